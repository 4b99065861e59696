"""Autograd pairs for the parallel layers' hot path: a collective forward and its conjugate backward, each a no-op
on a group of one (or None), so one code path serves every degree of parallelism. Named by what the forward does
between a region split over the ranks and the whole (Megatron's ``copy_to`` / ``reduce_from`` / ``scatter_to`` /
``gather_from`` regions), so that the two of a pair read apart:

    name                        forward                           backward
    copy_to_ranks               identity: x enters a split region all-reduce of the gradient
    reduce_from_ranks           all-reduce: partial sums -> sum   identity
    scatter_to_ranks            this rank's chunk (no transfer)   all-gather of the gradient
    gather_from_ranks           all-gather along a dim            this rank's chunk of the gradient
    gather_shared               all-gather along a dim            reduce-scatter of the gradient
    reduce_scatter_to_ranks     reduce-scatter along a dim        all-gather of the gradient
    all_to_all_mirror           rows to ranks by counts           the mirror all-to-all (counts swapped)

Chunks follow ``torch.chunk``'s rule (``tpf.sbp.chunk_bounds``). A column layer's identity forward / all-reduce
backward is ``kernels.linear``'s ``dgrad_hook``, so that it overlaps the weight gradient; ``copy_to_ranks`` is
the same pair for inputs that do not enter a linear layer (an expert split's tokens and routing weights). The
all-gather / reduce-scatter pairs fused with a matmul are the rings of ``tpflow.ops``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from tpflow.comm.collectives import all_gather, all_reduce, all_to_all, checked_counts, reduce_scatter
from tpflow.sbp import chunk_bounds

__all__ = [
    "all_to_all_mirror",
    "copy_to_ranks",
    "gather_from_ranks",
    "gather_shared",
    "reduce_from_ranks",
    "reduce_scatter_to_ranks",
    "scatter_to_ranks",
]


def _chunks(size: int, group: dist.ProcessGroup) -> list[tuple[int, int]]:
    return chunk_bounds(size, dist.get_world_size(group))


def _own_chunk(t: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    start, end = _chunks(t.shape[dim], group)[dist.get_rank(group)]
    return t.narrow(dim, start, end - start).contiguous()


class _ReduceFromRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        if x.is_contiguous():  # in place: autograd raises if anything still needed the partial sum
            ctx.mark_dirty(x)
        else:
            x = x.contiguous()
        all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _CopyToRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        dy = dy.clone(memory_format=torch.contiguous_format)
        all_reduce(dy, ctx.group)
        return dy, None


class _GatherFromRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, size, group):
        ctx.dim, ctx.group = dim, group
        return all_gather(x, dim, _chunks(size, group), group)

    @staticmethod
    def backward(ctx, dy):
        return _own_chunk(dy, ctx.dim, ctx.group), None, None, None


class _GatherShared(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, size, group):
        ctx.dim, ctx.group, ctx.size = dim, group, size
        return all_gather(x, dim, _chunks(size, group), group)

    @staticmethod
    def backward(ctx, dy):
        return reduce_scatter(dy.contiguous(), ctx.dim, _chunks(ctx.size, ctx.group), ctx.group), None, None, None


class _ScatterToRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group, ctx.size = dim, group, x.shape[dim]
        return _own_chunk(x, dim, group)

    @staticmethod
    def backward(ctx, dy):
        return all_gather(dy, ctx.dim, _chunks(ctx.size, ctx.group), ctx.group), None, None


class _ReduceScatterToRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group, ctx.size = dim, group, x.shape[dim]
        return reduce_scatter(x, dim, _chunks(x.shape[dim], group), group)

    @staticmethod
    def backward(ctx, dy):
        return all_gather(dy, ctx.dim, _chunks(ctx.size, ctx.group), ctx.group), None, None


class _AllToAllMirror(torch.autograd.Function):
    """Several tensors' rows by one set of counts, in one node: every rank's backward sends their gradients in
    the same order, however its graph differs from the others' (a rank that received no rows)."""

    @staticmethod
    def forward(ctx, send_counts, recv_counts, group, *xs):
        ctx.send_counts, ctx.recv_counts, ctx.group = send_counts, recv_counts, group
        ctx.set_materialize_grads(False)
        return tuple(all_to_all(x, send_counts, recv_counts, group) for x in xs)

    @staticmethod
    def backward(ctx, *dys):
        back = [None if dy is None else all_to_all(dy, ctx.recv_counts, ctx.send_counts, ctx.group) for dy in dys]
        return None, None, None, *back


