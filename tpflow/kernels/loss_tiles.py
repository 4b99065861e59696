"""The Triton kernels of ``tpflow.kernels.cross_entropy``: one program per row of logits, walking its classes
in blocks, so a row of any width is read once per kernel and nothing of ``[rows, classes]`` is allocated.

``stats_kernel`` (forward): the online logsumexp of the row, as Liger-Kernel's cross-entropy computes it,
plus the logit of the row's target where this block of classes holds it and, with label smoothing, the
row's sum of logits:

    m, s = -inf, 0
    for each block of classes:
        m_new = max(m, max(x_block));  s = s * exp(m - m_new) + sum(exp(x_block - m_new));  m = m_new
    stats[:, row] = (m, s, x[target] if here else 0, sum(x) if smoothing else 0)

``grad_kernel`` (backward, or the fused loss's forward): with the row's logsumexp ``lse`` over every rank's
classes, ``scale * (exp(x - lse) - smoothing / classes - (1 - smoothing) * [class == target])``, written
over the logits themselves when the caller passes them as the output (the fused head + loss does).
This module needs triton; ``tpflow.kernels.cross_entropy`` imports it only where triton is installed.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["grad_kernel", "stats_kernel"]


@triton.jit
def stats_kernel(x_ptr, stride_x, target_ptr, stats_ptr, rows, classes, start, SMOOTHING: tl.constexpr,
                 BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    target = tl.load(target_ptr + row) - start
    m = float("-inf")
    s = 0.0
    picked = 0.0
    total = 0.0
    for first in range(0, classes, BLOCK):
        cols = first + tl.arange(0, BLOCK)
        inside = cols < classes
        x = tl.load(x_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: sums stay 0, not nan
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), 0)
        m = m_new
        picked += tl.sum(tl.where(inside & (cols == target), x, 0.0), 0)
        if SMOOTHING:
            total += tl.sum(tl.where(inside, x, 0.0), 0)
    tl.store(stats_ptr + row, m)
    tl.store(stats_ptr + rows + row, s)
    tl.store(stats_ptr + 2 * rows + row, picked)
    tl.store(stats_ptr + 3 * rows + row, total)


@triton.jit
def grad_kernel(x_ptr, stride_x, out_ptr, stride_out, target_ptr, lse_ptr, scale_ptr, classes, start, off_value,
                on_value, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, out_row = x_ptr + row * stride_x, out_ptr + row * stride_out
    target = tl.load(target_ptr + row) - start
    lse = tl.load(lse_ptr + row)
    scale = tl.load(scale_ptr + row)
    for first in range(0, classes, BLOCK):
        cols = first + tl.arange(0, BLOCK)
        inside = cols < classes
        x = tl.load(x_row + cols, mask=inside, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) - off_value - tl.where(cols == target, on_value, 0.0)
        g = tl.where(scale == 0.0, 0.0, g * scale)  # an ignored row: zero, whatever its logits
        tl.store(out_row + cols, g.to(out_ptr.dtype.element_ty), mask=inside)
