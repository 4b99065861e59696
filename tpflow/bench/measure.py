"""What the harness measures besides time: the machine, every rank's values, bytes sent, peak memory.

Bytes: tpflow counts its own transfers (``tpflow.comm.stats``: point-to-point sends as sent);
``counting()`` adds torch's functional collectives (DTensor's redistributes, ``parallelize_module``)
by watching the dispatcher, and the c10d collectives on the process groups it is given (FSDP2's all-gathers,
reduce-scatters and replicas' all-reduces, on its data-parallel groups); ``count_ddp`` adds DDP's bucket
all-reduces through a comm hook (a Python call per bucket around DDP's own all-reduce hook). A collective
is counted as what the ring algorithm implementing it sends: (W-1)/W of the tensor per pass, two passes
for an all-reduce, and two for gloo's reduce-scatter (an all-reduce underneath); NCCL may pick a tree,
sending no more.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import pathlib
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from tpflow import comm

__all__ = ["count_ddp", "counting", "cpu_name", "device_name", "every_rank", "hold_freed_memory", "quantiles",
           "source_version", "step_peak", "step_times"]

T = TypeVar("T")


def cpu_name() -> str:
    """The CPU's model name, for the results header of a run on CPUs.

    Read from the ``model name`` line of ``/proc/cpuinfo`` where there is one, else from ``platform``.

    Returns:
        The model name; where ``/proc/cpuinfo`` gives none, ``platform.processor()``, or failing that
        ``platform.machine()``.

    Example::

        >>> name = cpu_name()                  # 'AMD EPYC' on the benchmarks' VM
        >>> isinstance(name, str) and name != ""
        True
    """
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines() if os.path.exists("/proc/cpuinfo") else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's, for every results file.

    Args:
        device: the device the benchmark runs on.

    Returns:
        ``torch.cuda.get_device_name(device)`` for a CUDA device, else :func:`cpu_name`.

    Example::

        >>> device_name(torch.device("cpu")) == cpu_name()
        True
        >>> device_name(torch.device("cuda", 0))  # needs a GPU  # doctest: +SKIP
        'NVIDIA H100 80GB HBM3'
    """
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def hold_freed_memory() -> str:
    """Have glibc keep freed memory in the process, for every case alike, and say so for the results header.

    By default glibc hands freed blocks back to the OS once the heap's free top passes a threshold,
    so the next step faults its pages in again: 10-15% of a CPU layer step on a 2-core VM, by an amount
    that follows the order in which a step frees its tensors rather than the work it does. A
    caching allocator (PyTorch's on CUDA, jemalloc) has no such cost.

    This raises glibc's trim and mmap thresholds to 32 MiB (glibc's largest mmap threshold) through
    ``mallopt``, for the whole process; the harness calls it once, before building any mode, on CPU runs.

    Returns:
        The allocator setting, for the results header: ``"glibc malloc keeping freed memory (mallopt trim and
        mmap thresholds 32 MiB)"``, which of the two took where glibc refused one, ``"glibc malloc defaults
        (mallopt refused)"`` where it refused both, or ``"the platform's allocator"`` where there is no
        ``libc.so.6`` to load.

    Example::

        >>> hold_freed_memory()                # on Linux
        'glibc malloc keeping freed memory (mallopt trim and mmap thresholds 32 MiB)'
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return "the platform's allocator"
    m_trim_threshold, m_mmap_threshold, limit = -1, -3, 32 << 20  # 32 MiB: glibc's largest mmap threshold
    trim, mmap = libc.mallopt(m_trim_threshold, limit), libc.mallopt(m_mmap_threshold, limit)
    if trim and mmap:
        return "glibc malloc keeping freed memory (mallopt trim and mmap thresholds 32 MiB)"
    if trim or mmap:
        kept = "trim" if trim else "mmap"
        return f"glibc malloc with only its {kept} threshold at 32 MiB (mallopt refused the other)"
    return "glibc malloc defaults (mallopt refused)"


def source_version() -> str:
    """The commit the benchmarked code is at, marked when its code (not earlier results) differs from it.

    Asks git in the checkout that holds this file; the code is the tracked files under ``tpflow/`` and
    ``benchmarks/``, except ``benchmarks/results/``.

    Returns:
        ``"commit <short sha>"``, with ``" with local changes"`` appended when the code differs from that
        commit, or ``"not a git checkout"`` where git cannot tell (not installed, or no repository).

    Example::

        >>> version = source_version()         # e.g. 'commit effe677 with local changes'
        >>> version.startswith("commit ") or version == "not a git checkout"
        True
    """
    root = pathlib.Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "tpflow", "benchmarks",
                                ":(exclude)benchmarks/results"],
                               cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"
    return f"commit {sha}" + (" with local changes" if dirty else "")


def every_rank(local: list[float]) -> torch.Tensor:
    """Every rank's ``local`` values, a row per rank (over the CPU backend).

    A collective over the default process group: every rank calls it, each with a list of the same length.

    Args:
        local: this rank's values.

    Returns:
        A float64 CPU tensor of shape ``[world size, len(local)]``; row ``r`` holds rank ``r``'s values.

    Example::

        >>> rank = dist.get_rank()
        >>> every_rank([float(rank), 10.0 * rank])   # on 2 ranks, each passing [its rank, 10 * its rank]
        tensor([[ 0.,  0.],
                [ 1., 10.]], dtype=torch.float64)
    """
    every = [torch.zeros(len(local), dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(every, torch.tensor(local, dtype=torch.float64))
    return torch.stack(every)


def step_times(local: list[float]) -> list[float]:
    """Each repetition's time on its slowest rank.

    A collective, like :func:`every_rank`: every rank calls it with its own times of the same repetitions.

    Args:
        local: this rank's time of each repetition, in seconds.

    Returns:
        For each repetition, the longest time any rank measured for it.

    Example::

        >>> times = [[0.010, 0.012], [0.011, 0.009]][dist.get_rank()]   # what rank 0 and rank 1 measured
        >>> step_times(times)
        [0.011, 0.012]
    """
    return every_rank(local).amax(0).tolist()


def quantiles(times: list[float]) -> tuple[float, float, float]:
    """Median, 20th and 80th percentile.

    The percentiles are ``statistics.quantiles``'s inclusive ones (interpolated between the samples); a single
    sample is all three.

    Args:
        times: the samples (step times, or per-step time ratios); at least one.

    Returns:
        ``(median, p20, p80)``.

    Example::

        >>> quantiles([1.0, 2.0, 3.0, 4.0, 5.0])
        (3.0, 1.8, 4.2)
        >>> quantiles([0.5])
        (0.5, 0.5, 0.5)
    """
    if len(times) == 1:
        return times[0], times[0], times[0]
    p20, _, _, p80 = statistics.quantiles(times, n=5, method="inclusive")
    return statistics.median(times), p20, p80


def _ring_passes(op: str, t: torch.Tensor) -> int:
    """An all-reduce is two passes; so is gloo's reduce-scatter (CPU tensors: an all-reduce underneath)."""
    return 2 if op in ("all_reduce", "all_reduce_") or (op == "reduce_scatter_tensor" and not t.is_cuda) else 1


