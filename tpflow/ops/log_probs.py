"""Per-token log-probabilities and entropies of logits split by classes (the vocabulary) across ranks, what RL
post-training computes of its sampled tokens under the policy and a reference, and the KL divergence between two
models' distributions (a teacher's, a reference's), on local blocks: no rank ever holds ``[rows, classes]``, and no
block larger than ``[chunk, classes / W]`` is made beside the logits themselves.

    forward    z = logits / T, chunk by chunk: the block's max m, sum of exp s, sum of exp * z w, the target's z
               -> one all-gather of [4, rows] -> logsumexp, log p(target) = z_t - lse, entropy = lse - E_p[z]
    backward   d/dz = g_logp (onehot - p) - g_H p (z - lse + H), recomputed chunk by chunk from the saved
               logits and each row's lse and H (no communication)
    kl         KL(p || q) = E_p[zp - zq] - lse_p + lse_q from [5, rows] (each side's max and sum of exp, and
               sum of exp(zp) * (zp - zq)); d/dzp = p (zp - zq - E_p[zp - zq]), d/dzq = q - p
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist

from tpflow import comm
from tpflow.ops.cross_entropy import check_targets

__all__ = ["Combined", "check_settings", "combine", "log_prob_grad", "token_stats", "vocab_parallel_kl",
           "vocab_parallel_log_probs"]


def _pieces(t: torch.Tensor, chunk: int) -> Iterator[tuple[slice, torch.Tensor]]:
    """``t`` (``[..., block]``) in views of at most ``chunk`` rows, row-major, each with its rows' slice of the
    flattened rows: a sliced block (``logits[:, :-1]``) is read where it lies, never copied whole to flatten it."""
    if t.dim() == 2:
        for i in range(0, t.shape[0], chunk):
            yield slice(i, i + min(chunk, t.shape[0] - i)), t[i:i + chunk]
        return
    per = math.prod(t.shape[1:-1])
    for b, sub in enumerate(t):
        for rows, piece in _pieces(sub, chunk):
            yield slice(b * per + rows.start, b * per + rows.stop), piece


class Combined(NamedTuple):
    """Each row's numbers over all classes, from every rank's :func:`token_stats`; the last three only when the
    stats carry their extras (else None).

    Example::

        >>> Combined(torch.zeros(2), torch.zeros(2), torch.ones(2)).top1 is None
        True
    """

    lse: torch.Tensor  # logsumexp of z
    picked: torch.Tensor  # the target's z
    entropy: torch.Tensor
    log_sum_sq: torch.Tensor | None = None  # log sum p^2
    mean: torch.Tensor | None = None  # mean z over the classes
    top1: torch.Tensor | None = None  # the target is the first argmax


def token_stats(z: torch.Tensor, target: torch.Tensor, start: int, extras: bool = False) -> torch.Tensor:
    """``[4, rows]`` numbers of a block ``z`` (``[rows, block]``, classes ``[start, start + block)``): its max, sum of
    ``exp(z - max)``, sum of ``exp(z - max) * z`` and the target's ``z`` (0 where the target is another rank's); with
    ``extras`` ``[7, rows]``, also the sum of ``z``, the sum of ``exp(2 (z - max))`` and the max over the classes
    before the target (what TRL's fused heads report beside: the mean logit, ``log sum p^2``, whether the target is
    the first argmax). :func:`combine` reads them.

    Args:
        z: ``[rows, block]``, the block's scaled logits (fp32 or fp64).
        target: ``[rows]``, each row's class (any index: one outside the block picks nothing).
        start: the block's first class.
        extras: also the three numbers TRL's fused heads report.

    Returns:
        ``[4, rows]``, or ``[7, rows]`` with ``extras``.

    Example::

        >>> z, t = torch.tensor([[0.0, 2.0, 1.0]]), torch.tensor([4])      # this rank holds classes 3, 4, 5
        >>> token_stats(z, t, start=3)[:, 0].tolist()[3]                   # class 4's z
        2.0
    """
    rows = z.shape[0]
    if z.shape[1] == 0:  # (a rank holding no classes)
        zero, low = z.new_zeros(rows), z.new_full((rows,), -torch.inf)
        return torch.stack((low, zero, zero, zero) + ((zero, zero, low) if extras else ()))
    m = z.max(-1).values
    e = (z - m[:, None]).exp_()  # the block's one temporary (the row sums below are products: no more)
    local = target - start
    mine = (local >= 0) & (local < z.shape[1])
    picked = torch.where(mine, z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None])[:, 0], 0.0)
    stats = (m, e.sum(-1), _row_dot(e, z), picked)
    if extras:
        before = torch.arange(start, start + z.shape[1], device=z.device) < target[:, None]
        stats += (z.sum(-1), _row_dot(e, e), z.masked_fill(~before, -torch.inf).max(-1).values)
    return torch.stack(stats)


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Each row's ``sum(a * b)``, as a batched product: no ``[rows, block]`` temporary."""
    return (a[:, None, :] @ b[:, :, None])[:, 0, 0]


