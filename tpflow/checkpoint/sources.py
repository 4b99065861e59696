"""Reading a rank's block of a parameter from a checkpoint that stores it otherwise: in slices of the file's tensors.

A block is read as index ranges along each dim (``block_ranges``): a split gives one range, DTensor's strided split
(a mixture's packed gate / up halves, ``_StridedShard``) several, a split in segments (a Mamba-2 mixer's fused
``in_proj``, ``tpflow.global_tensor.segments``) one per segment, and the block is their pieces put together.

Hugging Face's MoE checkpoints keep one tensor per expert (``mlp.experts.3.gate_proj.weight``), which transformers
stacks into the model's fused 3-D parameters when it loads them (its conversion mapping: the per-expert tensors
merged along a new dim 0, gate and up concatenated along dim 1), and renames some modules on the way (Mixtral's
``block_sparse_moe`` is the model's ``mlp``). ``checkpoint_sources`` reads that mapping as data: for each of the
model's names, the file tensors it is made of. A rank then reads only its experts' tensors, and of each only its
slice.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from tpflow.global_tensor.blocks import get_placement
from tpflow.global_tensor.segments import local_ranges, segments_of
from tpflow.sbp import chunk_bounds

__all__ = ["Seen", "Stacked", "block_ranges", "checkpoint_sources", "neighbours", "read_block", "read_stacked"]

Ranges = list[list[tuple[int, int]]]  # per dim, the [start, end) ranges a block holds, in order
Seen = Callable[[Ranges, torch.Tensor], None]  # told what was read: its ranges, and the values as read


class _NotBySlices(ValueError):
    """A layout whose block is not a product of ranges (FSDP2's strided split over a tensor-parallel split)."""


def block_ranges(t: torch.Tensor, coordinate: Sequence[int] | None = None) -> Ranges:
    """The index ranges along each dim of this rank's block of ``t`` (a plain tensor: the whole of it).

    Args:
        t: a tensor; a global one split (``Shard``, ``_StridedShard``) or broadcast over its mesh.
        coordinate: the block of the rank at this coordinate of ``t``'s mesh instead of this rank's.

    Returns:
        Per dim, ``[start, end)`` ranges whose pieces, in order, make the block.

    Example::

        >>> from torch.distributed.tensor import DTensor
        >>> from torch.distributed.tensor.placement_types import _StridedShard
        >>> from tpflow.checkpoint.sources import block_ranges
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> packed = DTensor.from_local(torch.zeros(4, 6, 8), P.mesh, [_StridedShard(1, split_factor=2)],
        ...                             shape=(4, 12, 8), stride=(96, 8, 1))
        >>> block_ranges(packed)              # on rank 1: the second half of the gate rows and of the up rows
        [[(0, 4)], [(3, 6), (9, 12)], [(0, 8)]]
    """
    ranges: Ranges = [[(0, n)] for n in t.shape]
    if not isinstance(t, DTensor):
        return ranges
    coord, sizes = get_placement(t).coordinate() if coordinate is None else coordinate, t.device_mesh.shape
    rows = local_ranges(t, coord)
    if rows is not None:  # this rank's rows of each segment (a fused projection's), FSDP2's share of them
        ranges[segments_of(t).dim] = rows
        return ranges
    for placement, c, n in zip(t.placements, coord, sizes):
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, (Shard, _StridedShard)):  # (a strided split is not a Shard in every torch)
            raise ValueError(f"a parameter laid out as {placement} is not read from a checkpoint by slices")
        d, parts = placement.dim, placement.split_factor if isinstance(placement, _StridedShard) else 1
        if ranges[d] != [(0, t.shape[d])]:  # FSDP2's strided split over a split dim, say: another rule
            raise _NotBySlices(f"a parameter split twice along dim {d} ({t.placements}) is not read from a "
                               "checkpoint by slices")
        narrowed = []
        for start, end in ranges[d]:
            step = (end - start) // parts
            for k in range(parts):  # a strided split: this rank's chunk of each of the parts
                a, b = chunk_bounds(step, n)[c]
                narrowed.append((start + k * step + a, start + k * step + b))
        ranges[d] = narrowed
    return ranges


