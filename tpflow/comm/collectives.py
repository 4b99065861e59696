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

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tpflow.sbp import chunk_range

__all__ = ["CommStats", "Pending", "all_gather", "all_reduce", "bounds", "count_ring", "exchange", "gather", "post",
           "reduce", "reduce_chunk", "reduce_scatter", "ring_bytes", "scatter", "stats"]


@dataclass
class CommStats:
    """Bytes and messages this rank has sent since the last ``reset()``.

    Transfers inside a graph torch.compile traces are not counted: dynamo would bake the count into the
    graph and guard on its value, so every call changed it and recompiled until the recompile limit.
    ``tpf.comm.stats`` is the one this rank's collectives count into; a ``FakeTransport`` keeps its own.

    Args:
        bytes_sent: bytes sent so far.
        messages_sent: messages sent so far (a ring pass over ``W`` ranks counts ``W - 1``).

    Example::

        >>> tpf.comm.stats.reset()
        >>> # ... a training step ...
        >>> tpf.comm.stats.bytes_sent  # doctest: +SKIP
        8408064
        >>> counter = tpf.comm.CommStats()
        >>> counter.add(4096, messages=2)
        >>> counter.bytes_sent, counter.messages_sent
        (4096, 2)
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
    """Posted point-to-point transfers; their send buffers stay alive until ``wait`` returns.

    ``post`` makes one, or adds to the one it is given, so that the transfers of several calls are waited on
    together. The receive buffers hold their data once ``wait`` has returned.

    Example::

        >>> pending = tpf.comm.Pending()
        >>> # on rank 0 of 2: send x to rank 1 and receive its block into buf, in two calls
        >>> _ = tpf.comm.post([(1, x)], [], pending=pending)  # doctest: +SKIP
        >>> _ = tpf.comm.post([], [(1, buf)], pending=pending)  # doctest: +SKIP
        >>> pending.wait()  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self.works: list = []
        self.buffers: list[torch.Tensor] = []

    def wait(self) -> None:
        """Wait for every transfer, then let go of the send buffers."""
        for work in self.works:
            work.wait()
        self.works, self.buffers = [], []


def post(sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]], tag: int = 0,
         pending: Pending | None = None) -> Pending:
    """Post sends and receives without waiting (added to ``pending`` if given).

    ``recvs`` buffers are filled in place once waited on; empty tensors travel nowhere, on both sides.
    Peers are ranks of the world group. Receives are posted before sends; every send is counted in ``stats``,
    and the tensor it reads (made contiguous) is kept in the ``Pending`` until ``wait``.

    Args:
        sends: ``(peer, tensor)`` pairs: what to send to which rank.
        recvs: ``(peer, buffer)`` pairs: the buffers to receive into, and from which rank.
        tag: the tag of every message posted; both ends must use the same.
        pending: a ``Pending`` to add the transfers to; default: a new one.

    Returns:
        The ``Pending`` holding the transfers: call its ``wait()`` before reading the receive buffers.

    Example::

        >>> # on rank 0 of 2: send x to rank 1, and receive rank 1's block into buf
        >>> pending = tpf.comm.post([(1, x)], [(1, buf)])  # doctest: +SKIP
        >>> pending.wait()  # doctest: +SKIP
    """
    pending = Pending() if pending is None else pending
    for peer, buf in recvs:
        if buf.numel():
            _issue(dist.irecv, buf, peer, tag, pending)
    for peer, tensor in sends:
        if tensor.numel():
            pending.buffers.append(tensor.contiguous())
            _issue(dist.isend, pending.buffers[-1], peer, tag, pending)
            stats.add(tensor.numel() * tensor.element_size())
    return pending


_BATCH: list[tuple[str, list, list[Pending]]] = []  # the open batch(): its device type, its ops, their Pendings


def _issue(op, tensor: torch.Tensor, peer: int, tag: int, pending: Pending) -> None:
    if _BATCH and _BATCH[-1][0] == tensor.device.type:
        _BATCH[-1][1].append(dist.P2POp(op, tensor, peer, tag=tag))
        _BATCH[-1][2].append(pending)
    else:
        pending.works.append(op(tensor, peer, tag=tag))


@contextlib.contextmanager
def batch(device: str) -> Iterator[None]:
    """Post the point-to-point transfers of the block's ``post`` calls on ``device`` tensors as one group
    (``dist.batch_isend_irecv``), when the block ends without an error; others are posted at once.

    On NCCL a rank's sends and receives to one peer share a stream, where a send that is not yet matched holds
    up everything behind it: two ranks that each send, then receive from the other, wait for ever. In one group
    the send and the receive progress together (how a pipeline's stage sends an activation and receives a
    gradient at once).

    Args:
        device: the device type whose transfers are grouped (``"cuda"``; gloo's CPU tensors travel apart).

    Returns:
        A context manager; the transfers are posted when it exits, and waited on through their ``Pending``.

    Example::

        >>> with tpf.comm.batch("cuda"):  # doctest: +SKIP
        ...     tpf.comm.post([(peer, activation)], [(peer, grad_buf)], pending=pending)
        >>> pending.wait()  # doctest: +SKIP
    """
    _BATCH.append((device, [], []))
    try:
        yield
        _, ops, pendings = _BATCH[-1]
    finally:
        _BATCH.pop()
    if ops:
        works = dist.batch_isend_irecv(ops)
        if len(works) == len(ops):  # one per op (gloo), whose wait() must run once
            for pending, work in zip(pendings, works):
                pending.works.append(work)
        else:  # one for the group (NCCL), which any number of waits may wait on
            for pending in {id(p): p for p in pendings}.values():
                pending.works.extend(works)


