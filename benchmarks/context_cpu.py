"""Context parallelism on CPU ranks: peak memory per rank, time and bytes against one device, and the share of the
ring's transfer hidden behind its compute on an emulated slow link.

    python -m tpflow.launch --nproc_per_node W benchmarks/context_cpu.py train [--tokens 4096 16384 32768]
    python -m tpflow.launch --nproc_per_node 1 benchmarks/context_cpu.py overlap [--tokens 4096]
    python -m tpflow.launch --nproc_per_node W benchmarks/context_cpu.py packed [--tokens 8192] [--window 512]
    python -m tpflow.launch --nproc_per_node W benchmarks/context_cpu.py mixers [--tokens 8192 16384 32768]
        [--shapes qwen3.5 nemotron-h]
    python -m tpflow.launch --nproc_per_node W benchmarks/context_cpu.py sparse [--tokens 4096 8192] [--top 2048]

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

``packed``: batches of documents of random lengths packed into rows (``position_ids`` restarting at each, lengths
drawn log-uniformly from 16 to ``--tokens`` / 2). First, on rank 0 alone, the balance of the ring's attention work
(the (query, key) pairs each rank scores) over 100 random batches at W = 2, 4 and 8: max / mean of the ranks', with
the head-tail cut and with ``balanced``. Then the same measurements as ``train`` on one packed batch of 2 rows, ring
and Ulysses against one device; the bounded ring's bytes against the layout's minimum counted from the documents
themselves: the keys and values of other ranks' tokens some query of this rank sees, sent once forward and again in
the backward, their fp32 gradients once back, the parts that move before the head, the gradients' all-reduce. Last,
a Mistral with a sliding window of ``--window`` tokens on one sequence: the ring's bytes against the same model's
whole-sequence ring (the window set to none), and its loss against one device's.

``mixers``: a Qwen3.5-shaped hybrid (3 gated-DeltaNet layers, then attention) and a Nemotron-H-shaped one (Mamba-2
and MLP layers, one attention layer), ``--hidden`` wide, their mixers head parallel (``tpflow.hf.mixer_split``) and,
for the DeltaNets, passing their state too (``tpflow.hf.state_passing``): the same measurements as ``train``; the
minimum bytes add, per mixer, the hidden states all-gathered in and reduce-scattered out, forward and backward
((W - 1) x a rank's tokens x hidden a ring pass; gloo's reduce-scatter is an all-reduce underneath, two passes), or
under state passing its fragments' summaries and halos gathered forward and reduce-scattered backward, and count the
all-reduce of the parameters left whole (the mixers' too under state passing: split over the tensor axis alone).

``sparse``: a DeepSeek-V3.2-shaped model (latent attention with a sparse-attention indexer picking ``--top`` keys a
query, ``tpflow.hf.context_indexer``), the same measurements as ``train`` but for a minimum of bytes.

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
from tpflow.ops import attention_work, balanced, head_tail, ring_attention

HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4, 2, 16, 512


def _model(hidden: int, layers: int, window: int | None = None):
    """A Llama, or with ``window`` a Mistral with that sliding window (the same weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    sizes = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                 num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                 max_position_embeddings=1 << 17, attn_implementation="sdpa")
    if window is None:
        return LlamaForCausalLM(LlamaConfig(**sizes))
    return MistralForCausalLM(MistralConfig(sliding_window=window, **sizes))


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


def _step(model, ids, params, **kwargs) -> torch.Tensor:
    loss = model(ids, labels=ids, **kwargs).loss
    loss.backward()
    reduce_partial_gradients(params)
    return loss.detach()


