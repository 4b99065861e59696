"""The shared-memory collectives of CPU ranks on one host (tpflow.comm.shm): every dtype, sizes from none to several
slots, uneven chunks, the same bits on every rank, gloo's numbers, ranks that disagree or never arrive; the futex each
machine sleeps on, and machines that keep gloo; a rank that a heap error aborts leaves its stacks in the report."""

from __future__ import annotations

import os
import platform
import time
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import tpflow as tpf
from tests import harness
from tpflow.comm import shm
from tpflow.sbp import chunk_bounds

SIZES = (0, 1, 7, 256)
SLOTS = (1 << 18) + 3  # more than one slot (1 MiB) of float32: in rounds
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8)


def _tensor(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(0, 50, (n,), generator=g).to(dtype)


def _same_everywhere(t: torch.Tensor) -> bool:
    with tpf.config.override(cpu_shared_memory=False):
        every = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(every, t)
    return all(torch.equal(e, t) for e in every)


def _collectives() -> None:
    world, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    assert shm.host_group(group) is not None, "ranks of one host share memory"
    for dtype in DTYPES:
        for n in (*SIZES, SLOTS) if dtype in (torch.float32, torch.bfloat16) else SIZES:
            parts = [_tensor(n, dtype, seed) for seed in range(world)]
            t = parts[rank].clone()
            assert tpf.comm.all_reduce(t, group) is None
            exact = torch.stack([p.double() for p in parts]).sum(0)
            tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2}.get(dtype, 1e-6)
            torch.testing.assert_close(t.double(), exact, rtol=tol, atol=tol * world * 4)
            assert _same_everywhere(t), (dtype, n)
            with tpf.config.override(cpu_shared_memory=False):
                gloo = parts[rank].clone()
                tpf.comm.all_reduce(gloo, group)
            torch.testing.assert_close(t, gloo, rtol=tol, atol=tol * world * 4)
    for sizes in ((3,), (5, 0, 70_000, 1, 200_000), (1 << 18, 1 << 18)):  # pieces across rounds, and on their edges
        pieces = [[_tensor(n, torch.float32, 100 * seed + i) for i, n in enumerate(sizes)] for seed in range(world)]
        flat, work = tpf.comm.all_reduce_cat(pieces[rank], group, async_op=True)
        work.wait()
        exact = sum(torch.cat(p).double() for p in pieces)
        torch.testing.assert_close(flat.double(), exact, rtol=1e-6, atol=1e-5)
        assert _same_everywhere(flat)
    t = torch.ones(2, 3)
    tpf.comm.all_reduce(t, group, async_op=True).wait()  # an async caller gets a finished work
    assert torch.equal(t, torch.full((2, 3), float(world)))
    for rows in (world + 1, world * 70_000 + 1):  # uneven chunks; a rank's 1.07 MiB take two slots
        chunks = chunk_bounds(rows, world)
        full = _tensor(rows * 4, torch.float32, 7).view(rows, 4)
        gathered = tpf.comm.all_gather(full[chunks[rank][0]:chunks[rank][1]].t().contiguous().t(), 0, chunks, group)
        assert torch.equal(gathered, full)
        fulls = [_tensor(rows * 4, torch.float32, 10 + p).view(rows, 4) for p in range(world)]
        mine = tpf.comm.reduce_scatter(fulls[rank], 0, chunks, group)
        torch.testing.assert_close(mine, sum(fulls[1:], fulls[0].clone())[chunks[rank][0]:chunks[rank][1]])
    with pytest.raises(RuntimeError, match="differs between ranks.*rank 1: all_reduce of 8 bytes of torch.float32"):
        tpf.comm.all_reduce(torch.ones(1 + (rank == 1)), group)
    t = torch.ones(3)
    tpf.comm.all_reduce(t, group)  # the group goes on after ranks that disagreed
    assert t.tolist() == [world] * 3


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shared_memory_collectives(world):
    harness.run(world, _collectives)


def _late_rank() -> None:
    with tpf.config.override(timeout=1.0):
        group = dist.new_group(list(range(dist.get_world_size())))
        t = torch.ones(3)
        tpf.comm.all_reduce(t, group)  # the region is made, under the timeout of 1 s
    if dist.get_rank() == 0:
        with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] of this group did not arrive within"):
            tpf.comm.all_reduce(t, group)


