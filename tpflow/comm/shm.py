"""The collectives of CPU ranks on one host, through shared memory: a 1 KiB all-reduce of 2 ranks in 59 us where
gloo took 1,141 (0.05x; 0.42x at 4 MiB; benchmarks/shm_cpu.py on this repository's 2-core VM, benchmarks/README.md).

Gloo sends every tensor over TCP loopback and runs every collective on a worker thread, so a decode step's
all-reduces of a few KiB cost the hand-offs, not the bytes. Here the ranks of a group map one file of
``/dev/shm`` (unlinked as soon as every rank has mapped it, so nothing is left behind) and meet there::

    arrived [W] int64           how many exchanges each rank has published
    signs   [2, W] int64        each rank's (bytes in all, dtype, collective) packed, for the agreement check
    slots   [2, W, capacity]    each rank's bytes, in two sets used in turn

An exchange writes this rank's bytes into its slot of set ``n % 2``, publishes ``n + 1``, waits until every rank
has, and reads every slot. No rank writes set ``n % 2`` again before exchange ``n + 2``, which it starts only once
every rank published ``n + 1``, that is, finished reading ``n``: one flag a rank per exchange, no second barrier.
Tensors larger than a slot go in rounds of a slot each. Sums run in rank order on every rank, so every rank holds
the same bits. An asynchronous all-reduce (a bucket of gradients) runs on the group's worker thread; a collective
called after it waits for it, so the ranks keep one order. Ranks that call a collective with other shapes or
dtypes fail together at its first round; a rank that died is noticed within a second; a wait longer than the
``timeout`` switch raises.

A rank that waits checks a few times, yields the core a few times, then sleeps in the kernel on the late rank's
counter (a futex, woken when that rank publishes): on oversubscribed cores (4 ranks on 2, or beside another job) a
waiting rank leaves the core to the ones it waits for. Spinning longer cost up to 1.18x gloo's training step beside
4 busy processes, 0.85x now (``benchmarks/loaded_cpu.py``, benchmarks/README.md).

The flag is published by a plain store after the bytes, which x86's total store order keeps in order for the
reader: other machines (and groups that span hosts, or a ``/dev/shm`` that cannot hold the region) keep gloo, and
so does a machine whose futex system call number tpflow does not know (the number is another call elsewhere: 202,
x86-64's futex, is aarch64's accept). ``transport(group)`` says which a group uses, and why.
``tpf.config.set(cpu_shared_memory=False)`` turns it off (on every rank alike).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import mmap
import os
import platform
import secrets
import threading
import time
import weakref
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist

from tpflow import config

__all__ = ["HostGroup", "carries", "futex_call", "host_group", "refusal", "transport"]

_CAPACITY = 1 << 20  # bytes a rank's slot holds: larger tensors go in rounds
_DIR = "/dev/shm"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8)
_ALL_REDUCE, _ALL_GATHER, _REDUCE_SCATTER = 1, 2, 3  # two bits of a signature
_NAMES = {_ALL_REDUCE: "all_reduce", _ALL_GATHER: "all_gather", _REDUCE_SCATTER: "reduce_scatter"}
_HOT_SPINS, _YIELDS = 64, 256  # checks before yielding the core, yields before sleeping in the kernel
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not private) futexes: other processes wait on them
# futex(2)'s number in each architecture's system call table (the kernel's syscall.tbl and asm-generic/unistd.h)
_FUTEX_CALLS = {"x86_64": 202, "amd64": 202, "i386": 240, "i686": 240, "armv7l": 240, "aarch64": 98, "riscv64": 98,
                "loongarch64": 98, "ppc64": 221, "ppc64le": 221, "s390x": 238}
_IN_ORDER = ("x86_64", "amd64")  # total store order: a plain store after the bytes publishes them
_NAP = 0.05  # seconds a sleeping rank waits before it looks for a dead peer or the timeout


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


# syscall(2) as a function object of its own (libc's ``syscall`` keeps whatever types others give it), each argument
# typed as the word the kernel reads: untyped, the seventh (val3) went on the stack with its upper half undefined. A
# CFUNCTYPE call lets go of the GIL while the kernel waits.
_syscall = ctypes.CFUNCTYPE(ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                            ctypes.POINTER(_Timespec), ctypes.c_void_p, ctypes.c_long,
                            use_errno=True)(("syscall", ctypes.CDLL(None)))
_NAP_SPEC = _Timespec(0, int(_NAP * 1e9))

_groups: weakref.WeakKeyDictionary[dist.ProcessGroup, HostGroup | str] = weakref.WeakKeyDictionary()  # or why not
_lock = threading.Lock()


def _numbers(t: torch.Tensor) -> np.ndarray:
    """``t``'s memory as a flat numpy array, no copy (bfloat16, which numpy lacks, as int16)."""
    t = t.detach()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().reshape(-1)


