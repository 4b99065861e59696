"""``tpf.Style``: a plan style, which checks a matched module and applies itself to it (torch's ``ParallelStyle`` with
a check before any change); ``Plan``: the plan matched against a model, which every entry's steps read.

``parallelize`` matches a plan's patterns to module names, calls every match's ``check`` (which raises, naming the
fix, before the model changes), then every match's ``apply`` (which swaps the module for a layer it returns, or
changes it in place), and makes whatever no entry split a global tensor broadcast over the placement. The built-in
entries (``ColumnParallel``, ``RowParallel``, ``VocabParallel``, ...) and a user's own subclasses go through the same
two steps; what the driver and the other entries read of an entry are the few properties below.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator

from torch import nn

from tpflow.placement import Placement

__all__ = ["Plan", "Stacked", "Style"]


class Style(ABC):
    """A plan style: what ``tpf.parallelize`` does to each module its pattern matches.

    Subclass it for a style of your own: ``check`` raises if the matched module cannot take the entry (nothing has
    changed yet, on any rank), ``apply`` (abstract: an entry without one cannot be made) changes it: it returns a
    module to swap in under every name of the matched one, or None where it changed the module in place. Parameters
    that ``apply`` leaves plain become global tensors broadcast over the placement afterwards (their gradients
    summed over the tensor-parallel ranks where the module sees only this rank's part of the data), so an entry only
    does what differs. Entries are compared with ``==`` (a module shared under two names takes one entry) and shown
    in errors with ``repr``: a frozen dataclass gives both.

    Example::

        >>> import tpflow as tpf
        >>> import torch.nn.functional as F
        >>> from torch import nn
        >>> class Halved(nn.Linear):                      # whole on every rank, half its weight's gradient
        ...     def forward(self, x):
        ...         w = self.weight * 0.5 + (self.weight * 0.5).detach()
        ...         return F.linear(x, w, self.bias)
        >>> class HalfGradient(tpf.Style):
        ...     def check(self, name, module, plan):
        ...         if type(module) is not nn.Linear:
        ...             raise ValueError(f"{name!r} is a {type(module).__name__}; HalfGradient takes an nn.Linear")
        ...     def apply(self, name, module, plan):
        ...         layer = Halved(module.in_features, module.out_features, bias=module.bias is not None)
        ...         layer.load_state_dict(module.state_dict())
        ...         return layer                          # swapped in; its weight then made global by parallelize
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)
        >>> model = tpf.parallelize(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 16), nn.Linear(16, 8)), placement=P,
        ...                         plan={"0": HalfGradient(), "1": "column", "2": "row"})
        >>> type(model[0]).__name__, tpf.get_sbp(model[0].weight), tpf.get_sbp(model[1].weight)
        ('Halved', (sbp.broadcast,), (sbp.split(dim=0),))
    """

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        """Raise if this entry cannot apply to ``module``, naming the fix; change nothing (the default accepts any
        module).

        Args:
            name: the module's name in the model (its first, if it has several).
            module: the matched module.
            plan: the plan matched against the model (``Plan``): its placement, the other
                entries, the model.
        """
        return None  # any module

    @abstractmethod
    def apply(self, name: str, module: nn.Module, plan: Plan) -> nn.Module | None:
        """Parallelize ``module``: return the module to put in its place, or None where it was changed in place.

        Args:
            name: the module's name in the model (its first, if it has several).
            module: the matched module, checked.
            plan: the plan matched against the model.

        Returns:
            A module swapped in under every name of ``module``, or None.
        """

    def arrange(self, placement: Placement) -> Placement:
        """The placement every entry of the plan works on when this entry is in it (default: ``placement`` itself;
        context parallelism's makes a 1-D placement ``(context, tensor)``).

        Args:
            placement: the placement as given, or as an entry before this one arranged it.

        Returns:
            The placement to work on.
        """
        return placement

    def layout(self, module: nn.Module) -> dict[str, int | None] | None:
        """How the layer this entry makes of ``module`` holds ``module``'s own parameters: each name with the dim it
        splits (None: whole), or None where the entry keeps ``module``'s parameters as they are (the default). Tied
        parameters are kept tied by it.

        Args:
            module: the matched module.

        Returns:
            The layout, or None.
        """
        return None

    def reads_whole(self, module: nn.Module) -> bool:
        """Whether the layer this entry makes of ``module`` reads the same whole input on every tensor-parallel
        rank; the first such layer of the model checks that the ranks are fed the same data (default False).

        Args:
            module: the matched module.

        Returns:
            True or False.
        """
        return False

    @property
    def splits_sequence(self) -> bool:
        """Whether this entry splits the activations over the ranks by tokens (sequence parallelism), which context
        parallelism, splitting the sequence through every layer already, refuses beside it (default False)."""
        return False

    @property
    def one_batch(self) -> bool:
        """Whether every rank of the placement must read the same batch, its axes all model axes (context
        parallelism's), so that trainers shard no data over them (default False)."""
        return False

    @property
    def splits_features(self) -> bool:
        """Whether the layer this entry makes returns this rank's block of its output features (a column layer not
        gathered), so that code reading its output sees this rank's share, by heads for an attention's projections
        (default False)."""
        return False

    def keeps_whole(self, name: str, plan: Plan) -> bool:
        """Whether this entry leaves the module ``name`` whole on every rank (each rank computing its own part of
        its output), where its kind would otherwise split it (default False); what fuses layers or adapts them reads
        it.

        Args:
            name: a module this entry matched.
            plan: the matched plan.

        Returns:
            True or False.
        """
        return False

    @property
    def styles(self) -> tuple[Style, ...]:
        """The entries this one stands for: itself (``Stacked``: the entries it stacks)."""
        return (self,)


class Plan:
    """The plan ``parallelize`` applies to ``model``: each matched module with its pattern and entry.

    Args:
        model: the model the plan is for.
        placement: the ranks, as the user gave them.
        matches: each matched module's name with its pattern and entry (``tpflow.plans.matching.match`` finds them).

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
        batches: the placement trainers shard data by (``tpf.adopt``).

    Example::

        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
        >>> plan = Plan(model, tpf.placement("cpu", ranks=[0, 1]), {"0": ("0", tpf.ColumnParallel())})
        >>> plan.matches["0"], plan.world
        (('0', ColumnParallel(gather_output=False, sequence_parallel=False, algo='auto', keep_gathered=True, \
sequence_dim=0, fuse=False)), 2)
    """

    def __init__(self, model: nn.Module, placement: Placement, matches: dict[str, tuple[str, Style]]) -> None:
        self.model, self.given, self.matches = model, placement, matches
        self.modules = dict(model.named_modules(remove_duplicate=False))
        arranged = placement
        for entry in self.distinct():
            arranged = entry.arrange(arranged)
        self.named, self.placement = arranged, arranged.tensor_slice
        self.grads: dict[str, str] = {}
        self.layers: dict[int, nn.Module] = {}
        self._finally: dict[Hashable, Callable[[], None]] = {}
        self._shared: dict[Hashable, object] = {}

    @property
    def batches(self) -> Placement:
        """The placement ``tpf.adopt`` shards data by (its axes but the last are data axes): ``named``, or where an
        entry keeps one batch on every rank (context parallelism), its ranks as one row."""
        if any(entry.one_batch for entry in self.distinct()):
            return Placement(self.named.type, self.named.flat_ranks)
        return self.named

    @property
    def world(self) -> int:
        """The tensor-parallel degree: the last axis of ``placement``."""
        return self.placement.hierarchy[-1]

    def entry(self, name: str) -> Style | None:
        """The entry the module ``name`` matched, or None."""
        return self.matches.get(name, (None, None))[1]

    def styles_of(self, name: str) -> tuple[Style, ...]:
        """The entries the module ``name`` matched (a ``Stacked`` one's each), or none."""
        entry = self.entry(name)
        return () if entry is None else entry.styles

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

    def replicate_as(self, name: str, grads: str) -> None:
        """How the parameters module ``name`` keeps whole (made global by ``parallelize`` after every entry) find
        their gradients (``"partial"``, ``"whole"``, ``"auto"``: ``tpflow.layers.replicated``), under every name the
        module has."""
        module = self.modules[name]
        for alias in (n for n, m in self.modules.items() if m is module):
            self.grads[alias] = grads

    def by_id(self, key: int) -> nn.Module:
        """What the module of ``id`` ``key`` is now: its replacement, or itself."""
        if key in self.layers:
            return self.layers[key]
        return next(m for m in self.modules.values() if id(m) == key)

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

    def distinct(self) -> list[Style]:
        """The plan's entries once each (equal ones once), a ``Stacked`` one as the entries it stacks."""
        distinct: list[Style] = []
        for _, entry in self.matches.values():
            for part in entry.styles:
                if not any(part is seen or part == seen for seen in distinct):
                    distinct.append(part)
        return distinct


@dataclasses.dataclass(frozen=True)
class Stacked(Style):
    """Several entries on one module, checked and applied in their order: an attention given its rank's heads
    (``tpf.SplitHeads``) and its tokens gathered on entry (``tpf.GatherSequence``) or its sequence split
    (``tpf.ContextParallel``). A module swapped in by one is what the next applies to.

    Args:
        entries: the entries, in order (at least two).

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 8))
        >>> both = tpf.Stacked((tpf.Replicated(why="kept whole"), tpf.GatherSequence()))
        >>> [type(e).__name__ for e in both.styles]
        ['Replicated', 'GatherSequence']
    """

    entries: tuple[Style, ...]

    def __post_init__(self) -> None:
        if len(self.entries) < 2:
            raise ValueError(f"Stacked takes two or more entries (tpf.Style), got {self.entries!r}")

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        for entry in self.entries:
            entry.check(name, module, plan)

    def apply(self, name: str, module: nn.Module, plan: Plan) -> nn.Module | None:
        swapped = None
        for entry in self.entries:
            layer = entry.apply(name, module if swapped is None else swapped, plan)
            swapped = layer if layer is not None else swapped
        return swapped

    def arrange(self, placement: Placement) -> Placement:
        for entry in self.entries:
            placement = entry.arrange(placement)
        return placement

    def layout(self, module: nn.Module) -> dict[str, int | None] | None:
        return next((found for e in self.entries if (found := e.layout(module)) is not None), None)

    def reads_whole(self, module: nn.Module) -> bool:
        return any(e.reads_whole(module) for e in self.entries)

    def keeps_whole(self, name: str, plan: Plan) -> bool:
        return any(e.keeps_whole(name, plan) for e in self.entries)

    @property
    def splits_sequence(self) -> bool:
        return any(e.splits_sequence for e in self.entries)

    @property
    def one_batch(self) -> bool:
        return any(e.one_batch for e in self.entries)

    @property
    def splits_features(self) -> bool:
        return any(e.splits_features for e in self.entries)

    @property
    def styles(self) -> tuple[Style, ...]:
        return tuple(p for e in self.entries for p in e.styles)
