"""The process group: set up once, lazily, from the launcher's environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``...), gloo for CPU tensors and NCCL for CUDA ones; a plain ``python script.py`` is a world of one, so
every script also runs as one process. At exit, gloo's threads are given a moment to finish (``_shutdown``)."""

from __future__ import annotations

import atexit
import datetime
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from tpflow import config

__all__ = ["get_rank", "get_world_size", "init_distributed", "on_teardown"]

_EXIT_GRACE_S = 0.05  # at exit, time for gloo's threads to free their last tensors (see _shutdown)
_EXIT_HOOK_PID: int | None = None  # the process whose exit runs _shutdown (not a forked child)
_TEARDOWN: list[Callable[[], None]] = []


def on_teardown(forget: Callable[[], None]) -> None:
    """Call ``forget`` before the process group is destroyed at exit (what holds its groups lets go of them).

    Args:
        forget: a function of no arguments (a cache's ``clear``).

    Example::

        >>> meshes = {}
        >>> on_teardown(meshes.clear)      # placement does this with its cache of meshes
    """
    _TEARDOWN.append(forget)


def _timeout() -> datetime.timedelta:
    """Collective timeout: a rank that never arrives fails the job instead of hanging it."""
    return datetime.timedelta(seconds=config.get("timeout"))


def init_distributed() -> None:
    """Set up the default process group once: from torchrun's environment, else a world of one.

    Placements, ``get_rank`` and ``get_world_size`` call it, so a script rarely needs to; later calls, or calls
    after the script set up the group itself, do nothing. The backend is ``"cpu:gloo,cuda:nccl"`` when CUDA is
    available, else gloo, and each process takes GPU ``LOCAL_RANK`` when there is one (ranks beyond the GPU count
    run CPU placements only). Collectives time out after the ``timeout`` switch (``TPFLOW_TIMEOUT``, seconds), so
    a rank that never arrives fails the job instead of hanging it.

    With ``RANK`` and ``WORLD_SIZE`` set (as ``python -m tpflow.launch`` sets them) the process joins that world;
    ``MASTER_ADDR`` or ``MASTER_PORT`` missing then is a ``ValueError`` that says how to launch. Without them, a
    plain ``python script.py`` is a world of one. An exit hook lets gloo's threads finish before the interpreter
    shuts down.

    Example::

        >>> import tpflow as tpf
        >>> tpf.init_distributed()   # optional: the first placement does it too
        >>> tpf.get_world_size()     # under `tpflow.launch --nproc_per_node 2`; 1 in a plain `python script.py`
        2
    """
    if dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if local_rank < torch.cuda.device_count():  # more ranks than GPUs: the extra ones run CPU placements only
        torch.cuda.set_device(local_rank)
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise ValueError(
                f"RANK and WORLD_SIZE are set but {' and '.join(missing)} are not: start multi-process runs with "
                "`python -m tpflow.launch --nproc_per_node N script.py`, or unset RANK/WORLD_SIZE for one process"
            )
        dist.init_process_group(backend, timeout=_timeout())
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=_timeout())
    global _EXIT_HOOK_PID
    if _EXIT_HOOK_PID is None:
        _EXIT_HOOK_PID = os.getpid()
        atexit.register(_shutdown)


def _shutdown() -> None:
    """Let gloo's threads finish before the interpreter is torn down.

    A gloo worker frees a collective's tensors a moment after the caller's ``wait`` returns. When its
    reference is the last one and Python is already finalizing, taking the GIL to free them aborts a
    finished run (SIGABRT, "terminate called without an active exception"; pytorch/pytorch#179291).
    The fix is the pause: the GIL is left free for a moment so such a worker can finish. Destroying the
    groups afterwards is best effort: it joins their threads only when nothing else holds them (a
    ``DeviceMesh`` or DTensor's caches may). A rank leaving on an uncaught exception (its traceback
    already printed, and recorded for the launcher) exits at once instead: a gloo group destroyed
    with that rank's collectives unfinished waits for its peers, here or when the interpreter frees
    it (as it does once ``torch._dynamo`` is imported), and the launcher would see the failure only
    when the other ranks end.
    """
    if os.getpid() != _EXIT_HOOK_PID or not dist.is_initialized():
        return
    time.sleep(_EXIT_GRACE_S)
    failure = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)  # the exception ending the program
    if failure is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130 if isinstance(failure, KeyboardInterrupt) else 1)
    for forget in _TEARDOWN:
        forget()
    dist.destroy_process_group()


def get_rank() -> int:
    """This process's rank in the world (0 in a plain one-process run).

    Sets up the process group first if needed (``init_distributed``).

    Returns:
        The rank, from 0 to ``get_world_size() - 1``.

    Example::

        >>> import tpflow as tpf
        >>> tpf.get_rank()   # on rank 0 of `python -m tpflow.launch --nproc_per_node 2` (1 on the other process)
        0
    """
    init_distributed()
    return dist.get_rank()


def get_world_size() -> int:
    """Number of processes in the world (1 in a plain one-process run).

    Sets up the process group first if needed (``init_distributed``). Placements may only name ranks below it.

    Returns:
        The world size (``--nproc_per_node`` times ``--nnodes`` under ``python -m tpflow.launch``).

    Example::

        >>> import tpflow as tpf
        >>> P = tpf.placement("cpu", ranks=list(range(tpf.get_world_size())))   # every rank, as Placement.all("cpu")
    """
    init_distributed()
    return dist.get_world_size()
