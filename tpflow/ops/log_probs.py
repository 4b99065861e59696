"""Per-token log-probabilities and entropies of logits split by classes (the vocabulary) across ranks, what RL
post-training computes of its sampled tokens under the policy and a reference, on local blocks: no rank ever holds
``[rows, classes]``, and no block larger than ``[chunk, classes / W]`` is made beside the logits themselves.

    forward    z = logits / T, chunk by chunk: the block's max m, sum of exp s, sum of exp * z w, the target's z
               -> one all-gather of [4, rows] -> logsumexp, log p(target) = z_t - lse, entropy = lse - E_p[z]
    backward   d/dz = g_logp (onehot - p) - g_H p (z - lse + H), recomputed chunk by chunk from the saved
               logits and each row's lse and H (no communication)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpflow import comm
from tpflow.ops.cross_entropy import check_targets

__all__ = ["vocab_parallel_log_probs"]


def _block_stats(z: torch.Tensor, target: torch.Tensor, start: int) -> torch.Tensor:
    """``[4, rows]``: the block's max, sum of ``exp(z - max)``, sum of ``exp(z - max) * z`` and the target's ``z``
    (0 where the target is another rank's)."""
    if z.shape[1] == 0:  # (a rank holding no classes)
        zero = z.new_zeros(z.shape[0])
        return torch.stack((torch.full_like(zero, -torch.inf), zero, zero, zero))
    m = z.max(-1).values
    e = torch.exp(z - m[:, None])
    local = target - start
    mine = (local >= 0) & (local < z.shape[1])
    picked = torch.where(mine, z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None])[:, 0], 0.0)
    return torch.stack((m, e.sum(-1), (e * z).sum(-1), picked))


def _combined(stats: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor,
                                                                               torch.Tensor]:
    """Every rank's ``[4, rows]`` stats -> each row's logsumexp, target ``z`` and entropy over all classes."""
    if group is not None and dist.get_world_size(group) > 1:
        stats = comm.all_gather(stats[None], 0, [(r, r + 1) for r in range(dist.get_world_size(group))], group)
    else:
        stats = stats[None]
    m, s, w, picked = stats.unbind(1)  # [W, rows] each
    top = m.max(0).values
    scale = torch.exp(m - top)  # an empty block: exp(-inf) = 0
    total = (s * scale).sum(0)
    lse = top + torch.log(total)
    return lse, picked.sum(0), lse - (w * scale).sum(0) / total


class _LogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, start, group, temperature, ignore_index, chunk):
        wide = torch.promote_types(logits.dtype, torch.float32)
        stats = torch.cat([_block_stats(logits[i:i + chunk].to(wide) / temperature, target[i:i + chunk], start)
                           for i in range(0, logits.shape[0], chunk)], 1) if logits.shape[0] else \
            logits.new_zeros(4, 0, dtype=wide)
        lse, picked, entropy = _combined(stats, group)
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
        for i in range(0, logits.shape[0], chunk):
            rows = slice(i, i + chunk)
            z = logits[rows].to(lse.dtype) / temperature
            p = torch.exp(z - lse[rows, None])
            g = torch.zeros_like(z)
            if grad_logp is not None:
                g_t = torch.where(valid[rows], grad_logp[rows], 0.0)
                g -= g_t[:, None] * p
                local = target[rows] - start
                mine = valid[rows] & (local >= 0) & (local < z.shape[1])
                g[mine, local[mine]] += g_t[mine]
            if grad_entropy is not None:
                g -= grad_entropy[rows, None] * p * (z - lse[rows, None] + entropy[rows, None])
            grad[rows] = (g / temperature).to(logits.dtype)
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
        logits: ``[rows, block]``: classes ``[start, start + block)`` of each row.
        target: ``[rows]`` class indices in ``[0, classes)``, or ``ignore_index``.
        start: the block's first class.
        classes: the number of classes over all ranks.
        group: the ranks holding the other blocks (None: this rank holds every class).
        temperature: the logits are divided by it (a sampler's temperature), > 0.
        ignore_index: a target whose log-probability is 0, with no gradient (its row's entropy is computed).
        chunk: rows of a block computed at once.

    Returns:
        ``(log_probs, entropy)``, each ``[rows]`` in fp32 (fp64 for fp64 logits).

    Example::

        >>> x, t = torch.randn(6, 50, dtype=torch.float64), torch.randint(0, 50, (6,))
        >>> logp, entropy = vocab_parallel_log_probs(x, t, start=0, classes=50, group=None, temperature=0.7)
        >>> want = torch.log_softmax(x / 0.7, -1)
        >>> torch.testing.assert_close(logp, want.gather(1, t[:, None])[:, 0])
        >>> torch.testing.assert_close(entropy, -(want.exp() * want).sum(-1))
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}: log-probabilities of greedy decoding are not "
                         f"defined (sample with a temperature, or score at temperature=1.0)")
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of rows, got {chunk}")
    check_targets(target, logits.shape[0], classes, ignore_index)
    return _LogProbs.apply(logits, target, start, group, float(temperature), ignore_index, chunk)
