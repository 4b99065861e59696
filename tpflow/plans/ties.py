"""Tied parameters (an embedding and its head holding one matrix) across planned layers: checked before the model
changes, made one parameter again once the layers are built.

A parameter a planned layer shares with a module the plan leaves alone would come untied, and one its layers split
differently cannot be one block: both are errors naming the fix. A parent holding its planned child's parameter
under a name of its own (BERT's prediction head keeps ``bias``, its decoder's) holds the child's new one.
"""

from __future__ import annotations

from tpflow.plans.style import Plan

__all__ = ["Ties"]


class Ties:
    """The parameters that the plan's layers share, found and checked from the matched plan (each entry's
    ``layout`` says which parameters its layer remakes, split along which dim).

    Args:
        plan: the matched plan, before any entry applies itself.

    Example::

        >>> from torch import nn
        >>> from tpflow.plans.matching import match
        >>> model = nn.ModuleDict({"embed": nn.Embedding(10, 4), "head": nn.Linear(4, 10, bias=False)})
        >>> model.head.weight = model.embed.weight                     # tied
        >>> plan = match(model, tpf.placement("cpu", ranks=[0, 1]), {"embed": "vocab", "head": "vocab"})
        >>> len(Ties(plan).tied)                                        # one parameter, two owners
        1
    """

    def __init__(self, plan: Plan) -> None:
        owners: dict[int, list[tuple[str, str]]] = {}
        for module_name, module in plan.modules.items():
            for attr, param in module.named_parameters(recurse=False):
                owners.setdefault(id(param), []).append((module_name, attr))
        layouts = {id(plan.modules[name]): (name, layout) for name, (_, entry) in plan.matches.items()
                   if (layout := entry.layout(plan.modules[name])) is not None}  # a module under any of its names
        self.tied: list[list[tuple[int, str]]] = []
        for shared in owners.values():
            keys = {(id(plan.modules[m]), attr) for m, attr in shared}
            if len(keys) < 2 or not any(id(plan.modules[m]) in layouts for m, _ in shared):
                continue  # one module under several names, or no remade layer involved
            names = [f"{m}.{attr}" for m, attr in shared]
            remade = [m for m, _ in shared if id(plan.modules[m]) in layouts]
            left = [name for name, (m, _) in zip(names, shared) if id(plan.modules[m]) not in layouts
                    and not any(r.startswith(m + ".") for r in remade)]  # (a parent's alias follows its layer's)
            if left:
                first = next(layouts[id(plan.modules[m])][0] for m, _ in shared if id(plan.modules[m]) in layouts)
                raise ValueError(f"plan pattern {plan.pattern(first)!r}: the parameters of {first!r} are shared with "
                                 f"{left}; parallelizing it alone would untie them: plan both (an embedding and its "
                                 f"tied head: 'vocab' for each), untie them first, or leave {first!r} out of the plan")
            dims = {name: layouts[id(plan.modules[m])][1].get(attr) for name, (m, attr) in zip(names, shared)
                    if id(plan.modules[m]) in layouts}
            if len(set(dims.values())) > 1:
                raise ValueError(f"{names} are one tied parameter, but their plan entries split it differently "
                                 f"({dims}: the dim each splits): give them entries that hold the same block (an "
                                 f"embedding and its head: 'vocab' for each)")
            self.tied.append(sorted(keys, key=lambda k: (k[0] not in layouts, k)))  # a remade layer's first

    def join(self, plan: Plan) -> None:
        """Make each tied parameter one again among the built layers (the first owner's block for every owner).

        Args:
            plan: the matched plan, every entry applied.
        """
        for owners in self.tied:
            first = getattr(plan.by_id(owners[0][0]), owners[0][1])
            for key, attr in owners[1:]:
                setattr(plan.by_id(key), attr, first)
