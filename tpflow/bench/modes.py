"""The parallel modes the harness compares, each a training step of one workload on this rank.

    one device          the plain model on rank 0 (the others wait)
    data, tpflow SBP    parameters broadcast, the batch split(0), the module on local rows (tpf.stage);
                        the partial gradients summed in buckets by the backward (the grad_sync switch)
    data, DDP           DistributedDataParallel, each rank its rows
    tensor, tpflow      column / row layers over all ranks (tpf.parallelize), the batch whole everywhere;
                        the column layers reading one input (q / k / v, gate / up) run as one product
    tensor, torch       PyTorch's parallelize_module with ColwiseParallel / RowwiseParallel
    tensor, transformers  the hf workload only: transformers' own tensor parallelism
                        (from_pretrained(..., tp_plan="auto")) on the same checkpoint and batch
    experts, tpflow     the moe workload only: its experts shared out whole over the ranks (expert parallel),
                        the rest as "tensor, tpflow" (where the moe workload's experts are split)
    experts, transformers  transformers' own (DistributedConfig(tp_size=W, ep_size=W)), same checkpoint
    experts over data, tpflow  the moe workload only: W data-parallel ranks, each its rows, FSDP2 over them, its
                        experts shared out over them (E / W each) with the tokens exchanged by all-to-all
    experts over data, transformers  transformers' own (DistributedConfig(fsdp_size=W, ep_size=W,
                        ep_implementation="all_to_all")), same checkpoint
    sequence, ring      tensor parallel with the activations between layer pairs split over dim 0: the
                        all-gather + matmul and matmul + reduce-scatter ring kernels (overlapped)
    sequence, unfused   the same layout, the plain collective then the matmul
    sequence, regather  the ring layout, with each column layer's input gathered again in the backward
                        rather than kept from the forward (Megatron's way: less memory, more bytes)
    pipeline, GPipe     one stage per rank, 2 micro-batches a rank (tpflow.bench.pipelines); also 1F1B,
                        interleaved (two stages a rank) and ZB-H1, each beside torch.distributed.pipelining's
                        schedule of the same name (", torch")
    data x tensor       2-D placement: data parallel over axis 0, tensor parallel over axis 1
    pipeline x tensor   2 stages, each tensor parallel over half the ranks, 1F1B
    fsdp x tensor       the hf workload only: tensor parallel over half the ranks (a named placement), FSDP2's
                        fully_shard over the two halves on each decoder layer and the model, each half its rows
    ddp x tensor        the same with each half a whole replica (FSDP2's HSDP, one rank a shard): DDP's layout
    fsdp x tensor, transformers  transformers' own (DistributedConfig(tp_size=, fsdp_size=)), same checkpoint

Every mode trains the same model from the same values on the same batch with SGD, so each step's
loss must equal one device's. A mode returns this rank's share of the loss (the shares sum to the
loss) and ``minimum``: the fewest bytes this rank must send per step for the mode's layout, from
the model's shapes and ring collectives (per layer: a column layer all-reduces its input gradient,
a row layer its output; with sequence parallelism each does an all-gather and a reduce-scatter of
the same sizes; data parallelism all-reduces the gradients of the parameter blocks a rank holds; a
pipeline stage sends its output forward and its input's gradient back).
"""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import shutil
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

import tpflow as tpf
from tpflow.bench import pipelines
from tpflow.bench.measure import count_ddp
from tpflow.bench.trainer import Context, Skip, Trainer, block_bytes, forward_backward, make_trainer, rows_share
from tpflow.bench.workloads import CausalLMLoss, Workload
from tpflow.comm import ring_bytes
from tpflow.layers import ParallelLinear
from tpflow.sbp import chunk_bounds

__all__ = ["MODES", "build", "slug"]

