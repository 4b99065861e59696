"""Creating global tensors whose logical values are one device's.

Every rank draws the full tensor from its generator (so all ranks' RNG stay in step, members of the
placement or not) and keeps its block: after ``torch.manual_seed(s)`` on every rank, ``randn(4, 5,
placement=P, sbp=...)`` holds exactly what ``torch.randn(4, 5)`` gives on one device after the same
seed, for any world size and SBP. ``full`` / ``zeros`` / ``ones`` build each block alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor

from tpflow.global_tensor.blocks import check_placement, is_zero_partial, local_of_full, wrap
from tpflow.placement import Placement
from tpflow.sbp import Sbp, local_region, normalize

__all__ = ["full", "ones", "rand", "randn", "tensor", "zeros"]


def _distribute(full: torch.Tensor, pl: Placement, sbps: tuple[Sbp, ...], requires_grad: bool) -> DTensor:
    out = wrap(local_of_full(full, pl, sbps), pl, sbps, full.shape, full.dtype)
    return out.requires_grad_(requires_grad)


def shape_of(size: tuple) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in size):
        raise TypeError(f"size must be non-negative ints, e.g. randn(4, 5, ...) or randn((4, 5), ...), got {size}")
    return tuple(size)


def _random(fn, size, placement, sbp, dtype, generator, requires_grad) -> DTensor:
    shape, pl = shape_of(size), check_placement(placement)
    sbps = normalize(sbp, pl.ndim, len(shape))
    full = fn(shape, dtype=dtype, device=pl.device, generator=generator)
    return _distribute(full, pl, sbps, requires_grad)


def randn(*size: int, placement: Placement, sbp: object, dtype: torch.dtype | None = None,
          generator: torch.Generator | None = None, requires_grad: bool = False) -> DTensor:
    """Global ``torch.randn``: the logical value equals one device's after the same seed."""
    return _random(torch.randn, size, placement, sbp, dtype, generator, requires_grad)


def rand(*size: int, placement: Placement, sbp: object, dtype: torch.dtype | None = None,
         generator: torch.Generator | None = None, requires_grad: bool = False) -> DTensor:
    """Global ``torch.rand``: the logical value equals one device's after the same seed."""
    return _random(torch.rand, size, placement, sbp, dtype, generator, requires_grad)


def full(size: Sequence[int], fill_value: float, *, placement: Placement, sbp: object,
         dtype: torch.dtype | None = None, requires_grad: bool = False) -> DTensor:
    """Global ``torch.full``, built block by block (no rank materialises the whole tensor)."""
    shape, pl = shape_of((size,)), check_placement(placement)
    sbps = normalize(sbp, pl.ndim, len(shape))
    dtype = dtype or torch.tensor(fill_value).dtype
    coord, local = pl.coordinate(), None
    if coord is not None:
        lengths = local_region(shape, sbps, pl.hierarchy, coord)[1]
        value = 0 if is_zero_partial(pl, sbps, coord) else fill_value
        local = torch.full(lengths, value, dtype=dtype, device=pl.device)
    return wrap(local, pl, sbps, shape, dtype).requires_grad_(requires_grad)


def zeros(*size: int, placement: Placement, sbp: object, dtype: torch.dtype | None = None,
          requires_grad: bool = False) -> DTensor:
    return full(shape_of(size), 0.0, placement=placement, sbp=sbp, dtype=dtype, requires_grad=requires_grad)


def ones(*size: int, placement: Placement, sbp: object, dtype: torch.dtype | None = None,
         requires_grad: bool = False) -> DTensor:
    return full(shape_of(size), 1.0, placement=placement, sbp=sbp, dtype=dtype, requires_grad=requires_grad)


def tensor(data: object, *, placement: Placement, sbp: object, dtype: torch.dtype | None = None,
           requires_grad: bool = False) -> DTensor:
    """A global tensor whose logical value is ``data`` (the same on every rank)."""
    pl = check_placement(placement)
    value = torch.as_tensor(data, dtype=dtype, device=pl.device)
    return _distribute(value, pl, normalize(sbp, pl.ndim, value.ndim), requires_grad)
