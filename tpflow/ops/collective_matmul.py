"""Matmul + reduce-scatter and all-gather + matmul, walked around a ring so transfers hide behind compute.

    matmul_reduce_scatter   x [M, K_r] @ w [K_r, N] on every rank is a partial sum;
                            rank r gets rows chunk(r) of the sum                      -> [M_r, N]
    all_gather_matmul       x_r [M_r, K] holds rows chunk(r); every rank gets
                            act(gather(x) @ w + b)                                   -> [M, N]

Rows are dim 0, chunked by ``torch.chunk``'s rule (tpflow's split(0)); x may have more dims
([S, B, K] in sequence parallelism), which fold into the rows of each chunk. Reduce-scatter: at step s rank r
computes chunk (r - s - 1) mod W, adding the partial received from r - 1 in the matmul's
epilogue (or, where the ``ring_add_late`` switch says so, after the product, so the transfer hides behind it), and
sends the sum on to r + 1; the last step leaves chunk r fully reduced. All-gather:
rank r computes on the rows it holds while forwarding them and receiving the next.

Each one's backward is the other: d(matmul_reduce_scatter) all-gathers dy and computes
dx = dy @ w^T chunk by chunk, with the weight gradient x^T @ dy of each chunk computed as it
arrives; d(all_gather_matmul) reduce-scatters dz @ w^T, with x^T @ dz of each chunk between
the steps.

Below the ``ring_min_elements`` switch's count per message (a chunk of the output for reduce-scatter, of the input
for all-gather), per-step overheads outweigh what the ring hides, and ``algo="auto"`` runs one
matmul and the plain collective instead. The rule reads only sizes every rank shares, so all
ranks take the same path.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from tpflow import config
from tpflow.comm.transport import Transport, as_transport
from tpflow.kernels.epilogue import accumulate_dtype, activation_grad, bias_grad, needs_pre, saved_for_grad
from tpflow.kernels.linear import wanted
from tpflow.kernels.matmul import matmul, matmul_ref
from tpflow.sbp import chunk_bounds

__all__ = ["ALGOS", "all_gather_matmul", "all_gather_matmul_ref", "matmul_reduce_scatter", "matmul_reduce_scatter_ref"]

ALGOS = ("auto", "ring", "naive")
Group = dist.ProcessGroup | Transport | None


def _use_ring(algo: str, t: Transport, bounds: list[tuple[int, int]], width: int, device: torch.device) -> bool:
    """Whether to run the ring: ``width`` is the row length of a message, the same on every rank."""
    if algo not in ALGOS:
        raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
    if t.world_size == 1 or algo == "naive":
        return False
    per_message = (bounds[0][1] - bounds[0][0]) * width
    return algo == "ring" or per_message >= config.get("ring_min_elements", device)


def _check_operands(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, name: str) -> None:
    if x.ndim < 2 or w.ndim != 2:
        raise ValueError(f"{name} takes x [rows, ..., K] and a 2-D w [K, N], got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"{name}: inner sizes differ: x {tuple(x.shape)} @ w {tuple(w.shape)}")
    if bias is not None and bias.shape != (w.shape[1],):
        raise ValueError(f"{name}: bias must have shape ({w.shape[1]},), got {tuple(bias.shape)}")


def _check_even_rows(t: Transport, rows: int, device: torch.device) -> None:
    """Every rank holds the same number of rows: one tiny all-gather, so that a mismatch is an error on
    every rank rather than ring messages of the wrong size (which gloo would pass without complaint)."""
    counts = t.gather_ints(rows, device)
    if len(set(counts)) > 1:
        raise ValueError(f"all_gather_matmul: the ranks hold {counts} rows: pass rows= (the total) when rows split "
                         f"unevenly")


def _flat_bounds(rows: int, world: int, inner: int) -> list[tuple[int, int]]:
    """Chunks of dim 0 (``rows``), as ranges of the rows of x flattened to 2-D (``inner`` per dim-0 index)."""
    return [(s * inner, e * inner) for s, e in chunk_bounds(rows, world)]


# The two schedules on plain tensors. ``wgrad`` hooks let each backward fold its weight
# gradient into the ring: it runs once per chunk of rows, after that chunk's transfer has started.

def _reduce_scatter_product(x: torch.Tensor, w: torch.Tensor, t: Transport, bounds: list, *, ring: bool,
                            bias: torch.Tensor | None, out_dtype: torch.dtype, partial_dtype: torch.dtype,
                            splits: int, wgrad: Callable[[int, int], None] | None = None) -> torch.Tensor:
    """Rows ``bounds[rank]`` of sum over ranks of ``x @ w``, plus ``bias``."""
    own_start, own_end = bounds[t.rank]
    if not ring:
        out = t.reduce_scatter(matmul(x, w, out_dtype=partial_dtype), bounds)
        if wgrad is not None:
            wgrad(0, x.shape[0])
        return (out if bias is None else out + bias).to(out_dtype)
    out = torch.empty(own_end - own_start, w.shape[1], dtype=out_dtype, device=x.device)

    def compute(start: int, end: int, acc: torch.Tensor | None, last: bool) -> torch.Tensor:
        if last:
            return matmul(x, w, bias=bias, acc=acc, row_start=start, row_end=end,
                          out=out[start - own_start:end - own_start])
        return matmul(x, w, acc=acc, row_start=start, row_end=end, out_dtype=partial_dtype)

    # a late add into a rounded output would round twice: only where the output keeps the partials' dtype
    add_late = config.get("ring_add_late", x.device) and out_dtype == partial_dtype
    t.ring_reduce_scatter(bounds, compute, width=w.shape[1], dtype=partial_dtype, device=x.device, splits=splits,
                          add_late=add_late, after=wgrad)
    return out


def _all_gather_product(x: torch.Tensor, w: torch.Tensor | None, t: Transport, bounds: list, *, ring: bool,
                        bias: torch.Tensor | None = None, activation: str | None = None,
                        out_dtype: torch.dtype | None = None, pre: bool = False,
                        wgrad: Callable[[torch.Tensor, int, int], None] | None = None):
    """(act(gather(x) @ w + bias), gather(x), pre-activation or None); with ``w`` None, only the gather (and hook)."""
    rows = bounds[-1][1]
    y = None if w is None else torch.empty(rows, w.shape[1], dtype=out_dtype, device=x.device)
    z = torch.empty_like(y) if pre else None

    def compute(start: int, end: int) -> None:
        if y is not None:
            matmul(gathered[start:end], w, bias=bias, activation=activation, out=y[start:end],
                   pre=None if z is None else z[start:end])
        if wgrad is not None:
            wgrad(gathered, start, end)

    if ring:
        gathered = x.new_empty(rows, x.shape[1])
        gathered[slice(*bounds[t.rank])] = x
        t.ring_all_gather(gathered, bounds, compute)
    else:
        gathered = t.all_gather(x.contiguous(), bounds)
        compute(0, rows)
    return y, gathered, z


class _GradSum:
    """A weight gradient summed chunk by chunk in (at least) fp32: ``add(a, b)`` is ``sum += a @ b``, the
    add fused into the matmul's epilogue."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.sum = torch.zeros(weight.shape, dtype=accumulate_dtype(weight.dtype), device=weight.device)

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        matmul(a, b, acc=self.sum, out=self.sum)


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, t, bounds, ring, out_dtype, partial_dtype, splits):
        ctx.save_for_backward(x, w)
        ctx.t, ctx.bounds, ctx.ring, ctx.has_bias = t, bounds, ring, bias is not None
        return _reduce_scatter_product(x, w, t, bounds, ring=ring, bias=bias, out_dtype=out_dtype,
                                       partial_dtype=partial_dtype, splits=splits)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        need_x, need_w, need_b = (wanted(ctx, i) for i in range(3))
        dw = _GradSum(w) if need_w else None

        def wgrad(gathered: torch.Tensor, start: int, end: int) -> None:
            dw.add(x[start:end].mT, gathered[start:end])

        dy = dy.to(x.dtype)
        dx, gathered, _ = _all_gather_product(dy, w.mT if need_x else None, ctx.t, ctx.bounds, ring=ctx.ring,
                                              out_dtype=x.dtype, wgrad=wgrad if need_w else None)
        # the bias was added to every row, so its gradient sums all of them: the gathered dy has them
        db = bias_grad(gathered) if ctx.has_bias and need_b else None
        return dx, None if dw is None else dw.sum.to(w.dtype), db, *[None] * 6


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, t, bounds, ring, activation, out_dtype, keep_gathered):
        y, gathered, z = _all_gather_product(x, w, t, bounds, ring=ring, bias=bias, activation=activation,
                                             out_dtype=out_dtype, pre=needs_pre(activation))
        ctx.save_for_backward(gathered if keep_gathered else x, w, saved_for_grad(y, z, activation))
        ctx.t, ctx.bounds, ctx.ring, ctx.activation, ctx.has_bias = t, bounds, ring, activation, bias is not None
        ctx.x_dtype, ctx.keep_gathered = x.dtype, keep_gathered
        ctx.mark_non_differentiable(gathered)
        return y, gathered

    @staticmethod
    def backward(ctx, dy, _):
        x, w, saved = ctx.saved_tensors  # x: gathered, or this rank's rows to gather again
        need_x, need_w, need_b = (wanted(ctx, i) for i in range(3))
        dz = activation_grad(dy, saved, ctx.activation).to(w.dtype)
        dw = dx = None
        if need_w:
            dw = _GradSum(w)
            if not ctx.keep_gathered:  # the gather again, with each chunk's weight gradient as it arrives
                _all_gather_product(x, None, ctx.t, ctx.bounds, ring=ctx.ring,
                                    wgrad=lambda gathered, start, end: dw.add(gathered[start:end].mT, dz[start:end]))
            elif not need_x:
                dw.add(x.mT, dz)
        if need_x:
            def wgrad(start: int, end: int) -> None:
                dw.add(x[start:end].mT, dz[start:end])

            dx = _reduce_scatter_product(dz, w.mT, ctx.t, ctx.bounds, ring=ctx.ring, bias=None,
                                         out_dtype=ctx.x_dtype, partial_dtype=accumulate_dtype(dz.dtype),
                                         splits=config.get("ring_splits", dz.device),
                                         wgrad=wgrad if need_w and ctx.keep_gathered else None)
        db = bias_grad(dz) if ctx.has_bias and need_b else None
        return dx, None if dw is None else dw.sum.to(w.dtype), db, *[None] * 6