def exchange(sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]) -> None:
    """Post every send and receive of one step at once, then wait for all of them.

    Posting all before waiting on any means two ranks that send to each other cannot
    deadlock. ``recvs`` buffers are filled in place; empty tensors are skipped.

    Args:
        sends: ``(peer, tensor)`` pairs, peers being ranks of the world group.
        recvs: ``(peer, buffer)`` pairs: the buffers to receive into, and from which rank.

    Example::

        >>> # ranks 0 and 1 swap blocks of the same shape
        >>> peer = 1 - tpf.get_rank()  # doctest: +SKIP
        >>> tpf.comm.exchange([(peer, block)], [(peer, buf)])  # doctest: +SKIP
    """
    post(sends, recvs).wait()


def bounds(size: int, parts: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each of ``parts`` chunks of ``size``, by ``torch.chunk``'s rule (tpflow's split).

    Args:
        size: the length to cut.
        parts: the number of chunks.

    Returns:
        ``parts`` pairs ``(start, end)``; trailing chunks are empty where ``size`` runs out.

    Example::

        >>> tpf.comm.bounds(10, 4)
        [(0, 3), (3, 6), (6, 9), (9, 10)]
        >>> tpf.comm.bounds(5, 4)
        [(0, 2), (2, 4), (4, 5), (5, 5)]
    """
    return [(offset, offset + length) for offset, length in (chunk_range(size, parts, i) for i in range(parts))]


def ring_bytes(nbytes: int, world: int, passes: int) -> int:
    """Bytes one rank sends in ``passes`` ring passes over ``nbytes`` on ``world`` ranks: (W-1)/W of it each.

    Args:
        nbytes: the size of the whole tensor, in bytes.
        world: the number of ranks in the ring.
        passes: ring passes: 1 for an all-gather or a reduce-scatter, 2 for an all-reduce.

    Returns:
        ``passes * (world - 1) * nbytes // world``.

    Example::

        >>> tpf.comm.ring_bytes(1 << 20, world=4, passes=2)  # an all-reduce of 1 MiB on 4 ranks
        1572864
    """
    return passes * (world - 1) * nbytes // world


def count_ring(t: torch.Tensor, world: int, passes: int) -> None:
    """Count ``passes`` ring passes over ``t`` on a group of ``world`` ranks.

    Adds ``ring_bytes`` of ``t``'s bytes and ``passes * (world - 1)`` messages to ``stats``.

    Args:
        t: the whole tensor the ring passes over, not one rank's chunk.
        world: the number of ranks in the group.
        passes: ring passes, as in ``ring_bytes``.

    Example::

        >>> tpf.comm.stats.reset()
        >>> tpf.comm.count_ring(torch.empty(1024), world=4, passes=1)
        >>> tpf.comm.stats.bytes_sent, tpf.comm.stats.messages_sent
        (3072, 3)
    """
    stats.add(ring_bytes(t.numel() * t.element_size(), world, passes), passes * (world - 1))


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
        >>> tpf.comm.all_reduce(t, torch.distributed.group.WORLD)  # doctest: +SKIP
        >>> t  # on 2 ranks  # doctest: +SKIP
        tensor([2., 2., 2., 2.])
    """
    count_ring(t, dist.get_world_size(group), 2)
    return dist.all_reduce(t, group=group, async_op=async_op)


Chunks = Sequence[tuple[int, int]]