def _tensor_bytes(model: nn.Module, plan: dict[str, str], sample: torch.Tensor, tokens: int, tp: int,
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


def _norm_params(model: nn.Module) -> list[torch.Tensor]:
    """The parameters ``parallelize`` left whole on every rank (the norms)."""
    return [p for m in model.modules() if not isinstance(m, ParallelLinear) for p in m.parameters(recurse=False)]


def _rows(n: int, parts: int, index: int) -> slice:
    start, end = chunk_bounds(n, parts)[index]
    return slice(start, end)


def _check_heads(w: Workload, tp: int) -> None:
    if w.heads and (w.heads % tp or w.kv_heads % tp):
        raise Skip(f"{w.heads} heads and {w.kv_heads} key/value heads do not split over {tp} ranks")


def one_device(w: Workload, ctx: Context) -> Trainer:
    model, x, y = w.model.to(ctx.device), w.inputs.to(ctx.device), w.targets.to(ctx.device)
    if ctx.rank != 0:
        return Trainer(lambda: None, [], 0, [0])
    return make_trainer(list(model.parameters()), forward_backward(model, x, y, w.loss_fn), 0, [0])


def data_sbp(w: Workload, ctx: Context) -> Trainer:
    P, S0 = ctx.placement(range(ctx.world)), tpf.sbp.split(0)
    st = tpf.stage(w.model.to(ctx.device), stage_id=0, placement=P, sbp=S0)
    x, y = w.inputs.to(ctx.device), tpf.tensor(w.targets.to(ctx.device), placement=P, sbp=S0)
    params = list(st.parameters())
    # the backward sums the partial gradients in buckets (tpflow.global_tensor.reducer)
    return make_trainer(params, forward_backward(st, x, y, rows_share(y.numel())),
                        ring_bytes(block_bytes(params), ctx.world, 2), range(ctx.world))


def data_ddp(w: Workload, ctx: Context) -> Trainer:
    if w.samples % ctx.world:
        raise Skip(f"DDP averages the ranks' gradients, which is the batch's only when its {w.samples} samples "
                   f"split evenly over {ctx.world} ranks")
    model = w.model.to(ctx.device)
    # gradients as views of the buckets: no copy into them, and the buckets counted as DDP's state
    ddp = DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                                  gradient_as_bucket_view=True)
    count_ddp(ddp)
    rows = _rows(w.samples, ctx.world, ctx.rank)
    x, y = w.inputs[rows].to(ctx.device), w.targets[rows].to(ctx.device)
    params = list(ddp.parameters())  # each rank's mean over its (equal) rows: 1/W of the batch's
    trainer = make_trainer(params, forward_backward(ddp, x, y, weight=1 / ctx.world),
                           ring_bytes(block_bytes(params), ctx.world, 2), range(ctx.world))
    trainer.state_bytes = block_bytes(params)
    return trainer


def tensor_tpflow(w: Workload, ctx: Context, expert_parallel: bool = False) -> Trainer:
    _check_heads(w, ctx.world)
    minimum = _tensor_bytes(w.model, w.plan, w.inputs, w.tokens, ctx.world) + _experts_bytes(w, ctx.world) + \
        _summed_norm_bytes(w, ctx.world)
    hf = isinstance(w.model, CausalLMLoss)  # the model's own plan, its head included
    minimum += _head_bytes(w, ctx.world, vocab_parallel=True) if hf else 0
    plan = tpf.hf_plan(w.model, expert_parallel=expert_parallel) if hf else _tpflow_plan(w)
    model = tpf.parallelize(w.model.to(ctx.device), placement=ctx.placement(range(ctx.world)), plan=plan)
    x, y = w.inputs.to(ctx.device), w.targets.to(ctx.device)
    step = forward_backward(model, x, y, w.loss_fn, weight=float(ctx.rank == 0))
    return make_trainer(list(model.parameters()), step, minimum, range(ctx.world))


def experts_tpflow(w: Workload, ctx: Context) -> Trainer:
    return tensor_tpflow(w, ctx, expert_parallel=True)


def _summed_norm_bytes(w: Workload, tp: int) -> int:
    """A Hugging Face workload's modules its own plan keeps whole with their gradients summed over the ranks
    (``replicated_with_grad_allreduce``: Qwen3's per-head q / k norms): one all-reduce of those gradients."""
    if not isinstance(w.model, CausalLMLoss):
        return 0
    patterns = [p for p, style in w.model.tp_plan.items() if style == "replicated_with_grad_allreduce"]
    params = [p for name, m in w.model.named_modules() if any(fnmatch.fnmatchcase(name, q) for q in patterns)
              for p in m.parameters()]
    return ring_bytes(sum(p.numel() * p.element_size() for p in params), tp, 2) if params else 0


def _experts_bytes(w: Workload, tp: int) -> int:
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


