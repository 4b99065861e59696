"""``parallelize(model, placement=, plan=)``: swap a model's ``nn.Linear`` layers for parallel ones, in place.

    plan = {"*.fc1": "column", "*.fc2": "row"}                       # fnmatch patterns of module names
    plan = {"*.q_proj": "column", "*.o_proj": tpf.RowParallel(sequence_parallel=True)}
    plan = {"*.[qkv]_proj": tpf.ColumnParallel(fuse=True), "*.o_proj": "row"}   # q, k, v as one product

Each matched ``nn.Linear`` is replaced by a layer holding its values (each rank keeps its block),
so a model built and loaded on one device, the same on every rank, becomes a tensor-parallel one.
"""

from __future__ import annotations

import fnmatch
import hashlib
from collections.abc import Mapping

from torch import nn

from tpflow import comm
from tpflow.layers import ColumnGroup, VocabParallelEmbedding
from tpflow.layers.experts import check_experts, experts_axis, split_experts
from tpflow.layers.regions import SPLIT, WHOLE, tag
from tpflow.layers.replicated import replicate
from tpflow.layers.vocab import ranks_without_rows
from tpflow.ops import ulysses_degrees
from tpflow.placement import Placement
from tpflow.plans.context import context_parallel
from tpflow.plans.fsdp import expect_fsdp, leaves_data_axes, tensor_slice
from tpflow.plans.heads import attention_heads, check, keep_columns, split_per_head
from tpflow.plans.hf import hf_plan
from tpflow.plans.inputs import check_inputs
from tpflow.plans.logits import route_loss
from tpflow.plans.pretrained import export_whole
from tpflow.plans.styles import (
    ColumnParallel,
    ContextParallel,
    ExpertParallel,
    ExpertTensorParallel,
    GatherSequence,
    Replicated,
    RowParallel,
    SequenceParallel,
    VocabParallel,
    style_of,
)

__all__ = ["parallelize"]