def all_gather(part: torch.Tensor, dim: int, chunks: Chunks, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's chunk along ``dim`` (rank i holds ``[start, end) = chunks[i]``), concatenated in rank order.

    Chunks of unequal sizes are padded to the largest for the library collective, and the padding is dropped
    after. Counted as one ring pass over the gathered tensor.

    Args:
        part: this rank's chunk; its size along ``dim`` must be that of ``chunks[rank]`` (else ValueError).
        dim: the dim the chunks cut.
        chunks: ``(start, end)`` of every rank's chunk, in rank order, e.g. ``bounds(size, world)``.
        group: the process group to gather over.

    Returns:
        The whole tensor: ``part``'s shape but for ``dim``, which holds every chunk.

    Example::

        >>> # on 2 ranks: rank 0 holds rows [0, 3) of 5, rank 1 rows [3, 5)
        >>> rank = tpf.get_rank()  # doctest: +SKIP
        >>> part = torch.full((3 - rank, 2), float(rank))  # doctest: +SKIP
        >>> group = torch.distributed.group.WORLD  # doctest: +SKIP
        >>> full = tpf.comm.all_gather(part, 0, tpf.comm.bounds(5, 2), group)  # doctest: +SKIP
        >>> full.shape  # doctest: +SKIP
        torch.Size([5, 2])
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
    all_gather_single(out, padded, group=group)
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
        chunks: ``(start, end)`` of every rank's chunk, in rank order, e.g. ``bounds(size, world)``.
        group: the process group to sum over.

    Returns:
        Rows ``chunks[rank]`` along ``dim`` of the sum.

    Example::

        >>> full = torch.ones(5, 2)  # a partial sum on each of 2 ranks
        >>> group = torch.distributed.group.WORLD  # doctest: +SKIP
        >>> out = tpf.comm.reduce_scatter(full, 0, tpf.comm.bounds(5, 2), group)  # doctest: +SKIP
        >>> out  # on rank 1  # doctest: +SKIP
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


class _ReduceChunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group, ctx.size = dim, group, x.shape[dim]
        return reduce_scatter(x, dim, bounds(x.shape[dim], dist.get_world_size(group)), group)

    @staticmethod
    def backward(ctx, dy):
        return all_gather(dy, ctx.dim, bounds(ctx.size, dist.get_world_size(ctx.group)), ctx.group), None, None


def _single(group: dist.ProcessGroup | None) -> bool:
    return group is None or dist.get_world_size(group) == 1


def reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-reduce forward, identity backward: partial sums leaving as one replicated value.

    A no-op on a group of one (or None). A contiguous ``x`` is summed in place, and autograd raises if
    anything still needed the partial sum; any other ``x`` is summed in a contiguous copy.

    Args:
        x: this rank's partial sum.
        group: the process group to sum over; None: no parallelism.

    Returns:
        The sum over ``group`` (``x`` itself on a group of one).

    Example::

        >>> x = torch.randn(4, 8)
        >>> tpf.comm.reduce(x, None) is x  # a group of one: nothing to do
        True
        >>> group = torch.distributed.group.WORLD  # doctest: +SKIP
        >>> y = tpf.comm.reduce(partial, group)  # a row-parallel layer's partial sums  # doctest: +SKIP
    """
    return x if _single(group) else _Reduce.apply(x, group)


def gather(x: torch.Tensor, dim: int, size: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather along ``dim`` (of full ``size``) forward; backward keeps this rank's chunk of the gradient.

    A no-op on a group of one (or None). Chunks follow ``torch.chunk``'s rule (``bounds``).

    Args:
        x: this rank's chunk along ``dim``, ``bounds(size, world)[rank]``.
        dim: the dim to gather along.
        size: the whole tensor's size along ``dim``.
        group: the process group to gather over; None: no parallelism.

    Returns:
        The whole tensor, ``size`` along ``dim`` (``x`` itself on a group of one).

    Example::

        >>> x = torch.randn(4, 8)
        >>> tpf.comm.gather(x, 1, 8, None) is x
        True
        >>> group = torch.distributed.group.WORLD  # doctest: +SKIP
        >>> y = tpf.comm.gather(x, 1, 16, group)  # 2 ranks of 8 columns each  # doctest: +SKIP
        >>> y.shape  # doctest: +SKIP
        torch.Size([4, 16])
    """
    return x if _single(group) else _Gather.apply(x, dim, size, group)


def scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's chunk along ``dim`` forward (no transfer); all-gather of the gradient backward.

    A no-op on a group of one (or None). Chunks follow ``torch.chunk``'s rule (``bounds``).

    Args:
        x: the whole tensor, the same on every rank of ``group``.
        dim: the dim to cut.
        group: the process group whose ranks take a chunk each; None: no parallelism.

    Returns:
        This rank's chunk, contiguous (``x`` itself on a group of one).

    Example::

        >>> x = torch.arange(6.0)
        >>> tpf.comm.scatter(x, 0, None) is x
        True
        >>> group = torch.distributed.group.WORLD  # doctest: +SKIP
        >>> tpf.comm.scatter(x, 0, group)  # on rank 1 of 2  # doctest: +SKIP
        tensor([3., 4., 5.])
    """
    return x if _single(group) else _Scatter.apply(x, dim, group)


def reduce_chunk(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Reduce-scatter along ``dim`` forward: this rank's chunk of the sum of every rank's ``x``; all-gather of the
    gradient backward. Partial sums leaving as one sequence-parallel value (a vocabulary-parallel embedding's).

    A no-op on a group of one (or None). Chunks follow ``torch.chunk``'s rule (``bounds``).

    Args:
        x: this rank's partial sum, whole along ``dim``.
        dim: the dim to cut.
        group: the process group to sum over; None: no parallelism.

    Returns:
        This rank's chunk of the sum (``x`` itself on a group of one).

    Example::

        >>> x = torch.ones(4, 2)
        >>> tpf.comm.reduce_chunk(x, 0, None) is x
        True
        >>> group = torch.distributed.group.WORLD  # doctest: +SKIP
        >>> tpf.comm.reduce_chunk(x, 0, group)  # on rank 0 of 2  # doctest: +SKIP
        tensor([[2., 2.],
                [2., 2.]])
    """
    return x if _single(group) else _ReduceChunk.apply(x, dim, group)
