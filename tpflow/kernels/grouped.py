"""The grouped GEMM of a mixture of experts: every local expert's product on its own rows in one launch, instead of a
loop of one matmul (and one host read of the token counts) per expert.

    x     [S, K]       the routed tokens, sorted by expert
    offs  [E]          int32 cumulative row ends: expert e owns rows offs[e-1] .. offs[e]; rows past offs[-1] (another
                       rank's tokens, transformers' expert-parallel sentinels) belong to none and come out as zeros
    w     [E, K, N]    one weight per expert; transformers stores gate_up_proj as [E, 2I, H] and reads
                       w = gate_up_proj.mT, a view the kernels read in place
    forward   y[rows of e]  = act(x[rows of e] @ w[e])        gated: act(x @ w[e][:, :N/2]) * (x @ w[e][:, N/2:])
    dgrad     dx[rows of e] = dz[rows of e] @ w[e]^T          the same kernel on w.mT
    wgrad     dw[e]         = x[rows of e]^T @ dz[rows of e]  dz = dy * act'(z) from the saved pre-activation z

The gated epilogue is a SwiGLU / GeGLU expert's ``act(gate) * up`` fused while both accumulators are in registers,
for w's columns as [gate half ; up half] (transformers' concatenated layout): the ``[S, N]`` product is stored only
as the pre-activation the backward needs, and ``[S, N/2]`` comes out.

Dispatch as ``matmul``'s: CUDA tensors run the Triton kernels (``grouped_tiles``); CPU tensors run the torch
reference (a loop of ``torch.matmul``) unless the ``kernels`` switch is ``"triton"``, which runs the kernels through
Triton's interpreter. The reference loops rather than calling ``torch._grouped_mm``: on CPU that took the loop's time
(22-23 against 21-23 ms for 4096 rows over 8 experts, K = N = 512, fp32, on a 2-core VM), needs 16-byte aligned
strides, and leaves the rows past ``offs[-1]`` (and their input gradient) uninitialised. fp64 runs the reference
(the kernels sum in fp32).
"""

from __future__ import annotations

import importlib.util
import itertools

import torch

from tpflow.kernels.epilogue import ACTIVATIONS, accumulate_dtype, activate, activation_grad, needs_pre, saved_for_grad
from tpflow.kernels.linear import wanted
from tpflow.kernels.matmul import use_triton

if importlib.util.find_spec("triton") is not None:
    from tpflow.kernels import grouped_tiles
else:  # CPU installs without triton run the torch reference
    grouped_tiles = None

