"""``tpf.Style``: a plan entry, which checks a matched module and applies itself to it (torch's ``ParallelStyle`` with
a check before any change).

``parallelize`` matches a plan's patterns to module names, calls every match's ``check`` (which raises, naming the
fix, before the model changes), then every match's ``apply`` (which swaps the module for a layer it returns, or
changes it in place), and makes whatever no entry split a global tensor broadcast over the placement. The built-in
entries (``ColumnParallel``, ``RowParallel``, ``VocabParallel``, ...) and a user's own subclasses go through the same
two steps; what the driver and the other entries read of an entry are the few properties below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from tpflow.placement import Placement

if TYPE_CHECKING:
    from tpflow.plans.matched import Plan

__all__ = ["Style"]


class Style:
    """A plan entry: what ``tpf.parallelize`` does to each module its pattern matches.

    Subclass it for an entry of your own: ``check`` raises if the matched module cannot take the entry (nothing has
    changed yet, on any rank), ``apply`` changes it: it returns a module to swap in under every name of the matched
    one, or None where it changed the module in place. Parameters that ``apply`` leaves plain become global tensors
    broadcast over the placement afterwards (their gradients summed over the tensor-parallel ranks where the module
    sees only this rank's part of the data), so an entry only does what differs. Entries are compared with ``==``
    (a module shared under two names takes one entry) and shown in errors with ``repr``: a frozen dataclass gives both.

    Example::

        >>> import tpflow as tpf
        >>> import torch.nn.functional as F
        >>> from torch import nn

from tpflow.placement import Placement
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
            plan: the plan matched against the model (``tpflow.plans.matched.Plan``): its placement, the other
                entries, the model.
        """

    def apply(self, name: str, module: nn.Module, plan: Plan) -> nn.Module | None:
        """Parallelize ``module``: return the module to put in its place, or None where it was changed in place.

        Args:
            name: the module's name in the model (its first, if it has several).
            module: the matched module, checked.
            plan: the plan matched against the model.

        Returns:
            A module swapped in under every name of ``module``, or None.
        """
        raise NotImplementedError(f"{type(self).__name__} must define apply(name, module, plan)")

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
