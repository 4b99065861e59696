"""Every rank of a placement parallelizes the same model by the same plan, or every one of them stops before the
model changes: a rank with another plan (``fuse=False``, no vocabulary split) would hang in a collective or, worse,
train on with other gradients. And a model built so that no checkpoint can fill it is refused before it changes."""

from __future__ import annotations

import hashlib

from torch import nn

from tpflow import comm
from tpflow.plans.style import Plan

__all__ = ["agree", "check_buffers"]


def agree(plan: Plan) -> None:
    """Compare the placement, the model's parameters' names, shapes and dtypes, and every matched entry over the ranks
    of ``plan``'s placement; the same error on every rank where they differ.

    Args:
        plan: the matched plan.

    Example::

        >>> from torch import nn
        >>> from tpflow.plans.matching import match
        >>> model = nn.Sequential(nn.Linear(4, 8))
        >>> agree(match(model, tpf.placement("cpu", ranks=[0, 1]), {"0": "column"}))   # the same on both: passes
    """
    placement = plan.named
    if placement.coordinate() is None:
        return
    shapes = [(name, tuple(p.shape), str(p.dtype)) for name, p in plan.model.named_parameters()]
    facts = {"the placement": repr(placement),
             "the model's dtypes": ", ".join(sorted({dtype for *_, dtype in shapes})),  # named before the digest
             "the model": f"{type(plan.model).__name__} of {len(shapes)} parameters "
                          f"(digest {hashlib.sha1(repr(shapes).encode()).hexdigest()[:12]})"}
    facts.update({f"the plan entry of {name!r}": f"{pattern!r}: {_described(entry)}"
                  for name, (pattern, entry) in plan.matches.items()})
    groups = [placement.mesh.get_group(axis) for axis in range(placement.ndim)] if len(placement.flat_ranks) > 1 else []
    comm.agree("parallelize", facts, groups, "call parallelize with the same model, placement and plan on every rank")


def _described(entry: object) -> str:
    """The entry as every rank shows it alike: its ``repr``, or, where that is ``object``'s (an address, which differs
    by rank), its class and fields."""
    if type(entry).__repr__ is object.__repr__:
        return f"{type(entry).__module__}.{type(entry).__qualname__}{vars(entry)!r}"
    return repr(entry)


def check_buffers(model: nn.Module) -> None:
    """Refuse a model whose computed buffers were never computed (built under ``torch.device("meta")``): no checkpoint
    holds them, so the forward would fail deep in the model's code.

    Args:
        model: the model about to be parallelized.

    Example::

        >>> from torch import nn
        >>> check_buffers(nn.Linear(2, 2))                   # nothing computed is missing
    """
    persistent = set(model.state_dict(keep_vars=True))
    lost = [name for name, b in model.named_buffers() if b.is_meta and name not in persistent]
    if lost:
        more = f" ... ({len(lost)} in all)" if len(lost) > 4 else ""
        raise ValueError(f"{lost[:4]}{more} are buffers on the meta device that no checkpoint holds (computed when "
                         f"the model is built, as a rotary embedding's frequencies): the model was built under "
                         f"torch.device('meta'). Build it under tpf.meta_parameters() instead, which puts only the "
                         f"parameters on meta, then parallelize and tpf.load_safetensors")