__all__ = ["grouped_mm", "grouped_mm_ref"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def grouped_mm_ref(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *, activation: str | None = None,
                   gated: bool = False, out_dtype: torch.dtype | None = None, upcast: bool = False) -> torch.Tensor:
    """The torch reference of ``grouped_mm``: a loop of ``torch.matmul`` over the experts, differentiable by autograd.

    Args:
        x, w, offs, activation, gated, out_dtype: as in ``grouped_mm``.
        upcast: compute in float64 and return float64 (the reference a tolerance is measured against).

    Returns:
        ``[S, N]`` (``[S, N/2]`` gated), zeros on the rows past ``offs[-1]``.

    Example::

        >>> x, w = torch.ones(4, 2), torch.stack([torch.eye(2), 2 * torch.eye(2)])
        >>> grouped_mm_ref(x, w, torch.tensor([1, 3], dtype=torch.int32))
        tensor([[1., 1.],
                [2., 2.],
                [2., 2.],
                [0., 0.]])
    """
    if upcast:
        x, w = x.double(), w.double()
    bounds = [0, *offs.tolist()]
    products = [x[start:end] @ w[e] for e, (start, end) in enumerate(itertools.pairwise(bounds))]
    z = torch.cat([*products, x.new_zeros(x.shape[0] - bounds[-1], w.shape[2])])
    if gated:
        gate, up = z.chunk(2, -1)
        y = activate(gate, activation) * up
    else:
        y = activate(z, activation)
    return y if upcast else y.to(out_dtype or x.dtype)


def _check(x, w, offs, activation, gated, out_dtype) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
    if x.ndim != 2 or w.ndim != 3 or offs.ndim != 1:
        raise ValueError(f"grouped_mm takes x [S, K], w [E, K, N] and offs [E], got x {tuple(x.shape)}, w "
                         f"{tuple(w.shape)} and offs {tuple(offs.shape)}")
    if x.shape[1] != w.shape[1] or offs.shape[0] != w.shape[0]:
        raise ValueError(f"grouped_mm sizes differ: x {tuple(x.shape)} @ w {tuple(w.shape)} (K must match) with offs "
                         f"{tuple(offs.shape)} (one end row per expert)")
    if x.dtype != w.dtype or x.dtype not in _FLOATS or (out_dtype is not None and out_dtype not in _FLOATS):
        raise ValueError(f"grouped_mm takes x and w of one floating dtype (and a floating out_dtype): x is {x.dtype}, "
                         f"w is {w.dtype}, out_dtype {out_dtype}")
    if offs.dtype not in (torch.int32, torch.int64) or offs.device != x.device:
        raise ValueError(f"offs must be int32 or int64 on x's device ({x.device}), got {offs.dtype} on {offs.device}")
    if gated and w.shape[2] % 2:
        raise ValueError(f"gated: w's {w.shape[2]} columns must be an even [gate half ; up half]")
    if offs.device.type == "cpu" and offs.numel():  # (on a GPU this check would wait for it: the kernels clip instead)
        steps = offs.diff(prepend=offs.new_zeros(1))
        if (steps < 0).any() or offs[-1] > x.shape[0]:
            raise ValueError(f"offs must be non-decreasing cumulative row ends from 0 to at most x's {x.shape[0]} "
                             f"rows, got {offs.tolist()}")


def _pre_grad(dy: torch.Tensor, saved: torch.Tensor, activation: str | None, gated: bool) -> torch.Tensor:
    """dz, the gradient of the product before the epilogue, from dy and what the forward saved (gated: the
    ``[gate ; up]`` pre-activation, the slopes taken in ``accumulate_dtype``)."""
    if not gated:
        return activation_grad(dy, saved, activation)
    wide = accumulate_dtype(saved.dtype)
    gate, up = saved.to(wide).chunk(2, -1)
    dy = dy.to(wide)
    return torch.cat([activation_grad(dy * up, gate, activation), dy * activate(gate, activation)], -1)


def _product(x, w, offs, activation, gated, out_dtype, pre) -> torch.Tensor:
    y = torch.empty(x.shape[0], w.shape[2] // 2 if gated else w.shape[2], dtype=out_dtype, device=x.device)
    if y.numel():
        grouped_tiles.product(x, w, offs, y, pre, ACTIVATIONS[activation], gated)
    return y


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offs, activation, gated, out_dtype):
        pre = torch.empty(x.shape[0], w.shape[2], dtype=x.dtype, device=x.device) \
            if gated or needs_pre(activation) else None
        y = _product(x, w, offs, activation, gated, out_dtype, pre)
        ctx.activation, ctx.gated = activation, gated
        ctx.save_for_backward(x, w, offs, pre if gated else saved_for_grad(y, pre, activation))
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, offs, saved = ctx.saved_tensors
        dz = _pre_grad(dy, saved, ctx.activation, ctx.gated).to(x.dtype)
        dx = dw = None
        if wanted(ctx, 0):
            dx = _product(dz, w.mT, offs, None, False, x.dtype, None)
        if wanted(ctx, 1):
            dw = torch.empty(w.shape, dtype=w.dtype, device=w.device)
            if dw.numel():
                grouped_tiles.weight_grad(x, dz, offs, dw)
        return dx, dw, None, None, None, None


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *, activation: str | None = None,
               gated: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Every expert's ``act(x[rows of e] @ w[e])`` in one kernel launch, differentiable (backward: two launches).

    The rows are sorted by expert; those past ``offs[-1]`` belong to no expert and come out as zeros (their input
    gradient too). Sums are kept in fp32 whatever the operands' dtype. The host never reads ``offs`` on a GPU (no
    sync): there its values are not checked, and must be non-decreasing and at most S.

    Args:
        x: ``[S, K]``, the tokens sorted by expert; any strides.
        w: ``[E, K, N]`` of x's dtype, any strides: transformers' ``gate_up_proj [E, 2I, H]`` is read as
            ``gate_up_proj.mT`` in place.
        offs: ``[E]`` int32 (or int64) cumulative row ends: expert e owns rows ``offs[e-1]`` to ``offs[e]``.
        activation: ``None``, ``"relu"``, ``"gelu"`` (tanh form) or ``"silu"``, fused into the kernel.
        gated: w's N columns are ``[gate half ; up half]`` and the result is ``act(gate) * up`` (SwiGLU with silu).
        out_dtype: the result's dtype (default: x's).

    Returns:
        ``[S, N]``, or ``[S, N/2]`` gated.

    Example::

        >>> x, w = torch.randn(6, 4), torch.randn(3, 4, 8)
        >>> offs = torch.tensor([2, 2, 5], dtype=torch.int32)       # 2 rows, none, 3 rows; row 5 is no expert's
        >>> y = grouped_mm(x, w, offs, activation="silu", gated=True)
        >>> y.shape, y[5].abs().sum().item()
        (torch.Size([6, 4]), 0.0)
        >>> torch.testing.assert_close(y, grouped_mm_ref(x, w, offs, activation="silu", gated=True))
    """
    _check(x, w, offs, activation, gated, out_dtype)
    # no triton_min_rows here: torch's path on a GPU is E launches after a host sync, no cheaper for a few rows
    if x.dtype == torch.float64 or not use_triton(x):
        return grouped_mm_ref(x, w, offs, activation=activation, gated=gated, out_dtype=out_dtype)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _GroupedMM.apply(x, w, offs, activation, gated, out_dtype or x.dtype)
    return _product(x, w, offs, activation, gated, out_dtype or x.dtype, None)  # inference: no pre-activation stored
