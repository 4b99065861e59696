"""tpflow's collectives of CPU ranks on one host: shared memory (``tpflow.comm.shm``) against gloo, side by side.

    python -m tpflow.launch --nproc_per_node 2 benchmarks/shm_cpu.py [--reps 2000]

For each size (float32 elements: a decode step's hidden state of one and of 8 tokens, a bucket of gradients),
``tpf.comm.all_reduce`` and ``tpf.comm.all_gather`` run ``--reps`` times with the ``cpu_shared_memory`` switch on,
then off (gloo), the two taking turns in rounds of a tenth of the reps; the time is the median round's mean call,
on the slowest rank. Each run is appended to ``benchmarks/results/shm_cpu_<cpu>_<date>.md``, with what the switch on
gave (``tpf.comm.shm.transport``: shared memory, or gloo and why, as on a machine it refuses).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import tpflow as tpf
from benchmarks.collective_cpu import write
from tpflow.bench.measure import step_times
from tpflow.sbp import chunk_bounds

SIZES = (256, 2048, 1 << 16, 1 << 20)


def _round(fn, calls: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return step_times([(time.perf_counter() - start) / calls])[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    torch.set_num_threads(1)
    tpf.init_distributed()
    group, world, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    with tpf.config.override(cpu_shared_memory=True):
        transport = tpf.comm.shm.transport(group)
    rows = [f"| {n:,} ({n * 4 / 1024:,.0f} KiB) |" for n in SIZES]
    for i, n in enumerate(SIZES):
        reps = max(10, args.reps if n < 1 << 16 else args.reps // 20)
        x = torch.randn(n)
        chunks = chunk_bounds(n, world)
        part = x[chunks[rank][0]:chunks[rank][1]].clone()
        ops = {"all_reduce": lambda x=x: tpf.comm.all_reduce(x.mul_(0.5), group),
               "all_gather": lambda part=part, chunks=chunks: tpf.comm.all_gather(part, 0, chunks, group)}
        for fn in ops.values():
            rounds: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(10):
                for on in (True, False):
                    with tpf.config.override(cpu_shared_memory=on):
                        fn()  # warm: the group's region is made at its first call
                        rounds[on].append(_round(fn, max(1, reps // 10)))
            shm, gloo = (statistics.median(rounds[on]) * 1e6 for on in (True, False))
            rows[i] += f" {shm:,.1f} | {gloo:,.1f} | {shm / gloo:.3f}x |"
    if rank == 0:
        command = f"python -m tpflow.launch --nproc_per_node {world} benchmarks/shm_cpu.py --reps {args.reps}"
        lines = [f"# Collectives of {world} CPU ranks on one host: shared memory against gloo, float32", "",
                 f"Command: `{command}`", "", f"With the switch on: {transport}.", "",
                 "| elements | all-reduce shm us | gloo us | shm / gloo | all-gather shm us | gloo us | shm / gloo |",
                 "|---|---|---|---|---|---|---|", *rows]
        print("\n".join(lines))
        print(f"appended to {write('shm_cpu', lines, args.out)}")


if __name__ == "__main__":
    main()