def parallelize(model: nn.Module, *, placement: Placement, plan: Mapping[str, object] | str) -> nn.Module:
    """Replace the ``nn.Linear`` (and, for ``"vocab"`` entries, ``nn.Embedding``) modules whose names match
    ``plan``'s patterns, and make every other parameter a global tensor too; returns ``model``.

    Patterns are ``fnmatch`` patterns over ``named_modules()`` names (``*`` crosses dots, so
    ``"*.fc1"`` matches ``"blocks.0.mlp.fc1"``). Every pattern must match at least one module,
    each match of a column or row entry must be an ``nn.Linear`` (of a ``"vocab"`` entry, an ``nn.Embedding`` or an
    ``nn.Linear`` head), and no module may match two patterns:
    anything else is an error naming the pattern, raised before the model is changed. So is an attention
    module whose heads do not split over the tensor-parallel ranks.

    Each matched ``nn.Linear`` is replaced by a layer holding its values (each rank keeps its block), so a
    model built and loaded on one device, the same on every rank, becomes a tensor-parallel one. A module
    shared under two names becomes one layer under both, if their entries agree. A tied embedding and head
    planned ``"vocab"`` hold the same block of one matrix and stay one parameter; a parameter a planned layer
    shares with a module outside the plan would come untied, which is an error too. A ``"vocab"`` head's logits
    come back as a global tensor split over the vocabulary, and the model's own ``F.cross_entropy`` after it runs
    vocabulary-parallel (``tpflow.plans.logits``). The
    ``ColumnParallel(fuse=True)`` layers of one parent module become one fused group (``ColumnGroup``).

    Every parameter no entry replaces (norms, embeddings, biases of other modules) stays whole on every rank as
    a global tensor broadcast over ``placement`` (``tpflow.layers.replicated``): the model's parameters are
    then all DTensors, as ``torch.nn.utils.clip_grad_norm_`` and ``torch.optim`` need, and each gets one
    device's gradient: where a module sees only this rank's part of the data (a per-head norm, a norm on this
    rank's tokens) its gradients are summed over the ranks. With fewer key/value heads than ranks, the k / v
    projections stay whole and each rank keeps its head (``tpflow.plans.heads``).

    Args:
        model: the model to change, in place.
        placement: the ranks its parallel layers live on (``tpf.placement``); on a 2-D placement the last
            axis is tensor parallel and the others data parallel: tpflow's own (SBP) data parallelism on an
            unnamed placement; on a named one (``names=("dp", "tp")``) the layers live on the last axis' slice
            (``placement["tp"]``) and the data axes are left to PyTorch's FSDP2, ``fully_shard(block,
            mesh=placement.mesh["dp"])`` on each block and on the model, which the first forward checks (column
            layers are not fused there: FSDP2 owns the weights, gathering and freeing them around each forward).
        plan: ``"auto"``: a Hugging Face model's own plan (``tpf.hf_plan(model)``); or ``fnmatch`` patterns over
            module names, each mapped to its entry: ``"column"`` (W split(1)), ``"row"`` (W split(0)),
            ``"vocab"`` (an embedding or a head split over the vocabulary), Hugging Face's names (``"colwise"``,
            ``"rowwise"``, ``"colwise_gather_output"``, ``"embedding_rowwise"``, ``"replicated_with_grad_allreduce"``,
            ``"sequence_parallel"``, ...; ``tpflow.plans.styles.STYLES``), or ``tpf.ColumnParallel(...)`` /
            ``tpf.RowParallel(...)`` / ``tpf.VocabParallel(...)`` / ``tpf.Replicated(...)`` /
            ``tpf.SequenceParallel(...)`` with options.

    Returns:
        ``model`` itself, its matched ``nn.Linear`` modules replaced.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> import tpflow as tpf
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)                          # the same model on every rank
        >>> block = nn.Sequential()
        >>> block.mlp = nn.Sequential()
        >>> block.mlp.fc1, block.mlp.act, block.mlp.fc2 = nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)
        >>> model = tpf.parallelize(block, placement=P, plan={"*.fc1": "column", "*.fc2": "row"})
        >>> type(model.mlp.fc1).__name__, type(model.mlp.fc2).__name__
        ('ColumnParallelLinear', 'RowParallelLinear')
        >>> model(torch.randn(8, 512)).shape                  # the whole output on every rank
        torch.Size([8, 512])
    """
    if not isinstance(placement, Placement):
        raise TypeError(f"placement must be a tpf.placement(type, ranks), got {placement!r}")
    if isinstance(plan, str):
        if plan != "auto":
            raise ValueError(f"plan must be 'auto' or a dict of module-name patterns to entries, got {plan!r}")
        plan = hf_plan(model)
    _check_buffers(model)
    modules = dict(model.named_modules(remove_duplicate=False))  # a module shared under two names has both
    chosen = _match(model, modules, plan)
    contexts = {name: style for name, (_, style) in chosen.items() if isinstance(style, ContextParallel)}
    given, placement = placement, _context_placement(model, modules, chosen, contexts, placement) if contexts else \
        placement
    _agree(model, placement, chosen)
    named, placement = placement, tensor_slice(placement)  # a named placement's data axes: FSDP2's
    experts = {name: ("experts", style.axis) if isinstance(style, ExpertParallel) else ("intermediate", None)
               for name, (_, style) in chosen.items() if isinstance(style, (ExpertTensorParallel, ExpertParallel))}
    for name, (by, axis) in experts.items():
        if axis is None:
            check_experts(name, modules[name], placement.hierarchy[-1], by)
        else:  # over a data axis of the named placement, and by the intermediate dim over its tensor axis
            check_experts(name, modules[name], named.hierarchy[experts_axis(named, axis)], by)
            if named.hierarchy[-1] > 1:
                check_experts(name, modules[name], named.hierarchy[-1])
    kv_heads, groups = _heads(modules, chosen, placement.hierarchy[-1])
    linears = {name: entry for name, entry in chosen.items()
               if isinstance(entry[1], (ColumnParallel, RowParallel, VocabParallel))}
    ties = _ties(model, modules, linears)
    _check_vocabularies(modules, linears, placement.hierarchy[-1])
    fused = _fused_groups(modules, linears)
    if leaves_data_axes(named):  # FSDP2's parameters are not tpflow's to join (fsdp.py): each layer on its own
        fused = {}
    built: dict[int, nn.Module] = {}
    styles: dict[int, tuple[str, object]] = {}
    for name, (pattern, style) in linears.items():  # a shared module is one layer: its names must agree
        first = styles.setdefault(id(modules[name]), (pattern, style))
        if first[1] != style:
            raise ValueError(f"{name!r} is the same module as one matched by {first[0]!r}, but plan pattern "
                             f"{pattern!r} gives it another style")
    for name, per_kv_head in groups.items():  # every check passed: the model changes from here on
        modules[name].num_key_value_groups = per_kv_head
    for name, (_, style) in linears.items():
        module = modules[name]
        if id(module) not in built:
            layer = built[id(module)] = style.build(module, placement)
            layer.label = f"{type(layer).__name__} {name!r}"
        for alias in (n for n, m in modules.items() if m is module):  # every name of a shared module
            parent_name, _, child = alias.rpartition(".")
            setattr(model.get_submodule(parent_name), child, built[id(module)])
    for owners in ties:  # a tied embedding and head: the same block of one matrix, one parameter
        first = getattr(built[owners[0][0]], owners[0][1])
        for key, attr in owners[1:]:
            setattr(built[key], attr, first)
    heads = [layer for layer in built.values() if getattr(layer, "global_output", False)]
    if heads:
        route_loss(model, heads)
    for parent, names in fused.items():
        ColumnGroup([built[id(modules[name])] for name in names], model.get_submodule(parent))
    for name, (by, axis) in experts.items():
        split_experts(modules[name], placement if axis is None else named, by, axis)
    for name, module in modules.items():  # per-head parameters of attention split by heads (gpt-oss's sinks)
        q = chosen.get(f"{name}.q_proj", (None, None))[1]
        if attention_heads(module) is not None and isinstance(q, ColumnParallel) and not q.gather_output:
            split_per_head(module, placement)
    grads = {}
    for name, (_, style) in chosen.items():
        if isinstance(style, SequenceParallel):
            grads[name] = "partial"
            if style.split_input:
                _on_tokens(modules[name], style.sequence_dim, placement, gather=False)
        elif isinstance(style, GatherSequence):
            _on_tokens(modules[name], style.sequence_dim, placement, gather=True)
            if style.split_output:
                _output_to_tokens(modules[name], style.sequence_dim, placement)
        elif isinstance(style, Replicated):
            grads[name] = style.grads
    coord = placement.coordinate()
    for name, (start, end) in kv_heads.items():
        grads[name] = "partial"
        if coord is not None:
            keep_columns(modules[name], start[coord[-1]], end[coord[-1]], placement)
    replicate(model, placement, grads)
    export_whole(model)
    first = next((name for name in modules if name in linears and _reads_whole(modules[name], linears[name][1])), None)
    if first is not None:  # the first layer that must read the same data on every tensor-parallel rank
        check_inputs(model.get_submodule(first), first, placement)
    expect_fsdp(model, named)
    if contexts:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        context_parallel(model, {name: modules[name] for name in contexts}, next(iter(contexts.values())).kind,
                         placement, given, head)
    return model