def _tpflow_plan(w: Workload, sequence_parallel: bool = False, algo: str = "auto", keep_gathered: bool = True) -> dict:
    """The workload's plan in tpflow's styles. Column layers reading one input fuse (``fuse=True``): the input
    crosses the ranks once per parent module, as in Megatron's fused q / k / v and gate / up."""
    styles = {"column": tpf.ColumnParallel(fuse=True, sequence_parallel=sequence_parallel, algo=algo,
                                           keep_gathered=keep_gathered),
              "row": tpf.RowParallel(sequence_parallel=sequence_parallel, algo=algo)}
    return {pattern: styles[kind] for pattern, kind in w.plan.items()}


def _head_bytes(w: Workload, tp: int, vocab_parallel: bool, tokens: int | None = None) -> int:
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


def _from_checkpoint(w: Workload, ctx: Context, auto: type, **parallel: object) -> nn.Module:
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


def tensor_transformers(w: Workload, ctx: Context, expert_parallel: bool = False) -> Trainer:
    """transformers' own tensor parallelism (``from_pretrained(path, tp_plan="auto")``, which needs accelerate) on
    the checkpoint of the workload's model, saved by rank 0 to a temporary directory; ``expert_parallel``: its
    experts shared out over the same ranks (``DistributedConfig(tp_size=W, ep_size=W)``)."""
    _check_heads(w, ctx.world)
    try:
        import accelerate  # noqa: F401 - transformers' tensor parallelism needs it
        from transformers import AutoModelForCausalLM
        from transformers.distributed.configuration_utils import DistributedConfig
    except ImportError as e:
        raise Skip(f"transformers' tensor parallelism needs transformers and accelerate: {e}") from e
    parallel = {"distributed_config": DistributedConfig(tp_size=ctx.world, ep_size=ctx.world)} if expert_parallel \
        else {"tp_plan": "auto"}
    model = CausalLMLoss(_from_checkpoint(w, ctx, AutoModelForCausalLM, **parallel))
    minimum = _tensor_bytes(w.model, w.plan, w.inputs, w.tokens, ctx.world) + _head_bytes(w, ctx.world, False) + \
        _experts_bytes(w, ctx.world) + _summed_norm_bytes(w, ctx.world)
    x, y = w.inputs.to(ctx.device), w.targets.to(ctx.device)
    step = forward_backward(model, x, y, w.loss_fn, weight=float(ctx.rank == 0))
    return make_trainer(list(model.parameters()), step, minimum, range(ctx.world))


def experts_transformers(w: Workload, ctx: Context) -> Trainer:
    return tensor_transformers(w, ctx, expert_parallel=True)


def tensor_torch(w: Workload, ctx: Context) -> Trainer:
    _check_heads(w, ctx.world)
    P = ctx.placement(range(ctx.world))
    minimum = _tensor_bytes(w.model, w.plan, w.inputs, w.tokens, ctx.world)
    styles = {"column": ColwiseParallel, "row": RowwiseParallel}
    names = [n for n, m in w.model.named_modules() if isinstance(m, nn.Linear)]
    plan = {n: styles[kind]() for pattern, kind in w.plan.items() for n in names if fnmatch.fnmatchcase(n, pattern)}
    widths = {m.out_features if isinstance(plan[n], ColwiseParallel) else m.in_features
              for n, m in w.model.named_modules() if n in plan}
    uneven = sorted(width for width in widths if width % ctx.world)
    if uneven:  # torch 2.13: RowwiseParallel multiplies mismatched blocks of uneven shards
        raise Skip(f"parallelize_module needs the split widths ({uneven}) to divide by {ctx.world} ranks")
    model = parallelize_module(w.model.to(ctx.device), P.mesh, plan)
    x, y = w.inputs.to(ctx.device), w.targets.to(ctx.device)
    step = forward_backward(model, x, y, w.loss_fn, weight=float(ctx.rank == 0))
    return make_trainer(list(model.parameters()), step, minimum, range(ctx.world))


