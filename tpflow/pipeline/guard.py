"""The ranks of one multi-rank pipeline stage agree after each forward and backward whether every one of them
computed it, so that none goes on into a hand-off or collective a failed rank never joins."""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from tpflow import comm
from tpflow.comm.wire import FAILED, HEADER_BYTES, OK, header, read_header
from tpflow.pipeline.stage import PipelineError

__all__ = ["UNFINISHED", "Guard"]

# A failed step's sends, for the process's lifetime: a peer may take them after the pipeline is gone, and gloo
# drops a send whose work and buffer are freed before it is taken.
UNFINISHED = comm.Pending()


class Guard:
    """The ranks of one multi-rank stage agree, after each forward and backward, whether every one of them
    computed it: each sends every other a header (tag ``tag``, over the world group: no process group of its own,
    which every rank would have to make), OK or a failed rank's error, and waits for theirs, so that none goes on
    into a hand-off or collective the failed rank never joins. Messages between two ranks under one tag arrive in
    order, so every agreement of every step shares the tag. (A rank stuck in a collective of the stage's own
    module, a tensor-parallel layer's all-reduce that the failed rank never reached, still waits there until the
    ``timeout`` switch's seconds.)

    Args:
        ranks: the stage's ranks, this one among them.
        tag: the message tag its agreements use (none other of the process's messages between these ranks).

    Example::

        >>> guard = Guard([0, 1], tag=777_001)
        >>> guard.check(None)                     # both ranks computed it: nothing is raised
        >>> guard.seconds > 0
        True
    """

    def __init__(self, ranks: list[int], tag: int) -> None:
        self.peers, self.tag = [r for r in ranks if r != dist.get_rank()], tag
        self.ok = header(OK)
        self.seconds = 0.0  # spent agreeing, this step

    def check(self, message: str | None) -> None:
        """Agree on an action: ``message`` (this rank's error, None if it computed the action) goes to the others;
        raises the first peer's error where one failed."""
        start = time.perf_counter()
        try:
            self._exchange(message)
        finally:
            self.seconds += time.perf_counter() - start

    def _exchange(self, message: str | None) -> None:
        buf = self.ok if message is None else header(FAILED, message=message)
        bufs = [torch.empty(HEADER_BYTES, dtype=torch.uint8) for _ in self.peers]
        pending = comm.post([], list(zip(self.peers, bufs, strict=True)), tag=self.tag)
        for r in self.peers:
            with contextlib.suppress(RuntimeError):  # a peer that died: the others still hear of it
                comm.post([(r, buf)], [], tag=self.tag, pending=pending)
        if message is not None:  # the peers may never take it (one died): kept alive, never waited on
            UNFINISHED.works += pending.works
            UNFINISHED.buffers += [*pending.buffers, *bufs]
            return
        pending.wait()
        for b in bufs:
            status, *_, text, _ = read_header(b)
            if status == FAILED:
                raise PipelineError(text)
