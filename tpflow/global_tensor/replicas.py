"""Replicas stay replicas: a global parameter broadcast over an axis of its placement must hold the very same bits on
every rank of that axis. A copy that drifts (a rank seeded apart for dropout, an optimizer step one rank skipped, a
write to one rank's block) trains on apart without an error; ``check_replicas`` compares them.

Each rank digests its blocks exactly (their bits read as integers: two int64 sums, one weighted by position), one
all-gather of the digests over the world compares them, and every rank raises the same error naming the first
parameter whose copies differ and which ranks hold which."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from tpflow.global_tensor.blocks import get_placement

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
    is broadcast over (its ``Replicate`` axes), naming the first such parameter and the ranks on each side.

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
    mine = []
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            continue
        placement = get_placement(p)
        coord = placement.coordinate()
        if coord is None or not any(isinstance(q, Replicate) for q in p.placements):
            continue
        kept = tuple(c for c, q in zip(coord, p.placements) if not isinstance(q, Replicate))  # where blocks differ
        mine.append((name, repr(placement), kept, _digest(p.to_local())))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    copies: dict[tuple, dict[tuple, list[int]]] = {}
    for rank, entries in enumerate(every):
        for name, where, kept, digest in entries:
            copies.setdefault((name, where, kept), {}).setdefault(digest, []).append(rank)
    for (name, _, _), holders in copies.items():
        if len(holders) > 1:
            ranks = sorted(r for held in holders.values() for r in held)
            sides = "; ".join(f"ranks {held} hold one value" for held in holders.values())
            raise ValueError(f"check_replicas: {name!r} is broadcast over ranks {ranks} but its copies differ: "
                             f"{sides}. Every rank of a tensor-parallel (or data-parallel) group must take the same "
                             f"steps on it: seed random ops alike on those ranks, step the optimizer on every rank, "
                             f"and change a replicated parameter only through its global tensor")
