"""``matmul`` of global tensors: the output SBP inferred from the inputs', the local product in tpflow's kernels."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor

from tpflow import config, kernels
from tpflow.global_tensor.blocks import get_placement, get_sbp, wrap
from tpflow.global_tensor.boxing import box
from tpflow.global_tensor.convert import to_global
from tpflow.global_tensor.signatures import infer_matmul, matmul_out_sbp
from tpflow.sbp import Sbp, Split, dual, from_dtensor

__all__ = ["matmul"]


def _transposed(sbps: Sequence[Sbp], ndim: int) -> tuple[Sbp, ...]:
    swap = {ndim - 1: ndim - 2, ndim - 2: ndim - 1}
    return tuple(Split(swap.get(s.dim, s.dim)) if isinstance(s, Split) else s for s in sbps)


def _as_rows(sbps: Sequence[Sbp], ndim: int) -> tuple[Sbp, ...]:
    """SBP of ``t.reshape(-1, t.shape[-1])``: every dim but the last folds into rows."""
    return tuple(Split(0 if s.dim < ndim - 1 else 1) if isinstance(s, Split) else s for s in sbps)


class _Matmul(torch.autograd.Function):
    """``a @ b`` on local blocks under a legal SBP signature; gradients in the inputs' layouts."""

    @staticmethod
    def forward(ctx, a, b, pl, out_sbps):
        a_sbps, b_sbps = get_sbp(a), get_sbp(b)
        a_local, b_local = a.to_local(), b.to_local()
        ctx.save_for_backward(a_local, b_local)
        ctx.meta = (pl, a_sbps, b_sbps, out_sbps, a.shape, b.shape)
        member = pl.coordinate() is not None
        local = kernels.matmul(a_local, b_local) if member else None
        return wrap(local, pl, out_sbps, (*a.shape[:-1], b.shape[-1]), a.dtype)

    @staticmethod
    def backward(ctx, grad):
        a_local, b_local = ctx.saved_tensors
        pl, a_sbps, b_sbps, out_sbps, a_shape, b_shape = ctx.meta
        member = pl.coordinate() is not None
        g_sbps = dual(out_sbps)
        g = box(grad, pl, from_dtensor(grad.placements), pl, g_sbps).to_local()
        a_nd, b_nd, g_nd = len(a_shape), len(b_shape), len(a_shape)
        grad_a = grad_b = None
        if kernels.wanted(ctx, 0):  # dA = dY @ B^T
            sbps = matmul_out_sbp(g_sbps, _transposed(b_sbps, b_nd), g_nd, b_nd)
            local = kernels.matmul(g, b_local.mT) if member else None
            grad_a = box(wrap(local, pl, sbps, a_shape, grad.dtype), pl, sbps, pl, dual(a_sbps))
        if kernels.wanted(ctx, 1):  # dB = A^T @ dY, batch dims folded into rows when B is 2-D
            if b_nd == 2 and a_nd > 2:
                a_sbps, g_sbps = _as_rows(a_sbps, a_nd), _as_rows(g_sbps, g_nd)
                if member:
                    a_local, g = a_local.flatten(0, -2), g.flatten(0, -2)
            sbps = matmul_out_sbp(_transposed(a_sbps, b_nd), g_sbps, b_nd, b_nd)
            local = kernels.matmul(a_local.mT, g) if member else None
            grad_b = box(wrap(local, pl, sbps, b_shape, grad.dtype), pl, sbps, pl, dual(b_sbps))
        return grad_a, grad_b, None, None


def matmul(a: DTensor, b: DTensor) -> DTensor:
    """``a [..., M, K] @ b [K, N]`` (or ``b [..., K, N]`` with a's batch dims) of global tensors.

    The output SBP follows from the inputs' (S0 x B -> S0, B x S1 -> S1, S1 x S0 -> P, B x B -> B,
    P x B -> P, B x P -> P, per placement axis). Inputs with no legal signature are first boxed
    to the one that moves the fewest bytes; ``TPFLOW_DEBUG=1`` logs that choice.

    Each rank multiplies its blocks with tpflow's kernels; no communication happens unless inputs are boxed. The
    product is differentiable, and the gradients come back in ``a``'s and ``b``'s own layouts (partial sums as
    broadcast). A plain ``torch.Tensor`` input is a ``TypeError`` that says to make it global with
    ``tpf.to_global``; inputs on different placements, shapes that are not ``[..., M, K] @ [K, N]`` or
    ``[..., M, K] @ [..., K, N]``, or inner sizes that differ are a ``ValueError``.

    Args:
        a: a global tensor ``[..., M, K]``.
        b: a global tensor ``[K, N]``, or ``[..., K, N]`` with ``a``'s batch dims, on ``a``'s placement.

    Returns:
        A global tensor ``[..., M, N]`` on the same placement, with the inferred SBP.

    Example::

        >>> import tpflow as tpf
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> a = tpf.randn(6, 8, placement=P, sbp=tpf.sbp.split(1), requires_grad=True)
        >>> b = tpf.randn(8, 4, placement=P, sbp=tpf.sbp.split(0), requires_grad=True)
        >>> c = tpf.matmul(a, b)
        >>> tpf.get_sbp(c)
        (sbp.partial_sum,)
        >>> c.sum().backward()
        >>> tpf.get_sbp(a.grad)
        (sbp.split(dim=1),)
    """
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, DTensor):
            raise TypeError(
                f"tpf.matmul takes global tensors, and {name} is a plain torch.Tensor: make it global with "
                f"tpf.to_global({name}, placement=..., sbp=...), or use torch.matmul for local tensors"
            )
    pl, b_pl = get_placement(a), get_placement(b)
    if pl != b_pl:
        raise ValueError(
            f"tpf.matmul inputs live on different placements: a on {pl}, b on {b_pl}; move one first, "
            f"e.g. b = tpf.to_global(b, placement=tpf.get_placement(a))"
        )
    if a.ndim < 2 or b.ndim < 2 or (b.ndim > 2 and (b.ndim != a.ndim or a.shape[:-2] != b.shape[:-2])):
        raise ValueError(
            f"tpf.matmul multiplies a [..., M, K] by b [K, N] or by b [..., K, N] with a's batch dims; "
            f"got a {tuple(a.shape)} and b {tuple(b.shape)}"
        )
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"tpf.matmul inner sizes differ: a {tuple(a.shape)} @ b {tuple(b.shape)} ({a.shape[-1]} != "
                         f"{b.shape[-2]})")
    a_sbps, b_sbps = get_sbp(a), get_sbp(b)
    nbytes = [t.numel() * t.element_size() for t in (a, b)]
    a_to, b_to, out = infer_matmul(a_sbps, b_sbps, a.ndim, b.ndim, *nbytes, pl.hierarchy)
    if (a_to, b_to) != (a_sbps, b_sbps):
        config.debug("matmul %s x %s has no signature on %s: boxing to %s x %s -> %s (fewest bytes)",
                  a_sbps, b_sbps, pl, a_to, b_to, out)
        a, b = to_global(a, sbp=a_to), to_global(b, sbp=b_to)
    else:
        config.debug("matmul %s x %s -> %s on %s", a_sbps, b_sbps, out, pl)
    return _Matmul.apply(a, b, pl, out)