_NOT_TRANSFERS = ("wait_tensor", "_wrap_tensor_autograd")


# c10d ops torch's own code (FSDP2) issues: where the tensor each ring pass walks is, and the passes
_C10D = {"_allgather_base_": (0, 1), "_reduce_scatter_base_": (1, 1), "allreduce_": (0, 2)}


class _Collectives(TorchDispatchMode):
    """Counts torch's functional collectives into ``comm.stats``, and the c10d ones on ``groups``; an unknown one
    is an error, not a zero."""

    def __init__(self, groups: list[dist.ProcessGroup]) -> None:
        super().__init__()
        self.groups = groups

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:  # modes run before subclasses: let DTensor lower the op to collectives on its blocks
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        op = func.overloadpacket.__name__
        if func.namespace == "c10d" and self.groups:
            self._c10d(func, op, args)
        if func.namespace != "_c10d_functional" or op in _NOT_TRANSFERS:
            return out
        group = _resolve_process_group(args[-1])
        if op == "all_to_all_single":  # (input, output_split_sizes, input_split_sizes, group): rows to each rank
            x, sizes = args[0], args[2]
            world, rank = dist.get_world_size(group), dist.get_rank(group)
            sizes = sizes or [x.shape[0] // world] * world
            row = x[:1].numel() * x.element_size()
            comm.stats.add(sum(n for r, n in enumerate(sizes) if r != rank) * row,
                           sum(1 for r, n in enumerate(sizes) if r != rank and n))
            return out
        if op not in ("all_reduce", "all_reduce_", "all_gather_into_tensor", "reduce_scatter_tensor"):
            raise RuntimeError(f"the harness cannot count the bytes of {func}: add its ring cost to "
                               "tpflow.bench.measure")
        counted = out if op == "all_gather_into_tensor" else args[0]  # the full tensor each pass walks
        comm.count_ring(counted, dist.get_world_size(group), _ring_passes(op, args[0]))
        return out

    def _c10d(self, func, op: str, args: tuple) -> None:
        """A c10d collective, counted where it runs on one of ``groups`` (its first script object: the group)."""
        boxed = next((a for a in args if isinstance(a, torch.ScriptObject)), None)
        group = None if boxed is None else dist.ProcessGroup.unbox(boxed)
        if not any(group is g for g in self.groups) or op == "alltoall_base_":  # tpflow counts its all-to-alls
            return
        if op not in _C10D:
            raise RuntimeError(f"the harness cannot count the bytes of {func}: add its ring cost to "
                               "tpflow.bench.measure")
        where, passes = _C10D[op]
        tensor = args[where][0] if isinstance(args[where], list) else args[where]
        gloo = op == "_reduce_scatter_base_" and not tensor.is_cuda  # an all-reduce underneath
        comm.count_ring(tensor, group.size(), 2 if gloo else passes)


@contextmanager
def counting(groups: list[dist.ProcessGroup] | tuple = ()) -> Iterator[comm.CommStats]:
    """Count every byte this rank sends inside the block, tpflow's and torch's collectives alike.

    Resets ``tpflow.comm.stats`` on entry. Besides the transfers tpflow counts itself, torch's functional
    collectives (DTensor's redistributes, ``parallelize_module``'s layers) are counted by watching the
    dispatcher, each as the ring algorithm's bytes, and so are the c10d collectives (all-gathers,
    reduce-scatters, all-reduces) on ``groups``: FSDP2's on its data-parallel groups, which tpflow does not count
    itself (its own collectives run on other groups). One whose ring cost the harness does not know raises
    RuntimeError rather than counting as zero. DDP's all-reduces also need :func:`count_ddp`.

    Args:
        groups: process groups whose c10d collectives torch's own code issues (FSDP2's); default none.

    Returns:
        A context manager that yields ``tpflow.comm.stats``; its ``bytes_sent`` and ``messages_sent`` hold
        what the block sent.

    Example::

        >>> from torch.distributed.tensor import Replicate
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> x = tpf.ones(4, 256, placement=P, sbp=tpf.sbp.split(0))      # 4 KiB, 2 KiB a rank
        >>> with counting() as stats:
        ...     y = x.redistribute(placements=[Replicate()])             # DTensor's own all-gather
        >>> stats.bytes_sent, stats.messages_sent                        # the ring's (W - 1) / W of the 4 KiB
        (2048, 1)
    """
    comm.stats.reset()
    with _Collectives(list(groups)):
        yield comm.stats


def _counted_allreduce(group, bucket):  # no annotations: DDP checks them, and these would be strings here
    comm.count_ring(bucket.buffer(), dist.get_world_size(group), 2)
    return default_hooks.allreduce_hook(group, bucket)


def count_ddp(model: torch.nn.parallel.DistributedDataParallel) -> None:
    """Have DDP's bucket all-reduces (its own, unchanged) counted in ``comm.stats``.

    Registers a comm hook that counts each bucket as a ring all-reduce (two passes), then runs DDP's default
    all-reduce hook on it: one Python call per bucket. DDP takes one comm hook per model, registered before
    the first backward.

    Args:
        model: the DDP-wrapped model, with no comm hook registered yet.

    Example::

        >>> from torch.nn.parallel import DistributedDataParallel
        >>> ddp = DistributedDataParallel(torch.nn.Linear(256, 4), gradient_as_bucket_view=True)
        >>> count_ddp(ddp)
        >>> with counting() as stats:
        ...     ddp(torch.randn(8, 256)).sum().backward()
        >>> stats.bytes_sent                   # one bucket of 1028 fp32 gradients, all-reduced: 2 passes of half
        4112
    """
    model.register_comm_hook(None, _counted_allreduce)


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null for the block (C++ code writes there directly)."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def step_peak(step: Callable[[], T], device: torch.device) -> tuple[int, T]:
    """The most bytes ``step()`` holds above what was live when it began (for a trainer that frees its
    gradients after each step: activations, gradients, communication buffers), and what it returned.
    CUDA's allocator statistics; on CPU, the profiler's allocation events (frees of blocks allocated
    before the step are not among them, so a step that frees what it did not allocate reads high).
    On CPU, file descriptor 2 (stderr) goes to /dev/null while the step runs under the profiler.

    Args:
        step: the step to run once, with no arguments.
        device: the device the step runs on: for CUDA the allocator's peak is read, for any other type the
            CPU profiler's events.

    Returns:
        ``(peak, result)``: the peak in bytes above what was live at the start, and what ``step()`` returned.

    Example::

        >>> peak, total = step_peak(lambda: torch.ones(1024, 1024).sum(), torch.device("cpu"))
        >>> peak >= 1024 * 1024 * 4, total         # the 4 MiB of ones and the sum's few bytes (4194308 here)
        (True, tensor(1048576.))
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base, result
    from torch.profiler import ProfilerActivity, profile

    # quiet: kineto logs each start and stop, and c10 warns of each free it did not see allocated (the step
    # runs unprofiled before and after, so nothing else it could print is lost)
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = step()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    return max(itertools.accumulate((e.nbytes() for e in events), initial=0)), result
