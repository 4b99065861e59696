"""The share of a model's values a rank holds under tensor parallelism, as the support matrix reports it: the most any
rank holds, and, where that is more than a split would leave (1/W + ``SLACK``), what stays whole on every rank and why.
"""

from __future__ import annotations

import fnmatch
import re

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tpflow.global_tensor.module import held_share
from tpflow.placement import Placement
from tpflow.plans.replicated import Replicated

__all__ = ["SLACK", "most_held", "what_stays_whole"]

SLACK = 0.1  # above 1/W + SLACK a rank holds more than the norms, the biases and a few small whole modules add
_PARTS = 3  # the largest whole parts a note names


def most_held(model: nn.Module, placement: Placement) -> float:
    """The share of ``model``'s parameter values the rank holding most holds (``held_share`` over the ranks of
    ``placement``; every rank calls it).

    Args:
        model: a model parallelized over ``placement``.
        placement: its ranks, 1-D.

    Returns:
        The largest share, rounded to two places.

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)
        >>> mlp = tpf.parallelize(nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)), placement=P,
        ...                       plan={"0": "column", "2": "row"})
        >>> most_held(mlp, P)                             # the second layer's bias whole on each rank
        0.51
    """
    share = torch.tensor([held_share(model)], dtype=torch.float64)
    if placement.hierarchy[-1] > 1:
        dist.all_reduce(share, op=dist.ReduceOp.MAX, group=placement.mesh.get_group())
    return round(share.item(), 2)


def what_stays_whole(model: nn.Module, plan: dict[str, object]) -> str:
    """The largest parts of a parallelized model that every rank holds whole, each with its share of the model's values
    and why: the plan's ``Replicated(why=...)`` entry for it, else its class and the entry that keeps it whole (k / v
    projections with fewer heads than ranks), if any.

    Args:
        model: the model, parallelized by ``plan``.
        plan: the plan it was parallelized with (``tpf.hf_plan(model)``).

    Returns:
        A sentence naming up to three parts, the largest first, with the module patterns of every layer alike
        (``model.layers.*.mamba``); empty where nothing of 1% of the values stays whole.

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)
        >>> plan = {"0": "column", "2": "row", "3": tpf.Replicated(why="a classifier kept whole")}
        >>> model = tpf.parallelize(nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8), nn.Linear(8, 8)),
        ...                         placement=P, plan=plan)
        >>> print(what_stays_whole(model, plan))          # (the row layer's bias: whole, added once)
        whole on every rank: 3 (12% of the values): a classifier kept whole; 2 (1% of the values): RowParallelLinear,
        whole under its entry row
    """
    names = [n for n, _ in model.named_modules()]
    entries = {n: entry for pattern, entry in plan.items() for n in names if fnmatch.fnmatchcase(n, pattern)}
    said = {n: entry.why for n, entry in entries.items() if isinstance(entry, Replicated) and entry.why}
    total, sizes = 0, {}
    seen: set[int] = set()
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            total += p.numel()
            if isinstance(p, DTensor) and p.to_local().numel() < p.numel():
                continue  # split over the ranks
            owner = next((n for n in said if name == n or name.startswith(n + ".")), None)
            why = said[owner] if owner else _unsplit(module, entries.get(name))
            part = (re.sub(r"\.\d+(?=\.|$)", ".*", owner or name), why)  # every layer's alike
            sizes[part] = sizes.get(part, 0) + p.numel()
    largest = sorted(((size, part) for part, size in sizes.items() if size >= total / 100), reverse=True)
    shown = [f"{name} ({size / total:.0%} of the values): {why}" for size, (name, why) in largest[:_PARTS]]
    return "whole on every rank: " + "; ".join(shown) if shown else ""


def _unsplit(module: nn.Module, entry: object) -> str:
    """Why a module no ``Replicated(why=...)`` entry names holds whole parameters: no entry splits it, or its entry
    keeps them whole (a projection of fewer heads than ranks, a row layer's bias)."""
    if entry is None:
        return f"{type(module).__name__}, which no plan entry splits"
    return f"{type(module).__name__}, whole under its entry {entry if isinstance(entry, str) else type(entry).__name__}"
