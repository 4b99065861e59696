"""Attention over a sequence split across ranks (context parallelism), on local blocks: no rank holds every token's
keys or activations, only its own queries' parts of the sequence.

    ring_attention      each rank keeps its queries; the key / value blocks go around the ring, the next one's
                        transfer posted before this one's attention runs; the blocks' results merge by their
                        log-sum-exps; backward: the blocks the other way round, their gradients travelling one step
                        behind, each block's computed from the queries' final output and log-sum-exp
    ulysses_attention   an all-to-all turns the sequence split into a split of the heads, any attention runs on
                        whole sequences of this rank's heads, and a second turns it back (4 all-to-alls forward)

A rank's part of the sequence is a list of segments (first position, length) laid end to end in its local tensors:
``head_tail`` balances causal work (rank r holds parts r and 2W-1-r of 2W, so every rank has as many visible blocks
as any other), ``contiguous`` is one segment each, ``balanced`` balances the work of packed documents (each query's
keys start at its document's). ``regroup`` moves a tensor from one cut to another.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from einops import rearrange

from tpflow import comm
from tpflow.comm.transport import Handle, Transport, as_transport
from tpflow.kernels.attention import add_sinks, attention, attention_backward, merge, sinks_backward
from tpflow.kernels.epilogue import accumulate_dtype

__all__ = ["Segments", "attention_work", "balanced", "contiguous", "head_tail", "regroup", "ring_attention",
           "ulysses_attention", "ulysses_degrees"]

Segments = tuple[tuple[int, int], ...]  # (first position, length) of each part a rank holds, in its local order


def head_tail(world: int, seq: int) -> list[Segments]:
    """Each rank's parts of a ``seq``-token sequence cut into ``2 * world`` equal parts: rank r holds parts r and
    2W-1-r, so that under causal masking every rank attends to as many keys as any other.

    Args:
        world: the ranks.
        seq: the sequence's length, a multiple of ``2 * world``.

    Returns:
        For each rank, its two segments ``(first position, length)``.

    Example::

        >>> head_tail(2, 8)
        [((0, 2), (6, 2)), ((2, 2), (4, 2))]
    """
    if seq % (2 * world):
        raise ValueError(f"head_tail cuts {seq} tokens into {2 * world} equal parts: pad to a multiple of {2 * world}")
    part = seq // (2 * world)
    return [((r * part, part), ((2 * world - 1 - r) * part, part)) for r in range(world)]


def contiguous(world: int, seq: int) -> list[Segments]:
    """Each rank's one segment of a ``seq``-token sequence cut into ``world`` equal parts.

    Args:
        world: the ranks.
        seq: the sequence's length, a multiple of ``world``.

    Returns:
        For each rank, its segment ``(first position, length)``.

    Example::

        >>> contiguous(2, 8)
        [((0, 4),), ((4, 4),)]
    """
    if seq % world:
        raise ValueError(f"contiguous cuts {seq} tokens into {world} equal parts: pad to a multiple of {world}")
    return [((r * (seq // world), seq // world),) for r in range(world)]


def attention_work(segments: Sequence[Segments], first: torch.Tensor) -> list[int]:
    """Each rank's causal attention work: the (query, key) pairs its queries score, query i seeing the keys from
    ``first[:, i]`` to itself, summed over the batch.

    Args:
        segments: every rank's segments.
        first: ``[B, S]`` each query's first visible key (``torch.arange(S)`` rows of zeros: plain causal).

    Returns:
        The pairs of each rank.

    Example::

        >>> attention_work(head_tail(2, 8), torch.zeros(1, 8, dtype=torch.long))   # causal: 1 + 2 + ... + 8
        [18, 18]
    """
    per = (torch.arange(first.shape[1], device=first.device) - first + 1).sum(0).tolist()
    return [sum(sum(per[a:a + n]) for a, n in parts) for parts in segments]


def balanced(world: int, first: torch.Tensor, chunks: int = 8) -> list[Segments]:
    """A cut of the sequence whose ranks' attention work is even where documents are packed (``first``: each query's
    first key, its document's start): the sequence in ``2 * world * m`` equal pieces (m the largest of ``chunks``,
    4, 2, 1 that divides it), each rank given as many pieces, the heaviest first to the least loaded rank (torch's
    per-document head-tail is the model: a long document's pieces spread over the ranks); head-tail where that is
    as even. Every rank holds as many tokens.

    Args:
        world: the ranks.
        first: ``[B, S]``, S a multiple of ``2 * world``, the same on every rank.
        chunks: pieces per head-tail part at most.

    Returns:
        For each rank, its segments, adjacent pieces merged.

    Example::

        >>> first = torch.tensor([[0] * 12 + [12] * 4])       # a document of 12 tokens, then one of 4
        >>> segments = balanced(2, first, chunks=2)
        >>> attention_work(segments, first), attention_work(head_tail(2, 16), first)
        ([44, 44], [20, 68])
    """
    seq = first.shape[1]
    if seq % (2 * world):
        raise ValueError(f"balanced cuts {seq} tokens into {2 * world} equal parts at least: pad to a multiple of "
                         f"{2 * world}")
    m = next(m for m in (chunks, 4, 2, 1) if seq % (2 * world * m) == 0)
    size, pieces = seq // (2 * world * m), 2 * world * m
    per = (torch.arange(seq, device=first.device) - first + 1).sum(0)
    work = per.view(pieces, size).sum(1).tolist()
    loads, held = [0] * world, [[] for _ in range(world)]
    for piece in sorted(range(pieces), key=lambda p: (-work[p], p)):
        rank = min((r for r in range(world) if len(held[r]) < 2 * m), key=lambda r: (loads[r], r))
        loads[rank] += work[piece]
        held[rank].append(piece)
    tail = head_tail(world, seq)
    if max(attention_work(tail, first)) <= max(loads):
        return tail
    return [_runs(sorted(parts), size) for parts in held]


def _runs(pieces: list[int], size: int) -> Segments:
    """Sorted pieces of ``size`` tokens as segments, adjacent ones merged."""
    out: list[list[int]] = []
    for p in pieces:
        if out and out[-1][0] + out[-1][1] == p * size:
            out[-1][1] += size
        else:
            out.append([p * size, size])
    return tuple((a, n) for a, n in out)


@functools.lru_cache(maxsize=8)  # a packed batch has its own cut: keep the last few
def _moves(have: tuple[Segments, ...], want: tuple[Segments, ...], rank: int) -> tuple[list, list, list, list]:
    """For ``regroup`` on ``rank``: its local rows in the order they leave, the counts to each rank, the counts from
    each, and the received rows' order in the new cut."""
    owner = {}
    for r, parts in enumerate(want):
        for a, n in parts:
            for p in range(a, a + n):
                owner[p] = r
    positions = [[p for a, n in parts for p in range(a, a + n)] for parts in have]
    mine = positions[rank]
    leaving = sorted(range(len(mine)), key=lambda i: (owner[mine[i]], i))
    send = [sum(owner[p] == r for p in mine) for r in range(len(have))]
    recv = [sum(owner[p] == rank for p in theirs) for theirs in positions]
    arriving = [p for theirs in positions for p in sorted(theirs, key=lambda p: owner[p]) if owner[p] == rank]
    where = {p: i for i, p in enumerate(arriving)}
    order = [where[p] for a, n in want[rank] for p in range(a, a + n)]
    return leaving, send, recv, order


def regroup(x: torch.Tensor, have: Sequence[Segments], want: Sequence[Segments],
            group: dist.ProcessGroup | None) -> torch.Tensor:
    """``x``'s dim 1, this rank's tokens laid out as ``have``, laid out as ``want`` instead: one all-to-all of the
    tokens that change rank (differentiable: the gradients go back the same way).

    Args:
        x: ``[B, L, ...]``, this rank's segments of ``have`` end to end.
        have, want: every rank's segments of the sequence, before and after.
        group: the ranks the sequence is split over.

    Returns:
        ``[B, L', ...]``: this rank's segments of ``want`` end to end.

    Example::

        >>> rank = tpf.get_rank()                         # on 2 ranks: positions 0-1, 6-7 and 2-5 to 0-3, 4-7
        >>> x = torch.tensor([[0, 1, 6, 7]]) if rank == 0 else torch.tensor([[2, 3, 4, 5]])
        >>> regroup(x, head_tail(2, 8), contiguous(2, 8), torch.distributed.group.WORLD)[0].tolist()  # on rank 1
        [4, 5, 6, 7]
    """
    have, want = tuple(map(tuple, have)), tuple(map(tuple, want))
    rank = 0 if group is None else dist.get_rank(group)
    leaving, send, recv, order = _moves(have, want, rank)
    rows = torch.tensor(leaving, device=x.device)
    got = comm.all_to_all_mirror(x.index_select(1, rows).movedim(1, 0).contiguous(), send, recv, group)
    return got.index_select(0, torch.tensor(order, device=x.device)).movedim(0, 1)


def _blocks(mine: Segments, theirs: Segments, causal: bool) -> Iterator[tuple[slice, slice, bool, int, int]]:
    """(this rank's query rows, the key rows, partly masked, q offset, k offset) of every pair of segments in which
    some query sees some key: a wholly visible block runs unmasked, a wholly hidden one not at all."""
    q_at = 0
    for q_start, q_len in mine:
        k_at = 0
        for k_start, k_len in theirs:
            masked = causal and k_start + k_len - 1 > q_start
            if not causal or k_start <= q_start + q_len - 1:
                yield slice(q_at, q_at + q_len), slice(k_at, k_at + k_len), masked, q_start, k_start
            k_at += k_len
        q_at += q_len


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, segments, transport, causal, scale, softcap):
        W, r = transport.world_size, transport.rank
        wide = accumulate_dtype(q.dtype)
        out = torch.zeros((*q.shape[:3], v.shape[-1]), dtype=wide, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=wide, device=q.device)
        width = k.shape[-1]
        kv = torch.cat([k, v], -1)  # one message a step: keys and values side by side (MLA's differ in width)
        for step in range(W):
            if step < W - 1:  # the next block crosses the link while this one computes
                arriving = torch.empty_like(kv)
                sent, got = transport.post(sends=[(kv, (r + 1) % W)], recvs=[(arriving, (r - 1) % W)], tag=0)
            for rows, keys, masked, q_offset, k_offset in _blocks(segments[r], segments[(r - step) % W], causal):
                block = attention(q[:, :, rows], kv[:, :, keys, :width], kv[:, :, keys, width:], causal=masked,
                                  scale=scale, q_offset=q_offset, k_offset=k_offset, softcap=softcap)
                out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], *block)
            if step < W - 1:
                got.wait()
                sent.wait()
                kv = arriving
        if sinks is not None:
            out, lse = add_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        # the last block held (rank r + 1's) is the backward's first: it runs the other way round, so that every
        # block's gradient ends on its own rank with no last hop to wait for
        ctx.save_for_backward(q, k, v, out, lse, kv if W > 1 else kv.new_empty(0), sinks)
        ctx.segments, ctx.transport, ctx.causal, ctx.scale, ctx.softcap = segments, transport, causal, scale, softcap
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, last, sinks = ctx.saved_tensors
        transport, segments = ctx.transport, ctx.segments
        W, r = transport.world_size, transport.rank
        right, left = (r + 1) % W, (r - 1) % W
        wide = accumulate_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=wide, device=q.device)
        width = k.shape[-1]
        kv = last if W > 1 else torch.cat([k, v], -1)
        got_grad, sent_grads, arriving_grad = Handle(), [], None
        for step in range(W):  # step s holds rank r + s + 1's block: the right neighbour's of the step before
            if step < W - 2:  # the next block crosses the link while this one computes (the last one is this rank's)
                arriving = torch.empty_like(kv)
                sent, got = transport.post(sends=[(kv, left)], recvs=[(arriving, right)], tag=0)
            elif step == W - 1:
                kv = torch.cat([k, v], -1)
            dkv = torch.zeros(kv.shape, dtype=wide, device=k.device)
            src = (r + step + 1) % W
            for rows, keys, masked, q_offset, k_offset in _blocks(segments[r], segments[src], ctx.causal):
                dq_b, dk_b, dv_b = attention_backward(
                    q[:, :, rows], kv[:, :, keys, :width], kv[:, :, keys, width:], out[:, :, rows], lse[:, :, rows],
                    dout[:, :, rows], causal=masked, scale=ctx.scale, q_offset=q_offset, k_offset=k_offset,
                    softcap=ctx.softcap)
                dq[:, :, rows] += dq_b
                dkv[:, :, keys, :width] += dk_b
                dkv[:, :, keys, width:] += dv_b
            got_grad.wait()  # the block's gradient so far, from the ranks that held it before
            if arriving_grad is not None:
                dkv += arriving_grad
            if step < W - 1:  # on to the left neighbour, which holds this block next
                arriving_grad = torch.empty_like(dkv)
                sent_grad, got_grad = transport.post(sends=[(dkv, left)], recvs=[(arriving_grad, right)], tag=1)
                sent_grads.append(sent_grad)
            if step < W - 2:
                got.wait()
                sent.wait()
                kv = arriving
        for handle in sent_grads:
            handle.wait()
        dsinks = None if sinks is None else sinks_backward(out, lse, dout, sinks)
        return (dq.to(q.dtype), dkv[..., :width].to(k.dtype), dkv[..., width:].to(v.dtype), dsinks, None, None, None,
                None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, segments: Sequence[Segments],
                   group: dist.ProcessGroup | Transport | None, causal: bool = True, scale: float | None = None,
                   softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of this rank's queries on every rank's keys and values, the key / value blocks passed around the
    ring of ``group``: ring attention. Differentiable in q, k and v.

    Each step posts the next block's transfer, then computes the blocks it holds (``tpf.kernels.attention``, with
    global positions, so causal masking is the whole sequence's) and merges them by their log-sum-exps: the
    transfer hides behind the compute. Blocks a causal mask hides wholly are skipped. The backward goes the other way
    round, starting from the block the forward ended with (kept for it) and ending with this rank's own: the key /
    value blocks of the W - 2 steps between cross the links again, and each block's gradient (fp32, fp64 for fp64)
    follows it one step behind, reaching its own rank with its last contribution, so no transfer is left to wait
    for at the end. Key / value heads fewer than the query heads travel as they are (GQA).

    Args:
        q: ``[B, Hq, L, D]``, this rank's queries: its segments laid end to end (any strides).
        k, v: ``[B, Hkv, L, D]``, this rank's keys and values, at the same positions.
        segments: every rank's segments of the sequence (``head_tail`` or ``contiguous``), in group rank order.
        group: the ranks the sequence is split over: a process group, a ``Transport`` (``tpf.comm.FakeWorld``'s),
            or None for the world.
        causal: hide from each query the keys at later positions.
        scale: the scores' factor (default ``D ** -0.5``).
        softcap: scores capped to ``softcap * tanh(s / softcap)`` (Gemma 2's), or None.
        sinks: ``[Hq]`` each head's sink logit in the softmax's denominator (gpt-oss's), or None.

    Returns:
        ``[B, Hq, L, D]`` in q's dtype: this rank's queries' attention over the whole sequence.

    Example::

        >>> _ = torch.manual_seed(0)                        # on 2 ranks: the same whole sequence everywhere
        >>> q, k, v = torch.randn(3, 1, 4, 8, 16).unbind(0)
        >>> segments = head_tail(2, 8)                      # rank 0: positions 0-1 and 6-7; rank 1: 2-5
        >>> mine = [torch.cat([t[:, :, a:a + n] for a, n in segments[tpf.get_rank()]], 2) for t in (q, k, v)]
        >>> out = ring_attention(*mine, segments=segments, group=None)
        >>> whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        >>> torch.testing.assert_close(out, torch.cat([whole[:, :, a:a + n] for a, n in segments[tpf.get_rank()]], 2))
    """
    transport = as_transport(group)
    if len(segments) != transport.world_size:
        raise ValueError(f"ring_attention: {len(segments)} ranks' segments for a ring of {transport.world_size}")
    lengths = {sum(n for _, n in s) for s in segments}
    if lengths != {q.shape[2]} or k.shape[2] != q.shape[2]:
        raise ValueError(f"ring_attention: every rank must hold {q.shape[2]} tokens as q does (k {k.shape[2]}); the "
                         f"segments give {sorted(lengths)}")
    return _Ring.apply(q, k, v, sinks, tuple(map(tuple, segments)), transport, causal, scale, softcap)


def ulysses_degrees(heads: int, kv_heads: int) -> list[int]:
    """The rank counts Ulysses can split attention heads over: W dividing the query heads, the key/value heads a
    multiple or a divisor of W (then repeated, each rank getting the one its query heads read).

    Args:
        heads: the query heads.
        kv_heads: the key/value heads.

    Returns:
        Every such W, ascending.

    Example::

        >>> ulysses_degrees(8, 2)
        [1, 2, 4, 8]
        >>> ulysses_degrees(6, 4)                       # 3 and 6 ranks: 4 kv heads neither split nor repeat
        [1, 2]
    """
    return [w for w in range(1, heads + 1) if heads % w == 0 and (kv_heads % w == 0 or w % kv_heads == 0)]


def _heads_to_ranks(x: torch.Tensor, world: int) -> torch.Tensor:
    """``[B, H, L, D]`` as ``[W, B, H / W, L, D]``: the rows for each rank, its block of heads."""
    return rearrange(x, "b (w h) l d -> w b h l d", w=world).contiguous()


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                      group: dist.ProcessGroup | None) -> torch.Tensor:
    """Attention of a sequence split over ``group`` by turning the split into one of the heads (Ulysses): an
    all-to-all gives every rank the whole sequence of its block of heads, ``attend`` runs on it unchanged, and an
    all-to-all brings each rank its tokens of every head back. The ranks must hold contiguous segments in rank
    order (``contiguous``). Key / value heads fewer than the ranks are repeated so each rank gets the one its query
    heads read (their gradients summed back); the query heads must split over the ranks.

    Args:
        q: ``[B, Hq, L, D]``, this rank's tokens of every query head.
        k, v: ``[B, Hkv, L, D]``: Hkv a multiple of W, or W a multiple of Hkv.
        attend: ``attend(q, k, v) -> [B, h, S, D]``, causal attention over the whole sequence of ``h`` heads.
        group: the ranks the sequence is split over; None: one rank.

    Returns:
        ``[B, Hq, L, D]``: this rank's tokens' attention, every head.

    Example::

        >>> _ = torch.manual_seed(0)                        # on 2 ranks: the same whole sequence everywhere
        >>> q, k, v = torch.randn(3, 1, 4, 8, 16).unbind(0)
        >>> def attend(q, k, v):
        ...     return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        >>> mine = [t[:, :, 4 * tpf.get_rank():4 * tpf.get_rank() + 4] for t in (q, k, v)]
        >>> out = ulysses_attention(*mine, attend, torch.distributed.group.WORLD)
        >>> torch.testing.assert_close(out, attend(q, k, v)[:, :, 4 * tpf.get_rank():4 * tpf.get_rank() + 4])
    """
    world = 1 if group is None else dist.get_world_size(group)
    if world == 1:
        return attend(q, k, v)
    heads, kv_heads = q.shape[1], k.shape[1]
    if world not in ulysses_degrees(heads, kv_heads):
        raise ValueError(f"ulysses_attention cannot split {heads} query heads and {kv_heads} key/value heads over "
                         f"{world} ranks: use {ulysses_degrees(heads, kv_heads)} ranks")
    if kv_heads < world:  # each rank gets the key/value head its query heads read
        k, v = k.repeat_interleave(world // kv_heads, 1), v.repeat_interleave(world // kv_heads, 1)
    ones = [1] * world
    parts = comm.all_to_all_mirror([_heads_to_ranks(t, world) for t in (q, k, v)], ones, ones, group)
    q, k, v = (rearrange(t, "w b h l d -> b h (w l) d") for t in parts)  # rank order is sequence order
    out = attend(q, k, v)
    back = comm.all_to_all_mirror(rearrange(out, "b h (w l) d -> w b h l d", w=world).contiguous(), ones, ones, group)
    return rearrange(back, "w b h l d -> b (w h) l d")
