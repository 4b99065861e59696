"""``ColumnParallelLinear``: W split(1), each rank computes a block of the output features.

    x [M, K] whole        w_shard_n [N/R, K]     y_shard_n = x @ w_shard_n.T + b_shard_n     [M, N/R]
    dgrad                 dx = all_reduce(dy_shard_n @ w_shard_n), overlapping the dW matmul
    sequence parallel     y_shard_n = all_gather(x_shard_m) @ w_shard_n.T, around a ring (tpflow.ops)
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from tpflow import comm
from tpflow.global_tensor import from_local
from tpflow.kernels import linear
from tpflow.kernels.epilogue import accumulate_dtype
from tpflow.layers.layouts import Layouts, Side, sequence_splits
from tpflow.layers.linear import ParallelLinear
from tpflow.ops import all_gather_matmul
from tpflow.placement import Placement
from tpflow.sbp import Sbp, broadcast, split

__all__ = ["ColumnParallelLinear"]


class ColumnParallelLinear(ParallelLinear):
    """``y = x @ W + b`` with W split(1): each rank computes a block of the output features.

    Storage is ``nn.Linear``'s: ``weight`` [out, in] holds W.T, split along its dim 0 (Shard(0)),
    and ``bias`` is split the same way. A plain input is the whole x, the same on every rank
    (Megatron's convention: ``input_sbp=sbp.broadcast``); the output is this rank's block of features
    (``output_sbp=sbp.split(-1)``), or the whole y with ``output_sbp=sbp.broadcast``. With
    ``input_sbp=sbp.split(0)`` (sequence parallelism) the input is instead this rank's chunk of dim 0
    (the sequence), gathered on the fly by ``all_gather_matmul``; the weight gradient needs the
    gathered input, which is kept from the forward, or with ``keep_gathered=False`` gathered again in
    the backward (Megatron's choice: the layer then saves only its rows of the input, for (W-1)/W of
    the gathered input's bytes more per rank). A global input may have any layout; the output is
    split on its last dim (broadcast with ``output_sbp=sbp.broadcast``).

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
        input_sbp: the input's layout over the ranks: ``sbp.broadcast`` (the default: the whole input on every
            rank) or, for sequence parallelism, ``sbp.split(0)`` (a plain input of two or more dims is this rank's
            chunk of dim 0, the sequence in Megatron's ``[seq, batch, hidden]``) or ``sbp.split(1)`` (of dim 1,
            Hugging Face's ``[batch, seq, hidden]``), all-gathered into the product by ``all_gather_matmul``; the
            output then has the whole sequence.
        output_sbp: the output's layout over the ranks: ``sbp.split(-1)`` (the default: this rank's block of the
            features, which a ``RowParallelLinear`` takes as its input) or ``sbp.broadcast`` (the features
            all-gathered: the whole y on every rank).
        algo: how the sequence-parallel all-gather runs: ``"ring"`` (fused with the matmul around a ring),
            ``"naive"`` (the plain all-gather, then one matmul) or ``"auto"`` (the default: the ring from the
            ``ring_min_elements`` switch's count per message). Anything but ``"auto"`` needs sequence parallelism.
        keep_gathered: under sequence parallelism, keep the gathered input from the forward for the weight
            gradient (default True), or, with False, save only this rank's rows and gather them again in the
            backward (less memory, more bytes sent). False needs sequence parallelism.
        global_output: return the output of a plain input as a global tensor split over its last dim (on a 2-D
            placement, over this rank's tensor-parallel ranks), not as this rank's plain block: an output head's
            logits, which ``tpf.cross_entropy`` and ``F.cross_entropy`` under ``tpf.vocab_parallel_loss()`` then
            take without gathering them (default False). ``output_sbp=sbp.broadcast`` overrides it.
        gather_output: alias of ``output_sbp``: True is ``sbp.broadcast``, False ``sbp.split(-1)``.
        sequence_parallel, sequence_dim: aliases of ``input_sbp``: ``sequence_parallel=True, sequence_dim=d`` is
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
        >>> fc1.weight.shape, fc1.weight.to_local().shape     # global [out, in]; this rank's Shard(0) block
        (torch.Size([2048, 512]), torch.Size([1024, 512]))
        >>> x = torch.randn(8, 512)                           # the whole x on every rank
        >>> fc1(x).shape                                      # this rank's block of the 2048 features
        torch.Size([8, 1024])
        >>> whole = tpf.ColumnParallelLinear(512, 2048, placement=P, output_sbp=tpf.sbp.broadcast)
        >>> whole(x).shape
        torch.Size([8, 2048])
        >>> whole.gather_output                               # the older spelling, an alias
        True
        >>> sp = tpf.ColumnParallelLinear(512, 2048, placement=P, input_sbp=tpf.sbp.split(0), keep_gathered=False)
        >>> tokens = torch.randn(16, 2, 512)                  # [seq, batch, hidden]
        >>> sp(tokens.chunk(2)[tpf.get_rank()]).shape         # this rank's 8 tokens in, all 16 out
        torch.Size([16, 2, 1024])
    """

    _weight_split = 0
    layouts = Layouts(
        input_sbp=Side({broadcast: {"sequence_parallel": False}, **sequence_splits(sequence_parallel=True)},
                       "sbp.broadcast (the whole input) or, for sequence parallelism, sbp.split(0) / sbp.split(1) "
                       "(this rank's chunk of the sequence dim)"),
        output_sbp=Side({split(-1): {"gather_output": False}, broadcast: {"gather_output": True}},
                        "sbp.split(-1) (this rank's block of the output features) or sbp.broadcast (the features "
                        "gathered whole)"),
        defaults={"sequence_parallel": False, "sequence_dim": 0, "gather_output": False})

    @classmethod
    def _check_flags(cls, *, keep_gathered: bool = True, **options: object) -> None:
        if not keep_gathered and not options["sequence_parallel"]:
            raise ValueError("ColumnParallelLinear: keep_gathered=False gathers a sequence-parallel input again in "
                             "the backward: it needs input_sbp=sbp.split(0) or sbp.split(1) (sequence parallelism)")
        super()._check_flags(**options)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, placement: Placement,
                 input_sbp: Sbp | None = None, output_sbp: Sbp | None = None, algo: str = "auto",
                 keep_gathered: bool = True, global_output: bool = False, gather_output: bool | None = None,
                 sequence_parallel: bool | None = None, sequence_dim: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        flags = self.layouts.resolve(type(self).__name__, {
            "input_sbp": input_sbp, "output_sbp": output_sbp, "gather_output": gather_output,
            "sequence_parallel": sequence_parallel, "sequence_dim": sequence_dim}, fill=True)
        self.check_options(algo=algo, keep_gathered=keep_gathered, **flags)
        self.gather_output, self.sequence_dim = flags["gather_output"], flags["sequence_dim"]
        self.keep_gathered = keep_gathered
        self.fused_group = None  # the ColumnGroup computing this layer with its siblings (parallelize's fuse=True)
        super().__init__(in_features, out_features, bias, placement, flags["sequence_parallel"], algo, device, dtype)
        self.global_output = global_output
        self._output_placement = self._tp_placement() if global_output else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if self._output_placement is None or self.gather_output or isinstance(y, DTensor):
            return y
        # contiguous: code written for whole logits views them (HF's loss: logits.view(-1, vocab)), and a
        # batch-first sequence-parallel product comes back with its dims moved
        return from_local(y.contiguous(), self._output_placement, split(y.ndim - 1),
                          shape=(*y.shape[:-1], self.out_features), sync_data=False)

    def _bias_sbp(self) -> tuple[Sbp, ...]:
        return self._axes(split(0))

    def _input_tp_sbp(self, ndim: int) -> Sbp:
        return split(self.sequence_dim) if self.sequence_parallel and ndim > self.sequence_dim + 1 else broadcast

    def _takes_split(self, x: torch.Tensor) -> bool:
        return self._splits_sequence(x)

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
        return comm.gather_from_ranks(y, -1, self.out_features, self.group) if self.gather_output else y

    def product(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, rows: int | None) -> torch.Tensor:
        """``x @ w.T + b`` for weight and bias blocks ``w``, ``b`` with this layer's collectives: what a fused
        group runs over its members' blocks side by side.

        Args:
            x: the input's local block in the layer's layout.
            w, b: ``[n, in_features]`` and ``[n]`` (or None): blocks of one or more column layers.
            rows: the sequence dim's size before a sequence-parallel split (None: even chunks, checked).

        Returns:
            This rank's output features for ``w``'s rows.

        Example::

            >>> P = tpf.placement("cpu", ranks=[0, 1])
            >>> layer = tpf.ColumnParallelLinear(8, 6, placement=P)
            >>> x = torch.randn(2, 8)
            >>> y = layer.product(x, *layer.local_blocks(()), rows=None)
            >>> y.shape, torch.equal(y, layer(x))          # this rank's 3 of 6 features, as forward gives them
            (torch.Size([2, 3]), True)
        """
        group = self.group
        if group is None:
            return linear(x, w, b)
        if self._splits_sequence(x):
            d = self.sequence_dim  # the ring gathers dim 0: a batch-first input is read as [seq, batch, ...]
            y = all_gather_matmul(x.movedim(d, 0), w.mT, group, rows=rows, bias=b, algo=self.algo,
                                  keep_gathered=self.keep_gathered)
            return y.movedim(0, d)
        # dx's partial sums travel in fp32 at least
        return linear(x, w, b, dgrad_hook=lambda dx: comm.all_reduce(dx, group, async_op=True),
                      dgrad_dtype=accumulate_dtype(x.dtype))

    def extra_repr(self) -> str:
        fused = "" if self.fused_group is None else f", fused with {len(self.fused_group.layers) - 1} other layers"
        return (super().extra_repr() + (", gather_output" if self.gather_output else "")
                + (", global_output" if self.global_output else "")
                + ("" if self.keep_gathered else ", keep_gathered=False") + fused)
