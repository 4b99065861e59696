"""Cross-entropy over logits split by classes (the vocabulary) across ranks, on local blocks: no rank ever holds
``[rows, classes]``.

    vocab_parallel_cross_entropy   logits [rows, V/W] -> stats [4, rows] -> all-gather [W, 4, rows] -> loss
                                   backward: the block's softmax - one_hot, from the row's logsumexp
    linear_cross_entropy           hidden [rows, H] @ W_block.T chunk by chunk: each chunk's logits, loss
                                   and gradient (written over the logits) made and dropped in turn, so
                                   [chunk, V/W] is the largest block; dH all-reduced, dW summed over chunks

Each rank reduces its block to four numbers per row (``tpflow.kernels.cross_entropy``: max, sum of exp,
target logit, sum of logits); one all-gather of those ``[4, rows]`` gives every rank the row's logsumexp
and target logit (Megatron all-reduces a max, then a sum, then the target logit: three waits instead of one).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpflow import comm
from tpflow.kernels import linear, matmul
from tpflow.kernels.autocast import autocast_operands
from tpflow.kernels.cross_entropy import logit_grad, logit_stats
from tpflow.kernels.epilogue import accumulate_dtype

__all__ = ["REDUCTIONS", "check_targets", "linear_cross_entropy", "vocab_parallel_cross_entropy"]

REDUCTIONS = ("mean", "sum", "none")


def _check(target: torch.Tensor, rows: int, classes: int, ignore_index: int, smoothing: float,
           reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {smoothing}")
    check_targets(target, rows, classes, ignore_index)


def check_targets(target: torch.Tensor, rows: int, classes: int, ignore_index: int) -> None:
    """Raise unless ``target`` holds ``rows`` class indices in ``[0, classes)`` or ``ignore_index`` (an error on CPU;
    a device-side assert on CUDA, which keeps the host from waiting).

    Args:
        target: the class indices.
        rows: how many there must be.
        classes: the number of classes.
        ignore_index: a target that counts for nothing.

    Example::

        >>> check_targets(torch.tensor([0, 4, -100]), 3, 5, -100)
        >>> check_targets(torch.tensor([5]), 1, 5, -100)
        Traceback (most recent call last):
        ...
        ValueError: target 5 is outside the 5 classes [0, 5) and is not ignore_index (-100)
    """
    if target.dtype not in (torch.int64, torch.int32) or target.shape != (rows,):
        raise ValueError(f"target must hold {rows} class indices (int64 or int32), got {target.dtype} "
                         f"{tuple(target.shape)}")
    bad = (target != ignore_index) & ((target < 0) | (target >= classes))
    if target.is_cuda:
        torch._assert_async(~bad.any(), f"cross_entropy: a target is outside [0, {classes}) and not ignore_index")
    elif bad.any():
        raise ValueError(f"target {target[bad][0].item()} is outside the {classes} classes [0, {classes}) and is not "
                         f"ignore_index ({ignore_index})")


def _combine(stats: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, ...]:
    """Every rank's ``[4, rows]`` stats -> each row's logsumexp, target logit and sum of logits over all classes."""
    if group is not None and dist.get_world_size(group) > 1:
        world = dist.get_world_size(group)
        stats = comm.all_gather(stats[None], 0, [(r, r + 1) for r in range(world)], group)  # [W, 4, rows]
    else:
        stats = stats[None]
    m, s, picked, total = stats.unbind(1)
    lse = torch.logsumexp(m + torch.log(s), 0)  # an empty block has m = -inf, s = 0: it adds nothing
    return lse, picked.sum(0), total.sum(0)


def _row_loss(lse, picked, total, valid, smoothing: float, classes: int) -> torch.Tensor:
    """``(1 - e) * (lse - x_target) + e * mean_j(lse - x_j)``, 0 for ignored rows."""
    loss = lse - (1.0 - smoothing) * picked
    if smoothing:
        loss = loss - smoothing / classes * total
    return torch.where(valid, loss, 0.0)


def _reduce(loss: torch.Tensor, valid: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return loss
    return loss.sum() if reduction == "sum" else loss.sum() / valid.sum()  # all ignored: 0 / 0 = nan, as torch


def _row_scale(grad: torch.Tensor, valid: torch.Tensor, reduction: str, dtype: torch.dtype) -> torch.Tensor:
    """Each row's factor in the gradient, in ``dtype``: the loss's gradient, over the counted rows for a mean."""
    scale = (grad if reduction == "none" else grad.expand(valid.shape)).to(dtype)
    if reduction == "mean":
        scale = scale / valid.sum()
    return torch.where(valid, scale, 0.0)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, start, classes, group, ignore_index, smoothing, reduction, out_dtype):
        stats = logit_stats(logits, target, start, smoothing > 0)
        lse, picked, total = _combine(stats, group)
        valid = target != ignore_index
        loss = _reduce(_row_loss(lse, picked, total, valid, smoothing, classes), valid, reduction)
        ctx.save_for_backward(logits, target, lse)
        ctx.args = start, classes, ignore_index, smoothing, reduction
        return loss.to(out_dtype)

    @staticmethod
    def backward(ctx, grad):
        logits, target, lse = ctx.saved_tensors
        start, classes, ignore_index, smoothing, reduction = ctx.args
        scale = _row_scale(grad, target != ignore_index, reduction, lse.dtype)
        return logit_grad(logits, target, start, lse, scale, smoothing, classes), *(None,) * 8


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, start: int, classes: int,
                                 group: dist.ProcessGroup | None, ignore_index: int = -100,
                                 label_smoothing: float = 0.0, reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy(whole_logits, target, ...)`` from this rank's block of the classes, differentiable.

    Every rank of ``group`` calls it with its block of the same rows and the same targets; each gets the whole
    loss. One all-gather of ``[4, rows]`` per call; the backward computes only the block's gradient.

    Args:
        logits: ``[rows, block]``: classes ``[start, start + block)`` of each row, row-major.
        target: ``[rows]`` class indices in ``[0, classes)``, or ``ignore_index``.
        start: the block's first class.
        classes: the number of classes over all ranks.
        group: the ranks holding the other blocks (None: this rank holds every class).
        ignore_index: a target that counts for nothing (no loss, no gradient, not in the mean).
        label_smoothing: as ``F.cross_entropy``'s: the target is ``1 - e`` on its class plus ``e / classes`` on all.
        reduction: ``"mean"`` over the counted rows, ``"sum"``, or ``"none"`` (``[rows]``).

    Returns:
        The loss, in the logits' dtype (computed in fp32, fp64 for fp64 logits); in fp32 under ``torch.autocast``,
        as autocast runs ``F.cross_entropy``.

    Example::

        >>> x, t = torch.randn(8, 50, requires_grad=True), torch.randint(0, 50, (8,))
        >>> loss = vocab_parallel_cross_entropy(x, t, start=0, classes=50, group=None)
        >>> torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(x, t))
    """
    _check(target, logits.shape[0], classes, ignore_index, label_smoothing, reduction)
    autocast = torch.is_autocast_enabled(logits.device.type)
    out_dtype = torch.promote_types(logits.dtype, torch.float32) if autocast else logits.dtype
    return _VocabParallelCE.apply(logits, target, start, classes, group, ignore_index, label_smoothing, reduction,
                                  out_dtype)


