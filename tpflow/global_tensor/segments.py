"""Parameters stored as segments that each split over the ranks: a fused projection ``[z | x | B | C | dt]`` of
Mamba-2, a convolution over ``[x | B | C]``, Qwen3.5's ``[q | k | v]``, each rank holding its rows of every segment.

DTensor has no placement for such a block (``_StridedShard`` cuts a dim into equal parts; segments differ), so the
parameter is a DTensor split along the dim whose local block is this rank's rows of each segment, back to back,
and whose global order is therefore rank by rank. The order the model stores (its checkpoints, ``state_dict``) is
kept at every way out, so that no gather gives the rank-major order: the parameter's own ``full_tensor()`` and
``redistribute`` to broadcast (and those of its ``detach()``, its gradient and its optimizer state) put the segments
back in stored order, and torch's distributed checkpoint writes and
reads each rank's rows of each segment at their stored offsets (a checkpoint saved on 2 ranks loads on 4 or on one
device). Those answers live on the tensor object, which a dtype conversion or a detached ``state_dict`` replaces:
the module holding it gives them again to every ``state_dict`` it makes and before each of its calls.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate
from torch.optim.optimizer import register_optimizer_step_post_hook

from tpflow.global_tensor import gradients
from tpflow.global_tensor.local import from_local
from tpflow.placement import Placement, nested_index
from tpflow.sbp import broadcast, chunk_bounds, split

__all__ = ["Segments", "keep_answering", "local_ranges", "segment", "segments_of"]

_SEGMENTS = "_tpflow_segments"  # on the parameter: its Segments (given again by the module, see the docstring)
_HELD = "_tpflow_segmented"  # on the module: its parameters' names -> Segments


@dataclasses.dataclass(frozen=True)
class Segments:
    """A dim of a parameter cut in segments of ``sizes`` (in stored order), each split evenly over ``ranks``, or over
    the ranks its span names (a key head's rows over the ranks holding its value heads).

    Args:
        dim: the dim cut.
        sizes: the segments' lengths along it, in the order the model stores them.
        ranks: the ranks the parameter is split over.
        spans: per segment, ``(first rank, ranks)`` it splits over; default every rank. Every rank must hold as
            many rows as every other.

    Example::

        >>> s = Segments(0, (4, 4, 2), ranks=2)      # [z | x | dt]: 4, 4 and 2 rows
        >>> s.ranges(1)                               # rank 1's rows of each
        [(2, 4), (6, 8), (9, 10)]
        >>> Segments(0, (2, 4, 2, 4), ranks=4, spans=((0, 2), (0, 2), (2, 2), (2, 2))).ranges(3)   # [q | v] x 2
        [(7, 8), (10, 12)]
    """

    dim: int
    sizes: tuple[int, ...]
    ranks: int
    spans: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        spans = self.over()
        uneven = [size for size, (_, count) in zip(self.sizes, spans) if size % count]
        if uneven or len(spans) != len(self.sizes):
            raise ValueError(f"segments of {list(self.sizes)} rows split over {self.ranks} ranks: {uneven} do not "
                             f"divide; use a degree that divides every segment")
        held = {sum(b - a for a, b in self.ranges(r)) for r in range(self.ranks)}
        if len(held) > 1 or any(first + count > self.ranks for first, count in spans):
            raise ValueError(f"segments of {list(self.sizes)} rows over the ranks {list(spans)} give the "
                             f"{self.ranks} ranks unequal blocks")

    def over(self) -> tuple[tuple[int, int], ...]:
        """Each segment's ``(first rank, ranks)``."""
        return self.spans or ((0, self.ranks),) * len(self.sizes)

    def ranges(self, index: int) -> list[tuple[int, int]]:
        """``[start, end)`` of rank ``index``'s rows of each segment it holds, in stored order."""
        starts = itertools.accumulate((0, *self.sizes))
        return [(start + (index - first) * size // count, start + (index - first + 1) * size // count)
                for start, size, (first, count) in zip(starts, self.sizes, self.over())
                if first <= index < first + count]

    def block(self, whole: torch.Tensor, index: int) -> torch.Tensor:
        """Rank ``index``'s block of the stored tensor ``whole``: its rows of each segment, back to back."""
        return torch.cat([whole.narrow(self.dim, a, b - a) for a, b in self.ranges(index)], self.dim)

    def stored(self, blocks: torch.Tensor) -> torch.Tensor:
        """The stored order of ``blocks``, every rank's block back to back (a gather of the split)."""
        pieces = {}  # (segment, rank) -> its rows
        for r, b in enumerate(blocks.chunk(self.ranks, self.dim)):
            held = [s for s, (first, count) in enumerate(self.over()) if first <= r < first + count]
            pieces.update(zip(((s, r) for s in held), b.split([self.sizes[s] // self.over()[s][1] for s in held],
                                                              self.dim)))
        return torch.cat([pieces[s, r] for s, (first, count) in enumerate(self.over())
                          for r in range(first, first + count)], self.dim)


def segment(module: nn.Module, name: str, segments: Segments, placement: Placement, *,
            read_by: nn.Module | None = None, axes: Sequence[int] | None = None) -> None:
    """Make ``module``'s own parameter ``name`` a global parameter split in ``segments`` over the last axis of
    ``placement`` (or over ``axes``, nested: rank ``(c, t)`` is index ``c * T + t`` of ``segments``): this rank's
    rows of each segment (allocated, not filled, for a parameter on the meta device, which a checkpoint then fills).
    Its module must read it as its local block (``LocalReads``).

    Args:
        module: the module holding the parameter, whole on every rank.
        name: the parameter's name in it.
        segments: its segments, over the ranks of ``axes``.
        placement: the ranks; the last axis is the tensor-parallel one.
        read_by: the module whose calls read the parameter, where not ``module``'s own (a mixer reading its
            convolution's weight itself).
        axes: the axes it is split over, in nesting order; default the last.

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)                                       # the same layer on every rank
        >>> layer = nn.Linear(2, 6)
        >>> whole = layer.weight.detach().clone()
        >>> segment(layer, "weight", Segments(0, (4, 2), ranks=2), P)
        >>> layer.weight.to_local().shape                                # rows 0-1 and 4 on rank 0
        torch.Size([3, 2])
        >>> torch.equal(layer.weight.full_tensor(), whole)               # the stored order, gathered
        True
    """
    full = module._parameters[name]
    axes = (placement.ndim - 1,) if axes is None else tuple(axes)
    world = math.prod(placement.hierarchy[a] for a in axes)
    if segments.ranks != world or sum(segments.sizes) != full.shape[segments.dim]:
        raise ValueError(f"{name!r}: segments {list(segments.sizes)} over {segments.ranks} ranks do not cut its "
                         f"{full.shape[segments.dim]} rows along dim {segments.dim} over {world}")
    coord = placement.coordinate()
    if coord is None:
        local = torch.empty(0, dtype=full.dtype)
    else:
        local = segments.block(full.detach(), nested_index(coord, placement.hierarchy, axes))
        local = torch.empty(local.shape, dtype=full.dtype) if full.is_meta else local.clone()
    sbp = tuple(split(segments.dim) if a in axes else broadcast for a in range(placement.ndim))
    value = from_local(local.to(placement.device), placement, sbp, shape=full.shape, sync_data=False)
    param = gradients.adopt(nn.Parameter(value, requires_grad=full.requires_grad))
    setattr(module, name, param)
    held = module.__dict__.get(_HELD)
    if held is None:
        held = module.__dict__[_HELD] = {}
        module.register_state_dict_post_hook(_answer_in_state_dict)
        (read_by or module).register_forward_pre_hook(_AnswerAgain(module))
    held[name] = segments
    _answer(param, segments)


def segments_of(t: torch.Tensor) -> Segments | None:
    """The segments a global parameter is split in (``segment``), or None for any other tensor.

    Args:
        t: a tensor.

    Returns:
        Its ``Segments``, or None.

    Example::

        >>> segments_of(torch.zeros(2))
    """
    return getattr(t, _SEGMENTS, None)


def local_ranges(t: torch.Tensor, coordinate: Sequence[int] | None = None) -> list[tuple[int, int]] | None:
    """The stored rows ``[start, end)`` along its segments' dim that a segmented parameter's local block holds, in
    order (FSDP2 over data axes splitting the tensor-parallel block further included); None for any other tensor.

    Args:
        t: a tensor.
        coordinate: the block of the rank at this coordinate of ``t``'s mesh instead of this rank's.

    Returns:
        The ranges, or None.

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> layer = nn.Linear(2, 6)
        >>> segment(layer, "weight", Segments(0, (4, 2), ranks=2), P)
        >>> local_ranges(layer.weight, (1,)), local_ranges(torch.zeros(2))
        ([(2, 4), (5, 6)], None)
    """
    segments = segments_of(t)
    if segments is None or not isinstance(t, DTensor):
        return None
    coordinate = t.device_mesh.get_coordinate() if coordinate is None else coordinate
    splits = [i for i, p in enumerate(t.placements) if not p.is_replicate()]
    sizes = t.device_mesh.shape
    if segments.ranks == math.prod(sizes[i] for i in splits) and len(splits) > 1:  # nested over every split axis
        return segments.ranges(nested_index(coordinate, sizes, splits))
    ranges = segments.ranges(coordinate[splits[-1]])  # the tensor-parallel split: the last mesh dim splitting it
    for i in splits[:-1]:  # FSDP2's data axes: their chunk [a, b) of the tensor-parallel block's rows
        a, b = chunk_bounds(sum(end - start for start, end in ranges), t.device_mesh.size(i))[coordinate[i]]
        narrowed, seen = [], 0
        for start, end in ranges:
            low, high = max(a - seen, 0), min(b - seen, end - start)
            if high > low:
                narrowed.append((start + low, start + high))
            seen += end - start
        ranges = narrowed
    return ranges


def keep_answering(root: nn.Module) -> None:
    """Before each call of ``root``, the segmented parameters of its modules given their answers again where they
    were replaced: FSDP2 (``fully_shard``) puts sharded parameters of its own in their place, which the holding
    module's calls never see (they run on FSDP2's gathered ones).

    Args:
        root: the model.

    Example::

        >>> model = nn.Sequential(nn.Linear(2, 6))
        >>> segment(model[0], "weight", Segments(0, (4, 2), ranks=2), tpf.placement("cpu", ranks=[0, 1]))
        >>> keep_answering(model)
    """
    if "_tpflow_answers" not in root.__dict__:
        root.__dict__["_tpflow_answers"] = True
        root.register_forward_pre_hook(_AnswerHolders(root))


class _AnswerHolders:
    """A root's forward pre-hook: ``_AnswerAgain`` for every module of it holding segmented parameters."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root

    def __call__(self, caller: nn.Module, args: tuple) -> None:
        for module in self.root.modules():
            if _HELD in module.__dict__:
                _AnswerAgain(module)(module, args)


def _answer(t: torch.Tensor, segments: Segments) -> None:
    """Give ``t`` (the parameter, or its detached copy in a state dict) the gathers in stored order and the
    distributed checkpoint's chunks at their stored offsets; a parameter gives them to its gradient as the backward
    leaves it, and its optimizer state after each step (``_answer_states``)."""
    if not isinstance(t, DTensor):
        return
    if isinstance(t, nn.Parameter) or getattr(t, "_is_param", False):
        t.register_post_accumulate_grad_hook(_answer_gradient)
    answers = _Answers(t, segments)
    setattr(t, _SEGMENTS, segments)
    t.full_tensor = answers.full_tensor
    t.detach = answers.detach
    t.redistribute = answers.redistribute
    t.__create_write_items__ = answers.write_items
    t.__create_chunk_list__ = answers.chunks
    t.__get_tensor_shard__ = answers.piece


def _answer_gradient(param: torch.Tensor) -> None:
    segments = param.__dict__.get(_SEGMENTS)  # (reduce_partial_gradients calls it for every parameter it sums)
    if param.grad is not None and segments is not None:
        _answer(param.grad, segments)


def _answer_states(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """After any optimizer's step, the state it keeps per segmented parameter (Adam's moments) answers as it does:
    torch's distributed checkpoint saves and reshards optimizer states through those tensors."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            segments = segments_of(param)
            if segments is None:
                continue
            for value in optimizer.state.get(param, {}).values():
                if isinstance(value, DTensor) and value.shape == param.shape:
                    _answer(value, segments)
            if param.grad is not None:
                _answer(param.grad, segments)


register_optimizer_step_post_hook(_answer_states)
gradients.register_gradient_replaced_hook(_answer_gradient)


def _answer_in_state_dict(module: nn.Module, state: dict, prefix: str, local_metadata: dict) -> None:
    for name, segments in module.__dict__[_HELD].items():
        if prefix + name in state:
            _answer(state[prefix + name], segments)


class _AnswerAgain:
    """A forward pre-hook: before each call, the answers again to ``module``'s segmented parameters a conversion
    replaced (an object holding the module, not a closure: a deep copy of the model maps it to the copy)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, caller: nn.Module, args: tuple) -> None:
        for name, segments in self.module.__dict__[_HELD].items():
            param = self.module._parameters.get(name)
            if param is not None and getattr(param, _SEGMENTS, None) is not segments:
                _answer(param, segments)


class _Answers:
    """A segmented DTensor's answers (an object holding the tensor, not closures: a deep copy of the model maps it
    to the copy)."""

    def __init__(self, t: DTensor, segments: Segments) -> None:
        self.t, self.segments = t, segments

    def full_tensor(self, *, grad_placements: Sequence | None = None) -> torch.Tensor:
        gathered = DTensor.redistribute(self.t, self.t.device_mesh, [Replicate()] * self.t.device_mesh.ndim)
        return self.segments.stored(gathered.to_local(grad_placements=grad_placements))

    def detach(self) -> DTensor:
        out = DTensor.detach(self.t)
        _answer(out, self.segments)
        return out

    def redistribute(self, device_mesh: object = None, placements: Sequence | None = None, **kwargs) -> DTensor:
        if device_mesh not in (None, self.t.device_mesh) or placements is None or not all(
                isinstance(p, Replicate) for p in placements):
            raise ValueError(f"a parameter split in segments {list(self.segments.sizes)} (rows of each per rank) "
                             f"redistributes only to broadcast on its own mesh, not to {placements}: take "
                             f"full_tensor() and distribute that")
        whole = self.full_tensor()
        return DTensor.from_local(whole, self.t.device_mesh, list(placements), run_check=False,
                                  shape=self.t.shape, stride=whole.stride())

    def _pieces(self) -> list[tuple[torch.Size, torch.Tensor]]:
        """This rank's pieces of the stored tensor: each segment's rows, with its offset in the stored tensor."""
        local, dim = self.t._local_tensor, self.segments.dim
        out, at = [], 0
        for start, end in local_ranges(self.t):
            offsets = [0] * self.t.ndim
            offsets[dim] = start
            out.append((torch.Size(offsets), local.narrow(dim, at, end - start)))
            at += end - start
        return out

    def write_items(self, fqn: str, obj: object) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=piece.shape),
                                                      properties=TensorProperties.create_from_tensor(piece),
                                                      size=self.t.size()))
                for offsets, piece in self._pieces()]

    def chunks(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=piece.shape) for offsets, piece in self._pieces()]

    def piece(self, index: MetadataIndex) -> torch.Tensor:
        found = next((piece for offsets, piece in self._pieces() if offsets == torch.Size(index.offset)), None)
        if found is None:
            raise ValueError(f"{index.fqn}: no piece of this rank's segments starts at {index.offset}")
        return found