def neighbours(t: torch.Tensor) -> list[tuple[int, ...]]:
    """The coordinates of the ranks whose blocks of ``t`` this rank reads too, to compare its bytes with theirs: along
    each mesh dim that splits ``t``, the next rank's (a ring, so that every block is read by two ranks); none for a
    plain tensor, a tensor broadcast, or one read whole.

    Args:
        t: the model's tensor (plain or global).

    Returns:
        Mesh coordinates, each once, this rank's left out.

    Example::

        >>> from tpflow.checkpoint.sources import neighbours
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> neighbours(tpf.zeros(4, 2, placement=P, sbp=tpf.sbp.split(0)))       # on rank 0: rank 1's block
        [(1,)]
        >>> neighbours(tpf.zeros(4, 2, placement=P, sbp=tpf.sbp.broadcast)), neighbours(torch.zeros(4, 2))
        ([], [])
    """
    if not isinstance(t, DTensor) or get_placement(t).coordinate() is None:
        return []
    try:
        block_ranges(t)
    except _NotBySlices:  # read whole
        return []
    coord, found = tuple(get_placement(t).coordinate()), []
    for dim, (placement, n) in enumerate(zip(t.placements, t.device_mesh.shape)):
        if isinstance(placement, (Shard, _StridedShard)) and n > 1:
            other = (*coord[:dim], (coord[dim] + 1) % n, *coord[dim + 1:])
            if other not in found:
                found.append(other)
    return found


def _pieces(ranges: Ranges) -> list[tuple[slice, ...]]:
    """The block's pieces (one per combination of ranges), as index tuples, in the order they are put together."""
    out: list[tuple[slice, ...]] = [()]
    for dim in ranges:
        out = [prefix + (slice(a, b),) for prefix in out for a, b in dim]
    return out


def _assemble(pieces: list[torch.Tensor], ranges: Ranges) -> torch.Tensor:
    """The pieces of ``_pieces(ranges)`` put together: concatenated along each dim, the last dim innermost."""
    for d in reversed(range(len(ranges))):
        k = len(ranges[d])
        if k > 1:
            pieces = [torch.cat(pieces[i:i + k], dim=d) for i in range(0, len(pieces), k)]
    return pieces[0]


def read_block(handle, key: str, t: torch.Tensor, coordinate: Sequence[int] | None = None,
               seen: Seen | None = None) -> torch.Tensor:
    """This rank's block of ``t`` from the file tensor ``key``, which holds it whole: only its slices are read.

    Args:
        handle: a ``safetensors.safe_open`` handle holding ``key``.
        key: the tensor's name in the file.
        t: the model's tensor (plain or global).
        coordinate: the block of the rank at this coordinate of ``t``'s mesh instead (``neighbours``).
        seen: called with the ranges read and what was read there, as read: the block, or the whole tensor where
            the block is cut from it (a layout not read by slices).

    Returns:
        The block, in the file's dtype.

    Example::

        >>> import os
        >>> import tempfile
        >>> from safetensors import safe_open
        >>> from safetensors.torch import save_file
        >>> from tpflow.checkpoint.sources import read_block
        >>> folder = tempfile.TemporaryDirectory()
        >>> path = os.path.join(folder.name, "w.safetensors")
        >>> save_file({"w": torch.arange(8.).reshape(4, 2)}, path)
        >>> w = tpf.zeros(4, 2, placement=tpf.placement("cpu", ranks=[0, 1]), sbp=tpf.sbp.split(0))
        >>> with safe_open(path, framework="pt") as f:
        ...     read_block(f, "w", w)                                   # on rank 1: its rows
        tensor([[4., 5.],
                [6., 7.]])
        >>> folder.cleanup()
    """
    sliced = handle.get_slice(key)
    if tuple(sliced.get_shape()) != tuple(t.shape):
        raise ValueError(f"{key!r} is {tuple(sliced.get_shape())} in the checkpoint but {tuple(t.shape)} in the model")
    seen = seen or (lambda ranges, value: None)
    whole = [[(0, n)] for n in t.shape]
    if not isinstance(t, DTensor):
        seen(whole, value := handle.get_tensor(key))
        return value
    try:
        ranges = block_ranges(t, coordinate)
    except _NotBySlices:  # FSDP2 over a tensor-parallel split (a resumed run): the whole tensor, cut as t is
        seen(whole, value := handle.get_tensor(key))
        return distribute_tensor(value, t.device_mesh, t.placements, src_data_rank=None).to_local()
    seen(ranges, value := _assemble([sliced[index] for index in _pieces(ranges)], ranges))
    return value


