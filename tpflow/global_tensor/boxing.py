"""Boxing: a global tensor's value moved to another layout, within a placement or across placements.

Within a placement, DTensor's ``redistribute`` does the work, plus the conversions to
``partial_sum`` that DTensor keeps internal (done locally: no communication). Across placements
with different ranks, blocks travel point to point: directly when both sides have the same mesh
shape and SBP, else gathered on the source, sent, and cut on the destination. ``post_across``
starts such a transfer without waiting, which is how a pipeline hands activations on.
No autograd here: ``convert`` and ``local`` wrap these in autograd functions.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tpflow import comm, config
from tpflow.global_tensor.blocks import Block, is_zero_partial, region_of, wrap
from tpflow.placement import Placement
from tpflow.sbp import Broadcast, PartialSum, Sbp, Split, broadcast, local_region, to_dtensor

__all__ = ["box", "box_within", "direct_route", "post_across"]


def box(x: DTensor, src_pl: Placement, src: tuple[Sbp, ...], dst_pl: Placement, dst: tuple[Sbp, ...]) -> DTensor:
    """A new DTensor of x's value in the new layout (never x itself: autograd may steal it as a grad).

    The same layout gives a new DTensor over the same block; the same placement goes through ``box_within``;
    other ranks get their blocks point to point. Changing the device type (``"cpu"`` to ``"cuda"``) is a
    ``ValueError``. Every rank of both placements must call it. ``to_global`` is its differentiable form.

    Args:
        x: a global tensor.
        src_pl, src: ``x``'s placement and SBPs (a tuple, one per axis, split dims >= 0).
        dst_pl, dst: the placement and SBPs to move the value to.

    Returns:
        A global tensor on ``dst_pl`` with SBPs ``dst``.

    Example::

        >>> import tpflow as tpf
        >>> from tpflow.global_tensor.boxing import box
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> x = tpf.randn(4, 5, placement=P, sbp=tpf.sbp.split(0))
        >>> y = box(x, P, (tpf.sbp.split(0),), P, (tpf.sbp.broadcast,))   # an all-gather
        >>> tpf.get_sbp(y)
        (sbp.broadcast,)
    """
    if (src_pl, src) == (dst_pl, dst):
        return wrap(x.to_local() if src_pl.coordinate() is not None else None, dst_pl, dst, x.shape, x.dtype)
    if src_pl == dst_pl:
        return box_within(x, src_pl, src, dst)
    if src_pl.type != dst_pl.type:
        raise ValueError(
            f"to_global from {src_pl} to {dst_pl} changes the device type: keep the type and move the ranks, "
            "or convert the local tensors with .to(device) first"
        )
    return _box_across(x, src_pl, src, dst_pl, dst)


def box_within(x: DTensor, pl: Placement, src: tuple[Sbp, ...], dst: tuple[Sbp, ...]) -> DTensor:
    """DTensor redistributes to every SBP but partial sum; axes that become partial sums are
    made locally: a split block is placed in zeros, a broadcast one kept on coordinate 0.

    Unlike ``box``, it returns ``x`` itself when ``src == dst``. Ranks outside ``pl`` get an empty block without
    communicating; the ranks of ``pl`` must all call it.

    Args:
        x: a global tensor on ``pl``.
        pl: its placement.
        src, dst: its SBPs and the SBPs to convert to (tuples, one per axis, split dims >= 0).

    Returns:
        A global tensor on ``pl`` with SBPs ``dst``.

    Example::

        >>> import tpflow as tpf
        >>> from tpflow.global_tensor.boxing import box_within
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> x = tpf.randn(4, 5, placement=P, sbp=tpf.sbp.split(0))
        >>> p = box_within(x, P, (tpf.sbp.split(0),), (tpf.sbp.partial_sum,))   # local: own rows placed in zeros
        >>> tpf.to_local(p).shape
        torch.Size([4, 5])
    """
    if src == dst:
        return x
    if pl.coordinate() is None:  # nothing to do off the placement; DTensor would build a malformed spec here
        return wrap(None, pl, dst, x.shape, x.dtype)
    mid = tuple(s if isinstance(d, PartialSum) else d for s, d in zip(src, dst))
    # a split block placed in zeros only covers its own rows when no other axis splits that dim
    nested = [s.dim for s in mid + dst if isinstance(s, Split)]
    mid = tuple(broadcast if isinstance(m, Split) and isinstance(d, PartialSum) and nested.count(m.dim) > 1 else m
                for m, d in zip(mid, dst))
    y = x if mid == src else x.redistribute(pl.mesh, to_dtensor(mid))
    config.debug("boxing %s -> %s on %s: redistribute to %s%s", src, dst, pl, mid,
              "" if mid == dst else ", then local partial-sum blocks")
    if mid == dst:
        return y
    coord = pl.coordinate()
    local = y.to_local()
    dst_off, dst_len = local_region(x.shape, dst, pl.hierarchy, coord)
    zero = any(isinstance(m, Broadcast) and isinstance(d, PartialSum) and c != 0 for m, d, c in zip(mid, dst, coord))
    if zero:
        local = local.new_zeros(dst_len)
    elif any(isinstance(m, Split) and isinstance(d, PartialSum) for m, d in zip(mid, dst)):
        mid_off, mid_len = local_region(x.shape, mid, pl.hierarchy, coord)
        embedded = local.new_zeros(dst_len)
        region_of(embedded, [m - d for m, d in zip(mid_off, dst_off)], mid_len).copy_(local)
        local = embedded
    return wrap(local, pl, dst, x.shape, x.dtype)


@functools.lru_cache(maxsize=4096)
def _across_plan(src_pl: Placement, src: tuple[Sbp, ...], dst_pl: Placement, dst: tuple[Sbp, ...],
                 shape: tuple[int, ...]) -> tuple[bool, tuple[tuple[int, int, tuple, tuple], ...]]:
    """(direct, transfers): every (sender, receiver, offsets, lengths) block of the conversion.

    Direct when both sides have the same mesh shape and SBP: coordinate i sends its block to
    coordinate i. Otherwise the source is gathered to broadcast and each destination block is
    cut from it by one sender, receivers that are also sources cutting their own; partial-sum
    blocks off coordinate 0 are zeros and travel nowhere.
    """
    src_ranks = src_pl.flat_ranks
    direct = src_pl.hierarchy == dst_pl.hierarchy and src == dst
    transfers, remote = [], 0
    for j, receiver in enumerate(dst_pl.flat_ranks):
        coord = dst_pl.coordinate(receiver)
        offsets, lengths = local_region(shape, dst, dst_pl.hierarchy, coord)
        if direct:
            transfers.append((src_ranks[j], receiver, offsets, lengths))
        elif not is_zero_partial(dst, coord):
            if receiver in src_ranks:
                sender = receiver
            else:
                sender, remote = src_ranks[remote % len(src_ranks)], remote + 1
            transfers.append((sender, receiver, offsets, lengths))
    return direct, tuple(transfers)


def direct_route(src_pl: Placement, src: tuple[Sbp, ...], dst_pl: Placement, dst: tuple[Sbp, ...],
                 shape: tuple[int, ...]) -> tuple[tuple[int, int, tuple[int, ...]], ...] | None:
    """Where boxing across placements is one message from each source rank to the destination rank at its
    coordinate (both sides of one mesh shape and SBP, no rank on both): each ``(sender, receiver, block shape)``;
    else None. A pipeline's hand-off carries its header inside such a message.

    Args:
        src_pl, src: the source placement and SBPs.
        dst_pl, dst: the destination placement and SBPs.
        shape: the global shape.

    Returns:
        The ``(sender, receiver, block shape)`` triples, or None where the route gathers, or keeps a block on a rank.

    Example (4 ranks)::

        >>> import tpflow as tpf
        >>> P, Q = tpf.placement("cpu", ranks=[0, 1]), tpf.placement("cpu", ranks=[2, 3])
        >>> direct_route(P, (tpf.sbp.split(0),), Q, (tpf.sbp.split(0),), (5, 2))
        ((0, 2, (3, 2)), (1, 3, (2, 2)))
    """
    direct, transfers = _across_plan(src_pl, src, dst_pl, dst, shape)
    if not direct or any(sender == receiver for sender, receiver, _, _ in transfers):
        return None
    return tuple((sender, receiver, tuple(lengths)) for sender, receiver, _, lengths in transfers)


def post_across(x: Block, src_pl: Placement, dst_pl: Placement, dst: tuple[Sbp, ...], tag: int = 0,
                pending: comm.Pending | None = None) -> tuple[comm.Pending, torch.Tensor | None]:
    """Post this rank's part of boxing ``x`` from ``src_pl`` to ``dst_pl`` without waiting: its sends and
    receives. Returns the transfers and this rank's destination block (None off ``dst_pl``), complete once they
    are waited on.

    The plan is direct when both sides have the same mesh shape and SBP; otherwise source ranks first gather
    ``x`` to broadcast among themselves (a collective over ``src_pl``) and each destination block is cut by one
    sender. Pipelines use it to hand activations on while computing.

    Args:
        x: this rank's ``Block`` of the tensor laid out on ``src_pl``; off ``src_pl`` an empty one
            (``Block.absent``), whose SBPs, shape and dtype say what to receive.
        src_pl: the source placement (``x.sbp`` lays the tensor out on it, split dims >= 0).
        dst_pl, dst: the destination placement and SBPs.
        tag: the point-to-point message tag, which keeps transfers between the same ranks apart.
        pending: a ``comm.Pending`` to add the transfers to (default: a new one).

    Returns:
        ``(pending, local)``: the posted transfers, and this rank's block of the destination (None on ranks
        outside ``dst_pl``), valid after ``pending.wait()``.

    Example::

        >>> from tpflow.global_tensor.blocks import Block
        >>> P, Q = tpf.placement("cpu", ranks=[0, 1]), tpf.placement("cpu", ranks=[1])
        >>> x = tpf.tensor(torch.arange(4.0), placement=P, sbp=tpf.sbp.split(0))
        >>> pending, local = post_across(Block.of(x), P, Q, (tpf.sbp.broadcast,))
        >>> pending.wait()
        >>> local                                       # on rank 1: the whole value (None off Q)
        tensor([0., 1., 2., 3.])
    """
    rank, src, shape = dist.get_rank(), x.sbp, x.shape
    direct, transfers = _across_plan(src_pl, src, dst_pl, dst, shape)
    source = None
    if rank in src_pl and direct:
        source = x.local
    elif rank in src_pl:  # a global tensor only where the route gathers it
        whole = (broadcast,) * src_pl.ndim
        source = box_within(wrap(x.local, src_pl, src, shape, x.local.dtype), src_pl, src, whole).to_local()
    sends, recvs, local = [], [], None
    for sender, receiver, offsets, lengths in transfers:
        piece = None
        if sender == rank:
            piece = source if direct else region_of(source, offsets, lengths)
            if receiver != rank:
                sends.append((receiver, piece))
        if receiver == rank:
            if sender == rank:
                local = piece.clone()
            else:
                local = torch.empty(lengths, dtype=x.local.dtype, device=dst_pl.device)
                recvs.append((sender, local))
    before = comm.stats.bytes_sent
    pending = comm.post(sends, recvs, tag, pending)
    coord = dst_pl.coordinate()
    if coord is not None and local is None:  # a partial-sum block off coordinate 0
        local = torch.zeros(local_region(shape, dst, dst_pl.hierarchy, coord)[1], dtype=x.local.dtype,
                            device=dst_pl.device)
    config.debug("boxing %s on %s -> %s on %s: %s, %d message(s) and %d byte(s) sent by this rank", src, src_pl, dst,
              dst_pl, "direct send/recv" if direct else "gather on source, send blocks, slice on destination",
              len(sends), comm.stats.bytes_sent - before)
    return pending, local


def _box_across(x: DTensor, src_pl: Placement, src: tuple[Sbp, ...], dst_pl: Placement,
                dst: tuple[Sbp, ...]) -> DTensor:
    pending, local = post_across(Block(x.to_local(), src, tuple(x.shape)), src_pl, dst_pl, dst)
    pending.wait()
    return wrap(local, dst_pl, dst, x.shape, x.dtype)
