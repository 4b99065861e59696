"""``to_global``: OneFlow's one conversion, for global tensors, plain (local) tensors and modules."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tpflow.global_tensor.blocks import check_placement, get_placement, get_sbp
from tpflow.global_tensor.boxing import box
from tpflow.global_tensor.local import from_local
from tpflow.global_tensor.module import module_to_global
from tpflow.placement import Placement
from tpflow.sbp import dual, from_dtensor, normalize

__all__ = ["to_global"]


class _GlobalToGlobal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src_pl, src, dst_pl, dst, grad_sbps):
        ctx.src_pl, ctx.dst_pl, ctx.grad_sbps = src_pl, dst_pl, grad_sbps
        return box(x, src_pl, src, dst_pl, dst)

    @staticmethod
    def backward(ctx, grad):
        grad = box(grad, ctx.dst_pl, from_dtensor(grad.placements), ctx.src_pl, ctx.grad_sbps)
        return grad, None, None, None, None, None


def to_global(x: torch.Tensor | nn.Module, placement: Placement | None = None, sbp: object = None, *,
              grad_sbp: object = None, shape: Sequence[int] | None = None, sync_data: bool = True):
    """Box a global tensor to a new placement and/or SBP (any pair, autograd both ways).

    A plain tensor is read as this rank's block (see ``from_local``); an ``nn.Module`` has every
    parameter and buffer converted (``sbp=None``: global ones keep their SBP, plain ones are broadcast).
    ``grad_sbp`` is the layout of the input's gradient
    (default: the input's own SBP, with partial sums read as broadcast).
    """
    if isinstance(x, nn.Module):
        if placement is None:
            raise TypeError("to_global(module, placement=..., sbp=...) needs a placement")
        return module_to_global(x, check_placement(placement), sbp)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"to_global takes a torch.Tensor or an nn.Module, got {type(x).__name__}")
    if not isinstance(x, DTensor):
        if placement is None or sbp is None:
            raise TypeError("to_global of a plain (local) tensor needs both placement= and sbp=")
        return from_local(x, placement, sbp, shape=shape, grad_sbp=grad_sbp, sync_data=sync_data)
    src_pl, src = get_placement(x), get_sbp(x)
    dst_pl = src_pl if placement is None else check_placement(placement)
    dst = src if sbp is None else normalize(sbp, dst_pl.ndim, x.ndim)
    if src_pl == dst_pl and len(src) != len(dst):
        raise ValueError(f"{len(dst)} SBP(s) for the {dst_pl.ndim}-D placement {dst_pl}")
    grad_sbps = dual(src) if grad_sbp is None else normalize(grad_sbp, src_pl.ndim, x.ndim)
    if (src_pl, src) == (dst_pl, dst) and grad_sbps == dual(src):
        return x
    return _GlobalToGlobal.apply(x, src_pl, src, dst_pl, dst, grad_sbps)
