"""Ring attention where each query sees the keys from a first one up to itself: packed documents (a document's
start), sliding windows (``i - window + 1``), left padding (the first real token), chunked attention (the chunk's
start). Most key / value blocks are then seen by few ranks, or none: instead of passing every block around the
ring, each rank fetches from each other rank only the keys its queries can see (``RingExchange``), one peer a step
(step s: from rank r - s, to rank r + s), the next step's transfer posted before this one's attention runs. A
sliding window of w tokens costs a rank about w tokens of keys and values from its neighbours, not the sequence.

The backward replays the steps: each rank fetches the same keys again, computes their gradients and sends them back
to their rank (fp32, fp64 for fp64), which adds them to its own.

``bounded_attention`` is the same on one rank holding whole sequences (Ulysses' heads): the sequence cut into pieces
(``pieces``), each pair of pieces in which some query sees some key computed on its own, so that no ``[S, S]`` mask
or scores are ever held.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from tpflow.comm.accounting import stats
from tpflow.comm.transport import Transport, as_transport
from tpflow.kernels.attention import add_sinks, attention, attention_backward, merge, sinks_backward
from tpflow.kernels.epilogue import accumulate_dtype
from tpflow.ops.context_attention import Segments

__all__ = ["RingExchange", "bounded_attention", "bounded_ring_attention", "pieces", "ring_exchange"]

Ranges = tuple[tuple[int, int], ...]  # (first position, length) of tokens, each inside one segment of their rank


@dataclasses.dataclass(frozen=True)
class RingExchange:
    """What each rank fetches from each other for a batch whose queries see keys from a first one on.

    Args:
        segments: every rank's segments of the sequence, in group rank order.
        first: ``[B, S]`` the global position of each query's first visible key (every rank the same).
        lowest: its smallest over the batch rows, per position (host integers).
        needs: ``needs[dst][src]``: the tokens of rank src whose keys rank dst's queries see (``src != dst``).

    Example::

        >>> first = torch.tensor([[0, 0, 0, 0, 4, 4, 4, 4]])          # two documents of 4 tokens
        >>> exchange = ring_exchange([((0, 4),), ((4, 4),)], first)
        >>> exchange.needs[1][0], exchange.needs[0][1]                # the second document's queries need nothing
        ((), ())
    """

    segments: tuple[Segments, ...]
    first: torch.Tensor
    lowest: tuple[int, ...]
    needs: tuple[tuple[Ranges, ...], ...]

    def rows(self, rank: int, ranges: Ranges) -> list[slice]:
        """The local rows of ``rank``'s tensors that hold ``ranges``."""
        out, at = [], 0
        starts = {}
        for start, length in self.segments[rank]:
            starts[start] = (at, length)
            at += length
        for start, length in ranges:
            seg_start = max(s for s in starts if s <= start)
            local = starts[seg_start][0] + start - seg_start
            out.append(slice(local, local + length))
        return out

    def blocks(self, rank: int, ranges: Ranges) -> Iterator[tuple[slice, slice, int, int]]:
        """(this rank's query rows, the key rows in a buffer laid out as ``ranges``, the first query's position, the
        first key's) of each pair of segment and range in which some query sees some key."""
        q_at = 0
        for q_start, q_len in self.segments[rank]:
            k_at = 0
            for k_start, k_len in ranges:
                first_query = max(q_start, k_start)  # causal: the queries before the keys see none of them
                if first_query < q_start + q_len and self.lowest[first_query] < k_start + k_len:
                    rows = slice(q_at + first_query - q_start, q_at + q_len)
                    yield rows, slice(k_at, k_at + k_len), first_query, k_start
                k_at += k_len
            q_at += q_len


