"""The harness's modes over two axes: data x tensor (tpflow's SBP, FSDP2, DDP's layout under FSDP2), pipeline x
tensor, transformers' FSDP x tensor, and experts shared out over the data-parallel ranks (tpflow's and
transformers'). Each is a ``Trainer`` of one workload on this rank, as ``tpflow.bench.modes`` describes."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import tpflow as tpf
from tpflow.bench import pipelines
from tpflow.bench.layouts import (
    check_heads,
    exchange_bytes,
    from_checkpoint,
    fsdp_bytes,
    head_bytes,
    rows_of,
    tensor_bytes,
    tpflow_plan,
)
from tpflow.bench.trainer import Context, Skip, Trainer, block_bytes, forward_backward, make_trainer, rows_share
from tpflow.bench.workloads import CausalLMLoss, Workload
from tpflow.comm import ring_bytes
from tpflow.sbp import chunk_bounds

__all__: list[str] = []  # the modes are reached through tpflow.bench.modes.MODES


def _halves(ctx: Context) -> list[list[int]]:
    if ctx.world < 4 or ctx.world % 2:
        raise Skip("needs an even world of at least 4 ranks")
    half = ctx.world // 2
    return [list(range(half)), list(range(half, ctx.world))]


def data_x_tensor(w: Workload, ctx: Context) -> Trainer:
    ranks = _halves(ctx)
    tp = len(ranks[0])
    check_heads(w, tp)
    P2 = ctx.placement(ranks)
    i, j = P2.coordinate()
    rows = rows_of(w.samples, len(ranks), i)
    x, y = w.inputs[rows].to(ctx.device), w.targets[rows].to(ctx.device)
    layers = tensor_bytes(w.model, w.plan, w.inputs, x.shape[:-1].numel(), tp)
    model = tpf.parallelize(w.model.to(ctx.device), placement=P2, plan=tpflow_plan(w))
    minimum = layers + sum(ring_bytes(block_bytes([p]), len(ranks), 2) for p in model.parameters())
    step = forward_backward(model, x, y, rows_share(w.targets.numel()), weight=float(j == 0))
    # the norms' copies over the data axis saw different rows: summed with the layers' (tpflow.gradients)
    return make_trainer(list(model.parameters()), step, minimum, range(ctx.world))


def pipeline_x_tensor(w: Workload, ctx: Context) -> Trainer:
    check_heads(w, max(1, ctx.world // 2))

    def layers(part: nn.Module, stage_input: torch.Tensor) -> int:
        return tensor_bytes(part, w.plan, stage_input, w.tokens, ctx.world // 2)
    return pipelines.pipeline_x_tensor(w, ctx, tpflow_plan(w), layers)


def _data_halves(w: Workload, ctx: Context) -> tuple[list[list[int]], int, int]:
    """Two data-parallel halves of tensor-parallel ranks, each training on its own rows: the halves, tp and dp."""
    ranks = _halves(ctx)
    tp, dp = len(ranks[0]), len(ranks)
    check_heads(w, tp)
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
    rows = rows_of(w.samples, dp, coord[0])
    x, y = w.inputs[rows].to(ctx.device), w.targets[rows].to(ctx.device)
    tokens = x.numel()
    minimum = tensor_bytes(w.model, w.plan, w.inputs, tokens, tp) + head_bytes(w, tp, True, tokens)
    model = tpf.parallelize(w.model.to(ctx.device), placement=P, plan="auto")
    layers = list(model.lm.model.layers)
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    groups = [[p.to_local() for p in layer.parameters()] for layer in layers]
    groups.append([p.to_local() for p in model.parameters() if id(p) not in in_layers])
    minimum += fsdp_bytes(groups, dp, shard, ctx.device.type == "cuda")
    for block in [*layers, model]:
        fully_shard(block, mesh=P.mesh[data])
    step = forward_backward(model, x, y, w.loss_fn, weight=1 / dp if coord[-1] == 0 else 0.0)  # equal rows
    trainer = make_trainer(list(model.parameters()), step, minimum, range(ctx.world))
    trainer.torch_groups = [P.mesh[name].get_group() for name in names[:-1]]
    return trainer


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
    rows = rows_of(w.samples, dp, ctx.rank)
    x, y = w.inputs[rows].to(ctx.device), w.targets[rows].to(ctx.device)
    minimum = exchange_bytes(w, dp, ctx.rank)
    model = tpf.parallelize(w.model.to(ctx.device), placement=P, plan=tpf.hf_plan(w.model, expert_parallel="dp"))
    ignored = tpf.fsdp_ignored_params(model)
    minimum += fsdp_bytes(_experts_over_data_groups(model.lm, ignored, lambda p: p.to_local()), dp, True,
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
    minimum = exchange_bytes(w, dp, ctx.rank)
    config = DistributedConfig(fsdp_size=dp, ep_size=dp, ep_implementation="all_to_all")
    lm = from_checkpoint(w, ctx, AutoModelForCausalLM, distributed_config=config)
    model = CausalLMLoss(lm)
    rows = rows_of(w.samples, dp, ctx.rank)
    x, y = w.inputs[rows].to(ctx.device), w.targets[rows].to(ctx.device)
    experts = {p for name, m in lm.named_modules() if name.endswith("mlp.experts") for p in m.parameters()}
    shapes = _experts_over_data_groups(lm, experts, lambda p: torch.empty(p.shape, dtype=p.dtype, device="meta"))
    minimum += fsdp_bytes(shapes, dp, True, ctx.device.type == "cuda")
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
    lm = from_checkpoint(w, ctx, AutoModelForCausalLM, distributed_config=DistributedConfig(tp_size=tp, fsdp_size=dp))
    model = CausalLMLoss(lm)
    mesh = next(p for p in lm.parameters() if p.device_mesh.ndim == 2).device_mesh
    data = mesh.mesh_dim_names[0]  # ("fsdp", "tp")
    i, j = mesh.get_coordinate()
    rows = rows_of(w.samples, dp, i)
    x, y = w.inputs[rows].to(ctx.device), w.targets[rows].to(ctx.device)
    tokens = x.numel()
    minimum = tensor_bytes(w.model, w.plan, w.inputs, tokens, tp) + head_bytes(w, tp, False, tokens)
    layers = list(lm.model.layers)
    in_layers = {id(p) for layer in layers for p in layer.parameters()}

    def blocks(params):
        return [torch.empty(_tp_block(p, p.device_mesh.ndim - 1 if p.device_mesh.ndim == 2 else 99, tp, j),
                            dtype=p.dtype, device="meta") for p in params]
    groups = [blocks(layer.parameters()) for layer in layers]
    groups.append(blocks(p for p in lm.parameters() if id(p) not in in_layers))
    minimum += fsdp_bytes(groups, dp, True, ctx.device.type == "cuda")
    step = forward_backward(model, x, y, w.loss_fn, weight=1 / dp if j == 0 else 0.0)
    trainer = make_trainer(list(model.parameters()), step, minimum, range(ctx.world))
    trainer.torch_groups = [mesh[data].get_group()]
    return trainer


def fsdp_x_tensor(w: Workload, ctx: Context) -> Trainer:
    return _data_x_tensor_fsdp(w, ctx, shard=True)


def ddp_x_tensor(w: Workload, ctx: Context) -> Trainer:
    return _data_x_tensor_fsdp(w, ctx, shard=False)
