"""tpflow's CPU collectives under stress, looking for memory errors (issue 54's heap corruption): shared memory on
and off, with glibc's heap checks.

    LD_PRELOAD=libc_malloc_debug.so.0 MALLOC_CHECK_=3 MALLOC_PERTURB_=165 \\
        python -m tpflow.launch --nproc_per_node 2 benchmarks/heap_cpu.py [--iterations 300]

Every iteration runs, with the ``cpu_shared_memory`` switch on and then off (gloo), the same on every rank:

- an all-reduce, an all-gather and a reduce-scatter of a random dtype and size (up to past a shared-memory slot, so
  some go in rounds);
- a bucket summed asynchronously (``all_reduce_cat``: on the shared-memory group's worker thread) while this thread
  allocates and frees tensors of many small sizes, so that both threads use glibc's per-size caches at once;
- a backward of a data-parallel MLP whose gradients are summed in 2 KiB buckets while the backward runs
  (``grad_sync="backward"``: the worker sums while autograd allocates);

and checks every result: the collectives' against their exact values (small integers), the gradients against one
device's. A corrupted heap aborts the rank (glibc's checks; ``MALLOC_CHECK_`` takes effect only with
``libc_malloc_debug.so`` preloaded, glibc 2.34 on; ``MALLOC_PERTURB_`` fills freed memory, so a read after a free
gives garbage the checks see), a wrong value raises. The counts, the transport and the heap settings are appended to
``benchmarks/results/heap_cpu_<cpu>_<date>.md``.
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import time

import torch
import torch.distributed as dist

import tpflow as tpf
from benchmarks.collective_cpu import write
from tpflow.comm import shm
from tpflow.sbp import chunk_bounds

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8)
SLOT = 1 << 20  # bytes of a shared-memory slot: larger tensors go in rounds
HEAP = ("LD_PRELOAD", "MALLOC_CHECK_", "MALLOC_PERTURB_", "GLIBC_TUNABLES")


def ints(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """``n`` small integers (sums of a few ranks stay exact in every dtype) of ``dtype``, from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0 if dtype == torch.uint8 else -4, 5, (n,), generator=g).to(dtype)


def collectives(pick: random.Random, seed: int, group: dist.ProcessGroup) -> None:
    """An all-reduce, an all-gather and a reduce-scatter of a random dtype and size, checked."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    dtype = pick.choice(DTYPES)
    n = pick.choice((0, 1, pick.randrange(2, 4096), pick.randrange(SLOT // 8, SLOT // 2 + 3)))
    every = [ints(n, dtype, seed + r) for r in range(world)]
    total = torch.stack(every).sum(0).to(dtype)
    t = every[rank].clone()
    tpf.comm.all_reduce(t, group)
    assert torch.equal(t, total), f"all_reduce of {n} {dtype}"
    chunks = chunk_bounds(n, world)
    whole = tpf.comm.all_gather(every[0][chunks[rank][0]:chunks[rank][1]].clone(), 0, chunks, group)
    assert torch.equal(whole, every[0]), f"all_gather of {n} {dtype}"
    mine = tpf.comm.reduce_scatter(every[rank].clone(), 0, chunks, group)
    assert torch.equal(mine, total[chunks[rank][0]:chunks[rank][1]]), f"reduce_scatter of {n} {dtype}"


def bucket(pick: random.Random, seed: int, group: dist.ProcessGroup) -> None:
    """A bucket summed asynchronously while this thread churns the heap, checked."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    sizes = [pick.randrange(0, 3000) for _ in range(pick.randrange(1, 12))]
    pieces = [[ints(s, torch.float32, seed + 100 * r + i) for i, s in enumerate(sizes)] for r in range(world)]
    flat, work = tpf.comm.all_reduce_cat(pieces[rank], group, async_op=True)
    churn = [torch.empty(pick.randrange(1, 300)) for _ in range(200)]  # small chunks: glibc's tcache sizes
    del churn[::2]
    churn += [torch.ones(pick.randrange(1, 64)) * k for k in range(100)]
    work.wait()
    exact = sum(torch.cat(p) for p in pieces) if sizes else torch.zeros(0)
    assert torch.equal(flat, exact), f"all_reduce_cat of pieces {sizes}"


class Training:
    """A data-parallel MLP (float64) whose gradients tpflow sums in small buckets during the backward, and one
    device's copy of it to check them against."""

    def __init__(self, world: int) -> None:
        torch.manual_seed(0)
        self.reference = torch.nn.Sequential(*(m for _ in range(4) for m in (torch.nn.Linear(24, 24), torch.nn.Tanh())),
                                             torch.nn.Linear(24, 3)).double()
        self.placement = tpf.placement("cpu", ranks=list(range(world)))
        self.model = tpf.to_global(copy.deepcopy(self.reference), placement=self.placement)
        self.world = world

    def step(self, seed: int) -> None:
        """One backward on 4 rows a rank, checked against one device's on every rank's rows."""
        x = torch.randn(4 * self.world, 24, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        rank = dist.get_rank()
        local = tpf.to_global(x[4 * rank:4 * rank + 4], placement=self.placement, sbp=tpf.sbp.split(0))
        self.model.zero_grad(set_to_none=True)
        self.reference.zero_grad(set_to_none=True)
        with tpf.config.override(grad_sync="backward", grad_bucket_bytes=2048):
            (self.model(local) ** 2).sum().backward()
        (self.reference(x) ** 2).sum().backward()
        for (name, p), q in zip(self.model.named_parameters(), self.reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad.to_local(), q.grad, rtol=1e-10, atol=1e-10, msg=name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iterations", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    torch.set_num_threads(1)
    tpf.init_distributed()
    group, world = dist.group.WORLD, dist.get_world_size()
    training, transports = Training(world), {}
    start = time.perf_counter()
    for i in range(args.iterations):
        for on in (True, False):
            with tpf.config.override(cpu_shared_memory=on):
                transports[on] = shm.transport(group)
                pick, seed = random.Random(f"{args.seed}/{i}/{on}"), 1000 * (args.seed * args.iterations + i)
                collectives(pick, seed, group)
                bucket(pick, seed, group)
                training.step(seed)
    seconds = time.perf_counter() - start
    if dist.get_rank() == 0:
        heap = ", ".join(f"{k}={os.environ[k]}" for k in HEAP if k in os.environ) or "glibc's defaults"
        command = (f"python -m tpflow.launch --nproc_per_node {world} benchmarks/heap_cpu.py --iterations "
                   f"{args.iterations} --seed {args.seed}")
        lines = [f"# tpflow's collectives of {world} CPU ranks under stress: shared memory and gloo", "",
                 f"Command: `{command}`", "", f"Heap: {heap}.", "",
                 "| transport | iterations: an all-reduce, all-gather, reduce-scatter, async bucket, backward each | "
                 "every result right |", "|---|---|---|",
                 *(f"| {transports[on]} | {args.iterations:,} | True |" for on in (True, False)), "",
                 f"{seconds:.1f} s in all; no rank aborted."]
        print("\n".join(lines))
        print(f"appended to {write('heap_cpu', lines, args.out)}")


if __name__ == "__main__":
    main()
