"""``RowParallelLinear``: W split(0), each rank multiplies its block of the input features.

    x_shard_k [M, K/R]    w_shard_k [N, K/R]     y = all_reduce(x_shard_k @ w_shard_k.T) + b    [M, N]
    dgrad                 dx_shard_k = dy @ w_shard_k: no collective
    sequence parallel     y_shard_m = reduce_scatter(x_shard_k @ w_shard_k.T) + b, around a ring (tpflow.ops)
"""

from __future__ import annotations

import torch

from tpflow import comm
from tpflow.kernels import linear
from tpflow.kernels.epilogue import accumulate_dtype
from tpflow.layers.layouts import Layouts, Side, sequence_splits
from tpflow.layers.linear import ParallelLinear
from tpflow.ops import matmul_reduce_scatter
from tpflow.placement import Placement
from tpflow.sbp import Sbp, broadcast, split

__all__ = ["RowParallelLinear"]


class RowParallelLinear(ParallelLinear):
    """``y = x @ W + b`` with W split(0): each rank multiplies its block of input features.

    Storage is ``nn.Linear``'s: ``weight`` [out, in] holds W.T, split along its dim 1 (Shard(1));
    ``bias`` is whole on every rank and added once, after the partial products are summed. A plain
    input is this rank's block of features (``input_sbp=sbp.split(-1)``, the output of a column layer),
    or the whole x with ``input_sbp=sbp.broadcast``. The output is the whole y on every rank
    (``output_sbp=sbp.broadcast``); with ``output_sbp=sbp.split(0)`` (sequence parallelism) it is this
    rank's chunk of dim 0 instead, reduce-scattered by ``matmul_reduce_scatter`` (a plain input's dim 0
    must then split evenly).

    Without sequence parallelism the partial products are all-reduced (in fp32 at least) and the backward
    needs no collective; with it, the reduce-scatter runs around a ring fused with the matmul, and the
    backward all-gathers the output's gradient. A global input may have any layout; the output is broadcast
    (split on the sequence dim under sequence parallelism). ``parallelize``'s ``"row"`` entry (``tpf.RowParallel``)
    builds this layer from a model's ``nn.Linear``.

    Args:
        in_features: the size of each input sample over all ranks; rank r holds ``torch.chunk``'s block r of
            these features (the weight's columns).
        out_features: the size of each output sample, whole on every rank.
        bias: whether the layer has a bias (default True), whole on every rank.
        placement: the ranks the layer lives on (``tpf.placement``). On a 2-D placement the last axis is
            tensor parallel and the axes before it hold copies (data parallelism), whose parameter gradients
            are partial sums reduced when read.
        input_sbp: the input's layout over the ranks: ``sbp.split(-1)`` (the default: a plain input is this rank's
            block of the input features, as a ``ColumnParallelLinear`` returns it) or ``sbp.broadcast`` (the whole
            x, the same on every rank; each rank takes its block: no transfer forward, an all-gather of its
            gradient backward).
        output_sbp: the output's layout over the ranks: ``sbp.broadcast`` (the default: the whole y, all-reduced)
            or, for sequence parallelism, ``sbp.split(0)`` / ``sbp.split(1)`` (the output of a plain input of two
            or more dims is this rank's chunk of that dim, the sequence in Megatron's ``[seq, batch, hidden]`` /
            Hugging Face's ``[batch, seq, hidden]``, reduce-scattered by ``matmul_reduce_scatter``; that dim of a
            plain input must be a multiple of the ranks). Needs ``input_sbp=sbp.split(-1)``.
        algo: how the sequence-parallel reduce-scatter runs: ``"ring"`` (fused with the matmul around a
            ring), ``"naive"`` (one matmul, then the plain reduce-scatter) or ``"auto"`` (the default: the
            ring from the ``ring_min_elements`` switch's count per message). Anything but ``"auto"`` needs
            sequence parallelism.
        input_is_parallel: alias of ``input_sbp``: True is ``sbp.split(-1)``, False ``sbp.broadcast``.
        sequence_parallel, sequence_dim: aliases of ``output_sbp``: ``sequence_parallel=True, sequence_dim=d`` is
            ``sbp.split(d)``, False is ``sbp.broadcast``.
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
        >>> whole_in = tpf.RowParallelLinear(2048, 512, placement=P, input_sbp=tpf.sbp.broadcast)
        >>> whole_in(torch.randn(8, 2048)).shape
        torch.Size([8, 512])
        >>> whole_in.input_is_parallel                        # the older spelling, an alias
        False
        >>> sp1 = tpf.ColumnParallelLinear(512, 2048, placement=P, input_sbp=tpf.sbp.split(0))
        >>> sp2 = tpf.RowParallelLinear(2048, 512, placement=P, output_sbp=tpf.sbp.split(0), algo="ring")
        >>> tokens = torch.randn(16, 2, 512).chunk(2)[tpf.get_rank()]   # this rank's 8 of 16 tokens
        >>> sp2(torch.relu(sp1(tokens))).shape                # back to this rank's tokens
        torch.Size([8, 2, 512])
    """

    _weight_split = 1
    layouts = Layouts(
        input_sbp=Side({split(-1): {"input_is_parallel": True}, broadcast: {"input_is_parallel": False}},
                       "sbp.split(-1) (this rank's block of the input features) or sbp.broadcast (the whole "
                       "input)"),
        output_sbp=Side({broadcast: {"sequence_parallel": False}, **sequence_splits(sequence_parallel=True)},
                        "sbp.broadcast (the whole output, all-reduced) or, for sequence parallelism, sbp.split(0) / "
                        "sbp.split(1) (this rank's chunk of the sequence dim, reduce-scattered)"),
        defaults={"input_is_parallel": True, "sequence_parallel": False, "sequence_dim": 0})

    @classmethod
    def _check_flags(cls, *, input_is_parallel: bool, **options: object) -> None:
        if options["sequence_parallel"] and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True: a sequence-parallel "
                             "output (output_sbp=sbp.split(0) or sbp.split(1)) takes input_sbp=sbp.split(-1), the "
                             "feature-split output of a column layer")
        super()._check_flags(**options)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, placement: Placement,
                 input_sbp: Sbp | None = None, output_sbp: Sbp | None = None, algo: str = "auto",
                 input_is_parallel: bool | None = None, sequence_parallel: bool | None = None,
                 sequence_dim: int | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        flags = self.layouts.resolve(type(self).__name__, {
            "input_sbp": input_sbp, "output_sbp": output_sbp, "input_is_parallel": input_is_parallel,
            "sequence_parallel": sequence_parallel, "sequence_dim": sequence_dim}, fill=True)
        self.check_options(algo=algo, **flags)
        self.input_is_parallel, self.sequence_dim = flags["input_is_parallel"], flags["sequence_dim"]
        super().__init__(in_features, out_features, bias, placement, flags["sequence_parallel"], algo, device, dtype)

    def _bias_sbp(self) -> tuple[Sbp, ...]:
        return self._axes(broadcast)

    def _input_tp_sbp(self, ndim: int) -> Sbp:
        return split(ndim - 1)

    def _takes_split(self, x: torch.Tensor) -> bool:
        return self.input_is_parallel

    def _output_tp_sbp(self, ndim: int) -> Sbp:
        return split(self.sequence_dim) if self.sequence_parallel and ndim > self.sequence_dim + 1 else broadcast

    def _forward_local(self, x: torch.Tensor, rows: int | None, data_split: tuple[bool, ...],
                       from_global: bool = False) -> torch.Tensor:
        group = self.group
        if self.input_is_parallel or from_global:  # a global input arrives already split
            self._check_features(x, self._local_features(self.in_features),
                                 f"this rank's block of the {self.in_features} input features")
        else:
            self._check_features(x, self.in_features, "the whole input features")
            x = comm.scatter_to_ranks(x, -1, group)
        w, b = self.local_blocks(data_split)
        if group is None:
            return linear(x, w, b)
        if self._splits_sequence(x):
            d = self.sequence_dim
            if not from_global and x.shape[d] % self._tp_size:
                raise ValueError(f"{self.label}: sequence parallelism splits dim {d} of the input over "
                                 f"{self._tp_size} ranks, but it has {x.shape[d]} rows: pad it to a multiple of "
                                 f"{self._tp_size}, or pass a global tensor (uneven chunks are fine there)")
            # the ring scatters dim 0: a batch-first input is read as [seq, batch, ...]
            return matmul_reduce_scatter(x.movedim(d, 0), w.mT, group, bias=b, algo=self.algo).movedim(0, d)
        # partial sums travel in fp32 at least
        y = comm.reduce_from_ranks(linear(x, w, out_dtype=accumulate_dtype(x.dtype)), group)
        return (y if b is None else y.add_(b)).to(x.dtype)  # the reduced sum is this layer's own: add in place

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.input_is_parallel else ", input_is_parallel=False")
