"""Fused column groups: the column layers of one parent module asked to run as one product (``fuse=True``: q / k / v,
gate / up), so that their shared input crosses the ranks once (``tpflow.layers.fused``).

Checked before the model changes: one product has one input, one layout and one set of options. Not made on a
named placement, whose weights FSDP2 owns (``tpflow.plans.fsdp``): each layer there computes on its own.
"""

from __future__ import annotations

from collections.abc import Mapping

from tpflow.layers import ColumnGroup
from tpflow.plans.style import Plan

__all__ = ["fused_groups", "join_group"]


def fused_groups(plan: Plan, fusing: Mapping[str, bool]) -> dict[str, list[str]]:
    """Parent module name -> the names of its two or more layers asked to fuse (a lone one stays alone), checked.

    Args:
        plan: the matched plan.
        fusing: the names of the layers asked to fuse, each with whether it can join a product (a layer that gathers
            its output cannot).

    Returns:
        The groups; none on a placement whose data axes are FSDP2's.

    Example::

        >>> from torch import nn
        >>> from tpflow.plans.matching import match
        >>> attn = nn.Module()
        >>> attn.q_proj, attn.k_proj = nn.Linear(8, 8), nn.Linear(8, 4)
        >>> plan = match(nn.ModuleDict({"attn": attn}), tpf.placement("cpu", ranks=[0, 1]),
        ...             {"attn.[qk]_proj": tpf.ColumnParallel(fuse=True)})
        >>> fused_groups(plan, {"attn.q_proj": True, "attn.k_proj": True})
        {'attn': ['attn.q_proj', 'attn.k_proj']}
    """
    siblings: dict[str, dict[int, str]] = {}
    for name in fusing:
        siblings.setdefault(name.rpartition(".")[0], {}).setdefault(id(plan.modules[name]), name)  # shared: once
    groups = {parent: list(names.values()) for parent, names in siblings.items() if len(names) > 1}
    seen: dict[int, str] = {}
    for parent, names in groups.items():
        first = plan.modules[names[0]]
        for name in names:
            module = plan.modules[name]
            if id(module) in seen:
                raise ValueError(f"{name!r} would be fused under both {seen[id(module)]!r} and {parent!r}: a module "
                                 f"shared by two parents fuses with neither; give it fuse=False")
            seen[id(module)] = parent
            ours = (module.in_features, module.bias is None, module.weight.dtype, plan.entry(name).options())
            theirs = (first.in_features, first.bias is None, first.weight.dtype, plan.entry(names[0]).options())
            if not fusing[name] or ours != theirs:
                raise ValueError(f"fuse=True joins the column layers under {parent!r} into one product, so they must "
                                 f"read the same input alike (same in_features, bias or none, dtype and options, no "
                                 f"gather_output): {name!r} differs from {names[0]!r}; give one of them fuse=False")
    return {} if plan.named.leaves_data_axes else groups  # checked alike: FSDP2 owns the weights there


def join_group(plan: Plan, parent: str, names: list[str]) -> None:
    """Once every entry has applied itself, join the layers ``names`` under ``parent`` into one ``ColumnGroup``.

    Args:
        plan: the matched plan.
        parent: the parent module's name.
        names: its layers' names, a group of ``fused_groups``.

    Example::

        >>> from torch import nn
        >>> model = nn.ModuleDict({"attn": nn.Module()})
        >>> model.attn.q_proj, model.attn.k_proj = nn.Linear(8, 8), nn.Linear(8, 4)
        >>> model = tpf.parallelize(model, placement=tpf.placement("cpu", ranks=[0, 1]),
        ...                         plan={"attn.[qk]_proj": tpf.ColumnParallel(fuse=True)})   # calls join_group
        >>> model.attn.q_proj.fused_group is model.attn.k_proj.fused_group
        True
    """
    plan.at_end(("fuse", parent), lambda: ColumnGroup([plan.layer(n) for n in names],
                                                      plan.model.get_submodule(parent)))
