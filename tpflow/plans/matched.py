"""A plan matched against one model: what every entry's ``check`` and ``apply`` read (the placement, the other
entries, the model), and what they leave for after the last ``apply`` (fused groups, the context's hooks).

Matching normalises the plan first: ``"auto"`` is the model's own (``tpf.hf_plan``), names (``"column"``, Hugging
Face's ``"colwise"``) and torch's own styles (``ColwiseParallel()``) become tpflow entries. Every pattern must match
a module, no module two patterns, and a module shared under two names takes one entry.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Hashable, Iterator, Mapping

from torch import nn

from tpflow.placement import Placement
from tpflow.plans.fsdp import tensor_slice
from tpflow.plans.hf import hf_plan
from tpflow.plans.names import style_of
from tpflow.plans.style import Style
from tpflow.plans.torch_styles import is_torch_style

__all__ = ["Plan"]


class Plan:
    """The plan ``parallelize`` applies to ``model``: each matched module with its pattern and entry.

    Args:
        model: the model the plan is for.
        placement: the ranks, as the user gave them.
        plan: ``"auto"``, or ``fnmatch`` patterns over module names mapped to entries (``tpf.Style``), their names
            (``"column"``, ``"colwise"``, ...) or torch's own styles.

    Attributes:
        model: the model.
        modules: every module by name (a module shared under two names under both).
        matches: each matched module's name with ``(pattern, entry)``.
        given: the placement as given (a context-parallel model's ``.logits`` are global over it).
        named: the placement the entries arranged (context parallelism makes a 1-D one ``(context, tensor)``):
            on a named placement its data axes are FSDP2's.
        placement: where the layers live: ``named``'s tensor-parallel slice on a named placement, else ``named``;
            its last axis is tensor parallel.
        grads: per module name, how the gradients of parameters it keeps whole are found (``"partial"``,
            ``"whole"``, ``"auto"``: ``tpflow.layers.replicated``).
        layers: each swapped module's replacement, by ``id`` of the module it replaced.

    Example::

        >>> from torch import nn
        >>> from tpflow.plans.matched import Plan
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
        >>> plan = Plan(model, tpf.placement("cpu", ranks=[0, 1]), {"0": "column", "2": "row"})
        >>> plan.matches["0"], plan.world
        (('0', ColumnParallel(gather_output=False, sequence_parallel=False, algo='auto', keep_gathered=True, \
sequence_dim=0, fuse=False)), 2)
    """

    def __init__(self, model: nn.Module, placement: Placement, plan: Mapping[str, object] | str) -> None:
        if isinstance(plan, str):
            if plan != "auto":
                raise ValueError(f"plan must be 'auto' or a dict of module-name patterns to entries, got {plan!r}")
            plan = hf_plan(model)
        self.model, self.given = model, placement
        self.modules = dict(model.named_modules(remove_duplicate=False))
        self.matches = self._match(plan)
        arranged = placement
        for entry in self._distinct():
            arranged = entry.arrange(arranged)
        self.named, self.placement = arranged, tensor_slice(arranged)
        self.grads: dict[str, str] = {}
        self.layers: dict[int, nn.Module] = {}
        self._finally: dict[Hashable, Callable[[], None]] = {}
        self._shared: dict[Hashable, object] = {}

    @property
    def world(self) -> int:
        """The tensor-parallel degree: the last axis of ``placement``."""
        return self.placement.hierarchy[-1]

    def entry(self, name: str) -> Style | None:
        """The entry the module ``name`` matched, or None."""
        return self.matches.get(name, (None, None))[1]

    def pattern(self, name: str) -> str:
        """The plan pattern the module ``name`` matched."""
        return self.matches[name][0]

    def each(self) -> Iterator[tuple[str, nn.Module, Style]]:
        """Every matched module once (a shared one under its first name), with its name and entry."""
        seen: set[int] = set()
        for name, (_, entry) in self.matches.items():
            module = self.modules[name]
            if id(module) not in seen:
                seen.add(id(module))
                yield name, module, entry

    def swap(self, module: nn.Module, layer: nn.Module) -> None:
        """Put ``layer`` in ``module``'s place under every name it has in the model."""
        self.layers[id(module)] = layer
        for alias in (n for n, m in self.modules.items() if m is module):
            parent, _, child = alias.rpartition(".")
            setattr(self.model.get_submodule(parent), child, layer)

    def layer(self, name: str) -> nn.Module:
        """What the module named ``name`` is now: its replacement, or itself."""
        module = self.modules[name]
        return self.layers.get(id(module), module)

    def shared(self, key: Hashable, compute: Callable[[], object]) -> object:
        """What several entries read alike (the fused groups), computed by the first that asks."""
        if key not in self._shared:
            self._shared[key] = compute()
        return self._shared[key]

    def at_end(self, key: Hashable, step: Callable[[], None]) -> None:
        """Run ``step`` once (the first given under ``key``) after every entry has applied itself: what joins
        several entries' layers (a fused group) or needs the model whole (the context's hooks)."""
        self._finally.setdefault(key, step)

    def finish(self) -> None:
        """Run the steps ``at_end`` collected, in the order they came."""
        for step in self._finally.values():
            step()

    def first_whole_reader(self) -> str | None:
        """The name of the model's first planned module whose layer reads the same whole input on every tensor-parallel
        rank (where the ranks' data is checked alike), or None."""
        return next((name for name, module in self.modules.items()
                     if name in self.matches and self.entry(name).reads_whole(module)), None)

    def _distinct(self) -> list[Style]:
        distinct: list[Style] = []
        for _, entry in self.matches.values():
            if not any(entry is seen or entry == seen for seen in distinct):
                distinct.append(entry)
        return distinct

    def _match(self, plan: Mapping[str, object]) -> dict[str, tuple[str, Style]]:
        """module name -> (its pattern, its entry), checked: every pattern matches, each name once, and a module under
        two names takes one entry."""
        chosen: dict[str, tuple[str, Style]] = {}
        for pattern, value in plan.items():  # every entry's kind checked before any match
            if not is_torch_style(value):
                style_of(pattern, value)
        for pattern, value in plan.items():
            names = [name for name in self.modules if name and fnmatch.fnmatchcase(name, pattern)]
            if not names:
                linears = [n for n, m in self.modules.items() if isinstance(m, nn.Linear)]
                raise ValueError(f"plan pattern {pattern!r} matches no module of {type(self.model).__name__}; its "
                                 f"nn.Linear modules are {linears}")
            for name in names:
                if name in chosen:
                    raise ValueError(f"{name!r} matches both plan patterns {chosen[name][0]!r} and {pattern!r}")
                chosen[name] = (pattern, style_of(pattern, value, self.modules[name]))
        first: dict[int, tuple[str, Style]] = {}
        for name, (pattern, entry) in chosen.items():  # a shared module is one layer: its names must agree
            seen = first.setdefault(id(self.modules[name]), (pattern, entry))
            if seen[1] != entry:
                raise ValueError(f"{name!r} is the same module as one matched by {seen[0]!r}, but plan pattern "
                                 f"{pattern!r} gives it another style")
        return chosen
