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
    (the lora workload)  the hf workload's Llama under PEFT's LoRA: one device and "tensor, tpflow" (each adapter
                        laid out as its base layer, tpflow.hf.adapters) train its adapters
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
from collections.abc import Callable

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

import tpflow as tpf
from tpflow.bench import pipelines
from tpflow.bench.hybrid import (
    data_x_tensor,
    ddp_x_tensor,
    experts_over_data_tpflow,
    experts_over_data_transformers,
    fsdp_x_tensor,
    fsdp_x_tensor_transformers,
    pipeline_x_tensor,
)
from tpflow.bench.layouts import (
    check_heads,
    experts_bytes,
    from_checkpoint,
    head_bytes,
    lora_bytes,
    norm_params,
    rows_of,
    summed_norm_bytes,
    tensor_bytes,
    tpflow_plan,
)
from tpflow.bench.measure import count_ddp
from tpflow.bench.trainer import Context, Skip, Trainer, block_bytes, forward_backward, make_trainer, rows_share
from tpflow.bench.workloads import CausalLMLoss, Workload
from tpflow.comm import ring_bytes

__all__ = ["MODES", "build", "slug"]


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
    rows = rows_of(w.samples, ctx.world, ctx.rank)
    x, y = w.inputs[rows].to(ctx.device), w.targets[rows].to(ctx.device)
    params = list(ddp.parameters())  # each rank's mean over its (equal) rows: 1/W of the batch's
    trainer = make_trainer(params, forward_backward(ddp, x, y, weight=1 / ctx.world),
                           ring_bytes(block_bytes(params), ctx.world, 2), range(ctx.world))
    trainer.state_bytes = block_bytes(params)
    return trainer


def tensor_tpflow(w: Workload, ctx: Context, expert_parallel: bool = False) -> Trainer:
    check_heads(w, ctx.world)
    minimum = tensor_bytes(w.model, w.plan, w.inputs, w.tokens, ctx.world) + experts_bytes(w, ctx.world) + \
        summed_norm_bytes(w, ctx.world) + lora_bytes(w, ctx.world)
    hf = isinstance(w.model, CausalLMLoss)  # the model's own plan, its head included
    minimum += head_bytes(w, ctx.world, vocab_parallel=True) if hf else 0
    plan = tpf.hf_plan(w.model, expert_parallel=expert_parallel) if hf else tpflow_plan(w)
    model = tpf.parallelize(w.model.to(ctx.device), placement=ctx.placement(range(ctx.world)), plan=plan)
    x, y = w.inputs.to(ctx.device), w.targets.to(ctx.device)
    step = forward_backward(model, x, y, w.loss_fn, weight=float(ctx.rank == 0))
    return make_trainer(list(model.parameters()), step, minimum, range(ctx.world))


def experts_tpflow(w: Workload, ctx: Context) -> Trainer:
    return tensor_tpflow(w, ctx, expert_parallel=True)


def tensor_transformers(w: Workload, ctx: Context, expert_parallel: bool = False) -> Trainer:
    """transformers' own tensor parallelism (``from_pretrained(path, tp_plan="auto")``, which needs accelerate) on
    the checkpoint of the workload's model, saved by rank 0 to a temporary directory; ``expert_parallel``: its
    experts shared out over the same ranks (``DistributedConfig(tp_size=W, ep_size=W)``)."""
    check_heads(w, ctx.world)
    try:
        import accelerate  # noqa: F401 - transformers' tensor parallelism needs it
        from transformers import AutoModelForCausalLM
        from transformers.distributed.configuration_utils import DistributedConfig
    except ImportError as e:
        raise Skip(f"transformers' tensor parallelism needs transformers and accelerate: {e}") from e
    parallel = {"distributed_config": DistributedConfig(tp_size=ctx.world, ep_size=ctx.world)} if expert_parallel \
        else {"tp_plan": "auto"}
    model = CausalLMLoss(from_checkpoint(w, ctx, AutoModelForCausalLM, **parallel))
    minimum = tensor_bytes(w.model, w.plan, w.inputs, w.tokens, ctx.world) + head_bytes(w, ctx.world, False) + \
        experts_bytes(w, ctx.world) + summed_norm_bytes(w, ctx.world)
    x, y = w.inputs.to(ctx.device), w.targets.to(ctx.device)
    step = forward_backward(model, x, y, w.loss_fn, weight=float(ctx.rank == 0))
    return make_trainer(list(model.parameters()), step, minimum, range(ctx.world))


def experts_transformers(w: Workload, ctx: Context) -> Trainer:
    return tensor_transformers(w, ctx, expert_parallel=True)


def tensor_torch(w: Workload, ctx: Context) -> Trainer:
    check_heads(w, ctx.world)
    P = ctx.placement(range(ctx.world))
    minimum = tensor_bytes(w.model, w.plan, w.inputs, w.tokens, ctx.world)
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
    check_heads(w, ctx.world)
    if w.samples % ctx.world:
        raise Skip(f"sequence parallelism splits dim 0 ({w.samples}) evenly over {ctx.world} ranks")
    layers = tensor_bytes(w.model, w.plan, w.inputs, w.tokens, ctx.world, sequence=True)
    model = tpf.parallelize(w.model.to(ctx.device), placement=ctx.placement(range(ctx.world)),
                            plan=tpflow_plan(w, sequence_parallel=True, algo=algo, keep_gathered=keep_gathered))
    rows = rows_of(w.samples, ctx.world, ctx.rank)
    x, y = w.inputs[rows].to(ctx.device), w.targets[rows].to(ctx.device)
    # norms see this rank's rows only: parallelize's replicas sum their gradients in the backward, one each
    minimum = layers + sum(ring_bytes(block_bytes([p]), ctx.world, 2) for p in norm_params(model))
    step = forward_backward(model, x, y, rows_share(w.targets.numel()))
    return make_trainer(list(model.parameters()), step, minimum, range(ctx.world))


def sequence_ring(w: Workload, ctx: Context) -> Trainer:
    return _sequence(w, ctx, "ring")


def sequence_unfused(w: Workload, ctx: Context) -> Trainer:
    return _sequence(w, ctx, "naive")


def sequence_regather(w: Workload, ctx: Context) -> Trainer:
    return _sequence(w, ctx, "ring", keep_gathered=False)


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


LORA_MODES = ("one device", "tensor, tpflow")  # transformers' TP with PEFT's LoRA: benchmarks/lora_cpu.py


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
        >>> ctx = Context(world=2, rank=tpf.get_rank(), device=torch.device("cpu"))
        >>> trainer = build("tensor, tpflow", w, ctx)
        >>> trainer.step()                                  # on rank 0, which reports the whole loss
        tensor(2.3699)
        >>> build("one device", w, ctx).step()              # on rank 0: the same loss on one device
        tensor(2.3699)
    """
    if w.name == "lora":
        if name not in LORA_MODES:
            raise Skip("the lora workload runs one device and tensor, tpflow (transformers' tensor parallelism with "
                       "PEFT's LoRA: benchmarks/lora_cpu.py)")
    elif w.name == "moe":
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
