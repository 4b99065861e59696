"""Attention of a block of queries on a block of keys / values, returning the log-sum-exp beside the output: the local
step of context parallelism, where each rank's queries meet, one ring step after another, key / value blocks from
other parts of the sequence, and the steps' results are combined by their log-sum-exps (``merge``).

    q    [B, Hq, Lq, D]    queries at global positions q_offset .. q_offset + Lq - 1
    k, v [B, Hkv, Lk, D]   keys at k_offset .. k_offset + Lk - 1; query head h reads kv head h // (Hq / Hkv) (GQA)
    out  [B, Hq, Lq, D]    softmax(q k^T * scale, masked) v, in q's dtype
    lse  [B, Hq, Lq]       fp32 logsumexp of each query's scores: what ``merge`` weighs two blocks' outputs by

    merge   lse = log(exp(lse_a) + exp(lse_b));  out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

Causal attention hides from each query the keys at later global positions, so a ring block can be partly visible
(the diagonal block), wholly visible (an earlier part of the sequence) or wholly hidden (a later part). A query that
sees no key of the block gets ``out = 0`` and ``lse = -inf``: ``merge`` gives such a block no weight, and its
gradients are 0.

Dispatch as ``matmul``'s: CUDA tensors run the Triton kernels (``attention_tiles``, ``attention_grad_tiles``:
flash-attention 2, forward and backward, reading every tensor through its strides, so transformers'
``[B, L, H, D].transpose(1, 2)`` views need no copy); CPU tensors run the torch reference (an explicit softmax in
fp32) unless the ``kernels`` switch is ``"triton"``, which runs the kernels through Triton's interpreter; without
gradients, a CPU block whose mask torch's flash kernel expresses (none, or the diagonal block) runs that kernel, and a
block with first keys runs it with a ``[B, 1, Lq, Lk]`` mask (the same in ``attention_backward``). fp64 and softcapped
scores run the reference.
All are differentiable, through ``lse`` too (the merge of a ring's steps differentiates through it).
``attention_backward`` gives a block's gradients from its queries' final output and log-sum-exp: a ring's backward.
"""

from __future__ import annotations

import importlib.util

import torch

from tpflow.kernels.epilogue import accumulate_dtype
from tpflow.kernels.linear import wanted
from tpflow.kernels.matmul import use_triton

if importlib.util.find_spec("triton") is not None:
    from tpflow.kernels import attention_grad_tiles, attention_tiles
else:  # CPU installs without triton run the torch reference
    attention_tiles = attention_grad_tiles = None

