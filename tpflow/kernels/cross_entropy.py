"""The local half of a cross-entropy over classes split across ranks: what one rank computes on its block of
the logits, before and after the small exchange ``tpflow.ops.cross_entropy`` makes.

    stats  [4, rows] fp32    per row: the block's max, sum of exp(x - max), the target's logit (0 where the
                             target is another block's) and, with label smoothing, the sum of the logits
    grad   [rows, classes]   scale * (softmax - smoothing / classes - (1 - smoothing) * one_hot), from the
                             row's logsumexp over every block; written over the logits when asked to

On CUDA tensors these run in Triton (``loss_tiles``: one program per row, an online logsumexp, nothing of the
block's size allocated); on CPU tensors in torch (the references, also what tests compare against) unless the
``kernels`` switch runs the Triton kernels through the interpreter.
"""

from __future__ import annotations

import importlib.util

import torch

from tpflow.kernels.matmul import use_triton

if importlib.util.find_spec("triton") is not None:
    from tpflow.kernels import loss_tiles
else:  # CPU installs without triton run the torch references
    loss_tiles = None

__all__ = ["logit_grad", "logit_grad_ref", "logit_stats", "logit_stats_ref"]

_BLOCK = 4096  # classes a program reads at once
_REF_ROWS = 1 << 20  # elements of the torch reference's exp buffer (4 MiB in fp32)


def _block(classes: int) -> int:
    return min(_BLOCK, 1 << max(classes - 1, 0).bit_length())


def _check(logits: torch.Tensor, target: torch.Tensor) -> None:
    if logits.ndim != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [rows, classes] and target [rows], got {tuple(logits.shape)} and "
                         f"{tuple(target.shape)}")
    if logits.stride(1) != 1:
        raise ValueError("logits must have unit stride along the classes (a row-major block)")


def logit_stats_ref(logits: torch.Tensor, target: torch.Tensor, start: int, smoothing: bool) -> torch.Tensor:
    """The torch reference of ``logit_stats``.

    Args:
        logits, target, start, smoothing: as in ``logit_stats``.

    Returns:
        ``[4, rows]`` fp32 (fp64 for fp64 logits).

    Example::

        >>> stats = logit_stats_ref(torch.zeros(2, 4), torch.tensor([1, 7]), start=0, smoothing=False)
        >>> stats[1]                                           # sum of exp(x - max) over the 4 classes
        tensor([4., 4.])
    """
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    rows, classes = x.shape
    if classes == 0:  # a rank holding no classes: exp sums to 0 under a max of -inf
        return torch.stack([x.new_full((rows,), float("-inf")), *x.new_zeros((3, rows))])
    m = x.amax(1)
    shift = m.masked_fill(m == float("-inf"), 0.0)  # a row all -inf in this block: exp(-inf - 0) = 0, not nan
    rows_at_once = _REF_ROWS // classes + 1  # in row blocks: a bounded buffer, as the kernel needs none
    s = torch.cat([(part - by[:, None]).exp_().sum(1)
                   for part, by in zip(x.split(rows_at_once), shift.split(rows_at_once))])
    local = target - start
    here = (local >= 0) & (local < classes)
    picked = torch.where(here, x.gather(1, local.clamp(0, classes - 1)[:, None]).squeeze(1), 0.0)
    total = x.sum(1) if smoothing else torch.zeros_like(m)
    return torch.stack([m, s, picked, total])


def logit_stats(logits: torch.Tensor, target: torch.Tensor, start: int, smoothing: bool) -> torch.Tensor:
    """Per row of a block of logits: max, sum of ``exp(x - max)``, the target's logit and the sum of logits.

    Args:
        logits: ``[rows, classes]``, this rank's classes ``[start, start + classes)`` of every row; any float
            dtype (read in fp32).
        target: ``[rows]`` class indices over all ranks' classes (others, such as an ignore index, match none).
        start: the first class of the block.
        smoothing: compute the sum of the logits (label smoothing needs it; else that row is zeros).

    Returns:
        ``[4, rows]`` fp32 (fp64 for fp64 logits): max, sum of exp, target logit (0 where not in the block),
        sum of logits.

    Example::

        >>> stats = logit_stats(torch.randn(8, 50), torch.randint(0, 100, (8,)), start=50, smoothing=True)
        >>> stats.shape
        torch.Size([4, 8])
    """
    _check(logits, target)
    rows, classes = logits.shape
    if logits.dtype == torch.float64 or not use_triton(logits) or classes == 0 or rows == 0:
        return logit_stats_ref(logits, target, start, smoothing)
    stats = torch.empty((4, rows), dtype=torch.float32, device=logits.device)
    loss_tiles.stats_kernel[(rows,)](logits, logits.stride(0), target.contiguous(), stats, rows, classes, start,
                                     SMOOTHING=smoothing, BLOCK=_block(classes), num_warps=8)
    return stats


