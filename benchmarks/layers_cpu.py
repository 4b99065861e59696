"""Step time of parallelized models: tpflow against PyTorch's DTensor tensor parallelism, side by side.

    python -m tpflow.launch --nproc_per_node 2 benchmarks/layers_cpu.py    # tpflow vs parallelize_module
    python -m tpflow.launch --nproc_per_node 1 benchmarks/layers_cpu.py    # + W = 1: against the plain model

Workloads: an MLP stack (fc1 column -> GELU -> fc2 row, residual) and a Llama-style decoder layer
(q/k/v/gate/up column, o/down row). One step is forward + backward of a sum-of-squares loss; each
rank runs one thread. The cases are interleaved, repetition by repetition, and every ratio is the
median of per-repetition ratios (paired, so drift cancels); a repetition's time is its slowest
rank's. Bytes per step per rank are tpflow's own counters (DTensor's collectives are not counted).
glibc is set to keep freed memory (``hold_freed_memory``; ``--malloc-defaults`` leaves it), so no case
pays page faults whose number follows the order of its frees rather than its work.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import tpflow as tpf
from benchmarks.collective_cpu import write
from tpflow.bench.measure import cpu_name, hold_freed_memory, step_times
from tpflow.bench.workloads import LLAMA_PLAN, DecoderLayer


class MLPStack(nn.Module):
    def __init__(self, dim: int, hidden: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"fc1": nn.Linear(dim, hidden), "fc2": nn.Linear(hidden, dim)})
                                    for _ in range(depth))

    def forward(self, x):
        for b in self.blocks:
            x = x + b["fc2"](F.gelu(b["fc1"](x)))
        return x


def workloads(dim: int, hidden: int, tokens: int):
    torch.manual_seed(0)
    mlp = MLPStack(dim, hidden, depth=2)
    mlp_plan = {"blocks.*.fc1": "column", "blocks.*.fc2": "row"}
    mlp_torch = {f"blocks.{i}.{n}": s for i in range(2) for n, s in (("fc1", ColwiseParallel()),
                                                                     ("fc2", RowwiseParallel()))}
    block = DecoderLayer(dim, heads=8, kv_heads=4, hidden=hidden)
    torch_block = {k.strip("*."): ColwiseParallel() if v == "column" else RowwiseParallel()
                   for k, v in LLAMA_PLAN.items()}
    torch_block = {("self_attn." if k[0] in "qkvo" else "mlp.") + k: s for k, s in torch_block.items()}
    batch, seq = max(tokens // 128, 1), min(tokens, 128)
    return [("MLP stack", mlp, mlp_plan, mlp_torch, torch.randn(batch * seq, dim)),
            ("decoder layer", block, LLAMA_PLAN, torch_block, torch.randn(batch, seq, dim))]


def step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).square().sum().backward()
    for p in model.parameters():
        p.grad = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1408)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--malloc-defaults", action="store_true",
                        help="leave glibc returning freed memory to the OS (each step then re-faults its pages)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    allocator = "glibc malloc defaults" if args.malloc_defaults else hold_freed_memory()
    flags = "".join(f" --{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in vars(args).items()
                    if k != "out" and v != parser.get_default(k))
    tpf.init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    P = tpf.placement("cpu", list(range(world)))
    lines = [f"# Parallelized models on gloo, {world} rank(s) x 1 thread, fp32",
             "", (f"{datetime.datetime.now():%Y-%m-%d %H:%M}, {cpu_name()}, torch {torch.__version__}. "
                  f"dim {args.dim}, hidden {args.hidden}, {args.tokens} tokens; {args.reps} interleaved repetitions "
                  "of forward + backward; ratios are medians of paired per-repetition ratios."),
             f"Allocator: {allocator}, for every case.",
             f"Command: `python -m tpflow.launch --nproc_per_node {world} benchmarks/layers_cpu.py{flags}`",
             "", "| workload | case | median ms | vs baseline | tpflow bytes / rank / step |",
             "|---|---|---:|---:|---:|"]
    for name, model, plan, torch_plan, x in workloads(args.dim, args.hidden, args.tokens):
        ours = tpf.parallelize(copy.deepcopy(model), placement=P, plan=plan)
        cases = {"tpflow parallelize": ours}
        if world > 1:
            cases["torch parallelize_module"] = parallelize_module(copy.deepcopy(model), P.mesh, torch_plan)
        else:
            cases["plain nn.Linear model"] = model
        baseline = list(cases)[1]
        torch.testing.assert_close(ours(x), cases[baseline](x), rtol=1e-4, atol=1e-4)
        times = {c: [] for c in cases}
        traffic = {}
        for rep in range(args.reps + 2):
            for case, m in cases.items():
                dist.barrier()
                tpf.comm.stats.reset()
                start = time.perf_counter()
                step(m, x)
                if rep >= 2:
                    times[case].append(time.perf_counter() - start)
                traffic[case] = tpf.comm.stats.bytes_sent
        slowest = {c: step_times(t) for c, t in times.items()}
        for case in cases:
            ratio = statistics.median(a / b for a, b in zip(slowest[case], slowest[baseline]))
            lines.append(f"| {name} | {case} | {statistics.median(slowest[case]) * 1e3:.1f} | {ratio:.2f}x | "
                         f"{traffic[case]:,} |")
    if rank == 0:
        print("\n".join(lines))
        print(f"wrote {write(f'layers_w{world}', lines, args.out)}")


if __name__ == "__main__":
    main()
