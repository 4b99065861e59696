"""Greedy decoding of a Hugging Face Qwen3 on CPU ranks: ms per token, tpflow's tensor parallelism beside
transformers' own and one device, side by side in one run; and where a tpflow decode step's host time goes.

    python -m tpflow.launch --nproc_per_node 2 benchmarks/decode_cpu.py [--batch 1 8] [--new-tokens 32]

The model (vocabulary ``--vocab``, ``--layers`` layers of width ``--hidden``, 8 heads of 32 with 4 key / value heads,
fp32, random weights) is saved by rank 0 to a temporary folder and loaded three ways: one device (rank 0 alone, the
others waiting), ``tpf.parallelize(model, plan="auto")`` and transformers' ``from_pretrained(path, tp_plan="auto")``.
Each runs ``generate(ids, max_new_tokens=N, min_new_tokens=N, do_sample=False)`` on a 16-token prompt, the three
taking turns rep by rep; ms per token is the median over ``--reps`` of the whole call's time / N on the slowest rank
(prefill included, as a user waits for it). The tokens must equal one device's. ``--profile`` adds, for tpflow, the
host time of one decode step's forward by operator (``torch.profiler``, rank 0), the most expensive first. Each run
is appended to ``benchmarks/results/decode_cpu_<cpu>_<date>.md``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import tpflow as tpf
from benchmarks.collective_cpu import write
from tpflow.bench.measure import step_times


def qwen3(args):
    """The benchmarks' Qwen3: ``args.vocab``, ``args.layers`` layers of ``args.hidden``, 8 heads of 32, 4 key / value
    heads, random weights (seed 0)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                         max_position_embeddings=256)
    return Qwen3ForCausalLM(config)


def _generate(model, ids, new: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)


def _ms_per_token(models: list, ids, new: int, reps: int, active: list[bool]) -> tuple[list[float], list]:
    """For each model: the median ms per token of ``generate`` on the slowest rank, and its tokens; the models take
    turns, rep by rep, so that drift hits them alike. A rank not ``active`` for a model only waits for it."""
    tokens = [_generate(m, ids, new) if on else None for m, on in zip(models, active)]  # warm-up
    times: list[list[float]] = [[] for _ in models]
    for _ in range(reps):
        for m, on, mine in zip(models, active, times):
            start = time.perf_counter()
            if on:
                _generate(m, ids, new)
            mine.append(time.perf_counter() - start)
            dist.barrier()  # the next model starts on every rank at once
    return [statistics.median(step_times(t)) * 1e3 / new for t in times], tokens


def _profile(model, ids) -> list[str]:
    """One decode step's forward on tpflow's model, host time by operator (rank 0's table, every rank running it)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        out = model(ids, use_cache=True)
        step = out.logits[:, -1:].full_tensor().argmax(-1) if hasattr(out.logits, "full_tensor") else \
            out.logits[:, -1:].argmax(-1)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(step, past_key_values=out.past_key_values, use_cache=True)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    return ["", "One decode step's forward, tpflow, rank 0 (`torch.profiler`, self CPU time):", "", "```text",
            *table.splitlines(), "```"]


def run(args) -> None:
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    world, rank = dist.get_world_size(), dist.get_rank()
    holder = [tempfile.mkdtemp(prefix="tpflow-decode-") if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    if rank == 0:
        qwen3(args).save_pretrained(holder[0])
    dist.barrier()
    one = AutoModelForCausalLM.from_pretrained(holder[0])
    ours = tpf.parallelize(AutoModelForCausalLM.from_pretrained(holder[0]),
                           placement=tpf.placement("cpu", list(range(world))), plan="auto")
    theirs = AutoModelForCausalLM.from_pretrained(holder[0], tp_plan="auto")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(holder[0])
    lines = [f"# Greedy decoding: {world} CPU ranks, Qwen3 vocabulary {args.vocab}, {args.layers} layers of "
             f"{args.hidden}, fp32, {args.new_tokens} new tokens after 16", "",
             f"Command: `{'' if tpf.config.get('cpu_shared_memory') else 'TPFLOW_CPU_SHARED_MEMORY=0 '}"
             f"python -m tpflow.launch --nproc_per_node {world} benchmarks/decode_cpu.py --batch "
             f"{' '.join(map(str, args.batch))} --new-tokens {args.new_tokens} --reps {args.reps}"
             f"{' --profile' if args.profile else ''}`", "",
             "| batch | one device ms/token | transformers' TP ms/token | tpflow ms/token | tpflow vs transformers | "
             "tpflow vs one device | tokens equal |", "|---|---|---|---|---|---|---|"]
    for batch in args.batch:
        ids = torch.randint(1, args.vocab, (batch, 16), generator=torch.Generator().manual_seed(batch))
        (base, hf, tp), (want, theirs_tokens, tokens) = _ms_per_token(
            [one, theirs, ours], ids, args.new_tokens, args.reps, [rank == 0, True, True])
        equal = [torch.equal(tokens, theirs_tokens)] + ([torch.equal(tokens, want)] if rank == 0 else [])
        lines.append(f"| {batch} | {base:.2f} | {hf:.2f} | {tp:.2f} | {tp / hf:.2f}x | {tp / base:.2f}x | "
                     f"{all(equal)} |")
    if args.profile:
        lines += _profile(ours, torch.randint(1, args.vocab, (1, 16), generator=torch.Generator().manual_seed(0)))
    if rank == 0:
        print("\n".join(lines))
        print(f"appended to {write('decode_cpu', lines, args.out)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", default="benchmarks/results")
    tpf.init_distributed()
    run(parser.parse_args())


if __name__ == "__main__":
    main()
