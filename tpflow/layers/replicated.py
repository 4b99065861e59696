"""Modules left whole on every rank (norms, an embedding until it is split), as global parameters with one
device's gradient.

``parallelize`` replaces the planned ``nn.Linear`` layers; every other parameter stays whole on every rank.
``replicate`` makes those parameters global tensors too (broadcast over the placement), so that the whole
model's parameters are DTensors: ``torch.nn.utils.clip_grad_norm_``, ``torch.optim``'s foreach paths and
``torch.distributed.checkpoint`` then take the model as they take one device's, where a mix of plain tensors
and DTensors fails ("got mixed torch.Tensor and DTensor"). The module's own forward is unchanged: around each
call on plain tensors it reads its parameters as local tensors (one autograd node), and the gradient comes back
global; called on global tensors, it computes with its global parameters.

A replicated parameter that sees only this rank's part of an activation (a per-head norm between a column
and a row layer, a norm on this rank's tokens) gets a partial-sum gradient; left alone, the copies drift
apart. ``grads="auto"`` finds those modules from the autograd graph on their first call with gradients
(``tpflow.layers.regions``) and sums their gradients over the tensor-parallel ranks in the backward, so
every copy gets one device's gradient and stays bit-identical to the others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from tpflow import comm
from tpflow.global_tensor import from_local, gradients
from tpflow.global_tensor.local_blocks import LocalBlocks
from tpflow.layers.regions import is_split, mark
from tpflow.placement import Placement
from tpflow.sbp import broadcast

__all__ = ["GRADS", "replicate", "replicated_grads"]

GRADS = ("auto", "partial", "whole")
_STATE = "_tpflow_replica"


def _grad_placements(p: DTensor) -> tuple:
    """A replicated parameter's gradient layout: partial sums over the data-parallel axes (a plain input differs
    there), whole over the tensor-parallel one."""
    return (Partial(),) * (p.device_mesh.ndim - 1) + (Replicate(),)


class _Replica:
    """The hooks of one replicated module: its parameters read as local tensors around each call (or the views an
    enclosing call read, which serve every call inside it)."""

    def __init__(self, module: nn.Module, placement: Placement, grads: str) -> None:
        self.placement, self.grads = placement, grads
        self.partial: bool | None = {"partial": True, "whole": False}.get(grads)  # "auto": found on first use
        self.names = [name for name, p in module.named_parameters(recurse=False) if p is not None]
        self.summing = placement.hierarchy[-1] > 1  # partial-sum gradients to add over the tensor-parallel ranks
        self.blocks = LocalBlocks()
        self.shown: list[tuple[dict, bool] | None] = []  # per call in progress: its views, read with gradients?
        module.register_forward_pre_hook(self.before, with_kwargs=True)
        module.register_forward_hook(self.after, always_call=True)
        module.register_load_state_dict_pre_hook(self.load)

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if any(isinstance(a, DTensor) for a in (*args, *kwargs.values())):
            self.shown.append(None)
            return  # a global input: the module runs on global tensors, its parameters as they are
        if self.partial is None and torch.is_grad_enabled():
            if torch.compiler.is_compiling():
                raise RuntimeError(f"{type(module).__name__}: whether its gradients are partial sums is read off the "
                                   "autograd graph on its first call with gradients, which torch.compile hides: run "
                                   "the model once eagerly before compiling it, or name the module in the plan "
                                   "(tpf.Replicated(grads='partial' or 'whole'))")
            self.partial = is_split([*args, *kwargs.values()])
        if not self.reuse():
            self.show(module, self.read(module), None)

    def read(self, module: nn.Module) -> tuple[torch.Tensor, ...]:
        """The parameters' local views, one autograd node."""
        return self.blocks([module._parameters[name] for name in self.names], key=None,
                           grad_placements=_grad_placements)

    def reuse(self) -> bool:
        """Whether this call takes the views an enclosing call read (the model's call reads every replicated
        parameter inside it once), which it can unless it needs gradients they do not carry."""
        enclosing = self._enclosing()
        if enclosing is None or (torch.is_grad_enabled() and not enclosing[1]):
            return False
        self.shown.append(enclosing)
        return True

    def show(self, module: nn.Module, views: Sequence[torch.Tensor], split: bool | None) -> None:
        """Put ``views`` of the parameters where the module's code finds them (``split``: for an enclosing
        module's call, whether its input was split, which decides the gradients while this module has not been
        called itself)."""
        shown = {}
        for name, view in zip(self.names, views):
            if self.summing and view.requires_grad:  # read in the backward: a later layer may tell
                view.register_hook(lambda g: self.summed(g) if (split if self.partial is None else self.partial)
                                   else g)
            module.__dict__[name] = shown[name] = view  # found before nn.Module.__getattr__ looks in _parameters
        self.shown.append((shown, torch.is_grad_enabled()))

    def summed(self, g: torch.Tensor) -> torch.Tensor:
        """A partial-sum gradient added over the tensor-parallel ranks."""
        g = g.clone()
        comm.all_reduce(g, self.placement.mesh.get_group(self.placement.ndim - 1))
        return g

    def whole(self, module: nn.Module) -> bool:
        """Whether every parameter is a copy on every rank now (not sharded by FSDP2 between its calls)."""
        params = [module._parameters.get(name) for name in self.names]
        return all(isinstance(p, DTensor) and all(pl.is_replicate() for pl in p.placements) for p in params)

    def _enclosing(self) -> tuple[dict, bool] | None:
        return next((views for views in reversed(self.shown) if views is not None), None)

    def hide(self, module: nn.Module) -> None:
        """Take back the views of the call that ends: an enclosing call's views come back, else the parameters."""
        if self.shown:
            self.shown.pop()
        enclosing = self._enclosing()
        for name in self.names:
            if enclosing is not None:
                module.__dict__[name] = enclosing[0][name]
            else:
                module.__dict__.pop(name, None)

    def after(self, module: nn.Module, args: tuple, output: object) -> None:
        self.hide(module)
        if self.grads == "auto" and not self.partial and not torch.compiler.is_compiling():
            mark(output, self)

    def saw_split(self) -> None:
        """A layer downstream reads this module's output as split data: its gradients are partial sums."""
        if self.grads == "auto":
            self.partial = True

    def load(self, module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
        """A single-device checkpoint (whole plain tensors) loads as is."""
        for name in self.names:
            value, param = state_dict.get(prefix + name), module._parameters[name]
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == param.shape:
                state_dict[prefix + name] = _global(value.to(param.dtype), self.placement)


def _global(value: torch.Tensor, placement: Placement) -> DTensor:
    """``value`` broadcast over ``placement``, each copy taken from the first rank of its axis (a meta value: a copy
    allocated and not initialised, for a checkpoint to fill)."""
    sbp = (broadcast,) * placement.ndim
    if value.is_meta:
        empty = torch.empty(value.shape, dtype=value.dtype, device=placement.device)
        return from_local(empty, placement, sbp, shape=value.shape, sync_data=False)
    return from_local(value.detach().to(placement.device), placement, sbp, shape=value.shape, sync_data=True)


def replicate(model: nn.Module, placement: Placement, grads: str | Mapping[str, str] = "auto") -> nn.Module:
    """Make every plain parameter of ``model``'s modules a global tensor broadcast over ``placement``, read as a
    local tensor by its module's unchanged forward; a parameter shared by two modules stays one parameter.

    Args:
        model: the model, changed in place (parameters that are global tensors already are left as they are).
        placement: the ranks it lives on; the last axis is the tensor-parallel one.
        grads: for every module holding such parameters, or per module name (a mapping; names it lacks get
            ``"auto"``): ``"whole"``: the module sees the same values on every tensor-parallel rank, so its
            gradient is whole; ``"partial"``: it sees this rank's part (its heads, its tokens), so its gradients
            are summed over the tensor-parallel ranks in the backward; ``"auto"`` (the default): found from the
            autograd graph on the module's first call with gradients.

    Returns:
        ``model`` itself.

    Example::

        >>> import torch
        >>> from torch import nn
        >>> import tpflow as tpf
        >>> from tpflow.layers.replicated import replicate
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> norm = replicate(nn.LayerNorm(8), P)
        >>> type(norm.weight).__name__, tpf.get_sbp(norm.weight)
        ('DTensor', (sbp.broadcast,))
        >>> norm(torch.randn(2, 8)).shape                     # its own forward, on plain tensors
        torch.Size([2, 8])
    """
    default, chosen = (grads, {}) if isinstance(grads, str) else ("auto", dict(grads))
    for name, value in {"": default, **chosen}.items():
        if value not in GRADS:
            raise ValueError(f"grads[{name!r}] must be one of {GRADS}, got {value!r}")
    if placement.coordinate() is None:
        return model
    converted: dict[int, nn.Parameter] = {}
    for name, module in model.named_modules(remove_duplicate=True):
        plain = {n: p for n, p in module.named_parameters(recurse=False) if not isinstance(p, DTensor)}
        if not plain or hasattr(module, _STATE):
            continue
        for n, p in plain.items():
            if id(p) not in converted:
                converted[id(p)] = gradients.adopt(nn.Parameter(_global(p, placement), requires_grad=p.requires_grad))
            setattr(module, n, converted[id(p)])
        setattr(module, _STATE, _Replica(module, placement, chosen.get(name, default)))
    roots = _whole_subtrees(model)
    if model not in roots:  # the model's own forward may read a parameter without calling its module
        roots.append(model)
    for root in roots:
        _Subtree(root)
    return model


class _Subtree:
    """A module with replicated modules inside (one left whole, and the model itself): around its call every one of
    their parameters is read as a local tensor, so its code may read a child's parameter without calling the child
    (``nn.MultiheadAttention`` reads ``out_proj.weight``, a state-space mixer passes ``self.conv1d.weight`` to its
    kernel, Gemma 4 reads ``embed_tokens.weight[pad_id]``). They are read once, as one autograd node, and the calls of
    the children inside take these views: the model's call reads each replicated parameter once, not once a call."""

    def __init__(self, root: nn.Module) -> None:
        self.inside = [(m, getattr(m, _STATE)) for m in root.modules() if m is not root and hasattr(m, _STATE)]
        self.blocks = LocalBlocks()
        root.register_forward_pre_hook(self.before, with_kwargs=True)
        root.register_forward_hook(self.after, always_call=True)
        self.shown: list[list[tuple[nn.Module, _Replica]]] = []  # per call in progress: the replicas it showed

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        inputs = [*args, *kwargs.values()]
        shown = []
        if not any(isinstance(a, DTensor) for a in inputs):
            split = is_split(inputs) if torch.is_grad_enabled() and not torch.compiler.is_compiling() else False
            # (parameters FSDP2 holds sharded until their module's own call gathers them are shown by that call)
            shown = [(child, replica) for child, replica in self.inside if replica.whole(child)]
            unread = [(child, replica) for child, replica in shown if not replica.reuse()]
            views = iter(self.blocks([child._parameters[name] for child, replica in unread for name in replica.names],
                                     key=None, grad_placements=_grad_placements))
            for child, replica in unread:
                replica.show(child, [next(views) for _ in replica.names], split)
        self.shown.append(shown)

    def after(self, module: nn.Module, args: tuple, output: object) -> None:
        for child, replica in reversed(self.shown.pop()):
            replica.hide(child)


def _whole_subtrees(model: nn.Module) -> list[nn.Module]:
    """The outermost modules holding no split parameter with a replicated module inside them (not containers,
    which have no call of their own)."""
    found, covered = [], set()
    for module in model.modules():
        if id(module) in covered or isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            continue
        params = [p for m in module.modules() if m is not module for p in m.parameters(recurse=False)]
        if params and not any(isinstance(p, DTensor) and not _is_replica(m, p) for m in module.modules()
                              for p in m.parameters(recurse=False)):
            found.append(module)
            covered.update(id(m) for m in module.modules())
    return found


def _is_replica(module: nn.Module, param: torch.Tensor) -> bool:
    """Whether ``param`` is one ``replicate`` made (its module has a replica's hooks)."""
    replica = getattr(module, _STATE, None)
    return replica is not None and any(module._parameters.get(n) is param for n in replica.names)


def replicated_grads(module: nn.Module) -> str | None:
    """How a replicated module's gradients are treated: ``"partial"`` (summed over the tensor-parallel ranks),
    ``"whole"``, ``"auto"`` while not yet found, or None if ``replicate`` never took it.

    Args:
        module: any module.

    Returns:
        One of the above.

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> q_proj, q_norm = tpf.ColumnParallelLinear(8, 8, placement=P), replicate(torch.nn.LayerNorm(4), P)
        >>> replicated_grads(q_norm)                              # not called with gradients yet
        'auto'
        >>> q_norm(q_proj(torch.randn(2, 8))).sum().backward()     # it sees this rank's columns (its heads)
        >>> replicated_grads(q_norm)
        'partial'
    """
    replica = getattr(module, _STATE, None)
    if replica is None:
        return None
    return "auto" if replica.partial is None else ("partial" if replica.partial else "whole")