__all__ = ["add_sinks", "attention", "attention_backward", "attention_ref", "merge", "sinks_backward"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MAX_HEAD_DIM = 128  # the kernels hold a [tile, head dim] fp32 accumulator (two in the backward) in registers


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"attention takes q [B, Hq, Lq, D], k [B, Hkv, Lk, D] and v [B, Hkv, Lk, Dv], got q "
                         f"{tuple(q.shape)}, k "
                         f"{tuple(k.shape)} and v {tuple(v.shape)}")
    B, Hq, _, D = q.shape
    if k.shape[0] != B or k.shape[3] != D or k.shape[1] == 0 or Hq % k.shape[1]:
        raise ValueError(f"attention sizes differ: q {tuple(q.shape)} against k, v {tuple(k.shape)} (batch and head "
                         f"dim must match, and the query heads be a multiple of the kv heads)")
    if D < 1:
        raise ValueError(f"attention takes a head dim of at least 1, got {D}")
    if k.shape[2] == 0:
        raise ValueError("attention needs at least one key")
    if q.dtype not in _FLOATS or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"attention takes q, k and v of one floating dtype, got {q.dtype}, {k.dtype} and {v.dtype}")


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float | None = None,
                  q_offset: int = 0, k_offset: int = 0, softcap: float | None = None, first: torch.Tensor | None = None,
                  upcast: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of ``attention``: the scores, an explicit softmax in fp32 (fp64 for fp64 inputs) and the
    log-sum-exp, differentiable by autograd (through ``lse`` too, and with zero gradients for a query that sees no
    key). It holds the ``[B, Hq, Lq, Lk]`` scores; the kernels never do.

    Args:
        q, k, v, causal, scale, q_offset, k_offset, softcap, first: as in ``attention``.
        upcast: compute in float64 and return float64 (the reference a tolerance is measured against).

    Returns:
        ``(out, lse)``: out ``[B, Hq, Lq, D]`` in q's dtype, lse ``[B, Hq, Lq]`` in fp32 (float64 upcast or for
        fp64 inputs).

    Example::

        >>> q, k, v = torch.randn(1, 1, 2, 8), torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8)
        >>> out, lse = attention_ref(q, k, v, causal=True, q_offset=0, k_offset=1)   # keys at 1..3
        >>> lse[0, 0, 0].item(), out[0, 0, 0].abs().sum().item()                     # query 0 sees none of them
        (-inf, 0.0)
        >>> torch.testing.assert_close(out[0, 0, 1], v[0, 0, 0])                     # query 1 sees key 1 alone
    """
    _check(q, k, v)
    wide = torch.float64 if upcast else accumulate_dtype(q.dtype)
    groups = q.shape[1] // k.shape[1]
    s = _scores(q.to(wide), k.to(wide).repeat_interleave(groups, 1), causal, scale, q_offset, k_offset, softcap, first)
    m = s.amax(-1, keepdim=True).detach()  # the shift cancels out of both results: no gradient through it
    m = m.masked_fill(m == float("-inf"), 0.0)  # a query that sees no key: exp(-inf - 0) = 0, not nan
    e = (s - m).exp()
    total = e.sum(-1, keepdim=True)
    seen = total > 0
    total = torch.where(seen, total, 1.0)  # (so that log and division stay finite where nothing is seen)
    out = (e / total) @ v.to(wide).repeat_interleave(groups, 1)
    lse = torch.where(seen, m + total.log(), float("-inf")).squeeze(-1)
    return (out if upcast else out.to(q.dtype)), lse


def _scores(q, k, causal, scale, q_offset, k_offset, softcap, first=None) -> torch.Tensor:
    """``q k^T * scale``, capped to ``softcap * tanh(s / softcap)`` (Gemma 2's), -inf where causal masking (or a
    query's first key) hides a key."""
    s = q @ k.mT * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if causal:
        queries = torch.arange(q.shape[2], device=q.device) + q_offset
        keys = torch.arange(k.shape[2], device=q.device) + k_offset
        s = s.masked_fill(keys > queries[:, None], float("-inf"))
    if first is not None:
        keys = torch.arange(k.shape[2], device=q.device) + k_offset
        s = s.masked_fill(keys < first[:, None, :, None], float("-inf"))
    return s


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, diag, lo):
        out, lse = _forward(q, k, v, causal, scale, diag, lo)
        ctx.save_for_backward(q, k, v, out, lse, lo)
        ctx.causal, ctx.scale, ctx.diag = causal, scale, diag
        ctx.set_materialize_grads(False)  # no lse gradient (the usual case): no zeros made and read
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, lo = ctx.saved_tensors
        dq = torch.empty_like(q) if wanted(ctx, 0) else None
        dk, dv = (torch.empty_like(k), torch.empty_like(v)) if wanted(ctx, 1) or wanted(ctx, 2) else (None, None)
        dout = torch.zeros_like(out) if dout is None else dout  # only lse was used
        attention_grad_tiles.backward(q, k, v, out, lse, dout, None if dlse is None else dlse.float().contiguous(), dq,
                                      dk, dv, ctx.scale, ctx.diag, ctx.causal, lo)
        return dq, dk, dv, None, None, None, None