def _measure(model, ids, reps: int, active: bool, **kwargs) -> tuple[float, float, int, float]:
    """(peak bytes, median seconds, bytes sent a step, loss) of this rank; a rank not ``active`` only waits."""
    params = list(model.parameters()) if active else []
    peak = sent = 0
    loss, times = float("nan"), []
    if active:
        model.requires_grad_(True)
        _step(model, ids, params, **kwargs)  # warm-up: lazy set-up is not the step's
        model.zero_grad(set_to_none=True)
        reset_peak()
        before, _ = resident()
        start_bytes = comm.stats.bytes_sent
        loss = _step(model, ids, params, **kwargs).item()
        sent = comm.stats.bytes_sent - start_bytes
        peak = resident()[1] - before
        model.zero_grad(set_to_none=True)
        for _ in range(reps):
            start = time.perf_counter()
            _step(model, ids, params, **kwargs)
            times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    slowest = step_times(times if active else [0.0] * reps)  # a collective: every rank takes part
    return peak, statistics.median(slowest), sent, loss


TABLE = ["| {} | mode | peak MiB per rank | vs one device | x W | time ms | vs one device | bytes sent | vs minimum | "
         "loss - one device's |", "|---|---|---|---|---|---|---|---|---|---|"]


def _one_device(model, ids, reps: int, **kwargs) -> tuple[float, float, float]:
    """(peak, seconds, loss) of ``model`` on rank 0 alone, the others waiting; on every rank."""
    one = _measure(model, ids, reps, active=dist.get_rank() == 0, **kwargs)
    return (every_rank([one[0]]).max().item(), every_rank([one[1]]).max().item(),
            every_rank([one[3] if dist.get_rank() == 0 else -1e9]).max().item())


def _slowest(kind: str, peak: float, seconds: float, sent: int, minimum: int, diff: float) -> tuple:
    """A mode's row: its peak, time, bytes and minimum on the rank where each is largest."""
    return (kind, every_rank([peak]).max().item(), every_rank([seconds]).max().item(), every_rank([sent]).max().item(),
            every_rank([minimum]).max().item(), diff)


def _lines(label: str, rows: list[tuple], one_peak: float, one_time: float, world: int) -> list[str]:
    """The table's lines of one batch: each mode against one device's peak and time, its bytes against its minimum."""
    out = []
    for mode, peak, seconds, sent, minimum, diff in rows:
        versus = f"{sent / minimum:.3f}" if minimum else "-"
        out.append(f"| {label} | {mode} | {peak / 2**20:,.1f} | {peak / one_peak:.3f} | {peak * world / one_peak:.2f} "
                   f"| {seconds * 1e3:,.0f} | {seconds / one_time:.2f} | {sent:,.0f} | {versus} | {diff:.1e} |")
    return out


def _ranks() -> tuple[int, int, tpf.Placement]:
    """One thread a rank, freed blocks out of the resident set (peaks measured by it); the world, this rank, and the
    placement of every rank."""
    torch.set_num_threads(1)
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: freed blocks leave the resident set
    world = dist.get_world_size()
    return world, dist.get_rank(), tpf.placement("cpu", list(range(world)))


def train(args) -> None:
    world, rank, P = _ranks()
    lines = [f"# Context parallelism: {world} CPU rank(s), Llama hidden {args.hidden}, {args.layers} layers, "
             f"{HEADS} heads of {HEAD_DIM} ({KV_HEADS} kv), vocabulary {VOCAB}, fp32, batch 1", "",
             f"Command: `python -m tpflow.launch --nproc_per_node {world} benchmarks/context_cpu.py train --tokens "
             f"{' '.join(map(str, args.tokens))} --hidden {args.hidden} --layers {args.layers} --reps {args.reps}`", "",
             TABLE[0].format("tokens"), TABLE[1]]
    for tokens in args.tokens:
        ref = _model(args.hidden, args.layers)
        ids = torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(1))
        one_peak, one_time, one_loss = _one_device(ref, ids, args.reps)
        rows = [("one device", one_peak, one_time, 0, 0, 0.0)]
        for kind in ("ring", "ulysses"):
            model = tpf.parallelize(copy.deepcopy(ref), placement=P, plan=tpf.hf_plan(ref, context_parallel=kind))
            peak, seconds, sent, loss = _measure(model, ids, args.reps, active=True)
            params = sum(p.numel() for p in ref.parameters())
            minimum = _minimum(kind, tokens, world, args.hidden, args.layers, params)
            rows.append(_slowest(kind, peak, seconds, sent, minimum, loss - one_loss))
        lines += _lines(f"{tokens:,}", rows, one_peak, one_time, world)
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


