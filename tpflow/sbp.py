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
    "chunk_bounds",
    "local_region",
    "dual",
    "matmul_out_sbp",
    "infer_matmul",
    "conversion_bytes",
]


@dataclass(frozen=True)
class Split:
    """The SBP ``split(dim)``: each rank of a placement axis holds one ``torch.chunk`` of dimension ``dim``.

    This is DTensor's ``Shard(dim)``: blocks follow ``torch.chunk``'s sizes, so 10 rows over 4 ranks are
    3, 3, 3, 1. Build one with ``tpf.sbp.split(dim)``, which checks that ``dim`` is an int; ``normalize`` makes a
    negative ``dim`` non-negative against a tensor's ndim. Instances are frozen, hashable and compare by ``dim``.

    Args:
        dim: the tensor dimension that is cut; a negative one counts from the end until ``normalize``.

    Example::

        >>> import tpflow as tpf
        >>> tpf.sbp.split(1)
        sbp.split(dim=1)
        >>> tpf.sbp.split(0) == tpf.sbp.Split(0)
        True
    """

    dim: int

    def __repr__(self) -> str:
        return f"sbp.split(dim={self.dim})"


@dataclass(frozen=True)
class Broadcast:
    """The SBP ``broadcast``: every rank of a placement axis holds the whole tensor (DTensor's ``Replicate()``).

    Use the instance ``tpf.sbp.broadcast``; every ``Broadcast()`` compares equal to it. A partial sum's gradient
    is broadcast (see ``dual``).

    Example::

        >>> import tpflow as tpf
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> x = tpf.zeros(4, 5, placement=P, sbp=tpf.sbp.broadcast)
        >>> tpf.get_sbp(x), tpf.to_local(x).shape   # every rank holds all 4 x 5
        ((sbp.broadcast,), torch.Size([4, 5]))
    """

    def __repr__(self) -> str:
        return "sbp.broadcast"


@dataclass(frozen=True)
class PartialSum:
    """The SBP ``partial_sum``: every rank of a placement axis holds a tensor of the full shape, and the value is
    their sum over the axis (DTensor's ``Partial("sum")``).

    Use the instance ``tpf.sbp.partial_sum``; every ``PartialSum()`` compares equal to it. It is what a matmul
    over a split inner dimension gives; converting it to ``broadcast`` is an all-reduce, to ``split`` a
    reduce-scatter. A partial sum made from a whole value (creation, boxing from ``broadcast``) keeps the value on
    the axis' coordinate 0 and zeros on the others.

    Example::

        >>> import tpflow as tpf
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> x = tpf.ones(2, 3, placement=P, sbp=tpf.sbp.partial_sum)   # ones on rank 0, zeros on rank 1
        >>> tpf.to_global(x, sbp=tpf.sbp.broadcast).to_local()          # an all-reduce
        tensor([[1., 1., 1.],
                [1., 1., 1.]])
    """

    def __repr__(self) -> str:
        return "sbp.partial_sum"


Sbp = Split | Broadcast | PartialSum
broadcast = Broadcast()
partial_sum = PartialSum()


