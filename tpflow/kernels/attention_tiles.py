"""The Triton kernels of ``tpflow.kernels.attention``: a flash-attention forward that also writes the log-sum-exp, for
one block of queries against one block of keys / values that may sit anywhere in the sequence (a ring's blocks), and
the tile helpers and launch its backward (``attention_grad_tiles``) shares.

Positions are global: query i is at ``q_offset + i``, key j at ``k_offset + j``, and causal attention hides key j
from query i where ``j > i + diag``, ``diag = q_offset - k_offset``: only the difference reaches the kernels. Query
head h reads kv head ``h // GROUP`` (GQA: k and v are never repeated). Every tensor is read through its strides.
Scores are kept in base 2, ``s = (q . k) * scale * log2(e)``, so that exp2 serves for exp.

``forward_kernel``: one program per (query tile, batch * query head):

    m, l, acc = -inf, 0, 0                                   # per row: running max, sum of exp2, weighted sum of v
    for each key tile before the causal bound:               # the tiles past it are all masked: not visited
        s = q @ k^T * scale * log2(e)                        # masked to -inf only on tiles crossing the diagonal / Lk
        m_new = max(m, rowmax(s));  p = exp2(s - m_new)
        l = l * exp2(m - m_new) + rowsum(p);  acc = acc * exp2(m - m_new) + p @ v;  m = m_new
    out = acc / l;  lse = (m + log2(l)) * ln(2)              # a row that sees no key: out = 0, lse = -inf

BOUNDED (packed documents, sliding windows, left padding): each query also has a first visible key ``lo`` (an index
into the key block, nondecreasing along the queries), so it sees keys ``lo .. i + diag``. The forward and dq visit
the key tiles from the tile's smallest ``lo``; kv_grad the query tiles up to its keys' last query (``last``, found
from ``lo`` by a search); every tile visited is masked.

Configs: one pinned 16 x 16 tile under the interpreter (several tiles at test sizes), else a few tiles autotuned per
bucketed shape. They are a first guess after Triton's tutorial 06 (forward 64-128 query rows by 32-128 keys; backward
narrow tiles along the dimension the program loops over), not yet timed on a GPU. Compiled offline for sm_90 (as
``benchmarks/kernels_compiled.py`` compiles the matmul kernels), in bf16 at head dims 64 and 128 every config fits
shared memory, runs on wgmma with cp.async loads and spills nothing (kv_grad's 64 x 64 at head dim 128 excepted,
which the autotuner can pass over). fp32 operands run correct but slow: full-precision fp32 dots are FMA loops that
spill at every config.

This module needs triton; ``tpflow.kernels.attention`` imports it only where triton is installed.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from tpflow import config
from tpflow.kernels.launcher import input_precision, one_at_a_time
from tpflow.kernels.tiles import INTERPRET

__all__ = ["configs", "forward", "forward_kernel"]

KERNELS = ("forward", "kv_grad", "q_grad")
_KEY = ["Q_KEY", "K_KEY", "CAUSAL", "BOUNDED", "HEAD_DIM"]
LOG2E = tl.constexpr(math.log2(math.e))
_LN2 = tl.constexpr(math.log(2.0))
DELTA_ROWS = 16 if INTERPRET else 128  # rows a delta program reads: tutorial 06's PRE_BLOCK


def configs(kernel: str, autotune: bool) -> list[triton.Config]:
    """The tile configs ``kernel`` is tuned over.

    Args:
        kernel: ``"forward"``, ``"kv_grad"`` or ``"q_grad"``.
        autotune: the list to sweep (True) or the one pinned config (False); one config under the interpreter.

    Returns:
        Triton configs: ``BLOCK_M`` query rows by ``BLOCK_N`` key rows a step.

    Example::

        >>> [len(configs(kernel, autotune=False)) for kernel in ("forward", "kv_grad", "q_grad")]
        [1, 1, 1]
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if INTERPRET:  # 16-row tiles: the tests' few dozen tokens still span several tiles, partial ones included
        shapes = [(16, 16, 1, 4)]
    elif not autotune:  # 2 stages: fp32 operands of head dim 128 fit shared memory too (the GPU tests)
        shapes = {"forward": [(64, 64, 2, 4)], "kv_grad": [(32, 64, 2, 8)], "q_grad": [(64, 32, 2, 4)]}[kernel]
    elif kernel == "forward":
        shapes = [(128, 64, 3, 8), (128, 64, 4, 8), (128, 128, 3, 8), (64, 64, 3, 4), (64, 32, 4, 4)]
    elif kernel == "kv_grad":  # holds its key tile's k, v, dk and dv: 8 warps (4 spilled 40-156 bytes at head dim 128)
        shapes = [(32, 128, 2, 8), (16, 128, 3, 8), (32, 64, 2, 8), (64, 64, 3, 8)]
    else:  # holds its query tile's q, dout and dq: wide in queries, narrow in keys
        shapes = [(128, 32, 3, 8), (64, 32, 3, 4), (128, 64, 3, 8), (64, 16, 4, 4)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_stages=s, num_warps=w) for m, n, s, w in shapes]


