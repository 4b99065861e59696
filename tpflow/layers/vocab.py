"""The vocabulary split over the ranks: the embedding, and the output head's loss without its logits.

    VocabParallelEmbedding   weight [V, H] split(0): rank r holds the rows of ids [start_r, end_r)
                             y = sum over ranks of (embedding of the ids in range, 0 elsewhere)
                             -- an all-reduce, or a reduce-scatter straight into a sequence-parallel layout
    linear_cross_entropy     the head's logits made chunk by chunk and consumed at once by the
                             vocabulary-parallel loss (``tpflow.ops.linear_cross_entropy``)

A column-parallel head (``ColumnParallelLinear``, weight ``[V, H]`` Shard(0)) holds the same block of the
same matrix as the embedding, so a tied pair stays one parameter (``parallelize`` ties them).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from tpflow import comm
from tpflow.layers.column import ColumnParallelLinear
from tpflow.layers.layouts import Layouts, Side, sequence_splits
from tpflow.layers.regions import SPLIT, WHOLE, tag
from tpflow.layers.sharded import ShardedModule
from tpflow.ops import cross_entropy as ops_ce
from tpflow.placement import Placement
from tpflow.sbp import Sbp, broadcast, chunk_bounds, split

__all__ = ["HeadBlocks", "VocabParallelEmbedding", "head_blocks", "linear_cross_entropy", "ranks_without_rows"]


def ranks_without_rows(rows: int, ranks: int) -> list[int]:
    """The ranks ``torch.chunk``'s blocks leave no row of ``rows`` (9 over 4 ranks: 3 each, the last none), which a
    vocabulary-parallel embedding refuses: such a rank could look up nothing.

    Args:
        rows: the vocabulary's size.
        ranks: the tensor-parallel ranks.

    Returns:
        Those ranks, in order (empty when every rank holds rows).

    Example::

        >>> ranks_without_rows(9, 4), ranks_without_rows(101, 4)
        ([3], [])
    """
    return [r for r, (start, end) in enumerate(chunk_bounds(rows, ranks)) if start == end]


class VocabParallelEmbedding(ShardedModule, nn.Embedding):
    """``nn.Embedding`` with its rows (the vocabulary) split over the ranks: each rank looks up the ids in its
    range, and the ranks' outputs are summed.

    ``weight`` is ``[num_embeddings, embedding_dim]``, split along dim 0 (Shard(0), ``torch.chunk``'s blocks: an
    uneven vocabulary is fine), the same block a column-parallel head of the same matrix holds. The input ids are
    whole on every rank (a plain tensor, or a global one); ids outside this rank's range look up nothing, so
    the outputs add up to one device's. The sum is an all-reduce (every rank gets the whole output), or with
    ``output_sbp=sbp.split(d)`` a reduce-scatter that leaves each rank its chunk of the sequence dim d, as the next
    sequence-parallel region takes it. The weight's gradient is this rank's rows of one device's.

    It is an ``nn.Embedding`` (same attributes, ``padding_idx`` handled the same: that row gets no gradient), so
    code that looks for one finds it; ``from_embedding`` keeps a subclass's own forward around the lookup (a
    scaled embedding's ``* embed_scale``).

    Args:
        num_embeddings: the vocabulary's size over all ranks.
        embedding_dim: the size of each embedding vector.
        padding_idx: an id whose row gets no gradient (as ``nn.Embedding``'s; negative counts from the end).
        placement: the ranks the rows are split over (``tpf.placement``); on a 2-D placement the last axis is
            tensor parallel and the others hold copies.
        output_sbp: the output's layout over the ranks: ``sbp.broadcast`` (the default: all-reduced, whole on every
            rank) or, for sequence parallelism, ``sbp.split(0)`` / ``sbp.split(1)`` (reduce-scattered along that
            dim, the sequence of ``[seq, batch, hidden]`` / ``[batch, seq, hidden]``, which must split evenly over
            the ranks).
        sequence_parallel, sequence_dim: aliases of ``output_sbp``: ``sequence_parallel=True, sequence_dim=d`` is
            ``sbp.split(d)``, False is ``sbp.broadcast``.
        device: where the parameters are made (default: the placement's device).
        dtype: the weight's dtype (default: torch's default dtype).

    Example::

        >>> import torch
        >>> import tpflow as tpf
        >>> from tpflow.layers import VocabParallelEmbedding
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)                        # the same weights on every rank
        >>> emb = VocabParallelEmbedding(101, 16, placement=P)
        >>> emb.weight.shape, emb.weight.to_local().shape   # on rank 0: ids [0, 51); rank 1 holds [51, 101)
        (torch.Size([101, 16]), torch.Size([51, 16]))
        >>> emb(torch.tensor([[0, 100, 50]])).shape         # the whole output on every rank
        torch.Size([1, 3, 16])
    """

    _embedding_class: type[nn.Embedding] | None = None  # the subclass a mixed class runs around this one
    layouts = Layouts(  # the SBPs its output takes, and the flags that are their aliases
        output_sbp=Side({broadcast: {"sequence_parallel": False}, **sequence_splits(sequence_parallel=True)},
                        "sbp.broadcast (the whole output, all-reduced) or, for sequence parallelism, sbp.split(0) / "
                        "sbp.split(1) (this rank's chunk of the sequence dim, reduce-scattered)"),
        defaults={"sequence_parallel": False, "sequence_dim": 0})

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, *,
                 placement: Placement, output_sbp: Sbp | None = None, sequence_parallel: bool | None = None,
                 sequence_dim: int | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        ShardedModule.__init__(self, placement, device)
        flags = self.layouts.resolve(type(self).__name__, {"output_sbp": output_sbp, "sequence_dim": sequence_dim,
                                                            "sequence_parallel": sequence_parallel}, fill=True)
        sequence_parallel, sequence_dim = flags["sequence_parallel"], flags["sequence_dim"]
        _check_sequence_dim(sequence_dim)
        empty = ranks_without_rows(num_embeddings, self._tp_size)
        if empty:
            raise ValueError(f"a vocabulary of {num_embeddings} rows over {self._tp_size} ranks leaves ranks {empty} "
                             f"no rows (torch.chunk's blocks): use fewer tensor-parallel ranks")
        full = nn.Embedding(num_embeddings, embedding_dim, padding_idx, device=device or placement.device,
                            dtype=dtype)  # nn.Embedding's init and RNG use, and its padding_idx rules
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, full.padding_idx
        self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse = None, 2.0, False, False
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.weight = self._parameter(full.weight, self._axes(split(0)))

    @classmethod
    def check_embedding(cls, module: nn.Module, **options: object) -> None:
        """Raise, naming the fix, unless ``from_embedding`` can convert ``module`` with these options; builds nothing
        (``parallelize``'s vocabulary entries check every match so before the model changes).

        Args:
            module: the embedding to convert.
            options: ``output_sbp`` (or its aliases ``sequence_parallel``, ``sequence_dim``), as the layer takes it.

        Example::

            >>> VocabParallelEmbedding.check_embedding(nn.Embedding(101, 16, max_norm=1.0))  # doctest: +ELLIPSIS
            Traceback (most recent call last):
                ...
            ValueError: Embedding has max_norm=1.0, which needs the whole table on one rank: ...
        """
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"from_embedding takes an nn.Embedding, got {type(module).__name__}")
        for name, plain in (("max_norm", None), ("scale_grad_by_freq", False), ("sparse", False)):
            if getattr(module, name) != plain:
                raise ValueError(f"{type(module).__name__} has {name}={getattr(module, name)!r}, which needs the whole "
                                 f"table on one rank: a vocabulary-parallel embedding takes {name}={plain!r}")
        _check_sequence_dim(cls.layouts.resolve(cls.__name__, options, fill=True)["sequence_dim"])

    @classmethod
    def from_embedding(cls, module: nn.Embedding, *, placement: Placement, **options) -> VocabParallelEmbedding:
        """This layer holding ``module``'s values (each rank keeps its rows; no RNG is drawn).

        A module on the meta device gives this rank's rows allocated and not initialised (for
        ``tpf.load_safetensors``). A subclass of ``nn.Embedding`` (a scaled embedding) becomes a subclass of both,
        whose own forward runs around this layer's lookup, with its buffers, submodules and attributes kept.

        Args:
            module: the ``nn.Embedding`` to convert (left unchanged); ``max_norm``, ``scale_grad_by_freq`` and
                ``sparse`` are refused, since each needs the whole table.
            placement: the ranks the rows are split over.
            options: ``output_sbp`` (or its aliases ``sequence_parallel``, ``sequence_dim``).

        Returns:
            The vocabulary-parallel embedding.

        Example::

            >>> P = tpf.placement("cpu", ranks=[0, 1])
            >>> _ = torch.manual_seed(0)                       # the same embedding on every rank
            >>> plain = nn.Embedding(101, 16)
            >>> emb = VocabParallelEmbedding.from_embedding(plain, placement=P)
            >>> torch.equal(emb.weight.full_tensor(), plain.weight), isinstance(emb, nn.Embedding)
            (True, True)
        """
        cls.check_embedding(module, **options)
        kind = cls if type(module) is nn.Embedding else _mixed(type(module))
        layer = kind.__new__(kind)
        cls.__init__(layer, module.num_embeddings, module.embedding_dim, module.padding_idx, placement=placement,
                     dtype=module.weight.dtype, device="meta", **options)  # no whole init, no RNG drawn
        for name, value in vars(module).items():  # a subclass's own attributes (embed_scale's float)
            if not name.startswith("_") and name not in vars(layer):
                setattr(layer, name, value)
        for name, buffer in module.named_buffers(recurse=False):
            layer.register_buffer(name, buffer, persistent=name not in module._non_persistent_buffers_set)
        for name, child in module.named_children():  # a subclass's own modules (Inkling 2's embed_norm)
            layer.add_module(name, child)
        layer.weight = layer._parameter(module.weight, layer._axes(split(0)))
        return layer

    def __reduce_ex__(self, protocol: int):
        """A mixed class (``from_embedding`` of a subclass) is made at run time: a copy or a pickle rebuilds it."""
        if self._embedding_class is None:
            return super().__reduce_ex__(protocol)
        return _rebuild, (self._embedding_class,), self.__getstate__()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(ids, DTensor):
            ids = ids.full_tensor()
        if self._tp_rank is None:
            raise ValueError(f"VocabParallelEmbedding: this rank is not in its placement {self.placement.ranks}")
        bad = (ids < 0) | (ids >= self.num_embeddings)
        if ids.is_cuda or torch.compiler.is_compiling():  # no host sync; a graph without a data-dependent branch
            torch._assert_async(~bad.any(), "VocabParallelEmbedding: an id is outside [0, num_embeddings)")
        elif bad.any():
            raise IndexError(f"id {ids[bad][0].item()} is outside the vocabulary [0, {self.num_embeddings})")
        (weight,) = self._local_blocks((self.weight,), (True,) * (self.placement.ndim - 1))
        if self._group is None:
            return tag(F.embedding(ids, weight, self.padding_idx), WHOLE)
        start, end = self.local_range(self.num_embeddings)
        outside = (ids < start) | (ids >= end)
        pad = self.padding_idx - start if self.padding_idx is not None and start <= self.padding_idx < end else None
        y = F.embedding((ids - start).masked_fill(outside, 0), weight, pad).masked_fill(outside[..., None], 0)
        if self.sequence_parallel:
            if y.shape[self.sequence_dim] % self._tp_size:
                raise ValueError(f"sequence parallelism splits dim {self.sequence_dim} ({y.shape[self.sequence_dim]} "
                                 f"tokens) over {self._tp_size} ranks: pad the sequence to a multiple of "
                                 f"{self._tp_size}")
            return tag(comm.reduce_scatter_to_ranks(y, self.sequence_dim, self._group), SPLIT)
        return tag(comm.reduce_from_ranks(y, self._group), WHOLE)

    @property
    def output_sbp(self) -> Sbp | None:
        """The output's layout over the tensor-parallel axis, as ``output_sbp=`` says it (read from the flags)."""
        return self.layouts.read(self)["output_sbp"]

    def extra_repr(self) -> str:
        where = "not on this rank"
        if self._tp_rank is not None:
            start, end = self.local_range(self.num_embeddings)
            where = f"rows [{start}, {end}) of {self.num_embeddings} on this rank"  # half-open, as local_range's
        return (f"{self.num_embeddings}, {self.embedding_dim}"
                + ("" if self.padding_idx is None else f", padding_idx={self.padding_idx}")
                + f", placement={self.placement.type}:{self.placement.ranks}, {where}"
                + (f", sequence_parallel (dim {self.sequence_dim})" if self.sequence_parallel else ""))