@dataclasses.dataclass(frozen=True)
class Stacked:
    """A model tensor that the checkpoint holds as one tensor per expert, the experts stacked along a new dim 0.

    Args:
        keys: ``keys[k][e]``, expert e's tensor of the k-th part.
        dim: the dim the parts are concatenated along (gate and up: 1), None for one part.

    Example::

        >>> from tpflow.checkpoint.sources import Stacked
        >>> down = Stacked(keys=(("experts.0.down_proj.weight", "experts.1.down_proj.weight"),), dim=None)
        >>> len(down.keys[0])                                           # two experts
        2
    """

    keys: tuple[tuple[str, ...], ...]
    dim: int | None


def checkpoint_sources(model: nn.Module, keys: list[str]) -> tuple[dict[str, str], dict[str, Stacked]]:
    """What transformers' conversion mapping makes of the checkpoint's ``keys`` for ``model``: the model's names of
    renamed tensors (their checkpoint keys), and the model's tensors stacked from per-expert ones.

    Args:
        model: a transformers model (anything else has no mapping: nothing is returned).
        keys: the checkpoint's tensor names.

    Returns:
        ``(renamed, stacked)``: model name -> checkpoint key, and model name -> ``Stacked``.

    Example::

        >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        >>> from tpflow.checkpoint.sources import checkpoint_sources
        >>> model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=16, hidden_size=8, moe_intermediate_size=4,
        ...     num_experts=2, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=4))
        >>> keys = [f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for e in range(2) for p in ("gate", "up")]
        >>> renamed, stacked = checkpoint_sources(model, keys)
        >>> gate_up = stacked["model.layers.0.mlp.experts.gate_up_proj"]
        >>> gate_up.keys[1], gate_up.dim               # the up halves, after the gates along dim 1
        (('model.layers.0.mlp.experts.0.up_proj.weight', 'model.layers.0.mlp.experts.1.up_proj.weight'), 1)
    """
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import MergeModulelist, WeightConverter, rename_source_key
    except ImportError:
        return {}, {}
    if not hasattr(model, "config"):
        return {}, {}
    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    renamed: dict[str, str] = {}
    parts: dict[str, dict[int, dict[int, str]]] = {}
    converter_of: dict[str, WeightConverter] = {}
    for key in keys:
        name, pattern = rename_source_key(key, renamings, converters)
        if pattern is None:
            if name != key:
                renamed[name] = key
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        k = converter.source_patterns.index(pattern)
        found = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
        if found is None:  # the renamings changed what the pattern names: found on the renamed key instead
            found = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), rename_source_key(key, renamings, [])[0])
        if found is None:
            raise ValueError(f"{key!r}: transformers converts it by {pattern!r}, whose expert index tpflow cannot "
                             "find in the name: load with from_pretrained, then parallelize")
        parts.setdefault(name, {}).setdefault(k, {})[int(found.group(1))] = key
        converter_of[name] = converter
    stacked = {}
    for name, by_part in parts.items():
        ops = converter_of[name].operations
        if not ops or not isinstance(ops[0], MergeModulelist) or ops[0].dim != 0 or len(ops) > 2 or \
                (len(ops) == 2 and type(ops[1]).__name__ != "Concatenate"):
            raise ValueError(f"{name}: the checkpoint's tensors are converted by {[type(o).__name__ for o in ops]}, "
                             "which tpf.load_safetensors does not read: load with from_pretrained, then parallelize")
        keys_ = tuple(tuple(by_part[k][e] for e in sorted(by_part[k])) for k in sorted(by_part))
        stacked[name] = Stacked(keys_, ops[1].dim if len(ops) == 2 else None)
    return renamed, stacked


