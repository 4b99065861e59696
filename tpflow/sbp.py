"""SBP: how a global tensor is laid out over one axis of its placement.

``split(dim)`` cuts the tensor along ``dim`` (``torch.chunk`` sizes, so 10 rows over 4 ranks
are 3, 3, 3, 1, as DTensor does); ``broadcast`` gives every rank the whole tensor;
``partial_sum`` gives every rank a tensor of the full shape whose sum over the axis is the
value. A tensor on an N-D placement has a tuple of N of them, applied axis by axis.

This module is pure layout arithmetic: which block of the global tensor a mesh coordinate
holds, which matmul signatures are legal, and what a conversion costs in bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement as DTensorPlacement

__all__ = [
    "Split",
    "Broadcast",
    "PartialSum",
    "Sbp",
    "split",
    "broadcast",
    "partial_sum",
    "normalize",
    "to_dtensor",
    "from_dtensor",
    "local_region",
    "dual",
    "matmul_out_sbp",
    "infer_matmul",
    "conversion_bytes",
]


@dataclass(frozen=True)
class Split:
    dim: int

    def __repr__(self) -> str:
        return f"sbp.split(dim={self.dim})"


@dataclass(frozen=True)
class Broadcast:
    def __repr__(self) -> str:
        return "sbp.broadcast"


@dataclass(frozen=True)
class PartialSum:
    def __repr__(self) -> str:
        return "sbp.partial_sum"


Sbp = Split | Broadcast | PartialSum
broadcast = Broadcast()
partial_sum = PartialSum()


def split(dim: int) -> Split:
    """``sbp.split(dim)``: each rank of the axis holds one ``torch.chunk`` of ``dim``."""
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"sbp.split(dim) takes an int dim, got {dim!r}")
    return Split(dim)


def _one(s: object) -> Sbp:
    if isinstance(s, (Split, Broadcast, PartialSum)):
        return s
    if isinstance(s, DTensorPlacement):
        return from_dtensor([s])[0]
    raise TypeError(f"expected tpf.sbp.split(dim), tpf.sbp.broadcast or tpf.sbp.partial_sum, got {s!r}")


def normalize(sbp: object, placement_ndim: int, tensor_ndim: int) -> tuple[Sbp, ...]:
    """Validate an SBP (or tuple of SBPs) against a placement and a tensor; split dims made >= 0."""
    if isinstance(sbp, (list, tuple)):
        sbps = tuple(_one(s) for s in sbp)
        if len(sbps) != placement_ndim:
            raise ValueError(
                f"{len(sbps)} SBP(s) {sbps} for a {placement_ndim}-D placement: give one SBP per placement axis"
            )
    else:
        if placement_ndim != 1:
            raise ValueError(
                f"a single SBP {sbp!r} for a {placement_ndim}-D placement: give a tuple of {placement_ndim} SBPs, "
                f"one per axis, e.g. (sbp.broadcast, sbp.split(0))"
            )
        sbps = (_one(sbp),)
    out = []
    for s in sbps:
        if isinstance(s, Split):
            if not -tensor_ndim <= s.dim < tensor_ndim:
                raise ValueError(
                    f"{s} is out of range for a {tensor_ndim}-D tensor: split dims must lie in "
                    f"[{-tensor_ndim}, {tensor_ndim - 1}]"
                )
            s = Split(s.dim % tensor_ndim)
        out.append(s)
    return tuple(out)


def to_dtensor(sbps: Sequence[Sbp]) -> list[DTensorPlacement]:
    return [Shard(s.dim) if isinstance(s, Split) else Replicate() if isinstance(s, Broadcast) else Partial("sum")
            for s in sbps]


def from_dtensor(placements: Sequence[DTensorPlacement]) -> tuple[Sbp, ...]:
    out: list[Sbp] = []
    for p in placements:
        if type(p) is Shard:
            out.append(Split(p.dim))
        elif isinstance(p, Replicate):
            out.append(broadcast)
        elif isinstance(p, Partial) and p.reduce_op == "sum":
            out.append(partial_sum)
        else:
            raise TypeError(f"DTensor placement {p} has no SBP: tpflow handles Shard, Replicate and Partial('sum')")
    return tuple(out)


def chunk_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """(offset, length) of chunk ``index`` when ``torch.chunk`` cuts ``size`` into ``parts``."""
    step = math.ceil(size / parts) if size else 0
    offset = min(index * step, size)
    return offset, min(step, size - offset)


def local_region(
    shape: Sequence[int], sbps: Sequence[Sbp], hierarchy: Sequence[int], coord: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, lengths) of the block of the global tensor held at mesh ``coord``.

    Splits apply axis by axis, each to what the previous axes left (DTensor's nested sharding).
    Broadcast and partial-sum axes leave the block whole.
    """
    offsets, lengths = [0] * len(shape), list(shape)
    for s, parts, c in zip(sbps, hierarchy, coord):
        if isinstance(s, Split):
            o, n = chunk_range(lengths[s.dim], parts, c)
            offsets[s.dim] += o
            lengths[s.dim] = n
    return tuple(offsets), tuple(lengths)


