"""Pipeline schedules on CPU ranks, tpflow's beside torch.distributed.pipelining's: the measured bubble against each
schedule's formula, step time, bytes sent, and peak activation memory.

    python -m tpflow.launch --nproc_per_node 4 benchmarks/pipeline_cpu.py [--reps 3] [--forward-ms 20]

``bubble``: stages of emulated compute: a forward sleeps ``--forward-ms``, the input's gradient as long, and the
weights' gradient as long again (so a whole backward costs two forwards, and ZB-H1 can move the weights' half),
so that four stages on a 2-core machine do not contend for cores and the measurement is of the schedule and the
executor (hand-offs, headers, Python) rather than of the machine. For p = world rank sets of one rank, each of
GPipe, 1F1B, interleaved (two stages a rank) and ZB-H1 (torch's zero-bubble schedule for one stage a rank,
``ScheduleInterleavedZeroBubble``, beside it), m in {p, 2p, 4p}: bubble = 1 - (a rank's compute time) / (the
step's time on the slowest rank), averaged over the ranks, against ``tpflow.pipeline.schedule.bubble``; the step
time (median of ``--reps`` steps after one warm-up step) and the bytes a rank sends a step, tpflow's over
torch's.

``memory``: stages of real layers (Linear, GELU, Linear of width ``--dim``), and the peak bytes of the activations
autograd saves on each rank during a step (each storage counted once, parameters not counted), every schedule,
tpflow's and torch's.

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
from tpflow.bench.pipelines import SCHEDULES, counting_p2p
from tpflow.kernels import wanted
from tpflow.pipeline.schedule import bubble as formula


class Clock:
    """This rank's time in emulated compute."""

    def __init__(self) -> None:
        self.busy = 0.0

    def sleep(self, seconds: float) -> None:
        start = time.perf_counter()
        time.sleep(seconds)
        self.busy += time.perf_counter() - start


class _Busy(torch.autograd.Function):
    """Stands for a stage's compute ``x * scale``: sleeps in forward, and in backward once for the input's gradient
    and once for the weight's, each only where autograd wants it (a zero-bubble schedule asks for them apart). A
    first stage, whose input wants no gradient, still spends both in its whole backward."""

    @staticmethod
    def forward(ctx, x, scale, seconds, clock):
        ctx.save_for_backward(x, scale)
        ctx.seconds, ctx.clock = seconds, clock
        clock.sleep(seconds)
        return x * scale

    @staticmethod
    def backward(ctx, grad):
        x, scale = ctx.saved_tensors
        dx = dscale = None
        if wanted(ctx, 0) or (not ctx.needs_input_grad[0] and wanted(ctx, 1)):
            ctx.clock.sleep(ctx.seconds)
            dx = grad * scale if wanted(ctx, 0) else None
        if wanted(ctx, 1):
            ctx.clock.sleep(ctx.seconds)
            dscale = (grad * x).sum()
        return dx, dscale, None, None


class Emulated(nn.Module):
    def __init__(self, seconds: float, clock: Clock) -> None:
        super().__init__()
        self.seconds, self.clock, self.scale = seconds, clock, nn.Parameter(torch.ones(()))

    def forward(self, x):
        return _Busy.apply(x, self.scale, self.seconds, self.clock)


def _tpflow_step(blocks: list[nn.Module], name: str, m: int):
    """tpflow's pipeline of ``blocks`` (stage k on rank k mod world): a step function and this rank's
    parameters."""
    world = dist.get_world_size()
    stages = [tpf.stage(b, stage_id=k, placement=tpf.placement("cpu", [k % world])) for k, b in enumerate(blocks)]
    pipe = tpf.Pipeline(stages, micro_batches=m, schedule=SCHEDULES[name][0], loss_fn=F.mse_loss)
    return (lambda x, y: pipe.step(x, y)), list(pipe.parameters())


def _torch_step(blocks: list[nn.Module], name: str, m: int):
    """torch.distributed.pipelining's schedule of the same name on the same blocks."""
    from torch.distributed.pipelining import PipelineStage, schedules
    world, rank = dist.get_world_size(), dist.get_rank()
    n = len(blocks)
    mine = [PipelineStage(b, k, n, torch.device("cpu")) for k, b in enumerate(blocks) if k % world == rank]
    cls = getattr(schedules, SCHEDULES[name][1])
    single = len(mine) == 1 and name != "ZB-H1"
    pipe = cls(mine[0] if single else mine, n_microbatches=m, loss_fn=F.mse_loss)
    first, last = rank == 0, rank == (n - 1) % world

    def step(x, y):
        with counting_p2p():
            pipe.step(*([x] if first else []), target=y if last else None, losses=[] if last else None)
    return step, [p for st in mine for p in st.submod.parameters()]