def split(dim: int) -> Split:
    """``sbp.split(dim)``: each rank of the axis holds one ``torch.chunk`` of ``dim``.

    Block sizes follow ``torch.chunk``, as DTensor's ``Shard`` does: ``ceil(size / n)`` each over ``n`` ranks, the
    last ones shorter or empty (10 rows over 4 ranks are 3, 3, 3, 1; 5 rows over 4 are 2, 2, 1, 0). ``dim`` is
    checked against the tensor's ndim only where the SBP is used (``normalize``), so ``split(-1)`` is the last
    dimension of whatever tensor it lays out. A ``dim`` that is not an int (a bool included) is a ``TypeError``:
    "sbp.split(dim) takes an int dim, got ...".

    Args:
        dim: the dimension to cut; a negative one counts from the end.

    Returns:
        A ``Split``.

    Example::

        >>> import tpflow as tpf
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> x = tpf.randn(5, 4, placement=P, sbp=tpf.sbp.split(0))   # rows 0-2 on rank 0, rows 3-4 on rank 1
        >>> tpf.to_local(x).shape   # on rank 0
        torch.Size([3, 4])
    """
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
    """Validate an SBP (or tuple of SBPs) against a placement and a tensor; split dims made >= 0.

    Every function that takes ``sbp=`` goes through this. DTensor placements (``Shard``, ``Replicate``,
    ``Partial("sum")``) are accepted in place of SBPs. A single SBP is only accepted for a 1-D placement.
    Anything that is not an SBP is a ``TypeError``; a number of SBPs other than ``placement_ndim``, or a split dim
    outside ``[-tensor_ndim, tensor_ndim - 1]``, is a ``ValueError`` that says what to give instead.

    Args:
        sbp: one SBP, or a list or tuple of SBPs with one per placement axis.
        placement_ndim: the number of placement axes (``Placement.ndim``).
        tensor_ndim: the number of dimensions of the tensor that ``sbp`` lays out.

    Returns:
        A tuple of ``placement_ndim`` SBPs whose split dims lie in ``[0, tensor_ndim)``.

    Example::

        >>> import tpflow as tpf
        >>> tpf.sbp.normalize(tpf.sbp.split(-1), 1, 2)
        (sbp.split(dim=1),)
        >>> tpf.sbp.normalize((tpf.sbp.broadcast, tpf.sbp.split(0)), 2, 2)
        (sbp.broadcast, sbp.split(dim=0))
    """
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
    """DTensor placements for SBPs: ``split(d)`` is ``Shard(d)``, ``broadcast`` is ``Replicate()`` and
    ``partial_sum`` is ``Partial("sum")``.

    Args:
        sbps: SBPs, one per placement axis.

    Returns:
        A list of DTensor placements, in the same order.

    Example::

        >>> import tpflow as tpf
        >>> tpf.sbp.to_dtensor([tpf.sbp.split(0), tpf.sbp.broadcast, tpf.sbp.partial_sum])
        [Shard(dim=0), Replicate(), Partial(sum)]
    """
    return [Shard(s.dim) if isinstance(s, Split) else Replicate() if isinstance(s, Broadcast) else Partial("sum")
            for s in sbps]


def from_dtensor(placements: Sequence[DTensorPlacement]) -> tuple[Sbp, ...]:
    """SBPs for DTensor placements, the inverse of ``to_dtensor``.

    Only ``Shard`` itself (not its subclasses, such as the strided shards FSDP makes), ``Replicate`` and
    ``Partial("sum")`` have an SBP; any other placement is a ``TypeError``: "DTensor placement ... has no SBP".

    Args:
        placements: DTensor placements, one per mesh axis (a DTensor's ``placements``).

    Returns:
        A tuple of SBPs, in the same order.

    Example::

        >>> import tpflow as tpf
        >>> from torch.distributed.tensor import Partial, Replicate, Shard
        >>> tpf.sbp.from_dtensor([Shard(1), Replicate(), Partial("sum")])
        (sbp.split(dim=1), sbp.broadcast, sbp.partial_sum)
    """
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