def dual(sbps: Sequence[Sbp]) -> tuple[Sbp, ...]:
    """The layout of a gradient: a partial sum's gradient is the same on every rank (broadcast)."""
    return tuple(broadcast if isinstance(s, PartialSum) else s for s in sbps)


def _signatures(a_ndim: int, b_ndim: int) -> list[tuple[Sbp, Sbp, Sbp]]:
    """Legal (a, b, out) SBPs of one axis for ``a [..., M, K] @ b [..., K, N]``, in order of preference."""
    out_ndim = max(a_ndim, b_ndim)
    sigs: list[tuple[Sbp, Sbp, Sbp]] = [(broadcast, broadcast, broadcast)]
    for i in range(a_ndim - 1):  # batch dims and M of a
        batch_of_b = b_ndim > 2 and i < a_ndim - 2
        sigs.append((Split(i), Split(i) if batch_of_b else broadcast, Split(i)))
    sigs += [
        (broadcast, Split(b_ndim - 1), Split(out_ndim - 1)),
        (Split(a_ndim - 1), Split(b_ndim - 2), partial_sum),
        (partial_sum, broadcast, partial_sum),
        (broadcast, partial_sum, partial_sum),
    ]
    return sigs


def matmul_out_sbp(
    a_sbps: Sequence[Sbp], b_sbps: Sequence[Sbp], a_ndim: int, b_ndim: int
) -> tuple[Sbp, ...] | None:
    """The output SBP when (a, b) is legal on every axis, else None."""
    table = {(a, b): o for a, b, o in _signatures(a_ndim, b_ndim)}
    out = tuple(table.get(pair) for pair in zip(a_sbps, b_sbps))
    return None if any(o is None for o in out) else out


def conversion_bytes(src: Sbp, dst: Sbp, nbytes: int, parts: int) -> float:
    """Bytes one rank sends to convert one axis from ``src`` to ``dst`` (ring collectives)."""
    if src == dst or parts == 1 or isinstance(src, Broadcast):
        return 0.0  # broadcast -> split / partial is a local slice or zeroing
    share = (parts - 1) / parts
    if isinstance(src, Split):
        if isinstance(dst, Broadcast):
            return share * nbytes  # all-gather
        if isinstance(dst, Split):
            return share * nbytes / parts  # all-to-all
        return 0.0  # split -> partial: the shard placed in zeros
    return {Broadcast: 2 * share * nbytes, Split: share * nbytes}[type(dst)]  # all-reduce / reduce-scatter


def infer_matmul(
    a_sbps: Sequence[Sbp],
    b_sbps: Sequence[Sbp],
    a_ndim: int,
    b_ndim: int,
    a_nbytes: int,
    b_nbytes: int,
    hierarchy: Sequence[int],
) -> tuple[tuple[Sbp, ...], tuple[Sbp, ...], tuple[Sbp, ...]]:
    """(a, b, out) SBPs for ``a @ b``: the inputs' own when legal, else the legal signature
    that moves the fewest bytes, chosen axis by axis."""
    sigs = _signatures(a_ndim, b_ndim)
    chosen = []
    for a, b, parts in zip(a_sbps, b_sbps, hierarchy):
        legal = [sig for sig in sigs if sig[:2] == (a, b)]
        if legal:
            chosen.append(legal[0])
            continue
        chosen.append(min(sigs, key=lambda sig: conversion_bytes(a, sig[0], a_nbytes, parts)
                          + conversion_bytes(b, sig[1], b_nbytes, parts)))
    return tuple(c[0] for c in chosen), tuple(c[1] for c in chosen), tuple(c[2] for c in chosen)
