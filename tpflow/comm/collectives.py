"""Communication on local shards, with byte counters.

- ``exchange`` / ``post``: point-to-point transfers over the world group, for boxing across
  placements (ranks that share no mesh) and a pipeline's hand-offs between stages.
- ``all_gather`` / ``reduce_scatter`` along a dim, uneven chunks (``torch.chunk``'s rule)
  included: the library collectives, padded to equal chunks where sizes differ.
- Autograd-aware collectives for the parallel layers' hot path, each the conjugate of its
  backward: ``reduce`` (all-reduce / identity), ``gather`` (all-gather / take own chunk) and
  ``scatter`` (own chunk / all-gather); a no-op on a group of one. (Identity / all-reduce is
  ``kernels.linear``'s ``dgrad_hook``, so that it overlaps the weight gradient; all-gather /
  reduce-scatter pairs are the ring kernels.)

Every transfer is counted in ``stats``; a library collective counts the bytes of the ring
algorithm that implements it ((W-1)/W of the tensor per pass; gloo's reduce-scatter is an
all-reduce underneath, two passes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tpflow.sbp import chunk_range

__all__ = ["CommStats", "Pending", "all_gather", "all_reduce", "bounds", "count_ring", "exchange", "gather", "post",
           "reduce", "reduce_scatter", "ring_bytes", "scatter", "stats"]


@dataclass
class CommStats:
    """Bytes and messages this rank has sent since the last ``reset()``.

    Transfers inside a graph torch.compile traces are not counted: dynamo would bake the count into the
    graph and guard on its value, so every call changed it and recompiled until the recompile limit.

    Example::

        >>> tpf.comm.stats.reset()
        >>> # ... a training step ...
        >>> tpf.comm.stats.bytes_sent  # doctest: +SKIP
        8408064
    """

    bytes_sent: int = 0
    messages_sent: int = 0

    def add(self, nbytes: int, messages: int = 1) -> None:
        """Count ``messages`` transfers of ``nbytes`` in all (nothing while torch.compile traces)."""
        if not torch.compiler.is_compiling():
            self.bytes_sent += nbytes
            self.messages_sent += messages

    def reset(self) -> None:
        """Start counting from zero."""
        self.bytes_sent = 0
        self.messages_sent = 0


stats = CommStats()

# torch 2.13 renames the single-tensor collectives (the old names warn); 2.11 has only the old ones.
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class Pending:
    """Posted point-to-point transfers; their send buffers stay alive until ``wait`` returns."""

    def __init__(self) -> None:
        self.works: list = []
        self.buffers: list[torch.Tensor] = []

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works, self.buffers = [], []


def post(sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]], tag: int = 0,
         pending: Pending | None = None) -> Pending:
    """Post sends and receives without waiting (added to ``pending`` if given). ``recvs`` buffers are filled
    in place once waited on; empty tensors travel nowhere, on both sides."""
    pending = Pending() if pending is None else pending
    for peer, buf in recvs:
        if buf.numel():
            pending.works.append(dist.irecv(buf, src=peer, tag=tag))
    for peer, tensor in sends:
        if tensor.numel():
            pending.buffers.append(tensor.contiguous())
            pending.works.append(dist.isend(pending.buffers[-1], dst=peer, tag=tag))
            stats.add(tensor.numel() * tensor.element_size())
    return pending


def exchange(sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]) -> None:
    """Post every send and receive of one step at once, then wait for all of them.

    Posting all before waiting on any means two ranks that send to each other cannot
    deadlock. ``recvs`` buffers are filled in place; empty tensors are skipped.
    """
    post(sends, recvs).wait()


def bounds(size: int, parts: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each of ``parts`` chunks of ``size``, by ``torch.chunk``'s rule (tpflow's split)."""
    return [(offset, offset + length) for offset, length in (chunk_range(size, parts, i) for i in range(parts))]


def ring_bytes(nbytes: int, world: int, passes: int) -> int:
    """Bytes one rank sends in ``passes`` ring passes over ``nbytes`` on ``world`` ranks: (W-1)/W of it each."""
    return passes * (world - 1) * nbytes // world