def chunk_bounds(size: int, parts: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each of ``parts`` chunks of ``size`` by ``torch.chunk``'s rule: tpflow's (and DTensor's)
    split, so 10 rows over 4 ranks are 3, 3, 3, 1, and 5 over 4 are 2, 2, 1, 0.

    Args:
        size: the length to cut.
        parts: the number of chunks.

    Returns:
        ``parts`` pairs ``(start, end)``; trailing chunks are empty where ``size`` runs out.

    Example::

        >>> tpf.sbp.chunk_bounds(10, 4)
        [(0, 3), (3, 6), (6, 9), (9, 10)]
        >>> tpf.sbp.chunk_bounds(5, 4)
        [(0, 2), (2, 4), (4, 5), (5, 5)]
    """
    step = math.ceil(size / parts) if size else 0
    return [(min(i * step, size), min((i + 1) * step, size)) for i in range(parts)]


def local_region(
    shape: Sequence[int], sbps: Sequence[Sbp], hierarchy: Sequence[int], coord: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, lengths) of the block of the global tensor held at mesh ``coord``.

    Splits apply axis by axis, each to what the previous axes left (DTensor's nested sharding).
    Broadcast and partial-sum axes leave the block whole.

    Args:
        shape: the global tensor's shape.
        sbps: its SBPs, one per placement axis, with split dims >= 0 (as ``normalize`` gives them).
        hierarchy: the placement's mesh shape (``Placement.hierarchy``).
        coord: a mesh coordinate (``Placement.coordinate(rank)``).

    Returns:
        ``(offsets, lengths)``: the block's start and size in every dimension of the tensor.

    Example::

        >>> import tpflow as tpf
        >>> tpf.sbp.local_region((10, 4), (tpf.sbp.split(0),), (4,), (3,))   # the last of 3, 3, 3, 1 rows
        ((9, 0), (1, 4))
        >>> tpf.sbp.local_region((8, 6), (tpf.sbp.split(0), tpf.sbp.split(0)), (2, 2), (1, 1))   # half of a half
        ((6, 0), (2, 6))
    """
    offsets, lengths = [0] * len(shape), list(shape)
    for s, parts, c in zip(sbps, hierarchy, coord):
        if isinstance(s, Split):
            start, end = chunk_bounds(lengths[s.dim], parts)[c]
            offsets[s.dim] += start
            lengths[s.dim] = end - start
    return tuple(offsets), tuple(lengths)


def dual(sbps: Sequence[Sbp]) -> tuple[Sbp, ...]:
    """The layout of a gradient: a partial sum's gradient is the same on every rank (broadcast).

    ``to_global``, ``from_local`` and ``matmul`` give an input's gradient this layout by default.

    Args:
        sbps: a tensor's SBPs, one per placement axis.

    Returns:
        The SBPs of its gradient: ``partial_sum`` replaced by ``broadcast``, the others kept.

    Example::

        >>> import tpflow as tpf
        >>> tpf.sbp.dual((tpf.sbp.partial_sum, tpf.sbp.split(0)))
        (sbp.broadcast, sbp.split(dim=0))
    """
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
    """The output SBP when (a, b) is legal on every axis, else None.

    For ``a [..., M, K] @ b [..., K, N]`` the legal (a, b) -> out signatures of one axis are: B x B -> B;
    S(i) x B -> S(i) for a's batch dims and M (S(i) x S(i) -> S(i) for the batch dims b shares); B x S(N) -> S(N);
    S(K) x S(K) -> P; P x B -> P and B x P -> P.

    Args:
        a_sbps, b_sbps: the SBPs of ``a`` and ``b``, one per placement axis, with split dims >= 0.
        a_ndim, b_ndim: the number of dimensions of ``a`` and ``b``.

    Returns:
        The output's SBPs, one per placement axis, or None when some axis has no legal signature.

    Example::

        >>> from tpflow import sbp
        >>> sbp.matmul_out_sbp((sbp.split(1),), (sbp.split(0),), 2, 2)
        (sbp.partial_sum,)
        >>> sbp.matmul_out_sbp((sbp.split(1),), (sbp.split(1),), 2, 2) is None
        True
    """
    table = {(a, b): o for a, b, o in _signatures(a_ndim, b_ndim)}
    out = tuple(table.get(pair) for pair in zip(a_sbps, b_sbps))
    return None if any(o is None for o in out) else out


def conversion_bytes(src: Sbp, dst: Sbp, nbytes: int, parts: int) -> float:
    """Bytes one rank sends to convert one axis from ``src`` to ``dst`` (ring collectives).

    With ``n = parts``: split -> broadcast (all-gather) sends ``(n - 1) / n * nbytes``; split -> another split
    (all-to-all) ``(n - 1) / n**2 * nbytes``; partial_sum -> broadcast (all-reduce) ``2 * (n - 1) / n * nbytes``;
    partial_sum -> split (reduce-scatter) ``(n - 1) / n * nbytes``. Conversions from broadcast and split ->
    partial_sum are local (0), as is any conversion over one rank or to the same SBP.

    Args:
        src, dst: the SBP of the axis before and after.
        nbytes: the size of the whole (global) tensor in bytes.
        parts: the number of ranks along the axis.

    Returns:
        The bytes, as a float.

    Example::

        >>> import tpflow as tpf
        >>> tpf.sbp.conversion_bytes(tpf.sbp.split(0), tpf.sbp.broadcast, 1024, 4)       # all-gather
        768.0
        >>> tpf.sbp.conversion_bytes(tpf.sbp.partial_sum, tpf.sbp.broadcast, 1024, 4)    # all-reduce
        1536.0
    """
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
    that moves the fewest bytes, chosen axis by axis.

    The bytes are those of ``conversion_bytes`` for boxing ``a`` and ``b`` on that axis; a tie goes to the
    signature listed first in ``matmul_out_sbp`` (B x B first). ``tpf.matmul`` uses this.

    Args:
        a_sbps, b_sbps: the SBPs of ``a`` and ``b``, one per placement axis, with split dims >= 0.
        a_ndim, b_ndim: the number of dimensions of ``a`` and ``b``.
        a_nbytes, b_nbytes: the sizes of the whole ``a`` and ``b`` in bytes.
        hierarchy: the placement's mesh shape (``Placement.hierarchy``).

    Returns:
        ``(a_to, b_to, out)``: the SBPs to box ``a`` and ``b`` to (their own when already legal) and the
        output's SBPs, each a tuple with one entry per placement axis.

    Example::

        >>> from tpflow import sbp
        >>> sbp.infer_matmul((sbp.split(1),), (sbp.split(1),), 2, 2, 4096, 4096, (2,))   # b re-split: 1024 bytes
        ((sbp.split(dim=1),), (sbp.split(dim=0),), (sbp.partial_sum,))
    """
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
