"""Saves the ranks make together, met through the world's store rather than a collective, so that no rank is left
waiting on one that went elsewhere:

- a roll call at the start: every rank says it came; rank 0 waits for the others a few seconds (``ARRIVAL_S``), the
  others for rank 0 up to the timeout switch (rank 0 may be busy with work of its own), so that a save called on
  rank 0 alone (``if rank == 0: model.save_pretrained(...)``, the habit of data parallelism) fails at once, naming
  the ranks that did not come, where its first gather would wait out the timeout;
- each step (the gathers, the writes, the publishing) ends with every rank saying how it left it: a rank that
  raised says so at once and every other rank raises it by name as it leaves the step; the failed rank itself
  never enters a collective after its error, so it leaves within seconds with its own error, and a rank still in a
  collective with it (in ``dcp.save``) is let go when its process ends (a launcher stops the others when a rank
  fails: ``python -m tpflow.launch`` says the first error once).

A rank that comes after the roll call failed raises the same error; what one call of a kind wrote in the store is
removed once every rank is in the next call of that kind.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch.distributed as dist

from tpflow import config
from tpflow.comm.peers import closed_connection, timed_out

__all__ = ["ARRIVAL_S", "GRACE_S", "Meeting"]

ARRIVAL_S = 10.0  # how long rank 0 waits for the other ranks to call what it called (at most the timeout switch)
GRACE_S = 3.0  # how long a rank that failed in a step waits for the others to leave it, so that they read its word

_calls: dict[str, int] = {}  # kind -> this process's calls so far: the n-th call of every rank meets the others'
_written: dict[str, list[str]] = {}  # kind -> the keys this rank wrote for its last call, removed after the next


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


class Meeting:
    """One call of ``kind`` that every rank of the world makes (see the module's docstring); the roll call is taken
    when it is made. Without a process group, or in a world of one, its steps are plain blocks.

    Args:
        kind: what is called (``"save_pretrained"``), the roll call's first word and its key in the store.
        fix: what to do when ranks did not call it, the roll call's last sentence.
        poll_s: the longest pause between two looks at the store while waiting (a meeting made many times a second,
            a weight stream's per bucket, polls more often than a save's).

    Raises:
        RuntimeError: on every rank that came, when some ranks did not call it in time.

    Example::

        >>> meeting = Meeting("a save", "call it on every rank")      # on every rank
        >>> with meeting.step("write", "the save to x"):
        ...     pass                                                   # a rank raising here: every rank raises
    """

    def __init__(self, kind: str, fix: str, poll_s: float = 0.1) -> None:
        self.kind, self.poll_s = kind, poll_s
        self.store = None
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        self.store = dist.distributed_c10d._get_default_store()  # torch keeps it private; tpflow.comm.peers too
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        _calls[kind] = _calls.get(kind, 0) + 1
        self.prefix = f"tpflow/{kind}/{_calls[kind]}/"
        self.written: list[str] = []  # this rank's keys, and rank 0's the ones every rank writes
        last, _written[kind] = _written.get(kind, []), self.written
        self._roll_call(fix)
        for key in last:  # every rank is in this call: none reads the last one's keys any more
            self.store.delete_key(key)

    def _set(self, key: str) -> None:
        """Say that this rank reached ``key`` (a roll call's, a step's end)."""
        self.store.set(f"{key}/{self.rank}", "")
        self.written += [f"{key}/{self.rank}", *([key, f"{key}/verdict"] if self.rank == 0 else [])]

    def _verdict(self, key: str, said: str) -> str:
        """The verdict of ``key``, ``said`` written first where no rank has written one (the first word stands)."""
        return self.store.compare_set(f"{key}/verdict", "", said).decode()

    def _await(self, key: str, seconds: float) -> str | None:
        """``key``'s value once a rank wrote it, or None after ``seconds``."""
        deadline, pause = time.monotonic() + seconds, 0.002
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                return None
            time.sleep(pause)
            pause = min(2 * pause, self.poll_s)
        return self.store.get(key).decode()

    def _missing(self, key: str) -> list[int]:
        return [r for r in range(self.world) if not self.store.check([f"{key}/{r}"])]

    def _meet(self, key: str, seconds: float, late: Callable[[list[int]], str]) -> None:
        """This rank at ``key``, then the verdict once every rank is there: ``late(missing ranks)`` where some are not
        within ``seconds``; raised unless complete."""
        self._set(key)
        if self.store.add(key, 1) == self.world:
            self._verdict(key, "complete")
        verdict = self._await(f"{key}/verdict", seconds)
        if verdict is None:
            verdict = self._verdict(key, late(self._missing(key)))
        if verdict != "complete":
            raise RuntimeError(verdict)

    def _roll_call(self, fix: str) -> None:
        seconds = config.get("timeout")
        seconds = min(ARRIVAL_S, seconds) if self.rank == 0 else seconds
        self._meet(self.prefix + "came", seconds, lambda missing: f"{self.kind}: {_ranks(missing)} did not call it "
                                                                  f"within {seconds:g} s of rank {self.rank}: {fix}")

    @contextlib.contextmanager
    def step(self, name: str, subject: str, left: str = "") -> Iterator[None]:
        """A block every rank runs; a rank that raises in it makes every rank raise as it leaves it, by name.

        Args:
            name: the step (its key in the store).
            subject: what fails, the error's first words (``"the save to /ckpt/step-100"``).
            left: what the failure leaves, the error's last words (``": /ckpt/step-100 is left as it was"``).

        Returns:
            A context manager. This rank's own error goes up as it is; another rank's as a ``RuntimeError``
            ``"{subject} failed on rank r (its error){left}"`` (also on a rank whose error was only the word of a
            peer gone, a closed connection or a timeout).

        Raises:
            RuntimeError: another rank failed in the step, or did not leave it within the timeout switch.
        """
        if self.store is None:
            yield
            return
        key = self.prefix + name
        try:
            yield
        except BaseException as e:  # KeyboardInterrupt and dcp's CheckpointException too: the others must hear it
            mine = f"{subject} failed on rank {self.rank} ({type(e).__name__}: {e}){left}"
            try:
                first = self._verdict(key, mine)
                self._set(key)
                self.store.add(key, 1)
                deadline = time.monotonic() + GRACE_S  # the ranks about to leave the step read the word before it goes
                while self.store.add(key, 0) < self.world and time.monotonic() < deadline:
                    time.sleep(0.01)
            except (RuntimeError, ValueError):  # the store went with its host: this rank's own error is all it knows
                first = mine
            if first != mine and (closed_connection(e) or timed_out(e)):
                raise RuntimeError(first) from e  # this rank only lost a peer: the peer's error is the cause
            raise
        seconds = config.get("timeout")
        self._meet(key, seconds, lambda missing: f"{subject}: {_ranks(missing)} did not finish within the timeout "
                                                 f"switch's {seconds:g} s{left}")
