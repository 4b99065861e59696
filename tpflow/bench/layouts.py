"""What the harness's modes share about their layouts: the workload's plan in tpflow's styles, the rows a rank takes,
the head counts a tensor split needs, transformers' own model loaded from the workload's checkpoint, and the fewest
bytes per rank each layout must send per step (the ``minimum`` every mode reports beside what it sent)."""

from __future__ import annotations

import fnmatch
import shutil
import tempfile

import torch
import torch.distributed as dist
from torch import nn

import tpflow as tpf
from tpflow.bench.trainer import Context, Skip
from tpflow.bench.workloads import CausalLMLoss, Workload
from tpflow.comm import ring_bytes
from tpflow.layers import ParallelLinear
from tpflow.sbp import chunk_bounds

__all__: list[str] = []  # the modes' helpers (tpflow.bench.modes, tpflow.bench.hybrid), not an API


def tensor_bytes(model: nn.Module, plan: dict[str, str], sample: torch.Tensor, tokens: int, tp: int,
                  sequence: bool = False) -> int:
    """The fewest bytes per rank for the linears of the plain ``model`` that ``plan`` makes column / row layers
    over ``tp`` ranks, on ``tokens`` rows like ``sample``. A row layer all-reduces its output (sequence
    parallel: reduce-scatters it, and all-gathers its gradient). Column layers that read the same input
    (q, k and v; gate and up) need it once: nothing forward, and one all-reduce of the sum of their input
    gradients, none where the input needs no gradient (sequence parallel: one all-gather of the input, and
    one reduce-scatter of that gradient). tpflow's and torch's layers, one collective per layer, send more."""
    kinds = {name: kind for name, _ in model.named_modules() for pattern, kind in plan.items()
             if fnmatch.fnmatchcase(name, pattern)}
    inputs: dict[str, torch.Tensor] = {}
    hooks = [model.get_submodule(name).register_forward_pre_hook(
        lambda m, args, name=name: inputs.__setitem__(name, args[0])) for name in kinds]
    try:
        model(sample[:1])
    finally:
        for h in hooks:
            h.remove()
    total, seen = 0, []
    for name, kind in kinds.items():
        m, x = model.get_submodule(name), inputs[name]
        if kind == "column" and any(x is other for other in seen):
            continue  # gathered, and its gradient reduced, with an earlier reader's
        seen.append(x)
        size = tokens * (m.in_features if kind == "column" else m.out_features) * x.element_size()
        both_ways = kind == "row" or x.requires_grad
        if sequence:  # all-gather (column) or reduce-scatter (row) forward, and the other one backward
            total += ring_bytes(size, tp, 1) * (2 if both_ways else 1)
        elif both_ways:  # a row layer's output forward, a column layer's input gradient backward
            total += ring_bytes(size, tp, 2)
    return total


def norm_params(model: nn.Module) -> list[torch.Tensor]:
    """The parameters ``parallelize`` left whole on every rank (the norms)."""
    return [p for m in model.modules() if not isinstance(m, ParallelLinear) for p in m.parameters(recurse=False)]


def rows_of(n: int, parts: int, index: int) -> slice:
    start, end = chunk_bounds(n, parts)[index]
    return slice(start, end)


def check_heads(w: Workload, tp: int) -> None:
    if w.heads and (w.heads % tp or w.kv_heads % tp):
        raise Skip(f"{w.heads} heads and {w.kv_heads} key/value heads do not split over {tp} ranks")


def summed_norm_bytes(w: Workload, tp: int) -> int:
    """A Hugging Face workload's modules its own plan keeps whole with their gradients summed over the ranks
    (``replicated_with_grad_allreduce``: Qwen3's per-head q / k norms): one all-reduce of those gradients."""
    if not isinstance(w.model, CausalLMLoss):
        return 0
    patterns = [p for p, style in w.model.tp_plan.items() if style == "replicated_with_grad_allreduce"]
    params = [p for name, m in w.model.named_modules() if any(fnmatch.fnmatchcase(name, q) for q in patterns)
              for p in m.parameters()]
    return ring_bytes(sum(p.numel() * p.element_size() for p in params), tp, 2) if params else 0


def experts_bytes(w: Workload, tp: int) -> int:
    """The moe workload's experts over ``tp`` ranks that all hold every token, split or shared out alike: per layer
    the output summed forward, and the tokens' and routing weights' gradients summed backward (the router upstream
    is whole on every rank)."""
    if w.name != "moe":
        return 0
    config = w.model.lm.config
    elem = next(w.model.parameters()).element_size()
    per_layer = 2 * ring_bytes(w.tokens * config.hidden_size * elem, tp, 2) + \
        ring_bytes(w.tokens * config.num_experts_per_tok * elem, tp, 2)
    return config.num_hidden_layers * per_layer


def tpflow_plan(w: Workload, sequence_parallel: bool = False, algo: str = "auto", keep_gathered: bool = True) -> dict:
    """The workload's plan in tpflow's styles. Column layers reading one input fuse (``fuse=True``): the input
    crosses the ranks once per parent module, as in Megatron's fused q / k / v and gate / up."""
    styles = {"column": tpf.ColumnParallel(fuse=True, sequence_parallel=sequence_parallel, algo=algo,
                                           keep_gathered=keep_gathered),
              "row": tpf.RowParallel(sequence_parallel=sequence_parallel, algo=algo)}
    return {pattern: styles[kind] for pattern, kind in w.plan.items()}


