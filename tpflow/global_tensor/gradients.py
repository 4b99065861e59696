"""Partial-sum gradients of tpflow's parameters, summed together before an optimizer reads them.

Data parallelism by SBP leaves each parameter's gradient a partial sum over the ranks that saw
different rows (OneFlow reduces it when it is read). Left to DTensor, an optimizer step reduces them
one parameter at a time: an all-reduce and a redistribute per parameter. tpflow sums them with one all-reduce
(per mesh axis) per bucket of up to 4 MiB of gradients that share mesh, layout and dtype, as DDP buckets them:
by the backward, as each bucket fills or when it ends (``tpflow.global_tensor.reducer``, the ``grad_sync``
switch's defaults on CUDA and CPU), or when they are read (``grad_sync="step"``, or what a backward under
``deferred()`` left), while micro-batches accumulate into partial sums for free.

``reduce_partial_gradients`` runs before every optimizer step (``torch.optim``'s global step pre-hook,
``HOOK``), for the parameters tpflow made (``to_global`` of a module, the parallel layers, stages) and only
on the axes where the parameter itself is broadcast; any other gradient is left to DTensor. Code that reads
gradients the backward left partial before the step (``clip_grad_norm_``, ``GradScaler.unscale_``) should call
``reduce_partial_gradients(params)`` first, or DTensor reduces them one by one there.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tpflow import comm, config
from tpflow.global_tensor.reducer import (
    deferred,
    gradient_replaced,
    register_gradient_replaced_hook,
    summed_axes,
    watch,
)

__all__ = ["HOOK", "adopt", "clip_grad_norm_", "deferred", "reduce_partial_gradients",
           "register_gradient_replaced_hook", "scale_grad", "summed_axes", "watch"]

_MARK = "_tpflow_sums_partial_grads"  # an attribute, not a WeakSet: a set lookup would compare tensors with ==


def adopt(param: torch.Tensor) -> torch.Tensor:
    """Mark a parameter tpflow made, whose partial-sum gradients are summed before an optimizer step: during the
    backward (``watch``), else by the optimizer hook.

    Args:
        param: a parameter (a DTensor ``nn.Parameter``).

    Returns:
        ``param`` itself.

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> weight = torch.nn.Parameter(tpf.zeros(4, 4, placement=P, sbp=tpf.sbp.broadcast))
        >>> tpf.gradients.adopt(weight) is weight
        True
    """
    setattr(param, _MARK, True)
    watch(param)
    return param


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def scale_grad(x: torch.Tensor, factor: float) -> torch.Tensor:
    """The identity forward; backward, the gradient times ``factor``: where FSDP2 averages gradients over data ranks
    that tpflow's exchanges already summed (a pipeline stage's rows, experts fed every rank's tokens).

    Args:
        x: any tensor.
        factor: what its gradient is multiplied by.

    Returns:
        A view of ``x``.

    Example::

        >>> x = torch.ones(2, requires_grad=True)
        >>> tpf.gradients.scale_grad(x, 0.5).sum().backward()
        >>> x.grad
        tensor([0.5000, 0.5000])
    """
    return _ScaleGrad.apply(x, factor)


@torch.no_grad()
def reduce_partial_gradients(params: Iterable[torch.Tensor], bucket_bytes: int | None = None) -> None:
    """Sum the partial-sum gradients of ``params`` where the parameter is broadcast, bucket by bucket.

    One flat all-reduce per mesh axis and bucket of gradients that share mesh, layout and dtype; the flat copy
    is the memory this costs, so buckets are capped. Each gradient keeps its storage. Other gradients (those the
    backward summed already) are left as they are.

    Args:
        params: parameters (global or plain; only global ones with partial-sum gradients are touched).
        bucket_bytes: the cap of a bucket (default: the ``grad_bucket_bytes`` switch, 4 MiB).

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> model = tpf.to_global(torch.nn.Linear(4, 2), placement=P)          # broadcast parameters
        >>> x = tpf.randn(6, 4, placement=P, sbp=tpf.sbp.split(0))             # data parallel: 3 rows a rank
        >>> with tpf.gradients.deferred():                                 # the backward leaves them partial
        ...     model(x).sum().backward()
        >>> tpf.get_sbp(model.weight.grad)
        (sbp.partial_sum,)
        >>> tpf.gradients.reduce_partial_gradients(model.parameters())  # before reading the gradients
        >>> tpf.get_sbp(model.weight.grad)
        (sbp.broadcast,)
        >>> norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    """
    bucket_bytes = config.get("grad_bucket_bytes") if bucket_bytes is None else bucket_bytes
    groups: dict[tuple, list[list[torch.Tensor]]] = {}
    filled: dict[tuple, int] = {}
    for p in params:
        axes = summed_axes(p)
        if not axes:
            continue
        g = p.grad
        key = (g.device_mesh, g.placements, g.dtype, axes)
        buckets = groups.setdefault(key, [[]])
        nbytes = g.to_local().nbytes
        if buckets[-1] and filled[key] + nbytes > bucket_bytes:
            buckets.append([])
            filled[key] = 0
        buckets[-1].append(p)
        filled[key] = filled.get(key, 0) + nbytes
    for (mesh, placements, _, axes), buckets in groups.items():
        summed = tuple(Replicate() if i in axes else pl for i, pl in enumerate(placements))
        for bucket in buckets:
            blocks = [p.grad.to_local() for p in bucket]  # (no grad mode: the blocks themselves)
            flat, _ = comm.all_reduce_cat(blocks, mesh.get_group(axes[0]))
            for axis in axes[1:]:
                comm.all_reduce(flat, mesh.get_group(axis))
            offset = 0
            for p, block in zip(bucket, blocks):
                block.copy_(flat[offset:offset + block.numel()].view_as(block))
                offset += block.numel()
                p.grad = DTensor.from_local(block, mesh, summed, run_check=False, shape=p.grad.shape,
                                            stride=p.grad.stride())
                gradient_replaced(p)


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for parameters on different placements (pipeline stages on their own
    ranks), which torch's cannot take: one norm over all of them, whole on every rank.

    A collective over the whole world: every rank calls it, with its parameters (a rank's other stages' are
    empty blocks). Partial-sum gradients are summed first (``reduce_partial_gradients``); each block counts
    once however many ranks hold a copy. A plain tensor's gradient counts as its rank's own.

    Args:
        parameters: the parameters whose gradients are clipped in place (``pipe.parameters()``).
        max_norm: the largest total norm left.
        norm_type: the p of the p-norm (``float("inf")`` for the largest magnitude).
        error_if_nonfinite: raise if the total norm is nan or inf.

    Returns:
        The total norm before clipping (a plain scalar tensor, the same on every rank).

    Example::

        >>> import torch.nn.functional as F
        >>> _ = torch.manual_seed(0)
        >>> stages = tpf.pipeline.cut(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)),
        ...                           [tpf.placement("cpu", [0]), tpf.placement("cpu", [1])])
        >>> pipe = tpf.Pipeline(stages, micro_batches=2, loss_fn=F.mse_loss)
        >>> opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        >>> loss = pipe.step(torch.ones(4, 8), torch.zeros(4, 8))
        >>> tpf.clip_grad_norm_(pipe.parameters(), 1.0)                   # both stages' gradients, on every rank
        tensor(0.3533)
        >>> opt.step()
    """
    params = [p for p in parameters if p.grad is not None]
    reduce_partial_gradients(params)
    norm_type, inf = float(norm_type), float(norm_type) == float("inf")
    total = torch.zeros((), dtype=torch.float64)
    blocks = []
    for p in params:
        g = p.grad
        block = g.to_local() if isinstance(g, DTensor) else g
        blocks.append(block)
        if block.numel() == 0:
            continue
        if inf:
            total = torch.maximum(total, block.detach().abs().max().double().cpu())
            continue
        copies = 1
        if isinstance(g, DTensor):
            for size, placement in zip(g.device_mesh.shape, g.placements):
                copies *= size if placement.is_replicate() else 1
        total += torch.linalg.vector_norm(block.detach().double(), norm_type).cpu() ** norm_type / copies
    device = blocks[0].device if blocks and blocks[0].device.type == "cuda" else torch.device("cpu")
    total = total.to(device)
    torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.MAX if inf else torch.distributed.ReduceOp.SUM)
    norm = total if inf else total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is {norm.item()}: pass "
                           f"error_if_nonfinite=False to clip anyway")
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for block in blocks:
        block.mul_(coef.to(block.device, block.dtype))
    return norm.float()


def _before_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    reduce_partial_gradients(p for group in optimizer.param_groups for p in group["params"] if getattr(p, _MARK, False))


HOOK = register_optimizer_step_pre_hook(_before_step)  # HOOK.remove() leaves every gradient to DTensor
