"""How a plain stage's module reads its parameters' local blocks (``tpflow.pipeline.stage``): each submodule holds its
blocks in place of its global parameters around a call, its gradient partial over the axes the rows are split on.

Eagerly, the blocks are read through autograd nodes of their own: where the gradients are summed during the backward
(``grad_sync="backward"``), each submodule's as it is entered, so autograd runs its node as soon as that submodule's
backward is done. In a pipeline's step (``open_step`` to ``close_step``) they are plain leaves made once for the step,
whose gradients reach the parameters once, at its end.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from tpflow import config
from tpflow.global_tensor.local_blocks import LocalBlocks

__all__ = ["PlainReads"]


class PlainReads:
    """A plain stage's reads of its parameters' local blocks (see the module docstring).

    Args:
        placement_type: the stage's placement's device type (``grad_sync``'s default depends on it).

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> stage = tpf.stage(torch.nn.Linear(8, 4), stage_id=0, placement=P, sbp=tpf.sbp.split(0))
        >>> reads = PlainReads("cpu")
        >>> with reads.reading(stage.module, (True,)):                 # rows split over the 2 ranks
        ...     type(stage.module.weight).__name__
        'Tensor'
        >>> type(stage.module.weight).__name__
        'DTensor'
    """

    def __init__(self, placement_type: str) -> None:
        self.placement_type = placement_type
        self.blocks = LocalBlocks()
        self.holders: list[nn.Module] | None = None  # the submodules with tensors of their own
        self.holder_ids: frozenset[int] = frozenset()  # theirs, to tell a copy of the stage (deepcopy, pickle)
        # per split axes, the submodules (ids) whose forward ran in the first call: they read their blocks as entered
        self.entered: dict[tuple[bool, ...], frozenset[int]] = {}
        # during a pipeline's step (open_step): per parameter and layout, the plain leaf the plain path reads (each
        # its own autograd node, so a zero-bubble schedule's weight pass runs each layer's gradient alone)
        self.leaves: dict[tuple[int, tuple[bool, ...]], tuple[DTensor, torch.Tensor]] | None = None

    def open_step(self) -> None:
        """A pipeline's step begins. Until ``close_step``, the plain path reads each parameter's block as a plain
        leaf made once for the step, so the micro-batches' gradients add up as plain tensors and reach the global
        parameter once (not a global tensor's sum every micro-batch; benchmarks/README.md, pipeline schedules)."""
        self.leaves = {}

    def close_step(self, keep: bool = True) -> None:
        """A pipeline's step ends: the leaves' gradients go to the parameters through autograd, as a whole-batch
        backward leaves them (laid out partial over the axes the rows were split on, added to any gradient a
        parameter holds, its hooks run once); ``keep=False`` drops them (a failed step). Once closed, a no-op."""
        leaves, self.leaves = self.leaves or {}, None
        spent: dict[tuple[bool, ...], list[tuple[DTensor, torch.Tensor]]] = {}
        for (_, split), (p, leaf) in leaves.items() if keep else ():
            if leaf.grad is not None:
                spent.setdefault(split, []).append((p, leaf.grad))
        for split, items in spent.items():
            layout = _grad_placements(split)
            blocks = self.blocks(tuple(p for p, _ in items), ("step", split), lambda p, layout=layout: layout)
            torch.autograd.backward(blocks, [g for _, g in items])

    def weights(self) -> list[torch.Tensor] | None:
        """The step's leaves where the plain path read them (what autograd reaches for the stage's parameters), or
        None."""
        return [leaf for _, leaf in self.leaves.values()] if self.leaves else None

    @contextlib.contextmanager
    def reading(self, module: nn.Module, split: tuple[bool, ...]) -> Iterator[None]:
        """Inside, each submodule holds its parameters' and buffers' local blocks in their places (as
        ``torch.func.functional_call`` does, without its walk of the whole module on every call); a parameter's
        gradient is partial over the ``split`` axes, a tied one's summed once.

        Where the gradients are summed during the backward (``grad_sync="backward"``), a submodule whose forward ran
        in the first call with these ``split`` axes that computed gradients reads its parameters from the next such
        call on as it is entered (``_on_entry``), through an autograd node of its own made just before its ops:
        autograd runs it as soon as the submodule's backward is done, so its gradients join their bucket (and the
        bucket is summed) while the backward goes on. The others' parameters (a child's weight its parent reads
        without calling the child) are read before the call, through one node, which autograd runs last. So the
        module must enter the same submodules on every call, each before its weights are read elsewhere, on the
        calling thread: a weight read otherwise is the global parameter there, and DTensor refuses to mix it with the
        blocks (``grad_sync="end"``, CPU's default, reads every block before the call)."""
        if self.holders is None:  # the submodules with tensors of their own, found once
            self.holders = [m for m in module.modules() if m._parameters or m._buffers]
            for m in self.holders:  # first: another pre-hook (weight_norm's) may read the blocks
                m.register_forward_pre_hook(_on_entry, prepend=True)
        ids = frozenset(map(id, self.holders))
        if ids != self.holder_ids:  # a copy of the stage (deepcopy, pickle): what it learned named other modules
            self.holder_ids, self.entered = ids, {}
        saved = [(m, dict(m._parameters), dict(m._buffers)) for m in self.holders]
        outer = _reading.call
        try:
            for m in self.holders:
                m._buffers.update((n, b.to_local()) for n, b in m._buffers.items() if b is not None)
            overlap = any(split) and self.leaves is None and torch.is_grad_enabled() and \
                config.get("grad_sync", self.placement_type) == "backward"
            learn = overlap and split not in self.entered  # learned from a call that computes gradients
            entered = self.entered[split] if overlap and not learn else ()
            call = _Call(self, split, entered, set() if learn else None, {id(m): params for m, params, _ in saved})
            call.read([m for m in self.holders if id(m) not in entered], ("before", split))
            _reading.call = call
            yield
            if call.ran is not None:
                self.entered[split] = frozenset(call.ran)
        finally:
            _reading.call = outer
            for m, params_of, buffers in saved:
                m._parameters.update(params_of)
                m._buffers.update(buffers)

    def leaf(self, p: DTensor, split: tuple[bool, ...]) -> torch.Tensor:
        """The step's plain leaf of ``p``'s block, made at its first micro-batch (shared by tied slots)."""
        key = (id(p), split)
        if key not in self.leaves:
            self.leaves[key] = (p, p.to_local().detach().requires_grad_(p.requires_grad))
        return self.leaves[key][1]


class _Call:
    """One call of a plain stage's module on local blocks: which submodules hold their blocks so far, and (in the
    first call with its split axes) whose forward ran."""

    def __init__(self, reads: PlainReads, split: tuple[bool, ...], entered: frozenset[int] | tuple,
                 ran: set[int] | None, params: dict[int, dict[str, torch.Tensor | None]]) -> None:
        self.reads, self.split, self.entered, self.ran = reads, split, entered, ran
        self.params = params  # per submodule (id), its own parameters (the global ones)
        self.block_of: dict[int, torch.Tensor] = {}  # per parameter (id), its block in this call
        self.done: set[int] = set()  # the submodules (ids) holding their blocks

    def read(self, holders: list[nn.Module], key: tuple) -> None:
        """Put ``holders``' parameters' blocks in their places, those not read yet in this call read through one
        autograd node (a pipeline step's leaves: each its own)."""
        slots = [(m, n, p) for m in holders if id(m) not in self.done for n, p in self.params[id(m)].items()
                 if p is not None]
        new = list({id(p): p for *_, p in slots if id(p) not in self.block_of}.values())
        if self.reads.leaves is not None:
            blocks = [self.reads.leaf(p, self.split) for p in new]
        else:
            placements = _grad_placements(self.split)
            blocks = self.reads.blocks(tuple(new), key, lambda p: placements)
        read = {**self.block_of, **{id(p): b for p, b in zip(new, blocks)}}
        for m, n, p in slots:
            m._parameters[n] = read[id(p)]
        if torch.is_grad_enabled() or self.reads.leaves is not None:  # blocks read without a node are not kept:
            self.block_of = read  # an entry under no_grad, then one with gradients, reads them again
            self.done.update(id(m) for m in holders)


class _Current(threading.local):
    call: _Call | None = None  # the plain stage's call running on this thread


_reading = _Current()


def _on_entry(module: nn.Module, args: tuple) -> None:
    """A plain stage's submodule is entered: in the stage's first call, note it; later, read its blocks now."""
    call = _reading.call
    if call is None or id(module) not in call.reads.holder_ids:
        return
    if call.ran is not None:
        call.ran.add(id(module))
    elif id(module) in call.entered and id(module) not in call.done:
        call.read([module], ("entered", id(module), call.split))


def _grad_placements(split: tuple[bool, ...]) -> tuple:
    """A plain stage's parameter gradient layout: partial over the axes its rows are split on."""
    return tuple(Partial() if on else Replicate() for on in split)