def count_ring(t: torch.Tensor, world: int, passes: int) -> None:
    """Count ``passes`` ring passes over ``t`` on a group of ``world`` ranks."""
    stats.add(ring_bytes(t.numel() * t.element_size(), world, passes), passes * (world - 1))


def all_reduce(t: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """Sum ``t`` in place over ``group``; with ``async_op`` the work to wait on."""
    count_ring(t, dist.get_world_size(group), 2)
    return dist.all_reduce(t, group=group, async_op=async_op)


Chunks = Sequence[tuple[int, int]]


def all_gather(part: torch.Tensor, dim: int, chunks: Chunks, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's chunk along ``dim`` (rank i holds ``[start, end) = chunks[i]``), concatenated in rank order."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    part = part.movedim(dim, 0)
    if part.shape[0] != chunks[rank][1] - chunks[rank][0]:
        raise ValueError(f"all_gather: rank {rank} holds {part.shape[0]} along dim {dim}, but its chunk "
                         f"{list(chunks[rank])} has {chunks[rank][1] - chunks[rank][0]}")
    step = max(e - s for s, e in chunks)
    even = all(e - s == step for s, e in chunks)
    padded = part.contiguous() if even else part.new_zeros((step, *part.shape[1:]))
    if not even:
        padded[:part.shape[0]] = part
    out = part.new_empty((step * world, *part.shape[1:]))
    all_gather_single(out, padded, group=group)
    count_ring(out, world, 1)
    if not even:
        out = torch.cat([out[i * step:i * step + e - s] for i, (s, e) in enumerate(chunks)])
    return out.movedim(0, dim)


def reduce_scatter(full: torch.Tensor, dim: int, chunks: Chunks, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's chunk (``chunks[rank]`` along ``dim``) of the sum over ``group`` of ``full``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    full = full.movedim(dim, 0)
    step = max(e - s for s, e in chunks)
    if all(e - s == step for s, e in chunks) and chunks[-1][1] == full.shape[0]:
        padded = full.contiguous()
    else:
        padded = full.new_zeros((step * world, *full.shape[1:]))
        for i, (s, e) in enumerate(chunks):
            padded[i * step:i * step + e - s] = full[s:e]
    out = full.new_empty((step, *full.shape[1:]))
    reduce_scatter_single(out, padded, group=group)
    count_ring(padded, world, 1 if full.is_cuda else 2)
    return out[:chunks[rank][1] - chunks[rank][0]].movedim(0, dim)


def _chunk(t: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    start, end = bounds(t.shape[dim], dist.get_world_size(group))[dist.get_rank(group)]
    return t.narrow(dim, start, end - start)


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        if x.is_contiguous():  # in place: autograd raises if anything still needed the partial sum
            ctx.mark_dirty(x)
        else:
            x = x.contiguous()
        all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, size, group):
        ctx.dim, ctx.group = dim, group
        return all_gather(x, dim, bounds(size, dist.get_world_size(group)), group)

    @staticmethod
    def backward(ctx, dy):
        return _chunk(dy, ctx.dim, ctx.group).contiguous(), None, None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group, ctx.size = dim, group, x.shape[dim]
        return _chunk(x, dim, group).contiguous()

    @staticmethod
    def backward(ctx, dy):
        return all_gather(dy, ctx.dim, bounds(ctx.size, dist.get_world_size(ctx.group)), ctx.group), None, None


def _single(group: dist.ProcessGroup | None) -> bool:
    return group is None or dist.get_world_size(group) == 1


def reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-reduce forward, identity backward: partial sums leaving as one replicated value."""
    return x if _single(group) else _Reduce.apply(x, group)


def gather(x: torch.Tensor, dim: int, size: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather along ``dim`` (of full ``size``) forward; backward keeps this rank's chunk of the gradient."""
    return x if _single(group) else _Gather.apply(x, dim, size, group)


def scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's chunk along ``dim`` forward (no transfer); all-gather of the gradient backward."""
    return x if _single(group) else _Scatter.apply(x, dim, group)
