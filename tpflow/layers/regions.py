"""Which activations are split over the tensor-parallel ranks, read off the autograd graph.

A replicated parameter (a norm's weight) gets one device's gradient on every rank only if the
module computes on the whole activation. Where it sees only this rank's part (Qwen3's per-head
``q_norm`` between a column and a row layer, a norm on this rank's tokens in a sequence-parallel
region) its gradient is a partial sum that must be added over the ranks. Parallel layers tag the
autograd node of each output they return, "split" or "whole"; ``is_split`` walks back from a
tensor through the graph, stopping at tags, and says whether a "split" tag is behind it. The other
way round, a layer that reads split data (a row layer, a sequence-parallel column layer) tells the
replicated modules behind its input (``mark``, ``reads_split``): a norm before a hand-split input.
The walks run once per module, on its first call with gradients, not per step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["SPLIT", "WHOLE", "is_split", "mark", "reads_split", "tag"]

SPLIT, WHOLE = "split", "whole"
_KEY, _OWNERS = "tpflow.region", "tpflow.owners"


def tag(t: torch.Tensor, region: str) -> torch.Tensor:
    """Mark the autograd node that made ``t`` as the edge of a ``"split"`` or ``"whole"`` region.

    Args:
        t: an activation a parallel layer returns (no-op without a graph: no gradient to get wrong).
        region: ``SPLIT`` (ranks hold different parts) or ``WHOLE`` (every rank holds the same value).

    Returns:
        ``t`` itself.

    Example::

        >>> w = torch.randn(4, 3, requires_grad=True)
        >>> y = tag(w * 2, SPLIT)                                   # as a column layer tags its output
        >>> is_split([y.relu()]), is_split([tag(y.sum(0), WHOLE) + 1])
        (True, False)
    """
    if not torch.compiler.is_compiling() and t.grad_fn is not None:  # traced code has no autograd nodes to tag
        t.grad_fn.metadata[_KEY] = region
    return t


def mark(t: object, owner: object) -> None:
    """Record ``owner`` (a replicated module's state, with a ``saw_split()`` method) on the autograd node that
    made ``t`` (or each tensor of a tuple), so that a layer reading split data downstream can tell it.

    Args:
        t: a module's output.
        owner: what ``saw_split()`` is called on.

    Example::

        >>> class Replica:                      # a replicated module's state
        ...     def saw_split(self):
        ...         print("told")
        >>> x = torch.randn(2, 3, requires_grad=True)
        >>> norm_output = x * 2
        >>> mark(norm_output, Replica())
        >>> reads_split(norm_output + 1)        # a layer downstream reads split data
        told
    """
    for x in t if isinstance(t, (tuple, list)) else (t,):
        if isinstance(x, torch.Tensor) and x.grad_fn is not None:
            x.grad_fn.metadata.setdefault(_OWNERS, []).append(owner)


def _walk(tensors: Iterable[object]) -> tuple[bool, list[object]]:
    """Back from ``tensors`` to the nearest region tags: whether a "split" one is there, and the owners marked on
    the nodes passed."""
    todo = [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set[int] = set()
    split, owners = False, []
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        owners.extend(node.metadata.get(_OWNERS, ()))
        region = node.metadata.get(_KEY)
        split = split or region == SPLIT
        if region is None:
            todo.extend(next_node for next_node, _ in node.next_functions)
    return split, owners


def is_split(tensors: Iterable[object]) -> bool:
    """Whether any of ``tensors`` derives from a ``"split"``-tagged activation with no ``"whole"`` tag between.

    Args:
        tensors: a module's inputs (non-tensors are skipped).

    Returns:
        True if the values differ over the tensor-parallel ranks, so that a replicated parameter applied to
        them gets a partial-sum gradient.

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> q_proj = tpf.ColumnParallelLinear(8, 8, placement=P)   # returns this rank's columns
        >>> x = torch.randn(2, 8, requires_grad=True)
        >>> is_split([q_proj(x)]), is_split([x * 2])
        (True, False)
    """
    return _walk(tensors)[0]


def reads_split(x: torch.Tensor) -> None:
    """A layer takes ``x`` as split data (this rank's tokens or features): every replicated module behind it, up to
    the nearest region tag, computed on split data too (a norm before a hand-split sequence-parallel input), and
    is told so (``saw_split()``).

    Args:
        x: the layer's input.

    Example::

        >>> class Replica:                      # a replicated norm's state
        ...     def saw_split(self):
        ...         print("told")
        >>> x = torch.randn(2, 3, requires_grad=True)
        >>> normed = x * 2
        >>> mark(normed, Replica())             # the norm marks its output
        >>> reads_split(normed[:, :2])          # a layer takes this rank's part of it
        told
        >>> reads_split(x + 1)                  # nothing marked behind it
    """
    for owner in _walk([x])[1]:
        owner.saw_split()
