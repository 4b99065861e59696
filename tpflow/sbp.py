"""SBP: how a global tensor is laid out over one axis of its placement.

``split(dim)`` cuts the tensor along ``dim`` (``torch.chunk`` sizes, so 10 rows over 4 ranks
are 3, 3, 3, 1, as DTensor does); ``broadcast`` gives every rank the whole tensor;
``partial_sum`` gives every rank a tensor of the full shape whose sum over the axis is the
value. A tensor on an N-D placement has a tuple of N of them, applied axis by axis.

This module is pure layout arithmetic: the SBPs, their DTensor placements, and which block of the global tensor a
mesh coordinate holds. Which matmul signatures are legal, and what a conversion costs, is
``tpflow.global_tensor.signatures``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement as DTensorPlacement

__all__ = [
    "Broadcast",
    "PartialSum",
    "Sbp",
    "Split",
    "broadcast",
    "chunk_bounds",
    "dual",
    "from_dtensor",
    "local_region",
    "normalize",
    "partial_sum",
    "split",
    "to_dtensor",
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
