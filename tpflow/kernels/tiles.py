"""The Triton kernels of ``tpflow.kernels.matmul``: two matmul kernels with one fused epilogue.

``tiled``: one program per output tile, operands read through pointers with any strides.

    for each output tile (pid_m, pid_n), in grouped order:      # GROUP_M row-tiles share B tiles in L2
        acc = zeros(BLOCK_M, BLOCK_N, fp32)
        for k in range(0, K, BLOCK_K):
            acc += A[rows, k:k+BK] @ B[k:k+BK, cols]            # masked edges: any M, N, K
        acc = act(acc + bias[cols]) + ACC[rows, cols]           # epilogue while acc is in registers
        C[rows, cols] = acc.to(C.dtype)

``persistent``: one program per SM, each walking the tiles ``pid, pid + programs, ...`` in the
same grouped order. A, B and C move by TMA (tensor descriptors, Hopper and later): the descriptors
zero-fill loads past an edge and clip stores, so no masks are computed, and the tile loop is
flattened so that the compiler can overlap one tile's epilogue with the next tile's loads. It needs
16-byte aligned bases and row strides, one unit stride per operand (row-major, or transposed such
as ``w.mT``), and fp16 / bf16 operands (``launcher.tma_layouts``).

Both compute only the rows ``[row_start, row_end)``, whose tiles start at a rotated
``tile_offset`` (the ring collectives' chunks), and write C, ACC and PRE as just those rows.
Their configs and autotuning are in ``tuning``, the host side that picks and launches one in
``launcher``. This module needs triton; ``tpflow.kernels.matmul`` imports it only where triton is
installed.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

__all__ = ["INTERPRET", "activation", "persistent_kernel", "tiled_kernel"]

# Triton reads TRITON_INTERPRET when it decorates the kernels below (interpreted or compiled functions), so
# tpflow reads it then too: the launchers pick their configs and programs by it.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

@triton.jit
def activation(y, ACTIVATION: tl.constexpr):
    """``act(y)`` by the activation's code in ``tpflow.kernels.epilogue.ACTIVATIONS`` (gelu in tanh form), in
    registers: every kernel's epilogue."""
    if ACTIVATION == 1:
        y = tl.maximum(y, 0.0)
    elif ACTIVATION == 2:  # 0.5 (1 + tanh(u)) == sigmoid(2 u), u = sqrt(2 / pi) (x + 0.044715 x^3)
        y = y * tl.sigmoid(1.5957691216057308 * (y + 0.044715 * y * y * y))
    elif ACTIVATION == 3:
        y = y * tl.sigmoid(y)
    return y

@triton.jit
def _tile(tile, rows, N, tile_offset, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of a linear tile index: GROUP_M row-tiles sweep the columns together, and
    the row tiles are rotated by tile_offset."""
    num_pid_m = tl.cdiv(rows, BLOCK_M)
    group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (tile // group) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % group) % group_m
    pid_n = (tile % group) // group_m
    return (pid_m + tile_offset) % num_pid_m, pid_n

@triton.jit
def _halves(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A tile's left and right halves of columns, for an epilogue with half the registers live."""
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))

