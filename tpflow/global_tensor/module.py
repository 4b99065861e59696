"""A module's global tensors: ``to_global`` of an ``nn.Module`` (every parameter and buffer converted, shared ones
kept shared), and the share of its parameters' values this rank holds."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tpflow.global_tensor import gradients
from tpflow.global_tensor.blocks import get_placement, get_sbp
from tpflow.global_tensor.boxing import box, box_within
from tpflow.global_tensor.local import from_local
from tpflow.placement import Placement
from tpflow.sbp import broadcast, normalize

__all__ = ["held_share", "module_to_global"]


def module_to_global(module: nn.Module, pl: Placement, sbp: object) -> nn.Module:
    """Every parameter and buffer, read as its whole (single-device) value, laid out as ``sbp`` on ``pl``.

    With ``sbp=None`` a global tensor keeps its SBP (moving to ``pl`` if it lives elsewhere) and a plain
    one is broadcast. Plain tensors are taken from the placement's first rank, so every rank starts from
    the same model whatever its own initialisation drew. Shared parameters stay shared; a tensor already
    in its layout is kept as it is (the same object).

    The module is converted in place. Every tensor is checked before any is converted, so an SBP that does not
    fit one (``split(1)`` of a 1-D bias, say) is a ``ValueError`` naming it, with the module left unchanged. New
    parameters are ``nn.Parameter`` objects marked with ``gradients.adopt``, so their partial-sum gradients are summed
    in buckets before an optimizer step. Every rank calls it (it is a collective). ``tpf.to_global(module, ...)``
    calls this.

    Args:
        module: the module whose parameters and buffers to convert.
        pl: the placement to put them on.
        sbp: the layout of every parameter and buffer (one SBP, or a tuple with one per axis of ``pl``), or None.

    Returns:
        ``module`` itself.

    Example::

        >>> import torch
        >>> import tpflow as tpf
        >>> from tpflow.global_tensor.module import module_to_global
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> model = module_to_global(torch.nn.Linear(3, 2), P, None)   # as tpf.to_global(model, placement=P)
        >>> tpf.get_sbp(model.weight)
        (sbp.broadcast,)
    """
    entries = []  # validate every tensor before converting any, so an error leaves the module intact
    for mod_name, mod in module.named_modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(mod, kind).items():
                if t is not None:
                    want = get_sbp(t) if sbp is None and isinstance(t, DTensor) else \
                        (broadcast,) * pl.ndim if sbp is None else sbp
                    try:
                        entries.append((getattr(mod, kind), name, t, normalize(want, pl.ndim, t.ndim)))
                    except ValueError as e:
                        raise ValueError(f"{f'{mod_name}.{name}'.lstrip('.')}: {e}") from None
    converted: dict[int, torch.Tensor] = {}
    for table, name, t, sbps in entries:
        if isinstance(t, DTensor) and (get_placement(t), get_sbp(t)) == (pl, sbps):
            continue
        if id(t) not in converted:
            with torch.no_grad():
                if isinstance(t, DTensor):
                    new = box(t, get_placement(t), get_sbp(t), pl, sbps)
                else:
                    whole = from_local(t.detach(), pl, (broadcast,) * pl.ndim, shape=t.shape)
                    new = box_within(whole, pl, (broadcast,) * pl.ndim, sbps)
            converted[id(t)] = gradients.adopt(nn.Parameter(new, t.requires_grad)) if isinstance(t, nn.Parameter) \
                else new
        table[name] = converted[id(t)]
    return module


def held_share(module: nn.Module) -> float:
    """The share of ``module``'s parameter values this rank holds: what a split saves in memory. Each parameter counts
    once (a tied embedding and head once), a global tensor as its local block over its whole (one device's) size, a
    plain tensor whole. A model split over W ranks holds 1/W; what stays whole on every rank (a broadcast norm, a
    module no plan entry splits) adds its share in full.

    Args:
        module: a model, parallelized or not.

    Returns:
        A fraction in [0, 1] (0 for a module without parameters or a rank outside their placement); ranks holding
        uneven blocks hold different shares.

    Example::

        >>> from tpflow.global_tensor.module import held_share
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)
        >>> mlp = tpf.parallelize(torch.nn.Sequential(torch.nn.Linear(8, 32, bias=False), torch.nn.GELU(),
        ...                                           torch.nn.Linear(32, 8, bias=False)), placement=P,
        ...                       plan={"0": "column", "2": "row"})
        >>> held_share(mlp), held_share(torch.nn.Linear(8, 32))
        (0.5, 1.0)
    """
    held = whole = 0
    for p in module.parameters():
        held += p.to_local().numel() if isinstance(p, DTensor) else p.numel()
        whole += p.numel()
    return held / whole if whole else 0.0
