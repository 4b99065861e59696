"""A global tensor as this rank's block: making one from a block, cutting blocks, reading its layout.

Everything in ``tpflow.global_tensor`` is built on these: a global tensor is a ``DTensor`` whose local
tensor is this rank's block of the logical value (empty on ranks outside its placement), laid out by
``tpflow.sbp``'s arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor

from tpflow.placement import Placement, placement_of_mesh
from tpflow.sbp import PartialSum, Sbp, from_dtensor, local_region, to_dtensor

__all__ = ["block", "check_placement", "get_placement", "get_sbp", "is_zero_partial", "local_of_full",
           "off_placement", "to_local", "wrap"]


def block(t: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(offsets, lengths)):
        t = t.narrow(dim, o, n)
    return t


def is_zero_partial(pl: Placement, sbps: Sequence[Sbp], coord: Sequence[int]) -> bool:
    """Whether a partial-sum block at ``coord`` is all zeros when made from a whole value."""
    return any(isinstance(s, PartialSum) and c != 0 for s, c in zip(sbps, coord))


def wrap(local: torch.Tensor | None, pl: Placement, sbps: Sequence[Sbp], shape: Sequence[int],
         dtype: torch.dtype) -> DTensor:
    """A DTensor from this rank's block (None on ranks outside ``pl``: an empty block)."""
    if local is None:
        local = torch.empty(0, dtype=dtype, device=pl.device)
    stride = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        stride[d] = stride[d + 1] * max(shape[d + 1], 1)
    return DTensor.from_local(local, pl.mesh, to_dtensor(sbps), run_check=False,
                              shape=torch.Size(shape), stride=tuple(stride))


def local_of_full(full: torch.Tensor, pl: Placement, sbps: Sequence[Sbp]) -> torch.Tensor | None:
    """This rank's block of a whole value (zeros for partial-sum blocks off coordinate 0)."""
    coord = pl.coordinate()
    if coord is None:
        return None
    offsets, lengths = local_region(full.shape, sbps, pl.hierarchy, coord)
    if is_zero_partial(pl, sbps, coord):
        return full.new_zeros(lengths)
    return block(full, offsets, lengths).clone()


def check_placement(placement: object) -> Placement:
    if not isinstance(placement, Placement):
        raise TypeError(f"placement must be a tpf.placement(type, ranks), got {placement!r}")
    return placement


def get_sbp(x: torch.Tensor) -> tuple[Sbp, ...]:
    """The SBP of a global tensor, one entry per placement axis."""
    if not isinstance(x, DTensor):
        raise TypeError("get_sbp takes a global tensor; this is a plain torch.Tensor (make it one with tpf.to_global)")
    return from_dtensor(x.placements)


def get_placement(x: torch.Tensor) -> Placement:
    """The placement of a global tensor."""
    if not isinstance(x, DTensor):
        raise TypeError(
            "get_placement takes a global tensor; this is a plain torch.Tensor (make it one with tpf.to_global)"
        )
    return placement_of_mesh(x.device_mesh)


def to_local(x: torch.Tensor) -> torch.Tensor:
    """This rank's block of a global tensor (empty on ranks outside its placement)."""
    if not isinstance(x, DTensor):
        raise TypeError("to_local takes a global tensor; this is already a plain (local) torch.Tensor")
    return x.to_local()


class _OffPlacement(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pl, sbps, shape, dtype):
        ctx.x = x.detach()
        return wrap(None, pl, sbps, shape, dtype)

    @staticmethod
    def backward(ctx, grad):
        return torch.zeros_like(ctx.x), None, None, None, None


def off_placement(x: torch.Tensor, pl: Placement, sbps: tuple[Sbp, ...], shape: Sequence[int], dtype: torch.dtype,
                  requires_grad: bool) -> DTensor:
    """What a rank outside ``pl`` holds of an output computed there from ``x``: an empty block with the output's
    shape and SBP. It requires grad where the computed output does, and stays in the graph of ``x``, so that in
    backward this rank still takes part in the boxings after it and in the one that brought ``x`` to ``pl``."""
    if x.requires_grad:
        return _OffPlacement.apply(x, pl, sbps, tuple(shape), dtype)
    return wrap(None, pl, sbps, shape, dtype).requires_grad_(requires_grad)
