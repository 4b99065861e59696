"""Replicas stay replicas: a global parameter broadcast over an axis of its placement must hold the very same bits on
every rank of that axis. A copy that drifts (a rank seeded apart for dropout, an optimizer step one rank skipped, a
write to one rank's block) trains on apart without an error; ``check_replicas`` compares them.

A split parameter is compared where its blocks have copies: under a data x tensor placement each block is broadcast
over the data axis, and its owners must agree. Where a block has no copy (a tensor-parallel-only placement), what
steps it must agree instead: the settings of the optimizers that hold the model's parameters
(``optimizer_settings``, also checked at each optimizer's first step).

Each rank digests its blocks exactly (their bits read as integers: two int64 sums, one weighted by position), one
all-gather over the world brings every rank's digests and optimizer settings, and every rank raises the same error
naming the first setting, or else the first parameter, whose copies differ and which ranks hold which."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from tpflow.comm.agreement import difference
from tpflow.global_tensor.blocks import get_placement
from tpflow.global_tensor.optimizer_settings import FIX, settings, stepped

__all__ = ["check_replicas"]

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _digest(t: torch.Tensor) -> tuple[int, int]:
    """Two integers that differ, in practice, for any other bits of ``t`` (its values as bit patterns)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    bits = flat.view(_BITS[flat.element_size()]).to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64).remainder_(1021).add_(1)
    return int(bits.sum()), int((bits * weights).sum())


def check_replicas(model: nn.Module) -> None:
    """Raise the same ``ValueError`` on every rank if any global parameter of ``model`` differs between the ranks it
    is broadcast over (its ``Replicate`` axes; a split parameter's blocks over a data axis), naming the first such
    parameter and the ranks on each side; or if the optimizers that stepped ``model``'s parameters have other
    settings on ranks of one placement (``optimizer_settings.settings``: a learning rate, a weight decay), which
    would step the blocks of its split parameters, copies of none, by other rules.

    Every rank of the world calls it (it all-gathers the digests over the world); parameters that are plain tensors are
    not global and are left out. It reads each of this rank's broadcast blocks once and all-gathers two integers a
    parameter (not timed here: run it where a pass over the parameters is affordable, as after test steps).

    Args:
        model: a model whose parameters ``parallelize`` (or ``to_global``, a ``tpf.stage``) made global.

    Example::

        >>> from torch import nn
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> model = tpf.parallelize(nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8)), placement=P, plan={"0": "column"})
        >>> check_replicas(model)                               # the norm is the same on both ranks
        >>> with torch.no_grad():
        ...     _ = model[1].weight.to_local().add_(1e-3 * tpf.get_rank())   # rank 1's copy drifts
        >>> check_replicas(model)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
            ...
        ValueError: check_replicas: '1.weight' is broadcast over ranks [0, 1] but its copies differ: ranks [0] hold ...
    """
    mine, where = [], set()
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            continue
        placement = get_placement(p)
        coord = placement.coordinate()
        if coord is None:
            continue
        where.add(repr(placement))
        if not any(isinstance(q, Replicate) for q in p.placements):
            continue
        kept = tuple(c for c, q in zip(coord, p.placements) if not isinstance(q, Replicate))  # where blocks differ
        mine.append((name, repr(placement), kept, _digest(p.to_local())))
    optimizers = stepped(model.parameters())
    steps = {f"{key}{f' (optimizer {i})' if i else ''}": value
             for i, opt in enumerate(optimizers) for key, value in settings(opt).items()}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (mine, sorted(where), steps))
    for shared in sorted({w for _, held, _ in every for w in held}):  # the ranks of each placement agree
        ranks = [r for r, (_, held, _) in enumerate(every) if shared in held]
        verdict = difference("check_replicas: the optimizers of the model", [every[r][2] for r in ranks], ranks)
        if verdict is not None:
            raise ValueError(f"{verdict}: {FIX}")
    copies: dict[tuple, dict[tuple, list[int]]] = {}
    for rank, (entries, _, _) in enumerate(every):
        for name, at, kept, digest in entries:
            copies.setdefault((name, at, kept), {}).setdefault(digest, []).append(rank)
    for (name, _, _), holders in copies.items():
        if len(holders) > 1:
            ranks = sorted(r for held in holders.values() for r in held)
            sides = "; ".join(f"ranks {held} hold one value" for held in holders.values())
            raise ValueError(f"check_replicas: {name!r} is broadcast over ranks {ranks} but its copies differ: "
                             f"{sides}. Every rank of a tensor-parallel (or data-parallel) group must take the same "
                             f"steps on it: seed random ops alike on those ranks, step the optimizer on every rank "
                             f"with the same settings, and change a replicated parameter only through its global "
                             f"tensor")