def matmul_reduce_scatter(x: torch.Tensor, w: torch.Tensor, group: Group = None, *,
                          bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                          partial_dtype: torch.dtype | None = None, splits: int | None = None,
                          algo: str = "auto") -> torch.Tensor:
    """This rank's rows of ``sum over ranks (x @ w) + bias``; ``x [M, ..., K_r]`` and ``w [K_r, N]`` hold its K shard.

    Every rank passes the same shape; rank r gets ``chunk(r)`` of dim 0 (``torch.chunk``'s rule). ``group``
    is a process group (default: the world) or a ``Transport``. Partials travel in
    ``partial_dtype`` (default: fp32, or fp64 for fp64 inputs; one rounding at the end), each chunk as
    ``splits`` messages (default: the ``ring_splits`` switch); with more than one, the link works while the
    next piece computes. ``algo``: ``"ring"``, ``"naive"`` (one matmul,
    then the plain reduce-scatter), or ``"auto"`` (the ring from the ``ring_min_elements`` switch's count per message).

    Differentiable. The bias is added once, on each row's owner; its gradient (from the all-gathered
    output gradient) is the whole one on every rank.

    This is what a sequence-parallel ``RowParallelLinear`` runs; its backward is ``all_gather_matmul``'s
    forward, with each chunk's weight gradient computed as the chunk arrives.

    Args:
        x: this rank's operand ``[M, ..., K_r]``: all M rows, this rank's block of the K inner features.
            Dims between the first and the last fold into the rows of each chunk.
        w: this rank's block of the weight, ``[K_r, N]``.
        group: a process group (default None: the world) or a ``Transport`` (``tpf.comm.FakeWorld``'s, say).
        bias: ``[N]``, added once to the sum (default None).
        out_dtype: the output's dtype (default: ``x``'s).
        partial_dtype: the dtype the partial sums travel and add in (default: fp32, or fp64 for fp64 inputs).
        splits: messages per chunk in the ring (default: the ``ring_splits`` switch); at least 1.
        algo: ``"ring"``, ``"naive"`` or ``"auto"`` (the default), as above.

    Returns:
        This rank's rows of the sum, ``[M_r, ..., N]``: ``chunk(r)`` of dim 0.

    Example::

        >>> import torch
        >>> import tpflow as tpf
        >>> from tpflow.ops import matmul_reduce_scatter
        >>> P = tpf.placement("cpu", ranks=[0, 1])                # run on 2 ranks
        >>> x = torch.randn(16, 2, 256)                           # [seq, batch, this rank's 256 of K = 512]
        >>> w = torch.randn(256, 1024)
        >>> y = matmul_reduce_scatter(x, w, P.mesh.get_group(0), algo="ring")
        >>> y.shape                                               # this rank's 8 of the 16 rows of the sum
        torch.Size([8, 2, 1024])
        >>> world = tpf.comm.FakeWorld(2)                         # or 2 ranks as threads of one process
        >>> xs, ws = torch.randn(2, 8, 4), torch.randn(2, 4, 6)  # rank r holds xs[r] and ws[r]
        >>> out = world.run(lambda t: matmul_reduce_scatter(xs[t.rank], ws[t.rank], t, algo="ring"))
        >>> torch.testing.assert_close(torch.cat(out), xs[0] @ ws[0] + xs[1] @ ws[1])
    """
    _check_operands(x, w, bias, "matmul_reduce_scatter")
    splits = config.get("ring_splits", x.device) if splits is None else splits
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    t = as_transport(group)
    bounds = _flat_bounds(x.shape[0], t.world_size, math.prod(x.shape[1:-1]))
    ring = _use_ring(algo, t, bounds, w.shape[1], x.device)
    y = _MatmulReduceScatter.apply(x.reshape(bounds[-1][1], x.shape[-1]), w, bias, t, bounds, ring,
                                   out_dtype or x.dtype, partial_dtype or accumulate_dtype(x.dtype), splits)
    start, end = chunk_bounds(x.shape[0], t.world_size)[t.rank]
    return y.reshape(end - start, *x.shape[1:-1], w.shape[1])