def _single(group: dist.ProcessGroup | None) -> bool:
    return group is None or dist.get_world_size(group) == 1


def reduce_from_ranks(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-reduce forward, identity backward: partial sums leaving as one replicated value (a row-parallel
    layer's output).

    A contiguous ``x`` is summed in place, and autograd raises if anything still needed the partial sum; any
    other ``x`` is summed in a contiguous copy.

    Args:
        x: this rank's partial sum.
        group: the process group to sum over; None: no parallelism.

    Returns:
        The sum over ``group`` (``x`` itself on a group of one).

    Example::

        >>> x = torch.ones(2, requires_grad=True)
        >>> y = tpf.comm.reduce_from_ranks(x * 1, torch.distributed.group.WORLD)
        >>> y                                           # on 2 ranks
        tensor([2., 2.], grad_fn=<_ReduceFromRanksBackward>)
        >>> y.sum().backward()
        >>> x.grad                                      # identity backward
        tensor([1., 1.])
    """
    if _single(group):
        return x
    if torch.is_grad_enabled() and x.requires_grad:
        return _ReduceFromRanks.apply(x, group)
    x = x if x.is_contiguous() else x.contiguous()  # no backward (decoding): no autograd node, traceable
    all_reduce(x, group)
    return x


def copy_to_ranks(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Identity forward, all-reduce backward: a value every rank holds whole, read by computations whose gradients
    are this rank's partial sums (the tokens and routing weights an expert split's slices read).

    Args:
        x: the value, the same on every rank of ``group``.
        group: the process group to sum the gradient over; None: no parallelism.

    Returns:
        ``x`` (a view of it, whose gradient is summed over ``group``).

    Example::

        >>> x = torch.ones(2, requires_grad=True)
        >>> y = tpf.comm.copy_to_ranks(x, torch.distributed.group.WORLD)
        >>> (y * 3).sum().backward()
        >>> x.grad                                      # on 2 ranks: both ranks' partial gradients
        tensor([6., 6.])
    """
    return x if _single(group) else _CopyToRanks.apply(x, group)


def gather_from_ranks(x: torch.Tensor, dim: int, size: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather along ``dim`` (of whole ``size``) forward; backward keeps this rank's chunk of the gradient
    (a column layer's ``gather_output``).

    Args:
        x: this rank's chunk along ``dim``, ``chunk_bounds(size, world)[rank]``.
        dim: the dim to gather along.
        size: the whole tensor's size along ``dim``.
        group: the process group to gather over; None: no parallelism.

    Returns:
        The whole tensor, ``size`` along ``dim`` (``x`` itself on a group of one).

    Example::

        >>> x = torch.full((1, 2), float(tpf.get_rank()), requires_grad=True)   # on 2 ranks: 2 of 3 columns
        >>> y = tpf.comm.gather_from_ranks(x[:, :2 - tpf.get_rank()], 1, 3, torch.distributed.group.WORLD)
        >>> y.detach()
        tensor([[0., 0., 1.]])
        >>> (y * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
        >>> x.grad                                      # on rank 0: its columns' gradient
        tensor([[1., 2.]])
    """
    return x if _single(group) else _GatherFromRanks.apply(x, dim, size, group)


def gather_shared(x: torch.Tensor, dim: int, size: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather along ``dim`` (of whole ``size``) forward; backward, the gradient's sum over the ranks, this rank's
    chunk of it (reduce-scatter): a block stored split over ranks that each compute with the whole of it (the
    B / C rows of a state space's group, shared by the ranks holding its heads), each rank's gradient a partial sum.

    Args:
        x: this rank's chunk along ``dim``, ``chunk_bounds(size, world)[rank]``.
        dim: the dim to gather along.
        size: the whole tensor's size along ``dim``.
        group: the process group to gather over; None: no parallelism.

    Returns:
        The whole tensor, ``size`` along ``dim`` (``x`` itself on a group of one).

    Example::

        >>> x = torch.full((1,), float(tpf.get_rank()), requires_grad=True)      # on 2 ranks
        >>> y = tpf.comm.gather_shared(x, 0, 2, torch.distributed.group.WORLD)
        >>> y.detach()
        tensor([0., 1.])
        >>> (y * (tpf.get_rank() + 1)).sum().backward()                         # rank r weighs by r + 1
        >>> x.grad                                                              # 1 + 2: both ranks' partial sums
        tensor([3.])
    """
    return x if _single(group) else _GatherShared.apply(x, dim, size, group)


def scatter_to_ranks(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's chunk along ``dim`` forward (no transfer); all-gather of the gradient backward (a whole
    input entering a row layer, or a sequence split where every rank held the whole sequence).

    Args:
        x: the whole tensor, the same on every rank of ``group``.
        dim: the dim to cut.
        group: the process group whose ranks take a chunk each; None: no parallelism.

    Returns:
        This rank's chunk, contiguous (``x`` itself on a group of one).

    Example::

        >>> x = torch.arange(6.0)
        >>> tpf.comm.scatter_to_ranks(x, 0, torch.distributed.group.WORLD)   # on rank 1 of 2
        tensor([3., 4., 5.])
    """
    return x if _single(group) else _ScatterToRanks.apply(x, dim, group)


def reduce_scatter_to_ranks(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Reduce-scatter along ``dim`` forward: this rank's chunk of the sum of every rank's ``x``; all-gather of
    the gradient backward. Partial sums leaving as one sequence-parallel value (a vocabulary-parallel
    embedding's).

    Args:
        x: this rank's partial sum, whole along ``dim``.
        dim: the dim to cut.
        group: the process group to sum over; None: no parallelism.

    Returns:
        This rank's chunk of the sum (``x`` itself on a group of one).

    Example::

        >>> x = torch.ones(4, 2)
        >>> tpf.comm.reduce_scatter_to_ranks(x, 0, torch.distributed.group.WORLD)   # on rank 0 of 2
        tensor([[2., 2.],
                [2., 2.]])
    """
    return x if _single(group) else _ReduceScatterToRanks.apply(x, dim, group)


def all_to_all_mirror(x: torch.Tensor | Sequence[torch.Tensor], send_counts: Sequence[int],
                      recv_counts: Sequence[int], group: dist.ProcessGroup | None) -> torch.Tensor | tuple:
    """All-to-all of rows by counts forward (``tpf.comm.all_to_all``); backward, the mirror all-to-all, which
    takes each row's gradient back to the rank it came from (tokens to their experts and back; a sequence split
    turned into a head split).

    Args:
        x: ``[sum(send_counts), ...]``: this rank's rows, grouped by the rank they go to; or several such tensors
            (tokens, their expert ids and routing weights), sent one after the other and their gradients back in
            the same order on every rank.
        send_counts: rows for each rank, in rank order.
        recv_counts: rows from each rank, in rank order (``tpf.comm.exchange_counts`` gives them).
        group: the process group; None: no parallelism.

    Returns:
        ``[sum(recv_counts), ...]``: the rows every rank sent this one, in rank order (``x`` itself on a group
        of one); a tuple of them for several tensors.

    Example::

        >>> rank = tpf.get_rank()                       # on 2 ranks: each keeps one row and sends the other one
        >>> x = (torch.tensor([[1.0], [2.0]]) + 10 * rank).requires_grad_()
        >>> y = tpf.comm.all_to_all_mirror(x, [1, 1], [1, 1], torch.distributed.group.WORLD)
        >>> y.detach().flatten()                        # on rank 0: its first row, then rank 1's first
        tensor([ 1., 11.])
        >>> (y * torch.tensor([[1.0], [5.0]])).sum().backward()
        >>> x.grad.flatten()                            # on rank 0: each row's gradient came back
        tensor([1., 1.])
    """
    world = 1 if group is None else dist.get_world_size(group)
    xs = (x,) if isinstance(x, torch.Tensor) else tuple(x)
    if not xs:
        raise ValueError("all_to_all_mirror: give a tensor, or several, to send")
    for t in xs:  # on one rank too: it fails there
        send, recv = checked_counts(t, send_counts, recv_counts, world)
    out = xs if world == 1 else _AllToAllMirror.apply(send, recv, group, *xs)
    return out[0] if isinstance(x, torch.Tensor) else tuple(out)
