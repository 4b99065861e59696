"""ColumnParallelLinear and RowParallelLinear: ``nn.Linear`` with its weight split over a placement.

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
from torch.distributed.tensor import DTensor, Partial, Replicate

from tpflow import comm
from tpflow.global_tensor import from_local, get_placement, get_sbp, gradients, tensor, to_global
from tpflow.global_tensor.blocks import off_placement
from tpflow.kernels import linear
from tpflow.kernels.epilogue import accumulate_dtype
from tpflow.layers.blocks import LocalBlocks
from tpflow.ops import ALGOS, all_gather_matmul, matmul_reduce_scatter
from tpflow.placement import Placement
from tpflow.sbp import PartialSum, Sbp, Split, broadcast, local_region, split

__all__ = ["ColumnParallelLinear", "ParallelLinear", "RowParallelLinear"]


def _grad_placements(p: DTensor, data_split: tuple[bool, ...]) -> tuple:
    """A parameter gradient's layout: partial over the data axes the input is split on, the parameter's own
    on the tensor-parallel axis."""
    return (*(Partial() if split_here else Replicate() for split_here in data_split), p.placements[-1])


class ParallelLinear(nn.Module, metaclass=ABCMeta):
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
        sequence_parallel: whether the activation on the layer's sequence side (the column layer's input,
            the row layer's output) is split over dim 0, the sequence, its collective run with the matmul
            by ``tpflow.ops``.
        algo: how sequence parallelism's collectives run: ``"ring"`` (fused into a ring that overlaps the
            matmul), ``"naive"`` (the plain collective, then one matmul) or ``"auto"`` (the ring from the
            ``ring_min_elements`` switch's count per message). Anything but ``"auto"`` needs
            ``sequence_parallel=True``.
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

    def __init__(self, in_features: int, out_features: int, bias: bool, placement: Placement,
                 sequence_parallel: bool, algo: str, device: torch.device | str | None,
                 dtype: torch.dtype | None) -> None:
        super().__init__()
        if not isinstance(placement, Placement):
            raise TypeError(f"placement must be a tpf.placement(type, ranks), got {placement!r}")
        if algo not in ALGOS:
            raise ValueError(f"algo must be one of {ALGOS} (the sequence-parallel collectives: fused into a ring "
                             f"that overlaps the matmul, the plain collective then the matmul, or by size), "
                             f"got {algo!r}")
        if algo != "auto" and not sequence_parallel:
            raise ValueError(f"algo={algo!r} chooses how sequence parallelism's collectives run: it needs "
                             "sequence_parallel=True")
        self.algo = algo
        device = torch.device(device) if device is not None else placement.device
        if device.type != placement.type:
            raise ValueError(f"device {device} does not match the placement's type {placement.type!r}")
        self.in_features, self.out_features = in_features, out_features
        self.placement, self.sequence_parallel = placement, sequence_parallel
        self.label = f"{type(self).__name__}({in_features}, {out_features})"  # parallelize() names it by its path
        coord = placement.coordinate()
        self._tp_size, self._tp_rank = placement.hierarchy[-1], None if coord is None else coord[-1]
        self._group = self._find_group()
        self._blocks = LocalBlocks()
        full = nn.Linear(in_features, out_features, bias, device=device, dtype=dtype)  # nn.Linear's init and RNG use
        self._adopt(full.weight, full.bias)

    # layouts

    def _axes(self, tp: Sbp) -> tuple[Sbp, ...]:
        return (broadcast,) * (self.placement.ndim - 1) + (tp,)

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

    def _parameter(self, value: torch.Tensor, sbp: tuple[Sbp, ...]) -> nn.Parameter:
        pl = self.placement
        block = tensor(value.detach().to(pl.device), placement=pl, sbp=sbp).to_local()
        synced = from_local(block, pl, sbp, shape=value.shape, sync_data=True).detach()
        return gradients.adopt(nn.Parameter(synced, requires_grad=value.requires_grad))

    def _find_group(self) -> dist.ProcessGroup | None:
        """The tensor-parallel axis' process group, looked up once: resolved lazily on the first forward, it
        would change the module during the first traced call, and torch.compile would recompile on the next."""
        if self._tp_size == 1 or self._tp_rank is None:
            return None
        return self.placement.mesh.get_group(self.placement.ndim - 1)

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The tensor-parallel process group (None on a single rank: nothing to communicate)."""
        return self._group

    def __getstate__(self) -> dict:
        """The process group is this process's handle: a copy (``copy.deepcopy``, pickle) looks it up again."""
        return {**self.__dict__, "_group": None}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._group = self._find_group()

    def _local_features(self, size: int) -> int:
        start, end = comm.bounds(size, self._tp_size)[self._tp_rank]
        return end - start

    def _check_features(self, x: torch.Tensor, want: int, what: str) -> None:
        if x.ndim == 0 or x.shape[-1] != want:
            raise ValueError(f"{self.label}: the input has {x.shape[-1] if x.ndim else 0} features in its last dim, "
                             f"but this layer expects {want} ({what})")

    # inputs and outputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, DTensor):
            return self._forward_global(x)
        if self._tp_rank is None:
            raise ValueError(f"{self.label}: rank {dist.get_rank()} is not in the layer's placement "
                             f"{self.placement.ranks}: call it only there, or pass a global tensor (ranks outside "
                             f"the placement then get an empty block)")
        return self._forward_local(x, rows=None, data_split=(True,) * (self.placement.ndim - 1))

    @abstractmethod
    def _input_tp_sbp(self, ndim: int) -> Sbp:
        """The layout over the tensor-parallel axis that the layer computes on, for an input of ``ndim`` dims."""

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
        rows = local_region(x.shape, kept + (broadcast,), pl.hierarchy, coord)[1][0] if ndim > 1 else None
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

            >>> w, b = layer.local_blocks(data_split=())  # doctest: +SKIP
        """
        params = (self.weight,) if self.bias is None else (self.weight, self.bias)
        blocks = self._blocks(params, data_split, lambda p: _grad_placements(p, data_split))
        return blocks[0], blocks[1] if len(blocks) > 1 else None

    @classmethod
    def from_linear(cls, module: nn.Linear, *, placement: Placement, **options) -> ParallelLinear:
        """This layer holding ``module``'s values (each rank keeps its block; no RNG is drawn).

        Every rank must pass the same values (build or load the model the same on every rank); along the
        data-parallel axes of a 2-D placement the copies are taken from each axis' first rank.

        Args:
            module: the ``nn.Linear`` to convert; its sizes, bias and dtype are kept, and it is left unchanged.
            placement: the ranks the new layer lives on (``tpf.placement``).
            options: the layer's other keyword options (``gather_output``, ``sequence_parallel``, ...).

        Returns:
            A new layer of this class on ``placement``.

        Example::

            >>> fc1 = tpf.ColumnParallelLinear.from_linear(nn.Linear(512, 2048), placement=P)  # doctest: +SKIP
        """
        if not isinstance(module, nn.Linear):
            raise TypeError(f"from_linear takes an nn.Linear, got {type(module).__name__}")
        with torch.random.fork_rng(devices=[placement.device] if placement.type == "cuda" else []):
            layer = cls(module.in_features, module.out_features, module.bias is not None, placement=placement,
                        dtype=module.weight.dtype, **options)
        layer._adopt(module.weight, module.bias)
        return layer

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """A single-device checkpoint (whole plain tensors) loads as is: each rank keeps its block."""
        for name in ("weight", "bias"):
            value, param = state_dict.get(prefix + name), getattr(self, name)
            if param is not None and isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
                    and value.shape == param.shape:  # a shape mismatch is left for torch to report
                state_dict[prefix + name] = tensor(value.to(param.dtype).to(self.placement.device),
                                                   placement=self.placement, sbp=get_sbp(param))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        tp = f"W split({1 - self._weight_split}), weight sbp {get_sbp(self.weight)}"
        where = "not on this rank" if self._tp_rank is None else \
            f"rank {dist.get_rank()} holds {tuple(self.weight.to_local().shape)} of weight {tuple(self.weight.shape)}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"placement={self.placement.type}:{self.placement.ranks}, {tp}, {where}"
                + (", sequence_parallel" if self.sequence_parallel else "")
                + (f", algo={self.algo!r}" if self.algo != "auto" else ""))


class ColumnParallelLinear(ParallelLinear):
    """``y = x @ W + b`` with W split(1): each rank computes a block of the output features.

    Storage is ``nn.Linear``'s: ``weight`` [out, in] holds W.T, split along its dim 0 (Shard(0)),
    and ``bias`` is split the same way. A plain input is the whole x, the same on every rank
    (Megatron's convention); the output is this rank's block of features, or the whole y with
    ``gather_output``. With ``sequence_parallel`` the input is instead this rank's chunk of dim 0
    (the sequence), gathered on the fly by ``all_gather_matmul``; the weight gradient needs the
    gathered input, which is kept from the forward, or with ``keep_gathered=False`` gathered again in
    the backward (Megatron's choice: the layer then saves only its rows of the input, for (W-1)/W of
    the gathered input's bytes more per rank). A global input may have any layout; the output is
    split on its last dim (broadcast with ``gather_output``).

    Without sequence parallelism the forward is one local matmul and the backward all-reduces the input's
    gradient while the weight's gradient computes; with it, the input's gather runs around a ring fused with
    the matmul, and the backward reduce-scatters the input's gradient. ``parallelize``'s ``"column"`` entry
    (``tpf.ColumnParallel``) builds this layer from a model's ``nn.Linear``.

    Args:
        in_features: the size of each input sample, whole on every rank.
        out_features: the size of each output sample over all ranks; rank r holds and computes
            ``torch.chunk``'s block r of these features.
        bias: whether the layer has a bias (default True), split over the ranks like the output features.
        placement: the ranks the layer lives on (``tpf.placement``). On a 2-D placement the last axis is
            tensor parallel and the axes before it hold copies (data parallelism), whose parameter gradients
            are partial sums reduced when read.
        gather_output: all-gather the output's features, so that every rank gets the whole y instead of its
            block (default False: the block, which a ``RowParallelLinear`` takes as its input).
        sequence_parallel: a plain input of two or more dims is this rank's chunk of dim 0 (the sequence, in
            Megatron's ``[seq, batch, hidden]`` layout), all-gathered into the product by ``all_gather_matmul``;
            the output then has the whole dim 0 (default False: the whole input on every rank).
        algo: how the sequence-parallel all-gather runs: ``"ring"`` (fused with the matmul around a ring),
            ``"naive"`` (the plain all-gather, then one matmul) or ``"auto"`` (the default: the ring from the
            ``ring_min_elements`` switch's count per message). Anything but ``"auto"`` needs
            ``sequence_parallel=True``.
        keep_gathered: with ``sequence_parallel``, keep the gathered input from the forward for the weight
            gradient (default True), or, with False, save only this rank's rows and gather them again in the
            backward (less memory, more bytes sent). False needs ``sequence_parallel=True``.
        device: where the parameters are made (default: the placement's device); its type must be the
            placement's.
        dtype: the parameters' dtype (default: torch's default dtype).

    Example::

        >>> import torch
        >>> import tpflow as tpf
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)                          # the same parameters and x on every rank
        >>> fc1 = tpf.ColumnParallelLinear(512, 2048, placement=P)
        >>> fc1.weight.shape, fc1.weight.to_local().shape     # global [out, in]; this rank's Shard(0) block
        (torch.Size([2048, 512]), torch.Size([1024, 512]))
        >>> x = torch.randn(8, 512)                           # the whole x on every rank
        >>> fc1(x).shape                                      # this rank's block of the 2048 features
        torch.Size([8, 1024])
        >>> whole = tpf.ColumnParallelLinear(512, 2048, placement=P, gather_output=True)
        >>> whole(x).shape
        torch.Size([8, 2048])
        >>> sp = tpf.ColumnParallelLinear(512, 2048, placement=P, sequence_parallel=True, keep_gathered=False)
        >>> tokens = torch.randn(16, 2, 512)                  # [seq, batch, hidden]
        >>> sp(tokens.chunk(2)[tpf.get_rank()]).shape         # this rank's 8 tokens in, all 16 out
        torch.Size([16, 2, 1024])
    """

    _weight_split = 0

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, placement: Placement,
                 gather_output: bool = False, sequence_parallel: bool = False, algo: str = "auto",
                 keep_gathered: bool = True, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        if not keep_gathered and not sequence_parallel:
            raise ValueError("ColumnParallelLinear: keep_gathered=False gathers a sequence-parallel input again in "
                             "the backward: it needs sequence_parallel=True")
        self.gather_output, self.keep_gathered = gather_output, keep_gathered
        self.fused_group = None  # the ColumnGroup computing this layer with its siblings (parallelize's fuse=True)
        super().__init__(in_features, out_features, bias, placement, sequence_parallel, algo, device, dtype)

    def _bias_sbp(self) -> tuple[Sbp, ...]:
        return self._axes(split(0))

    def _input_tp_sbp(self, ndim: int) -> Sbp:
        return split(0) if self.sequence_parallel and ndim > 1 else broadcast

    def _output_tp_sbp(self, ndim: int) -> Sbp:
        return broadcast if self.gather_output else split(ndim - 1)

    def _forward_local(self, x: torch.Tensor, rows: int | None, data_split: tuple[bool, ...],
                       from_global: bool = False) -> torch.Tensor:
        self._check_features(x, self.in_features, "the whole input features")
        if self.fused_group is not None and not from_global:
            # under torch.compile the group runs eagerly between graphs: its pending outputs are Python state
            # keyed by tensor identity, and dynamo cannot trace DTensor blocks that share a storage ("Attempted
            # to set the storage of a tensor ... to a storage on different device meta", torch 2.13)
            output = torch.compiler.disable(self.fused_group.output) if torch.compiler.is_compiling() \
                else self.fused_group.output
            return output(self, x, data_split)
        y = self.product(x, *self.local_blocks(data_split), rows)
        return comm.gather(y, -1, self.out_features, self.group) if self.gather_output else y

    def product(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, rows: int | None) -> torch.Tensor:
        """``x @ w.T + b`` for weight and bias blocks ``w``, ``b`` with this layer's collectives: what a fused
        group runs over its members' blocks side by side.

        Args:
            x: the input's local block in the layer's layout.
            w, b: ``[n, in_features]`` and ``[n]`` (or None): blocks of one or more column layers.
            rows: dim 0's size before a sequence-parallel split (None: even chunks, checked).

        Returns:
            This rank's output features for ``w``'s rows.

        Example::

            >>> y = layer.product(x, *layer.local_blocks(()), rows=None)  # doctest: +SKIP
        """
        group = self.group
        if group is None:
            return linear(x, w, b)
        if self.sequence_parallel and x.ndim > 1:
            return all_gather_matmul(x, w.mT, group, rows=rows, bias=b, algo=self.algo,
                                     keep_gathered=self.keep_gathered)
        # dx's partial sums travel in fp32 at least
        return linear(x, w, b, dgrad_hook=lambda dx: comm.all_reduce(dx, group, async_op=True),
                      dgrad_dtype=accumulate_dtype(x.dtype))

    def extra_repr(self) -> str:
        fused = "" if self.fused_group is None else f", fused with {len(self.fused_group.layers) - 1} other layers"
        return (super().extra_repr() + (", gather_output" if self.gather_output else "")
                + ("" if self.keep_gathered else ", keep_gathered=False") + fused)


class RowParallelLinear(ParallelLinear):
    """``y = x @ W + b`` with W split(0): each rank multiplies its block of input features.

    Storage is ``nn.Linear``'s: ``weight`` [out, in] holds W.T, split along its dim 1 (Shard(1));
    ``bias`` is whole on every rank and added once, after the partial products are summed. A plain
    input is this rank's block of features (``input_is_parallel``, the output of a column layer),
    or the whole x with ``input_is_parallel=False``. The output is the whole y on every rank; with
    ``sequence_parallel`` it is this rank's chunk of dim 0 instead, reduce-scattered by
    ``matmul_reduce_scatter`` (a plain input's dim 0 must then split evenly).

    Without sequence parallelism the partial products are all-reduced (in fp32 at least) and the backward
    needs no collective; with it, the reduce-scatter runs around a ring fused with the matmul, and the
    backward all-gathers the output's gradient. A global input may have any layout; the output is broadcast
    (split on dim 0 with ``sequence_parallel``). ``parallelize``'s ``"row"`` entry (``tpf.RowParallel``)
    builds this layer from a model's ``nn.Linear``.

    Args:
        in_features: the size of each input sample over all ranks; rank r holds ``torch.chunk``'s block r of
            these features (the weight's columns).
        out_features: the size of each output sample, whole on every rank.
        bias: whether the layer has a bias (default True), whole on every rank.
        placement: the ranks the layer lives on (``tpf.placement``). On a 2-D placement the last axis is
            tensor parallel and the axes before it hold copies (data parallelism), whose parameter gradients
            are partial sums reduced when read.
        input_is_parallel: a plain input is this rank's block of the input features, as a
            ``ColumnParallelLinear`` returns it (default True); with False it is the whole x, the same on every
            rank, and each rank takes its block (no transfer forward, an all-gather of its gradient backward).
        sequence_parallel: the output of a plain input of two or more dims is this rank's chunk of dim 0 (the
            sequence), reduce-scattered by ``matmul_reduce_scatter`` (default False: the whole y). Needs
            ``input_is_parallel=True``, and a plain input's dim 0 must be a multiple of the ranks.
        algo: how the sequence-parallel reduce-scatter runs: ``"ring"`` (fused with the matmul around a
            ring), ``"naive"`` (one matmul, then the plain reduce-scatter) or ``"auto"`` (the default: the
            ring from the ``ring_min_elements`` switch's count per message). Anything but ``"auto"`` needs
            ``sequence_parallel=True``.
        device: where the parameters are made (default: the placement's device); its type must be the
            placement's.
        dtype: the parameters' dtype (default: torch's default dtype).

    Example::

        >>> import torch
        >>> import tpflow as tpf
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)                          # the same parameters and x on every rank
        >>> fc1 = tpf.ColumnParallelLinear(512, 2048, placement=P)
        >>> fc2 = tpf.RowParallelLinear(2048, 512, placement=P)
        >>> fc2.weight.to_local().shape                       # this rank's Shard(1) block of [512, 2048]
        torch.Size([512, 1024])
        >>> x = torch.randn(8, 512)
        >>> fc2(torch.relu(fc1(x))).shape                     # one all-reduce, in fc2: the whole y everywhere
        torch.Size([8, 512])
        >>> whole_in = tpf.RowParallelLinear(2048, 512, placement=P, input_is_parallel=False)
        >>> whole_in(torch.randn(8, 2048)).shape
        torch.Size([8, 512])
        >>> sp1 = tpf.ColumnParallelLinear(512, 2048, placement=P, sequence_parallel=True)
        >>> sp2 = tpf.RowParallelLinear(2048, 512, placement=P, sequence_parallel=True, algo="ring")
        >>> tokens = torch.randn(16, 2, 512).chunk(2)[tpf.get_rank()]   # this rank's 8 of 16 tokens
        >>> sp2(torch.relu(sp1(tokens))).shape                # back to this rank's tokens
        torch.Size([8, 2, 512])
    """

    _weight_split = 1

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, placement: Placement,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, algo: str = "auto",
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True (its input is the "
                             "feature-split output of a column layer)")
        self.input_is_parallel = input_is_parallel
        super().__init__(in_features, out_features, bias, placement, sequence_parallel, algo, device, dtype)

    def _bias_sbp(self) -> tuple[Sbp, ...]:
        return self._axes(broadcast)

    def _input_tp_sbp(self, ndim: int) -> Sbp:
        return split(ndim - 1)

    def _output_tp_sbp(self, ndim: int) -> Sbp:
        return split(0) if self.sequence_parallel and ndim > 1 else broadcast

    def _forward_local(self, x: torch.Tensor, rows: int | None, data_split: tuple[bool, ...],
                       from_global: bool = False) -> torch.Tensor:
        group = self.group
        if self.input_is_parallel or from_global:  # a global input arrives already split
            self._check_features(x, self._local_features(self.in_features),
                                 f"this rank's block of the {self.in_features} input features")
        else:
            self._check_features(x, self.in_features, "the whole input features")
            x = comm.scatter(x, -1, group)
        w, b = self.local_blocks(data_split)
        if group is None:
            return linear(x, w, b)
        if self.sequence_parallel and x.ndim > 1:
            if not from_global and x.shape[0] % self._tp_size:
                raise ValueError(f"{self.label}: sequence parallelism splits dim 0 of the input over "
                                 f"{self._tp_size} ranks, but it has {x.shape[0]} rows: pad it to a multiple of "
                                 f"{self._tp_size}, or pass a global tensor (uneven chunks are fine there)")
            return matmul_reduce_scatter(x, w.mT, group, bias=b, algo=self.algo)
        # partial sums travel in fp32 at least
        y = comm.reduce(linear(x, w, out_dtype=accumulate_dtype(x.dtype)), group)
        return (y if b is None else y.add_(b)).to(x.dtype)  # the reduced sum is this layer's own: add in place

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.input_is_parallel else ", input_is_parallel=False")
