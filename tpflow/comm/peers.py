"""A wait on a peer rank that failed, said plainly: gone (gloo's "Connection closed by peer": its process died or
exited) or late (past the timeout). A collective or transfer that times out names the rank it waited for: gloo's
own words ("Timed out waiting 15000ms for recv operation") name neither the peer nor the cause, while one rank that
stopped, or runs another collective, is what leaves the others waiting."""

from __future__ import annotations

import contextlib
import time

import torch.distributed as dist

from tpflow import config

__all__ = ["closed_connection", "naming_late", "timed_out", "waiting_on"]


def closed_connection(e: BaseException) -> bool:
    """Whether ``e`` is gloo's word that a peer closed its connection (its process died or exited).

    Args:
        e: an exception a transfer or a collective raised.

    Returns:
        True for a ``RuntimeError`` saying the connection was closed, reset or refused, or the pipe broke.

    Example::

        >>> closed_connection(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
        True
        >>> closed_connection(ValueError("a wrong shape"))
        False
    """
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(w in text for w in ("connection closed", "connection reset",
                                                                    "broken pipe", "connection refused"))


def timed_out(e: BaseException) -> bool:
    """Whether ``e`` is a transfer's or collective's timeout (gloo's or NCCL's words).

    Args:
        e: an exception a wait raised.

    Returns:
        True or False.

    Example::

        >>> timed_out(RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv"))
        True
    """
    text = str(e).lower()
    return isinstance(e, RuntimeError) and ("timed out" in text or "timeout" in text)


def waiting_on(what: str, who: str, e: BaseException) -> RuntimeError:
    """The error to raise in place of a timeout ``e``: ``what`` waited on ``who`` past the timeout switch.

    Args:
        what: the operation (``"the ring all-gather"``).
        who: the rank or ranks it waited for (``"rank 1"``).
        e: the timeout.

    Returns:
        A ``RuntimeError`` naming them, the cause to look for and the original error.

    Example::

        >>> str(waiting_on("the ring", "rank 1", RuntimeError("Timed out")))[:58]
        'tpflow: the ring waited for rank 1 longer than the timeout'
    """
    seconds = config.get("timeout")
    return RuntimeError(f"tpflow: {what} waited for {who} longer than the timeout switch's {seconds:g} s: that rank "
                        f"stopped, or runs another collective (every rank must run the same collectives in the same "
                        f"order), or is that much slower. {type(e).__name__}: {e}")


def naming_late(what: str, group: dist.ProcessGroup) -> contextlib.AbstractContextManager[None]:
    """Around a collective of ``group``: its timeout raised as ``waiting_on`` the rank that is late. A collective of
    three or more ranks does not say which one that is: the ranks that time out in it say so in the world's store,
    and those that do not within two seconds are the late ones (every rank timing out in it, or no store, names the
    group's other ranks). A rank that times out closes its connections, so a rank that waited less long hears
    "connection closed" instead: it answers the roll call too and raises the verdict of the ranks that timed out.

    Args:
        what: the collective (``"an all-gather"``).
        group: its process group.

    Returns:
        The context manager.

    Example::

        >>> with naming_late("an all-reduce", torch.distributed.group.WORLD):
        ...     torch.distributed.all_reduce(torch.ones(2))
    """
    return _NamingLate(what, group)


class _NamingLate:
    """``naming_late``'s context manager, a class: a collective that succeeds pays two plain calls, where a
    generator's context manager builds and steps a generator (benchmarks/aspects_cpu.py times it in a step)."""

    __slots__ = ("group", "what")

    def __init__(self, what: str, group: dist.ProcessGroup) -> None:
        self.what, self.group = what, group

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, e: BaseException | None, traceback: object) -> bool:
        if not isinstance(e, RuntimeError):
            return False
        late = timed_out(e)
        if not late and not closed_connection(e):
            return False
        others = [r for r in dist.get_process_group_ranks(self.group) if r != dist.get_rank()]
        call = _RollCall(others)
        if late:
            raise waiting_on(self.what, _who(call.late(self.what)), e) from e
        verdict = call.verdict()  # None: no rank timed out, a peer died (the launcher says which)
        if verdict is None or dist.get_rank() in verdict:
            return False
        raise waiting_on(self.what, _who(verdict), e) from e


def _who(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"one of ranks {ranks}"


_failures: dict[tuple[int, ...], int] = {}  # a group's (ranks) failed collectives on this rank so far: each roll call


class _RollCall:
    """The ranks of a failed collective meet in the world's store (torch keeps it private): each says it was there,
    and the ranks that timed out write down who was not."""

    def __init__(self, others: list[int]):
        self.others = others
        try:
            self.store = dist.distributed_c10d._get_default_store()
        except (AttributeError, RuntimeError, ValueError):
            self.store = None
        group = tuple(sorted([*others, dist.get_rank()]))
        _failures[group] = n = _failures.get(group, 0) + 1
        self.key = f"tpflow/failed/{'-'.join(map(str, group))}/{n}/"

    def late(self, what: str) -> list[int]:
        """The other ranks that have not also come to this collective within two seconds (all of them where every
        one has, or there is no store), written down for the ranks that heard only a closed connection."""
        if self.store is None or len(self.others) == 1:
            late = self.others
        else:
            self.store.set(self.key + str(dist.get_rank()), what)
            late, deadline = list(self.others), time.monotonic() + 2.0
            while late and time.monotonic() < deadline:
                late = [r for r in late if not self.store.check([self.key + str(r)])]
                time.sleep(0.05)
            late = late or self.others
        if self.store is not None:
            self.store.set(self.key + "late", ",".join(map(str, late)))
        return late

    def verdict(self, seconds: float = 4.0) -> list[int] | None:
        """The late ranks as a rank that timed out wrote them down within ``seconds``, or None."""
        if self.store is None:
            return None
        self.store.set(self.key + str(dist.get_rank()), "connection closed")
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.store.check([self.key + "late"]):
                return [int(r) for r in self.store.get(self.key + "late").decode().split(",")]
            time.sleep(0.05)
        return None