def _sum(slots: np.ndarray, dtype: torch.dtype, out: np.ndarray) -> None:
    """``out = slots[0] + slots[1] + ...`` (rank order, so every rank gets the same bits) for slots ``[W, n]``."""
    if dtype == torch.bfloat16:
        torch.sum(torch.from_numpy(slots).view(torch.bfloat16), 0, out=torch.from_numpy(out).view(torch.bfloat16))
    else:
        np.add.reduce(slots, axis=0, out=out)


def _fill(slot: np.ndarray, pieces: list[np.ndarray], lo: int, hi: int) -> None:
    """Bytes ``[lo, hi)`` of the pieces back to back into the start of ``slot``."""
    if len(pieces) == 1:
        slot[:hi - lo] = pieces[0][lo:hi]
        return
    start = 0
    for piece in pieces:
        end = start + piece.size
        if end > lo and start < hi:
            a, b = max(lo, start), min(hi, end)
            slot[a - lo:b - lo] = piece[a - start:b - start]
        if end >= hi:
            return
        start = end


class HostGroup:
    """A process group's ranks meeting in one shared-memory region (see the module's docstring).

    Made by ``host_group``, once per group, when its first CPU collective runs; the collectives of
    ``tpflow.comm`` go through it where it exists.

    Args:
        group: the process group; every rank of it must construct this at the same point (it runs two of
            the group's collectives to share the region).

    Example::

        >>> host = tpf.comm.shm.host_group(torch.distributed.group.WORLD)   # on 2 ranks of one host
        >>> t = torch.ones(3)
        >>> host.all_reduce(t)
        >>> t
        tensor([2., 2., 2.])
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.timeout = float(config.get("timeout"))
        self.exchanges = 0
        self.lock = threading.Lock()
        self.worker: concurrent.futures.ThreadPoolExecutor | None = None  # runs the asynchronous collectives
        self.thread: threading.Thread | None = None  # the worker's thread
        self.queued: list[concurrent.futures.Future] = []
        self.futex = futex_call(platform.machine())
        w = self.world
        # the first rank's token (64 bytes); arrived; the signatures; each rank's pid and pid namespace; the slots
        header = -(-(64 + 8 * w + 16 * w + 16 * w) // 64) * 64
        self.region, self.refused = _share(header + 2 * w * _CAPACITY, group)
        self.ok = self.region is not None
        if not self.ok:
            return
        raw = np.frombuffer(self.region, dtype=np.uint8)
        self.arrived = raw[64:64 + 8 * w].view(np.int64)
        self.signatures = raw[64 + 8 * w:64 + 24 * w].view(np.int64).reshape(2, w)
        self.ids = raw[64 + 24 * w:64 + 40 * w].view(np.int64).reshape(w, 2)
        self.slots = raw[header:].reshape(2, w, _CAPACITY)
        self.mine = [self.slots[k, self.rank] for k in (0, 1)]
        self.ids[self.rank] = (os.getpid(), os.stat("/proc/self/ns/pid").st_ino)

    def _wait(self, target: int, what: str) -> None:
        """Return once every rank has published exchange ``target``: a few checks, a few yields of the core, then
        asleep in the kernel on the first late rank's counter (a futex), woken by its publishing, so that a rank
        waiting on a busy machine leaves the core to the ranks it waits for."""
        arrived, start = self.arrived, None
        hot = _HOT_SPINS if threading.current_thread() is not self.thread else 0  # the worker leaves the GIL at once
        for spins in range(_YIELDS):
            if arrived.min() >= target:
                return
            if spins >= hot:
                os.sched_yield()  # a rank on this core may be the one to wait for (the GIL is let go meanwhile)
        while (late := [p for p in range(self.world) if arrived[p] < target]):
            seen = int(arrived[late[0]])
            _syscall(self.futex, arrived.ctypes.data + 8 * late[0], _FUTEX_WAIT, seen & 0xFFFFFFFF,
                     ctypes.byref(_NAP_SPEC), None, 0)
            if int(arrived[late[0]]) != seen:
                continue  # woken: that rank published
            start = start or time.monotonic()
            dead = [p for p in late if not self._alive(p)]
            if dead:
                raise RuntimeError(f"tpflow {what}: rank(s) {dead} of this group died before arriving")
            if time.monotonic() - start > self.timeout:
                raise RuntimeError(f"tpflow {what}: rank(s) {late} of this group did not arrive within the timeout "
                                   f"switch's {self.timeout:.0f} s: every rank must run the same collectives in the "
                                   "same order")

    def _publish(self) -> None:
        """Say this rank's bytes of exchange ``self.exchanges`` are in place, waking the ranks asleep on it."""
        self.arrived[self.rank] = self.exchanges
        _syscall(self.futex, self.arrived.ctypes.data + 8 * self.rank, _FUTEX_WAKE, self.world, None, None, 0)

    def drain(self) -> None:
        """Wait for the collectives queued on the worker: a collective called now follows them on every rank."""
        while self.queued:
            self.queued.pop(0).result()

    def _alive(self, peer: int) -> bool:
        pid, namespace = (int(v) for v in self.ids[peer])
        if namespace != os.stat("/proc/self/ns/pid").st_ino:
            return True  # another pid namespace: its pid means nothing here
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    def _rounds(self, mine: list[np.ndarray], dtype: torch.dtype, kind: int) -> Iterator[tuple[int, np.ndarray]]:
        """Exchange the concatenation of ``mine`` (flat arrays of one dtype) with every rank, a slot at a time:
        yields each round's offset (in elements) and every rank's elements of it ``[W, n]``, valid until the next
        round."""
        pieces = [m.view(np.uint8) for m in mine]
        total, size, numbers = sum(p.size for p in pieces), mine[0].itemsize, mine[0].dtype
        signature = total << 8 | _DTYPES.index(dtype) << 2 | kind
        for lo in range(0, max(total, 1), _CAPACITY):
            hi = min(lo + _CAPACITY, total)
            k = self.exchanges & 1
            self.exchanges += 1
            _fill(self.mine[k], pieces, lo, hi)
            self.signatures[k, self.rank] = signature
            self._publish()
            if self.arrived.min() < self.exchanges:
                self._wait(self.exchanges, _NAMES[kind])
            if lo == 0 and (self.signatures[k] != signature).any():
                self._disagree(self.signatures[k])
            yield lo // size, self.slots[k, :, :hi - lo].view(numbers)

    def _disagree(self, signatures: np.ndarray) -> None:
        said = "; ".join(f"rank {p}: {_NAMES.get(int(s) & 3, '?')} of {int(s) >> 8} bytes of "
                         f"{_DTYPES[int(s) >> 2 & 63] if (int(s) >> 2 & 63) < len(_DTYPES) else '?'}"
                         for p, s in enumerate(signatures))
        raise RuntimeError(f"tpflow collective {self.exchanges} of this group differs between ranks ({said}): every "
                           "rank must run the same collectives, with the same shapes and dtypes, in the same order")

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum ``t`` (contiguous, on CPU) over the group in place, in rank order."""
        self.drain()
        with self.lock:
            out = _numbers(t)
            for lo, slots in self._rounds([out], t.dtype, _ALL_REDUCE):
                _sum(slots, t.dtype, out[lo:lo + slots.shape[1]])

    def all_reduce_cat(self, pieces: list[torch.Tensor], out: torch.Tensor, async_op: bool = False):
        """The sum over the group of the pieces (contiguous, on CPU, ``out``'s dtype) back to back, into ``out``
        (flat, as many elements), without concatenating them first: they go straight into the slot. With
        ``async_op``, the group's worker thread runs it and the future is returned (``result()`` once done); the
        pieces must stay unchanged until then."""
        if async_op:
            if self.worker is None:
                self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tpflow-shm")
                self.thread = self.worker.submit(threading.current_thread).result()
            self.queued.append(self.worker.submit(self.all_reduce_cat, pieces, out))
            return self.queued[-1]
        if threading.current_thread() is not self.thread:
            self.drain()
        with self.lock:
            flat = _numbers(out)
            for lo, slots in self._rounds([_numbers(p) for p in pieces], out.dtype, _ALL_REDUCE):
                _sum(slots, out.dtype, flat[lo:lo + slots.shape[1]])

    def all_gather(self, out: torch.Tensor, part: torch.Tensor) -> None:
        """Every rank's ``part`` (equal sizes, contiguous) into ``out`` (contiguous), in rank order."""
        self.drain()
        with self.lock:
            whole = _numbers(out).reshape(self.world, -1)
            for lo, slots in self._rounds([_numbers(part)], part.dtype, _ALL_GATHER):
                whole[:, lo:lo + slots.shape[1]] = slots

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> None:
        """This rank's ``1/W`` of the sum of ``full`` (contiguous, ``W`` equal chunks) into ``out``, in rank
        order."""
        self.drain()
        with self.lock:
            mine = _numbers(out)
            start = self.rank * mine.size
            for lo, slots in self._rounds([_numbers(full)], full.dtype, _REDUCE_SCATTER):
                a, b = max(lo, start), min(lo + slots.shape[1], start + mine.size)
                if a < b:
                    _sum(slots[:, a - lo:b - lo], full.dtype, mine[a - start:b - start])


def futex_call(machine: str) -> int | None:
    """futex(2)'s system call number on ``machine``, as the kernel's tables give it; None where tpflow does not know
    it (there the ranks keep gloo: a wrong number is another system call).

    Args:
        machine: an architecture as ``platform.machine()`` names it.

    Returns:
        The number, or None.

    Example::

        >>> tpf.comm.shm.futex_call("x86_64"), tpf.comm.shm.futex_call("aarch64"), tpf.comm.shm.futex_call("sparc64")
        (202, 98, None)
    """
    return _FUTEX_CALLS.get(machine.lower())


def refusal(machine: str) -> str | None:
    """Why the CPU ranks of a ``machine`` host cannot meet in shared memory, None where they can.

    Args:
        machine: an architecture as ``platform.machine()`` names it.

    Returns:
        The reason (their collectives go through gloo), or None.

    Example::

        >>> tpf.comm.shm.refusal("x86_64") is None
        True
        >>> tpf.comm.shm.refusal("sparc64")
        "sparc64: futex(2)'s system call number there is not known to tpflow"
    """
    if futex_call(machine) is None:
        return f"{machine}: futex(2)'s system call number there is not known to tpflow"
    if machine.lower() not in _IN_ORDER:
        return f"{machine}: its stores may reach another core out of order (x86-64's total store order is relied on)"
    return None


def _share(size: int, group: dist.ProcessGroup) -> tuple[mmap.mmap | None, str | None]:
    """A ``size``-byte region every rank of ``group`` maps, or (on every rank) None and why not."""
    rank, path, token, refused = dist.get_rank(group), None, secrets.token_bytes(16), None
    if rank == 0:
        refused = refusal(platform.machine()) or (None if os.path.isdir(_DIR) else f"{_DIR} is missing")
    if rank == 0 and refused is None:
        path = os.path.join(_DIR, f"tpflow-{os.getpid()}-{secrets.token_hex(6)}")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)  # room now, or an error here: not a SIGBUS at the first write
                os.pwrite(fd, token, 0)
            finally:
                os.close(fd)
        except OSError as e:
            _unlink(path)
            path, refused = None, f"{_DIR} cannot hold the group's {size:,} bytes ({e})"
    said = [path, token, refused]
    dist.broadcast_object_list(said, src=dist.get_global_rank(group, 0), group=group)
    region = None
    if said[0] is not None:
        try:
            with open(said[0], "r+b") as f:
                region = mmap.mmap(f.fileno(), size)
            if region[:16] != said[1]:
                region.close()
                region = None
        except OSError:
            region = None
    everyone = torch.tensor([region is not None], dtype=torch.int32)
    dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=group)
    if rank == 0 and path is not None:
        _unlink(path)
    if not everyone.item() and region is not None:
        region.close()
        region = None
    return region, None if region is not None else said[2] or "a rank cannot map the first rank's file (another host)"


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _meeting(group: dist.ProcessGroup) -> HostGroup | str:
    """The group's ``HostGroup``, made at its first call, or why it has none."""
    if not config.get("cpu_shared_memory"):
        return "the cpu_shared_memory switch is off"
    try:
        return _groups[group]
    except KeyError:
        pass
    with _lock:
        if dist.get_world_size(group) == 1:
            found: HostGroup | str = "a group of one rank"
        else:
            host = HostGroup(group)
            found = host if host.ok else host.refused
        _groups[group] = found
    return found


