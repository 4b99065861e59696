"""CPU benchmarks of the ring collectives: real gloo ranks, and an emulated link.

    python -m tpflow.launch --nproc_per_node 2 benchmarks/collective_cpu.py gloo [--size 1024]
    python benchmarks/collective_cpu.py fake

``gloo``: each rank one thread, fp32, M = N = K = size with K split over the ranks. Side by
side, interleaved so drift hits all alike: torch.matmul + dist.reduce_scatter_tensor (gloo's
is an all-reduce underneath), the ring with two and with one message per chunk, and the
all-gather + matmul mirror against dist.all_gather_into_tensor + torch.matmul. Bytes and
messages come from tpflow's counters.

``fake``: ranks as threads on a FakeWorld whose link bandwidth is set from the measured compute
time, so the transfer would take 0.5x and 2x of it; overlap efficiency E = (compute + transfer -
ring) / min(compute, transfer). Keep ``--world`` at most the core count: with more threads than
cores, the compute-only baseline itself stalls on the ring's order.

Each run is appended to ``benchmarks/results/collective_<mode>_<cpu>_<date>.md``.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from tpflow import comm, config, init_distributed
from tpflow.bench.measure import cpu_name, source_version, step_times
from tpflow.bench.results import file_slug
from tpflow.comm import FakeWorld, stats
from tpflow.ops import all_gather_matmul, matmul_reduce_scatter
from tpflow.sbp import chunk_bounds


def add_late(flag: bool, fn):
    """``fn`` with the reduce-scatter ring's late add (the ``ring_add_late`` switch) set to ``flag``."""
    def run(*args):
        with config.override(ring_add_late=flag):
            return fn(*args)
    return run


def write(name: str, lines: list[str], out: str) -> pathlib.Path:
    """Append this run to the day's file for ``name`` and this CPU, with the code's commit: repeated runs
    stay side by side, so a range quoted from them is backed by the file."""
    device = file_slug(cpu_name())
    path = pathlib.Path(out) / f"{name}_{device}_{datetime.date.today()}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [*lines[:1], "", f"Code: tpflow {source_version()}.", *lines[1:]]
    with path.open("a") as f:
        f.write(("\n" if path.stat().st_size else "") + "\n".join(lines) + "\n")
    return path


OVERLAP = ("Transfer = bytes per rank / bandwidth. Overlap E = (compute + transfer - ring) / min(compute, transfer): "
           "the share of the shorter of the two hidden behind the other (1 = perfect).")


def median_seconds(run: Callable[[], object], reps: int) -> float:
    """The median wall time of ``reps`` calls of ``run`` (a FakeWorld's ranks, all of them, each call)."""
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def overlap(compute: float, transfer: float, ring: float) -> float:
    """The share of the shorter of compute and transfer that the ring hid behind the other: ``OVERLAP``'s E."""
    return (compute + transfer - ring) / min(compute, transfer)