def _context_placement(model: nn.Module, modules: dict[str, nn.Module], plan: dict[str, tuple],
                       contexts: dict[str, ContextParallel], placement: Placement) -> Placement:
    """The ``(context, tensor)`` placement of a context-parallel plan, checked: a 1-D placement's ranks are all
    context parallel (a tensor axis of one rank), a 2-D one's first axis is; every attention module takes the same
    entry; Ulysses' heads split over the context ranks."""
    if placement.names is not None or placement.ndim > 2:
        raise ValueError(f"context parallelism runs on a 1-D placement (context alone) or an unnamed 2-D one (context "
                         f"x tensor), got {placement!r}")
    if not hasattr(model, "config") or not hasattr(model, "set_attn_implementation"):
        raise ValueError(f"tpf.ContextParallel plans a Hugging Face model's attention modules (through its "
                         f"AttentionInterface); {type(model).__name__} is not one")
    sequence = [pattern for pattern, style in plan.values() if isinstance(style, (SequenceParallel, GatherSequence))
                or getattr(style, "sequence_parallel", False)]
    if sequence:
        raise ValueError(f"context parallelism splits the sequence through every layer already: drop the sequence-"
                         f"parallel entries {sorted(set(sequence))}")
    kinds = {style.kind for style in contexts.values()}
    missed = [name for name, m in modules.items() if attention_heads(m) is not None and name not in contexts]
    if len(kinds) > 1 or missed:
        raise ValueError(f"context parallelism splits the sequence through every attention module alike: plan each "
                         f"with the same tpf.ContextParallel entry (got kinds {sorted(kinds)}; unplanned: {missed})")
    if placement.ndim == 1:
        placement = Placement(placement.type, [[rank] for rank in placement.flat_ranks])
    context, tensor = placement.hierarchy
    for name in contexts:
        counts = attention_heads(modules[name])
        if kinds == {"ulysses"} and counts is not None:
            heads, kv = counts[0] // tensor, max(counts[1] // tensor, 1)  # this tensor rank's
            if context not in ulysses_degrees(heads, kv):
                raise ValueError(f"{name!r}: Ulysses splits each tensor-parallel rank's {heads} query heads and {kv} "
                                 f"key/value heads over the {context} context ranks, which they do not divide: use "
                                 f"{ulysses_degrees(heads, kv)} context ranks, or tpf.ContextParallel('ring')")
    return placement