def read_stacked(handles: dict, source: Stacked, t: torch.Tensor, coordinate: Sequence[int] | None = None,
                 seen: Seen | None = None) -> torch.Tensor:
    """This rank's block of ``t`` from per-expert tensors: only its experts' tensors, and of each its slice.

    Args:
        handles: checkpoint key -> ``safe_open`` handle.
        source: what ``t`` is made of.
        t: the model's tensor, ``[experts, ...]``.
        coordinate: the block of the rank at this coordinate of ``t``'s mesh instead (``neighbours``).
        seen: called with the block's ranges (of ``t``) and the block, as read.

    Returns:
        The block.

    Example::

        >>> import os
        >>> import tempfile
        >>> from safetensors import safe_open
        >>> from safetensors.torch import save_file
        >>> from tpflow.checkpoint.sources import Stacked, read_stacked
        >>> folder = tempfile.TemporaryDirectory()
        >>> path = os.path.join(folder.name, "experts.safetensors")
        >>> save_file({f"e.{i}.w": torch.full((2, 3), float(i)) for i in range(2)}, path)
        >>> t = tpf.zeros(2, 2, 3, placement=tpf.placement("cpu", ranks=[0, 1]), sbp=tpf.sbp.split(0))
        >>> with safe_open(path, framework="pt") as f:
        ...     read_stacked({"e.0.w": f, "e.1.w": f}, Stacked((("e.0.w", "e.1.w"),), None), t)   # on rank 1
        tensor([[[1., 1., 1.],
                 [1., 1., 1.]]])
        >>> folder.cleanup()
    """
    ranges = block_ranges(t, coordinate)
    region = [list(dim) for dim in ranges]
    experts = len(source.keys[0])
    if t.shape[0] != experts or any(len(k) != experts for k in source.keys):
        raise ValueError(f"the checkpoint holds {[len(k) for k in source.keys]} experts' tensors for a parameter of "
                         f"{t.shape[0]} experts {tuple(t.shape)}")
    part = t.shape[source.dim] // len(source.keys) if source.dim is not None else None
    want = [*t.shape[1:]]
    if part is not None:
        want[source.dim - 1] = part
    for keys in source.keys:
        for key in keys:
            if list(handles[key].get_slice(key).get_shape()) != want:
                raise ValueError(f"{key!r} is {tuple(handles[key].get_slice(key).get_shape())} in the checkpoint, but "
                                 f"the model's {tuple(t.shape)} takes {tuple(want)} from each expert")
    if part is not None:  # a range over two parts (gate and up, whole) read as one piece of each
        ranges[source.dim] = [(max(a, k * part), min(b, (k + 1) * part)) for a, b in ranges[source.dim]
                              for k in range(a // part, (b - 1) // part + 1)]
    rows = []
    for start, end in ranges[0]:
        for e in range(start, end):
            pieces = []
            for index in _pieces(ranges[1:]):
                k = 0
                if part is not None:  # which part (gate, up) this piece lies in, and where in it
                    s = index[source.dim - 1]
                    k = s.start // part
                    index = (*index[:source.dim - 1], slice(s.start - k * part, s.stop - k * part),
                             *index[source.dim:])
                key = source.keys[k][e]
                pieces.append(handles[key].get_slice(key)[index])
            rows.append(_assemble(pieces, ranges[1:]))
    block = torch.stack(rows)
    if seen is not None:
        seen(region, block)
    return block