def bench_gloo(size: int, reps: int, out: str) -> None:
    torch.set_num_threads(1)
    init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(size, size // world, generator=gen)  # K shard: a row layer's input
    w = torch.randn(size // world, size, generator=gen)
    rows = chunk_bounds(size, world)
    own = slice(*rows[rank])
    x_rows = torch.randn(size, size, generator=gen)[own].contiguous()  # M shard: a sequence-parallel input
    w_cols = torch.randn(size, size // world, generator=gen)
    group = dist.group.WORLD  # the library collectives, with their bytes counted by tpflow.comm

    def torch_rs():
        return comm.reduce_scatter(torch.matmul(x, w), 0, rows, group)

    def torch_ag():
        return torch.matmul(comm.all_gather(x_rows, 0, rows, group), w_cols)

    cases = {
        "matmul + reduce_scatter_tensor (torch)": torch_rs,
        "matmul alone, no communication (the floor)": lambda: torch.matmul(x, w),
        "matmul_reduce_scatter ring, 1 msg/chunk, late add": add_late(
            True, lambda: matmul_reduce_scatter(x, w, algo="ring", splits=1)),
        "matmul_reduce_scatter ring, 2 msgs/chunk, late add": add_late(
            True, lambda: matmul_reduce_scatter(x, w, algo="ring", splits=2)),
        "matmul_reduce_scatter ring, 2 msgs/chunk, add in epilogue": add_late(
            False, lambda: matmul_reduce_scatter(x, w, algo="ring", splits=2)),
        "matmul_reduce_scatter ring, 1 msg/chunk, add in epilogue": add_late(
            False, lambda: matmul_reduce_scatter(x, w, algo="ring", splits=1)),
        "all_gather_into_tensor + matmul (torch)": torch_ag,
        "all_gather_matmul ring": lambda: all_gather_matmul(x_rows, w_cols, rows=size, algo="ring"),
    }
    for late in (True, False):
        torch.testing.assert_close(add_late(late, lambda: matmul_reduce_scatter(x, w, algo="ring"))(), torch_rs())
    torch.testing.assert_close(all_gather_matmul(x_rows, w_cols, algo="ring"), torch_ag())
    times: dict[str, list[float]] = {name: [] for name in cases}
    traffic = {}
    for rep in range(reps + 2):  # two warm-up rounds
        for name, fn in cases.items():
            dist.barrier()
            stats.reset()
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            if rep >= 2:
                times[name].append(elapsed)
            traffic[name] = (stats.bytes_sent, stats.messages_sent)
    slowest = {name: step_times(times[name]) for name in cases}  # a step ends with its slowest rank
    if rank:
        return
    rs_base, ag_base = "matmul + reduce_scatter_tensor (torch)", "all_gather_into_tensor + matmul (torch)"
    lines = [f"# Ring collectives on gloo, {world} ranks x 1 thread, fp32, M = N = K = {size}",
             "", f"{datetime.datetime.now():%Y-%m-%d %H:%M}, {cpu_name()}, torch {torch.__version__}. {reps} "
             "interleaved repetitions; a repetition's time is its slowest rank's. The ratio is the median of "
             "each repetition's ratio to the torch case run just before it (paired, so drift cancels).",
             f"Command: `python -m tpflow.launch --nproc_per_node {world} benchmarks/collective_cpu.py gloo "
             f"--size {size} --reps {reps}`", "",
             "| case | median ms | vs torch | bytes sent / rank | messages / rank |", "|---|---:|---:|---:|---:|"]
    for name in cases:
        nbytes, msgs = traffic[name]
        base = slowest[ag_base if "all_gather" in name else rs_base]
        ratio = statistics.median(t / b for t, b in zip(slowest[name], base))
        lines.append(f"| {name} | {statistics.median(slowest[name]) * 1e3:.2f} | {ratio:.2f}x | {nbytes:,} | {msgs} |")
    print("\n".join(lines))
    print(f"wrote {write('collective_gloo', lines, out)}")


def bench_fake(size: int, world: int, reps: int, out: str) -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(size, size // world, generator=gen) for _ in range(world)]
    ws = [torch.randn(size // world, size, generator=gen) for _ in range(world)]

    def step(t, splits):
        return matmul_reduce_scatter(xs[t.rank], ws[t.rank], t, algo="ring", splits=splits)

    def timed(fake: FakeWorld, splits: int, late: bool) -> float:
        return median_seconds(lambda: add_late(late, fake.run)(step, splits), reps)

    nbytes = (world - 1) * (size // world) * size * 4  # per rank, fp32 partials
    lines = [f"# Ring matmul + reduce-scatter on an emulated link ({world} ranks as threads, fp32, M = N = K = {size})",
             "", f"{datetime.datetime.now():%Y-%m-%d %H:%M}, {cpu_name()}, torch {torch.__version__}; median of "
             f"{reps}. Command: `python benchmarks/collective_cpu.py fake --size {size} --world {world}`", "",
             OVERLAP, "",
             "| link | msgs/chunk | accumulator added | compute-only ms | transfer ms | ring ms | overlap E |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for splits, late in ((1, True), (2, True), (4, False), (2, False), (1, False)):
        compute = timed(FakeWorld(world), splits, late)
        for ratio in (0.5, 2.0):
            transfer = ratio * compute
            ring = timed(FakeWorld(world, bandwidth=nbytes / transfer), splits, late)
            lines.append(f"| transfer = {ratio}x compute | {splits} | {'late' if late else 'in the epilogue'} | "
                         f"{compute * 1e3:.1f} | {transfer * 1e3:.1f} | {ring * 1e3:.1f} | "
                         f"{overlap(compute, transfer, ring):.0%} |")
    print("\n".join(lines))
    print(f"wrote {write('collective_fake', lines, out)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["gloo", "fake"])
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--world", type=int, default=2, help="fake: ranks")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if args.mode == "gloo":
        bench_gloo(args.size, args.reps, args.out)
    else:
        bench_fake(args.size, args.world, args.reps, args.out)


if __name__ == "__main__":
    main()
