"""``tpf.cross_entropy``: the loss of logits that are a global tensor split over the classes (a vocabulary-parallel
head's), computed on each rank's block (``tpflow.ops.vocab_parallel_cross_entropy``): no rank gathers them.

``vocab_parallel_loss()`` routes ``F.cross_entropy`` to it for such logits, so that code written for one device
(a Hugging Face model's own loss) runs vocabulary-parallel unchanged; torch's ``loss_parallel()`` does the same
for DTensor's own decomposition, without label smoothing.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from tpflow.global_tensor.blocks import get_placement, get_sbp
from tpflow.ops.cross_entropy import vocab_parallel_cross_entropy
from tpflow.sbp import PartialSum, Split, chunk_bounds

__all__ = ["cross_entropy", "vocab_layout", "vocab_parallel_loss"]


def vocab_layout(logits: DTensor) -> tuple[int, object]:
    """Where this rank's block of a global tensor's classes (its last dim) starts, and the group splitting them,
    checked: the classes may be split on the placement's last axis only, and nothing may be a partial sum.

    Args:
        logits: a global tensor, the classes in its last dim.

    Returns:
        ``(the block's first class, the group splitting the classes or None)``.

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> vocab_layout(tpf.randn(6, 11, placement=P, sbp=tpf.sbp.broadcast))
        (0, None)
    """
    pl, sbps, last = get_placement(logits), get_sbp(logits), Split(logits.ndim - 1)
    if any(isinstance(s, PartialSum) for s in sbps):
        raise ValueError(f"logits laid out as {sbps} hold partial sums: reduce them first "
                         f"(tpf.to_global(logits, sbp=...))")
    if any(s == last for s in sbps[:-1]):
        raise ValueError(f"logits laid out as {sbps} split the classes on a data axis: split them on "
                         f"the placement's last axis only")
    coord = pl.coordinate()
    if coord is None:
        raise ValueError(f"this rank is not in the logits' placement {pl.ranks}")
    if sbps[-1] != last or pl.hierarchy[-1] == 1:
        return 0, None
    return chunk_bounds(logits.shape[-1], pl.hierarchy[-1])[coord[-1]][0], pl.mesh.get_group(pl.ndim - 1)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100,
                  label_smoothing: float = 0.0, reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy`` with the classes in the last dim, for logits split over them across ranks.

    With logits a global tensor split over its last dim (a ``ColumnParallelLinear(global_output=True)`` head's,
    a Hugging Face model's ``.logits`` after ``parallelize(plan="auto")``), each rank computes on its block: one
    all-gather of four numbers per row, no ``[rows, classes]`` anywhere; the backward writes only the block's
    gradient. Plain logits (one device, or whole on every rank) take the same kernels.

    Args:
        logits: ``[..., classes]``: a global tensor (split over the last dim on the placement's last axis, or
            broadcast; data axes may split the other dims) or a plain tensor.
        target: ``[...]`` class indices, the rows this rank holds (a plain tensor, or a global one whose block
            is that).
        ignore_index: a target that adds no loss or gradient and is not counted in the mean.
        label_smoothing: as ``F.cross_entropy``'s, in [0, 1].
        reduction: ``"mean"`` over the counted rows, ``"sum"``, or ``"none"`` (the loss of each row, ``[...]``).

    Returns:
        A plain tensor: the loss over the rows this rank holds, the same on every rank splitting the classes;
        in the logits' dtype.

    Example::

        >>> import torch
        >>> import tpflow as tpf
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)
        >>> whole, target = torch.randn(6, 11), torch.randint(0, 11, (6,))
        >>> logits = tpf.tensor(whole, placement=P, sbp=tpf.sbp.split(1))   # 6 and 5 classes per rank
        >>> loss = tpf.cross_entropy(logits, target, label_smoothing=0.1)
        >>> torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(whole, target, label_smoothing=0.1))
    """
    start, group = (0, None) if not isinstance(logits, DTensor) else vocab_layout(logits)
    classes = logits.shape[-1]
    local = logits.to_local() if isinstance(logits, DTensor) else logits
    target = target.to_local() if isinstance(target, DTensor) else target
    if target.shape != local.shape[:-1]:
        raise ValueError(f"cross_entropy: target {tuple(target.shape)} must have the shape of the logits' rows "
                         f"on this rank {tuple(local.shape[:-1])} (the classes are the last dim)")
    rows = local.reshape(math.prod(local.shape[:-1]), local.shape[-1])  # a rank may hold no classes
    loss = vocab_parallel_cross_entropy(rows if rows.stride(-1) == 1 else rows.contiguous(), target.reshape(-1),
                                        start=start, classes=classes, group=group, ignore_index=ignore_index,
                                        label_smoothing=label_smoothing, reduction=reduction)
    return loss.reshape(target.shape) if reduction == "none" else loss


def _routed(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
            reduction="mean", label_smoothing=0.0):
    """``F.cross_entropy``'s arguments, if ``cross_entropy`` computes them (logits [rows, classes] split over the
    classes, class-index targets, no weights), else None."""
    if not (isinstance(input, DTensor) and input.ndim == 2 and any(s == Split(1) for s in get_sbp(input))):
        return None
    if weight is not None or size_average is not None or reduce is not None or target.is_floating_point():
        return None
    return cross_entropy(input, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                         reduction=reduction)


class _VocabParallelLoss(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy:
            loss = _routed(*args, **kwargs)
            if loss is not None:
                return loss
        return func(*args, **kwargs)


def vocab_parallel_loss() -> TorchFunctionMode:
    """A context manager under which ``F.cross_entropy`` of logits split over the classes (a global tensor
    ``[rows, classes]`` split over dim 1) runs as ``tpf.cross_entropy``: vocabulary-parallel, no gather.

    Other calls (other layouts, class weights, probability targets) go to torch as they are. ``parallelize``
    enters it around a model's loss when its head is vocabulary-parallel, so the model's own loss code runs.

    Returns:
        The context manager (a ``TorchFunctionMode``).

    Example::

        >>> import torch
        >>> import torch.nn.functional as F
        >>> import tpflow as tpf
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> logits = tpf.randn(6, 11, placement=P, sbp=tpf.sbp.split(1))
        >>> with tpf.vocab_parallel_loss():
        ...     loss = F.cross_entropy(logits, torch.tensor([0, 1, 2, 3, 4, 10]))
        >>> type(loss).__name__                               # a plain scalar, the same on every rank
        'Tensor'
    """
    return _VocabParallelLoss()
