"""``python -m tpflow.bench``: every parallel mode on one workload, side by side in one run.

    python -m tpflow.bench --nproc_per_node 2                   # launches itself over 2 ranks
    python -m tpflow.launch --nproc_per_node 4 -m tpflow.bench  # the same through the launcher; adds the 2-D modes
    python -m tpflow.bench.plot                                 # the newest results as a PNG

Each mode (``tpflow.bench.modes``) trains the same model on the same batch. The modes' steps are
interleaved, repetition by repetition, so drift hits all alike; a step's time is its slowest rank's,
and a mode's time against one device's is the ratio of their median step times (below 1: faster). One
step per mode is counted (bytes every rank sends, torch's collectives included) and one is profiled for
memory (per rank: parameters, gradients, activations at the step's peak), both outside the timed ones;
every step's loss is compared with one device's. CUDA is used when every rank
has a GPU, else CPU processes over gloo with one thread each. Rows go to
``benchmarks/results/bench_<device>_w<W>_<time>.{json,csv,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import tpflow as tpf
from tpflow.bench import results, terminal
from tpflow.bench.measure import (
    counting,
    device_name,
    every_rank,
    hold_freed_memory,
    quantiles,
    source_version,
    step_peak,
    step_times,
)
from tpflow.bench.modes import MODES, build, slug
from tpflow.bench.trainer import Context, Skip, Trainer
from tpflow.bench.workloads import build as build_workload

DEFAULTS = dict(dim=256, hidden=1024, depth=4, tokens=256, seq=32, heads=8, kv_heads=4, reps=10, warmup=1)
TINY = dict(dim=32, hidden=64, depth=4, tokens=64, seq=8, heads=8, kv_heads=4, reps=2, warmup=1)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tpflow.bench", description="Every parallel mode on one workload, "
                                "side by side in one run.")
    p.add_argument("--nproc_per_node", "--nproc-per-node", type=int, default=2,
                   help="ranks to launch when not already under the launcher (default 2)")
    p.add_argument("--workload", nargs="+", choices=["mlp", "transformer", "hf", "moe", "lora"],
                   default=["mlp", "transformer"])
    p.add_argument("--modes", nargs="+", choices=[slug(m) for m in MODES], default=[slug(m) for m in MODES],
                   metavar="MODE", help=f"a subset of: {' '.join(slug(m) for m in MODES)} (one-device always runs)")
    p.add_argument("--tiny", action="store_true", help="a workload of seconds, for tests: " +
                   " ".join(f"--{k.replace('_', '-')} {v}" for k, v in TINY.items()))
    for name, value in DEFAULTS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"default {value}")
    p.add_argument("--micro-batches", type=int, default=None, help="per pipeline (default: 2 per stage)")
    p.add_argument("--out", default="benchmarks/results", help="folder for the JSON, CSV and table")
    return p


def settings(args: argparse.Namespace) -> dict[str, int]:
    base = TINY if args.tiny else DEFAULTS
    return {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}


def command(argv: list[str], world: int) -> str:
    """The command that repeats this run, after the tpflow switches the environment sets."""
    def launcher_flag(i: int) -> bool:  # --nproc_per_node N or --nproc_per_node=N
        return argv[i].startswith("--nproc") or (i > 0 and argv[i - 1].startswith("--nproc") and "=" not in argv[i - 1])
    flags = [a for i, a in enumerate(argv) if not launcher_flag(i)]
    switches = [f"{s.env}={shlex.quote(os.environ[s.env])}" for s in tpf.config.SWITCHES.values()
                if s.env in os.environ]
    return " ".join([*switches, "python -m tpflow.bench --nproc_per_node", str(world), *flags])


def device_for_ranks() -> torch.device:
    """CUDA when every rank of this node has its own GPU; else CPU for all (mixed devices would mislead)."""
    local = int(os.environ.get("LOCAL_RANK", 0))
    gpus = every_rank([float(torch.cuda.device_count() > local)])
    return torch.device("cuda", local) if bool(gpus.min()) else torch.device("cpu")


@dataclass
class Measured:
    """One mode's raw measurements on this rank."""

    shares: list[float] = field(default_factory=list)  # every step's share of the loss
    times: list[float] = field(default_factory=list)  # the timed steps, seconds
    sent: int = 0  # bytes sent in the counted step
    peak: int = 0  # the profiled step's peak above its start


def measure(trainers: dict[str, Trainer], cfg: dict, ctx: Context, progress: terminal.Progress, task) -> dict:
    """Warm-up steps, a counted one, a profiled one, then the timed ones: the modes interleaved step by step."""
    found = {n: Measured() for n in trainers}
    sync = torch.cuda.synchronize if ctx.device.type == "cuda" else (lambda: None)
    counted, profiled = cfg["warmup"], cfg["warmup"] + 1
    for i in range(cfg["warmup"] + 2 + cfg["reps"]):
        for n, trainer in trainers.items():
            m = found[n]
            dist.barrier()
            if i == counted:
                with counting(trainer.torch_groups) as stats:
                    share = trainer.step()
                    sync()
                m.sent = stats.bytes_sent
            elif i == profiled:
                m.peak, share = step_peak(trainer.step, ctx.device)
            else:
                start = time.perf_counter()
                share = trainer.step()
                sync()
                if i > profiled:
                    m.times.append(time.perf_counter() - start)
            m.shares.append(0.0 if share is None else float(share))
            progress.advance(task)
    return found