def _gathered(stats: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's ``[n, rows]`` stats, ``[W, n, rows]``."""
    if group is None or dist.get_world_size(group) == 1:
        return stats[None]
    return comm.all_gather(stats[None], 0, [(r, r + 1) for r in range(dist.get_world_size(group))], group)


def _lse(m: torch.Tensor, s: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks' ``[W, rows]`` maxima, sums of ``exp(z - max)`` and of ``exp(z - max) * v`` -> each row's logsumexp
    and ``E_softmax(z)[v]``."""
    top = m.max(0).values
    scale = torch.exp(m - top)  # an empty block: exp(-inf) = 0
    total = (s * scale).sum(0)
    return top + torch.log(total), (w * scale).sum(0) / total


def combine(stats: torch.Tensor, group: dist.ProcessGroup | None, classes: int) -> Combined:
    """Every rank's :func:`token_stats` of its block of the same rows -> each row's numbers over all ``classes``
    (one all-gather of the ``[4 or 7, rows]`` stats).

    Args:
        stats: this rank's :func:`token_stats`.
        group: the ranks holding the other blocks (None: this rank holds every class).
        classes: the number of classes over all ranks (for the mean; unused without extras).

    Returns:
        The rows' :class:`Combined` numbers, the same on every rank of ``group``.

    Example::

        >>> z, t = torch.randn(3, 10, dtype=torch.float64), torch.tensor([1, 5, 9])
        >>> got = combine(token_stats(z, t, 0, extras=True), None, 10)
        >>> torch.testing.assert_close(got.lse, z.logsumexp(-1))
        >>> got.top1.tolist() == (z.argmax(-1) == t).tolist()
        True
    """
    m, s, w, picked, *extras = _gathered(stats, group).unbind(1)  # [W, rows] each
    lse, mean = _lse(m, s, w)
    picked = picked.sum(0)
    if not extras:
        return Combined(lse, picked, lse - mean)
    total, squares, before = extras
    top = m.max(0).values
    log_sum_sq = torch.log((squares * torch.exp(2 * (m - top))).sum(0)) + 2 * (top - lse)
    top1 = (picked >= top) & (picked > before.max(0).values)
    return Combined(lse, picked, lse - mean, log_sum_sq, total.sum(0) / classes, top1)


def log_prob_grad(z: torch.Tensor, target: torch.Tensor, start: int, valid: torch.Tensor, lse: torch.Tensor,
                  entropy: torch.Tensor, grad_logp: torch.Tensor | None,
                  grad_entropy: torch.Tensor | None) -> torch.Tensor:
    """The gradient by a block ``z`` (``[rows, block]``, classes from ``start``) of the rows' log-probabilities of
    ``target`` and entropies, given theirs (None: no gradient reaches that output):
    ``g_logp (onehot - p) - g_H p (z - lse + H)``; rows not ``valid`` have no log-probability gradient.

    Args:
        z: ``[rows, block]``, the block's scaled logits.
        target: ``[rows]``, each row's class.
        start: the block's first class.
        valid: ``[rows]``, the rows whose log-probability counts.
        lse, entropy: ``[rows]``, each row's logsumexp of ``z`` and entropy over all classes (:func:`combine`'s).
        grad_logp, grad_entropy: ``[rows]``, the outputs' gradients, or None.

    Returns:
        ``[rows, block]``, the gradient by ``z``.

    Example::

        >>> z = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
        >>> t, lse = torch.tensor([1, 3]), z.logsumexp(-1).detach()
        >>> got = log_prob_grad(z.detach(), t, 0, t >= 0, lse, lse, torch.ones(2, dtype=torch.float64), None)
        >>> torch.testing.assert_close(got, torch.autograd.grad(z.log_softmax(-1).gather(1, t[:, None]).sum(), z)[0])
    """
    logp = z - lse[:, None]  # two [rows, block] buffers in all: log p (then the gradient) and p
    p = logp.exp()
    g = None if grad_entropy is None else logp.add_(entropy[:, None]).mul_(p).mul_(-grad_entropy[:, None])
    if grad_logp is not None:
        g_t = torch.where(valid, grad_logp, 0.0)
        p.mul_(g_t[:, None])
        g = p.neg_() if g is None else g.sub_(p)
        local = target - start
        mine = valid & (local >= 0) & (local < z.shape[1])
        g[mine, local[mine]] += g_t[mine]
    return torch.zeros_like(z) if g is None else g


class _LogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, start, group, temperature, ignore_index, chunk):
        wide = torch.promote_types(logits.dtype, torch.float32)
        stats = torch.cat([logits.new_zeros(4, 0, dtype=wide)] + [
            token_stats(piece.to(wide) / temperature, target[rows], start) for rows, piece in _pieces(logits, chunk)],
            1)
        lse, picked, entropy = combine(stats, group, 0)[:3]
        valid = target != ignore_index
        ctx.save_for_backward(logits, target, lse, entropy)
        ctx.args = start, temperature, ignore_index, chunk
        return torch.where(valid, picked - lse, 0.0), entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, target, lse, entropy = ctx.saved_tensors
        start, temperature, ignore_index, chunk = ctx.args
        grad = torch.empty_like(logits)
        valid = target != ignore_index
        for (rows, piece), (_, out) in zip(_pieces(logits, chunk), _pieces(grad, chunk)):
            g = log_prob_grad(piece.to(lse.dtype) / temperature, target[rows], start, valid[rows], lse[rows],
                              entropy[rows], None if grad_logp is None else grad_logp[rows],
                              None if grad_entropy is None else grad_entropy[rows])
            out.copy_(g.div_(temperature))
        return grad, *(None,) * 6


def vocab_parallel_log_probs(logits: torch.Tensor, target: torch.Tensor, *, start: int, classes: int,
                             group: dist.ProcessGroup | None, temperature: float = 1.0, ignore_index: int = -100,
                             chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax(whole_logits / temperature).gather(target)`` and the entropy of ``softmax(whole_logits /
    temperature)`` of each row, from this rank's block of the classes, differentiable.

    Every rank of ``group`` calls it with its block of the same rows and the same targets; each gets every row's
    log-probability and entropy. One all-gather of ``[4, rows]`` per call; the backward computes only the block's
    gradient, ``chunk`` rows at a time.

    Args:
        logits: ``[..., block]``: classes ``[start, start + block)`` of each row (a view is read where it lies).
        target: ``[rows]``, the rows flattened: class indices in ``[0, classes)``, or ``ignore_index``.
        start: the block's first class.
        classes: the number of classes over all ranks.
        group: the ranks holding the other blocks (None: this rank holds every class).
        temperature: the logits are divided by it (a sampler's temperature), > 0.
        ignore_index: a target whose log-probability is 0, with no gradient (its row's entropy is computed).
        chunk: rows of a block computed at once.

    Returns:
        ``(log_probs, entropy)``, each ``[rows]`` (the rows flattened) in fp32 (fp64 for fp64 logits).

    Example::

        >>> x, t = torch.randn(6, 50, dtype=torch.float64), torch.randint(0, 50, (6,))
        >>> logp, entropy = vocab_parallel_log_probs(x, t, start=0, classes=50, group=None, temperature=0.7)
        >>> want = torch.log_softmax(x / 0.7, -1)
        >>> torch.testing.assert_close(logp, want.gather(1, t[:, None])[:, 0])
        >>> torch.testing.assert_close(entropy, -(want.exp() * want).sum(-1))
    """
    check_settings(temperature, chunk)
    check_targets(target, math.prod(logits.shape[:-1]), classes, ignore_index)
    return _LogProbs.apply(logits, target, start, group, float(temperature), ignore_index, chunk)


def check_settings(temperature: float, chunk: int) -> None:
    """Raise unless the temperature is positive and the chunk a positive number of rows.

    Args:
        temperature: a sampler's temperature.
        chunk: rows computed at once.

    Example::

        >>> check_settings(0.7, 256)
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}: log-probabilities of greedy decoding are not "
                         f"defined (sample with a temperature, or score at temperature=1.0)")
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of rows, got {chunk}")


def _kl_stats(zp: torch.Tensor, zq: torch.Tensor) -> torch.Tensor:
    """``[5, rows]``: each side's block max and sum of ``exp(z - max)``, and ``sum exp(zp - max) * (zp - zq)``."""
    if zp.shape[1] == 0:
        zero = zp.new_zeros(zp.shape[0])
        return torch.stack((torch.full_like(zero, -torch.inf), zero, zero, torch.full_like(zero, -torch.inf), zero))
    mp, mq = zp.max(-1).values, zq.max(-1).values
    ep = torch.exp(zp - mp[:, None])
    return torch.stack((mp, ep.sum(-1), (ep * (zp - zq)).sum(-1), mq, torch.exp(zq - mq[:, None]).sum(-1)))


class _KL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p_logits, q_logits, group, temperature, chunk):
        wide = torch.promote_types(p_logits.dtype, torch.float32)
        stats = torch.cat([p_logits.new_zeros(5, 0, dtype=wide)] + [
            _kl_stats(p.to(wide) / temperature, q.to(wide) / temperature)
            for (_, p), (_, q) in zip(_pieces(p_logits, chunk), _pieces(q_logits, chunk))], 1)
        mp, sp, w, mq, sq = _gathered(stats, group).unbind(1)
        lse_p, mean = _lse(mp, sp, w)
        lse_q = _lse(mq, sq, sq)[0]
        ctx.save_for_backward(p_logits, q_logits, lse_p, lse_q, mean)
        ctx.args = temperature, chunk
        return mean - lse_p + lse_q

    @staticmethod
    def backward(ctx, grad):
        p_logits, q_logits, lse_p, lse_q, mean = ctx.saved_tensors
        temperature, chunk = ctx.args
        dp, dq = (torch.empty_like(t) if n else None for t, n in zip((p_logits, q_logits), ctx.needs_input_grad))
        outs = [_pieces(d, chunk) if d is not None else None for d in (dp, dq)]
        for (rows, p_piece), (_, q_piece) in zip(_pieces(p_logits, chunk), _pieces(q_logits, chunk)):
            zp, zq = (t.to(lse_p.dtype) / temperature for t in (p_piece, q_piece))
            p, g = torch.exp(zp - lse_p[rows, None]), grad[rows, None] / temperature
            if dp is not None:
                next(outs[0])[1].copy_(g * p * (zp - zq - mean[rows, None]))
            if dq is not None:
                next(outs[1])[1].copy_(g * (torch.exp(zq - lse_q[rows, None]) - p))
        return dp, dq, None, None, None


