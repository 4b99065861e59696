"""CPU ranks on busy cores: tpflow's collectives through shared memory against gloo, for a decode and a training step.

    python -m tpflow.launch --nproc_per_node 4 benchmarks/loaded_cpu.py            # 4 ranks on this VM's 2 cores
    python -m tpflow.launch --nproc_per_node 2 benchmarks/loaded_cpu.py --busy 2   # 2 ranks beside 2 busy processes

A Qwen3 (vocabulary ``--vocab``, ``--layers`` layers of ``--hidden``, 8 heads of 32, 4 key / value heads, fp32,
random weights), ``tpf.parallelize(plan="auto")`` over every rank, runs two steps with the ``cpu_shared_memory``
switch on and off in turn, rep by rep, so that drift hits both alike: greedy ``generate`` of ``--new-tokens`` tokens
after a 16-token prompt (ms per token), and a training step (forward, the model's loss, backward, AdamW) on
``--batch`` x ``--seq`` tokens, at learning rate 0 so that every step's loss is comparable. ``--busy K`` starts K
processes that spin on the cores for the whole run (another job on the machine). The time is the median over
``--reps`` on the slowest rank; both ways must give the same tokens and losses within 1e-5 (their sums run in other
orders). Each run is appended to ``benchmarks/results/loaded_cpu_<cpu>_<date>.md``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time

import torch
import torch.distributed as dist

import tpflow as tpf
from benchmarks.collective_cpu import write
from benchmarks.decode_cpu import qwen3
from tpflow.bench.measure import step_times


def _spin(stop) -> None:
    while not stop.is_set():
        sum(range(10_000))


def _steps(model, args):
    """The two steps, each returning what both ways must agree on."""
    prompt = torch.randint(1, args.vocab, (1, 16), generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(1, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)

    def decode():
        with torch.no_grad():
            return model.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                  do_sample=False, pad_token_id=0)

    def train():
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return {"decode": (decode, args.new_tokens), "training step": (train, 1)}


def _time(fn, per: int, reps: int) -> tuple[float, list]:
    """Median ms (per token for decoding) of ``fn`` on the slowest rank, shared memory on and off taking turns; and
    each way's results."""
    times: dict[bool, list[float]] = {True: [], False: []}
    results: dict[bool, list] = {True: [], False: []}
    for _ in range(reps + 1):
        for on in (True, False):
            with tpf.config.override(cpu_shared_memory=on):
                dist.barrier()
                start = time.perf_counter()
                results[on].append(fn())
                times[on].append(time.perf_counter() - start)
    ms = {on: statistics.median(step_times(t[1:])) * 1e3 / per for on, t in times.items()}  # the first warms
    return ms[True], ms[False], results


def run(args) -> None:
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    stop = multiprocessing.Event()
    spinners = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True)
                for _ in range(args.busy if rank == 0 else 0)]
    for p in spinners:
        p.start()
    model = tpf.parallelize(qwen3(args), placement=tpf.placement("cpu", list(range(world))), plan="auto")
    lines = [f"# {world} CPU ranks on {os.cpu_count()} cores beside {args.busy} busy processes: Qwen3 vocabulary "
             f"{args.vocab}, {args.layers} layers of {args.hidden}, fp32", "",
             f"Command: `python -m tpflow.launch --nproc_per_node {world} benchmarks/loaded_cpu.py --busy {args.busy} "
             f"--reps {args.reps}`", "",
             "| step | shared memory ms | gloo ms | ratio | same results |", "|---|---|---|---|---|"]
    for name, (fn, per) in _steps(model, args).items():
        if name == "training step":
            model.train()
        shm, gloo, results = _time(fn, per, args.reps)
        same = all(torch.allclose(a.float(), b.float(), rtol=1e-5, atol=0)
                   for a, b in zip(results[True], results[False]))
        lines.append(f"| {name}{' (per token)' if per > 1 else ''} | {shm:.2f} | {gloo:.2f} | {shm / gloo:.2f}x | "
                     f"{same} |")
    stop.set()
    for p in spinners:
        p.join()
    if rank == 0:
        print("\n".join(lines))
        print(f"appended to {write('loaded_cpu', lines, args.out)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=0)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results")
    tpf.init_distributed()
    run(parser.parse_args())


if __name__ == "__main__":
    main()