def _forward(q, k, v, causal, scale, diag, lo) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(q)  # q's strides where q is dense (a transposed [B, L, H, D] view stays one)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    if out.numel():
        attention_tiles.forward(q, k, v, out, lse, scale, diag, causal, lo)
    return out, lse


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float | None = None,
              q_offset: int = 0, k_offset: int = 0, softcap: float | None = None,
              first: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a block of queries on a block of keys / values, and each query's log-sum-exp of scores:
    flash-attention (no ``[Lq, Lk]`` scores in memory), differentiable through both results.

    Positions are global, so that a ring's blocks of the sequence mask as one sequence would: query i is at
    ``q_offset + i``, key j at ``k_offset + j``, and causal attention hides the keys at later positions. A query that
    sees no key (a block wholly later than it) gets ``out = 0`` and ``lse = -inf``; ``merge`` weighs such a block 0.
    Sums are kept in fp32 whatever the inputs' dtype.

    Args:
        q: ``[B, Hq, Lq, D]``, any strides (transformers' ``[B, L, H, D].transpose(1, 2)`` is read in place).
        k, v: ``[B, Hkv, Lk, D]`` and ``[B, Hkv, Lk, Dv]`` of q's dtype, any strides; Hq a multiple of Hkv, query
            head h reading kv head ``h // (Hq // Hkv)`` (grouped-query attention, without repeating k and v). Dv may
            differ from D (latent attention's values are narrower than its keys): the kernels, which take one head
            dim, then run on the narrower side padded with zero columns, which change no score and no output.
        causal: hide from each query the keys at later positions.
        scale: the scores' factor (default ``D ** -0.5``).
        q_offset, k_offset: the global positions of the first query and the first key.
        softcap: scores capped to ``softcap * tanh(s / softcap)`` before the softmax (Gemma 2's attention), or
            None; it runs the torch reference, which holds the scores (as do head dims past the kernels' 128).
        first: ``[B, Lq]`` integers, the global position of each query's first visible key, nondecreasing along
            each row (its document's start, ``i - window + 1`` for a sliding window, the first real token after
            left padding), or None: every key up to the query.

    Returns:
        ``(out, lse)``: out ``[B, Hq, Lq, Dv]`` in q's dtype (q's strides where q is dense and Dv = D), lse
        ``[B, Hq, Lq]`` fp32 (fp64 for fp64 inputs).

    Example::

        >>> q, k, v = torch.randn(1, 4, 6, 16), torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
        >>> out, lse = attention(q, k, v, causal=True)
        >>> out.shape, lse.shape
        (torch.Size([1, 4, 6, 16]), torch.Size([1, 4, 6]))
        >>> sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        >>> torch.testing.assert_close(out, sdpa)
        >>> first, second = attention(q, k[:, :, :3], v[:, :, :3], causal=True), \\
        ...     attention(q, k[:, :, 3:], v[:, :, 3:], causal=True, k_offset=3)    # two blocks of keys
        >>> torch.testing.assert_close(merge(*first, *second)[0], out)
    """
    _check(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    grads = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if v.shape[-1] != q.shape[-1] and (_kernels(q, softcap) or _cpu_flash(q, k, causal, q_offset - k_offset, softcap,
                                                                           first)):
        out, lse = attention(*_widened(max(q.shape[-1], v.shape[-1]), q, k, v), causal=causal, scale=scale,
                             q_offset=q_offset, k_offset=k_offset, softcap=softcap, first=first)
        return out[..., :v.shape[-1]], lse
    if not grads and _cpu_flash(q, k, causal, q_offset - k_offset, softcap, first):  # CPU: no [Lq, Lk] scores
        mask = _block_mask(q, k, causal, q_offset, k_offset, first)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, *_repeated(q, k, v), 0.0, causal and mask is None, attn_mask=mask, scale=scale)
        if mask is not None:  # a query that sees no key: the kernel's out is 0, its lse 0, not -inf
            lse = lse.masked_fill(~(mask == 0).any(-1), float("-inf"))
        return out, lse
    if not _kernels(q, softcap):
        return attention_ref(q, k, v, causal=causal, scale=scale, q_offset=q_offset, k_offset=k_offset,
                             softcap=softcap, first=first)
    diag, lo = q_offset - k_offset, _first_keys(first, k_offset)
    if grads:
        return _Attention.apply(q, k, v, causal, scale, diag, lo)
    return _forward(q, k, v, causal, scale, diag, lo)


def _widened(width: int, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``ts`` with zero columns up to ``width``: torch's CPU flash kernel and the Triton kernels take one head dim
    for q, k and v, and zero columns change no score and no output column (latent attention's keys are wider than
    its values)."""
    return tuple(torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in ts)


def _first_keys(first: torch.Tensor | None, k_offset: int) -> torch.Tensor | None:
    """Each query's first visible key as an index into the key block (int32, contiguous: what the kernels read)."""
    return None if first is None else (first - k_offset).clamp(-1, 2 ** 30).to(torch.int32).contiguous()


def _kernels(q: torch.Tensor, softcap: float | None) -> bool:
    """Whether the Triton kernels compute the block: not fp64, no softcap, a head dim their registers hold."""
    return softcap is None and q.dtype != torch.float64 and q.shape[-1] <= _MAX_HEAD_DIM and use_triton(q)


def _cpu_flash(q: torch.Tensor, k: torch.Tensor, causal: bool, diag: int, softcap: float | None,
               first: torch.Tensor | None) -> bool:
    """Whether torch's CPU flash attention computes the block: on CPU without the Triton switch, no softcap, and
    its causal mask (query i sees keys 0..i) the block's (no mask, or the diagonal block of equal lengths), or a
    mask of the block's first keys."""
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16) and softcap is None
            and not use_triton(q) and (first is not None or not causal or (diag == 0 and q.shape[2] == k.shape[2])))


def _block_mask(q: torch.Tensor, k: torch.Tensor, causal: bool, q_offset: int, k_offset: int,
                first: torch.Tensor | None) -> torch.Tensor | None:
    """The block's additive ``[B, 1, Lq, Lk]`` mask (0 where a query sees a key, -inf elsewhere) where it has first
    keys, else None."""
    if first is None:
        return None
    queries = torch.arange(q.shape[2], device=q.device) + q_offset
    keys = torch.arange(k.shape[2], device=q.device) + k_offset
    seen = keys >= first[:, :, None]
    if causal:
        seen = seen & (keys <= queries[:, None])
    return torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill(~seen, float("-inf"))[:, None]


def _repeated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v with each kv head repeated for its query heads (torch's CPU flash kernels take equal head counts)."""
    groups = q.shape[1] // k.shape[1]
    return k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)


def attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                       dout: torch.Tensor, *, causal: bool, scale: float | None = None, q_offset: int = 0,
                       k_offset: int = 0, softcap: float | None = None,
                       first: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """The gradients of one block's attention, given its queries' final ``out`` and ``lse`` over every block: what a
    ring's backward runs block by block (flash-attention's backward needs only those, not the block's own results).

    Args:
        q, k, v, causal, scale, q_offset, k_offset, softcap, first: the block, as ``attention`` took it.
        out: ``[B, Hq, Lq, D]`` the queries' output over all blocks, in q's dtype.
        lse: ``[B, Hq, Lq]`` fp32, their log-sum-exp over all blocks.
        dout: the gradient of ``out``.

    Returns:
        ``(dq, dk, dv)`` in fp32, this block's share: dq summed over the blocks gives q's gradient, and each block's
        dk and dv are its keys' and values' (summed over the query heads of each kv head).

    Example::

        >>> q, k, v = (torch.randn(1, 2, 6, 8, requires_grad=True) for _ in range(3))
        >>> first = attention(q, k[:, :, :3], v[:, :, :3], causal=True)
        >>> second = attention(q, k[:, :, 3:], v[:, :, 3:], causal=True, k_offset=3)
        >>> out, lse = merge(*first, *second)
        >>> dout = torch.randn_like(out)
        >>> dq, dk, dv = attention_backward(q, k[:, :, 3:], v[:, :, 3:], out, lse, dout, causal=True, k_offset=3)
        >>> want = torch.autograd.grad(out, k, dout)[0][:, :, 3:]       # the second block's keys
        >>> torch.testing.assert_close(dk, want)
    """
    _check(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    diag = q_offset - k_offset
    if v.shape[-1] != q.shape[-1] and (_kernels(q, softcap) or _cpu_flash(q, k, causal, diag, softcap, first)):
        qw, kw, vw, ow, dw = _widened(max(q.shape[-1], v.shape[-1]), q, k, v, out, dout)
        grads = attention_backward(qw, kw, vw, ow, lse, dw, causal=causal, scale=scale, q_offset=q_offset,
                                   k_offset=k_offset, softcap=softcap, first=first)
        return tuple(g[..., :t.shape[-1]] for g, t in zip(grads, (q, k, v)))
    if _cpu_flash(q, k, causal, diag, softcap, first):
        mask = _block_mask(q, k, causal, q_offset, k_offset, first)
        hidden = lse == float("-inf")  # queries that see no key anywhere: no gradient (and no nan from -inf - -inf)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(q.dtype).masked_fill(hidden[..., None], 0), q, *_repeated(q, k, v), out.to(q.dtype),
            lse.float().masked_fill(hidden, 0.0).contiguous(), 0.0, causal and mask is None, attn_mask=mask,
            scale=scale)
        return dq.float(), _per_kv_head(dk, k.shape[1], torch.float32), _per_kv_head(dv, k.shape[1], torch.float32)
    if _kernels(q, softcap):  # the kernels read lse as contiguous [B, Hq, Lq] (a ring's is a slice of its rows)
        dq, dk, dv = (torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
        attention_grad_tiles.backward(q, k, v, out.to(q.dtype), lse.float().contiguous(), dout.to(q.dtype), None, dq,
                                      dk, dv, scale, diag, causal, _first_keys(first, k_offset))
        return dq, dk, dv
    return _reference_backward(q, k, v, out, lse, dout, causal, scale, q_offset, k_offset, softcap, first)


def _per_kv_head(grad: torch.Tensor, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """A gradient over every query head's copy of k or v, summed into each kv head's."""
    return grad.unflatten(1, (kv_heads, grad.shape[1] // kv_heads)).sum(2).to(dtype)


def _reference_backward(q, k, v, out, lse, dout, causal, scale, q_offset, k_offset, softcap, first):
    """flash-attention's backward written out in torch, on the scores (fp32, fp64 for fp64 inputs)."""
    wide = accumulate_dtype(q.dtype)
    groups = q.shape[1] // k.shape[1]
    qw, kw, vw = q.to(wide), k.to(wide).repeat_interleave(groups, 1), v.to(wide).repeat_interleave(groups, 1)
    s = _scores(qw, kw, causal, scale, q_offset, k_offset, softcap, first)
    lse = lse.to(wide)[..., None]
    p = torch.where(lse == float("-inf"), 0.0, (s - lse.masked_fill(lse == float("-inf"), 0.0)).exp())
    dout = dout.to(wide)
    delta = (dout * out.to(wide)).sum(-1, keepdim=True)
    ds = p * (dout @ vw.mT - delta)
    if softcap is not None:  # d(c tanh(x / c)) / dx = 1 - tanh^2
        ds = ds * (1 - (s.masked_fill(s == float("-inf"), 0.0) / softcap) ** 2)
    return (ds @ kw * scale, _per_kv_head(ds.mT @ qw * scale, k.shape[1], wide),
            _per_kv_head(p.mT @ dout, k.shape[1], wide))


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention of queries on two blocks of keys from each block's ``attention``: the outputs weighed by their
    share of the total ``exp(lse)``. Differentiable (torch ops); a block with ``lse = -inf`` (no key seen) weighs 0,
    and its gradients are 0, not nan.

    Args:
        out_a, lse_a: one block's output ``[..., L, D]`` and log-sum-exp ``[..., L]``.
        out_b, lse_b: the other block's.

    Returns:
        ``(out, lse)`` over both blocks: out in the wider of the outputs' dtypes (a ring's fp32 running output stays
        fp32), lse in the wider of the lse dtypes.

    Example::

        >>> out_a, out_b = torch.ones(1, 2), torch.zeros(1, 2)
        >>> out, lse = merge(out_a, torch.tensor([0.0]), out_b, torch.tensor([0.0]))   # equal weights
        >>> out, lse
        (tensor([[0.5000, 0.5000]]), tensor([0.6931]))
        >>> merge(out_a, torch.tensor([0.0]), out_b, torch.tensor([float("-inf")]))[0]  # b saw no key
        tensor([[1., 1.]])
    """
    m = torch.maximum(lse_a, lse_b).detach()  # the shift cancels out: no gradient through it
    m = m.masked_fill(m == float("-inf"), 0.0)  # neither block saw a key: weights exp(-inf) = 0, not nan
    w_a, w_b = (lse_a - m).exp(), (lse_b - m).exp()
    total = w_a + w_b
    seen = total > 0
    total = torch.where(seen, total, 1.0)
    lse = torch.where(seen, m + total.log(), float("-inf"))
    out = out_a * (w_a / total)[..., None] + out_b * (w_b / total)[..., None]
    return out.to(torch.promote_types(out_a.dtype, out_b.dtype)), lse


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention sinks (gpt-oss's): each head's sink logit joins the softmax's denominator as a key whose value is 0,
    so the queries' outputs over every block shrink by their share of it. Apply once, to the merge of all blocks.

    Args:
        out: ``[B, H, L, D]`` the queries' attention over every block.
        lse: ``[B, H, L]`` its log-sum-exp.
        sinks: ``[H]`` each head's sink logit.

    Returns:
        ``(out, lse)`` with the sinks: out in its dtype, lse in its dtype. A block's gradients from these (as
        ``attention_backward`` takes them) are those of attention with the sinks.

    Example::

        >>> out, lse = torch.ones(1, 1, 1, 2), torch.zeros(1, 1, 1)          # one key of score 0
        >>> add_sinks(out, lse, torch.zeros(1))                              # a sink as large: half the weight
        (tensor([[[[0.5000, 0.5000]]]]), tensor([[[0.6931]]]))
    """
    total = torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None].expand_as(lse))
    return out * (lse - total).exp()[..., None].to(out.dtype), total


def sinks_backward(out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The gradient of the sinks from ``add_sinks``' results: ``-sum(p_sink * rowsum(dout * out))`` per head, where
    ``p_sink = exp(sink - lse)`` is the sink's share of each query's softmax.

    Args:
        out, lse: what ``add_sinks`` returned.
        dout: the gradient of ``out``.
        sinks: ``[H]``.

    Returns:
        ``[H]`` in the sinks' dtype.

    Example::

        >>> sinks = torch.zeros(1, dtype=torch.float64, requires_grad=True)
        >>> out, lse = add_sinks(torch.ones(1, 1, 1, 2, dtype=torch.float64), torch.zeros(1, 1, 1,
        ...                      dtype=torch.float64), sinks)
        >>> out.sum().backward()
        >>> torch.testing.assert_close(sinks_backward(out, lse, torch.ones_like(out), sinks), sinks.grad)
    """
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
    return -(torch.exp(sinks.to(lse.dtype)[None, :, None] - lse) * delta).sum((0, 2)).to(sinks.dtype)