class _LinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, start, classes, group, ignore_index, smoothing, reduction,
                chunk, backward):
        valid = target != ignore_index
        count = valid.sum()
        wide = accumulate_dtype(hidden.dtype)  # partial sums over chunks and ranks
        needs = [backward and n for n in ctx.needs_input_grad[:3]]
        dh = torch.empty(hidden.shape, dtype=wide, device=hidden.device) if needs[0] else None
        dw = torch.zeros(weight.shape, dtype=wide, device=weight.device) if needs[1] else None
        db = torch.zeros(weight.shape[0], dtype=wide, device=weight.device) if bias is not None and needs[2] else None
        losses = []
        for first in range(0, hidden.shape[0], chunk):
            h, t = hidden[first:first + chunk], target[first:first + chunk]
            logits = linear(h, weight, bias)  # [chunk, V/W], the only block of logits alive
            lse, picked, total = _combine(logit_stats(logits, t, start, smoothing > 0), group)
            losses.append(_row_loss(lse, picked, total, valid[first:first + chunk], smoothing, classes))
            if any(needs):
                # unscaled (1 / count is applied to the fp32 sums below): fp16 logits keep the gradient's digits
                scale = valid[first:first + chunk].to(lse.dtype)
                grad = logit_grad(logits, t, start, lse, scale, smoothing, classes, out=logits)  # over the logits
                if dh is not None:
                    matmul(grad, weight, out=dh[first:first + chunk])
                if dw is not None:
                    matmul(grad.mT, h, acc=dw, out=dw)  # summed over the chunks in place
                if db is not None:
                    db += grad.sum(0, dtype=db.dtype)
                del grad
            del logits  # before the next chunk's are made: one chunk of logits alive at a time
        if dh is not None and group is not None and dist.get_world_size(group) > 1:
            comm.all_reduce(dh, group)  # each rank's classes add to every hidden state's gradient
        if reduction == "mean":  # every target ignored: zero gradients (the loss is nan, as torch's)
            for g in (dh, dw, db):
                if g is not None:
                    g /= count.clamp_min(1)
        ctx.dtypes = hidden.dtype, weight.dtype, weight.dtype
        ctx.save_for_backward(dh, dw, db)
        rows = torch.cat(losses) if losses else hidden.new_zeros(0, dtype=wide)
        return _reduce(rows, valid, reduction)

    @staticmethod
    def backward(ctx, grad):
        grads = tuple(None if g is None else (g * grad).to(dtype) for g, dtype in zip(ctx.saved_tensors, ctx.dtypes))
        return *grads, *(None,) * 9


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         target: torch.Tensor, *, start: int, classes: int, group: dist.ProcessGroup | None,
                         ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean",
                         chunk: int = 256) -> torch.Tensor:
    """``cross_entropy(hidden @ W.T + b, target)`` for a head whose rows (the classes) are split over ``group``,
    computed ``chunk`` rows at a time so that the logits never exist beyond ``[chunk, block]``.

    The gradients of ``hidden``, ``weight`` and ``bias`` are computed in the forward, while each chunk's logits
    exist (their storage takes the chunk's gradient), and scaled by the loss's gradient in the backward; so the
    reduction is ``"mean"`` or ``"sum"``.

    Args:
        hidden: ``[rows, H]``, the whole hidden states on every rank of ``group``.
        weight: ``[block, H]``: the head's rows for classes ``[start, start + block)`` (``nn.Linear``'s layout).
        bias: ``[block]`` or None.
        target: ``[rows]`` class indices in ``[0, classes)``, or ``ignore_index``.
        start, classes, group, ignore_index, label_smoothing: as in ``vocab_parallel_cross_entropy``.
        reduction: ``"mean"`` over the counted rows, or ``"sum"``.
        chunk: rows of logits made at once.

    Returns:
        The loss, in fp32 (fp64 for fp64 inputs), as it was summed. Under ``torch.autocast`` the product runs in
        autocast's dtype (the operands cast as ``F.linear``'s are, their gradients cast back).

    Example::

        >>> h, w = torch.randn(8, 16, requires_grad=True), torch.randn(50, 16, requires_grad=True)
        >>> t = torch.randint(0, 50, (8,))
        >>> loss = linear_cross_entropy(h, w, None, t, start=0, classes=50, group=None, chunk=3)
        >>> torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(h @ w.T, t))
    """
    if reduction == "none":
        raise ValueError("linear_cross_entropy computes the gradients in the forward, scaled by one number in the "
                         "backward: use reduction='mean' or 'sum' (or vocab_parallel_cross_entropy for per-row losses)")
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [rows, H] and weight [block, H], got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of rows, got {chunk}")
    _check(target, hidden.shape[0], classes, ignore_index, label_smoothing, reduction)
    device = hidden.device.type
    if torch.is_autocast_enabled(device):  # autocast's casts for F.linear, done here: the kernels take one dtype
        hidden, weight, bias = autocast_operands(device, hidden, weight, bias)
        with torch.autocast(device, enabled=False):
            return linear_cross_entropy(hidden, weight, bias, target, start=start, classes=classes, group=group,
                                        ignore_index=ignore_index, label_smoothing=label_smoothing,
                                        reduction=reduction, chunk=chunk)
    backward = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    return _LinearCE.apply(hidden, weight, bias, target, start, classes, group, ignore_index, label_smoothing,
                           reduction, chunk, backward)
