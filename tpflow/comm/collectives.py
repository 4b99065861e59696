"""The library collectives on local shards, with uneven chunks and byte counters: what the layers and boxing
call when no ring of their own overlaps the transfer with compute.

    all_reduce       the sum of every rank's tensor, in place
    all_reduce_cat   the sum of every rank's pieces put back to back (a bucket of gradients)
    all_gather       every rank's chunk along a dim, concatenated (chunks of ``torch.chunk``'s rule or any)
    reduce_scatter   this rank's chunk of the sum
    exchange_counts  what every rank will send this one, from what this one sends each (before an all-to-all)
    all_to_all       rows to every rank by counts, uneven and zero counts included (tokens to experts,
                     a sequence split turned into a head split)

Uneven chunks are padded to the largest for the library's all-gather and reduce-scatter, and the padding is
dropped after. The ring-shaped ones count the bytes of the ring that implements them, the all-to-alls the bytes
they send other ranks (``tpflow.comm.accounting``); the autograd pairs built on these are in ``tpflow.comm.pairs``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from tpflow.comm import shm
from tpflow.comm.accounting import count_ring, stats
from tpflow.comm.peers import naming_late

__all__ = ["all_gather", "all_reduce", "all_reduce_cat", "all_to_all", "checked_counts", "exchange_counts",
           "reduce_scatter"]

# torch 2.13 renames the single-tensor collectives (the old names warn); 2.11 has only the old ones.
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

Chunks = Sequence[tuple[int, int]]


class _Done:
    """The work of a collective that finished before it returned."""

    def wait(self) -> None:
        pass


_DONE = _Done()


class _Queued:
    """The work of a collective queued on a shared-memory group's worker thread."""

    def __init__(self, future) -> None:
        self.future = future

    def wait(self) -> None:
        self.future.result()


def _host(group: dist.ProcessGroup, t: torch.Tensor) -> shm.HostGroup | None:
    """Where ``t``'s collective over ``group`` runs through shared memory: the group's region, else None (gloo, and
    what torch.compile traces)."""
    return shm.host_group(group) if shm.carries(t) and not torch.compiler.is_compiling() else None