@functools.cache
def _mixed(embedding_class: type[nn.Embedding]) -> type[VocabParallelEmbedding]:
    """``embedding_class``'s forward around ``VocabParallelEmbedding``'s lookup (its ``super().forward``), made once
    per subclass."""
    return type(f"VocabParallel{embedding_class.__name__}", (embedding_class, VocabParallelEmbedding),
                {"_embedding_class": embedding_class})


def _rebuild(embedding_class: type[nn.Embedding]) -> VocabParallelEmbedding:
    kind = _mixed(embedding_class)
    return kind.__new__(kind)


def linear_cross_entropy(hidden: torch.Tensor, head: ColumnParallelLinear | nn.Linear, target: torch.Tensor, *,
                         ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean",
                         chunk: int = 256) -> torch.Tensor:
    """``F.cross_entropy(head(hidden), target)`` without the logits: the head's product and the loss computed
    ``chunk`` tokens at a time, the vocabulary split over the head's ranks, so no rank ever holds more than
    ``[chunk, V / W]`` of logits (``tpflow.ops.linear_cross_entropy``).

    The gradients of ``hidden`` and of the head's parameters are computed in the forward, while each chunk's
    logits exist, and scaled by the loss's gradient in the backward.

    Args:
        hidden: ``[..., H]``, the head's input, whole on every rank of the head's placement (plain).
        head: a ``ColumnParallelLinear`` (its weight split over the vocabulary; not sequence parallel) or an
            ``nn.Linear``: on one device, or a head ``parallelize`` left whole (its weight broadcast).
        target: ``[...]``, class indices in ``[0, V)`` or ``ignore_index``.
        ignore_index, label_smoothing: as ``F.cross_entropy``'s.
        reduction: ``"mean"`` over the counted tokens, or ``"sum"``.
        chunk: tokens whose logits are made at once.

    Returns:
        The loss (a plain scalar, the same on every rank of the head's placement), in fp32 (fp64 for fp64 inputs).

    Example::

        >>> import tpflow as tpf
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)
        >>> head = tpf.ColumnParallelLinear(16, 101, bias=False, placement=P)   # a vocabulary-parallel lm_head
        >>> hidden, target = torch.randn(2, 5, 16, requires_grad=True), torch.randint(0, 101, (2, 5))
        >>> loss = tpf.linear_cross_entropy(hidden, head, target)
        >>> loss.backward()
        >>> loss                                                    # the same on every rank
        tensor(4.8424, grad_fn=<_LinearCEBackward>)
        >>> logits = hidden @ head.weight.full_tensor().T          # what it never makes
        >>> torch.allclose(loss, F.cross_entropy(logits.flatten(0, 1), target.flatten()))
        True
    """
    if isinstance(hidden, DTensor):
        raise TypeError("linear_cross_entropy takes the hidden states as a plain tensor, whole on every rank")
    weight, bias, start, group, classes = head_blocks(head, "linear_cross_entropy")
    if target.shape != hidden.shape[:-1]:
        raise ValueError(f"target {tuple(target.shape)} must have hidden's shape without its last dim "
                         f"{tuple(hidden.shape[:-1])}")
    return ops_ce.linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), weight, bias, target.reshape(-1),
                                       start=start, classes=classes, group=group, ignore_index=ignore_index,
                                       label_smoothing=label_smoothing, reduction=reduction, chunk=chunk)


