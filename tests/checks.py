"""Rank-side helpers for multi-rank tests: exact sources and an independent reassembly.

Values are small integers stored as floats, so sums of partials are exact and every
comparison can be ``torch.equal``. ``logical`` reassembles a global tensor from the raw
per-rank blocks with ``all_gather_object``, not through tpflow, so a boxing bug cannot hide
behind the same bug in the checker.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

import tpflow as tpf
from tpflow.sbp import Broadcast, PartialSum, local_region

S0, S1, B, P = tpf.sbp.split(0), tpf.sbp.split(1), tpf.sbp.broadcast, tpf.sbp.partial_sum
SBPS_2D = (S0, S1, B, P)


def ints(shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, tuple(shape), generator=g).float()


def block(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(offsets, lengths)):
        t = t.narrow(d, o, n)
    return t


def source(ref: torch.Tensor, pl, sbps, seed: int = 7, requires_grad: bool = False):
    """A global tensor of value ``ref`` whose partial-sum axes hold random addends (not zeros)."""
    coord = pl.coordinate()
    local = torch.empty(0)
    if coord is not None:
        offsets, lengths = local_region(ref.shape, sbps, pl.hierarchy, coord)
        on_first = all(c == 0 for s, c in zip(sbps, coord) if isinstance(s, PartialSum))
        local = block(ref, offsets, lengths).clone() if on_first else torch.zeros(lengths)
        for axis, s in enumerate(sbps):
            if isinstance(s, PartialSum):
                k = pl.hierarchy[axis]
                # the same addends on broadcast replicas: key on the other non-broadcast axes only
                others = tuple(c for a, (t, c) in enumerate(zip(sbps, coord))
                               if a != axis and not isinstance(t, Broadcast))
                key = hash((seed, axis, others)) % 2**31
                noise = [ints(lengths, key + c) for c in range(1, k)]
                local += -sum(noise) if coord[axis] == 0 else noise[coord[axis] - 1]
    x = tpf.from_local(local, pl, sbps, shape=ref.shape, sync_data=False)
    return x.detach().requires_grad_(requires_grad)


def logical(t) -> torch.Tensor | None:
    """The value of global tensor ``t`` reassembled from every rank's block (None if inconsistent)."""
    pl, sbps = tpf.get_placement(t), tpf.get_sbp(t)
    blocks: list = [None] * dist.get_world_size()
    dist.all_gather_object(blocks, t.to_local().detach().clone())
    out = torch.zeros(t.shape, dtype=t.dtype)
    seen: dict = {}
    for rank in pl.flat_ranks:
        coord = pl.coordinate(rank)
        offsets, lengths = local_region(t.shape, sbps, pl.hierarchy, coord)
        if tuple(blocks[rank].shape) != tuple(lengths):
            return None
        # broadcast replicas must be identical, not merely sum right
        key = tuple(c for s, c in zip(sbps, coord) if not isinstance(s, Broadcast))
        if key in seen and not torch.equal(seen[key], blocks[rank]):
            return None
        if key not in seen:
            seen[key] = blocks[rank]
            block(out, offsets, lengths).add_(blocks[rank])
    return out


def grad_block(g: torch.Tensor, t) -> torch.Tensor:
    """This rank's block of gradient ``g`` for output ``t`` (a partial sum's gradient is broadcast)."""
    pl, sbps = tpf.get_placement(t), tpf.sbp.dual(tpf.get_sbp(t))
    coord = pl.coordinate()
    if coord is None:
        return torch.empty(0)
    return block(g, *local_region(g.shape, sbps, pl.hierarchy, coord)).clone()


def backward_logical(out, g: torch.Tensor) -> None:
    """Backpropagate the logical gradient ``g`` of global ``out`` from its local blocks."""
    dual = tpf.sbp.dual(tpf.get_sbp(out))
    grad = tpf.from_local(grad_block(g, out), tpf.get_placement(out), dual, shape=g.shape, sync_data=False)
    if out.is_leaf:  # an identity conversion returned its input; DTensor cannot clone grads off-mesh
        out.grad = grad.detach()
    else:
        torch.autograd.backward(out, grad.detach())


def sbp_tuples(ndim: int):
    return list(itertools.product(SBPS_2D, repeat=ndim))