def logit_grad_ref(logits: torch.Tensor, target: torch.Tensor, start: int, lse: torch.Tensor, scale: torch.Tensor,
                   smoothing: float, classes: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference of ``logit_grad``.

    Args:
        logits, target, start, lse, scale, smoothing, classes, out: as in ``logit_grad``.

    Returns:
        The gradient, in ``out`` if given.

    Example::

        >>> g = logit_grad_ref(torch.zeros(1, 4), torch.tensor([0]), 0, torch.log(torch.tensor([4.0])),
        ...                    torch.ones(1), 0.0, 4)
        >>> g
        tensor([[-0.7500,  0.2500,  0.2500,  0.2500]])
    """
    wide = torch.promote_types(logits.dtype, torch.float32)
    if out is logits and logits.dtype == wide:  # over the logits themselves: no buffer at all
        g = logits.sub_(lse[:, None].to(wide)).exp_()
    else:  # one block-sized buffer, then in place
        g = (logits.to(wide) - lse[:, None].to(wide)).exp_()
    if smoothing:
        g -= smoothing / classes
    local = target - start
    here = (local >= 0) & (local < logits.shape[1])
    if logits.shape[1]:
        g.scatter_add_(1, local.clamp(0, logits.shape[1] - 1)[:, None],
                       -(1.0 - smoothing) * here[:, None].to(wide))
    g.mul_(scale[:, None].to(wide)).masked_fill_(scale[:, None] == 0, 0.0)
    if out is None:
        return g.to(logits.dtype)
    return g if g is out else out.copy_(g)


def logit_grad(logits: torch.Tensor, target: torch.Tensor, start: int, lse: torch.Tensor, scale: torch.Tensor,
               smoothing: float, classes: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The cross-entropy's gradient on a block of logits: ``scale * (softmax - smoothing / classes - (1 -
    smoothing) * one_hot(target))``, the softmax taken with every rank's classes through ``lse``.

    Args:
        logits: ``[rows, block]``, this rank's classes ``[start, start + block)``.
        target: ``[rows]`` class indices over all classes.
        start: the first class of the block.
        lse: ``[rows]`` fp32, each row's logsumexp over all classes.
        scale: ``[rows]`` fp32, each row's factor (the loss's gradient; 0 for an ignored row, whose gradient is 0).
        smoothing: the label smoothing, in [0, 1].
        classes: the number of classes over all ranks (what the smoothing spreads over).
        out: where to write the gradient (``logits`` itself: in place, as the fused head + loss does); default a
            new tensor of the logits' dtype.

    Returns:
        The gradient, ``[rows, block]``.

    Example::

        >>> x = torch.randn(8, 50)
        >>> lse = torch.logsumexp(x, 1)                           # one rank holding every class
        >>> g = logit_grad(x, torch.randint(0, 50, (8,)), 0, lse, torch.full((8,), 1 / 8), 0.0, 50)
        >>> g.shape
        torch.Size([8, 50])
    """
    _check(logits, target)
    rows, block = logits.shape
    if logits.dtype == torch.float64 or not use_triton(logits) or block == 0 or rows == 0:
        return logit_grad_ref(logits, target, start, lse, scale, smoothing, classes, out)
    out = torch.empty_like(logits) if out is None else out
    if out.shape != logits.shape or out.stride(1) != 1:
        raise ValueError(f"out must be a row-major [rows, block] like the logits, got {tuple(out.shape)}")
    loss_tiles.grad_kernel[(rows,)](logits, logits.stride(0), out, out.stride(0), target.contiguous(),
                                    lse.float().contiguous(), scale.float().contiguous(), block, start,
                                    smoothing / classes, 1.0 - smoothing, BLOCK=_block(block), num_warps=8)
    return out