def _documents(tokens: int, rows: int, gen: torch.Generator) -> torch.Tensor:
    """``[rows, tokens]`` position_ids of documents of log-uniform random lengths (16 to tokens / 2) packed end to
    end, the last cut to fit."""
    out = []
    for _ in range(rows):
        positions: list[int] = []
        while len(positions) < tokens:
            length = int(torch.exp(torch.empty(1).uniform_(2.77, float(torch.log(torch.tensor(tokens / 2))),
                                                            generator=gen)))
            positions += list(range(length))
        out.append(positions[:tokens])
    return torch.tensor(out)


def _first(positions: torch.Tensor) -> torch.Tensor:
    """Each query's first key: its document's start."""
    at = torch.arange(positions.shape[1])
    return (at - positions).expand_as(positions)


def _seen(first: torch.Tensor, mine: list[int]) -> torch.Tensor:
    """``[S]``: the keys some query at the positions ``mine`` sees (from its first key to itself), in any row."""
    marks = torch.zeros(first.shape[0], first.shape[1] + 1, dtype=torch.long)
    index = torch.tensor(mine)
    marks.scatter_add_(1, first[:, index], torch.ones(first.shape[0], len(mine), dtype=torch.long))
    marks.scatter_add_(1, index.expand(first.shape[0], -1) + 1, -torch.ones(first.shape[0], len(mine),
                                                                           dtype=torch.long))
    return (marks.cumsum(1)[:, :-1] > 0).any(0)