def _reads_whole(module: nn.Module, style: object) -> bool:
    """Whether the layer ``style`` makes of ``module`` reads the same whole input on every tensor-parallel rank."""
    if isinstance(style, VocabParallel):
        return isinstance(module, nn.Embedding) or not style.sequence_parallel  # an embedding reads every id
    if isinstance(style, ColumnParallel):
        return not style.sequence_parallel
    return isinstance(style, RowParallel) and not style.input_is_parallel


def _agree(model: nn.Module, placement: Placement, chosen: dict[str, tuple]) -> None:
    """Every rank of ``placement`` parallelizes the same model by the same plan, or every one of them stops here:
    a rank with another plan (fuse=False, no vocabulary split) would hang in a collective or, worse, train on
    with other gradients."""
    if placement.coordinate() is None:
        return
    shapes = [(name, tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters()]
    facts = {"the placement": repr(placement),
             "the model": f"{type(model).__name__} of {len(shapes)} parameters "
                          f"(digest {hashlib.sha1(repr(shapes).encode()).hexdigest()[:12]})"}
    facts.update({f"the plan entry of {name!r}": f"{pattern!r}: {style!r}"
                  for name, (pattern, style) in chosen.items()})
    groups = [placement.mesh.get_group(axis) for axis in range(placement.ndim)] if len(placement.flat_ranks) > 1 else []
    comm.agree("parallelize", facts, groups, "call parallelize with the same model, placement and plan on every rank")


def _check_buffers(model: nn.Module) -> None:
    """Refuse a model whose computed buffers were never computed (built under ``torch.device("meta")``): no
    checkpoint holds them, so the forward would fail deep in the model's code."""
    persistent = set(model.state_dict(keep_vars=True))
    lost = [name for name, b in model.named_buffers() if b.is_meta and name not in persistent]
    if lost:
        more = f" ... ({len(lost)} in all)" if len(lost) > 4 else ""
        raise ValueError(f"{lost[:4]}{more} are buffers on the meta device that no checkpoint holds (computed when "
                         f"the model is built, as a rotary embedding's frequencies): the model was built under "
                         f"torch.device('meta'). Build it under tpf.meta_parameters() instead, which puts only the "
                         f"parameters on meta, then parallelize and tpf.load_safetensors")


def _match(model: nn.Module, modules: dict[str, nn.Module], plan: Mapping[str, object]) -> dict[str, tuple]:
    """module name -> (its pattern, its entry), checked: every pattern matches, each name once, linears for
    column and row entries."""
    chosen: dict[str, tuple[str, object]] = {}
    entries = {pattern: style_of(pattern, style) for pattern, style in plan.items()}  # every entry checked first
    for pattern, style in entries.items():
        names = [name for name in modules if name and fnmatch.fnmatchcase(name, pattern)]
        if not names:
            linears = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
            raise ValueError(f"plan pattern {pattern!r} matches no module of {type(model).__name__}; its nn.Linear "
                             f"modules are {linears}")
        for name in names:
            module = modules[name]
            if isinstance(style, (ColumnParallel, RowParallel)) and type(module) is not nn.Linear:
                raise ValueError(f"plan pattern {pattern!r} matches {name!r}, a {type(module).__name__}, not an "
                                 f"nn.Linear")
            if isinstance(style, VocabParallel) and type(module) is not nn.Linear and (
                    not isinstance(module, nn.Embedding) or isinstance(module, VocabParallelEmbedding)):
                raise ValueError(f"plan pattern {pattern!r} gives {name!r}, a {type(module).__name__}, a vocabulary "
                                 f"entry, which takes an nn.Embedding (an embedding) or an nn.Linear (a head)")
            if name in chosen:
                raise ValueError(f"{name!r} matches both plan patterns {chosen[name][0]!r} and {pattern!r}")
            chosen[name] = (pattern, style)
    return chosen


def _heads(modules: dict[str, nn.Module], chosen: dict, world: int) -> tuple[dict, dict[str, int]]:
    """Check every attention module whose projections are column layers against ``world`` ranks; where its
    key/value heads must be replicated, take its k / v projections out of ``chosen``. Returns each such
    projection's name with the columns each rank keeps (starts, ends), and each such attention module's name
    with its query heads per key/value head on a rank (its ``num_key_value_groups`` to be)."""
    kept: dict[str, tuple[list[int], list[int]]] = {}
    groups: dict[str, int] = {}
    for name, module in modules.items():
        counts = attention_heads(module)
        if counts is None or not isinstance(chosen.get(f"{name}.q_proj", (None, None))[1], ColumnParallel):
            continue
        if check(name, counts, world):
            continue
        heads, kv, head_dim = counts
        for proj in ("k_proj", "v_proj"):
            style = chosen.pop(f"{name}.{proj}", (None, None))[1]
            if not isinstance(style, ColumnParallel) or style.sequence_parallel or style.gather_output:
                raise ValueError(f"{name!r} has {kv} key/value heads for {world} ranks, so its {proj} stays whole "
                                 f"on every rank and each keeps its head, which needs a plain column entry (no "
                                 f"sequence parallelism, no gather_output): use {kv} ranks or fewer, or plan it "
                                 f"as tpf.ColumnParallel()")
            share = world // kv  # ranks per key/value head
            kept[f"{name}.{proj}"] = ([r // share * head_dim for r in range(world)],
                                      [(r // share + 1) * head_dim for r in range(world)])
        groups[name] = heads // world  # the rank's query heads share its one key/value head
    return kept, groups


def _tp_group(placement: Placement):
    """The tensor-parallel axis' process group, None on one rank or outside the placement."""
    if placement.hierarchy[-1] == 1 or placement.coordinate() is None:
        return None
    return placement.mesh.get_group(placement.ndim - 1)


def _on_tokens(module: nn.Module, dim: int, placement: Placement, gather: bool) -> None:
    """``module``'s first input (or ``hidden_states``) cut to this rank's chunk of ``dim`` (the entry of a
    sequence-parallel region: the backward all-gathers its gradient), or, with ``gather``, this rank's chunk
    all-gathered whole (the backward keeps this rank's chunk)."""
    world, group = placement.hierarchy[-1], _tp_group(placement)

    def cut(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args, kwargs = list(args), dict(kwargs)
        x = args[0] if args else kwargs["hidden_states"]
        if gather:  # contiguous: the module's own code may view it (an MoE block flattens its tokens)
            x = tag(comm.all_gather_chunk(x, dim, x.shape[dim] * world, group).contiguous(), WHOLE)
        elif x.shape[dim] % world:
            raise ValueError(f"sequence parallelism splits dim {dim} ({x.shape[dim]} tokens) over {world} ranks: pad "
                             f"the sequence to a multiple of {world}, or parallelize without sequence_parallel "
                             f"(generation)")
        else:
            x = tag(comm.chunk_all_gather(x, dim, group), SPLIT)
        if args:
            args[0] = x
        else:
            kwargs["hidden_states"] = x
        return tuple(args), kwargs

    module.register_forward_pre_hook(cut, with_kwargs=True)


def _output_to_tokens(module: nn.Module, dim: int, placement: Placement) -> None:
    """``module``'s output (or its first element), whole on every rank, cut to this rank's chunk of ``dim`` (the
    backward all-gathers its gradient)."""
    group = _tp_group(placement)

    def cut(mod: nn.Module, args: tuple, output: object) -> object:
        if isinstance(output, tuple):
            return (tag(comm.chunk_all_gather(output[0], dim, group), SPLIT), *output[1:])
        return tag(comm.chunk_all_gather(output, dim, group), SPLIT)

    module.register_forward_hook(cut)


def _fused_groups(modules: dict[str, nn.Module], chosen: dict) -> dict[str, list[str]]:
    """parent module name -> the names of its two or more fuse=True column layers (a lone one stays alone),
    checked to compute alike: one product has one input, one layout and one set of options."""
    siblings: dict[str, dict[int, str]] = {}
    for name, (_, style) in chosen.items():
        if isinstance(style, ColumnParallel) and style.fuse:
            siblings.setdefault(name.rpartition(".")[0], {}).setdefault(id(modules[name]), name)  # shared: once
    groups = {parent: list(names.values()) for parent, names in siblings.items() if len(names) > 1}
    seen: dict[int, str] = {}
    for parent, names in groups.items():
        first = names[0]
        for name in names:
            module, style = modules[name], chosen[name][1]
            if id(module) in seen:
                raise ValueError(f"{name!r} would be fused under both {seen[id(module)]!r} and {parent!r}: a module "
                                 f"shared by two parents fuses with neither; give it fuse=False")
            seen[id(module)] = parent
            ours = (module.in_features, module.bias is None, module.weight.dtype, style)
            theirs = (modules[first].in_features, modules[first].bias is None, modules[first].weight.dtype,
                      chosen[first][1])
            if style.gather_output or ours != theirs:
                raise ValueError(f"fuse=True joins the column layers under {parent!r} into one product, so they must "
                                 f"read the same input alike (same in_features, bias or none, dtype and options, no "
                                 f"gather_output): {name!r} differs from {first!r}; give one of them fuse=False")
    return groups


def _check_vocabularies(modules: dict[str, nn.Module], chosen: dict, world: int) -> None:
    """Every rank must hold some rows of a vocabulary-parallel embedding (checked before the model changes)."""
    for name, (pattern, style) in chosen.items():
        module = modules[name]
        if isinstance(style, VocabParallel) and isinstance(module, nn.Embedding):
            empty = ranks_without_rows(module.num_embeddings, world)
            if empty:
                raise ValueError(f"plan pattern {pattern!r}: {name!r} has {module.num_embeddings} rows, which leave "
                                 f"ranks {empty} of {world} none (torch.chunk's blocks): use fewer tensor-parallel "
                                 f"ranks, or leave it out of the plan")


def _split_dim(param: str, style: object) -> int | None:
    """The dim of a planned module's parameter ``param`` that its layer splits (None: whole)."""
    if isinstance(style, RowParallel):
        return 1 if param == "weight" else None
    return 0  # a column layer's weight [out, in] and bias, an embedding's [vocab, dim] rows


def _ties(model: nn.Module, modules: dict[str, nn.Module], chosen: dict) -> list[list[tuple[int, str]]]:
    """The parameters planned layers share (a tied embedding and head), as lists of (module id, parameter name)
    to be made one parameter again once built; checked first: a parameter shared with a module the plan leaves
    alone would come untied, and one its layers split differently cannot be one block."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for module_name, module in modules.items():
        for attr, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((module_name, attr))
    planned = {id(modules[name]): (name, entry) for name, entry in chosen.items()}  # a module under any of its names
    ties = []
    for shared in owners.values():
        keys = {(id(modules[m]), attr) for m, attr in shared}
        if len(keys) < 2 or not any(id(modules[m]) in planned for m, _ in shared):
            continue  # one module under several names, or no planned layer involved
        names = [f"{m}.{attr}" for m, attr in shared]
        left = [name for name, (m, _) in zip(names, shared) if id(modules[m]) not in planned]
        if left:
            first, (pattern, _) = next(planned[id(modules[m])] for m, _ in shared if id(modules[m]) in planned)
            raise ValueError(f"plan pattern {pattern!r}: the parameters of {first!r} are shared with {left}; "
                             f"parallelizing it alone would untie them: plan both (an embedding and its tied head: "
                             f"'vocab' for each), untie them first, or leave {first!r} out of the plan")
        dims = {name: _split_dim(attr, planned[id(modules[m])][1][1])
                for name, (m, attr) in zip(names, shared)}
        if len(set(dims.values())) > 1:
            raise ValueError(f"{names} are one tied parameter, but their plan entries split it differently "
                             f"({dims}: the dim each splits): give them entries that hold the same block (an "
                             f"embedding and its head: 'vocab' for each)")
        ties.append(sorted(keys))
    return ties
