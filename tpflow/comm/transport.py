"""How the ring collectives move tensors: a small interface, and its torch.distributed transport.

    sends, recvs = transport.post(sends=[(tensor, peer)], recvs=[(buffer, peer)])   # start all at once
    recvs.wait()                                                                   # buffers are filled

A step's send and receive are posted together: on NCCL they go into one group, which is what keeps
a two-rank ring (both ranks sending to each other) from deadlocking. Peers are ranks of the
transport's group. Every transport counts the bytes and messages it sends.

The rings themselves are written once, here, over ``post``: ``ring_reduce_scatter`` and
``ring_all_gather`` take a hook that does the compute of each chunk, so the fused kernels put a
matmul there and the plain collectives a copy or an add.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from tpflow.comm import collectives
from tpflow.comm.accounting import CommStats, stats
from tpflow.comm.peers import timed_out, waiting_on
from tpflow.sbp import chunk_bounds

__all__ = ["DistTransport", "Handle", "Transport", "as_transport"]

Pairs = Sequence[tuple[torch.Tensor, int]]


def _sub_bounds(start: int, end: int, parts: int) -> list[tuple[int, int]]:
    return [(start + a, start + b) for a, b in chunk_bounds(end - start, parts)]


class Handle:
    """Completion of a set of posted operations.

    ``Transport.post`` returns one for its sends and one for its receives. ``wait`` returns once the operations
    are done or, on NCCL, once the current stream waits for them (see ``DistTransport``); a second ``wait`` is
    a no-op.

    Args:
        works: the operations, objects with a ``wait()`` method (torch.distributed works); none: already done.
        peers: the rank each work waits for (of ``group``), named if it times out.
        group: the process group ``peers`` are ranks of (None: the world's ranks).

    Example::

        >>> done = tpf.comm.Handle()  # nothing to wait for
        >>> done.wait()
    """

    def __init__(self, works: Sequence = (), peers: Sequence[int] = (), group: dist.ProcessGroup | None = None) -> None:
        # peers: the group's ranks the works wait for, one each (made world ranks only when one is late)
        self._works, self._peers, self._group = list(works), list(peers), group

    def wait(self) -> None:
        """Wait for every operation; later calls return at once. A timeout names the rank it waited for."""
        for j, work in enumerate(self._works):
            try:
                work.wait()
            except RuntimeError as e:
                if not timed_out(e):
                    raise
                ranks = [r if self._group is None else dist.get_global_rank(self._group, r) for r in self._peers]
                who = f"rank {ranks[j]}" if len(ranks) == len(self._works) else f"one of ranks {sorted(set(ranks))}"
                raise waiting_on("a ring transfer", who, e) from e
        self._works = []


class Transport(ABC):
    """Point-to-point messages between the ``world_size`` ranks of one group.

    A subclass sets ``rank``, ``world_size`` and ``stats`` and implements ``post``; the two rings
    (``ring_reduce_scatter``, ``ring_all_gather``) and the plain collectives over them (``reduce_scatter``,
    ``all_gather``, ``gather_ints``) come with the interface. ``DistTransport`` runs over torch.distributed,
    ``FakeTransport`` over threads of one process.

    Attributes:
        rank: this rank, in ``[0, world_size)``.
        world_size: the number of ranks in the group.
        stats: the ``CommStats`` the sends are counted in.

    Example::

        >>> def swap(transport):  # two ranks send each other their rank
        ...     peer, buf = 1 - transport.rank, torch.empty(3)
        ...     sent, got = transport.post(sends=[(torch.full((3,), float(transport.rank)), peer)],
        ...                                recvs=[(buf, peer)])
        ...     got.wait()
        ...     sent.wait()
        ...     return buf
        >>> tpf.comm.FakeWorld(2).run(swap)
        [tensor([1., 1., 1.]), tensor([0., 0., 0.])]
    """

    rank: int
    world_size: int
    stats: CommStats

    @abstractmethod
    def post(self, sends: Pairs = (), recvs: Pairs = (), tag: int = 0) -> tuple[Handle, Handle]:
        """Start every send and receive; returns (handle of the sends, handle of the receives).

        A send's tensor must not change until its handle is waited on; a receive's buffer is
        filled once its handle is. Messages between two ranks arrive in the order they were
        posted, and both ends must post them in the same order: ``tag`` is honoured by gloo and
        the fake transport, but NCCL matches by order alone."""

    def _count(self, sends: Pairs) -> None:
        for tensor, _ in sends:
            self.stats.add(tensor.numel() * tensor.element_size())

    # The two rings. ``bounds[c]`` are the rows of chunk c, which rank c owns.

    def ring_reduce_scatter(self, bounds: Sequence[tuple[int, int]], compute: Callable, *, width: int,
                            dtype: torch.dtype, device: torch.device, splits: int = 1, add_late: bool = False,
                            after: Callable[[int, int], None] | None = None) -> None:
        """Reduce chunk c's partials of every rank onto rank c, around the ring r -> r + 1.

        At step s this rank computes chunk ``(r - s - 1) mod W``: ``compute(start, end, acc, last)``
        returns the partial of rows ``[start, end)`` plus ``acc`` (the sum so far, received from
        r - 1 as ``[end - start, width]`` of ``dtype``; None at step 0). That is sent on to r + 1,
        except at the last step (``last``), where the chunk is this rank's own and fully reduced.
        ``after(start, end)``, if given, runs once the piece's send has started: other work on
        those rows (a weight gradient) that the transfer can hide behind.

        Each chunk travels as ``splits`` pieces (the ``ring_splits`` switch of ``tpflow.config`` sets the default
        per device). ``compute`` adds ``acc`` inside the matmul, so it cannot start before ``acc`` arrives; with
        one piece a rank would wait, every step, for its
        neighbour's whole chunk to cross the link, since the neighbour finished computing it at
        the same moment. With two, the first piece crosses while the second computes.
        ``add_late`` instead computes each piece's product while its ``acc`` crosses the link, and
        adds ``acc`` after it arrives: the whole transfer hides, even with one message, at the price
        of that extra pass over the piece (``compute`` then gets ``acc=None`` and its result must be
        writable in place).
        Sends the rows of every chunk but its own, in ``splits * (W - 1)`` messages.
        """
        W, r = self.world_size, self.rank
        right, left = (r + 1) % W, (r - 1) % W
        inbox: list[tuple[Handle, torch.Tensor | None]] = [(Handle(), None)] * splits
        in_flight: list[Handle] = []
        for s in range(W):
            last = s == W - 1
            pieces = _sub_bounds(*bounds[(r - s - 1) % W], splits)
            upcoming = None if last else _sub_bounds(*bounds[(r - s - 2) % W], splits)
            for j, (start, end) in enumerate(pieces):
                got, acc = inbox[j]
                if add_late and acc is not None:
                    part = compute(start, end, None, last)
                    got.wait()
                    part += acc
                else:
                    got.wait()
                    part = compute(start, end, acc, last)
                if upcoming is not None:
                    rows = upcoming[j][1] - upcoming[j][0]
                    buf = torch.empty(rows, width, dtype=dtype, device=device) if rows else None
                    sent, got = self.post(sends=[(part, right)] if end > start else [],
                                          recvs=[(buf, left)] if rows else [], tag=j)
                    in_flight.append(sent)
                    inbox[j] = (got, buf)
                if after is not None and end > start:
                    after(start, end)
        for handle in in_flight:
            handle.wait()

    def ring_all_gather(self, out: torch.Tensor, bounds: Sequence[tuple[int, int]],
                        on_chunk: Callable[[int, int], None]) -> None:
        """Gather every rank's rows into ``out`` (this rank's own rows already there), around the ring.

        A received chunk is forwarded to r + 1 before ``on_chunk(start, end)`` computes on it, so the
        next chunk is on the wire during the compute. Sends (W-1)/W of the rows in W-1 messages.
        """
        W, r = self.world_size, self.rank
        right, left = (r + 1) % W, (r - 1) % W
        got, in_flight = Handle(), []
        for s in range(W):
            got.wait()
            start, end = bounds[(r - s) % W]
            if s < W - 1:
                n_start, n_end = bounds[(r - s - 1) % W]
                sent, got = self.post(sends=[(out[start:end], right)] if end > start else [],
                                      recvs=[(out[n_start:n_end], left)] if n_end > n_start else [])
                in_flight.append(sent)
            if end > start:
                on_chunk(start, end)
        for handle in in_flight:
            handle.wait()

    # Plain collectives (no compute inside): the fallback below the size where rings pay.

    def reduce_scatter(self, full: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> torch.Tensor:
        """This rank's rows of the sum over ranks of the 2-D ``full``."""
        out = []

        def add(start: int, end: int, acc: torch.Tensor | None, last: bool) -> torch.Tensor:
            part = full[start:end] if acc is None else full[start:end] + acc
            if last:
                out.append(part.clone() if acc is None else part)
            return part

        self.ring_reduce_scatter(bounds, add, width=full.shape[1], dtype=full.dtype, device=full.device)
        return out[0]

    def gather_ints(self, value: int, device: torch.device | str = "cpu") -> list[int]:
        """Every rank's ``value`` (a tiny all-gather, counted like any other)."""
        one = chunk_bounds(self.world_size, self.world_size)
        return self.all_gather(torch.tensor([[value]], device=device), one).flatten().tolist()

    def all_gather(self, part: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> torch.Tensor:
        """Every rank's rows, concatenated in rank order."""
        out = part.new_empty((bounds[-1][1], *part.shape[1:]))
        out[slice(*bounds[self.rank])] = part
        self.ring_all_gather(out, bounds, lambda start, end: None)
        return out


class DistTransport(Transport):
    """torch.distributed point-to-point over a process group: gloo on CPU, NCCL on CUDA.

    On NCCL a step's operations are one group launched on NCCL's own stream, ordered after the
    kernels already queued on the current stream, and ``wait`` only makes the current stream wait
    for them: the host never blocks, and the next chunk's matmul runs beside the transfer.
    Its bytes count into ``tpflow.comm.stats`` with the rest of this rank's traffic.

    Args:
        group: the process group whose ranks the peers are; default: the world group.

    Example::

        >>> tpf.init_distributed()
        >>> transport = tpf.comm.DistTransport()
        >>> transport.gather_ints(10 + transport.rank)  # under python -m tpflow.launch --nproc_per_node 2
        [10, 11]
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group or dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.stats = stats

    def post(self, sends: Pairs = (), recvs: Pairs = (), tag: int = 0) -> tuple[Handle, Handle]:
        ops = [dist.P2POp(dist.irecv, buf, group=self.group, group_peer=peer, tag=tag) for buf, peer in recvs]
        ops += [dist.P2POp(dist.isend, t, group=self.group, group_peer=peer, tag=tag) for t, peer in sends]
        if not ops:
            return Handle(), Handle()
        self._count(sends)
        works = dist.batch_isend_irecv(ops)
        peers = [peer for _, peer in (*recvs, *sends)]
        if len(works) != len(ops):  # NCCL coalesces the group into one work
            both = Handle(works, peers, self.group)
            return both, both
        return (Handle(works[len(recvs):], peers[len(recvs):], self.group),
                Handle(works[:len(recvs)], peers[:len(recvs)], self.group))

    def reduce_scatter(self, full: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> torch.Tensor:
        """NCCL's reduce-scatter on CUDA; on CPU the plain ring, since gloo's is an all-reduce underneath
        (twice the bytes)."""
        if full.is_cuda:
            return collectives.reduce_scatter(full, 0, bounds, self.group)
        return super().reduce_scatter(full, bounds)

    def gather_ints(self, value: int, device: torch.device | str = "cpu") -> list[int]:
        """Every rank's ``value``, over the group's CPU backend when it has one (no wait on the GPU stream)."""
        cpu = "gloo" in str(dist.get_backend(self.group))
        return super().gather_ints(value, "cpu" if cpu else device)

    def all_gather(self, part: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> torch.Tensor:
        """The library's all-gather (uneven chunks padded)."""
        return collectives.all_gather(part, 0, bounds, self.group)


def as_transport(group: dist.ProcessGroup | Transport | None) -> Transport:
    """The transport of ``group``: itself if it is one, else a torch.distributed one.

    A ``DistTransport`` takes 3 us to make; it is not cached, so that nothing here keeps a process group, and
    its gloo threads, alive past ``destroy_process_group``. Without an initialized process group (and no
    ``Transport`` given) it raises a RuntimeError.

    Args:
        group: a ``Transport`` (returned as it is), a process group, or None for the world group.

    Returns:
        A ``Transport`` over the ranks of ``group``.

    Example::

        >>> world = tpf.comm.FakeWorld(2)
        >>> tpf.comm.as_transport(world.transports[0]) is world.transports[0]
        True
        >>> tpf.comm.as_transport(None).world_size  # under python -m tpflow.launch --nproc_per_node 2
        2
    """
    if isinstance(group, Transport):
        return group
    if not dist.is_initialized():
        raise RuntimeError("the collective kernels need a process group: call tpflow.init_distributed() (or run "
                           "under python -m tpflow.launch), or pass a Transport")
    return DistTransport(group)
