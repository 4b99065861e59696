"""The shared-memory collectives of CPU ranks on one host (tpflow.comm.shm): every dtype, sizes from none to several
slots, uneven chunks, the same bits on every rank, gloo's numbers, ranks that disagree or never arrive."""

from __future__ import annotations

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
