"""The Triton kernels of ``tpflow.kernels.grouped``: every local expert's product in one launch, on rows sorted by
expert (expert e owns rows ``[offs[e-1], offs[e])``; the rows past ``offs[-1]`` belong to no expert).

``product_kernel`` (forward, and the input gradient with ``w.mT``): ``y[rows of e] = act(x[rows of e] @ w[e])``.
The row tiles of every expert, then those of the rows past the experts (written as zeros), are numbered one
after another; the grid holds an upper bound of them, ``cdiv(S, BLOCK_M) + E`` (each expert adds at most one
partial tile), so the host launches without reading ``offs``:

    for each program (row tile t, column tile n):
        e, rows = the segment holding row tile t            # a cumsum over the E + 1 segments' tile counts
        if t is past the last segment's tiles: exit
        acc = zeros(BLOCK_M, BLOCK_N, fp32)                  # and acc_up, gated
        for k in range(0, K, BLOCK_K) if e < E:             # the rows past the experts: no product
            acc += x[rows, k:k+BK] @ w[e, k:k+BK, cols]
            acc_up += x[rows, k:k+BK] @ w[e, k:k+BK, N + cols]      # gated: the up half's columns
        PRE[rows, cols] = acc;  PRE[rows, N + cols] = acc_up        # for the backward, when asked
        y[rows, cols] = act(acc) * acc_up  (gated)  or  act(acc)

``weight_grad_kernel`` (the weight gradient): ``dw[e] = x[rows of e]^T @ dy[rows of e]``, one program per (expert,
K tile, N tile) walking the expert's rows; an expert without rows gets zeros.

Configs: one small pinned config under the interpreter (several tiles per expert at test sizes), else a few 64- and
128-wide tiles, autotuned per bucketed shape. They are a first guess, not yet timed on a GPU
(``benchmarks/grouped_gpu.py`` will); compiled offline for sm_90 in bf16 (the MLP's four products, as
``benchmarks/kernels_compiled.py`` compiles the matmul kernels), every one fits shared memory and runs on wgmma with
cp.async pipelining, and only the gated product's 128-row tiles spill (8-12 bytes, at 255 registers).

This module needs triton; ``tpflow.kernels.grouped`` imports it only where triton is installed.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tpflow import config
from tpflow.kernels.launcher import input_precision, one_at_a_time
from tpflow.kernels.tiles import INTERPRET, activation

__all__ = ["configs", "product", "product_kernel", "weight_grad", "weight_grad_kernel"]

KERNELS = ("product", "weight_grad")
_KEYS = {"product": ["S_KEY", "N_KEY", "K_KEY", "E", "ACTIVATION", "GATED", "STORE_PRE"],
         "weight_grad": ["S_KEY", "N_KEY", "K_KEY", "E"]}


def configs(kernel: str, autotune: bool) -> list[triton.Config]:
    """The tile configs ``kernel`` is tuned over.

    Args:
        kernel: ``"product"`` or ``"weight_grad"``.
        autotune: the list to sweep (True) or the one pinned config (False); one config under the interpreter.

    Returns:
        Triton configs (``BLOCK_M`` is the rows a step reads: the product's output rows, the weight gradient's
        contraction).

    Example::

        >>> [len(configs(kernel, autotune=False)) for kernel in ("product", "weight_grad")]
        [1, 1]
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if INTERPRET:  # 16-row tiles: the tests' few rows per expert still span several tiles
        shapes = [(16, 32, 32, 1, 4)]
    elif not autotune:  # small K steps: 3 stages fit in shared memory for fp32 operands too (the GPU tests)
        shapes = [(128, 128, 32, 3, 8)] if kernel == "product" else [(32, 128, 128, 3, 8)]
    elif kernel == "product":  # a gated product holds two accumulators: no 256-wide tiles
        shapes = [(128, 128, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 32, 3, 8), (128, 64, 64, 4, 4),
                  (64, 128, 64, 4, 4), (64, 64, 64, 4, 4)]
    else:
        shapes = [(64, 128, 128, 3, 8), (64, 128, 128, 4, 8), (32, 128, 128, 3, 8), (64, 64, 128, 4, 4),
                  (64, 128, 64, 4, 4), (32, 64, 64, 4, 4)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_stages=s, num_warps=w)
            for m, n, k, s, w in shapes]


@triton.jit
def _segment(offs_ptr, tile, S, E, BLOCK_M: tl.constexpr, SEGMENTS: tl.constexpr):
    """(segment, first row, end row) of row tile ``tile``: segment e < E is expert e's rows, segment E the rows
    past ``offs[-1]``; a segment past E means the tile is past them all. Bounds are clipped to ``[0, S]``."""
    seg = tl.arange(0, SEGMENTS)
    ends = tl.minimum(tl.maximum(tl.load(offs_ptr + seg, mask=seg < E, other=S), 0), S)
    starts = tl.minimum(tl.maximum(tl.load(offs_ptr + seg - 1, mask=(seg > 0) & (seg <= E), other=0), 0), S)
    tiles = tl.where(seg <= E, tl.cdiv(tl.maximum(ends - starts, 0), BLOCK_M), 0)
    e = tl.sum((tl.cumsum(tiles, 0) <= tile).to(tl.int32), 0)
    before = tl.sum(tl.where(seg < e, tiles, 0), 0)
    start = tl.sum(tl.where(seg == e, starts, 0), 0)
    return e, start + (tile - before) * BLOCK_M, tl.sum(tl.where(seg == e, ends, 0), 0)


