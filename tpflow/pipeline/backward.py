"""A stage's backward in two parts, for zero-bubble schedules: the input's gradient (``B``), which the stage
before waits for, and the weights' (``W``), which nobody waits for, run later in what would be idle time.

``input_grad`` runs autograd towards the stage's input alone (``backward(inputs=[x])``). A node that feeds both
the input's gradient and a weight's (a linear's product) then computes only its input side: torch's own nodes
skip an output the engine does not need, and so do tpflow's kernels (``tpflow.kernels.linear``). Before it
runs, the graph is read once: the nodes on the input's path that also feed a branch reaching only weights
(each layer's product, a norm's multiply) keep the gradient flowing into them, by a hook. ``WeightGrad.run``
runs autograd again from those nodes, with the kept gradients, towards the weights: each computes its weight
side now, and nothing on the input's path runs twice.

The nodes are grouped by the parameters their branches reach, one backward call per group, so that no call
walks into another group's nodes (which would recompute their input side): a layer whose parameters are read
through one node (``LocalBlocks``) is one group. A parameter applied at two points of the path (a shared
layer) makes one group of both, whose call recomputes the input side between them; the kept gradients are
put back on each node, so nothing counts twice. A stage whose input needs no gradient (the first) has no
input side: its whole backward runs as ``B`` and ``W`` has nothing left.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightGrad", "input_grad"]


def _parents(root: Node) -> dict[Node, list[Node]]:
    """For every node below ``root``, the nodes whose backward sends it a gradient."""
    parents: dict[Node, list[Node]] = {root: []}
    todo = [root]
    while todo:
        node = todo.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                todo.append(child)
            parents[child].append(node)
    return parents


def _above(start: Node, parents: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """The nodes reached from ``start`` towards the root without entering ``stop``, and the ``stop`` nodes met."""
    seen, met, todo = {start}, set(), [start]
    while todo:
        for parent in parents[todo.pop()]:
            if parent in stop:
                met.add(parent)
            elif parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen, met


class WeightGrad:
    """What ``W`` needs after ``B``: per group of boundary nodes, their kept gradients and the parameters they
    reach. ``run()`` accumulates those parameters' gradients, once. ``input_grad`` makes these.

    Args:
        groups: per group, its boundary nodes (on the input's path, feeding a branch that reaches only weights)
            and the parameters those branches reach.

    Example::

        >>> lin = torch.nn.Linear(3, 2)
        >>> x = torch.randn(4, 3, requires_grad=True)
        >>> later = input_grad(lin(x).sum(), None, x, list(lin.parameters()))   # B: the input's gradient
        >>> type(later).__name__, lin.weight.grad is None
        ('WeightGrad', True)
        >>> later.run()                                                         # W: the weights' gradients
        >>> lin.weight.grad.shape
        torch.Size([2, 3])
    """

    def __init__(self, groups: list[tuple[list[Node], list[torch.Tensor]]]) -> None:
        self.groups = groups
        self.kept: dict[Node, tuple[torch.Tensor | None, ...]] = {}

    def keep(self, node: Node) -> object:
        def hook(grads: tuple[torch.Tensor | None, ...]) -> None:
            self.kept[node] = grads
        return node.register_prehook(hook)

    def run(self) -> None:
        """The weights' gradients, accumulated into their ``.grad`` as a whole backward would leave them."""
        for nodes, params in self.groups:
            edges, grads = [], []
            for node in nodes:
                for i, g in enumerate(self.kept.get(node, ())):
                    if g is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(g)
            if not edges:
                continue  # the branch got no gradient (an output the loss does not use)
            # with several nodes, one may lie above another: the gradient it passes down is already in the kept one
            handles = [node.register_prehook(lambda _, kept=self.kept[node]: kept) for node in nodes
                       if len(nodes) > 1 and node in self.kept]
            try:
                torch.autograd.backward(edges, grads, inputs=params, retain_graph=True)
            finally:
                for h in handles:
                    h.remove()
        self.groups, self.kept = [], {}


def input_grad(output: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor | None,
               params: Iterable[torch.Tensor]) -> WeightGrad:
    """``B`` of a zero-bubble schedule: the gradient of ``x`` (accumulated into ``x.grad``) from ``output``'s
    gradient ``grad``, and what ``W`` needs to compute the parameters' gradients later.

    Args:
        output: the stage's output (or its loss, on the last stage).
        grad: the gradient of ``output`` (None for a scalar loss).
        x: the stage's input: a leaf tensor; None, or one that needs no gradient, runs the whole backward now.
        params: the stage's parameters.

    Returns:
        A ``WeightGrad``; its ``run()`` is the step's ``W``.

    Example::

        >>> import torch
        >>> from tpflow.pipeline.backward import input_grad
        >>> lin = torch.nn.Linear(3, 2)
        >>> x = torch.randn(4, 3, requires_grad=True)
        >>> later = input_grad(lin(x).sum(), None, x, list(lin.parameters()))
        >>> x.grad is not None, lin.weight.grad is None
        (True, True)
        >>> later.run()
        >>> lin.weight.grad is not None
        True
    """
    root = output.grad_fn
    start = None if x is None or not x.requires_grad else get_gradient_edge(x).node
    parents = {} if root is None else _parents(root)
    if start not in parents:  # nothing flows back to the input: all of it is the weights'
        torch.autograd.backward(output, grad)
        return WeightGrad([])
    path, _ = _above(start, parents, set())
    groups: list[tuple[set[Node], set[torch.Tensor]]] = []
    for p in params:
        if not p.requires_grad or get_gradient_edge(p).node not in parents:
            continue
        _, met = _above(get_gradient_edge(p).node, parents, path)
        joined = [g for g in groups if g[0] & met]
        nodes, members = set(met), {p}
        for g in joined:
            groups.remove(g)
            nodes |= g[0]
            members |= g[1]
        groups.append((nodes, members))
    later = WeightGrad([(list(nodes), list(members)) for nodes, members in groups])
    handles = [later.keep(node) for nodes, _ in later.groups for node in nodes]
    try:
        torch.autograd.backward(output, grad, inputs=[x], retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return later

