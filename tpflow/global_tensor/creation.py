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
    """Global ``torch.randn``: the logical value equals one device's after the same seed.

    Every rank draws the whole tensor from ``generator`` on the placement's device, members of the placement or
    not, and keeps its block, so all ranks' random streams stay in step; each rank thus holds the whole tensor for
    a moment. A ``partial_sum`` axis keeps the value on its coordinate 0 and zeros on the others. A size that is
    not non-negative ints, or a ``placement`` that is not a ``Placement``, is a ``TypeError``; an SBP that does
    not fit the placement or the shape is a ``ValueError``.

    Args:
        *size: the global shape, as ints or as one tuple, list or ``torch.Size``.
        placement: the ranks that hold the tensor (``tpf.placement``).
        sbp: its layout: one SBP for a 1-D placement, else a tuple with one per placement axis.
        dtype: the dtype (default: torch's default dtype).
        generator: the generator to draw from (default: the device's default one; seed it on every rank).
        requires_grad: whether the result is a leaf that requires grad.

    Returns:
        A global tensor (a ``DTensor``).

    Example::

        >>> import torch
        >>> import tpflow as tpf
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)
        >>> x = tpf.randn(4, 5, placement=P, sbp=tpf.sbp.split(0))
        >>> _ = torch.manual_seed(0)
        >>> torch.equal(x.full_tensor(), torch.randn(4, 5))   # any world size and SBP
        True
    """
    return _random(torch.randn, size, placement, sbp, dtype, generator, requires_grad)


def rand(*size: int, placement: Placement, sbp: object, dtype: torch.dtype | None = None,
         generator: torch.Generator | None = None, requires_grad: bool = False) -> DTensor:
    """Global ``torch.rand``: the logical value equals one device's after the same seed.

    Uniform on ``[0, 1)``, drawn as ``randn`` draws: every rank draws the whole tensor and keeps its block, so all
    ranks' random streams stay in step.

    Args:
        *size: the global shape, as ints or as one tuple, list or ``torch.Size``.
        placement: the ranks that hold the tensor (``tpf.placement``).
        sbp: its layout: one SBP for a 1-D placement, else a tuple with one per placement axis.
        dtype: the dtype (default: torch's default dtype).
        generator: the generator to draw from (default: the device's default one; seed it on every rank).
        requires_grad: whether the result is a leaf that requires grad.

    Returns:
        A global tensor (a ``DTensor``).

    Example::

        >>> import tpflow as tpf
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> x = tpf.rand((4, 5), placement=P, sbp=tpf.sbp.split(1))   # columns 0-2 on rank 0, 3-4 on rank 1
        >>> tpf.to_local(x).shape   # on rank 1
        torch.Size([4, 2])
    """
    return _random(torch.rand, size, placement, sbp, dtype, generator, requires_grad)


def full(size: Sequence[int], fill_value: float, *, placement: Placement, sbp: object,
         dtype: torch.dtype | None = None, requires_grad: bool = False) -> DTensor:
    """Global ``torch.full``, built block by block (no rank materialises the whole tensor).

    A ``partial_sum`` axis holds ``fill_value`` on its coordinate 0 and zeros on the others, so the value is
    ``fill_value`` everywhere. Unlike ``zeros`` and ``ones``, ``size`` is one argument.

    Args:
        size: the global shape, a tuple, list or ``torch.Size`` (or an int for a 1-D tensor).
        fill_value: the value of every element.
        placement: the ranks that hold the tensor (``tpf.placement``).
        sbp: its layout: one SBP for a 1-D placement, else a tuple with one per placement axis.
        dtype: the dtype (default: ``fill_value``'s, as ``torch.tensor(fill_value)`` has it: an int gives
            ``torch.int64``).
        requires_grad: whether the result is a leaf that requires grad.

    Returns:
        A global tensor (a ``DTensor``).

    Example::

        >>> import tpflow as tpf
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> f = tpf.full((2, 3), 7.0, placement=P, sbp=tpf.sbp.split(1))
        >>> tpf.to_local(f)   # on rank 0: columns 0-1
        tensor([[7., 7.],
                [7., 7.]])
    """
    shape, pl = shape_of((size,)), check_placement(placement)
    sbps = normalize(sbp, pl.ndim, len(shape))
    dtype = dtype or torch.tensor(fill_value).dtype
    coord, local = pl.coordinate(), None
    if coord is not None:
        lengths = local_region(shape, sbps, pl.hierarchy, coord)[1]
        value = 0 if is_zero_partial(sbps, coord) else fill_value
        local = torch.full(lengths, value, dtype=dtype, device=pl.device)
    return wrap(local, pl, sbps, shape, dtype).requires_grad_(requires_grad)