def run_bubble(name: str, m: int, forward_s: float, reps: int, peer: bool) -> tuple[float, float, int]:
    """One configuration over the world's ranks: the bubble averaged over the ranks, the median step time, and the
    bytes rank 0 sends a step."""
    clock = Clock()
    blocks = [Emulated(forward_s, clock) for _ in range(dist.get_world_size() * SCHEDULES[name][2])]
    step, params = (_torch_step if peer else _tpflow_step)(blocks, name, m)
    x, y = torch.randn(4 * m, 8), torch.randn(4 * m, 8)
    walls, busy, sent = [], [], 0
    for rep in range(reps + 1):
        dist.barrier()
        clock.busy = 0.0
        tpf.comm.stats.reset()
        start = time.perf_counter()
        step(x, y)
        wall = time.perf_counter() - start
        for q in params:
            q.grad = None
        if rep:  # the first step warms up (and torch infers shapes)
            walls.append(wall)
            busy.append(clock.busy)
            sent = tpf.comm.stats.bytes_sent
    steps = step_times(walls)
    per_step = every_rank([1 - b / s for b, s in zip(busy, steps)]).mean(0)
    return statistics.median(per_step.tolist()), statistics.median(steps), int(every_rank([float(sent)])[0, 0])


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


def peak_activations(name: str, m: int, dim: int, rows: int, peer: bool) -> int:
    """Peak saved-activation bytes on this rank during one step, over the world's ranks as rank sets."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    n = world * SCHEDULES[name][2]
    blocks = [nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in range(n)]
    step, params = (_torch_step if peer else _tpflow_step)(blocks, name, m)
    x, y = torch.randn(rows * m, dim), torch.randn(rows * m, dim)
    step(x, y)  # warm-up
    for q in params:
        q.grad = None
    counter = _SavedBytes(params)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, _unpack):
        step(x, y)
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
    if world < 2:
        raise SystemExit("a pipeline needs at least 2 ranks: python -m tpflow.launch --nproc_per_node 4 "
                         "benchmarks/pipeline_cpu.py")
    f = args.forward_ms
    flags = f"--reps {args.reps} --forward-ms {f:g} --dim {args.dim} --rows {args.rows}"
    lines = [f"## {world} CPU ranks, 1 thread each; `{flags}`", "",
             f"Bubble: emulated stages, forward {f:g} ms, input gradient {f:g} ms, weight gradient {f:g} ms "
             f"(interleaved: each of a rank's two stages so); median of {args.reps} steps. torch: "
             "torch.distributed.pipelining's schedule of the same name on the same stages (ZB-H1: "
             "ScheduleInterleavedZeroBubble).", "",
             "| schedule | p | m | formula | tpflow | torch | tpflow step ms | torch step ms | tpflow / torch | "
             "KiB sent by rank 0, tpflow (torch) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name in SCHEDULES:
        for m in (world, 2 * world, 4 * world):
            share = formula(SCHEDULES[name][0], world, m, SCHEDULES[name][2])[1]
            ours, theirs = (run_bubble(name, m, f / 1000, args.reps, peer) for peer in (False, True))
            lines.append(f"| {name} | {world} | {m} | {share:.1%} | {ours[0]:.1%} | {theirs[0]:.1%} | "
                         f"{ours[1] * 1000:.0f} | {theirs[1] * 1000:.0f} | {ours[1] / theirs[1]:.2f}x | "
                         f"{ours[2] / 1024:.1f} ({theirs[2] / 1024:.1f}) |")
    lines += ["", f"Peak saved activations per rank (Linear {args.dim} -> {4 * args.dim} -> {args.dim}, GELU per "
              f"stage; {args.rows} rows a micro-batch, m = {2 * world}, fp32), KiB:", "",
              "| schedule | " + " | ".join(f"rank {r}: tpflow (torch)" for r in range(world)) + " |",
              "|---|" + "---|" * world]
    for name in SCHEDULES:
        peaks = [[int(v) for v in every_rank([peak_activations(name, 2 * world, args.dim, args.rows, peer)])[:, 0]]
                 for peer in (False, True)]
        lines.append(f"| {name} | " + " | ".join(f"{a / 1024:.0f} ({b / 1024:.0f})" for a, b in zip(*peaks)) + " |")
    if rank == 0:
        print("\n".join(lines))
        print(f"appended to {write('pipeline', lines, args.out)}")


if __name__ == "__main__":
    main()
