"""A plan matched against a model: the plan normalised (names such as ``"column"``, and torch's own styles such as
``ColwiseParallel()``, become tpflow entries), then every pattern matched to module names. Every pattern must match
a module, no module two patterns, and a module shared under two names takes one entry."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from torch import nn

from tpflow.placement import Placement
from tpflow.plans.names import style_of
from tpflow.plans.style import Plan, Style
from tpflow.plans.torch_styles import is_torch_style

__all__ = ["match"]


def match(model: nn.Module, placement: Placement, plan: Mapping[str, object]) -> Plan:
    """The plan ``parallelize`` applies to ``model``: each matched module with its pattern and entry, checked.

    Args:
        model: the model the plan is for.
        placement: the ranks, as the user gave them.
        plan: ``fnmatch`` patterns over module names mapped to entries (``tpf.Style``), their names (``"column"``,
            ``"row"``, ``"vocab"``) or torch's own styles.

    Returns:
        The matched plan (``tpflow.plans.style.Plan``).

    Example::

        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
        >>> plan = match(model, tpf.placement("cpu", ranks=[0, 1]), {"0": "column", "[2]": "row"})
        >>> plan.entry("2"), plan.pattern("2")
        (RowParallel(input_is_parallel=True, sequence_parallel=False, algo='auto', sequence_dim=0), '[2]')
    """
    if not isinstance(plan, Mapping):
        raise ValueError(f"plan must be a dict of module-name patterns to entries, got {plan!r} (plan='auto', a "
                         f"Hugging Face model's own, is read by tpf.parallelize)")
    modules = dict(model.named_modules(remove_duplicate=False))
    head = _output_head(model, modules)
    chosen: dict[str, tuple[str, Style]] = {}
    for pattern, value in plan.items():  # every entry's kind checked before any match
        if not is_torch_style(value):
            style_of(pattern, value)
    for pattern, value in plan.items():
        names = [name for name in modules if name and fnmatch.fnmatchcase(name, pattern)]
        if not names:
            linears = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
            raise ValueError(f"plan pattern {pattern!r} matches no module of {type(model).__name__}; its nn.Linear "
                             f"modules are {linears}")
        for name in names:
            if name in chosen:
                raise ValueError(f"{name!r} matches both plan patterns {chosen[name][0]!r} and {pattern!r}")
            chosen[name] = (pattern, style_of(pattern, value, modules[name], head=modules[name] is head))
    first: dict[int, tuple[str, Style]] = {}
    for name, (pattern, entry) in chosen.items():  # a shared module is one layer: its names must agree
        seen = first.setdefault(id(modules[name]), (pattern, entry))
        if seen[1] != entry:
            raise ValueError(f"{name!r} is the same module as one matched by {seen[0]!r}, but plan pattern "
                             f"{pattern!r} gives it another style")
    return Plan(model, placement, chosen)


def _output_head(model: nn.Module, modules: dict[str, nn.Module]) -> nn.Module | None:
    """The model's output head: a Hugging Face model's ``get_output_embeddings()``, else its last ``nn.Linear``
    (torchtitan's ``output``)."""
    found = getattr(model, "get_output_embeddings", lambda: None)()
    return found if found is not None else next((m for m in reversed(modules.values()) if isinstance(m, nn.Linear)),
                                                None)
