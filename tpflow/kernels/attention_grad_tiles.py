"""The backward Triton kernels of ``tpflow.kernels.attention`` (flash-attention 2's: the probabilities recomputed
from the saved log-sum-exp), on the forward's tiles and launch (``attention_tiles``, whose docstring has the
positions, GQA, base-2 scores, BOUNDED first keys and the configs).

``delta_kernel`` (the backward's first step): ``delta = rowsum(dout * out) - dlse``. With ``P = softmax(S)``,
``out = P V`` and ``lse = logsumexp(S)``, ``dS = P * (dP - rowsum(dout * out)) + P * dlse = P * (dP - delta)``
(``dP = dout V^T``): one term serves the gradient of both outputs. A row that sees no key gets delta = 0 (it has no
gradient, whatever its dlse).

``kv_grad_kernel``: one program per (key tile, batch * kv head), summing over the GROUP query heads that read it:

    for each query head of the kv head, for each query tile from the causal bound:
        P^T = exp2(k @ q^T * scale * log2(e) - lse * log2(e))   # masked only on tiles crossing the diagonal
        dv += P^T @ dout;  dk += (P^T * (v @ dout^T - delta)) @ q
    dk *= scale

``q_grad_kernel``: one program per (query tile, batch * query head), over the key tiles the forward visits:
``dq += (P * (dout @ v^T - delta)) @ k``, then ``dq *= scale``.

This module needs triton; ``tpflow.kernels.attention`` imports it only where triton is installed.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tpflow.kernels.attention_tiles import (
    DELTA_ROWS,
    base2_lse,
    kernel_meta,
    key_bounds,
    launch,
    load_tile,
    query_bounds,
    row_first_keys,
    tile_ptrs,
    visible,
)

__all__ = ["backward", "delta_kernel", "kv_grad_kernel", "q_grad_kernel"]


@triton.jit
def delta_kernel(
    out_ptr, dout_ptr, lse_ptr, dlse_ptr, delta_ptr,
    # sizes: Lq rows a head, Hq heads; lse, dlse and delta are contiguous [B, Hq, Lq]
    Lq, Hq,
    stride_ob, stride_oh, stride_om, stride_od, stride_db, stride_dh, stride_dm, stride_dd,
    HAS_DLSE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    bh = tl.program_id(1)
    b, h = (bh // Hq).to(tl.int64), (bh % Hq).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    out = load_tile(tile_ptrs(out_ptr, b, h, rows, offs_d, stride_ob, stride_oh, stride_om, stride_od),
                rows, Lq, offs_d, HEAD_DIM, BLOCK_D, True)
    dout = load_tile(tile_ptrs(dout_ptr, b, h, rows, offs_d, stride_db, stride_dh, stride_dm, stride_dd),
                 rows, Lq, offs_d, HEAD_DIM, BLOCK_D, True)
    stats = bh.to(tl.int64) * Lq + rows
    delta = tl.sum(out.to(tl.float32) * dout.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(dlse_ptr + stats, mask=rows < Lq, other=0.0)
    lse = tl.load(lse_ptr + stats, mask=rows < Lq, other=0.0)
    tl.store(delta_ptr + stats, tl.where(lse == float("-inf"), 0.0, delta), mask=rows < Lq)


@triton.jit
def _kv_grad_tiles(dk, dv, k, v, q_ptrs, dout_ptrs, lse_ptr, delta_ptr, stride_qm, stride_dm, offs_m, keys, offs_d,
                   lo, hi, Lq, Lk, diag, qk_scale, lo_ptr, b, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                   BOUNDED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                   INPUT_PRECISION: tl.constexpr):
    """dk and dv of one key tile, summed over the query tiles ``[lo, hi)`` of one query head."""
    for start in range(lo, hi, BLOCK_M):
        rows = start + offs_m
        firsts = row_first_keys(lo_ptr, b, rows, Lq, Lk) if BOUNDED else rows
        q = load_tile(q_ptrs + start * stride_qm, rows, Lq, offs_d, HEAD_DIM, BLOCK_D, True)
        dout = load_tile(dout_ptrs + start * stride_dm, rows, Lq, offs_d, HEAD_DIM, BLOCK_D, True)
        s = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION) * qk_scale
        p = tl.exp2(s - base2_lse(lse_ptr, rows, Lq)[None, :])  # P^T: [keys, queries]
        if MASKED:
            p = tl.where(visible(rows[None, :], keys[:, None], Lk, diag, firsts[None, :], CAUSAL, BOUNDED), p, 0.0)
        dv = tl.dot(p.to(dout.dtype), dout, dv, input_precision=INPUT_PRECISION)
        dp = tl.dot(v, tl.trans(dout), input_precision=INPUT_PRECISION)
        delta = tl.load(delta_ptr + rows, mask=rows < Lq, other=0.0)
        dk = tl.dot((p * (dp - delta[None, :])).to(q.dtype), q, dk, input_precision=INPUT_PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["diag"])
def kv_grad_kernel(
    q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, lo_ptr, last_ptr,  # last: [B, Lk] int32
    # sizes as the forward's, Hkv kv heads; lse and delta are contiguous [B, Hkv * GROUP, Lq]
    Lq, Lk, Hkv, GROUP, diag, qk_scale, scale,
    stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd, stride_db, stride_dh, stride_dm, stride_dd,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    Q_KEY, K_KEY,
    CAUSAL: tl.constexpr, BOUNDED: tl.constexpr, HEAD_DIM: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    bh = tl.program_id(1)
    b, kvh = (bh // Hkv).to(tl.int64), (bh % Hkv).to(tl.int64)
    first_key = tl.program_id(0) * BLOCK_N
    keys = first_key + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    k = load_tile(tile_ptrs(k_ptr, b, kvh, keys, offs_d, stride_kb, stride_kh, stride_kn, stride_kd), keys,
              Lk, offs_d, HEAD_DIM, BLOCK_D, True)
    v = load_tile(tile_ptrs(v_ptr, b, kvh, keys, offs_d, stride_vb, stride_vh, stride_vn, stride_vd), keys,
              Lk, offs_d, HEAD_DIM, BLOCK_D, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    start, full = query_bounds(first_key, Lq, diag, CAUSAL, BLOCK_M, BLOCK_N)
    if BOUNDED:  # every query tile up to the keys' last query masked
        last = tl.load(last_ptr + b * Lk + keys, mask=keys < Lk, other=-1)
        full = tl.minimum(tl.max(last, 0) + 1, Lq)
    for g in range(GROUP):  # GQA: every query head reading this kv head adds to its gradients here
        h = kvh * GROUP + g
        q_ptrs = tile_ptrs(q_ptr, b, h, offs_m, offs_d, stride_qb, stride_qh, stride_qm, stride_qd)
        dout_ptrs = tile_ptrs(dout_ptr, b, h, offs_m, offs_d, stride_db, stride_dh, stride_dm, stride_dd)
        stats = (b * Hkv * GROUP + h) * Lq
        dk, dv = _kv_grad_tiles(dk, dv, k, v, q_ptrs, dout_ptrs, lse_ptr + stats, delta_ptr + stats, stride_qm,
                                stride_dm, offs_m, keys, offs_d, start, full, Lq, Lk, diag, qk_scale, lo_ptr, b, True,
                                CAUSAL, BOUNDED, HEAD_DIM, BLOCK_D, BLOCK_M, INPUT_PRECISION)
        if not BOUNDED:
            dk, dv = _kv_grad_tiles(dk, dv, k, v, q_ptrs, dout_ptrs, lse_ptr + stats, delta_ptr + stats, stride_qm,
                                    stride_dm, offs_m, keys, offs_d, full, Lq, Lq, Lk, diag, qk_scale, lo_ptr, b, False,
                                    CAUSAL, False, HEAD_DIM, BLOCK_D, BLOCK_M, INPUT_PRECISION)
    mask = (keys[:, None] < Lk) & (offs_d[None, :] < HEAD_DIM)
    tl.store(tile_ptrs(dk_ptr, b, kvh, keys, offs_d, stride_dkb, stride_dkh, stride_dkn, stride_dkd),
             (dk * scale).to(dk_ptr.dtype.element_ty), mask=mask)
    tl.store(tile_ptrs(dv_ptr, b, kvh, keys, offs_d, stride_dvb, stride_dvh, stride_dvn, stride_dvd),
             dv.to(dv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _q_grad_tiles(dq, q, dout, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, rows, offs_n, offs_d, lo, hi, Lk,
                  diag, firsts, qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, BOUNDED: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  INPUT_PRECISION: tl.constexpr):
    """dq of one query tile over the key tiles ``[lo, hi)``, masked where MASKED."""
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n
        k = load_tile(k_ptrs + start * stride_kn, cols, Lk, offs_d, HEAD_DIM, BLOCK_D, MASKED)
        v = load_tile(v_ptrs + start * stride_vn, cols, Lk, offs_d, HEAD_DIM, BLOCK_D, MASKED)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        p = tl.exp2(s - lse2[:, None])
        if MASKED:
            p = tl.where(visible(rows[:, None], cols[None, :], Lk, diag, firsts[:, None], CAUSAL, BOUNDED), p, 0.0)
        dp = tl.dot(dout, tl.trans(v), input_precision=INPUT_PRECISION)
        dq = tl.dot((p * (dp - delta[:, None])).to(k.dtype), k, dq, input_precision=INPUT_PRECISION)
    return dq


@triton.jit(do_not_specialize=["diag"])
def q_grad_kernel(
    q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, delta_ptr, dq_ptr, lo_ptr,
    Lq, Lk, Hq, GROUP, diag, qk_scale, scale,
    stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd, stride_db, stride_dh, stride_dm, stride_dd,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    Q_KEY, K_KEY,
    CAUSAL: tl.constexpr, BOUNDED: tl.constexpr, HEAD_DIM: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    bh = tl.program_id(1)
    b, h = (bh // Hq).to(tl.int64), (bh % Hq).to(tl.int64)
    first_row = tl.program_id(0) * BLOCK_M
    rows = first_row + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = load_tile(tile_ptrs(q_ptr, b, h, rows, offs_d, stride_qb, stride_qh, stride_qm, stride_qd), rows,
              Lq, offs_d, HEAD_DIM, BLOCK_D, True)
    dout = load_tile(tile_ptrs(dout_ptr, b, h, rows, offs_d, stride_db, stride_dh, stride_dm, stride_dd),
                 rows, Lq, offs_d, HEAD_DIM, BLOCK_D, True)
    stats = bh.to(tl.int64) * Lq
    lse2 = base2_lse(lse_ptr + stats, rows, Lq)
    delta = tl.load(delta_ptr + stats + rows, mask=rows < Lq, other=0.0)
    k_ptrs = tile_ptrs(k_ptr, b, h // GROUP, offs_n, offs_d, stride_kb, stride_kh, stride_kn, stride_kd)
    v_ptrs = tile_ptrs(v_ptr, b, h // GROUP, offs_n, offs_d, stride_vb, stride_vh, stride_vn, stride_vd)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    full, end = key_bounds(first_row, Lk, diag, CAUSAL, BLOCK_M, BLOCK_N)
    if BOUNDED:  # every tile from the rows' first key masked, as in the forward
        firsts = row_first_keys(lo_ptr, b, rows, Lq, Lk)
        full = tl.maximum(tl.min(firsts, 0), 0) // BLOCK_N * BLOCK_N
    else:
        firsts = rows
        dq = _q_grad_tiles(dq, q, dout, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, rows, offs_n, offs_d, 0,
                           full, Lk, diag, firsts, qk_scale, False, CAUSAL, False, HEAD_DIM, BLOCK_D, BLOCK_N,
                           INPUT_PRECISION)
    dq = _q_grad_tiles(dq, q, dout, lse2, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, rows, offs_n, offs_d, full, end,
                       Lk, diag, firsts, qk_scale, True, CAUSAL, BOUNDED, HEAD_DIM, BLOCK_D, BLOCK_N, INPUT_PRECISION)
    tl.store(tile_ptrs(dq_ptr, b, h, rows, offs_d, stride_dqb, stride_dqh, stride_dqm, stride_dqd),
             (dq * scale).to(dq_ptr.dtype.element_ty), mask=(rows[:, None] < Lq) & (offs_d[None, :] < HEAD_DIM))


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
             dout: torch.Tensor, dlse: torch.Tensor | None, dq: torch.Tensor | None, dk: torch.Tensor | None,
             dv: torch.Tensor | None, scale: float, diag: int, causal: bool, lo: torch.Tensor | None = None) -> None:
    """Launch the gradients of ``forward``'s ``out`` and ``lse``: dq into ``dq``, dk and dv (summed over the query
    heads of each kv head) into ``dk`` and ``dv``.

    Args:
        q, k, v, scale, diag, causal, lo: as in ``forward``.
        out, lse: what ``forward`` wrote.
        dout: the gradient of ``out``, any strides.
        dlse: the gradient of ``lse``, contiguous fp32, or None (no gradient).
        dq: like q (any strides), or None not to compute it.
        dk, dv: like k and v (any strides), both or neither.

    Example::

        >>> from tpflow.kernels.attention_tiles import forward
        >>> q, k, v = (torch.randn(1, 2, 20, 16, requires_grad=True) for _ in range(3))
        >>> out, lse = torch.empty_like(q), torch.empty(1, 2, 20)
        >>> forward(q, k, v, out, lse, 0.25, diag=0, causal=True)
        >>> grads = [torch.empty_like(t) for t in (q, k, v)]
        >>> backward(q, k, v, out, lse, torch.ones_like(out), None, *grads, 0.25, diag=0, causal=True)
        >>> sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25)
        >>> want = torch.autograd.grad(sdpa.sum(), (q, k, v))
        >>> all(torch.allclose(g, w, atol=1e-5) for g, w in zip(grads, want))
        True
    """
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    meta = kernel_meta(q, k, causal, lo)
    delta = torch.empty_like(lse)
    delta_kernel[(triton.cdiv(Lq, DELTA_ROWS), B * Hq)](
        out, dout, lse, lse if dlse is None else dlse, delta, Lq, Hq, *out.stride(), *dout.stride(),
        HAS_DLSE=dlse is not None, HEAD_DIM=D, BLOCK_D=meta["BLOCK_D"], BLOCK_M=DELTA_ROWS)
    rest = (Hq // Hkv, diag, scale * math.log2(math.e), scale)  # GROUP, diag, qk_scale, scale
    strides = (*q.stride(), *k.stride(), *v.stride(), *dout.stride())
    if dk is not None:
        def kv_grid(META):
            return (triton.cdiv(Lk, META["BLOCK_N"]), B * Hkv)

        keys = torch.arange(Lk, dtype=torch.int32, device=q.device).expand(B, Lk).contiguous()
        last = None if lo is None else (torch.searchsorted(lo, keys, right=True) - 1).to(torch.int32)  # each key's
        launch(kv_grad_kernel, "kv_grad", kv_grid, q, k, v, dout, lse, delta, dk, dv,  # last query
               lse if lo is None else lo, lse if last is None else last, Lq, Lk, Hkv, *rest, *strides, *dk.stride(),
               *dv.stride(), **meta)
    if dq is not None:
        def q_grid(META):
            return (triton.cdiv(Lq, META["BLOCK_M"]), B * Hq)

        launch(q_grad_kernel, "q_grad", q_grid, q, k, v, dout, lse, delta, dq, lse if lo is None else lo, Lq, Lk, Hq,
               *rest, *strides, *dq.stride(), **meta)
