"""The batch's loss from its micro-batches' on a pipeline's last stage: one device's over the whole batch.

Each micro-batch's loss is weighted by its share of the batch's items (``loss_reduction="mean"``: its rows, or its
targets other than ``ignore_index``, counted over the whole batch before any loss is taken) or not at all (``"sum"``).
A loss that takes ``num_items_in_batch`` (Hugging Face's convention, ``causal_lm_loss``) is handed the whole batch's
count and divides its own sum by it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tpflow.global_tensor import to_global
from tpflow.global_tensor.blocks import Block
from tpflow.global_tensor.local import from_block
from tpflow.placement import Placement
from tpflow.sbp import broadcast

__all__ = ["BatchLoss"]


class BatchLoss:
    """How ``loss_fn`` reduces a batch, checked once: each micro-batch's loss weighted so that their sum is one
    device's loss over the whole batch.

    Args:
        loss_fn: the loss, called as ``loss_fn(output, target)`` (or with ``num_items_in_batch=``).
        loss_reduction: ``"mean"``, ``"sum"`` or None (a torch loss module's own, else ``"mean"``).
        ignore_index: the target value a mean leaves out, or None (a loss module's own, or -100 where
            ``F.cross_entropy``'s rule applies).

    Example::

        >>> import torch.nn.functional as F
        >>> from tpflow.pipeline.loss import BatchLoss
        >>> loss = BatchLoss(F.cross_entropy, None, None)
        >>> loss.reduction, loss.ignore_index
        ('mean', -100)
        >>> loss.items((torch.tensor([1, -100]), torch.tensor([2, 3])), torch.tensor([1, -100, 2, 3]))
        ([1, 2], 3)
    """

    def __init__(self, loss_fn: Callable, loss_reduction: str | None, ignore_index: int | None) -> None:
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(output, target), got {loss_fn!r}")
        self.loss_fn, self.takes_count = loss_fn, _takes_count(loss_fn)
        if self.takes_count and loss_reduction == "sum":
            raise ValueError("loss_reduction='sum', but loss_fn takes num_items_in_batch, and so divides its sum by "
                             "the batch's items: leave loss_reduction out (a mean), or give a loss_fn without it")
        self.reduction = _reduction(loss_fn, loss_reduction)
        self.ignore_index = _ignore_index(loss_fn, ignore_index, self.takes_count)
        self.count = _counter(loss_fn, self.ignore_index)

    def items(self, micro_targets: tuple[torch.Tensor, ...], targets: torch.Tensor) -> tuple[list[float], float]:
        """Each micro-batch's items and the whole batch's, for a mean: counted before any loss is taken.

        Args:
            micro_targets: the micro-batches' targets.
            targets: the whole batch's.

        Returns:
            ``(each micro-batch's items, the batch's)``.
        """
        if self.reduction == "sum":
            return [1] * len(micro_targets), 1
        total = self.count(targets)
        if self.takes_count:
            return [total] * len(micro_targets), total
        if total == 0:  # nothing to average: each micro-batch's mean is NaN, and so is the batch's, as on one device
            return [t.shape[0] for t in micro_targets], targets.shape[0]
        return [self.count(t) for t in micro_targets], total

    def __call__(self, placement: Placement, y: Block, target: torch.Tensor, items: float,
                 total: float) -> torch.Tensor:
        """The micro-batch's loss on the last stage's ranks, on its whole output (gathered where the stage left it
        split): a mean weighted by the micro-batch's share of the batch's items (rows, or targets other than
        ``ignore_index``); a loss that takes ``num_items_in_batch`` is handed the batch's count instead.

        Args:
            placement: the last stage's placement.
            y: the stage's output block for the micro-batch.
            target: the micro-batch's targets.
            items: its items (``items``).
            total: the batch's.

        Returns:
            The weighted loss, a scalar.
        """
        whole, local = (broadcast,) * placement.ndim, y.local
        if y.sbp != whole:  # DTensor's mean over uneven split(0) blocks averages the blocks' means (biased)
            local = to_global(from_block(y, placement), sbp=whole).to_local()
        target = target.to(local.device)
        if local.shape[:1] != target.shape[:1]:
            raise ValueError(f"a micro-batch of the last stage's output has {local.shape[0]} rows but its targets "
                             f"{target.shape[0]}: step(inputs, targets) takes as many target rows as input rows")
        if self.takes_count:
            return self.loss_fn(local, target, num_items_in_batch=torch.tensor(total, device=local.device))
        if self.reduction == "sum":
            return self.loss_fn(local, target)
        if items == 0:  # nothing to average (its mean would be NaN): no loss, and zero gradients
            return local.reshape(-1)[:0].sum()
        return self.loss_fn(local, target) * (items / total)


def _takes_count(loss_fn: Callable) -> bool:
    """Whether ``loss_fn`` takes ``num_items_in_batch`` (Hugging Face's convention: its sum over that count)."""
    try:
        params = inspect.signature(loss_fn.forward if isinstance(loss_fn, nn.Module) else loss_fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return "num_items_in_batch" in params


def _ignore_index(loss_fn: Callable, given: int | None, takes_count: bool) -> int | None:
    """The target value ``loss_fn`` leaves out of its mean: ``given``, or a torch loss module's own
    (``nn.CrossEntropyLoss``, ``nn.NLLLoss``), or -100 for ``F.cross_entropy`` and ``F.nll_loss`` called with two
    arguments and for a loss that takes ``num_items_in_batch``, else None (every row counts)."""
    if given is not None and (isinstance(given, bool) or not isinstance(given, int)):
        raise TypeError(f"ignore_index must be an int (the target value a mean leaves out), got {given!r}")
    if given is not None and callable(getattr(loss_fn, "num_items", None)):
        raise ValueError(f"ignore_index={given}, but loss_fn counts its own items (its num_items): give the ignored "
                         f"label to the loss itself (tpf.pipeline.causal_lm_loss(model, ignore_index={given}))")
    own = getattr(loss_fn, "ignore_index", None) if isinstance(loss_fn, nn.Module) else None
    if own is None and any(loss_fn is f for f in (F.cross_entropy, F.nll_loss)):
        own = -100
        if given is not None and given != own:
            raise ValueError(f"ignore_index={given}, but loss_fn {loss_fn.__name__}(output, target) leaves out -100: "
                             f"pass loss_fn=lambda y, t: F.{loss_fn.__name__}(y, t, ignore_index={given}) with it")
    if given is not None and own is not None and given != own:
        raise ValueError(f"ignore_index={given}, but loss_fn {type(loss_fn).__name__} has ignore_index={own}: leave "
                         "ignore_index out, and the loss module's own is used")
    if given is None and own is None and takes_count:
        return -100
    return given if given is not None else own


def _counter(loss_fn: Callable, ignore_index: int | None) -> Callable[[torch.Tensor], float]:
    """How many items a batch of targets holds for ``loss_fn``'s mean: its own ``num_items(targets)`` where it has one
    (``causal_lm_loss`` counts the labels after the causal shift); the integer targets other than ``ignore_index``
    (weighted by a loss module's class ``weight``, as its mean divides by); else the rows."""
    own = getattr(loss_fn, "num_items", None)
    if callable(own):
        return lambda t: _number(own(t))
    weight = getattr(loss_fn, "weight", None) if isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)) else None

    def count(t: torch.Tensor) -> float:
        if ignore_index is None or t.is_floating_point():  # class probabilities: every row counts
            return t.shape[0]
        kept = t != ignore_index
        return _number(kept.sum() if weight is None else weight.to(t.device)[t[kept]].sum())
    return count


def _number(n: object) -> float:
    """A count as a Python number: an int where it is whole (a token count), a float where it is weighted."""
    n = n.item() if isinstance(n, torch.Tensor) else n
    return n if isinstance(n, int) else float(n)


def _reduction(loss_fn: Callable, given: str | None) -> str:
    """How ``loss_fn`` reduces its rows: ``given``, or a torch loss module's own ``reduction``, or "mean"."""
    own = getattr(loss_fn, "reduction", None) if isinstance(loss_fn, nn.Module) else None
    if own is not None and own not in ("mean", "sum"):
        raise ValueError(f"loss_fn {type(loss_fn).__name__}(reduction={own!r}) must return a scalar: give it "
                         f"reduction='mean' or 'sum'")
    if given is not None and given not in ("mean", "sum"):
        raise ValueError(f"loss_reduction must be 'mean' (loss_fn averages over its rows) or 'sum', got {given!r}")
    if given is not None and own is not None and given != own:
        raise ValueError(f"loss_reduction={given!r}, but loss_fn {type(loss_fn).__name__} has reduction={own!r}: "
                         f"leave loss_reduction out, and the loss module's own is used")
    return given or own or "mean"
