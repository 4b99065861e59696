"""An optimizer's settings agree over the ranks that hold its parameters.

Each rank steps its own blocks of a split parameter with its own optimizer, and no other rank holds a copy of such a
block: one rank given another learning rate, weight decay or betas updates its blocks by other rules, and the model
trains on wrong without an error (``check_replicas`` compares copies, which split parameters do not have). So at an
optimizer's first step (torch.optim's global step pre-hook, ``HOOK``: a plain ``torch.optim.AdamW(model.parameters())``
loop is covered) each rank describes every param group's settings, one all-gather per axis of the placements its
global parameters live on compares them (``comm.agree``), and every rank raises the same error naming the setting and
the ranks that differ. Later steps cost a dictionary lookup. ``check_replicas`` compares the settings again as they are
then (a scheduler stepped on one rank only).
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tpflow import comm

__all__ = ["HOOK", "check_settings", "settings", "stepped"]

_STEPPED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizers whose first step passed, in order

FIX = ("build the optimizer with the same settings on every rank that holds the model (learning rate, weight decay, "
       "betas, eps, the same parameters in each group) and change them alike (a scheduler stepped on every rank): "
       "each rank steps its own blocks of the split parameters, which no other rank holds a copy of")


def _said(value: object) -> str:
    """A setting as every rank writes it alike (an object's ``repr`` may hold its address, which differs by rank)."""
    if isinstance(value, torch.Tensor):
        return f"tensor({value.tolist()})"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_said(v) for v in value) + ")"
    if value is None or isinstance(value, (bool, int, float, complex, str)):
        return repr(value)
    return type(value).__qualname__


def settings(optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """What ``optimizer`` steps by, as named facts: its class, and each param group's settings and parameters (their
    count and a digest of their whole shapes).

    Args:
        optimizer: any ``torch.optim`` optimizer.

    Returns:
        name -> value, e.g. ``{"lr of param group 0": "0.01", ...}``.

    Example::

        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
        >>> settings(opt)["lr of param group 0"]
        '0.1'
    """
    facts = {"the optimizer": f"{type(optimizer).__qualname__} of {len(optimizer.param_groups)} param groups"}
    for i, group in enumerate(optimizer.param_groups):
        shapes = repr([tuple(p.shape) for p in group["params"]]).encode()
        facts[f"the parameters of param group {i}"] = \
            f"{len(group['params'])} (shapes {hashlib.sha1(shapes).hexdigest()[:12]})"
        facts.update({f"{key} of param group {i}": _said(value) for key, value in group.items() if key != "params"})
    return facts


def _groups(optimizer: torch.optim.Optimizer) -> list[dist.ProcessGroup]:
    """The ranks that step ``optimizer``'s global parameters with this rank: the world where its parameters'
    placements cover it (a pipeline's stages), else the axes of each placement this rank is in."""
    meshes = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if isinstance(p, DTensor) and id(p.device_mesh) not in meshes:
                meshes[id(p.device_mesh)] = p.device_mesh
    by_ranks = {(tuple(m.mesh.shape), tuple(m.mesh.flatten().tolist())): m for m in meshes.values()}
    held = {r for _, ranks in by_ranks for r in ranks}
    if len(held) <= 1:
        return []
    if held == set(range(dist.get_world_size())):
        return [dist.group.WORLD]
    return [mesh.get_group(axis) for _, mesh in sorted(by_ranks.items())
            if mesh.get_coordinate() is not None for axis in range(mesh.ndim)]


def check_settings(optimizer: torch.optim.Optimizer) -> None:
    """Raise the same ``ValueError`` on every rank that holds ``optimizer``'s global parameters unless they all step
    them by the same settings (``settings``); an optimizer of plain tensors only passes.

    Args:
        optimizer: an optimizer of a parallelized model's parameters; every rank holding them calls it.

    Raises:
        ValueError: naming the first setting that differs and which ranks hold which value.

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> model = tpf.parallelize(torch.nn.Sequential(torch.nn.Linear(4, 8)), placement=P, plan={"0": "column"})
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3 * (1 + tpf.get_rank()))   # rank 1's is other
        >>> check_settings(opt)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
            ...
        ValueError: optimizer: the ranks disagree on lr of param group 0 (rank 0: 0.001; rank 1: 0.002): build ...
    """
    groups = _groups(optimizer)
    if groups:
        comm.agree("optimizer", settings(optimizer), groups, FIX)


def stepped(params: Iterable[torch.Tensor]) -> list[torch.optim.Optimizer]:
    """The optimizers that took a first step and hold any of ``params``, in the order of their first steps.

    Args:
        params: a model's parameters.

    Returns:
        The optimizers (none before a step).

    Example::

        >>> model = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> opt.step()
        >>> stepped(model.parameters()) == [opt]
        True
    """
    ids = {id(p) for p in params}
    return [opt for opt in list(_STEPPED) if any(id(p) in ids for g in opt.param_groups for p in g["params"])]


def _first_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    if optimizer in _STEPPED or torch.compiler.is_compiling():
        return
    check_settings(optimizer)  # raises before the step; checked again on the next one
    _STEPPED[optimizer] = None


HOOK = register_optimizer_step_pre_hook(_first_step)  # HOOK.remove() leaves the settings unchecked