@triton.jit(do_not_specialize=["S"])  # S changes with every batch's token count
def _product_kernel(
    x_ptr, w_ptr, offs_ptr, y_ptr, pre_ptr,
    # sizes: S rows of x, E experts, N columns of y (a gated product reads 2N of w), contraction K
    S, E, N, K,
    stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_ym, stride_yn, stride_pm, stride_pn,
    # autotune keys: sizes rounded to powers of two, so a few rows more do not re-tune
    S_KEY, N_KEY, K_KEY,
    ACTIVATION: tl.constexpr, GATED: tl.constexpr, STORE_PRE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr, SEGMENTS: tl.constexpr,  # SEGMENTS: a power of two >= E + 1
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # row-major tile order: the programs running together share a row tile of x and sweep one expert's columns
    col_tiles = tl.cdiv(N, BLOCK_N)
    e, first, end = _segment(offs_ptr, tl.program_id(0) // col_tiles, S, E, BLOCK_M, SEGMENTS)
    if e > E:
        return
    rows = first + tl.arange(0, BLOCK_M)
    cols = (tl.program_id(0) % col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_mask = rows[:, None] < end
    col_mask = cols[None, :] < N
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + e.to(tl.int64) * stride_we + offs_k[:, None] * stride_wk + cols[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(tl.where(e < E, tl.cdiv(K, BLOCK_K), 0)):  # the rows past the experts: zeros
        if EVEN_K:  # no K mask: the loads stay simple enough to pipeline well
            x = tl.load(x_ptrs, mask=row_mask, other=0.0)
            w = tl.load(w_ptrs, mask=col_mask, other=0.0)
        else:
            k_mask = offs_k < K - k * BLOCK_K
            x = tl.load(x_ptrs, mask=row_mask & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask, other=0.0)
        acc = tl.dot(x, w, acc, input_precision=INPUT_PRECISION)
        if GATED:  # the up half: N columns to the right, multiplied by the same rows of x
            if EVEN_K:
                up = tl.load(w_ptrs + N * stride_wn, mask=col_mask, other=0.0)
            else:
                up = tl.load(w_ptrs + N * stride_wn, mask=k_mask[:, None] & col_mask, other=0.0)
            acc_up = tl.dot(x, up, acc_up, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    mask = row_mask & col_mask
    if STORE_PRE:  # the pre-activation, for the backward: [gate ; up] gated, like w's columns
        pre_ptrs = pre_ptr + rows.to(tl.int64)[:, None] * stride_pm + cols[None, :] * stride_pn
        tl.store(pre_ptrs, acc.to(pre_ptr.dtype.element_ty), mask=mask)
        if GATED:
            tl.store(pre_ptrs + N * stride_pn, acc_up.to(pre_ptr.dtype.element_ty), mask=mask)
    y = activation(acc, ACTIVATION)
    if GATED:
        y = y * acc_up
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :] * stride_yn, y.to(y_ptr.dtype.element_ty),
             mask=mask)


@triton.jit(do_not_specialize=["S"])
def weight_grad_kernel(
    x_ptr, dy_ptr, offs_ptr, dw_ptr,
    # sizes: S rows, E experts, dw[e] is [K, N]
    S, E, K, N,
    stride_xm, stride_xk, stride_dym, stride_dyn, stride_we, stride_wk, stride_wn,
    S_KEY, N_KEY, K_KEY,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # BLOCK_M: rows summed over a step
):
    e = tl.program_id(1)
    col_tiles = tl.cdiv(N, BLOCK_N)
    offs_k = (tl.program_id(0) // col_tiles) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = (tl.program_id(0) % col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    # offs clipped to [0, S]: its values are not checked on a GPU
    start = tl.minimum(tl.maximum(tl.load(offs_ptr + e - 1, mask=e > 0, other=0), 0), S)
    end = tl.minimum(tl.maximum(tl.load(offs_ptr + e), 0), S)
    rows = start + tl.arange(0, BLOCK_M)
    k_mask = offs_k[:, None] < K
    col_mask = cols[None, :] < N
    x_ptrs = x_ptr + offs_k[:, None] * stride_xk + rows.to(tl.int64)[None, :] * stride_xm  # x^T: [BLOCK_K, BLOCK_M]
    dy_ptrs = dy_ptr + rows.to(tl.int64)[:, None] * stride_dym + cols[None, :] * stride_dyn
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for m in range(tl.cdiv(end - start, BLOCK_M)):  # an expert without rows: none, and zeros are stored
        in_rows = rows < end - m * BLOCK_M
        x = tl.load(x_ptrs, mask=k_mask & in_rows[None, :], other=0.0)
        dy = tl.load(dy_ptrs, mask=in_rows[:, None] & col_mask, other=0.0)
        acc = tl.dot(x, dy, acc, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_M * stride_xm
        dy_ptrs += BLOCK_M * stride_dym
    tl.store(dw_ptr + e.to(tl.int64) * stride_we + offs_k[:, None] * stride_wk + cols[None, :] * stride_wn,
             acc.to(dw_ptr.dtype.element_ty), mask=k_mask & col_mask)


# EVEN_K: no K mask, so the loads stay simple enough to pipeline well
product_kernel = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(_product_kernel)

@functools.cache
def _tuned(kernel: str, autotune: bool) -> triton.runtime.Autotuner:
    fn = product_kernel if kernel == "product" else weight_grad_kernel
    return triton.autotune(configs=configs(kernel, autotune), key=_KEYS[kernel])(fn)


def _launch(kernel: str, grid, *args, **kwargs) -> None:
    autotune = bool(config.get("autotune")) and not INTERPRET
    with one_at_a_time():
        _tuned(kernel, autotune)[grid](*args, **kwargs)


def _keys(S: int, N: int, K: int) -> tuple[int, int, int]:
    return triton.next_power_of_2(max(S, 1)), triton.next_power_of_2(max(N, 1)), triton.next_power_of_2(max(K, 1))


def product(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, y: torch.Tensor, pre: torch.Tensor | None,
            activation: int, gated: bool) -> None:
    """Launch ``y = act(x @ w[e])`` on each expert's rows (gated: ``act(x @ w[e][:, :N]) * (x @ w[e][:, N:])`` for
    ``y [S, N]``), zeros on the rows past ``offs[-1]``, the pre-activation into ``pre``. ``tpflow.kernels.grouped``
    checks the arguments and calls this.

    Args:
        x: ``[S, K]``, any strides.
        w: ``[E, K, N]`` (``[E, K, 2N]`` gated), of x's dtype, any strides (``w.mT`` of ``[E, N, K]`` in place).
        offs: ``[E]`` int32 / int64, each expert's end row, non-decreasing, at most S.
        y: ``[S, N]``, the result.
        pre: ``[S, N]`` (``[S, 2N]`` gated) for the pre-activation, or None.
        activation: the activation's code in ``ACTIVATIONS``.
        gated: w's columns are the gate half then the up half.

    Example::

        >>> x, w = torch.ones(5, 3), torch.ones(2, 3, 4)
        >>> y = torch.full((5, 4), float("nan"))
        >>> product(x, w, torch.tensor([1, 3], dtype=torch.int32), y, None, 0, False)
        >>> y[:, 0]                               # experts 0 and 1 own rows 0-2; rows 3-4 belong to none
        tensor([3., 3., 3., 0., 0.])
    """
    S, K = x.shape
    E, N = w.shape[0], y.shape[1]
    pre_arg = y if pre is None else pre

    def grid(META):
        return ((triton.cdiv(S, META["BLOCK_M"]) + E) * triton.cdiv(N, META["BLOCK_N"]),)

    _launch("product", grid, x, w, offs, y, pre_arg, S, E, N, K, x.stride(0), x.stride(1), *w.stride(), *y.stride(),
            *pre_arg.stride(), *_keys(S, N, K), ACTIVATION=activation, GATED=gated, STORE_PRE=pre is not None,
            INPUT_PRECISION=input_precision(x), SEGMENTS=triton.next_power_of_2(E + 1))


def weight_grad(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor, dw: torch.Tensor) -> None:
    """Launch ``dw[e] = x[rows of e]^T @ dy[rows of e]`` for every expert (zeros for an expert without rows).

    Args:
        x: ``[S, K]``, any strides.
        dy: ``[S, N]``, of x's dtype, any strides.
        offs: ``[E]``, as in ``product``.
        dw: ``[E, K, N]``, the result.

    Example::

        >>> dw = torch.full((3, 2, 4), float("nan"))
        >>> weight_grad(torch.ones(5, 2), torch.ones(5, 4), torch.tensor([2, 2, 5], dtype=torch.int32), dw)
        >>> dw[:, 0, 0]                           # 2 rows, none, 3 rows
        tensor([2., 0., 3.])
    """
    S, K = x.shape
    E, N = dw.shape[0], dw.shape[2]

    def grid(META):
        return (triton.cdiv(K, META["BLOCK_K"]) * triton.cdiv(N, META["BLOCK_N"]), E)

    _launch("weight_grad", grid, x, dy, offs, dw, S, E, K, N, *x.stride(), *dy.stride(), *dw.stride(),
            *_keys(S, N, K), INPUT_PRECISION=input_precision(x))
