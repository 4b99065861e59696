"""Local -> global: a global tensor from each rank's block (OneFlow's ``to_global`` of a local tensor).

Without a global shape, the ranks exchange their blocks' shapes and dtypes in one fixed-size
all-gather (``tpflow.comm.wire``), which also checks that the blocks fit together, so a mismatch is
an error on every rank rather than a hang or a wrong value.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tpflow.comm import collectives, wire
from tpflow.global_tensor.blocks import Block, check_placement, wrap
from tpflow.global_tensor.boxing import box
from tpflow.placement import Placement
from tpflow.sbp import Broadcast, Sbp, Split, dual, from_dtensor, local_region, normalize

__all__ = ["from_block", "from_local"]


class _LocalToGlobal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, pl, sbps, shape, grad_sbps, sync_data):
        ctx.pl, ctx.grad_sbps, ctx.local_shape = pl, grad_sbps, local.shape
        coord = pl.coordinate()
        if coord is None:
            return wrap(None, pl, sbps, shape, local.dtype)
        if sync_data and any(isinstance(s, Broadcast) for s in sbps):
            local = local.detach().clone()
            for axis, s in enumerate(sbps):
                if isinstance(s, Broadcast) and pl.hierarchy[axis] > 1:
                    root = pl.rank_at(coord[:axis] + (0,) + coord[axis + 1:])
                    dist.broadcast(local, src=root, group=pl.mesh.get_group(axis))
        return wrap(local.detach(), pl, sbps, shape, local.dtype)

    @staticmethod
    def backward(ctx, grad):
        grad = box(grad, ctx.pl, from_dtensor(grad.placements), ctx.pl, ctx.grad_sbps)
        local = grad.to_local() if ctx.pl.coordinate() is not None else grad.to_local().new_zeros(ctx.local_shape)
        return local, None, None, None, None, None


def _all_gather_meta(local: torch.Tensor, device: torch.device) -> list[tuple[tuple[int, ...], object]]:
    """Every rank's (shape, dtype), in one fixed-size all-gather over the world."""
    meta = torch.tensor(wire.meta_ints(local.shape, local.dtype), device=device)
    metas = torch.empty(dist.get_world_size() * meta.numel(), dtype=meta.dtype, device=device)
    collectives.all_gather_single(metas, meta)
    out = []
    for ints in metas.view(-1, meta.numel()).tolist():
        shape, dtype = wire.read_meta_ints(ints)
        out.append((shape, "unsupported" if dtype is None else dtype))
    return out


def _global_shape(local: torch.Tensor, pl: Placement, sbp: object,
                  shape: Sequence[int] | None) -> tuple[tuple[int, ...], tuple[Sbp, ...]]:
    """(global shape, SBPs) of per-rank blocks, checked on every rank so a mismatch fails everywhere."""
    if shape is not None:
        shape = tuple(shape)
        sbps = normalize(sbp, pl.ndim, len(shape))
        coord = pl.coordinate()
        if coord is not None and tuple(local.shape) != local_region(shape, sbps, pl.hierarchy, coord)[1]:
            raise ValueError(
                f"rank {dist.get_rank()} holds a block of shape {tuple(local.shape)}, but global shape {shape} "
                f"with sbp {sbps} on {pl} gives it {local_region(shape, sbps, pl.hierarchy, coord)[1]}"
            )
        return shape, sbps
    members = {r: meta for r, meta in enumerate(_all_gather_meta(local, pl.device)) if r in pl}
    if len({m[1] for m in members.values()}) > 1:
        raise ValueError(f"the ranks of {pl} hold blocks of different dtypes: {members}")
    if len({len(m[0]) for m in members.values()}) > 1:
        raise ValueError(f"the ranks of {pl} hold blocks of different ndim: { {r: m[0] for r, m in members.items()} }")
    first = members[pl.flat_ranks[0]][0]
    sbps = normalize(sbp, pl.ndim, len(first))
    shape = list(first)
    for dim in {s.dim for s in sbps if isinstance(s, Split)}:
        along = [axis for axis, s in enumerate(sbps) if s == Split(dim)]
        shape[dim] = sum(members[r][0][dim] for r in pl.flat_ranks
                         if all(c == 0 for axis, c in enumerate(pl.coordinate(r)) if axis not in along))
    wrong = {r: m[0] for r, m in members.items()
             if m[0] != local_region(shape, sbps, pl.hierarchy, pl.coordinate(r))[1]}
    if wrong:
        expected = {r: local_region(shape, sbps, pl.hierarchy, pl.coordinate(r))[1] for r in wrong}
        raise ValueError(
            f"local blocks do not make a global tensor with sbp {sbps} on {pl}: ranks hold {wrong}, but global "
            f"shape {tuple(shape)} needs {expected} (split blocks follow torch.chunk sizes; other dims must agree)"
        )
    return tuple(shape), sbps