def ring_exchange(segments: Sequence[Segments], first: torch.Tensor) -> RingExchange:
    """The exchange of a batch: which tokens' keys and values each rank needs from each other, found once per batch
    (one copy of ``first`` to the host) and shared by every layer with the same first keys.

    Args:
        segments: every rank's segments of the sequence (``head_tail``, ``contiguous`` or any other cut of it into
            parts of equal total length per rank).
        first: ``[B, S]`` integers, the global position of each query's first visible key: nondecreasing along each
            row and not after the query.

    Returns:
        The ``RingExchange``.

    Example::

        >>> positions = torch.arange(8)[None]
        >>> exchange = ring_exchange([((0, 4),), ((4, 4),)], (positions - 1).clamp(min=0))  # a window of 2
        >>> exchange.needs[1][0]                                      # rank 1 needs rank 0's last token alone
        ((3, 1),)
    """
    segments = tuple(tuple(tuple(s) for s in parts) for parts in segments)
    host = first.detach().to("cpu", torch.long)
    seq = sum(length for parts in segments for _, length in parts)
    if host.ndim != 2 or host.shape[1] != seq:
        raise ValueError(f"ring_exchange: first must be [batch, {seq}] (the segments' sequence), got "
                         f"{list(host.shape)}")
    if bool((host.diff(dim=1) < 0).any()) or bool((host > torch.arange(seq)).any()) or bool((host < 0).any()):
        raise ValueError("ring_exchange: each query's first key must be a position from 0 up to the query's own, "
                         "nondecreasing along the sequence")
    lowest = tuple(host.min(0).values.tolist())
    needs = []
    for dst, mine in enumerate(segments):
        row = []
        for src, theirs in enumerate(segments):
            wanted = [] if src == dst else [
                (max(k_start, lowest[q_start]), min(k_start + k_len, q_start + q_len))
                for k_start, k_len in theirs for q_start, q_len in mine]
            row.append(_union([(a, b) for a, b in wanted if a < b], theirs))
        needs.append(tuple(row))
    return RingExchange(segments, first, lowest, tuple(needs))


def _union(spans: list[tuple[int, int]], segments: Segments) -> Ranges:
    """``[a, b)`` spans merged where they overlap or touch inside one segment, as (start, length) in segment order."""
    out: list[list[int]] = []
    for (a, b), segment in sorted((span, _segment(span[0], segments)) for span in spans):
        if out and out[-1][2] == segment and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b, segment])
    return tuple((a, b - a) for a, b, _ in out)


def _segment(position: int, segments: Segments) -> int:
    return next(n for n, (start, length) in enumerate(segments) if start <= position < start + length)


def _gather(kv: torch.Tensor, rows: list[slice]) -> torch.Tensor:
    """The rows of ``[B, H, L, Dk + Dv]`` keys and values side by side, end to end (a message to send)."""
    return torch.cat([kv[:, :, r] for r in rows], 2)


class _Step:
    """One step's transfer: this rank's keys and values that rank r + s needs, out; those it needs of r - s, in."""

    def __init__(self, exchange: RingExchange, transport: Transport, kv: torch.Tensor, step: int, tag: int) -> None:
        W, r = transport.world_size, transport.rank
        self.dst, self.src = (r + step) % W, (r - step) % W
        self.ranges = exchange.needs[r][self.src]
        out_rows = exchange.rows(r, exchange.needs[self.dst][r])
        length = sum(n for _, n in self.ranges)
        self.buffer = kv.new_empty((*kv.shape[:2], length, kv.shape[3]))
        sends = [(_gather(kv, out_rows), self.dst)] if out_rows else []
        recvs = [(self.buffer, self.src)] if length else []
        self.handles = transport.post(sends=sends, recvs=recvs, tag=tag)

    def wait(self) -> torch.Tensor:
        sent, got = self.handles
        got.wait()
        sent.wait()
        return self.buffer


