"""What ColumnParallelLinear and RowParallelLinear share: ``nn.Linear`` with its weight split over a placement.

In the ``y = x @ W`` convention (W is in x out; ``nn.Linear`` stores ``weight = W.T``, out x in):

    ColumnParallelLinear   W split(1): rank r holds output features chunk(r)   weight Shard(0), bias Shard(0)
    RowParallelLinear      W split(0): rank r holds input features chunk(r)    weight Shard(1), bias Replicate

Forward and backward run on local shards, with the collectives in conjugate pairs:

    column            linear                      backward: all-reduce of dx, overlapping the dW matmul
    column, seq-par   x rows --all_gather_matmul  backward: reduce-scatter ring with dW folded in (or, with
                                                  keep_gathered=False, x gathered again with dW folded into
                                                  that ring, then the reduce-scatter ring)
    row               linear --all-reduce--> + b  backward: no collective
    row, seq-par      matmul_reduce_scatter       backward: all-gather ring with dW folded in

Column layers of one parent module that read one input can run as one product (``parallelize``'s
``fuse=True``, ``tpflow.layers.fused``): one collective for the group. On a placement of one rank
every collective is skipped. On a 2-D placement the tensor-parallel axis is the last one; the
others hold copies (data parallelism), whose gradients are partial sums over the data they saw,
reduced when read. Parameters are DTensors, so state dicts, ``torch.distributed.checkpoint`` and
optimizers see the global tensors.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tpflow.global_tensor import from_local, get_placement, get_sbp, to_global
from tpflow.global_tensor.blocks import off_placement
from tpflow.layers.layouts import Layouts
from tpflow.layers.regions import SPLIT, WHOLE, reads_split, tag
from tpflow.layers.sharded import ShardedModule
from tpflow.ops import ALGOS
from tpflow.placement import Placement
from tpflow.sbp import PartialSum, Sbp, Split, broadcast, local_region, split

__all__ = ["ParallelLinear"]


class ParallelLinear(ShardedModule, metaclass=ABCMeta):
    """What column and row layers share: a weight split over the last axis of a placement, read as local
    blocks on the hot path, ``nn.Linear``'s initialisation and state-dict layout.

    An abstract base: build a ``ColumnParallelLinear`` or a ``RowParallelLinear`` (or convert an ``nn.Linear``
    with their ``from_linear``); both take these options, as keywords after ``bias``. The parameters are drawn
    as ``nn.Linear`` draws them on one device for the same seed, then each rank keeps its block. The last axis
    of ``placement`` is the tensor-parallel one; the axes before it hold copies (data parallelism).

    Args:
        in_features, out_features: the whole layer's sizes (``nn.Linear``'s), not a rank's block of them;
            blocks of the split one follow ``torch.chunk``'s rule.
        bias: whether the layer has a bias.
        placement: the ranks the parameters live on (``tpf.placement``), 1-D or 2-D.
        input_sbp, output_sbp: the input's and the output's layouts over the tensor-parallel axis (``layouts``
            lists those each layer takes); the activation on the layer's sequence side (the column layer's input,
            the row layer's output) is ``split(0)`` or ``split(1)`` under sequence parallelism, its collective run
            with the matmul by ``tpflow.ops``. The older flags (``sequence_parallel``, ``sequence_dim``, ...) say
            the same, as aliases.
        algo: how sequence parallelism's collectives run: ``"ring"`` (fused into a ring that overlaps the
            matmul), ``"naive"`` (the plain collective, then one matmul) or ``"auto"`` (the ring from the
            ``ring_min_elements`` switch's count per message). Anything but ``"auto"`` needs
            sequence parallelism.
        device: where the parameters are made (default: the placement's device); its type must be the
            placement's.
        dtype: the parameters' dtype (default: torch's default dtype).

    Example::

        >>> import tpflow as tpf
        >>> from tpflow.layers import ParallelLinear
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> fc1 = tpf.ColumnParallelLinear(512, 2048, placement=P)
        >>> isinstance(fc1, ParallelLinear), fc1.group is not None   # a 2-rank tensor-parallel group
        (True, True)
    """

    _weight_split: int  # the dim of ``weight`` [out, in] split over the tensor-parallel axis
    layouts: Layouts  # the SBPs its input and output take, and the flags that are their aliases

    def __init__(self, in_features: int, out_features: int, bias: bool, placement: Placement,
                 sequence_parallel: bool, algo: str, device: torch.device | str | None,
                 dtype: torch.dtype | None) -> None:
        super().__init__(placement, device)
        self.algo = algo
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel = sequence_parallel
        self.label = f"{type(self).__name__}({in_features}, {out_features})"  # parallelize() names it by its path
        self._told = False  # whether the replicated modules behind a split input were told (regions.reads_split)
        # nn.Linear's init and RNG use
        full = nn.Linear(in_features, out_features, bias, device=device or placement.device, dtype=dtype)
        self._adopt(full.weight, full.bias)

    # layouts

    @abstractmethod
    def _bias_sbp(self) -> tuple[Sbp, ...]:
        """The bias's layout over the placement."""

    def _adopt(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Take whole (single-device) values as this layer's parameters: each rank keeps its block, and copies
        along broadcast axes are taken from the axis' first rank, so replicas agree even if ranks' values differ."""
        self.weight = self._parameter(weight, self._axes(split(self._weight_split)))
        if bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = self._parameter(bias, self._bias_sbp())

    def _splits_sequence(self, x: torch.Tensor) -> bool:
        """Whether sequence parallelism applies to ``x``: it has a sequence dim besides its features."""
        return self.sequence_parallel and x.ndim > self.sequence_dim + 1

    @classmethod
    def check_options(cls, **options: object) -> None:
        """Raise a ValueError naming the fix for options this layer cannot take, building nothing (``parallelize``'s
        entries check every match so before the model changes; the constructor checks the same).

        Args:
            options: the layer's keyword options (``input_sbp``, ``output_sbp``, ``algo``, ... or the flags that
                alias the SBPs), as its constructor takes them.

        Example::

            >>> tpf.ColumnParallelLinear.check_options(input_sbp=tpf.sbp.split(0), keep_gathered=False)
            >>> tpf.ColumnParallelLinear.check_options(input_sbp=tpf.sbp.partial_sum)  # doctest: +ELLIPSIS
            Traceback (most recent call last):
                ...
            ValueError: ColumnParallelLinear takes input_sbp=sbp.broadcast (the whole input) or..., got sbp.partial_sum
        """
        cls._check_flags(**cls.layouts.resolve(cls.__name__, options, fill=True))

    @classmethod
    def _check_flags(cls, *, sequence_parallel: bool, sequence_dim: int, algo: str = "auto",
                     **options: object) -> None:
        """``check_options`` on the flags the SBPs stand for; a subclass checks its own flags, then calls this."""
        if algo not in ALGOS:
            raise ValueError(f"algo must be one of {ALGOS} (the sequence-parallel collectives: fused into a ring "
                             f"that overlaps the matmul, the plain collective then the matmul, or by size), "
                             f"got {algo!r}")
        if algo != "auto" and not sequence_parallel:
            raise ValueError(f"algo={algo!r} chooses how sequence parallelism's collectives run: it needs "
                             "sequence_parallel=True")
        if sequence_dim not in (0, 1):
            raise ValueError(f"sequence_dim must be 0 ([seq, batch, hidden], Megatron's layout) or 1 ([batch, seq, "
                             f"hidden], Hugging Face's), got {sequence_dim!r}")
        if sequence_dim and not sequence_parallel:
            raise ValueError(f"sequence_dim={sequence_dim} says which dim sequence parallelism splits: it needs "
                             "sequence_parallel=True")

    def _local_features(self, size: int) -> int:
        start, end = self.local_range(size)
        return end - start

    def _check_features(self, x: torch.Tensor, want: int, what: str) -> None:
        if x.ndim == 0 or x.shape[-1] != want:
            raise ValueError(f"{self.label}: the input has {x.shape[-1] if x.ndim else 0} features in its last dim, "
                             f"but this layer expects {want} ({what})")

    @property
    def input_sbp(self) -> Sbp | None:
        """The input's layout over the tensor-parallel axis, as ``input_sbp=`` says it (read from the flags)."""
        return self.layouts.read(self)["input_sbp"]

    @property
    def output_sbp(self) -> Sbp | None:
        """The output's layout over the tensor-parallel axis, as ``output_sbp=`` says it (read from the flags)."""
        return self.layouts.read(self)["output_sbp"]

    # inputs and outputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, DTensor):
            return self._forward_global(x)
        if self._tp_rank is None:
            raise ValueError(f"{self.label}: rank {dist.get_rank()} is not in the layer's placement "
                             f"{self.placement.ranks}: call it only there, or pass a global tensor (ranks outside "
                             f"the placement then get an empty block)")
        data_split = (True,) * (self.placement.ndim - 1)
        if torch.compiler.is_compiling():  # nothing to tag in traced code, and no work after a fused group's break
            return self._forward_local(x, rows=None, data_split=data_split)
        if not self._told and torch.is_grad_enabled() and self._takes_split(x):
            reads_split(x)  # replicated modules behind a split input: once, on the first call with gradients
            self._told = True
        y = self._forward_local(x, rows=None, data_split=data_split)
        return tag(y, WHOLE if self._output_tp_sbp(x.ndim) == broadcast else SPLIT)

    @abstractmethod
    def _input_tp_sbp(self, ndim: int) -> Sbp:
        """The layout over the tensor-parallel axis that the layer computes on, for an input of ``ndim`` dims."""

    @abstractmethod
    def _takes_split(self, x: torch.Tensor) -> bool:
        """Whether a plain input ``x`` is this rank's part of the data (its tokens or its features)."""

    @abstractmethod
    def _output_tp_sbp(self, ndim: int) -> Sbp:
        """The output's layout over the tensor-parallel axis."""

    def _forward_global(self, x: DTensor) -> DTensor:
        """A global tensor in any layout: converted to the one the layer computes on; the result is global too."""
        pl, ndim = self.placement, x.ndim
        self._check_features(x, self.in_features, "the whole input features")  # the global shape: every rank agrees
        kept = get_sbp(x)[:-1] if get_placement(x) == pl else (broadcast,) * (pl.ndim - 1)
        kept = tuple(broadcast if isinstance(s, PartialSum) or s == Split(ndim - 1) else s for s in kept)
        want = kept + (self._input_tp_sbp(ndim),)
        if get_placement(x) != pl or get_sbp(x) != want:
            x = to_global(x, placement=pl, sbp=want)
        out_shape = (*x.shape[:-1], self.out_features)
        out_sbp = kept + (self._output_tp_sbp(ndim),)
        if self._tp_rank is None:  # outside the placement: an empty block, as DTensor has it
            trained = any(p.requires_grad for p in self.parameters())
            return off_placement(x, pl, out_sbp, out_shape, x.dtype, x.requires_grad or trained)
        coord = pl.coordinate()
        d = self.sequence_dim
        rows = local_region(x.shape, kept + (broadcast,), pl.hierarchy, coord)[1][d] if ndim > d + 1 else None
        data_split = tuple(isinstance(s, Split) for s in kept)
        y = self._forward_local(x.to_local(), rows=rows, data_split=data_split, from_global=True)
        return from_local(y, pl, out_sbp, shape=out_shape, sync_data=False)

    @abstractmethod
    def _forward_local(self, x: torch.Tensor, rows: int | None, data_split: tuple[bool, ...],
                       from_global: bool = False) -> torch.Tensor:
        """The layer on this rank's blocks. ``from_global``: x is a global input's block, already in the
        layer's layout, and ``rows`` its dim 0's size before the tensor-parallel split (None for 1-D);
        ``data_split`` says, per data-parallel axis, whether the input is split there."""

    def local_blocks(self, data_split: tuple[bool, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's weight and bias blocks, differentiable into the parameters' gradients.

        On the axes before the tensor-parallel one, each copy of a parameter sees its own rows of data when
        the input is split there, so its gradient is a partial sum (reduced when read, as OneFlow's data
        parallelism does); with a broadcast input it is whole.

        Args:
            data_split: per data-parallel axis, whether the input is split there.

        Returns:
            ``(weight block, bias block or None)``.

        Example::

            >>> P = tpf.placement("cpu", ranks=[0, 1])
            >>> layer = tpf.ColumnParallelLinear(8, 6, placement=P)
            >>> w, b = layer.local_blocks(data_split=())   # a 1-D placement: no data-parallel axis
            >>> w.shape, b.shape
            (torch.Size([3, 8]), torch.Size([3]))
        """
        params = (self.weight,) if self.bias is None else (self.weight, self.bias)
        blocks = self._local_blocks(params, data_split)
        return blocks[0], blocks[1] if len(blocks) > 1 else None

    @classmethod
    def from_linear(cls, module: nn.Linear, *, placement: Placement, **options) -> ParallelLinear:
        """This layer holding ``module``'s values (each rank keeps its block; no RNG is drawn).

        A module on the meta device (``tpf.meta_parameters()``) gives this rank's blocks allocated and not
        initialised, for ``tpf.load_safetensors`` to fill. Every rank must pass the same values (build or load the
        model the same on every rank); along the
        data-parallel axes of a 2-D placement the copies are taken from each axis' first rank.

        Args:
            module: the ``nn.Linear`` to convert; its sizes, bias and dtype are kept, and it is left unchanged.
            placement: the ranks the new layer lives on (``tpf.placement``).
            options: the layer's other keyword options (``input_sbp``, ``output_sbp``, ``algo``, ...).

        Returns:
            A new layer of this class on ``placement``.

        Example::

            >>> P = tpf.placement("cpu", ranks=[0, 1])
            >>> _ = torch.manual_seed(0)                   # the same module on every rank
            >>> fc1 = nn.Linear(16, 64)
            >>> layer = tpf.ColumnParallelLinear.from_linear(fc1, placement=P)
            >>> torch.equal(layer.weight.full_tensor(), fc1.weight), layer.weight.to_local().shape
            (True, torch.Size([32, 16]))
        """
        if not isinstance(module, nn.Linear):
            raise TypeError(f"from_linear takes an nn.Linear, got {type(module).__name__}")
        layer = cls(module.in_features, module.out_features, module.bias is not None, placement=placement,
                    dtype=module.weight.dtype, device="meta", **options)  # no whole init, no RNG drawn
        layer._adopt(module.weight, module.bias)
        return layer

    def extra_repr(self) -> str:
        tp = f"W split({1 - self._weight_split}), weight sbp {get_sbp(self.weight)}"
        where = "not on this rank" if self._tp_rank is None else \
            f"rank {dist.get_rank()} holds {tuple(self.weight.to_local().shape)} of weight {tuple(self.weight.shape)}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"placement={self.placement.type}:{self.placement.ranks}, {tp}, {where}"
                + (", sequence_parallel" if self.sequence_parallel else "")
                + (f", algo={self.algo!r}" if self.algo != "auto" else ""))