def from_local(local: torch.Tensor, placement: Placement, sbp: object, *, shape: Sequence[int] | None = None,
               grad_sbp: object = None, sync_data: bool = True) -> DTensor:
    """A global tensor from each rank's block (OneFlow's local -> global ``to_global``).

    With ``split`` each rank's tensor is its shard, with ``partial_sum`` its addend, with
    ``broadcast`` the whole value (copied from the axis' first rank when ``sync_data``).
    Without ``shape`` the ranks exchange their block shapes: one small collective that also
    checks they fit together. The gradient of ``local`` is this rank's block of the global
    gradient in layout ``grad_sbp`` (default: ``sbp``, with partial sums read as broadcast).

    That exchange is an all-gather over the whole world, so without ``shape`` every rank calls ``from_local``,
    ranks outside the placement included (their ``local``, ``torch.empty(0)`` say, is ignored, and they get an
    empty block and a zero gradient). Split blocks must follow ``torch.chunk``'s sizes and the other dimensions
    must agree. ``tpf.to_global`` of a plain tensor calls this.

    A ``local`` that is not a plain tensor is a ``TypeError``. Blocks that do not fit together (the message lists
    what each rank holds and what the global shape needs), blocks of different dtypes or ndims, a block that does
    not match a given ``shape``, or a ``grad_sbp`` whose blocks have another shape than ``sbp``'s are a
    ``ValueError`` on every rank.

    Args:
        local: this rank's block, a plain ``torch.Tensor``.
        placement: the ranks that hold the global tensor (``tpf.placement``).
        sbp: how the blocks make up the value: one SBP for a 1-D placement, else a tuple with one per axis.
        shape: the global shape, if known (skips the exchange; each rank then checks only its own block).
        grad_sbp: the layout of the global gradient whose blocks are ``local``'s gradient; it may differ from
            ``sbp`` only in ``broadcast`` / ``partial_sum``.
        sync_data: whether ``broadcast`` axes copy the value from the axis' first rank (False trusts the ranks
            to hold the same value already, and saves the broadcast).

    Returns:
        A global tensor (a ``DTensor``).

    Example::

        >>> import torch
        >>> import tpflow as tpf
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> rank = tpf.get_rank()
        >>> mine = torch.full((2 - rank, 3), float(rank))   # 2 rows on rank 0, 1 row on rank 1
        >>> tpf.from_local(mine, P, tpf.sbp.split(0)).shape
        torch.Size([3, 3])
        >>> s = tpf.from_local(torch.ones(2, 3), P, tpf.sbp.partial_sum, shape=(2, 3))
        >>> s.full_tensor()   # the sum of both ranks' ones
        tensor([[2., 2., 2.],
                [2., 2., 2.]])
    """
    if not isinstance(local, torch.Tensor) or isinstance(local, DTensor):
        raise TypeError(f"from_local takes a plain torch.Tensor, got {type(local).__name__}")
    pl = check_placement(placement)
    global_shape, sbps = _global_shape(local, pl, sbp, shape)
    grad_sbps = dual(sbps) if grad_sbp is None else normalize(grad_sbp, pl.ndim, len(global_shape))
    for coord in map(pl.coordinate, pl.flat_ranks):
        if local_region(global_shape, grad_sbps, pl.hierarchy, coord)[1] != \
                local_region(global_shape, sbps, pl.hierarchy, coord)[1]:
            raise ValueError(
                f"grad_sbp {grad_sbps} gives blocks of another shape than sbp {sbps}: the gradient of a local "
                "tensor must have its shape, so use grad_sbp that differs only in broadcast / partial_sum"
            )
    return _LocalToGlobal.apply(local, pl, sbps, global_shape, grad_sbps, sync_data)


def from_block(b: Block, placement: Placement) -> DTensor:
    """The global tensor whose block on this rank is ``b`` (``from_local`` with the shape known and no data
    synchronised: no communication), its gradient reaching ``b.local``.

    Args:
        b: this rank's ``Block`` (an empty ``local`` off ``placement``).
        placement: the placement ``b``'s SBPs lay it out on.

    Returns:
        A global tensor (a ``DTensor``).

    Example::

        >>> from tpflow.global_tensor.blocks import Block
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> x = tpf.randn(5, 3, placement=P, sbp=tpf.sbp.split(0))
        >>> torch.equal(from_block(Block.of(x), P).full_tensor(), x.full_tensor())
        True
    """
    return from_local(b.local, placement, b.sbp, shape=b.shape, sync_data=False)