class _BoundedRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, exchange, transport, scale, softcap):
        W, r = transport.world_size, transport.rank
        wide = accumulate_dtype(q.dtype)
        out = torch.zeros((*q.shape[:3], v.shape[-1]), dtype=wide, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=wide, device=q.device)
        width = k.shape[-1]
        kv = torch.cat([k, v], -1)  # keys and values side by side (MLA's differ in width)
        coming = _Step(exchange, transport, kv, 1, 0) if W > 1 else None
        for step in range(W):
            if step == 0:
                held, ranges = kv, exchange.segments[r]
            else:
                held, ranges = coming.wait(), coming.ranges
                coming = _Step(exchange, transport, kv, step + 1, 0) if step + 1 < W else None
            for rows, keys, q_at, k_at in exchange.blocks(r, ranges):
                block = attention(q[:, :, rows], held[:, :, keys, :width], held[:, :, keys, width:], causal=True,
                                  scale=scale,
                                  q_offset=q_at, k_offset=k_at, softcap=softcap,
                                  first=exchange.first[:, q_at:q_at + rows.stop - rows.start])
                out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], *block)
        if sinks is not None:
            out, lse = add_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.exchange, ctx.transport, ctx.scale, ctx.softcap = exchange, transport, scale, softcap
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        exchange, transport = ctx.exchange, ctx.transport
        W, r = transport.world_size, transport.rank
        wide = accumulate_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=wide, device=q.device)
        width = k.shape[-1]
        kv = torch.cat([k, v], -1)
        dkv = torch.zeros(kv.shape, dtype=wide, device=k.device)
        coming = _Step(exchange, transport, kv, 1, 0) if W > 1 else None
        returns = []
        for step in range(W):
            if step == 0:
                held, ranges = kv, exchange.segments[r]
            else:  # the next step's keys cross the links while these compute
                now = coming
                held, ranges = now.wait(), now.ranges
                coming = _Step(exchange, transport, kv, step + 1, 0) if step + 1 < W else None
            grads = dkv if step == 0 else torch.zeros(held.shape, dtype=wide, device=held.device)
            for rows, keys, q_at, k_at in exchange.blocks(r, ranges):
                dq_b, dk_b, dv_b = attention_backward(
                    q[:, :, rows], held[:, :, keys, :width], held[:, :, keys, width:], out[:, :, rows], lse[:, :, rows],
                    dout[:, :, rows], causal=True, scale=ctx.scale, q_offset=q_at, k_offset=k_at,
                    softcap=ctx.softcap, first=exchange.first[:, q_at:q_at + rows.stop - rows.start])
                dq[:, :, rows] += dq_b
                grads[:, :, keys, :width] += dk_b
                grads[:, :, keys, width:] += dv_b
            if step > 0:  # their keys' gradients back to rank r - s; ours from rank r + s
                back = exchange.needs[now.dst][r]
                mine = torch.empty((*dkv.shape[:2], sum(n for _, n in back), dkv.shape[3]), dtype=wide,
                                   device=dkv.device)
                handles = transport.post(sends=[(grads, now.src)] if ranges else [],
                                         recvs=[(mine, now.dst)] if back else [], tag=1)
                returns.append((handles, grads, mine, exchange.rows(r, back)))
        for (sent, got), _, mine, rows in returns:
            got.wait()
            sent.wait()
            at = 0
            for piece in rows:
                n = piece.stop - piece.start
                dkv[:, :, piece] += mine[:, :, at:at + n]
                at += n
        dsinks = None if sinks is None else sinks_backward(out, lse, dout, sinks)
        return (dq.to(q.dtype), dkv[..., :width].to(k.dtype), dkv[..., width:].to(v.dtype), dsinks, None, None, None,
                None)