def _bounded_minimum(first: torch.Tensor, segments, hidden: int, layers: int, params: int) -> int:
    """The fewest bytes this rank sends in a step of the bounded ring (fp32), counted from the documents."""
    world, rank = len(segments), dist.get_rank()
    seq = first.shape[1]
    positions = [[p for a, n in parts for p in range(a, a + n)] for parts in segments]
    owner = torch.empty(seq, dtype=torch.long)
    for r, held in enumerate(positions):
        owner[held] = r
    kv = 2 * KV_HEADS * HEAD_DIM * 4 * first.shape[0]  # a token's keys and values, every row
    theirs = sum(int((_seen(first, positions[dst]) & (owner == rank)).sum()) for dst in range(world) if dst != rank)
    mine = int((_seen(first, positions[rank]) & (owner != rank)).sum())
    moving = sum(p // (seq // world) != rank for p in positions[rank])
    reduce = 2 * (world - 1) * params * 4 // world
    return layers * kv * (2 * theirs + mine) + 2 * moving * hidden * 4 * first.shape[0] + reduce


def _balance_table(tokens: int) -> list[str]:
    lines = [f"Balance of the ring's attention work over 100 random packed batches of 2 rows x {tokens:,} tokens "
             "(max / mean of the ranks' query-key pairs: the mean over the batches, and the worst):", "",
             "| W | head-tail: mean | worst | balanced: mean | worst |", "|---|---|---|---|---|"]
    gen = torch.Generator().manual_seed(0)
    batches = [_first(_documents(tokens, 2, gen)) for _ in range(100)]
    for world in (2, 4, 8):
        if tokens % (2 * world):
            continue
        ratios = {}
        for name, cut in (("head-tail", lambda f, w=world: head_tail(w, f.shape[1])),
                          ("balanced", lambda f, w=world: balanced(w, f))):
            work = [attention_work(cut(f), f) for f in batches]
            ratios[name] = [max(w) / (sum(w) / len(w)) for w in work]
        lines.append(f"| {world} | {statistics.mean(ratios['head-tail']):.3f} | {max(ratios['head-tail']):.3f} | "
                     f"{statistics.mean(ratios['balanced']):.3f} | {max(ratios['balanced']):.3f} |")
    return lines


def packed(args) -> None:
    world, rank, P = _ranks()
    tokens = args.tokens[0]
    lines = [f"# Context parallelism over packed documents and a sliding window: {world} CPU rank(s), Llama / Mistral "
             f"hidden {args.hidden}, {args.layers} layers, {HEADS} heads of {HEAD_DIM} ({KV_HEADS} kv), vocabulary "
             f"{VOCAB}, fp32", "",
             f"Command: `python -m tpflow.launch --nproc_per_node {world} benchmarks/context_cpu.py packed --tokens "
             f"{tokens} --window {args.window} --hidden {args.hidden} --layers {args.layers} --reps {args.reps}`", "",
             *_balance_table(tokens), ""]
    positions = _documents(tokens, 2, torch.Generator().manual_seed(1))
    ids = torch.randint(0, VOCAB, positions.shape, generator=torch.Generator().manual_seed(2))
    first = _first(positions)
    segments = balanced(world, first)
    work = attention_work(segments, first)
    lines += [f"The packed batch measured: 2 rows of {positions.eq(0).sum().item()} documents; the ring's cut "
              f"balanced: work max / mean {max(work) / (sum(work) / world):.3f} (head-tail: "
              f"{max(attention_work(head_tail(world, tokens), first)) / (sum(work) / world):.3f}).", "",
              TABLE[0].format("batch"), TABLE[1]]
    ref = _model(args.hidden, args.layers)
    params = sum(p.numel() for p in ref.parameters())
    cases = [("packed", ref, {"position_ids": positions}, ids)]
    window = _model(args.hidden, args.layers, window=args.window)
    one_row = ids[:1]
    cases.append((f"window {args.window}", window, {}, one_row))
    for batch, base, kwargs, tokens_in in cases:
        kwargs["use_cache"] = False  # transformers keeps packed documents apart only without a cache, the split alike
        one_peak, one_time, one_loss = _one_device(base, tokens_in, args.reps, **kwargs)
        rows = [("one device", one_peak, one_time, 0, 0, 0.0)]
        kinds = ("ring", "ulysses") if batch == "packed" else ("ring", "whole-sequence ring")
        for kind in kinds:
            model = base if kind != "whole-sequence ring" else _model(args.hidden, args.layers)
            plan = tpf.hf_plan(model, context_parallel=kind.split()[-1])
            model = tpf.parallelize(copy.deepcopy(model), placement=P, plan=plan)
            peak, seconds, sent, loss = _measure(model, tokens_in, args.reps, active=True, **kwargs)
            if kind == "ulysses":
                minimum = _minimum(kind, tokens, world, args.hidden, args.layers, params) * 2  # 2 rows
                minimum -= 2 * (world - 1) * params * 4 // world  # the all-reduce counted once
            elif kind == "whole-sequence ring":
                minimum = _minimum("ring", tokens, world, args.hidden, args.layers, params)
            else:
                row_first = first if batch == "packed" else torch.clamp(
                    torch.arange(tokens) - args.window + 1, min=0)[None]
                cut = segments if batch == "packed" else head_tail(world, tokens)
                minimum = _bounded_minimum(row_first, cut, args.hidden, args.layers, params)
            diff = loss - one_loss if kind != "whole-sequence ring" else float("nan")
            rows.append(_slowest(kind, peak, seconds, sent, minimum, diff))
        lines += _lines(batch, rows, one_peak, one_time, world)
    if rank == 0:
        print("\n".join(lines))
        print(f"appended to {write('context_packed', lines, args.out)}")


def _hybrid(shape: str, hidden: int):
    """A Qwen3.5-shaped model (3 gated-DeltaNet layers, then full attention; value heads twice the key heads) or a
    Nemotron-H-shaped one (Mamba-2 and MLP layers, one attention layer; heads in groups), ``hidden`` wide, fp32,
    with the attention of ``train`` (4 heads of 16, 2 key/value heads)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    attention = dict(vocab_size=VOCAB, hidden_size=hidden, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                     head_dim=HEAD_DIM, max_position_embeddings=1 << 17, attn_implementation="sdpa")
    if shape == "qwen3.5":
        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(
            **attention, intermediate_size=2 * hidden, layer_types=["linear_attention"] * 3 + ["full_attention"],
            num_hidden_layers=4, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=hidden // 8,
            linear_value_head_dim=hidden // 8))
    return NemotronHForCausalLM(NemotronHConfig(
        **attention, intermediate_size=2 * hidden, layer_types=["linear_attention", "mlp"] * 2 + ["full_attention",
                                                                                                "mlp"],
        num_hidden_layers=6, mamba_num_heads=8, mamba_head_dim=hidden // 4, n_groups=4, ssm_state_size=32,
        chunk_size=128))


def _passed(config, slots: int) -> int:
    """The bytes one rank's pieces of a state-passing mixer's gathers hold (``tpflow.hf.state_passing``), batch 1,
    fp32: each of its ``slots`` fragments' summary (a DeltaNet's ``[F | M]``: value heads x k x (v + k); a Mamba-2
    scan's: heads x (head dim + 1) x state) and its halo (the convolution's channels x its k - 1 tokens)."""
    if hasattr(config, "linear_key_head_dim"):  # a gated DeltaNet
        k, v = config.linear_key_head_dim, config.linear_value_head_dim
        heads, channels = config.linear_num_value_heads, 2 * config.linear_num_key_heads * k + \
            config.linear_num_value_heads * v
        return slots * 4 * (heads * k * (v + k) + channels * (config.linear_conv_kernel_dim - 1))
    heads, dim, size = config.mamba_num_heads, config.mamba_head_dim, config.ssm_state_size
    channels = heads * dim + 2 * config.n_groups * size
    return slots * 4 * (heads * (dim + 1) * size + channels * (config.conv_kernel - 1))


def mixers(args) -> None:
    """Hybrids whose linear attention or state spaces run head parallel or pass their state, ring and Ulysses,
    against one device."""
    from tpflow.hf.mixer_styles import mixer_style

    world, rank, P = _ranks()
    lines = [f"# Context parallelism through linear attention and state spaces (head parallel, and passing their "
             f"state): {world} CPU rank(s), "
             f"hidden {args.hidden}, vocabulary {VOCAB}, fp32, batch 1", "",
             f"Command: `python -m tpflow.launch --nproc_per_node {world} benchmarks/context_cpu.py mixers --tokens "
             f"{' '.join(map(str, args.tokens))} --hidden {args.hidden} --reps {args.reps} --shapes "
             f"{' '.join(args.shapes)}`", ""]
    for shape in args.shapes:
        ref = _hybrid(shape, args.hidden)
        kinds = [type(m).__name__ for m in ref.modules() if mixer_style(m) is not None]
        attention = sum(1 for t in ref.config.layer_types if t == "full_attention")
        lines += [f"{shape}-shaped: {len(kinds)} {kinds[0]} layers, {attention} attention layer(s), "
                  f"{sum(p.numel() for p in ref.parameters()):,} parameters.", "", TABLE[0].format("tokens"),
                  TABLE[1]]
        for tokens in args.tokens:
            ids = torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(1))
            one_peak, one_time, one_loss = _one_device(ref, ids, args.reps, use_cache=False)
            rows = [("one device", one_peak, one_time, 0, 0, 0.0)]
            for mode, kind in ((m, k) for m in ("head_parallel", "state_passing") for k in ("ring", "ulysses")):
                plan = tpf.hf_plan(ref, context_parallel=kind, mixers=mode)
                model = tpf.parallelize(copy.deepcopy(ref), placement=P, plan=plan)
                peak, seconds, sent, loss = _measure(model, ids, args.reps, active=True, use_cache=False)
                whole = sum(p.numel() for p in model.parameters() if p.to_local().numel() == p.numel())
                minimum = _minimum(kind, tokens, world, args.hidden, attention, whole)
                # each mixer: the hidden states all-gathered in (1 ring pass), reduce-scattered out (2 on gloo),
                # and both again backward; under state passing its fragments' summaries and halos, all-gathered
                # forward and reduce-scattered backward
                per_pass = (world - 1) * (tokens // world) * args.hidden * 4 * 2 if mode == "head_parallel" else \
                    (world - 1) * _passed(ref.config, 2 if kind == "ring" else 1)
                minimum += len(kinds) * 3 * per_pass
                said = kind if mode == "head_parallel" else f"{kind}, state passing"
                rows.append(_slowest(said, peak, seconds, sent, minimum, loss - one_loss))
            lines += _lines(f"{tokens:,}", rows, one_peak, one_time, world)
        lines.append("")
    if rank == 0:
        print("\n".join(lines))
        print(f"appended to {write('context_mixers', lines, args.out)}")


def _sparse_model(hidden: int, top: int):
    """A DeepSeek-V3.2-shaped model, ``hidden`` wide, fp32: 2 dense layers of latent attention (rope 8 + nope 16 key
    dims against 16 value dims, as 64 + 128 against 128), each with a sparse-attention indexer (2 heads of 32) picking
    ``top`` keys a query."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    torch.manual_seed(0)
    return DeepseekV32ForCausalLM(DeepseekV32Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=hidden // 2, kv_lora_rank=hidden // 4,
        qk_nope_head_dim=HEAD_DIM, qk_rope_head_dim=HEAD_DIM // 2, v_head_dim=HEAD_DIM, index_n_heads=2,
        index_head_dim=32, index_topk=top, mlp_layer_types=["dense", "dense"],
        layer_types=["indexed_attention", "indexed_attention"], max_position_embeddings=1 << 17,
        attn_implementation="sdpa"))


