"""``argmax`` / ``argmin`` of a global tensor along a dim it is split on: the logits' argmax over a split vocabulary.

Each rank takes its block's best value and index (offset to the whole dim), the ranks' pairs are gathered along the
split axis (two small tensors a rank, no logits), and the best rank's index wins, the first rank's on a tie: the
first best index of the whole dim, as ``torch.argmax`` gives on one device. torch's own handler for this case
(``torch.distributed.tensor._nonlinear_redux``) gathers the pairs along the reduced dim, which fails with a shape
error where a leading dim is 1 (``generate``'s batch of one, an evaluation's last batch); tpflow's takes its place for
a dim split over one axis, and leaves every other case to it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from tpflow.sbp import chunk_bounds

__all__ = ["split_argmax"]

_OPS = {torch.ops.aten.argmax.default: torch.argmax, torch.ops.aten.argmin.default: torch.argmin}


def _split_axis(x: DTensor, dim: int) -> int | None:
    """The one placement axis ``x`` is split on along ``dim`` (None: none, several, or a partial sum)."""
    axes = [a for a, p in enumerate(x.placements) if type(p) is Shard and p.dim == dim]  # not a strided one
    if len(axes) != 1 or any(p.is_partial() for p in x.placements):
        return None
    return axes[0]


def split_argmax(x: DTensor, dim: int, keepdim: bool = False, largest: bool = True) -> DTensor:
    """``x.argmax(dim, keepdim)`` (``argmin`` when ``largest`` is False) of a global tensor split along ``dim`` on one
    placement axis: whole indices, replicated over that axis.

    Args:
        x: the global tensor.
        dim: the dim to reduce, split on one axis of ``x``'s placement.
        keepdim: keep ``dim`` with size 1.
        largest: argmax (True) or argmin.

    Returns:
        The indices, a global tensor laid out as ``x`` but replicated over the split axis (and ``dim`` dropped
        unless ``keepdim``).

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)
        >>> logits = torch.randn(1, 3, 11)                   # a batch of one: torch's own handler fails on it
        >>> split = tpf.tensor(logits, placement=P, sbp=tpf.sbp.split(2))
        >>> torch.equal(split.argmax(-1).full_tensor(), logits.argmax(-1))
        True
    """
    dim = dim % x.ndim
    axis = _split_axis(x, dim)
    if axis is None:
        raise ValueError(f"split_argmax takes a tensor split along dim {dim} on one placement axis, got "
                         f"{x.placements}")
    mesh, local = x.device_mesh, x.to_local()
    parts = mesh.size(axis)
    start = chunk_bounds(x.shape[dim], parts)[mesh.get_local_rank(axis)][0]
    pick = torch.argmax if largest else torch.argmin
    if local.shape[dim]:
        index = pick(local, dim, keepdim=True)
        value = local.gather(dim, index)
    else:  # an empty block (fewer classes than ranks): it never wins
        shape = [*local.shape[:dim], 1, *local.shape[dim + 1:]]
        bounds = torch.finfo(local.dtype) if local.is_floating_point() else torch.iinfo(local.dtype)
        value = torch.full(shape, bounds.min if largest else bounds.max, dtype=local.dtype, device=local.device)
        index = torch.zeros(shape, dtype=torch.int64, device=local.device)
    group = mesh.get_group(axis)
    values, indices = [torch.empty_like(value) for _ in range(parts)], [torch.empty_like(index) for _ in range(parts)]
    dist.all_gather(values, value.contiguous(), group=group)
    dist.all_gather(indices, (index + start).contiguous(), group=group)
    values, indices = torch.stack(values), torch.stack(indices)  # the ranks' pairs along a new dim 0
    winner = pick(values, 0, keepdim=True)  # the first best rank: the first best index of the whole dim
    out = indices.gather(0, winner).squeeze(0)
    if not keepdim:
        out = out.squeeze(dim)
    placements = [Replicate() if a == axis else
                  Shard(p.dim - 1) if isinstance(p, Shard) and not keepdim and p.dim > dim else p
                  for a, p in enumerate(x.placements)]
    shape = list(x.shape)
    shape[dim] = 1
    if not keepdim:
        del shape[dim]
    return DTensor.from_local(out, mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def _handler(previous):
    def arg_reduce(op_call, args: tuple, kwargs: dict) -> object:
        x = args[0]
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        if dim is not None and x.ndim and _split_axis(x, dim % x.ndim) is not None:
            return split_argmax(x, dim, keepdim, largest=_OPS[op_call] is torch.argmax)
        return previous(op_call, args, kwargs)

    return arg_reduce


def _register() -> None:
    """Take the place of torch's handlers for argmax / argmin where it has them (its other cases kept)."""
    handlers = getattr(getattr(DTensor, "_op_dispatcher", None), "_custom_op_handlers", None)
    if handlers is None:
        return
    for op in _OPS:
        previous = handlers.get(op)
        if previous is not None and getattr(previous, "__name__", "") != "arg_reduce":
            handlers[op] = _handler(previous)


_register()