def zeros(*size: int, placement: Placement, sbp: object, dtype: torch.dtype | None = None,
          requires_grad: bool = False) -> DTensor:
    """Global ``torch.zeros``: ``full(size, 0.0, ...)``, built block by block.

    Args:
        *size: the global shape, as ints or as one tuple, list or ``torch.Size``.
        placement: the ranks that hold the tensor (``tpf.placement``).
        sbp: its layout: one SBP for a 1-D placement, else a tuple with one per placement axis.
        dtype: the dtype (default: torch's default dtype).
        requires_grad: whether the result is a leaf that requires grad.

    Returns:
        A global tensor (a ``DTensor``).

    Example::

        >>> import tpflow as tpf
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> z = tpf.zeros(4, 5, placement=P, sbp=tpf.sbp.broadcast, requires_grad=True)
    """
    return full(shape_of(size), 0.0, placement=placement, sbp=sbp, dtype=dtype, requires_grad=requires_grad)


def ones(*size: int, placement: Placement, sbp: object, dtype: torch.dtype | None = None,
         requires_grad: bool = False) -> DTensor:
    """Global ``torch.ones``: ``full(size, 1.0, ...)``, built block by block.

    A ``partial_sum`` axis holds ones on its coordinate 0 and zeros on the others, so the value is all ones.

    Args:
        *size: the global shape, as ints or as one tuple, list or ``torch.Size``.
        placement: the ranks that hold the tensor (``tpf.placement``).
        sbp: its layout: one SBP for a 1-D placement, else a tuple with one per placement axis.
        dtype: the dtype (default: torch's default dtype).
        requires_grad: whether the result is a leaf that requires grad.

    Returns:
        A global tensor (a ``DTensor``).

    Example::

        >>> import torch
        >>> import tpflow as tpf
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> o = tpf.ones(4, 5, placement=P, sbp=tpf.sbp.split(0), dtype=torch.bfloat16)
    """
    return full(shape_of(size), 1.0, placement=placement, sbp=sbp, dtype=dtype, requires_grad=requires_grad)


def tensor(data: object, *, placement: Placement, sbp: object, dtype: torch.dtype | None = None,
           requires_grad: bool = False) -> DTensor:
    """A global tensor whose logical value is ``data`` (the same on every rank).

    Every rank must pass the same ``data``: it is neither checked nor copied between ranks, each rank keeps its
    block of its own. A ``partial_sum`` axis keeps the value on its coordinate 0 and zeros on the others.

    Args:
        data: the value: anything ``torch.as_tensor`` takes (a list, a number, an array, a tensor).
        placement: the ranks that hold the tensor (``tpf.placement``).
        sbp: its layout: one SBP for a 1-D placement, else a tuple with one per placement axis.
        dtype: the dtype (default: inferred from ``data``, as ``torch.as_tensor`` does).
        requires_grad: whether the result is a leaf that requires grad.

    Returns:
        A global tensor (a ``DTensor``).

    Example::

        >>> import tpflow as tpf
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> t = tpf.tensor([[1.0, 2.0], [3.0, 4.0]], placement=P, sbp=tpf.sbp.split(1))
        >>> tpf.to_local(t)   # on rank 1
        tensor([[2.],
                [4.]])
    """
    pl = check_placement(placement)
    value = torch.as_tensor(data, dtype=dtype, device=pl.device)
    return _distribute(value, pl, normalize(sbp, pl.ndim, value.ndim), requires_grad)