def summarize(workload: str, samples: int, trainers: dict[str, Trainer], found: dict[str, Measured],
              world: int) -> list[dict]:
    """A row per mode: every rank's values gathered, times on the slowest rank, losses against one device's."""
    rows = []
    base = quantiles(step_times(found["one device"].times))[0]
    reference = every_rank(found["one device"].shares).sum(0).tolist()
    for n, t in trainers.items():
        m = found[n]
        grads = t.grad_bytes or 0
        per_rank = every_rank([m.sent, t.minimum, m.peak + t.state_bytes + t.param_bytes(), t.param_bytes(), grads,
                               max(m.peak - grads, 0)])
        losses = every_rank(m.shares).sum(0).tolist()
        slowest = step_times(m.times)
        median, p20, p80 = quantiles(slowest)
        rows.append(dict(
            workload=workload, mode=n, world=world, ranks=len(t.ranks),
            step_ms=median * 1e3, step_ms_p20=p20 * 1e3, step_ms_p80=p80 * 1e3, samples_per_s=samples / median,
            time_vs_one_device=median / base,
            peak_bytes=int(per_rank[:, 2].max()), param_bytes=int(per_rank[:, 3].max()),
            grad_bytes=int(per_rank[:, 4].max()), adamw_bytes=2 * int(per_rank[:, 3].max()),
            activation_bytes=int(per_rank[:, 5].max()),
            sent_bytes=int(per_rank[:, 0].max()), minimum_bytes=int(per_rank[:, 1].max()),
            sent_per_rank=[int(v) for v in per_rank[:, 0]], minimum_per_rank=[int(v) for v in per_rank[:, 1]],
            losses=losses, loss_rel_diff=max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference)),
            skipped=None))
    return rows


def run_workload(name: str, cfg: dict, modes: list[str], ctx: Context,
                 progress: terminal.Progress) -> tuple[list[dict], str]:
    """Every mode that can run on workload ``name``: its rows (skipped modes with their reason) and the
    workload's description."""
    w = build_workload(name, **{k: cfg[k] for k in ("dim", "hidden", "depth", "tokens", "seq", "heads", "kv_heads")})
    trainers, skipped = {}, {}
    for mode in modes:
        try:
            trainers[mode] = build(mode, w, ctx)
        except Skip as why:
            skipped[mode] = str(why)
    task = progress.add(f"{w.name} on {ctx.world} ranks", (cfg["warmup"] + 2 + cfg["reps"]) * len(trainers))
    rows = summarize(w.name, w.samples, trainers, measure(trainers, cfg, ctx, progress, task), ctx.world)
    rows += [dict(workload=w.name, mode=n, world=ctx.world, skipped=why) for n, why in skipped.items()]
    order = list(MODES)
    return sorted(rows, key=lambda r: order.index(r["mode"])), w.describe()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if "RANK" not in os.environ:  # not under the launcher: launch this over the ranks asked for
        from tpflow import launch

        return launch.main(["--nproc_per_node", str(args.nproc_per_node), "-m", "tpflow.bench", *argv])
    tpf.init_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    if world < 2:
        raise SystemExit("the modes are compared on 2 or more ranks: python -m tpflow.bench --nproc_per_node 2")
    device = device_for_ranks()
    allocator = "CUDA caching allocator"
    if device.type == "cpu":
        torch.set_num_threads(1)
        allocator = hold_freed_memory()
    cfg = settings(args)
    if cfg["reps"] < 1 or cfg["warmup"] < 0:
        raise SystemExit("--reps must be at least 1 and --warmup at least 0")
    modes = ["one device", *[m for m in MODES if slug(m) in args.modes and m != "one device"]]
    ctx = Context(world, rank, device, args.micro_batches)
    meta = dict(device=device_name(device), device_type=device.type, world=world, torch=torch.__version__,
                tpflow=tpf.__version__, code=source_version(), python=sys.version.split()[0],
                timestamp=datetime.datetime.now().isoformat(timespec="seconds"), command=command(argv, world),
                allocator=allocator, threads_per_rank=torch.get_num_threads() if device.type == "cpu" else None,
                cpus=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                settings=cfg, dtype="float32", optimizer="SGD", loss="MSE")
    rows, workloads = [], []
    with terminal.Progress(enabled=rank == 0) as progress:
        for name in args.workload:
            found, described = run_workload(name, cfg, modes, ctx, progress)
            rows += found
            workloads.append(described)
    meta["workloads"] = workloads
    if rank == 0:
        terminal.show(rows, meta)
        paths = results.write(rows, meta, args.out)
        print("\n".join(f"{kind}: {path}" for kind, path in paths.items()))
        print(f"to plot: python -m tpflow.bench.plot {paths['json']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
