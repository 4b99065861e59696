"""``parallelize(model, placement=, plan=)``: swap a model's ``nn.Linear`` layers for parallel ones, in place.

    plan = {"*.fc1": "column", "*.fc2": "row"}                       # fnmatch patterns of module names
    plan = {"*.q_proj": "column", "*.o_proj": tpf.RowParallel(sequence_parallel=True)}
    plan = {"*.[qkv]_proj": tpf.ColumnParallel(fuse=True), "*.o_proj": "row"}   # q, k, v as one product

Each matched ``nn.Linear`` is replaced by a layer holding its values (each rank keeps its block),
so a model built and loaded on one device, the same on every rank, becomes a tensor-parallel one.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from torch import nn

from tpflow.layers import ColumnGroup
from tpflow.placement import Placement
from tpflow.plans.styles import ColumnParallel, RowParallel, style_of

__all__ = ["parallelize"]


def parallelize(model: nn.Module, *, placement: Placement, plan: Mapping[str, object]) -> nn.Module:
    """Replace the ``nn.Linear`` modules whose names match ``plan``'s patterns; returns ``model``.

    Patterns are ``fnmatch`` patterns over ``named_modules()`` names (``*`` crosses dots, so
    ``"*.fc1"`` matches ``"blocks.0.mlp.fc1"``). Every pattern must match at least one module,
    each match must be an ``nn.Linear``, and no module may match two patterns: anything else is
    an error naming the pattern, raised before the model is changed.

    Each matched ``nn.Linear`` is replaced by a layer holding its values (each rank keeps its block), so a
    model built and loaded on one device, the same on every rank, becomes a tensor-parallel one. A module
    shared under two names becomes one layer under both, if their entries agree. A parameter a planned
    layer shares with another module (a tied embedding) would come untied, which is an error too. The
    ``ColumnParallel(fuse=True)`` layers of one parent module become one fused group (``ColumnGroup``).

    Args:
        model: the model to change, in place.
        placement: the ranks its parallel layers live on (``tpf.placement``); on a 2-D placement the last
            axis is tensor parallel and the others data parallel.
        plan: ``fnmatch`` patterns over module names, each mapped to its entry: ``"column"`` (W split(1)),
            ``"row"`` (W split(0)), or ``tpf.ColumnParallel(...)`` / ``tpf.RowParallel(...)`` with options.

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
    modules = dict(model.named_modules(remove_duplicate=False))  # a module shared under two names has both
    chosen: dict[str, tuple[str, ColumnParallel | RowParallel]] = {}
    for pattern, style in plan.items():
        style = style_of(pattern, style)
        names = [name for name in modules if name and fnmatch.fnmatchcase(name, pattern)]
        if not names:
            linears = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
            raise ValueError(f"plan pattern {pattern!r} matches no module of {type(model).__name__}; its nn.Linear "
                             f"modules are {linears}")
        for name in names:
            module = modules[name]
            if type(module) is not nn.Linear:
                raise ValueError(f"plan pattern {pattern!r} matches {name!r}, a {type(module).__name__}, not an "
                                 f"nn.Linear")
            if name in chosen:
                raise ValueError(f"{name!r} matches both plan patterns {chosen[name][0]!r} and {pattern!r}")
            chosen[name] = (pattern, style)
    _check_ties(model, modules, chosen)
    fused = _fused_groups(modules, chosen)
    built: dict[int, nn.Module] = {}
    styles: dict[int, tuple[str, object]] = {}
    for name, (pattern, style) in chosen.items():  # a shared module is one layer: its names must agree
        first = styles.setdefault(id(modules[name]), (pattern, style))
        if first[1] != style:
            raise ValueError(f"{name!r} is the same module as one matched by {first[0]!r}, but plan pattern "
                             f"{pattern!r} gives it another style")
    for name, (_, style) in chosen.items():
        module = modules[name]
        if id(module) not in built:
            layer = built[id(module)] = style.build(module, placement)
            layer.label = f"{type(layer).__name__} {name!r}"
        for alias in (n for n, m in modules.items() if m is module):  # every name of a shared module
            parent_name, _, child = alias.rpartition(".")
            setattr(model.get_submodule(parent_name), child, built[id(module)])
    for parent, names in fused.items():
        ColumnGroup([built[id(modules[name])] for name in names], model.get_submodule(parent))
    return model


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


def _check_ties(model: nn.Module, modules: dict[str, nn.Module], chosen: dict) -> None:
    """A parameter of a replaced layer that another module also holds (a tied embedding) would come untied."""
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name)
    for name, (pattern, _) in chosen.items():
        aliases = {n for n, m in modules.items() if m is modules[name]}
        for param in modules[name].parameters():
            others = [n for n in owners[id(param)] if n.rpartition(".")[0] not in aliases]
            if others:
                raise ValueError(f"plan pattern {pattern!r}: the parameters of {name!r} are shared with {others}; "
                                 f"parallelizing it would untie them: untie them first, or leave {name!r} out of the "
                                 f"plan")
