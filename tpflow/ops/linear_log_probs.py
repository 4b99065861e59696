"""Per-token log-probabilities and entropies straight from hidden states and a head whose rows (the vocabulary) are
split across ranks, chunk by chunk over the tokens: the logits are never whole, on any rank, nor alive beyond one
``[chunk, vocabulary / W]`` block (Liger's and TRL's fused heads, on a split vocabulary).

    forward    per chunk: y = h W_block^T + b -> z = softcap tanh(scale y / softcap) / T -> token_stats
               -> one all-gather of every chunk's [4 or 7, rows] -> log p(target), entropy (and the extras)
    backward   per chunk, the block recomputed: dz (log_prob_grad) -> dy -> dh = dy W_block, dW += dy^T h,
               db += sum dy; dh all-reduced over the vocabulary's ranks (each block adds to every hidden state)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tpflow import comm
from tpflow.ops.cross_entropy import check_targets
from tpflow.ops.log_probs import check_settings, combine, log_prob_grad, token_stats

__all__ = ["EXTRAS", "linear_log_probs"]

EXTRAS = ("log_sum_sq_probs", "mean_logits", "is_top1")  # TRL's names, in the order they are returned


def _scaled(y: torch.Tensor, scale: float, softcap: float | None, inv_t: float) -> tuple[torch.Tensor, torch.Tensor
                                                                                        | None]:
    """``z`` of a block's logits ``y`` (fp32 or wider, a fresh tensor: scaled in place), and ``tanh`` of the softcap
    (None without one)."""
    if softcap is None:
        return y.mul_(scale * inv_t), None
    t = y.mul_(scale / softcap).tanh_()
    return t * (softcap * inv_t), t


class _LinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, start, classes, group, shape, ignore_index, chunk, extras, dtypes):
        ctx.set_materialize_grads(False)  # an entropy only logged sends no gradient: none is computed for it
        dtype, wide = dtypes  # the product's, the statistics'
        stats = [hidden.new_zeros(7 if extras else 4, 0, dtype=wide)]
        w, b = (None if t is None else t.to(dtype) for t in (weight, bias))
        for first in range(0, hidden.shape[0], chunk):
            z = _scaled(F.linear(hidden[first:first + chunk].to(dtype), w, b).to(wide), *shape)[0]
            stats.append(token_stats(z, target[first:first + chunk], start, bool(extras)))
            del z  # before the next chunk's: one block alive
        numbers = combine(torch.cat(stats, 1), group, classes)
        valid = target != ignore_index
        ctx.save_for_backward(hidden, weight, bias, target, numbers.lse, numbers.entropy)
        ctx.args = start, group, shape, ignore_index, chunk, dtype
        more = [getattr(numbers, name) for name in ("log_sum_sq", "mean", "top1")] if extras else []
        ctx.mark_non_differentiable(*more)
        return torch.where(valid, numbers.picked - numbers.lse, 0.0), numbers.entropy, *more

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, *_):
        hidden, weight, bias, target, lse, entropy = ctx.saved_tensors
        start, group, (scale, softcap, inv_t), ignore_index, chunk, dtype = ctx.args
        needs = ctx.needs_input_grad[:3]
        if grad_logp is None and grad_entropy is None:
            return (None,) * 12
        wide = lse.dtype  # the gradients are summed in it, over chunks and ranks
        dh = torch.empty(hidden.shape, dtype=wide, device=hidden.device) if needs[0] else None
        dw = torch.zeros(weight.shape, dtype=wide, device=weight.device) if needs[1] else None
        db = torch.zeros(weight.shape[0], dtype=wide, device=weight.device) if bias is not None and needs[2] \
            else None
        w, b = (None if t is None else t.to(dtype) for t in (weight, bias))
        valid = target != ignore_index
        for first in range(0, hidden.shape[0], chunk):
            rows = slice(first, first + chunk)
            h = hidden[rows].to(dtype)
            z, t = _scaled(F.linear(h, w, b).to(wide), scale, softcap, inv_t)
            dy = log_prob_grad(z, target[rows], start, valid[rows], lse[rows], entropy[rows],
                               None if grad_logp is None else grad_logp[rows],
                               None if grad_entropy is None else grad_entropy[rows]).mul_(inv_t * scale)
            del z
            if t is not None:
                dy.mul_(t.square_().neg_().add_(1))  # d tanh = 1 - tanh^2
            dy = dy.to(dtype)  # the logits' gradient in the product's dtype, as autograd's would be
            if dh is not None:
                dh[rows] = _wide_mm(dy, w, wide)
            if dw is not None:
                dw += _wide_mm(dy.mT, h, wide)
            if db is not None:
                db += dy.sum(0, dtype=wide)
        if dh is not None and group is not None and dist.get_world_size(group) > 1:
            comm.all_reduce(dh, group)
        return (None if dh is None else dh.to(hidden.dtype), None if dw is None else dw.to(weight.dtype),
                None if db is None else db.to(bias.dtype), *(None,) * 9)


def _wide_mm(a: torch.Tensor, b: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
    """``a @ b`` summed in ``wide`` (fp32 for half-precision operands: each chunk's product is not rounded to bf16
    before the chunks are summed)."""
    if a.dtype == wide:
        return a @ b
    if a.is_cuda and wide == torch.float32 and a.dtype in (torch.float16, torch.bfloat16):
        return torch.mm(a, b, out_dtype=wide)
    return a.to(wide) @ b.to(wide)


def linear_log_probs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor, *,
                     start: int, classes: int, group: dist.ProcessGroup | None, temperature: float = 1.0,
                     ignore_index: int = -100, chunk: int = 1024, logit_scale: float = 1.0,
                     softcap: float | None = None, extras: bool = False,
                     dtype: torch.dtype | None = None, stats: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    """Each row's ``log_softmax(z).gather(target)`` and entropy of ``softmax(z)``, ``z = softcap * tanh(logit_scale *
    (hidden @ W.T + b) / softcap) / temperature`` (no tanh without a softcap), for a head whose rows are split over
    ``group``, ``chunk`` rows at a time, differentiable in ``hidden``, ``weight`` and ``bias``.

    Every rank of ``group`` calls it with the same rows and targets and its block of the head; each gets every row's
    numbers. One all-gather of ``[4, rows]`` (``[7, rows]`` with ``extras``); the backward recomputes each chunk's
    block and all-reduces the hidden states' gradient.

    Args:
        hidden: ``[rows, H]``, the same on every rank of ``group``.
        weight: ``[block, H]``: the head's rows for classes ``[start, start + block)`` (``nn.Linear``'s layout).
        bias: ``[block]`` or None.
        target: ``[rows]`` class indices in ``[0, classes)``, or ``ignore_index``.
        start: the block's first class.
        classes: the number of classes over all ranks.
        group: the ranks holding the other blocks (None: this rank holds every class).
        temperature: the logits are divided by it (a sampler's temperature), > 0.
        ignore_index: a target whose log-probability is 0, with no gradient (its row's entropy is computed).
        chunk: rows whose logits are made at once.
        logit_scale: the logits are multiplied by it first (a model's ``logit_scale``).
        softcap: a model's ``final_logit_softcapping``, or None.
        extras: also return, without gradients, ``log sum p^2``, the mean of ``z`` over the classes and whether
            the target is the (first) argmax (``EXTRAS``).
        dtype: the product's (each chunk of ``hidden`` and the head cast to it; default ``hidden``'s): the
            gradients are still summed in the statistics' dtype and returned in their inputs' dtypes.
        stats: the dtype of the scaled logits, their statistics and the gradients' sums (default fp32, fp64 for
            an fp64 product).

    Returns:
        ``(log_probs, entropy)``, each ``[rows]`` in fp32 (fp64 for fp64 inputs), then the ``EXTRAS`` with
        ``extras``.

    Example::

        >>> h, w = torch.randn(6, 8, dtype=torch.float64), torch.randn(50, 8, dtype=torch.float64)
        >>> t = torch.randint(0, 50, (6,))
        >>> logp, entropy = linear_log_probs(h, w, None, t, start=0, classes=50, group=None, chunk=4)
        >>> torch.testing.assert_close(logp, torch.log_softmax(h @ w.T, -1).gather(1, t[:, None])[:, 0])
    """
    check_settings(temperature, chunk)
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [rows, H] and weight [block, H], got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    check_targets(target, hidden.shape[0], classes, ignore_index)
    shape = (float(logit_scale), None if softcap is None else float(softcap), 1.0 / float(temperature))
    product = hidden.dtype if dtype is None else dtype
    stats = torch.promote_types(product, torch.float32) if stats is None else stats
    return _LinearLogProbs.apply(hidden, weight, bias, target, start, classes, group, shape, ignore_index, chunk,
                                 extras, (product, stats))