def _sequence(w: Workload, ctx: Context, algo: str, keep_gathered: bool = True) -> Trainer:
    _check_heads(w, ctx.world)
    if w.samples % ctx.world:
        raise Skip(f"sequence parallelism splits dim 0 ({w.samples}) evenly over {ctx.world} ranks")
    layers = _tensor_bytes(w.model, w.plan, w.inputs, w.tokens, ctx.world, sequence=True)
    model = tpf.parallelize(w.model.to(ctx.device), placement=ctx.placement(range(ctx.world)),
                            plan=_tpflow_plan(w, sequence_parallel=True, algo=algo, keep_gathered=keep_gathered))
    rows = _rows(w.samples, ctx.world, ctx.rank)
    x, y = w.inputs[rows].to(ctx.device), w.targets[rows].to(ctx.device)
    # norms see this rank's rows only: parallelize's replicas sum their gradients in the backward, one each
    minimum = layers + sum(ring_bytes(block_bytes([p]), ctx.world, 2) for p in _norm_params(model))
    step = forward_backward(model, x, y, rows_share(w.targets.numel()))
    return make_trainer(list(model.parameters()), step, minimum, range(ctx.world))


def sequence_ring(w: Workload, ctx: Context) -> Trainer:
    return _sequence(w, ctx, "ring")


def sequence_unfused(w: Workload, ctx: Context) -> Trainer:
    return _sequence(w, ctx, "naive")


def sequence_regather(w: Workload, ctx: Context) -> Trainer:
    return _sequence(w, ctx, "ring", keep_gathered=False)


def _halves(ctx: Context) -> list[list[int]]:
    if ctx.world < 4 or ctx.world % 2:
        raise Skip("needs an even world of at least 4 ranks")
    half = ctx.world // 2
    return [list(range(half)), list(range(half, ctx.world))]


def data_x_tensor(w: Workload, ctx: Context) -> Trainer:
    ranks = _halves(ctx)
    tp = len(ranks[0])
    _check_heads(w, tp)
    P2 = ctx.placement(ranks)
    i, j = P2.coordinate()
    rows = _rows(w.samples, len(ranks), i)
    x, y = w.inputs[rows].to(ctx.device), w.targets[rows].to(ctx.device)
    layers = _tensor_bytes(w.model, w.plan, w.inputs, x.shape[:-1].numel(), tp)
    model = tpf.parallelize(w.model.to(ctx.device), placement=P2, plan=_tpflow_plan(w))
    minimum = layers + sum(ring_bytes(block_bytes([p]), len(ranks), 2) for p in model.parameters())
    step = forward_backward(model, x, y, rows_share(w.targets.numel()), weight=float(j == 0))
    # the norms' copies over the data axis saw different rows: summed with the layers' (tpflow.gradients)
    return make_trainer(list(model.parameters()), step, minimum, range(ctx.world))