def host_group(group: dist.ProcessGroup) -> HostGroup | None:
    """The shared-memory meeting place of ``group``'s ranks, made at its first call on every rank; None where
    the switch ``cpu_shared_memory`` is off, or the ranks cannot share memory (another host, a machine ``refusal``
    names, ``/dev/shm`` missing or full): gloo's collectives then.

    Call it at the same point on every rank of ``group``: the first call runs two of its collectives.

    Args:
        group: the process group (one with a CPU backend: gloo).

    Returns:
        The group's ``HostGroup``, or None.

    Example::

        >>> host = tpf.comm.shm.host_group(torch.distributed.group.WORLD)
        >>> host is tpf.comm.shm.host_group(torch.distributed.group.WORLD)   # one per group
        True
    """
    found = _meeting(group)
    return found if isinstance(found, HostGroup) else None


def transport(group: dist.ProcessGroup) -> str:
    """How the CPU collectives of ``group`` travel, and why (a report's header); called as ``host_group`` is.

    Args:
        group: the process group (one with a CPU backend: gloo).

    Returns:
        ``"shared memory (...)"``, or ``"gloo (...)"`` with the reason.

    Example::

        >>> tpf.comm.shm.transport(torch.distributed.group.WORLD)    # 2 ranks of an x86-64 host
        'shared memory (/dev/shm, futex: system call 202 on x86_64)'
    """
    found = _meeting(group)
    if isinstance(found, HostGroup):
        return f"shared memory ({_DIR}, futex: system call {found.futex} on {platform.machine()})"
    return f"gloo ({found})"


def carries(t: torch.Tensor) -> bool:
    """Whether ``t``'s collectives may go through shared memory: a contiguous CPU tensor of a dtype it adds.

    Args:
        t: the tensor a collective would send.

    Returns:
        True for contiguous CPU tensors of the floating and integer dtypes the region sums.

    Example::

        >>> tpf.comm.shm.carries(torch.ones(2)), tpf.comm.shm.carries(torch.ones(2, 2).t())
        (True, False)
    """
    return t.device.type == "cpu" and t.is_contiguous() and t.dtype in _DTYPES
