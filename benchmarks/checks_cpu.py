"""What the ranks-agree checks cost on CPU ranks: the input digest on every step, parallelize's plan check, and
the agreement of a multi-rank pipeline stage's ranks after each action.

    python -m tpflow.launch --nproc_per_node W benchmarks/checks_cpu.py [--hidden 256] [--layers 2] [--reps 20]

A Hugging Face Llama (random weights) parallelized by ``plan="auto"`` trains (forward, backward and AdamW of its
``labels=`` loss) with the input check on every step (``check_inputs="always"``, the debugging setting) and off,
the two interleaved step by step; the default (``first``) checks only a shape's first step, so its cost per step
is the ``off`` row's after the first. ``time`` is the median over ``--reps`` steps of the slowest rank. The plan
check is timed apart: ``parallelize``'s one all-gather of its facts, by ``tpf.comm.agree`` on the same facts. On 4
ranks the model is also cut into two stages of two tensor-parallel ranks (``plan="auto"``, 1F1B, ``--micro-batches``)
and each step's time beside the time its ranks spent agreeing (``Pipeline.agreement_seconds``: sending their words
and waiting for their peers', a bound on the cost: the wait includes a slower peer's compute). Each run is appended to
``benchmarks/results/checks_<cpu>_<date>.md``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist

import tpflow as tpf
from benchmarks.collective_cpu import write
from tpflow.bench.measure import every_rank, step_times


def _model(args):
    import transformers

    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def run(args) -> None:
    torch.set_num_threads(1)
    world = dist.get_world_size()
    P = tpf.placement("cpu", ranks=list(range(world)))
    ref = _model(args)
    model = tpf.parallelize(copy.deepcopy(ref), placement=P, plan="auto")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {"always": [], "off": []}
    for rep in range(args.reps + 1):
        for mode in times:
            with tpf.config.override(check_inputs=mode):
                start = time.perf_counter()
                model(ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
                if rep:  # the first round warms up
                    times[mode].append(time.perf_counter() - start)
    medians = {mode: statistics.median(step_times(t)) for mode, t in times.items()}
    facts = {f"the plan entry of {name!r}": repr(style) for name, style in tpf.hf_plan(ref).items()}
    agree = []
    for _ in range(args.reps):
        start = time.perf_counter()
        tpf.comm.agree("parallelize", facts, [dist.group.WORLD], "")
        agree.append(time.perf_counter() - start)
    agree_ms = statistics.median(step_times(agree)) * 1e3
    lines = [f"# The ranks-agree checks: {world} CPU rank(s), Llama hidden {args.hidden}, {args.layers} layers, "
             f"{args.batch}x{args.seq} tokens, fp32", "",
             f"Command: `python -m tpflow.launch --nproc_per_node {world} benchmarks/checks_cpu.py --hidden "
             f"{args.hidden} --layers {args.layers} --batch {args.batch} --seq {args.seq} --reps {args.reps}"
             f"{' --micro-batches ' + str(args.micro_batches) if world == 4 else ''}`", "",
             "| input check | step ms (median, slowest rank) | time vs off |", "|---|---:|---:|",
             *(f"| {mode} | {medians[mode] * 1e3:,.1f} | {medians[mode] / medians['off']:.3f}x |" for mode in times),
             "", f"parallelize's plan check (one all-gather of {len(facts)} plan entries): {agree_ms:.2f} ms, once."]
    if world == 4:
        lines += ["", *_pipeline(args)]
    if dist.get_rank() == 0:
        print("\n".join(lines))
        print(f"appended to {write('checks', lines, args.out)}")


def _pipeline(args) -> list[str]:
    """Two stages of two tensor-parallel ranks: each step's time and the share its agreement took."""
    lm = _model(args)
    ref = copy.deepcopy(lm)
    halves = [tpf.placement("cpu", [0, 1]), tpf.placement("cpu", [2, 3])]
    pipe = tpf.Pipeline(tpf.pipeline.cut(lm, halves, plan="auto"), micro_batches=args.micro_batches,
                        loss_fn=tpf.pipeline.causal_lm_loss(ref))
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    steps, shares = [], []
    for rep in range(args.reps + 1):
        start = time.perf_counter()
        pipe.step(ids, ids)
        opt.step()
        opt.zero_grad()
        step = time.perf_counter() - start
        if rep:
            steps.append(step)
            shares.append(pipe.agreement_seconds / step)
    step_ms = statistics.median(step_times(steps)) * 1e3
    share = every_rank([statistics.median(shares)]).max().item()
    return [f"Pipeline: 2 stages x 2 tensor-parallel ranks, 1F1B, {args.micro_batches} micro-batches: step "
            f"{step_ms:,.1f} ms (median, slowest rank); the stage's agreement at most {share:.1%} of a step (median "
            "over steps, the rank that spent most; its time includes waiting for a slower peer, which the stage's "
            "next collective would wait for anyway)."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--out", default="benchmarks/results")
    tpf.init_distributed()
    run(parser.parse_args())


if __name__ == "__main__":
    main()
