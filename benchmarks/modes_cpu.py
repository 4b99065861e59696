"""Step time of every parallel mode on one workload, side by side in one run (CPU ranks over gloo).

    python -m tpflow.launch --nproc_per_node 2 benchmarks/modes_cpu.py [--dim 256 --rows 64 --reps 11]
    python -m tpflow.launch --nproc_per_node 4 benchmarks/modes_cpu.py     # adds the 2-D hybrids

The workload: 4 blocks of Linear(d, 4d), GELU, Linear(4d, d), MSE loss, one SGD step, fp32, one thread
a rank. Every mode trains the same model on the same batch; its step (forward, backward, optimizer) is
timed on its slowest rank, with the cases interleaved so drift hits all alike, and reported as a ratio
to one device (rank 0 alone, the others waiting). On fewer cores than ranks the ranks share cores, so
ratios above the core count say little about a real machine; the absolute times are this CPU's only.

    one device        the plain model on rank 0
    data (SBP)        parameters broadcast, the batch split(0): OneFlow's data parallelism
    data (DDP)        DistributedDataParallel, each rank its rows
    tensor            fc1 column / fc2 row parallel over all ranks (tpf.parallelize)
    pipeline          one stage per rank, 1F1B, 2 micro-batches a stage
    data x tensor     2-D placement: data parallel over axis 0, tensor parallel over axis 1 (4 ranks)
    pipeline x tensor 2 stages, each tensor parallel over 2 ranks (4 ranks)

Each run is appended to ``benchmarks/results/modes_w<W>_<cpu>_<date>.md``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import tpflow as tpf
from benchmarks.collective_cpu import hold_freed_memory, step_times, write

B, S0 = tpf.sbp.broadcast, tpf.sbp.split(0)
PLAN = {"*.0": tpf.ColumnParallel(), "*.2": tpf.RowParallel()}


def blocks(dim: int, depth: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
                           for _ in range(depth)])


def _trainer(params, forward_backward: Callable[[], object]) -> Callable[[], None]:
    """One training step: zero the gradients, ``forward_backward()``, an SGD step."""
    opt = torch.optim.SGD(params, lr=1e-3)

    def step():
        opt.zero_grad()
        forward_backward()
        opt.step()
    return step


def one_device(model, x, y) -> Callable[[], None]:
    if dist.get_rank() != 0:
        return lambda: None
    return _trainer(model.parameters(), lambda: F.mse_loss(model(x), y).backward())


def data_sbp(model, x, y) -> Callable[[], None]:
    P = tpf.placement("cpu", list(range(dist.get_world_size())))
    model = tpf.to_global(model, placement=P, sbp=B)
    gx, gy = tpf.tensor(x, placement=P, sbp=S0), tpf.tensor(y, placement=P, sbp=B)
    return _trainer(model.parameters(), lambda: F.mse_loss(tpf.to_global(model(gx), sbp=B), gy).backward())


def data_ddp(model, x, y) -> Callable[[], None]:
    world, rank = dist.get_world_size(), dist.get_rank()
    model, rows = DistributedDataParallel(model), torch.tensor_split(torch.arange(len(x)), world)[rank]
    x, y = x[rows], y[rows]  # each rank its rows
    return _trainer(model.parameters(), lambda: F.mse_loss(model(x), y).backward())


def tensor_parallel(model, x, y) -> Callable[[], None]:
    # plain inputs: every rank the whole batch, the outputs whole after each row layer
    model = tpf.parallelize(model, placement=tpf.placement("cpu", list(range(dist.get_world_size()))), plan=PLAN)
    return _trainer(model.parameters(), lambda: F.mse_loss(model(x), y).backward())


def _pipeline_step(stages: list[tpf.Stage], x, y) -> Callable[[], None]:
    pipe = tpf.Pipeline(stages, micro_batches=2 * len(stages), schedule="1f1b", loss_fn=F.mse_loss)
    return _trainer(pipe.parameters(), lambda: pipe.step(x, y))


def pipeline(model, x, y) -> Callable[[], None]:
    world = dist.get_world_size()
    per = len(model) // world
    stages = [tpf.stage(model[i * per:(i + 1) * per] if i < world - 1 else model[i * per:], stage_id=i,
                        placement=tpf.placement("cpu", [i])) for i in range(world)]
    return _pipeline_step(stages, x, y)


def data_x_tensor(model, x, y) -> Callable[[], None]:
    P2 = tpf.placement("cpu", [[0, 1], [2, 3]])
    model = tpf.parallelize(model, placement=P2, plan=PLAN)
    gx, gy = tpf.tensor(x, placement=P2, sbp=(S0, B)), tpf.tensor(y, placement=P2, sbp=(B, B))
    return _trainer(model.parameters(), lambda: F.mse_loss(tpf.to_global(model(gx), sbp=(B, B)), gy).backward())


def pipeline_x_tensor(model, x, y) -> Callable[[], None]:
    halves = [model[:len(model) // 2], model[len(model) // 2:]]
    stages = []
    for i, ranks in enumerate(([0, 1], [2, 3])):
        pl = tpf.placement("cpu", ranks)
        stages.append(tpf.stage(tpf.parallelize(halves[i], placement=pl, plan=PLAN), stage_id=i, placement=pl,
                                sbp=B))
    return _pipeline_step(stages, x, y)


MODES = {"one device": one_device, "data (SBP)": data_sbp, "data (DDP)": data_ddp, "tensor": tensor_parallel,
         "pipeline": pipeline, "data x tensor": data_x_tensor, "pipeline x tensor": pipeline_x_tensor}
FOUR_RANKS = {"data x tensor", "pipeline x tensor"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    tpf.init_distributed()
    torch.set_num_threads(1)
    allocator = hold_freed_memory()
    world = dist.get_world_size()
    if world < 2:
        raise SystemExit("compare the modes on 2 or 4 ranks: python -m tpflow.launch --nproc_per_node 2 "
                         "benchmarks/modes_cpu.py")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(args.rows, args.dim, generator=g), torch.randn(args.rows, args.dim, generator=g)
    base = blocks(args.dim)
    names = [n for n in MODES if n not in FOUR_RANKS or world == 4]
    steps = {n: MODES[n](copy.deepcopy(base), x, y) for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(args.reps + 1):
        for n in names:
            dist.barrier()
            start = time.perf_counter()
            steps[n]()
            if rep:  # the first round warms up
                times[n].append(time.perf_counter() - start)
    medians = {n: statistics.median(step_times(times[n])) for n in names}
    flags = f"--dim {args.dim} --rows {args.rows} --reps {args.reps}"
    lines = [f"## {world} CPU ranks, 1 thread each; `{flags}`; {allocator}", "",
             f"4 blocks of Linear({args.dim}, {4 * args.dim}), GELU, Linear({4 * args.dim}, {args.dim}); "
             f"{args.rows} rows; forward, backward and SGD step; median of {args.reps} on the slowest rank.", "",
             "| mode | step (ms, this CPU) | vs one device |", "|---|---|---|"]
    for n in names:
        lines.append(f"| {n} | {medians[n] * 1e3:.1f} | {medians[n] / medians['one device']:.2f}x |")
    if dist.get_rank() == 0:
        print("\n".join(lines))
        print(f"appended to {write(f'modes_w{world}', lines, args.out)}")


if __name__ == "__main__":
    main()
