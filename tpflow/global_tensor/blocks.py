"""A global tensor as this rank's block: making one from a block, cutting blocks, reading its layout.

Everything in ``tpflow.global_tensor`` is built on these: a global tensor is a ``DTensor`` whose local
tensor is this rank's block of the logical value (empty on ranks outside its placement), laid out by
``tpflow.sbp``'s arithmetic. ``Block`` is the same without the DTensor: the block, its SBPs and the global shape,
which is how a pipeline carries a micro-batch from stage to stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor

from tpflow.placement import Placement, placement_of_mesh
from tpflow.sbp import PartialSum, Sbp, from_dtensor, local_region, to_dtensor

__all__ = ["Block", "check_placement", "get_placement", "get_sbp", "is_zero_partial", "local_of_full",
           "off_placement", "region_of", "to_local", "wrap"]


def region_of(t: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """The block of ``t`` that starts at ``offsets`` and has sizes ``lengths``: a view (``narrow`` along each
    dimension), no copy.

    Args:
        t: a plain tensor.
        offsets, lengths: the block's start and size in each leading dimension of ``t``, as ``sbp.local_region``
            gives them.

    Returns:
        A view of ``t``.

    Example::

        >>> import torch
        >>> from tpflow.global_tensor.blocks import region_of
        >>> region_of(torch.arange(12).reshape(4, 3), (2, 0), (2, 3))
        tensor([[ 6,  7,  8],
                [ 9, 10, 11]])
    """
    for dim, (o, n) in enumerate(zip(offsets, lengths)):
        t = t.narrow(dim, o, n)
    return t


def is_zero_partial(sbps: Sequence[Sbp], coord: Sequence[int]) -> bool:
    """Whether a partial-sum block at ``coord`` is all zeros when made from a whole value.

    A partial sum made from a whole value keeps the value on coordinate 0 of each partial-sum axis and zeros on
    the others, so the blocks still sum to the value.

    Args:
        sbps: the SBPs, one per placement axis.
        coord: a mesh coordinate.

    Returns:
        True when some partial-sum axis has a coordinate other than 0.

    Example::

        >>> import tpflow as tpf
        >>> from tpflow.global_tensor.blocks import is_zero_partial
        >>> is_zero_partial((tpf.sbp.partial_sum,), (1,)), is_zero_partial((tpf.sbp.partial_sum,), (0,))
        (True, False)
    """
    return any(isinstance(s, PartialSum) and c != 0 for s, c in zip(sbps, coord))


def wrap(local: torch.Tensor | None, pl: Placement, sbps: Sequence[Sbp], shape: Sequence[int],
         dtype: torch.dtype) -> DTensor:
    """A DTensor from this rank's block (None on ranks outside ``pl``: an empty block).

    No communication and no checks: the block must already be this rank's part of the layout. The DTensor has
    the global ``shape`` with contiguous strides.

    Args:
        local: this rank's block, or None on ranks outside ``pl``.
        pl: the placement.
        sbps: the SBPs, one per placement axis, with split dims >= 0.
        shape: the global shape.
        dtype: the dtype of the empty block made when ``local`` is None.

    Returns:
        A global tensor (``DTensor``) on ``pl``.

    Example::

        >>> import torch
        >>> import tpflow as tpf
        >>> from tpflow.global_tensor.blocks import wrap
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> x = wrap(torch.ones(2, 5), P, (tpf.sbp.split(0),), (4, 5), torch.float32)   # 2 rows on each rank
        >>> x.shape
        torch.Size([4, 5])
    """
    if local is None:
        local = torch.empty(0, dtype=dtype, device=pl.device)
    stride = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        stride[d] = stride[d + 1] * max(shape[d + 1], 1)
    return DTensor.from_local(local, pl.mesh, to_dtensor(sbps), run_check=False,
                              shape=torch.Size(shape), stride=tuple(stride))


class Block(NamedTuple):
    """A global tensor as the hot paths hold it: this rank's block, its SBPs and its global shape, with no
    DTensor around it, so that a stage's hot path pays no DTensor dispatch per op.

    A pipeline's micro-batch is one from the first stage to the loss: the stage computes on ``local`` (and
    returns the output's ``Block``), a hand-off posts ``local`` across placements by ``sbp`` and ``shape``, and
    the loss reads the last stage's. A rank outside the placement holds an empty ``local`` (``Block.absent``),
    as a DTensor does; its dtype still says what the others hold. The loss is a ``Block`` of no placement axes.
    ``tpflow.global_tensor.local.from_block`` makes the global tensor back, where a module needs one.

    Args:
        local: this rank's block of the value (plain tensor; autograd reaches it).
        sbp: the SBPs, one per placement axis, split dims >= 0; ``()`` for a plain value (the loss).
        shape: the global shape.

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> x = tpf.randn(5, 3, placement=P, sbp=tpf.sbp.split(0))
        >>> b = Block.of(x)
        >>> b.sbp, b.shape, b.local.shape               # on rank 1: the last 2 of 5 rows
        ((sbp.split(dim=0),), (5, 3), torch.Size([2, 3]))
        >>> Block.absent(b.sbp, b.shape, torch.float16).local     # what a rank outside P holds
        tensor([], dtype=torch.float16)
    """

    local: torch.Tensor
    sbp: tuple[Sbp, ...]
    shape: tuple[int, ...]

    @classmethod
    def of(cls, x: DTensor) -> Block:
        """The block of a global tensor ``x`` on this rank (a view of its local tensor)."""
        return cls(x.to_local(), from_dtensor(x.placements), tuple(x.shape))

    @classmethod
    def absent(cls, sbp: tuple[Sbp, ...], shape: tuple[int, ...], dtype: torch.dtype) -> Block:
        """What a rank outside the placement holds of a tensor laid out as ``sbp``: an empty block."""
        return cls(torch.empty(0, dtype=dtype), sbp, shape)


def local_of_full(full: torch.Tensor, pl: Placement, sbps: Sequence[Sbp]) -> torch.Tensor | None:
    """This rank's block of a whole value (zeros for partial-sum blocks off coordinate 0).

    Args:
        full: the whole (global) value, the same on every rank.
        pl: the placement.
        sbps: the SBPs, one per placement axis, with split dims >= 0.

    Returns:
        A copy of this rank's block, or None on ranks outside ``pl``.

    Example::

        >>> import torch
        >>> import tpflow as tpf
        >>> from tpflow.global_tensor.blocks import local_of_full
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> local_of_full(torch.arange(6.).reshape(2, 3), P, (tpf.sbp.split(0),))   # on rank 1
        tensor([[3., 4., 5.]])
    """
    coord = pl.coordinate()
    if coord is None:
        return None
    offsets, lengths = local_region(full.shape, sbps, pl.hierarchy, coord)
    if is_zero_partial(sbps, coord):
        return full.new_zeros(lengths)
    return region_of(full, offsets, lengths).clone()


def check_placement(placement: object) -> Placement:
    """``placement`` itself when it is a ``Placement``, else a ``TypeError`` that says what was given.

    Args:
        placement: the value a caller passed as ``placement=``.

    Returns:
        ``placement``, unchanged.

    Example::

        >>> import tpflow as tpf
        >>> from tpflow.global_tensor.blocks import check_placement
        >>> check_placement([0, 1])
        Traceback (most recent call last):
            ...
        TypeError: placement must be a tpf.placement(type, ranks), got [0, 1]
    """
    if not isinstance(placement, Placement):
        raise TypeError(f"placement must be a tpf.placement(type, ranks), got {placement!r}")
    return placement


def get_sbp(x: torch.Tensor) -> tuple[Sbp, ...]:
    """The SBP of a global tensor, one entry per placement axis.

    Always a tuple, also on a 1-D placement, so compare it with a tuple. A plain ``torch.Tensor`` is a
    ``TypeError`` ("get_sbp takes a global tensor; this is a plain torch.Tensor (make it one with
    tpf.to_global)"); a DTensor whose placements have no SBP (``Partial("max")``, say) is a ``TypeError`` too.

    Args:
        x: a global tensor (any ``DTensor``).

    Returns:
        A tuple of SBPs (``tpf.sbp.split(dim)``, ``tpf.sbp.broadcast``, ``tpf.sbp.partial_sum``).

    Example::

        >>> import tpflow as tpf
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> x = tpf.randn(4, 5, placement=P, sbp=tpf.sbp.split(0))
        >>> tpf.get_sbp(x)
        (sbp.split(dim=0),)
        >>> tpf.get_sbp(x) == (tpf.sbp.split(0),)
        True
    """
    if not isinstance(x, DTensor):
        raise TypeError("get_sbp takes a global tensor; this is a plain torch.Tensor (make it one with tpf.to_global)")
    return from_dtensor(x.placements)


def get_placement(x: torch.Tensor) -> Placement:
    """The placement of a global tensor.

    A plain ``torch.Tensor`` is a ``TypeError`` ("get_placement takes a global tensor; this is a plain
    torch.Tensor (make it one with tpf.to_global)"). A DTensor that torch code made on its own ``DeviceMesh`` has
    a placement too.

    Args:
        x: a global tensor (any ``DTensor``).

    Returns:
        A ``Placement`` equal to the one ``x`` was made on.

    Example::

        >>> import tpflow as tpf
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> x = tpf.randn(4, 5, placement=P, sbp=tpf.sbp.split(0))
        >>> tpf.get_placement(x)
        placement(type="cpu", ranks=[0, 1])
    """
    if not isinstance(x, DTensor):
        raise TypeError(
            "get_placement takes a global tensor; this is a plain torch.Tensor (make it one with tpf.to_global)"
        )
    return placement_of_mesh(x.device_mesh)


def to_local(x: torch.Tensor) -> torch.Tensor:
    """This rank's block of a global tensor (empty on ranks outside its placement).

    No communication: with ``split`` the block is this rank's shard, with ``broadcast`` the whole value, with
    ``partial_sum`` this rank's addend. It is DTensor's ``to_local``, so gradients flow back to ``x``. A plain
    tensor is a ``TypeError`` ("to_local takes a global tensor; this is already a plain (local) torch.Tensor").

    Args:
        x: a global tensor.

    Returns:
        This rank's block, a plain ``torch.Tensor``.

    Example::

        >>> import tpflow as tpf
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> x = tpf.randn(5, 4, placement=P, sbp=tpf.sbp.split(0))
        >>> tpf.to_local(x).shape   # on rank 0; rank 1 holds the other 2 rows (torch.chunk sizes)
        torch.Size([3, 4])
    """
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
    backward this rank still takes part in the boxings after it and in the one that brought ``x`` to ``pl``.

    The gradient it gives ``x`` is zeros. Layers and pipeline stages call it on the ranks that skip a computation.

    Args:
        x: the input of the computation, as this rank holds it.
        pl: the placement the output is computed on (this rank is outside it).
        sbps: the output's SBPs, one per axis of ``pl``.
        shape, dtype: the output's global shape and dtype.
        requires_grad: whether the computed output requires grad (used when ``x`` does not).

    Returns:
        A global tensor on ``pl`` whose block on this rank is empty.

    Example::

        >>> import torch
        >>> import tpflow as tpf
        >>> from tpflow.global_tensor.blocks import off_placement
        >>> P, Q = tpf.placement("cpu", ranks=[0, 1]), tpf.placement("cpu", ranks=[1])
        >>> x = tpf.randn(4, 5, placement=P, sbp=tpf.sbp.split(0))
        >>> y = off_placement(x, Q, (tpf.sbp.broadcast,), (4, 5), torch.float32, False)   # on rank 0
        >>> tpf.to_local(y).shape
        torch.Size([0])
    """
    if x.requires_grad:
        return _OffPlacement.apply(x, pl, sbps, tuple(shape), dtype)
    return wrap(None, pl, sbps, shape, dtype).requires_grad_(requires_grad)
