"""An in-process transport: the ranks of a ring as threads, joined by emulated links.

Tests run the collective kernels on it without processes, count every byte and message, and
shake the schedule with random delays; benchmarks give each link a bandwidth and latency to
measure how much of the transfer time the rings hide behind compute.

A message crosses its link after ``latency + bytes / bandwidth`` (plus up to ``jitter`` at
random), one message at a time per link and in order, like a wire.

CUDA tensors work in forward only: autograd runs every thread's CUDA backward on one device
thread, so emulated ranks waiting for each other inside backward would block that thread. The sender's tensor is read
when the message arrives, not when it was posted, so a schedule that reuses a buffer before its
send has completed hands the receiver the wrong numbers, as real hardware would; a receive
buffer holds NaN until its handle is waited on.
"""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tpflow.comm.accounting import CommStats
from tpflow.comm.transport import Handle, Pairs, Transport

__all__ = ["FakeTransport", "FakeWorld"]


@dataclass
class _Message:
    tensor: torch.Tensor
    arrive_at: float
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _data: torch.Tensor | None = None

    def data(self) -> torch.Tensor:
        """The tensor as it is on arrival (read once, by whichever side gets there first)."""
        _sleep_until(self.arrive_at)
        with self._lock:
            if self._data is None:
                self._data = self.tensor.clone()
                self.tensor = None
            return self._data


def _sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)


class _Wait:
    def __init__(self, fn: Callable[[], None]) -> None:
        self.wait = fn