@triton.jit
def _epilogue(acc, offs_m, offs_n, rows, N, bias_ptr, acc_ptr, stride_accm, stride_accn,
              ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ACC: tl.constexpr):
    """(z, y) of one fp32 tile whose rows are ``offs_m`` of the range: z = acc + bias (the
    pre-activation), y = act(z) + ACC."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y = activation(acc, ACTIVATION)
    if HAS_ACC:
        mask = (offs_m[:, None] < rows) & (offs_n[None, :] < N)
        y += tl.load(acc_ptr + offs_m[:, None] * stride_accm + offs_n[None, :] * stride_accn, mask=mask,
                     other=0.0).to(tl.float32)
    return acc, y

# tile_offset varies from chunk to chunk of a ring: not specialised on (a value of 1 would otherwise
# compile a kernel of its own mid-training). The row range is: whether row_start and row_end are
# multiples of 16 decides if a transposed A's rows load as vectors (cp.async) or element by element.
@triton.jit(do_not_specialize=["tile_offset"])
def _tiled_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, acc_ptr, pre_ptr,
    # sizes: C rows [row_start, row_end) of A's rows, N columns, contraction K
    N, K, row_start, row_end, tile_offset,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_accm, stride_accn,
    # autotune keys: sizes rounded to powers of two, so a few rows more do not re-tune
    M_KEY, N_KEY, K_KEY,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ACC: tl.constexpr, STORE_PRE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    rows = row_end - row_start
    pid_m, pid_n = _tile(tl.program_id(0), rows, N, tile_offset, BLOCK_M, BLOCK_N, GROUP_M)
    out_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # C, ACC and PRE hold only the rows of the range
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (row_start + out_m)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    row_mask = out_m[:, None] < rows
    col_mask = offs_n[None, :] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(tl.cdiv(K, BLOCK_K)):
        if EVEN_K:  # no K mask: the loads stay simple enough to pipeline well
            a = tl.load(a_ptrs, mask=row_mask, other=0.0)
            b = tl.load(b_ptrs, mask=col_mask, other=0.0)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=row_mask & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & col_mask, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    # the epilogue in two halves of columns: half the registers live at once, so a fused GELU or an
    # fp32 partial does not spill
    left, right = _halves(acc, BLOCK_M, BLOCK_N)
    half_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 2)
    _store_half(left, out_m, half_n, rows, N, c_ptr, pre_ptr, stride_cm, stride_cn, bias_ptr, acc_ptr,
                stride_accm, stride_accn, ACTIVATION, HAS_BIAS, HAS_ACC, STORE_PRE)
    _store_half(right, out_m, half_n + BLOCK_N // 2, rows, N, c_ptr, pre_ptr, stride_cm, stride_cn, bias_ptr,
                acc_ptr, stride_accm, stride_accn, ACTIVATION, HAS_BIAS, HAS_ACC, STORE_PRE)

@triton.jit
def _store_half(acc, offs_m, offs_n, rows, N, c_ptr, pre_ptr, stride_cm, stride_cn, bias_ptr, acc_ptr,
                stride_accm, stride_accn, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
                HAS_ACC: tl.constexpr, STORE_PRE: tl.constexpr):
    """The epilogue of part of a tile, stored through pointers (masked at the edges)."""
    z, y = _epilogue(acc, offs_m, offs_n, rows, N, bias_ptr, acc_ptr, stride_accm, stride_accn,
                     ACTIVATION, HAS_BIAS, HAS_ACC)
    mask = (offs_m[:, None] < rows) & (offs_n[None, :] < N)
    if STORE_PRE:  # the pre-activation, for the backward of gelu / silu (same layout as C)
        tl.store(pre_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
                 z.to(pre_ptr.dtype.element_ty), mask=mask)
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, y.to(c_ptr.dtype.element_ty),
             mask=mask)

@triton.jit
def _store_tma(acc, m0, n0, offs_m, offs_n, rows, N, c_desc, pre_desc, bias_ptr, acc_ptr, stride_accm,
               stride_accn, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ACC: tl.constexpr,
               STORE_PRE: tl.constexpr):
    """The epilogue of one (sub)tile, stored by TMA at (m0, n0)."""
    z, y = _epilogue(acc, offs_m, offs_n, rows, N, bias_ptr, acc_ptr, stride_accm, stride_accn,
                     ACTIVATION, HAS_BIAS, HAS_ACC)
    if STORE_PRE:
        pre_desc.store([m0, n0], z.to(pre_desc.dtype))
    c_desc.store([m0, n0], y.to(c_desc.dtype))

@triton.jit(do_not_specialize=["row_start", "tile_offset"])  # TMA coordinates: alignment is no matter
def persistent_kernel(
    a_desc, b_desc, c_desc, pre_desc, bias_ptr, acc_ptr,
    # sizes: C rows [row_start, row_start + rows) of A's rows, N, K; c_desc holds just those rows
    row_start, rows, N, K, tile_offset, stride_accm, stride_accn,
    M_KEY, N_KEY, K_KEY,
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ACC: tl.constexpr, STORE_PRE: tl.constexpr,
    A_T: tl.constexpr, B_T: tl.constexpr,  # the descriptor holds the operand's transpose
    PROGRAMS: tl.constexpr, SUBTILE: tl.constexpr,  # SUBTILE: store C in two halves (less epilogue smem)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    tiles = tl.cdiv(rows, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=True):
        pid_m, pid_n = _tile(tile, rows, N, tile_offset, BLOCK_M, BLOCK_N, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            k0 = ki * BLOCK_K
            a = a_desc.load([k0, row_start + m0]).T if A_T else a_desc.load([row_start + m0, k0])
            b = b_desc.load([n0, k0]).T if B_T else b_desc.load([k0, n0])
            acc = tl.dot(a, b, acc)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        if SUBTILE:
            left, right = _halves(acc, BLOCK_M, BLOCK_N)
            offs_n = n0 + tl.arange(0, BLOCK_N // 2)
            _store_tma(left, m0, n0, offs_m, offs_n, rows, N, c_desc, pre_desc, bias_ptr, acc_ptr,
                       stride_accm, stride_accn, ACTIVATION, HAS_BIAS, HAS_ACC, STORE_PRE)
            _store_tma(right, m0, n0 + BLOCK_N // 2, offs_m, offs_n + BLOCK_N // 2, rows, N, c_desc,
                       pre_desc, bias_ptr, acc_ptr, stride_accm, stride_accn, ACTIVATION, HAS_BIAS, HAS_ACC,
                       STORE_PRE)
        else:
            _store_tma(acc, m0, n0, offs_m, n0 + tl.arange(0, BLOCK_N), rows, N, c_desc, pre_desc,
                       bias_ptr, acc_ptr, stride_accm, stride_accn, ACTIVATION, HAS_BIAS, HAS_ACC, STORE_PRE)

# EVEN_K: no K mask, so the loads stay simple enough to pipeline well
tiled_kernel = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(_tiled_kernel)