def test_a_rank_that_never_arrives_fails_the_wait():
    try:
        harness.run(2, _late_rank)
    finally:
        harness.discard(2)  # rank 0 is an exchange ahead of rank 1 on that group


def _switched_off() -> tuple[bool, float]:
    with tpf.config.override(cpu_shared_memory=False):
        t = torch.ones(2)
        tpf.comm.all_reduce(t, dist.group.WORLD)
        return shm.host_group(dist.group.WORLD) is None, t[0].item()


def test_the_switch_turns_it_off():
    assert harness.run(2, _switched_off) == [(True, 2.0)] * 2


def test_each_machine_sleeps_on_its_own_futex_number():
    """202 is x86-64's futex but aarch64's accept: each machine's number from the kernel's tables, or none."""
    expected = {"x86_64": 202, "AMD64": 202, "i686": 240, "aarch64": 98, "riscv64": 98, "ppc64le": 221, "s390x": 238,
                "armv7l": 240, "sparc64": None, "mips": None, "": None}
    for machine, number in expected.items():
        with mock.patch("platform.machine", return_value=machine):
            assert shm.futex_call(platform.machine()) == number, machine
    assert shm.refusal("x86_64") is None
    assert "futex(2)'s system call number there is not known" in shm.refusal("sparc64")
    assert "out of order" in shm.refusal("aarch64")


def _machines() -> dict[str, tuple[bool, str, float]]:
    """Per faked machine: whether a new group meets in shared memory, its transport, and an all-reduce's sum."""
    seen = {}
    for machine in ("sparc64", "aarch64", platform.machine()):
        with mock.patch("platform.machine", return_value=machine):
            group = dist.new_group(list(range(dist.get_world_size())))
            said = shm.transport(group)
            t = torch.ones(2)
            tpf.comm.all_reduce(t, group)
            seen[machine] = (shm.host_group(group) is not None, said, t[0].item())
    return seen


def test_an_unknown_machine_keeps_gloo_and_says_why():
    for seen in harness.run(2, _machines):
        assert seen["sparc64"] == (False, "gloo (sparc64: futex(2)'s system call number there is not known to "
                                          "tpflow)", 2.0)
        assert seen["aarch64"][0] is False and "aarch64: its stores may reach another core out of order" in \
            seen["aarch64"][1] and seen["aarch64"][2] == 2.0
        if platform.machine() == "x86_64":
            assert seen["x86_64"] == (True, "shared memory (/dev/shm, futex: system call 202 on x86_64)", 2.0)


def _waiting_cpu() -> float:
    """CPU seconds this rank's thread spends in an all-reduce that rank 1 joins a second late."""
    group = dist.group.WORLD
    assert shm.host_group(group) is not None
    t = torch.ones(1)
    tpf.comm.all_reduce(t, group)
    if dist.get_rank() == 1:
        time.sleep(1.0)
    start = time.thread_time()
    tpf.comm.all_reduce(t, group)
    return time.thread_time() - start


def test_a_waiting_rank_sleeps_in_the_kernel():
    """The futex call really sleeps (a wrong number or argument returns at once, and the rank spins its second)."""
    waited, _ = harness.run(2, _waiting_cpu)
    assert waited < 0.3, f"rank 0 spent {waited:.2f} CPU seconds waiting 1 s for rank 1: the futex did not sleep"


def _aborts_in_a_worker_thread() -> None:
    """Rank 1 aborts as glibc does on a corrupted heap (SIGABRT), from a thread of its own while the main one waits."""
    if dist.get_rank() == 1:
        import threading

        threading.Thread(target=os.abort, name="aborting-thread").start()
        time.sleep(30)


def test_a_rank_killed_by_a_signal_leaves_its_stacks_in_the_report():
    try:
        with pytest.raises(AssertionError) as caught:
            harness.run(2, _aborts_in_a_worker_thread, timeout=60)
    finally:
        harness.discard(2)
    report = str(caught.value)
    assert "rank 1 died (exit code -6); its threads' stacks then (faulthandler):" in report, report
    assert "Fatal Python error: Aborted" in report and "_aborts_in_a_worker_thread" in report, report