class FakeWorld:
    """``world_size`` ranks in one process; ``run(fn)`` calls ``fn(transport)`` on each in its own thread.

    Each ordered pair of ranks has its own link: a message crosses it after ``latency + bytes / bandwidth``
    (plus up to ``jitter`` at random), one message at a time and in order. A rank that waits ``timeout``
    seconds for a message that never comes raises, naming what it waited for. Once a rank has failed, the
    world is broken: make a new one. ``transports`` holds each rank's ``FakeTransport``.

    Args:
        world_size: the number of ranks, at least 1.
        bandwidth: bytes/s of each link; None: infinite.
        latency: seconds every message takes on top of its transfer time.
        jitter: the most seconds added to a message's arrival at random.
        seed: the seed of the jitter's random numbers.
        timeout: seconds a rank waits for a message before it raises.

    Example::

        >>> world = tpf.comm.FakeWorld(3, bandwidth=1e9, latency=1e-4, jitter=1e-4)
        >>> def gather(transport):
        ...     return transport.all_gather(torch.full((1, 2), float(transport.rank)), tpf.sbp.chunk_bounds(3, 3))
        >>> world.run(gather)[0]
        tensor([[0., 0.],
                [1., 1.],
                [2., 2.]])
    """

    def __init__(self, world_size: int, *, bandwidth: float | None = None, latency: float = 0.0,
                 jitter: float = 0.0, seed: int = 0, timeout: float = 60.0) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size, self.bandwidth, self.latency, self.jitter, self.timeout = (
            world_size, bandwidth, latency, jitter, timeout)
        self.transports = [FakeTransport(self, rank) for rank in range(world_size)]
        self._rng = random.Random(seed)
        self._cond = threading.Condition()
        self._sent: dict[tuple, list[_Message]] = defaultdict(list)  # (src, dst, tag) -> messages in order
        self._received: dict[tuple, int] = defaultdict(int)  # (src, dst, tag) -> receives posted so far
        self._link_free: dict[tuple, float] = defaultdict(float)
        self._last_arrival: dict[tuple, float] = defaultdict(float)
        self._failed: str | None = None

    def run(self, fn: Callable, *args) -> list:
        """Results of ``fn(transport, *args)`` on every rank; the first rank to fail has its error raised."""
        if self._failed:
            raise RuntimeError(f"this FakeWorld is broken ({self._failed}): make a new one")
        results, first_error = [None] * self.world_size, []

        def body(rank: int) -> None:
            try:
                results[rank] = fn(self.transports[rank], *args)
            except BaseException as e:
                with self._cond:
                    if not first_error:  # the others then fail waiting for it; their errors say so
                        first_error.append(e)
                        self._failed = f"rank {rank} failed: {e!r}"
                    self._cond.notify_all()

        threads = [threading.Thread(target=body, args=(rank,), daemon=True) for rank in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if first_error:
            raise first_error[0]
        return results

    def _send(self, src: int, dst: int, tag: int, tensor: torch.Tensor) -> _Message:
        nbytes = tensor.numel() * tensor.element_size()
        with self._cond:
            link = (src, dst)
            start = max(time.monotonic(), self._link_free[link])
            self._link_free[link] = start + (nbytes / self.bandwidth if self.bandwidth else 0.0)
            arrive = self._link_free[link] + self.latency + self._rng.uniform(0, self.jitter)
            arrive = self._last_arrival[link] = max(arrive, self._last_arrival[link])  # a link keeps order
            msg = _Message(tensor, arrive)
            self._sent[(src, dst, tag)].append(msg)
            self._cond.notify_all()
        return msg

    def _recv(self, src: int, dst: int, tag: int, buf: torch.Tensor) -> Callable[[], None]:
        key = (src, dst, tag)
        if buf.is_floating_point():
            buf.fill_(float("nan"))  # read before its wait(), a receive buffer gives NaN, not stale numbers
        with self._cond:
            index = self._received[key]
            self._received[key] += 1

        def wait() -> None:
            with self._cond:
                ok = self._cond.wait_for(lambda: len(self._sent[key]) > index or self._failed, self.timeout)
                if self._failed:
                    raise RuntimeError(f"rank {dst}: gave up waiting for rank {src}: {self._failed}")
                if not ok:
                    raise RuntimeError(f"rank {dst}: no message {index} from rank {src} (tag {tag}) after "
                                       f"{self.timeout}s: the schedule deadlocks, or a rank is slower than the timeout")
                msg, self._sent[key][index] = self._sent[key][index], None  # delivered: the world lets it go
            data = msg.data()
            if data.shape != buf.shape or data.dtype != buf.dtype:
                raise RuntimeError(f"rank {dst}: message from rank {src} is {tuple(data.shape)} {data.dtype}, but the "
                                   f"receive expects {tuple(buf.shape)} {buf.dtype}")
            buf.copy_(data)

        return wait


class FakeTransport(Transport):
    """One rank's end of a ``FakeWorld``.

    ``FakeWorld`` makes one per rank (its ``transports``) and hands each to the function ``run`` calls. Its
    ``stats`` counts this rank's sends only, apart from ``tpf.comm.stats``. A peer must be another rank of
    the world.

    Args:
        world: the ``FakeWorld`` this end belongs to.
        rank: this end's rank in ``world``.

    Example::

        >>> world = tpf.comm.FakeWorld(2)
        >>> world.run(lambda transport: transport.gather_ints(10 + transport.rank))
        [[10, 11], [10, 11]]
        >>> world.transports[0].stats.bytes_sent, world.transports[0].stats.messages_sent
        (8, 1)
    """

    def __init__(self, world: FakeWorld, rank: int) -> None:
        self.world, self.rank, self.world_size = world, rank, world.world_size
        self.stats = CommStats()

    def post(self, sends: Pairs = (), recvs: Pairs = (), tag: int = 0) -> tuple[Handle, Handle]:
        for _, peer in (*sends, *recvs):
            if not 0 <= peer < self.world_size or peer == self.rank:
                raise ValueError(f"rank {self.rank}: peer {peer} is not another rank of a world of {self.world_size}")
        waits = [self.world._recv(peer, self.rank, tag, buf) for buf, peer in recvs]
        msgs = [self.world._send(self.rank, peer, tag, t) for t, peer in sends]
        self._count(sends)
        return Handle([_Wait(m.data) for m in msgs]), Handle([_Wait(w) for w in waits])