class HeadBlocks(NamedTuple):
    """This rank's block of a head split over the vocabulary (differentiable into its parameters) and where it lies.

    Example::

        >>> HeadBlocks(torch.ones(3, 2), None, 0, None, 3).classes
        3
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    start: int  # the block's first class
    group: dist.ProcessGroup | None  # the ranks holding the other blocks
    classes: int  # the whole vocabulary


def head_blocks(head: ColumnParallelLinear | nn.Linear, caller: str) -> HeadBlocks:
    """This rank's block of ``head``'s weight and bias, for a product computed outside the head's forward from whole
    hidden states (a fused loss, fused log-probabilities), checked.

    Args:
        head: a ``ColumnParallelLinear`` (split over the vocabulary; not sequence parallel, gathered or fused) or an
            ``nn.Linear`` (one device's, or a head ``parallelize`` left whole: its weight broadcast).
        caller: the function's name, for the errors.

    Returns:
        ``(weight, bias, start, group, classes)``.

    Example::

        >>> import tpflow as tpf
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> blocks = head_blocks(tpf.ColumnParallelLinear(16, 101, bias=False, placement=P), "f")
        >>> tuple(blocks.weight.shape), blocks.start, blocks.classes          # on rank 1 of 2
        ((50, 16), 51, 101)
    """
    if isinstance(head, ColumnParallelLinear):
        if head.sequence_parallel or head.fused_group is not None:  # (gathering its output: only its forward's)
            raise ValueError(f"{head.label}: {caller} computes the head itself from whole hidden states: build it "
                             f"without sequence_parallel or fusing")
        weight, bias = head.local_blocks((True,) * (head.placement.ndim - 1))
        return HeadBlocks(weight, bias, head.local_range(head.out_features)[0], head.group, head.out_features)
    if not isinstance(head, nn.Linear):
        raise TypeError(f"head must be a ColumnParallelLinear or an nn.Linear, got {type(head).__name__}")
    weight, bias = head.weight, head.bias
    if isinstance(weight, DTensor):  # a head the plan left whole: its weight broadcast over a placement
        if not all(p.is_replicate() for p in weight.placements):
            raise ValueError(f"{caller}: the head's weight is laid out as {weight.placements}; a head split over the "
                             f"vocabulary is a ColumnParallelLinear (plan it 'vocab'), any other head is whole on "
                             f"every rank")
        weight, bias = weight.to_local(), None if bias is None else bias.to_local()
    return HeadBlocks(weight, bias, 0, None, head.out_features)


def _check_sequence_dim(sequence_dim: int) -> None:
    if sequence_dim not in (0, 1):
        raise ValueError(f"sequence_dim must be 0 ([seq, batch, hidden]) or 1 ([batch, seq, hidden]), got "
                         f"{sequence_dim!r}")