def sparse(args) -> None:
    """Sparse attention with an indexer (DeepSeek-V3.2's), ring and Ulysses against one device."""
    world, rank, P = _ranks()
    lines = [f"# Context parallelism through sparse attention with an indexer: {world} CPU rank(s), hidden "
             f"{args.hidden}, top-{args.top} keys a query, vocabulary {VOCAB}, fp32, batch 1", "",
             f"Command: `python -m tpflow.launch --nproc_per_node {world} benchmarks/context_cpu.py sparse --tokens "
             f"{' '.join(map(str, args.tokens))} --hidden {args.hidden} --top {args.top} --reps {args.reps}`", "",
             "Bytes sent a step against none for one device (no minimum column): the ring gathers each layer's keys "
             "and values whole (and reduce-scatters their gradients), Ulysses all-to-alls q / k / v / out and "
             "gathers the picks; both gather the indexer's keys.", "", TABLE[0].format("tokens"), TABLE[1]]
    ref = _sparse_model(args.hidden, args.top)
    for tokens in args.tokens:
        ids = torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(1))
        one_peak, one_time, one_loss = _one_device(ref, ids, args.reps, use_cache=False)
        rows = [("one device", one_peak, one_time, 0, 0, 0.0)]
        for kind in ("ring", "ulysses"):
            model = tpf.parallelize(copy.deepcopy(ref), placement=P, plan=tpf.hf_plan(ref, context_parallel=kind))
            peak, seconds, sent, loss = _measure(model, ids, args.reps, active=True, use_cache=False)
            rows.append(_slowest(kind, peak, seconds, sent, 0, loss - one_loss))
        lines += _lines(f"{tokens:,}", rows, one_peak, one_time, world)
    lines.append("")
    if rank == 0:
        print("\n".join(lines))
        print(f"appended to {write('context_sparse', lines, args.out)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["train", "overlap", "packed", "mixers", "sparse"])
    parser.add_argument("--tokens", type=int, nargs="+", default=None)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--top", type=int, default=2048)
    parser.add_argument("--shapes", nargs="+", choices=["qwen3.5", "nemotron-h"], default=["qwen3.5", "nemotron-h"])
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if args.mode == "train":
        args.tokens = args.tokens or [4096, 16384, 32768]
        tpf.init_distributed()
        train(args)
    elif args.mode == "packed":
        args.tokens = args.tokens or [8192]
        tpf.init_distributed()
        packed(args)
    elif args.mode == "mixers":
        args.tokens = args.tokens or [8192, 16384, 32768]
        tpf.init_distributed()
        mixers(args)
    elif args.mode == "sparse":
        args.tokens = args.tokens or [4096, 8192]
        tpf.init_distributed()
        sparse(args)
    else:
        args.tokens = (args.tokens or [4096])[0]
        if tpf.get_rank() == 0:  # under the launcher; one process is enough
            bench_overlap(args)


if __name__ == "__main__":
    main()
