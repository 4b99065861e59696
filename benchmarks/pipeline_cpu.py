"""Pipeline schedules on CPU ranks: the measured bubble against theory, and peak activation memory.

    python -m tpflow.launch --nproc_per_node 4 benchmarks/pipeline_cpu.py [--reps 3]

``bubble``: stages of emulated compute: a forward sleeps ``--forward-ms``, a backward twice as long, so
that four stages on a 2-core machine do not contend for cores and the measurement is of the schedule
and the executor (hand-offs, headers, Python) rather than of the machine. For p = 2 and p = world stages of
one rank each, GPipe and 1F1B, m in {p, 2p, 4p}: bubble = 1 - (a stage's compute time) / (the step's
time on its slowest rank), averaged over the stages, against (p - 1) / (m + p - 1). The median of
``--reps`` steps after one warm-up step.

``memory``: stages of real layers (Linear, GELU, Linear of width ``--dim``), and the peak bytes of the
activations autograd saves on each stage during a step (each storage counted once, parameters not
counted), 1F1B against GPipe; stage s of 1F1B holds min(p - s, m) micro-batches, GPipe all m, so the
ratio's bound is p / m on stage 0.

Each run is appended to ``benchmarks/results/pipeline_<cpu>_<date>.md``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpflow as tpf
from benchmarks.collective_cpu import write
from tpflow.bench.measure import every_rank, step_times


class _Busy(torch.autograd.Function):
    """Stands for a stage's compute: sleeps in forward and (twice as long) in backward."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.seconds)
        return grad, None


class Emulated(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds, self.scale = seconds, nn.Parameter(torch.ones(()))

    def forward(self, x):
        return _Busy.apply(x * self.scale, self.seconds)


def _pipeline(blocks: list[nn.Module], schedule: str, micro_batches: int) -> tpf.Pipeline:
    stages = [tpf.stage(b, stage_id=i, placement=tpf.placement("cpu", [i])) for i, b in enumerate(blocks)]
    return tpf.Pipeline(stages, micro_batches=micro_batches, schedule=schedule, loss_fn=F.mse_loss)


def bubble(p: int, schedule: str, m: int, forward_s: float, reps: int) -> float:
    """The measured bubble of one configuration (the same on every rank)."""
    pipe = _pipeline([Emulated(forward_s) for _ in range(p)], schedule, m)
    x, y = torch.randn(4 * m, 8), torch.randn(4 * m, 8)
    walls, busy = [], []
    for rep in range(reps + 1):
        dist.barrier()
        start = time.perf_counter()
        pipe.step(x, y)
        wall = time.perf_counter() - start
        if rep:  # the first step warms up
            walls.append(wall)
            busy.append(sum(end - begin for a, begin, end in pipe.trace if a.kind in ("F", "B")))
    steps = step_times(walls)
    mine = [1 - b / s for b, s in zip(busy, steps)] if pipe.stage_index is not None else [0.0] * reps
    per_step = every_rank(mine)[:p].mean(0)  # averaged over the stages
    return statistics.median(per_step.tolist())


class _SavedBytes:
    """Live bytes of the tensors autograd saves for backward, each storage once, parameters excluded."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.skip = {self._local(p).untyped_storage().data_ptr() for p in params}
        self.refs: dict[int, list] = {}  # storage -> [count, bytes]
        self.live = self.peak = 0

    @staticmethod
    def _local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, torch.distributed.tensor.DTensor) else t

    def pack(self, t: torch.Tensor):
        storage = self._local(t).untyped_storage()
        key = storage.data_ptr()
        if key in self.skip or storage.nbytes() == 0:
            return t
        entry = self.refs.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        return _Held(self, key, t)

    def release(self, key: int) -> None:
        entry = self.refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[key]


class _Held:
    def __init__(self, owner: _SavedBytes, key: int, t: torch.Tensor) -> None:
        self.owner, self.key, self.tensor = owner, key, t

    def __del__(self) -> None:
        self.owner.release(self.key)


def _unpack(held):
    return held.tensor if isinstance(held, _Held) else held


def peak_activations(p: int, schedule: str, m: int, dim: int, rows: int) -> int:
    """Peak saved-activation bytes on this rank's stage during one step (0 off the pipeline)."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in range(p)]
    pipe = _pipeline(blocks, schedule, m)
    x, y = torch.randn(rows * m, dim), torch.randn(rows * m, dim)
    pipe.step(x, y)  # warm-up
    counter = _SavedBytes(list(pipe.parameters()))
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, _unpack):
        pipe.step(x, y)
    return counter.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--forward-ms", type=float, default=20.0)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--rows", type=int, default=16, help="rows per micro-batch in the memory runs")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    tpf.init_distributed()
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    stage_counts = sorted({2, world} - {1}) if world >= 2 else []
    if not stage_counts:
        raise SystemExit("a pipeline needs at least 2 ranks: python -m tpflow.launch --nproc_per_node 4 "
                         "benchmarks/pipeline_cpu.py")
    flags = f"--reps {args.reps} --forward-ms {args.forward_ms:g} --dim {args.dim} --rows {args.rows}"
    lines = [f"## {world} CPU ranks, 1 thread each; `{flags}`",
             "", f"Bubble: emulated stages, forward {args.forward_ms:g} ms, backward {2 * args.forward_ms:g} ms; "
             f"median of {args.reps} steps.", "",
             "| stages p | micro-batches m | theory (p-1)/(m+p-1) | GPipe | 1F1B |", "|---|---|---|---|---|"]
    for p in stage_counts:
        for m in (p, 2 * p, 4 * p):
            measured = {s: bubble(p, s, m, args.forward_ms / 1000, args.reps) for s in ("gpipe", "1f1b")}
            lines.append(f"| {p} | {m} | {(p - 1) / (m + p - 1):.1%} | {measured['gpipe']:.1%} | "
                         f"{measured['1f1b']:.1%} |")
    lines += ["", f"Peak saved activations per stage (Linear {args.dim} -> {4 * args.dim} -> {args.dim}, GELU; "
              f"{args.rows} rows a micro-batch, fp32):", "",
              "| stages p | m | stage | GPipe | 1F1B | 1F1B / GPipe | bound min(p-s, m) / m |",
              "|---|---|---|---|---|---|---|"]
    for p in stage_counts:
        for m in (p, 2 * p, 4 * p):
            peaks = {}
            for s in ("gpipe", "1f1b"):
                peaks[s] = [int(v) for v in every_rank([peak_activations(p, s, m, args.dim, args.rows)])[:p, 0]]
            for stage in range(p):
                g, f = peaks["gpipe"][stage], peaks["1f1b"][stage]
                lines.append(f"| {p} | {m} | {stage} | {g / 1024:.0f} KiB | {f / 1024:.0f} KiB | {f / g:.3f} | "
                             f"{min(p - stage, m) / m:.3f} |")
    if rank == 0:
        print("\n".join(lines))
        print(f"appended to {write('pipeline', lines, args.out)}")


if __name__ == "__main__":
    main()