def vocab_parallel_kl(p_logits: torch.Tensor, q_logits: torch.Tensor, *, group: dist.ProcessGroup | None,
                      temperature: float = 1.0, chunk: int = 256) -> torch.Tensor:
    """Each row's ``KL(p || q)`` of ``p = softmax(whole p_logits / temperature)`` and ``q = softmax(whole q_logits /
    temperature)``, from this rank's block of the classes of both (the same block), differentiable in both.

    Args:
        p_logits: ``[..., block]``: the distribution the expectation is under (a student's, the policy's).
        q_logits: ``[..., block]``: the other (a teacher's, a reference's).
        group: the ranks holding the other blocks (None: this rank holds every class).
        temperature: both logits are divided by it, > 0.
        chunk: rows of a block computed at once.

    Returns:
        ``[rows]``, the rows flattened, in fp32 (fp64 for fp64 logits).

    Example::

        >>> x, y = torch.randn(6, 50, dtype=torch.float64), torch.randn(6, 50, dtype=torch.float64)
        >>> p, q = torch.log_softmax(x, -1), torch.log_softmax(y, -1)
        >>> torch.testing.assert_close(vocab_parallel_kl(x, y, group=None), (p.exp() * (p - q)).sum(-1))
    """
    check_settings(temperature, chunk)
    if p_logits.shape != q_logits.shape:
        raise ValueError(f"the two logits must hold the same rows and classes, got {tuple(p_logits.shape)} and "
                         f"{tuple(q_logits.shape)}")
    return _KL.apply(p_logits, q_logits, group, float(temperature), chunk)
