"""Context parallelism on CPU ranks: peak memory per rank, time and bytes against one device, and the share of the
ring's transfer hidden behind its compute on an emulated slow link.

    python -m tpflow.launch --nproc_per_node W benchmarks/context_cpu.py train [--tokens 4096 16384 32768]
    python -m tpflow.launch --nproc_per_node 1 benchmarks/context_cpu.py overlap [--tokens 4096]

``train``: a Hugging Face Llama of tiny width (hidden ``--hidden``, 4 heads of 16, 2 key/value heads, ``--layers``
layers, vocabulary 512, fp32, one sequence of ``--tokens``) by its own ``labels=`` loss, three ways side by side:
one device (rank 0 alone, the others waiting), ``context_parallel="ring"`` and ``"ulysses"`` over the W ranks.
``peak``: the most host memory a rank gains over one forward + backward (its peak resident set after
``/proc/self/clear_refs`` reset it, less the set before; blocks of 64 KiB or more are mapped on their own, so freed
memory leaves the resident set), the most on any rank; against one device's, and against one device's / W.
``time``: forward + backward + the gradients summed, the median of ``--reps`` after a warm-up, on the slowest rank.
``bytes``: what this rank sent in that step (``tpflow.comm.stats``), against the layout's minimum: for the ring, K
and V once around in the forward (W - 1 blocks a rank), in the backward the W - 2 blocks between the first (kept from
the forward) and the last (its own) and the blocks' fp32 gradients W - 1 hops, the head-tail parts that move to
become contiguous before the head (and their gradients), and the gradients' all-reduce; for Ulysses,
the 4 all-to-alls of q, k, v (key/value heads repeated up to W) and the output, forward and backward, and the
gradients' all-reduce.

``overlap``: ``ring_attention`` forward + backward on 2 ranks as threads of one process (``tpf.comm.FakeWorld``),
the link's bandwidth set from the measured compute so the transfer would take 0.5x and 1x of it; overlap
E = (compute + transfer - ring) / min(compute, transfer), the share of the shorter of the two hidden.

Each run is appended to ``benchmarks/results/context_<mode>_<cpu>_<date>.md``.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import statistics
import time

import torch
import torch.distributed as dist

import tpflow as tpf
from benchmarks.collective_cpu import OVERLAP, median_seconds, overlap, write
from benchmarks.vocab_cpu import reset_peak, resident
from tpflow import comm
from tpflow.bench.measure import every_rank, step_times
from tpflow.comm import FakeWorld
from tpflow.global_tensor.gradients import reduce_partial_gradients
from tpflow.ops import head_tail, ring_attention

HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4, 2, 16, 512


def _model(hidden: int, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=1 << 17, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def _minimum(kind: str, tokens: int, world: int, hidden: int, layers: int, params: int) -> int:
    """The fewest bytes a rank sends in a step of the layout (fp32), as the module docstring counts them."""
    local = tokens // world
    reduce = 2 * (world - 1) * params * 4 // world  # the gradients' ring all-reduce
    if world == 1:
        return 0
    if kind == "ring":  # K, V around forward; backward the W - 2 blocks between again, their gradients W - 1 hops
        kv = 2 * KV_HEADS * local * HEAD_DIM * 4
        attention = layers * ((world - 1) * kv + (world - 2) * kv + (world - 1) * kv)
        rank = dist.get_rank()
        moving = sum(part // 2 != rank for part in (rank, 2 * world - 1 - rank))
        return attention + 2 * moving * (local // 2) * hidden * 4 + reduce
    heads = (HEADS + 2 * max(KV_HEADS, world) + HEADS) * local * HEAD_DIM * 4  # q, k, v, out of this rank's tokens
    return layers * 2 * heads * (world - 1) // world + reduce


def _step(model, ids, params) -> torch.Tensor:
    loss = model(ids, labels=ids).loss
    loss.backward()
    reduce_partial_gradients(params)
    return loss.detach()


def _measure(model, ids, reps: int, active: bool) -> tuple[float, float, int, float]:
    """(peak bytes, median seconds, bytes sent a step, loss) of this rank; a rank not ``active`` only waits."""
    params = list(model.parameters()) if active else []
    peak = sent = 0
    loss, times = float("nan"), []
    if active:
        model.requires_grad_(True)
        _step(model, ids, params)  # warm-up: lazy set-up is not the step's
        model.zero_grad(set_to_none=True)
        reset_peak()
        before, _ = resident()
        start_bytes = comm.stats.bytes_sent
        loss = _step(model, ids, params).item()
        sent = comm.stats.bytes_sent - start_bytes
        peak = resident()[1] - before
        model.zero_grad(set_to_none=True)
        for _ in range(reps):
            start = time.perf_counter()
            _step(model, ids, params)
            times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    slowest = step_times(times if active else [0.0] * reps)  # a collective: every rank takes part
    return peak, statistics.median(slowest), sent, loss


def train(args) -> None:
    torch.set_num_threads(1)
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: freed blocks leave the resident set
    world, rank = dist.get_world_size(), dist.get_rank()
    P = tpf.placement("cpu", list(range(world)))
    lines = [f"# Context parallelism: {world} CPU rank(s), Llama hidden {args.hidden}, {args.layers} layers, "
             f"{HEADS} heads of {HEAD_DIM} ({KV_HEADS} kv), vocabulary {VOCAB}, fp32, batch 1", "",
             f"Command: `python -m tpflow.launch --nproc_per_node {world} benchmarks/context_cpu.py train --tokens "
             f"{' '.join(map(str, args.tokens))} --hidden {args.hidden} --layers {args.layers} --reps {args.reps}`", "",
             "| tokens | mode | peak MiB per rank | vs one device | x W | time ms | vs one device | bytes sent | "
             "vs minimum | loss - one device's |", "|---|---|---|---|---|---|---|---|---|---|"]
    for tokens in args.tokens:
        ref = _model(args.hidden, args.layers)
        ids = torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(1))
        one = _measure(ref, ids, args.reps, active=rank == 0)
        one_peak, one_time = every_rank([one[0]]).max().item(), every_rank([one[1]]).max().item()
        one_loss = every_rank([one[3] if rank == 0 else -1e9]).max().item()
        rows = [("one device", one_peak, one_time, 0, 0, 0.0)]
        for kind in ("ring", "ulysses"):
            model = tpf.parallelize(copy.deepcopy(ref), placement=P, plan=tpf.hf_plan(ref, context_parallel=kind))
            peak, seconds, sent, loss = _measure(model, ids, args.reps, active=True)
            params = sum(p.numel() for p in ref.parameters())
            minimum = _minimum(kind, tokens, world, args.hidden, args.layers, params)
            rows.append((kind, every_rank([peak]).max().item(), every_rank([seconds]).max().item(),
                         every_rank([sent]).max().item(), every_rank([minimum]).max().item(), loss - one_loss))
        for mode, peak, seconds, sent, minimum, diff in rows:
            versus = f"{sent / minimum:.3f}" if minimum else "-"
            lines.append(f"| {tokens:,} | {mode} | {peak / 2**20:,.1f} | {peak / one_peak:.3f} | "
                         f"{peak * world / one_peak:.2f} | {seconds * 1e3:,.0f} | {seconds / one_time:.2f} | "
                         f"{sent:,.0f} | {versus} | {diff:.1e} |")
    if rank == 0:
        print("\n".join(lines))
        print(f"appended to {write('context_train', lines, args.out)}")


def bench_overlap(args) -> None:
    torch.set_num_threads(1)
    world, tokens = 2, args.tokens
    gen = torch.Generator().manual_seed(0)
    parts = head_tail(world, tokens)
    shapes = [(1, 8, tokens // world, 64), (1, 8, tokens // world, 64), (1, 8, tokens // world, 64)]
    inputs = [[torch.randn(s, generator=gen).requires_grad_() for s in shapes] for _ in range(world)]

    def step(transport):
        q, k, v = inputs[transport.rank]
        out = ring_attention(q, k, v, segments=parts, group=transport)
        out.backward(torch.ones_like(out))

    def timed(fake: FakeWorld) -> float:
        return median_seconds(lambda: fake.run(step), args.reps)

    kv = 2 * 8 * (tokens // world) * 64 * 4
    nbytes = (world - 1) * kv + (world - 2) * kv + (world - 1) * kv  # per rank: K / V forward, backward, dK / dV
    lines = [f"# Ring attention on an emulated link ({world} ranks as threads, fp32, {tokens:,} tokens, 8 heads of "
             "64, causal, head-tail)", "", f"Command: `python -m tpflow.launch --nproc_per_node 1 "
             f"benchmarks/context_cpu.py overlap --tokens {tokens} "
             f"--reps {args.reps}`; median of {args.reps}, forward + backward.", "",
             OVERLAP, "",
             "| link | compute-only ms | transfer ms | ring ms | overlap E |", "|---|---:|---:|---:|---:|"]
    compute = timed(FakeWorld(world))
    for ratio in (0.5, 1.0):
        transfer = ratio * compute
        ring = timed(FakeWorld(world, bandwidth=nbytes / transfer))
        lines.append(f"| transfer = {ratio}x compute | {compute * 1e3:.0f} | {transfer * 1e3:.0f} | {ring * 1e3:.0f} "
                     f"| {overlap(compute, transfer, ring):.0%} |")
    print("\n".join(lines))
    print(f"appended to {write('context_overlap', lines, args.out)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["train", "overlap"])
    parser.add_argument("--tokens", type=int, nargs="+", default=None)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if args.mode == "train":
        args.tokens = args.tokens or [4096, 16384, 32768]
        tpf.init_distributed()
        train(args)
    else:
        args.tokens = (args.tokens or [4096])[0]
        if tpf.get_rank() == 0:  # under the launcher; one process is enough
            bench_overlap(args)


if __name__ == "__main__":
    main()