@triton.jit
def tile_ptrs(ptr, b, h, rows, offs_d, stride_b, stride_h, stride_row, stride_d):
    """Pointers to a tile of head ``h`` of batch ``b``: its ``rows`` by ``offs_d``."""
    return ptr + b * stride_b + h * stride_h + rows[:, None] * stride_row + offs_d[None, :] * stride_d


@triton.jit
def load_tile(ptrs, rows, n, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    """A tile of ``rows`` (zeros past row ``n`` where ROWS asks for the check) by ``offs_d`` (zeros past HEAD_DIM)."""
    if ROWS:
        if HEAD_DIM == BLOCK_D:
            tile = tl.load(ptrs, mask=rows[:, None] < n, other=0.0)
        else:
            tile = tl.load(ptrs, mask=(rows[:, None] < n) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    elif HEAD_DIM == BLOCK_D:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return tile


@triton.jit
def visible(queries, keys, Lk, diag, lo, CAUSAL: tl.constexpr, BOUNDED: tl.constexpr):
    """Which (query, key) pairs attend: keys before Lk, causal not after the query's position, BOUNDED not before
    the query's first key ``lo``. ``queries`` (and ``lo``) and ``keys`` are indices into their blocks, shaped to
    broadcast against each other ([BM, 1] and [1, BN], or transposed)."""
    keep = keys < Lk
    if CAUSAL:
        keep = keep & (keys <= queries + diag)
    if BOUNDED:
        keep = keep & (keys >= lo)
    return keep


@triton.jit
def key_bounds(first_row, Lk, diag, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(full, end) for the query tile from ``first_row``: the key tiles before ``full`` are visible to every row of
    the tile (no mask), those in ``[full, end)`` need the mask, and the keys from ``end`` are hidden from every row."""
    full_tiles = Lk // BLOCK_N * BLOCK_N
    if CAUSAL:
        end = tl.minimum(tl.maximum(first_row + BLOCK_M + diag, 0), Lk)
        full = tl.minimum(tl.maximum(first_row + 1 + diag, 0) // BLOCK_N * BLOCK_N, full_tiles)
    else:
        end = Lk
        full = full_tiles
    return full, end


@triton.jit
def query_bounds(first_key, Lq, diag, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(start, full) for the key tile from ``first_key``: the queries before ``start`` see none of its keys, the
    query tiles in ``[start, full)`` need the mask, and those from ``full`` see all of them."""
    if CAUSAL:  # query i sees key j where i >= j - diag
        start = tl.maximum(first_key - diag, 0) // BLOCK_M * BLOCK_M
        full = tl.minimum(tl.cdiv(tl.maximum(first_key + BLOCK_N - 1 - diag, 0), BLOCK_M) * BLOCK_M, Lq)
    else:
        start = 0
        full = 0
    return start, full


@triton.jit
def row_first_keys(lo_ptr, b, rows, Lq, Lk):
    """Each row's first visible key (an index into the key block; Lk past Lq, so that such rows bound nothing)."""
    return tl.load(lo_ptr + b * Lq + rows, mask=rows < Lq, other=Lk)


@triton.jit
def base2_lse(lse_ptr, rows, Lq):
    """The rows' log-sum-exp in base 2; +inf for a row that sees no key (lse -inf) and past Lq, so that its
    recomputed probabilities exp2(s - lse2) are 0."""
    lse = tl.load(lse_ptr + rows, mask=rows < Lq, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)


@triton.jit
def _forward_tiles(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, rows, offs_n, offs_d, lo, hi, Lk, diag,
                   firsts, qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, BOUNDED: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                   INPUT_PRECISION: tl.constexpr):
    """The online softmax over the key tiles ``[lo, hi)``, masked where MASKED (``firsts``: the rows' first keys,
    where BOUNDED): the rows' output sums ``acc``, sums of exp2 ``l_i`` and maxima ``m_i``."""
    for start in range(lo, hi, BLOCK_N):
        cols = start + offs_n
        k = load_tile(k_ptrs + start * stride_kn, cols, Lk, offs_d, HEAD_DIM, BLOCK_D, MASKED)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        if MASKED:
            s = tl.where(visible(rows[:, None], cols[None, :], Lk, diag, firsts[:, None], CAUSAL, BOUNDED), s,
                         float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: sums stay 0, not nan
        alpha = tl.exp2(m_i - shift)
        p = tl.exp2(s - shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_tile(v_ptrs + start * stride_vn, cols, Lk, offs_d, HEAD_DIM, BLOCK_D, MASKED)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["diag"])  # diag changes from one ring step to the next
def forward_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, lo_ptr,  # lo: [B, Lq] int32, each query's first key (BOUNDED)
    # sizes: Lq queries and Lk keys a head, Hq query heads, GROUP query heads a kv head; causal: keys j <= i + diag
    Lq, Lk, Hq, GROUP, diag, qk_scale,
    stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_om, stride_od,
    # autotune keys: the lengths rounded to powers of two, so a few tokens more do not re-tune
    Q_KEY, K_KEY,
    CAUSAL: tl.constexpr, BOUNDED: tl.constexpr, HEAD_DIM: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  # BLOCK_D: HEAD_DIM up to a power of two
):
    bh = tl.program_id(1)
    b, h = (bh // Hq).to(tl.int64), (bh % Hq).to(tl.int64)
    first_row = tl.program_id(0) * BLOCK_M
    rows = first_row + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = load_tile(tile_ptrs(q_ptr, b, h, rows, offs_d, stride_qb, stride_qh, stride_qm, stride_qd), rows, Lq, offs_d,
                  HEAD_DIM, BLOCK_D, True)
    k_ptrs = tile_ptrs(k_ptr, b, h // GROUP, offs_n, offs_d, stride_kb, stride_kh, stride_kn, stride_kd)
    v_ptrs = tile_ptrs(v_ptr, b, h // GROUP, offs_n, offs_d, stride_vb, stride_vh, stride_vn, stride_vd)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    full, end = key_bounds(first_row, Lk, diag, CAUSAL, BLOCK_M, BLOCK_N)
    if BOUNDED:  # every tile from the rows' first key masked
        firsts = row_first_keys(lo_ptr, b, rows, Lq, Lk)
        full = tl.maximum(tl.min(firsts, 0), 0) // BLOCK_N * BLOCK_N
    else:
        firsts = rows
        acc, l_i, m_i = _forward_tiles(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, rows, offs_n, offs_d, 0,
                                       full, Lk, diag, firsts, qk_scale, False, CAUSAL, False, HEAD_DIM, BLOCK_D,
                                       BLOCK_N, INPUT_PRECISION)
    acc, l_i, m_i = _forward_tiles(acc, l_i, m_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, rows, offs_n, offs_d, full,
                                   end, Lk, diag, firsts, qk_scale, True, CAUSAL, BOUNDED, HEAD_DIM, BLOCK_D, BLOCK_N,
                                   INPUT_PRECISION)
    seen = l_i > 0.0
    l_i = tl.where(seen, l_i, 1.0)
    tl.store(tile_ptrs(out_ptr, b, h, rows, offs_d, stride_ob, stride_oh, stride_om, stride_od),
             (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < Lq) & (offs_d[None, :] < HEAD_DIM))
    tl.store(lse_ptr + bh.to(tl.int64) * Lq + rows, tl.where(seen, (m_i + tl.log2(l_i)) * _LN2, float("-inf")),
             mask=rows < Lq)


@functools.cache
def _tuned(fn: triton.JITFunction, kernel: str, autotune: bool) -> triton.runtime.Autotuner:
    return triton.autotune(configs=configs(kernel, autotune), key=_KEY)(fn)


def launch(fn: triton.JITFunction, kernel: str, grid, *args, **kwargs) -> None:
    """Run the attention kernel ``fn`` (named ``kernel`` in ``configs``) over ``grid``, autotuned where the switch
    asks, one launch at a time."""
    autotune = bool(config.get("autotune")) and not INTERPRET
    with one_at_a_time():
        _tuned(fn, kernel, autotune)[grid](*args, **kwargs)


def kernel_meta(q: torch.Tensor, k: torch.Tensor, causal: bool, lo: torch.Tensor | None) -> dict:
    """The keyword arguments every attention kernel takes: autotune keys and the shape's constexprs."""
    D = q.shape[-1]
    return dict(Q_KEY=triton.next_power_of_2(q.shape[2]), K_KEY=triton.next_power_of_2(k.shape[2]), CAUSAL=causal,
                BOUNDED=lo is not None, HEAD_DIM=D, INPUT_PRECISION=input_precision(q),
                BLOCK_D=max(16, triton.next_power_of_2(D)))


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, scale: float,
            diag: int, causal: bool, lo: torch.Tensor | None = None) -> None:
    """Launch the attention of ``q`` on ``k`` / ``v`` into ``out`` and its log-sum-exp into ``lse``.
    ``tpflow.kernels.attention`` checks the arguments and calls this.

    Args:
        q: ``[B, Hq, Lq, D]``, any strides.
        k, v: ``[B, Hkv, Lk, D]`` of q's dtype, Hq a multiple of Hkv, any strides.
        out: ``[B, Hq, Lq, D]``, the result, any strides.
        lse: ``[B, Hq, Lq]`` fp32, contiguous.
        scale: the scores' factor.
        diag: ``q_offset - k_offset``; causal hides key j from query i where ``j > i + diag``.
        causal: mask the keys after each query.
        lo: ``[B, Lq]`` int32 contiguous, each query's first visible key (an index into k, nondecreasing along each
            row: packed documents, sliding windows), or None.

    Example::

        >>> q, k, v = torch.randn(1, 2, 5, 16), torch.randn(1, 1, 3, 16), torch.randn(1, 1, 3, 16)
        >>> out, lse = torch.empty_like(q), torch.empty(1, 2, 5)
        >>> forward(q, k, v, out, lse, 0.25, diag=-2, causal=True)   # queries at 0..4, keys at 2..4
        >>> lse[0, 0, :2]                                          # rows that see no key
        tensor([-inf, -inf])
        >>> out[0, 0, :2].abs().sum().item()
        0.0
    """
    B, Hq, Lq, _ = q.shape

    def grid(META):
        return (triton.cdiv(Lq, META["BLOCK_M"]), B * Hq)

    launch(forward_kernel, "forward", grid, q, k, v, out, lse, lse if lo is None else lo, Lq, k.shape[2], Hq,
           Hq // k.shape[1], diag, scale * math.log2(math.e), *q.stride(), *k.stride(), *v.stride(), *out.stride(),
           **kernel_meta(q, k, causal, lo))
