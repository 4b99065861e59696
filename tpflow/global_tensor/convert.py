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

    For a global tensor, a ``placement`` or ``sbp`` left out stays as it is, and ``x`` itself comes back when
    nothing changes. Within a placement the conversion is DTensor's ``redistribute``, plus conversions to
    ``partial_sum`` made locally; across placements the blocks travel point to point, and ``TPFLOW_DEBUG=1`` logs
    the route. It is a collective: every rank of the source and destination placements calls it. A plain tensor
    needs both ``placement`` and ``sbp``; a module needs ``placement``, is converted in place and comes back
    itself (``grad_sbp``, ``shape`` and ``sync_data`` do not apply to it; see ``module_to_global``).

    Errors say what to change: another type of ``x``, or a missing ``placement`` or ``sbp``, is a ``TypeError``;
    a wrong number of SBPs, a split dim out of range, a change of device type (``"cpu"`` to ``"cuda"``) or local
    blocks that do not fit together are a ``ValueError``.

    Args:
        x: a global tensor, a plain (local) tensor, or an ``nn.Module``.
        placement: the placement to move to (default: ``x``'s own, for a global tensor).
        sbp: the layout to convert to: one SBP for a 1-D placement, else a tuple with one per placement axis
            (default: ``x``'s own, for a global tensor).
        grad_sbp: the layout of ``x``'s gradient: on ``x``'s placement for a global tensor, on ``placement`` for
            a plain one (see ``from_local``).
        shape: for a plain tensor, the global shape, which saves the ranks exchanging their block shapes.
        sync_data: for a plain tensor, whether ``broadcast`` axes copy the value from the axis' first rank.

    Returns:
        A global tensor (a ``DTensor``), or the module ``x``.

    Example::

        >>> import torch
        >>> import tpflow as tpf
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> x = tpf.randn(4, 5, placement=P, sbp=tpf.sbp.split(0))
        >>> y = tpf.to_global(x, sbp=tpf.sbp.broadcast)                                  # an all-gather
        >>> z = tpf.to_global(x, placement=tpf.placement("cpu", ranks=[1]))              # all 4 rows to rank 1
        >>> rows = tpf.to_global(torch.randn(2, 5), placement=P, sbp=tpf.sbp.split(0))   # 2 rows per rank: 4 x 5
        >>> model = tpf.to_global(torch.nn.Linear(5, 3), placement=P)                    # broadcast from rank 0
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
    if sbp is None and dst_pl.ndim != src_pl.ndim:
        raise ValueError(f"to_global from the {src_pl.ndim}-D {src_pl} to the {dst_pl.ndim}-D {dst_pl} cannot keep the "
                         f"SBP {src}: give sbp=, one per axis of the new placement")
    dst = src if sbp is None else normalize(sbp, dst_pl.ndim, x.ndim)
    grad_sbps = dual(src) if grad_sbp is None else normalize(grad_sbp, src_pl.ndim, x.ndim)
    if (src_pl, src) == (dst_pl, dst) and grad_sbps == dual(src):
        return x
    return _GlobalToGlobal.apply(x, src_pl, src, dst_pl, dst, grad_sbps)
