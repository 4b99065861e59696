"""Where the step of data parallelism and of a pipeline goes on CPU ranks, beside PyTorch's: each rank's wall and
CPU time a step, ``torch.profiler``'s self CPU time by op, and what posting a gloo send costs.

    python -m tpflow.launch --nproc_per_node 2 benchmarks/profile_cpu.py [--steps 40] [--tiny]

Pairs of harness modes (``tpflow.bench``): tpflow's SBP data parallelism against DDP on its MLP and transformer
workloads, and tpflow's 1F1B against ``torch.distributed.pipelining``'s on the MLP. The two modes of a pair take
turns step by step, each step after a barrier; a step's time is the slowest rank's, its CPU time each rank's process
time (every thread). Then 5 steps of each mode under ``torch.profiler`` give the first and the last rank's self CPU
time by op, a step's worth. Last, a 64 KiB ``dist.isend`` of rank 0 to rank 1 is timed as it is posted, with rank
1's receive posted before it (as tpflow's pipeline posts its receives) and after it. Each run is appended to
``benchmarks/results/profile_cpu_<cpu>_<date>.md``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.profiler import profile

import tpflow as tpf
from benchmarks.collective_cpu import write
from tpflow.bench.modes import build
from tpflow.bench.trainer import Context
from tpflow.bench.workloads import build as build_workload

PAIRS = (("mlp", ("data, tpflow SBP", "data, DDP")), ("transformer", ("data, tpflow SBP", "data, DDP")),
         ("mlp", ("pipeline, 1F1B", "pipeline, 1F1B, torch")))
TOP = 10  # ops listed per mode


def _timed(trainers: dict, steps: int) -> dict[str, tuple[list[float], list[float]]]:
    """Each mode's (slowest rank's wall seconds, this rank's CPU seconds) per step, the modes taking turns."""
    found = {name: ([], []) for name in trainers}
    for _ in range(steps):
        for name, trainer in trainers.items():
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            trainer.step()
            found[name][1].append(time.process_time() - cpu)
            found[name][0].append(time.perf_counter() - wall)
    slowest = torch.tensor([found[name][0] for name in trainers])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {name: (slowest[i].tolist(), found[name][1]) for i, name in enumerate(trainers)}


def _ops(trainer, steps: int = 5) -> tuple[float, list[tuple[str, float, float]]]:
    """This rank's self CPU ms a step under ``torch.profiler``, and the top ops: (name, ms a step, calls a step)."""
    with profile() as prof:
        for _ in range(steps):
            trainer.step()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) / 1e3 / steps
    return total, [(e.key, e.self_cpu_time_total / 1e3 / steps, e.count / steps) for e in events[:TOP]]


def _isend_posts(nbytes: int, ahead: bool, reps: int) -> float:
    """Rank 0's median seconds to post a ``dist.isend`` of ``nbytes`` to rank 1, whose receive is posted before it
    (``ahead``) or 3 ms after it."""
    rank, posts = dist.get_rank(), []
    for i in range(reps):
        buf = torch.empty(nbytes, dtype=torch.uint8)
        if rank == 1:
            if ahead:
                work = dist.irecv(buf, 0, tag=i)
                dist.barrier()
            else:
                dist.barrier()
                time.sleep(0.003)
                work = dist.irecv(buf, 0, tag=i)
            work.wait()
        elif rank == 0:
            message = torch.ones(nbytes, dtype=torch.uint8)
            dist.barrier()
            if ahead:
                time.sleep(0.002)  # the receive is in
            start = time.perf_counter()
            work = dist.isend(message, 1, tag=i)
            posts.append(time.perf_counter() - start)
            work.wait()
        else:
            dist.barrier()
    return statistics.median(posts) if posts else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--tiny", action="store_true", help="a run of seconds, for tests: dim 32, 2 steps")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    torch.set_num_threads(1)
    tpf.init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    ctx = Context(world=world, rank=rank, device=torch.device("cpu"))
    size = dict(dim=32, hidden=64, tokens=64) if args.tiny else dict(dim=256, hidden=1024, tokens=256)
    steps = 2 if args.tiny else args.steps
    lines = []
    for workload, pair in PAIRS:
        trainers = {name: build(name, build_workload(workload, depth=4, seq=32, heads=8, kv_heads=4, **size), ctx)
                    for name in pair}
        for trainer in trainers.values():
            for _ in range(3):
                trainer.step()
        times = _timed(trainers, steps)
        cpu = torch.tensor([statistics.median(times[name][1]) for name in pair])
        every = [torch.zeros_like(cpu) for _ in range(world)]
        dist.all_gather(every, cpu)
        ratios = [a / b for a, b in zip(times[pair[0]][0], times[pair[1]][0])]
        lines += [f"## {pair[0]} against {pair[1]}, {workload} (dim {size['dim']}), {steps} steps each", "",
                  "| mode | step ms (slowest rank, median) | CPU ms a step, per rank (median) |", "|---|---|---|"]
        for i, name in enumerate(pair):
            per_rank = ", ".join(f"{float(c[i]) * 1e3:.1f}" for c in every)
            lines.append(f"| {name} | {statistics.median(times[name][0]) * 1e3:.1f} | {per_rank} |")
        lines += ["", f"Step by step, {pair[0]} / {pair[1]}: median {statistics.median(ratios):.3f}, quartiles "
                  f"{statistics.quantiles(ratios, n=4)[0]:.3f}-{statistics.quantiles(ratios, n=4)[2]:.3f}."
                  if len(ratios) > 1 else "", ""]
        for name, trainer in trainers.items():
            found = [None] * world
            dist.all_gather_object(found, _ops(trainer))
            for r in sorted({0, world - 1}):  # the first rank, and the last (a pipeline's last stage: the loss)
                total, top = found[r]
                lines += [f"Rank {r}'s self CPU time under torch.profiler, {name}: {total:.1f} ms a step.", "",
                          "| op | self CPU ms a step | calls a step |", "|---|---|---|",
                          *(f"| {key} | {ms:.2f} | {calls:g} |" for key, ms, calls in top), ""]
        del trainers
    reps = 5 if args.tiny else 50
    ahead, late = (_isend_posts(1 << 16, on, reps) for on in (True, False))
    lines += [f"Posting rank 0's `dist.isend` of 64 KiB to rank 1 (gloo, median of {reps}): {ahead * 1e6:.0f} us with "
              f"the receive posted before it, {late * 1e6:.0f} us with the receive posted after it."]
    if rank == 0:
        command = f"python -m tpflow.launch --nproc_per_node {world} benchmarks/profile_cpu.py" + \
            (" --tiny" if args.tiny else f" --steps {args.steps}")
        lines = [f"# Where data parallelism's and a pipeline's step goes, {world} CPU ranks", "",
                 f"Command: `{command}`", "", *lines]
        print("\n".join(lines))
        print(f"appended to {write('profile_cpu', lines, args.out)}")


if __name__ == "__main__":
    main()