def all_reduce(t: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
    """Sum ``t`` in place over ``group``; with ``async_op`` the work to wait on.

    Counted as two ring passes over ``t``.

    Args:
        t: this rank's tensor; it holds the sum once the all-reduce is done.
        group: the process group to sum over.
        async_op: return at once with the work instead of waiting for it.

    Returns:
        With ``async_op``, the work: ``wait()`` on it before reading ``t``; else None.

    Example::

        >>> t = torch.ones(4)
        >>> tpf.comm.all_reduce(t, torch.distributed.group.WORLD)
        >>> t                                           # on 2 ranks
        tensor([2., 2., 2., 2.])
    """
    count_ring(t, dist.get_world_size(group), 2)
    host = _host(group, t)
    if host is None and async_op:
        return dist.all_reduce(t, group=group, async_op=True)
    if host is None:
        with naming_late("an all-reduce", group):
            return dist.all_reduce(t, group=group)
    host.all_reduce(t)
    return _DONE if async_op else None


def all_reduce_cat(pieces: Sequence[torch.Tensor], group: dist.ProcessGroup, async_op: bool = False):
    """The sum over ``group`` of the pieces flattened and put back to back: a bucket of gradients. Through shared
    memory the pieces go straight to the other ranks, without the concatenated copy, and ``async_op`` runs it on
    the group's worker thread (as gloo and NCCL run theirs) while this one goes on.

    Counted as two ring passes over the concatenation.

    Args:
        pieces: tensors of one dtype and device.
        group: the process group to sum over.
        async_op: return at once with the work instead of waiting for it.

    Returns:
        ``(flat, work)``: the concatenation (the sum once ``work.wait()`` returns; at once without ``async_op``).

    Example::

        >>> flat, work = tpf.comm.all_reduce_cat([torch.ones(2), torch.zeros(1)], torch.distributed.group.WORLD)
        >>> work.wait()
        >>> flat                                        # on 2 ranks
        tensor([2., 2., 0.])
    """
    host = _host(group, pieces[0]) if all(shm.carries(p) and p.dtype == pieces[0].dtype for p in pieces) else None
    if host is None:
        flat = torch.cat([p.reshape(-1) for p in pieces])
        work = all_reduce(flat, group, async_op=async_op)
        return flat, work or _DONE
    flat = pieces[0].new_empty(sum(p.numel() for p in pieces))
    count_ring(flat, dist.get_world_size(group), 2)
    queued = host.all_reduce_cat(list(pieces), flat, async_op=async_op)
    return flat, _Queued(queued) if async_op else _DONE


def all_gather(part: torch.Tensor, dim: int, chunks: Chunks, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's chunk along ``dim`` (rank i holds ``[start, end) = chunks[i]``), concatenated in rank order.

    Chunks of unequal sizes are padded to the largest for the library collective, and the padding is dropped
    after. Counted as one ring pass over the gathered tensor.

    Args:
        part: this rank's chunk; its size along ``dim`` must be that of ``chunks[rank]`` (else ValueError).
        dim: the dim the chunks cut.
        chunks: ``(start, end)`` of every rank's chunk, in rank order, e.g. ``tpf.sbp.chunk_bounds(size, world)``.
        group: the process group to gather over.

    Returns:
        The whole tensor: ``part``'s shape but for ``dim``, which holds every chunk.

    Example::

        >>> rank = tpf.get_rank()                       # on 2 ranks: rank 0 holds rows [0, 3) of 5, rank 1 [3, 5)
        >>> part = torch.full((3 - rank, 2), float(rank))
        >>> full = tpf.comm.all_gather(part, 0, tpf.sbp.chunk_bounds(5, 2), torch.distributed.group.WORLD)
        >>> full[:, 0]
        tensor([0., 0., 0., 1., 1.])
    """
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
    host = _host(group, padded)
    if host is None:
        with naming_late("an all-gather", group):
            all_gather_single(out, padded, group=group)
    else:
        host.all_gather(out, padded)
    count_ring(out, world, 1)
    if not even:
        out = torch.cat([out[i * step:i * step + e - s] for i, (s, e) in enumerate(chunks)])
    return out.movedim(0, dim)


def reduce_scatter(full: torch.Tensor, dim: int, chunks: Chunks, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's chunk (``chunks[rank]`` along ``dim``) of the sum over ``group`` of ``full``.

    Chunks of unequal sizes are padded to the largest for the library collective. Counted as one ring pass
    over the (padded) tensor on CUDA, and two on CPU, where gloo's reduce-scatter is an all-reduce underneath.

    Args:
        full: this rank's whole tensor (its partial sum).
        dim: the dim the chunks cut.
        chunks: ``(start, end)`` of every rank's chunk, in rank order, e.g. ``tpf.sbp.chunk_bounds(size, world)``.
        group: the process group to sum over.

    Returns:
        Rows ``chunks[rank]`` along ``dim`` of the sum.

    Example::

        >>> full = torch.ones(5, 2)                     # a partial sum on each of 2 ranks
        >>> out = tpf.comm.reduce_scatter(full, 0, tpf.sbp.chunk_bounds(5, 2), torch.distributed.group.WORLD)
        >>> out                                         # on rank 1: rows [3, 5) of the sum
        tensor([[2., 2.],
                [2., 2.]])
    """
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
    host = _host(group, padded)
    if host is None:
        with naming_late("a reduce-scatter", group):
            reduce_scatter_single(out, padded, group=group)
    else:
        host.reduce_scatter(out, padded)
    count_ring(padded, world, 1 if full.is_cuda else 2)
    return out[:chunks[rank][1] - chunks[rank][0]].movedim(0, dim)


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """What every rank sends this one, from what this one sends every rank: the transpose of the ranks' count
    tables, so that an all-to-all's receivers can size their buffers (and an expert layer knows how many of
    each expert's tokens come from where).

    Args:
        counts: an integer tensor ``[W, ...]``; row ``r`` is what this rank sends rank ``r`` (a count, or a row
            of counts, e.g. per expert of rank ``r``).
        group: the process group of ``W`` ranks.

    Returns:
        ``[W, ...]`` of ``counts``' dtype and device: row ``r`` is rank ``r``'s row for this rank.

    Example::

        >>> rank = tpf.get_rank()                       # on 2 ranks: rank r sends r + 1 rows to each rank
        >>> tpf.comm.exchange_counts(torch.tensor([rank + 1, rank + 1]), torch.distributed.group.WORLD)
        tensor([1, 2])
    """
    world = dist.get_world_size(group)
    if counts.ndim == 0 or counts.shape[0] != world:
        raise ValueError(f"exchange_counts: counts of shape {tuple(counts.shape)}: one row per rank of a group of "
                         f"{world} is needed")
    counts = counts.contiguous()
    out = torch.empty_like(counts)
    with naming_late("the exchange of all-to-all counts", group):
        dist.all_to_all_single(out, counts, group=group)
    stats.add((world - 1) * counts[0].numel() * counts.element_size(), world - 1)
    return out


def checked_counts(x: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int],
                   world: int) -> tuple[list[int], list[int]]:
    """An all-to-all's counts as lists of ints, checked on this rank: one per rank, none negative, the send counts
    adding up to ``x``'s rows. (That each rank's receive counts are what the others send is the caller's: take
    them from ``exchange_counts``; NCCL would otherwise hang or mix rows up.)

    Args:
        x: the rows to send.
        send_counts, recv_counts: rows for, and from, each rank.
        world: the group's size.

    Returns:
        ``(send_counts, recv_counts)`` as lists of ints.

    Example::

        >>> from tpflow.comm.collectives import checked_counts
        >>> checked_counts(torch.zeros(3, 2), torch.tensor([1, 2]), [2, 0], world=2)
        ([1, 2], [2, 0])
        >>> checked_counts(torch.zeros(3, 2), [4, -1], [2, 0], world=2)
        Traceback (most recent call last):
        ValueError: all_to_all: counts must not be negative, got send [4, -1], receive [2, 0]
    """
    send, recv = [int(c) for c in send_counts], [int(c) for c in recv_counts]
    if len(send) != world or len(recv) != world:
        raise ValueError(f"all_to_all: {len(send)} send and {len(recv)} receive counts for a group of {world} "
                         "ranks: give one count per rank")
    if min(send + recv) < 0:
        raise ValueError(f"all_to_all: counts must not be negative, got send {send}, receive {recv}")
    if x.shape[0] != sum(send):
        raise ValueError(f"all_to_all: x has {x.shape[0]} rows but send_counts {send} add up to {sum(send)}")
    return send, recv


def all_to_all(x: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int],
               group: dist.ProcessGroup) -> torch.Tensor:
    """Rows of ``x`` to every rank by counts: the first ``send_counts[0]`` rows to rank 0, the next
    ``send_counts[1]`` to rank 1, and so on; returns the rows every rank sent this one, in rank order.

    Counts may be uneven or zero (nothing is dropped or padded). Rows sent to this rank itself are counted as
    no bytes; each other rank's rows as one message.

    Args:
        x: ``[sum(send_counts), ...]``: this rank's rows, grouped by the rank they go to.
        send_counts: rows for each rank, in rank order.
        recv_counts: rows from each rank, in rank order: what those ranks send this one (``exchange_counts`` of
            ``send_counts`` where the receiver does not know them; counts that disagree hang or mix rows up on NCCL).
        group: the process group.

    Returns:
        ``[sum(recv_counts), ...]``: rank 0's rows for this rank first, then rank 1's, and so on.

    Example::

        >>> rank = tpf.get_rank()                       # on 2 ranks: rank 0 sends 1 row to 0 and 2 to 1
        >>> send = [1, 2] if rank == 0 else [0, 1]
        >>> recv = tpf.comm.exchange_counts(torch.tensor(send), torch.distributed.group.WORLD).tolist()
        >>> x = torch.arange(sum(send), dtype=torch.float32) + 10 * rank
        >>> tpf.comm.all_to_all(x, send, recv, torch.distributed.group.WORLD)   # on rank 1
        tensor([ 1.,  2., 10.])
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    send_counts, recv_counts = checked_counts(x, send_counts, recv_counts, world)
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    with naming_late("an all-to-all", group):
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group)
    row = math.prod(x.shape[1:]) * x.element_size()
    others = [c for r, c in enumerate(send_counts) if r != rank and c]
    stats.add(sum(others) * row, len(others))
    return out
