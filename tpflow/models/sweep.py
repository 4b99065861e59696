"""The sweep: every model type checked on a pool of rank processes per degree, a hung or crashed pool replaced so
that one model cannot stop the rest."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import time
import traceback
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection, wait

from tpflow.models.check import Verdict

__all__ = ["sweep"]

TIMEOUT_S = 180  # one model type under one mode on every rank; a hang past it is a failing verdict
_COLLECTIVE_TIMEOUT_S = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, conn: Connection) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TPFLOW_TIMEOUT=str(_COLLECTIVE_TIMEOUT_S))
    import torch

    torch.set_num_threads(1)
    import transformers

    transformers.logging.set_verbosity_error()
    import tpflow as tpf
    from tpflow.models.check import check

    tpf.init_distributed()
    placement = tpf.placement("cpu", ranks=list(range(world)))
    while (job := conn.recv()) is not None:
        try:
            kind, mode, ratios = job
            conn.send(check(kind, mode, placement, ratios))
        except BaseException as e:
            conn.send(Verdict("failing", f"{type(e).__name__}: {traceback.format_exception_only(e)[-1].strip()}"))


class _Pool:
    def __init__(self, world: int) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.conns, self.procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, world, port, child), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, job: tuple[str, str, bool], timeout: float) -> tuple[Verdict, bool]:
        """Every rank's verdict combined, and whether the pool is still sound."""
        for conn in self.conns:
            conn.send(job)
        got: dict[int, Verdict] = {}
        deadline = time.monotonic() + timeout
        while len(got) < len(self.conns):
            pending = [c for i, c in enumerate(self.conns) if i not in got]
            ready = wait(pending, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                return Verdict("failing", f"hung: no answer from every rank in {timeout:.0f} s"), False
            for conn in ready:
                try:
                    got[self.conns.index(conn)] = conn.recv()
                except (EOFError, OSError):
                    return Verdict("failing", "a rank's process died (killed, out of memory?)"), False
        verdicts = set(got.values())
        if len(verdicts) == 1:
            return verdicts.pop(), True
        shown = "; ".join(f"rank {r}: {v.status} {v.why}" for r, v in sorted(got.items()))
        return Verdict("failing", f"the ranks disagree: {shown}"), False

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):  # a rank that died
                conn.send(None)
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()


def sweep(kinds: Iterable[str], modes: Iterable[str], world: int,
          progress: Callable[[str, str, Verdict], None] | None = None,
          ratios: bool = False) -> dict[tuple[str, str], Verdict]:
    """Check every model type of ``kinds`` under every mode of ``modes`` on ``world`` rank processes (gloo, CPU).

    Args:
        kinds: model types.
        modes: modes (``tpflow.models.check.MODES``).
        world: the degree: how many rank processes.
        progress: called with each verdict as it comes.
        ratios: the tiny models at their families' real ratios (``tiny_config(kind, ratios=True)``).

    Returns:
        ``{(kind, mode): Verdict}``.

    Example::

        >>> sweep(["llama"], ["tp"], world=2)  # launches its own rank processes  # doctest: +SKIP
        {('llama', 'tp'): Verdict(status='exact', why='', share=0.5, whole='')}
    """
    verdicts: dict[tuple[str, str], Verdict] = {}
    pool = None
    try:
        for kind in kinds:
            for mode in modes:
                pool = pool or _Pool(world)
                verdict, sound = pool.run((kind, mode, ratios), TIMEOUT_S)
                if not sound:
                    pool.close()
                    pool = None
                verdicts[kind, mode] = verdict
                if progress is not None:
                    progress(kind, mode, verdict)
    finally:
        if pool is not None:
            pool.close()
    return verdicts
