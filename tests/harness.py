"""Multi-rank test harness: a pool of real gloo processes per world size, kept for the session.

``run(world_size, fn, *args)`` runs ``fn(*args)`` on every rank and returns the per-rank
results. A rank that raises fails the test with its traceback; a pool whose ranks stop
answering (a hang) is killed after the timeout and replaced, so one bad test cannot stall
the rest of the suite. A rank killed by a signal (a segfault, a heap corruption's abort) fails it
with every thread's Python stack at that moment (faulthandler's, kept in a file per rank).
``run_python(args)`` runs a fresh Python process from the repository root, for what must run as a
user runs it (the launcher, the examples, the benchmark scripts);
``run_scripts(commands, nproc)`` runs several scripts in one launch (``tests/scripts.py``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import NamedTuple

import torch

ROOT = Path(__file__).resolve().parents[1]  # the repository
COLLECTIVE_TIMEOUT_S = 60  # gloo collectives of a broken test fail after this instead of hanging
GRACE_S = 10  # after one rank fails, how long the others get to finish before the pool is replaced


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, conn: Connection, faults: str) -> None:
    faulthandler.enable(open(faults, "w"), all_threads=True)  # noqa: SIM115 (open as long as the process)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TPFLOW_TIMEOUT=str(COLLECTIVE_TIMEOUT_S))
    torch.set_num_threads(1)
    import tpflow

    tpflow.init_distributed()
    while True:
        msg = conn.recv()
        if msg is None:
            torch.distributed.destroy_process_group()
            break
        fn, args = msg
        try:
            conn.send(("ok", fn(*args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
        finally:  # the next test's frameworks see the world, whatever this one parallelized; one thread a rank again
            tpflow.hf.frameworks.view.forget()  # (accelerate's state sets torch's threads to the cores: two ranks of
            torch.set_num_threads(1)  # two threads each on two cores spin against each other, every later test 3-5x)


class Pool:
    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size, port = world_size, _free_port()
        self.conns, self.procs = [], []
        self.faults = tempfile.mkdtemp(prefix=f"tpflow-pool{world_size}-")  # each rank's stacks if a signal kills it
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, world_size, port, child, self._faults(rank)), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, fn, args: tuple, timeout: float) -> list:
        for conn in self.conns:
            conn.send((fn, args))
        results: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        while len(results) < self.world_size:
            if any(kind == "error" for kind, _ in results.values()):
                deadline = min(deadline, time.monotonic() + GRACE_S)
            pending = [c for r, c in enumerate(self.conns) if r not in results]
            ready = wait(pending, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                rank = self.conns.index(conn)
                try:
                    results[rank] = conn.recv()
                except EOFError:
                    self.procs[rank].join(timeout=5)  # its exit code, and faulthandler's stacks written
                    results[rank] = ("error", f"rank {rank} died (exit code {self.procs[rank].exitcode})"
                                              f"{self._stacks(rank)}")
        errors = {r: text for r, (kind, text) in sorted(results.items()) if kind == "error"}
        missing = [r for r in range(self.world_size) if r not in results]
        if errors or missing:
            self.close(kill=True)
            report = "".join(f"\n--- rank {r} ---\n{text}" for r, text in errors.items())
            if missing:
                report += f"\nranks {missing} gave no answer (hung, or stuck waiting on a failed rank)"
            raise AssertionError(f"{fn.__name__} failed on world size {self.world_size}:{report}")
        return [results[r][1] for r in range(self.world_size)]

    def _faults(self, rank: int) -> str:
        return os.path.join(self.faults, f"rank{rank}.txt")

    def _stacks(self, rank: int) -> str:
        """What faulthandler wrote when a signal killed ``rank`` ('' if nothing)."""
        with contextlib.suppress(OSError), open(self._faults(rank)) as f:
            text = f.read().strip()
            return f"; its threads' stacks then (faulthandler):\n{text}" if text else ""
        return ""

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, kill: bool = False) -> None:
        if not kill:
            for conn in self.conns:
                with contextlib.suppress(BrokenPipeError, OSError):
                    conn.send(None)
        for proc in self.procs:
            proc.join(timeout=0 if kill else 5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.procs = []
        shutil.rmtree(self.faults, ignore_errors=True)


_pools: dict[int, Pool] = {}


def run(world_size: int, fn, *args, timeout: float = 120) -> list:
    """``fn(*args)`` on every rank of a ``world_size`` gloo world; the list of their results."""
    pool = _pools.get(world_size)
    if pool is None or not pool.alive():
        pool = _pools[world_size] = Pool(world_size)
    try:
        return pool.run(fn, args, timeout)
    finally:
        if not pool.procs:
            del _pools[world_size]


def discard(world_size: int) -> None:
    """Kill the pool of ``world_size``: a test that leaves messages in flight (a failed pipeline) must not hand
    them to the next test."""
    pool = _pools.pop(world_size, None)
    if pool is not None:
        pool.close(kill=True)


def shutdown() -> None:
    for pool in _pools.values():
        pool.close()
    _pools.clear()


class Ran(NamedTuple):
    """One script of ``run_scripts``: its exit code and its output (every rank's)."""

    code: int
    stdout: str


def run_scripts(commands: list[str], nproc: int | None = None, timeout: float = 600) -> tuple[dict[str, Ran], str]:
    """``commands`` (each ``"path args..."``, from the repository root) run in turn by ``tests/scripts.py``: under the
    launcher on ``nproc`` ranks, or in one plain process (None). Returns each command's exit code and output, and the
    run's stderr; a run that fails (a script raised) raises with its stderr."""
    launch = [] if nproc is None else ["-m", "tpflow.launch", "--nproc_per_node", str(nproc)]
    proc = run_python([*launch, "tests/scripts.py", *commands], timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"tests/scripts.py on {nproc or 'one'} process(es) failed:\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
    ran, command, lines = {}, None, []
    for line in proc.stdout.splitlines():
        if line.startswith(">>> ") and line[4:] in commands:
            command, lines = line[4:], []
        elif command is not None and line.startswith(f"<<< {command} exit "):
            ran[command], command = Ran(int(line.rsplit(" ", 1)[1]), "\n".join(lines)), None
        elif command is not None:
            lines.append(line)
    assert list(ran) == commands, proc.stdout[-3000:]
    return ran, proc.stderr


def run_python(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """``python *args`` from the repository root, outside any torch.distributed world (no RANK, WORLD_SIZE, ...
    inherited), with the repository importable; its output captured as text."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