def bounded_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, exchange: RingExchange,
                           group: dist.ProcessGroup | Transport | None, scale: float | None = None,
                           softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries on every rank's keys and values, each query seeing keys from its first
    one (``exchange.first``) up to itself, each rank fetching from the others only the keys its queries see.
    Differentiable in q, k and v.

    Args:
        q: ``[B, Hq, L, D]``, this rank's queries: its segments laid end to end.
        k, v: ``[B, Hkv, L, D]``, this rank's keys and values, at the same positions.
        exchange: ``ring_exchange(segments, first)`` of this batch, the same on every rank.
        group: the ranks the sequence is split over: a process group, a ``Transport``, or None for the world.
        scale: the scores' factor (default ``D ** -0.5``).
        softcap: scores capped to ``softcap * tanh(s / softcap)``, or None.
        sinks: ``[Hq]`` each head's sink logit in the softmax's denominator (gpt-oss's), or None.

    Returns:
        ``[B, Hq, L, D]`` in q's dtype.

    Example::

        >>> from tpflow.ops import contiguous
        >>> _ = torch.manual_seed(0)                        # on 2 ranks: the same whole sequence everywhere
        >>> q, k, v = torch.randn(3, 1, 4, 8, 16).unbind(0)
        >>> first = (torch.arange(8) - 2).clamp(min=0)[None]   # a sliding window of 3
        >>> exchange = ring_exchange(contiguous(2, 8), first)
        >>> r = tpf.get_rank()
        >>> out = bounded_ring_attention(*(t[:, :, 4 * r:4 * r + 4] for t in (q, k, v)), exchange=exchange,
        ...                              group=None)
        >>> seen = (torch.arange(8)[:, None] >= torch.arange(8)) & (torch.arange(8) >= first.T)
        >>> whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=seen)
        >>> torch.testing.assert_close(out, whole[:, :, 4 * r:4 * r + 4])
    """
    transport = as_transport(group)
    if len(exchange.segments) != transport.world_size:
        raise ValueError(f"bounded_ring_attention: {len(exchange.segments)} ranks' segments for a ring of "
                         f"{transport.world_size}")
    if q.shape[0] != exchange.first.shape[0] or k.shape[2] != q.shape[2] or \
            sum(n for _, n in exchange.segments[transport.rank]) != q.shape[2]:
        raise ValueError(f"bounded_ring_attention: q {list(q.shape)} and k {list(k.shape)} do not match the "
                         f"exchange's batch of {exchange.first.shape[0]} rows and this rank's segments "
                         f"{exchange.segments[transport.rank]}")
    return _BoundedRing.apply(q, k, v, sinks, exchange, transport, scale, softcap)



class _Alone(Transport):
    """One rank by itself: every key is here, nothing is sent."""

    def __init__(self) -> None:
        self.rank, self.world_size, self.stats = 0, 1, stats

    def post(self, sends=(), recvs=(), tag: int = 0):
        raise RuntimeError("a rank alone sends nothing")


def pieces(seq: int, size: int) -> Segments:
    """A ``seq``-token sequence cut into pieces of ``size`` tokens (the last maybe shorter): one rank's segments for
    ``bounded_attention``.

    Args:
        seq: the tokens.
        size: a piece's.

    Returns:
        The segments ``(first position, length)``.

    Example::

        >>> pieces(10, 4)
        ((0, 4), (4, 4), (8, 2))
    """
    return tuple((start, min(size, seq - start)) for start in range(0, seq, size))


def bounded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, exchange: RingExchange,
                      scale: float | None = None, softcap: float | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of whole sequences held by one rank, each query seeing keys from its first one
    (``exchange.first``) up to itself, pair of pieces by pair of pieces (those no query of one sees a key of the
    other skipped). Differentiable in q, k, v and the sinks.

    Args:
        q: ``[B, Hq, S, D]``.
        k, v: ``[B, Hkv, S, D]``.
        exchange: ``ring_exchange([pieces(S, size)], first)``, one rank's.
        scale, softcap, sinks: as in ``bounded_ring_attention``.

    Returns:
        ``[B, Hq, S, D]`` in q's dtype.

    Example::

        >>> q, k, v = torch.randn(3, 1, 2, 8, 16).unbind(0)
        >>> first = torch.tensor([[0, 0, 0, 3, 3, 3, 3, 3]])          # documents of 3 and 5 tokens
        >>> out = bounded_attention(q, k, v, exchange=ring_exchange([pieces(8, 2)], first))
        >>> seen = (torch.arange(8)[:, None] >= torch.arange(8)) & (torch.arange(8) >= first.T)
        >>> whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=seen)
        >>> torch.testing.assert_close(out, whole)
    """
    if len(exchange.segments) != 1:
        raise ValueError(f"bounded_attention runs on one rank's pieces; the exchange has {len(exchange.segments)} "
                         f"ranks': use bounded_ring_attention")
    return bounded_ring_attention(q, k, v, exchange=exchange, group=_Alone(), scale=scale, softcap=softcap,
                                  sinks=sinks)