def lora_bytes(w: Workload, tp: int) -> int:
    """The lora workload's adapters on split layers: one all-reduce of ``T x r`` each (a row layer's ``lora_A``
    output forward, a column layer's ``lora_B`` input gradient backward); 0 for another workload."""
    if w.name != "lora":
        return 0
    from peft.tuners.lora import LoraLayer

    elem = next(w.model.parameters()).element_size()
    ranks = [m.r["default"] for name, m in w.model.named_modules()
             if isinstance(m, LoraLayer) and any(fnmatch.fnmatchcase(name, p) for p in w.plan)]
    return sum(ring_bytes(w.tokens * r * elem, tp, 2) for r in ranks)


def head_bytes(w: Workload, tp: int, vocab_parallel: bool, tokens: int | None = None) -> int:
    """The hf workload's layers beyond the plan's: the vocabulary-parallel embedding's output all-reduced, the
    column-parallel head's input gradient all-reduced, and its logits gathered (transformers' own plan,
    ``colwise_gather_output``) or, ``vocab_parallel``, only each token's four loss statistics all-gathered in fp32
    (tpflow's, ``tpflow.ops.cross_entropy``); ``tokens``: a data-parallel row's (default: the whole batch's)."""
    lm = w.model.lm
    tokens, dim, vocab = tokens or w.tokens, lm.config.hidden_size, lm.config.vocab_size
    elem = next(lm.parameters()).element_size()
    total = 2 * ring_bytes(tokens * dim * elem, tp, 2)
    if vocab_parallel:  # HF's loss takes logits.float(): the statistics are fp32 (fp64 for an fp64 model)
        return total + ring_bytes(tp * 4 * tokens * max(elem, 4), tp, 1)
    return total + ring_bytes(tokens * vocab * elem, tp, 1)


def from_checkpoint(w: Workload, ctx: Context, auto: type, **parallel: object) -> nn.Module:
    """transformers' own parallel model: the workload's model saved by rank 0 to a temporary folder (removed once
    every rank has loaded it), loaded by ``auto.from_pretrained`` with the ``parallel`` arguments."""
    holder = [tempfile.mkdtemp(prefix="tpflow-bench-hf-") if ctx.rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    if ctx.rank == 0:
        w.model.lm.save_pretrained(holder[0])
    dist.barrier()
    lm = auto.from_pretrained(holder[0], dtype=next(w.model.parameters()).dtype, **parallel)
    dist.barrier()
    if ctx.rank == 0:
        shutil.rmtree(holder[0])
    return lm


def fsdp_bytes(groups: list[list[torch.Tensor]], dp: int, shard: bool, cuda: bool) -> int:
    """FSDP2's bytes per rank for its parameter ``groups`` (each decoder layer's, then the root's: the rest) over
    ``dp`` data-parallel ranks. Sharded (``shard``): each group's blocks, dim 0 padded to a multiple of dp, all-gathered
    before the forward and again before the backward (the root's only once: FSDP2 keeps the root's gathered for the
    backward), and their gradients reduce-scattered (gloo's reduce-scatter is an all-reduce underneath: two passes).
    Replicated (one rank a shard): only the gradients all-reduced over the replicas."""
    total = 0
    for k, params in enumerate(groups):
        padded = sum(-(-p.shape[0] // dp) * dp * p[:1].numel() * p.element_size() for p in params)
        if not shard:
            total += ring_bytes(padded, dp, 2)
            continue
        gathers = 1 if k == len(groups) - 1 else 2
        total += ring_bytes(padded, dp, 1) * gathers + ring_bytes(padded, dp, 1 if cuda else 2)
    return total


def exchange_bytes(w: Workload, dp: int, rank: int) -> int:
    """The bytes rank ``rank`` sends exchanging the moe workload's tokens with ``dp`` data-parallel ranks that share
    its experts out, over a step: its tokens' hidden states out and the other ranks' outputs back, then in the
    backward the mirror of both; each token once to each other rank holding one of its experts, read off the
    one-device model's routing of the whole batch. The routing that travels with them (ids, weights) and the counts
    are overhead, not counted here."""
    lm = w.model.lm
    per_rank = lm.config.num_experts // dp
    seq = w.inputs.shape[1]
    bounds = [rows_of(w.samples, dp, d) for d in range(dp)]
    pairs = torch.zeros(dp, dp, dtype=torch.long)  # [from, to]: tokens sent, summed over the layers

    def record(module, args, kwargs):
        ids = args[1] if len(args) > 1 else kwargs["top_k_index"]
        for d, rows in enumerate(bounds):
            mine = ids[rows.start * seq:rows.stop * seq]
            to = torch.zeros(mine.shape[0], dp, dtype=torch.bool).scatter_(1, mine // per_rank, True)
            pairs[d] += to.sum(0)

    experts = [m for name, m in lm.named_modules() if name.endswith("mlp.experts")]
    handles = [m.register_forward_pre_hook(record, with_kwargs=True) for m in experts]
    try:
        with torch.no_grad():
            w.model(w.inputs)
    finally:
        for h in handles:
            h.remove()
    pairs.fill_diagonal_(0)  # a rank's own tokens stay
    row = lm.config.hidden_size * next(w.model.parameters()).element_size()
    return int(2 * (pairs[rank].sum() + pairs[:, rank].sum())) * row