def pipeline_x_tensor(w: Workload, ctx: Context) -> Trainer:
    _check_heads(w, max(1, ctx.world // 2))

    def layers(part: nn.Module, stage_input: torch.Tensor) -> int:
        return _tensor_bytes(part, w.plan, stage_input, w.tokens, ctx.world // 2)
    return pipelines.pipeline_x_tensor(w, ctx, _tpflow_plan(w), layers)


def _fsdp_bytes(groups: list[list[torch.Tensor]], dp: int, shard: bool, cuda: bool) -> int:
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


def _data_halves(w: Workload, ctx: Context) -> tuple[list[list[int]], int, int]:
    """Two data-parallel halves of tensor-parallel ranks, each training on its own rows: the halves, tp and dp."""
    ranks = _halves(ctx)
    tp, dp = len(ranks[0]), len(ranks)
    _check_heads(w, tp)
    if w.samples % dp:
        raise Skip(f"each data-parallel half trains on its own rows: {w.samples} samples do not split in {dp}")
    return ranks, tp, dp


def _data_x_tensor_fsdp(w: Workload, ctx: Context, shard: bool) -> Trainer:
    """tpflow's tensor parallelism over half the ranks, FSDP2 over the two halves: sharded, or each half a whole
    replica (HSDP with one rank a shard: DDP's layout)."""
    from torch.distributed.fsdp import fully_shard

    ranks, tp, dp = _data_halves(w, ctx)
    names, data = (("dp", "tp"), "dp") if shard else (("replicate", "shard", "tp"), ("replicate", "shard"))
    P = ctx.placement(ranks if shard else [[row] for row in ranks], names=names)
    coord = P.coordinate()
    rows = _rows(w.samples, dp, coord[0])
    x, y = w.inputs[rows].to(ctx.device), w.targets[rows].to(ctx.device)
    tokens = x.numel()
    minimum = _tensor_bytes(w.model, w.plan, w.inputs, tokens, tp) + _head_bytes(w, tp, True, tokens)
    model = tpf.parallelize(w.model.to(ctx.device), placement=P, plan="auto")
    layers = list(model.lm.model.layers)
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    groups = [[p.to_local() for p in layer.parameters()] for layer in layers]
    groups.append([p.to_local() for p in model.parameters() if id(p) not in in_layers])
    minimum += _fsdp_bytes(groups, dp, shard, ctx.device.type == "cuda")
    for block in [*layers, model]:
        fully_shard(block, mesh=P.mesh[data])
    step = forward_backward(model, x, y, w.loss_fn, weight=1 / dp if coord[-1] == 0 else 0.0)  # equal rows
    trainer = make_trainer(list(model.parameters()), step, minimum, range(ctx.world))
    trainer.torch_groups = [P.mesh[name].get_group() for name in names[:-1]]
    return trainer


def _exchange_bytes(w: Workload, dp: int, rank: int) -> int:
    """The bytes rank ``rank`` sends exchanging the moe workload's tokens with ``dp`` data-parallel ranks that share
    its experts out, over a step: its tokens' hidden states out and the other ranks' outputs back, then in the
    backward the mirror of both; each token once to each other rank holding one of its experts, read off the
    one-device model's routing of the whole batch. The routing that travels with them (ids, weights) and the counts
    are overhead, not counted here."""
    lm = w.model.lm
    per_rank = lm.config.num_experts // dp
    seq = w.inputs.shape[1]
    bounds = [_rows(w.samples, dp, d) for d in range(dp)]
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


def _experts_over_data_groups(lm: nn.Module, ignored: set, local: Callable) -> list[list[torch.Tensor]]:
    """FSDP2's parameter groups of a model whose experts it leaves alone: each decoder layer's, then the root's."""
    layers = list(lm.model.layers)
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    groups = [[local(p) for p in layer.parameters() if p not in ignored] for layer in layers]
    groups.append([local(p) for p in lm.parameters() if id(p) not in in_layers and p not in ignored])
    return groups


def experts_over_data_tpflow(w: Workload, ctx: Context) -> Trainer:
    """The moe workload on W data-parallel ranks, each its rows, FSDP2 over them, the experts shared out over them
    (``tpf.hf_plan(model, expert_parallel="dp")``, ``ignored_params=tpf.fsdp_ignored_params(model)``)."""
    from torch.distributed.fsdp import fully_shard

    dp = ctx.world
    if w.samples % dp:
        raise Skip(f"each data-parallel rank trains on its own rows: {w.samples} samples do not split in {dp}")
    P = ctx.placement([[r] for r in range(dp)], names=("dp", "tp"))
    rows = _rows(w.samples, dp, ctx.rank)
    x, y = w.inputs[rows].to(ctx.device), w.targets[rows].to(ctx.device)
    minimum = _exchange_bytes(w, dp, ctx.rank)
    model = tpf.parallelize(w.model.to(ctx.device), placement=P, plan=tpf.hf_plan(w.model, expert_parallel="dp"))
    ignored = tpf.fsdp_ignored_params(model)
    minimum += _fsdp_bytes(_experts_over_data_groups(model.lm, ignored, lambda p: p.to_local()), dp, True,
                           ctx.device.type == "cuda")
    for block in [*model.lm.model.layers, model]:
        fully_shard(block, mesh=P.mesh["dp"], ignored_params=ignored)
    step = forward_backward(model, x, y, w.loss_fn, weight=1 / dp)  # equal rows
    trainer = make_trainer(list(model.parameters()), step, minimum, range(ctx.world))
    trainer.torch_groups = [P.mesh["dp"].get_group()]
    return trainer


def experts_over_data_transformers(w: Workload, ctx: Context) -> Trainer:
    """transformers' own: ``DistributedConfig(fsdp_size=W, ep_size=W, ep_implementation="all_to_all")`` on the
    workload's checkpoint, each rank its rows; the layout's minimum as for tpflow's."""
    dp = ctx.world
    if w.samples % dp:
        raise Skip(f"each data-parallel rank trains on its own rows: {w.samples} samples do not split in {dp}")
    try:
        from transformers import AutoModelForCausalLM
        from transformers.distributed.configuration_utils import DistributedConfig
    except ImportError as e:
        raise Skip(f"needs transformers with DistributedConfig: {e}") from e
    minimum = _exchange_bytes(w, dp, ctx.rank)
    config = DistributedConfig(fsdp_size=dp, ep_size=dp, ep_implementation="all_to_all")
    lm = _from_checkpoint(w, ctx, AutoModelForCausalLM, distributed_config=config)
    model = CausalLMLoss(lm)
    rows = _rows(w.samples, dp, ctx.rank)
    x, y = w.inputs[rows].to(ctx.device), w.targets[rows].to(ctx.device)
    experts = {p for name, m in lm.named_modules() if name.endswith("mlp.experts") for p in m.parameters()}
    shapes = _experts_over_data_groups(lm, experts, lambda p: torch.empty(p.shape, dtype=p.dtype, device="meta"))
    minimum += _fsdp_bytes(shapes, dp, True, ctx.device.type == "cuda")
    step = forward_backward(model, x, y, w.loss_fn, weight=1 / dp)
    trainer = make_trainer(list(model.parameters()), step, minimum, range(ctx.world))
    meshes = {p.device_mesh for p in lm.parameters() if hasattr(p, "device_mesh")}
    trainer.torch_groups = [m.get_group(d) for m in meshes for d in range(m.ndim)]
    return trainer


def _tp_block(p: torch.Tensor, tp_axis: int, tp: int, coord: int) -> torch.Size:
    """The tensor-parallel block of a DTensor parameter ``p`` (its shape before the data axes shard it): its global
    shape cut where its placement on mesh axis ``tp_axis`` splits it."""
    shape = list(p.shape)
    placements = getattr(p, "placements", ())
    if tp_axis < len(placements) and placements[tp_axis].is_shard():
        dim = placements[tp_axis].dim
        start, end = chunk_bounds(shape[dim], tp)[coord]
        shape[dim] = end - start
    return torch.Size(shape)


def fsdp_x_tensor_transformers(w: Workload, ctx: Context) -> Trainer:
    """transformers' own FSDP2 x tensor parallelism (``from_pretrained(path, distributed_config=
    DistributedConfig(tp_size=, fsdp_size=))``) on the workload's checkpoint, each data-parallel half its rows; the
    layout's minimum as for tpflow's (its own plan's head: logits gathered)."""
    _, tp, dp = _data_halves(w, ctx)
    try:
        from transformers import AutoModelForCausalLM
        from transformers.distributed.configuration_utils import DistributedConfig
    except ImportError as e:
        raise Skip(f"needs transformers with DistributedConfig: {e}") from e
    lm = _from_checkpoint(w, ctx, AutoModelForCausalLM, distributed_config=DistributedConfig(tp_size=tp, fsdp_size=dp))
    model = CausalLMLoss(lm)
    mesh = next(p for p in lm.parameters() if p.device_mesh.ndim == 2).device_mesh
    data = mesh.mesh_dim_names[0]  # ("fsdp", "tp")
    i, j = mesh.get_coordinate()
    rows = _rows(w.samples, dp, i)
    x, y = w.inputs[rows].to(ctx.device), w.targets[rows].to(ctx.device)
    tokens = x.numel()
    minimum = _tensor_bytes(w.model, w.plan, w.inputs, tokens, tp) + _head_bytes(w, tp, False, tokens)
    layers = list(lm.model.layers)
    in_layers = {id(p) for layer in layers for p in layer.parameters()}

    def blocks(params):
        return [torch.empty(_tp_block(p, p.device_mesh.ndim - 1 if p.device_mesh.ndim == 2 else 99, tp, j),
                            dtype=p.dtype, device="meta") for p in params]
    groups = [blocks(layer.parameters()) for layer in layers]
    groups.append(blocks(p for p in lm.parameters() if id(p) not in in_layers))
    minimum += _fsdp_bytes(groups, dp, True, ctx.device.type == "cuda")
    step = forward_backward(model, x, y, w.loss_fn, weight=1 / dp if j == 0 else 0.0)
    trainer = make_trainer(list(model.parameters()), step, minimum, range(ctx.world))
    trainer.torch_groups = [mesh[data].get_group()]
    return trainer


def fsdp_x_tensor(w: Workload, ctx: Context) -> Trainer:
    return _data_x_tensor_fsdp(w, ctx, shard=True)


def ddp_x_tensor(w: Workload, ctx: Context) -> Trainer:
    return _data_x_tensor_fsdp(w, ctx, shard=False)


MODES: dict[str, Callable[[Workload, Context], Trainer]] = {
    "one device": one_device,
    "data, tpflow SBP": data_sbp,
    "data, DDP": data_ddp,
    "tensor, tpflow": tensor_tpflow,
    "tensor, torch": tensor_torch,
    "tensor, transformers": tensor_transformers,
    "experts, tpflow": experts_tpflow,
    "experts, transformers": experts_transformers,
    "experts over data, tpflow": experts_over_data_tpflow,
    "experts over data, transformers": experts_over_data_transformers,
    "sequence, ring": sequence_ring,
    "sequence, unfused": sequence_unfused,
    "sequence, regather": sequence_regather,
    **{f"pipeline, {name}{peer}": build(name) for name in pipelines.SCHEDULES
       for peer, build in (("", pipelines.pipeline_mode), (", torch", pipelines.torch_pipeline_mode))},
    "data x tensor": data_x_tensor,
    "pipeline x tensor": pipeline_x_tensor,
    "fsdp x tensor": fsdp_x_tensor,
    "ddp x tensor": ddp_x_tensor,
    "fsdp x tensor, transformers": fsdp_x_tensor_transformers,
}


HF_ONLY = ("tensor, transformers", "fsdp x tensor", "ddp x tensor", "fsdp x tensor, transformers")
HF_MODES = ("one device", "tensor, tpflow", "tensor, torch", *HF_ONLY)
MOE_ONLY = ("experts, tpflow", "experts, transformers", "experts over data, tpflow", "experts over data, transformers")
MOE_MODES = ("one device", "tensor, tpflow", "tensor, transformers", *MOE_ONLY)


def slug(mode: str) -> str:
    """The mode's name for the command line: "data, DDP" is data-ddp.

    Lower case, with ", " and spaces made hyphens: the choices of ``python -m tpflow.bench --modes``.

    Args:
        mode: a key of ``MODES``.

    Returns:
        The hyphenated name.

    Example::

        >>> slug("data, DDP")
        'data-ddp'
        >>> slug("pipeline x tensor")
        'pipeline-x-tensor'
    """
    return mode.lower().replace(", ", "-").replace(" ", "-")


def build(name: str, w: Workload, ctx: Context) -> Trainer:
    """Mode ``name`` on a fresh copy of the workload's model (every rank calls it, in the same order).

    The model is deep-copied, so every mode starts from the same values and ``w`` is left as it was (the
    batch's tensors are shared). Building a mode can run collectives (DDP broadcasts its parameters, for
    one), hence the same order on every rank.

    Args:
        name: a key of ``MODES``, e.g. ``"tensor, tpflow"``.
        w: the workload, the same on every rank.
        ctx: this rank's world, rank and device.

    Returns:
        The mode's :class:`Trainer` on this rank.

    Raises:
        Skip: the mode cannot run this workload on this world.

    Example::

        >>> from tpflow.bench.workloads import build as build_workload
        >>> w = build_workload("mlp", dim=32, hidden=64, depth=4, tokens=64, seq=8, heads=8, kv_heads=4)
        >>> ctx = Context(world=2, rank=dist.get_rank(), device=torch.device("cpu"))
        >>> trainer = build("tensor, tpflow", w, ctx)
        >>> trainer.step()                                  # on rank 0, which reports the whole loss
        tensor(2.3699)
        >>> build("one device", w, ctx).step()              # on rank 0: the same loss on one device
        tensor(2.3699)
    """
    if w.name == "moe":
        if name not in MOE_MODES:
            raise Skip("the moe workload runs one device, the tensor modes (experts split) and the experts modes")
    elif name in MOE_ONLY:
        raise Skip("the experts modes run the moe workload only")
    elif name in HF_ONLY and w.name != "hf":
        raise Skip("transformers' own tensor parallelism runs the hf workload only" if name.endswith("transformers")
                   else "FSDP2 wraps the hf workload's decoder layers: it runs the hf workload only")
    elif w.name == "hf" and name not in HF_MODES:
        raise Skip("the hf workload runs one device and the tensor modes only")
    fresh = dataclasses.replace(w, model=copy.deepcopy(w.model))
    return MODES[name](fresh, ctx)