def all_gather_matmul(x: torch.Tensor, w: torch.Tensor, group: Group = None, *, rows: int | None = None,
                      bias: torch.Tensor | None = None, activation: str | None = None,
                      out_dtype: torch.dtype | None = None, return_gathered: bool = False,
                      keep_gathered: bool = True,
                      algo: str = "auto") -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``act(gather(x) @ w + bias)`` ``[M, ..., N]``, where this rank's ``x [M_r, ..., K]`` holds ``chunk(r)`` of dim 0.

    ``rows`` is M, the same on every rank; each rank checks its row count against it. Without
    it the rows must split evenly (M = W * M_r, Megatron's contract), which the ranks check
    with one tiny all-gather (over the CPU backend where the group has one). ``return_gathered``
    also returns ``gather(x)`` (no gradient), which a caller can keep instead of gathering again.
    ``group`` and ``algo`` as in ``matmul_reduce_scatter``. Differentiable: the weight gradient needs
    ``gather(x)``, which is kept from the forward (``keep_gathered``), or, with
    ``keep_gathered=False``, gathered again in the backward (Megatron's sequence parallelism): the
    saved activation shrinks from ``gather(x)`` to ``x``, for (W-1)/W of ``gather(x)``'s bytes more
    per rank, sent while the chunks' weight gradients compute.

    This is what a sequence-parallel ``ColumnParallelLinear`` runs; its backward is ``matmul_reduce_scatter``'s
    forward on ``dz @ w^T``.

    Args:
        x: this rank's rows ``[M_r, ..., K]``: ``chunk(r)`` of dim 0 of the whole input. Dims between the
            first and the last fold into the rows of each chunk.
        w: the weight ``[K, N]`` (in a column layer, this rank's block of its output features).
        group: a process group (default None: the world) or a ``Transport`` (``tpf.comm.FakeWorld``'s, say).
        rows: M, the whole dim 0 (default None: ``W * M_r``, checked).
        bias: ``[N]``, added before the activation (default None).
        activation: ``None`` (the default), ``"relu"``, ``"gelu"`` (the tanh form) or ``"silu"``, applied in
            the matmul's epilogue.
        out_dtype: the output's dtype (default: ``x``'s).
        return_gathered: also return ``gather(x)`` (default False).
        keep_gathered: keep ``gather(x)`` from the forward for the weight gradient (default True), or gather
            ``x`` again in the backward (False).
        algo: ``"ring"``, ``"naive"`` (the plain all-gather, then one matmul) or ``"auto"`` (the default), as in
            ``matmul_reduce_scatter``.

    Returns:
        ``act(gather(x) @ w + bias)``, ``[M, ..., N]`` on every rank; with ``return_gathered``, the pair
        ``(that, gather(x))``.

    Example::

        >>> import torch
        >>> import tpflow as tpf
        >>> from tpflow.ops import all_gather_matmul
        >>> P = tpf.placement("cpu", ranks=[0, 1])                # run on 2 ranks
        >>> x = torch.randn(8, 2, 512)                            # [this rank's 8 of 16 tokens, batch, hidden]
        >>> w = torch.randn(512, 1024)
        >>> y, gathered = all_gather_matmul(x, w, P.mesh.get_group(0), activation="gelu", return_gathered=True)
        >>> y.shape, gathered.shape
        (torch.Size([16, 2, 1024]), torch.Size([16, 2, 512]))
        >>> world = tpf.comm.FakeWorld(2)                         # or 2 ranks as threads of one process
        >>> xs, w = torch.randn(5, 4), torch.randn(4, 6)          # 5 rows: rank 0 holds 3, rank 1 holds 2
        >>> out = world.run(lambda t: all_gather_matmul(xs.chunk(2)[t.rank], w, t, rows=5, algo="ring"))
        >>> torch.testing.assert_close(out[1], xs @ w)
    """
    _check_operands(x, w, bias, "all_gather_matmul")
    t = as_transport(group)
    if rows is None:
        if t.world_size > 1:
            _check_even_rows(t, x.shape[0], x.device)
        rows = x.shape[0] * t.world_size
    start, end = chunk_bounds(rows, t.world_size)[t.rank]
    if x.shape[0] != end - start:
        raise ValueError(f"all_gather_matmul: rank {t.rank} holds {x.shape[0]} rows, but chunk {t.rank} of {rows} "
                         f"rows over {t.world_size} ranks has {end - start}")
    bounds = _flat_bounds(rows, t.world_size, math.prod(x.shape[1:-1]))
    ring = _use_ring(algo, t, bounds, x.shape[-1], x.device)
    y, gathered = _AllGatherMatmul.apply(x.reshape(math.prod(x.shape[:-1]), x.shape[-1]), w, bias, t, bounds, ring,
                                         activation, out_dtype or x.dtype, keep_gathered)
    y, gathered = y.reshape(rows, *x.shape[1:-1], w.shape[1]), gathered.reshape(rows, *x.shape[1:])
    return (y, gathered) if return_gathered else y


def matmul_reduce_scatter_ref(x: torch.Tensor, w: torch.Tensor, group: Group = None, *,
                              bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The unfused reference: ``torch.matmul``, then the library's reduce-scatter (not differentiable).

    What ``matmul_reduce_scatter`` computes, for tests and benchmarks to compare against; the partial
    sums travel in ``x``'s dtype.

    Args:
        x: this rank's operand ``[M, ..., K_r]``: all M rows, this rank's block of K.
        w: this rank's block of the weight, ``[K_r, N]``.
        group: a process group (default None: the world) or a ``Transport``.
        bias: ``[N]``, added to the sum (default None).
        out_dtype: the output's dtype (default: ``x``'s).

    Returns:
        This rank's rows of ``sum over ranks (x @ w) + bias``, ``[M_r, ..., N]``.

    Example::

        >>> import torch
        >>> import tpflow as tpf
        >>> from tpflow.ops import matmul_reduce_scatter, matmul_reduce_scatter_ref
        >>> world = tpf.comm.FakeWorld(2)
        >>> xs, ws = torch.randn(2, 8, 4), torch.randn(2, 4, 6)
        >>> fused = world.run(lambda t: matmul_reduce_scatter(xs[t.rank], ws[t.rank], t))
        >>> ref = world.run(lambda t: matmul_reduce_scatter_ref(xs[t.rank], ws[t.rank], t))
        >>> torch.testing.assert_close(fused, ref)
    """
    t = as_transport(group)
    y = torch.matmul(x, w)
    out = t.reduce_scatter(y.flatten(1), chunk_bounds(x.shape[0], t.world_size))
    out = out.reshape(out.shape[0], *y.shape[1:])
    return (out if bias is None else out + bias).to(out_dtype or x.dtype)


def all_gather_matmul_ref(x: torch.Tensor, w: torch.Tensor, group: Group = None, *, rows: int | None = None,
                          bias: torch.Tensor | None = None, activation: str | None = None,
                          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The unfused reference: the library's all-gather, then ``torch.matmul`` (not differentiable).

    What ``all_gather_matmul`` computes, for tests and benchmarks to compare against.

    Args:
        x: this rank's rows ``[M_r, ..., K]``, ``chunk(r)`` of dim 0.
        w: the weight ``[K, N]``.
        group: a process group (default None: the world) or a ``Transport``.
        rows: M, the whole dim 0 (default None: ``W * M_r``, not checked).
        bias: ``[N]``, added before the activation (default None).
        activation: ``None`` (the default), ``"relu"``, ``"gelu"`` (the tanh form) or ``"silu"``.
        out_dtype: the output's dtype (default: ``x``'s).

    Returns:
        ``act(gather(x) @ w + bias)``, ``[M, ..., N]``.

    Example::

        >>> import torch
        >>> import tpflow as tpf
        >>> from tpflow.ops import all_gather_matmul, all_gather_matmul_ref
        >>> world = tpf.comm.FakeWorld(2)
        >>> xs, w = torch.randn(8, 4), torch.randn(4, 6)
        >>> fused = world.run(lambda t: all_gather_matmul(xs.chunk(2)[t.rank], w, t, activation="relu"))
        >>> ref = world.run(lambda t: all_gather_matmul_ref(xs.chunk(2)[t.rank], w, t, activation="relu"))
        >>> torch.testing.assert_close(fused, ref)
    """
    t = as_transport(group)
    rows = x.shape[0] * t.world_size if rows is None else rows
    gathered = t.all_gather(x.flatten(1).contiguous(), chunk_bounds(rows, t.world_size))
    return matmul_ref(gathered.reshape(rows, *x.shape[1:]), w, bias=bias, activation=activation, out_dtype=out_dtype)
