"""The attention kernels (``tpflow.kernels.attention``) against their torch reference in float64, forward and backward
(through the log-sum-exp too), on CPU through Triton's interpreter and compiled on a GPU, for the blocks a ring
computes: queries and keys at different global positions, keys wholly visible, partly visible or wholly hidden; and
``merge`` putting blocks back together. Tolerance scales with the dtype's own error:
err(kernel, fp64) <= 2 * err(torch in the same dtype, fp64) + atol."""

from __future__ import annotations

import pytest
import torch

import tpflow as tpf
from tpflow.kernels.attention import attention, attention_backward, attention_ref, merge

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


@pytest.fixture(autouse=True)
def _triton_kernels():
    pytest.importorskip("triton")
    with tpf.config.override(kernels="triton"):
        yield


def _rand(*shape, dtype, seed, transposed=False, padded=False):
    """A random tensor; transposed: ``[B, H, L, D]`` as transformers passes it, a view of ``[B, L, H, D]``; padded: a
    view of a wider tensor whose 3 more columns are nan (the kernels must never read past the head dim)."""
    g = torch.Generator().manual_seed(seed)
    if transposed:
        shape = (shape[0], shape[2], shape[1], *shape[3:])
    t = torch.randn(*shape[:-1], shape[-1] + 3 * padded, generator=g)
    t[..., shape[-1]:] = float("nan")
    t = t.to(device=DEVICE, dtype=dtype)[..., :shape[-1]]
    return t.transpose(1, 2) if transposed else t


def _close(got, want_torch, ref64, dtype, what):
    assert got.shape == ref64.shape and got.dtype == want_torch.dtype, what
    hidden = ref64 == float("-inf")  # lse of a query that sees no key: exactly -inf
    assert torch.equal(got == float("-inf"), hidden) and torch.equal(want_torch == float("-inf"), hidden), what
    got, want_torch, ref64 = (t.double().masked_fill(hidden, 0.0) for t in (got, want_torch, ref64))
    err = (got - ref64).abs().max().item()
    bound = 2 * (want_torch - ref64).abs().max().item() + ATOL[dtype] * max(1.0, ref64.abs().max().item())
    assert err <= bound, f"{what}: error {err:.3g} > bound {bound:.3g}"


def _results(fn, q, k, v, dout, dlse, **kw):
    """(out, lse, dq, dk, dv) of ``fn``, the gradients those of ``sum(out * dout) + sum(lse * dlse)``."""
    out, lse = fn(q, k, v, **kw)
    return (out, lse, *torch.autograd.grad((out, lse), (q, k, v), (dout, dlse)))


def _check(dtype, B, Hq, Hkv, Lq, Lk, D, causal, q_offset, k_offset, transposed, first=None, Dv=None):
    """out, lse and the gradients of q, k and v (from both out and lse) against the fp64 reference, k and v read from
    wider rows; a query that sees no key gets out 0, lse -inf and dq 0, whatever the gradient of its lse (here nan, as a
    merge by torch.logaddexp of two -inf would give). ``first``: each query's first key (global positions); ``Dv``:
    the values' head dim (D's by default)."""
    Dv = D if Dv is None else Dv
    q = _rand(B, Hq, Lq, D, dtype=dtype, seed=1, transposed=transposed).requires_grad_()
    k = _rand(B, Hkv, Lk, D, dtype=dtype, seed=2, transposed=transposed, padded=True).requires_grad_()
    v = _rand(B, Hkv, Lk, Dv, dtype=dtype, seed=3, transposed=transposed, padded=True).requires_grad_()
    positions = torch.arange(Lq, device=DEVICE) + q_offset
    hidden = ((positions < k_offset) & causal).expand(B, 1, Lq)  # queries before every key
    if first is not None:  # or whose first key is past the block's, or past the query itself
        last = (positions if causal else torch.full_like(positions, k_offset + Lk - 1)).clamp(max=k_offset + Lk - 1)
        hidden = hidden | (first.clamp(min=k_offset) > last)[:, None]
    dout = _rand(B, Hq, Lq, Dv, dtype=dtype, seed=4)
    dlse = _rand(B, Hq, Lq, dtype=torch.float32, seed=5).masked_fill(hidden, float("nan"))
    kw = dict(causal=causal, q_offset=q_offset, k_offset=k_offset, first=first)
    got = _results(attention, q, k, v, dout, dlse, **kw)
    want = _results(attention_ref, q, k, v, dout, dlse, **kw)
    as64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = _results(attention_ref, *as64, dout.double(), dlse.double(), **kw)
    for what, got_t, want_t, ref_t in zip(("out", "lse", "dq", "dk", "dv"), got, want, ref):
        _close(got_t, want_t, ref_t.detach(), dtype, what)
    hidden = hidden.expand(B, Hq, Lq)
    assert torch.equal(ref[1] == float("-inf"), hidden)
    assert not got[0][hidden].any() and not got[2][hidden].any()
    return q, k, v, got, kw


# (dtype, B, Hq, Hkv, Lq, Lk, D, causal, q_offset, k_offset, transposed): lengths that are not a multiple of the
# interpreter's 16-row tiles, the ring's three kinds of causal block, GQA and MQA, a head dim not a power of two
CASES = {
    "fp32-causal-gqa-transposed": (torch.float32, 2, 4, 2, 21, 21, 16, True, 0, 0, True),
    "fp16-full-mqa-dim-20": (torch.float16, 1, 4, 1, 13, 40, 20, False, 0, 0, False),
    "fp32-earlier-keys": (torch.float32, 1, 2, 2, 21, 13, 16, True, 16, 0, False),
    "fp16-crossing-keys": (torch.float16, 1, 4, 2, 21, 40, 32, True, 16, 24, True),
    "fp32-later-keys": (torch.float32, 1, 2, 1, 16, 13, 16, True, 16, 32, False),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_outputs_and_gradients(case):
    """Crossing keys: the first 8 queries (positions 16-23) see no key of the block (at 24-63), the others part of
    it; later keys: no query sees any. Results in q's layout (a transposed view stays one), the same without
    gradients."""
    q, k, v, got, kw = _check(*case)
    assert got[0].stride() == q.stride()
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(attention(q, k, v, **kw), got[:2]))


@pytest.mark.parametrize("diag", [-17, -15, -2, -1, 1, 14, 15, 31])
def test_causal_bounds(diag):
    """17 queries (the last alone in its tile) on 33 keys, ``diag = q_offset - k_offset`` next to the multiples of the
    interpreter's 16-row tiles: where the tiles each program visits, and the ones it masks, begin and end."""
    _check(torch.float32, 1, 2, 1, 17, 33, 16, True, max(diag, 0), max(-diag, 0), False)


def _firsts(B, Lq, q_offset, window, seed):
    """Random packed documents (one row left-padded: its padding sees itself alone) under a sliding window: each
    query's first key, nondecreasing along the row."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.arange(Lq) + q_offset
    rows = []
    for b in range(B):
        starts = torch.zeros(q_offset + Lq, dtype=torch.bool)
        starts[torch.randint(0, q_offset + Lq, (3,), generator=g)] = True
        starts[0] = True
        start = torch.where(starts, torch.arange(q_offset + Lq), 0).cummax(0).values[positions]
        if b == 1:  # left padding up to position pad: each padded query its own key alone
            pad = q_offset + Lq // 3
            start = torch.where(positions < pad, positions, start.clamp(min=pad))
        rows.append(start if window is None else torch.maximum(start, positions - window + 1))
    return torch.stack(rows).to(DEVICE)


# (q_offset, k_offset, Lq, Lk, window, causal): the diagonal block, earlier keys, crossing keys, a window narrower
# than a tile, non-causal documents' lower bounds
BOUNDED = {
    "diagonal-documents": (0, 0, 37, 37, None, True),
    "earlier-keys-window-5": (40, 3, 21, 37, 5, True),
    "crossing-window-20": (16, 9, 33, 40, 20, True),
    "diagonal-window-3": (0, 0, 40, 40, 3, True),
    "full-documents": (0, 0, 21, 21, None, False),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", BOUNDED.values(), ids=BOUNDED.keys())
def test_first_keys(case, dtype):
    """Each query's first visible key (packed documents, left padding, sliding windows), GQA, transposed inputs: out,
    lse and every gradient against the fp64 reference, the tiles the kernels visit bounded by the rows' first keys."""
    q_offset, k_offset, Lq, Lk, window, causal = case
    first = _firsts(2, Lq, q_offset, window, seed=Lq)
    _check(dtype, 2, 4, 2, Lq, Lk, 16, causal, q_offset, k_offset, True, first=first)


# bf16 blocks spanning many of the compiled kernels' 32-128 row tiles, the lengths not multiples of them
GPU_CASES = {
    "bf16-causal": (torch.bfloat16, 1, 4, 2, 1000, 1000, 128, True, 0, 0, True),
    "bf16-crossing-keys": (torch.bfloat16, 1, 4, 2, 1000, 1531, 128, True, 1000, 37, True),
    "bf16-mostly-later-keys": (torch.bfloat16, 1, 4, 1, 1000, 1531, 64, True, 37, 1000, False),
    "fp32-full": (torch.float32, 2, 2, 2, 777, 1531, 80, False, 0, 0, False),
}


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU: bf16, and blocks the size of the compiled kernels' tiles")
@pytest.mark.parametrize("case", GPU_CASES.values(), ids=GPU_CASES.keys())
def test_ring_blocks_on_a_gpu(case):
    _check(*case)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU: bf16, and blocks the size of the compiled kernels' tiles")
@pytest.mark.parametrize("window", [None, 300], ids=["documents", "documents-window-300"])
def test_first_keys_on_a_gpu(window):
    """Packed documents (and left padding, a window) on the compiled kernels' tiles: a ring's crossing block and
    the diagonal block, bf16."""
    for q_offset, k_offset, Lq, Lk in ((1000, 37, 1000, 1531), (0, 0, 1531, 1531)):
        first = _firsts(2, Lq, q_offset, window, seed=Lq)
        _check(torch.bfloat16, 2, 4, 2, Lq, Lk, 128, True, q_offset, k_offset, True, first=first)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU: long packed sequences against torch's attention")
@pytest.mark.parametrize("tokens", [8192, 32768])
def test_long_packed_sequences_against_sdpa(tokens):
    """bf16, 8 query heads on 2 kv heads of 128 dims, documents of random lengths and a window of 4096 on one row:
    out and gradients within twice the error of torch's attention with the same mask in bf16, both against it in
    fp32."""
    first = _firsts(1, tokens, 0, 4096, seed=tokens)
    at = torch.arange(tokens, device=DEVICE)
    seen = (at[None, :, None] >= at[None, None, :]) & (at[None, None, :] >= first[:, :, None])
    q = _rand(1, 8, tokens, 128, dtype=torch.bfloat16, seed=1)
    k, v = (_rand(1, 2, tokens, 128, dtype=torch.bfloat16, seed=s) for s in (2, 3))
    dout = _rand(1, 8, tokens, 128, dtype=torch.bfloat16, seed=4)

    def sdpa(q, k, v):
        k, v = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=seen[:, None])

    def results(fn, *inputs):
        inputs = [t.detach().requires_grad_() for t in inputs]
        out = fn(*inputs)
        return (out.detach(), *torch.autograd.grad(out, inputs, dout.to(out.dtype)))

    got = results(lambda q, k, v: attention(q, k, v, causal=True, first=first)[0], q, k, v)
    torch_bf16 = results(sdpa, q, k, v)
    ref = results(sdpa, q.float(), k.float(), v.float())
    for what, got_t, want_t, ref_t in zip(("out", "dq", "dk", "dv"), got, torch_bf16, ref):
        _close(got_t, want_t, ref_t.double(), torch.bfloat16, what)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU: long sequences against torch's flash attention")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("tokens", [4096, 32768])
def test_long_sequences_against_flash(tokens, causal):
    """bf16, 8 query heads on 2 kv heads of 128 dims: out and gradients within twice the error of torch's flash
    backend (fed k and v repeated per query head), both measured against torch's attention in fp32."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = _rand(1, 8, tokens, 128, dtype=torch.bfloat16, seed=1)
    k, v = (_rand(1, 2, tokens, 128, dtype=torch.bfloat16, seed=s) for s in (2, 3))
    dout = _rand(1, 8, tokens, 128, dtype=torch.bfloat16, seed=4)

    def sdpa(q, k, v):
        k, v = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def results(fn, *inputs):
        inputs = [t.detach().requires_grad_() for t in inputs]
        out = fn(*inputs)
        return (out.detach(), *torch.autograd.grad(out, inputs, dout.to(out.dtype)))

    got = results(lambda q, k, v: attention(q, k, v, causal=causal)[0], q, k, v)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        flash = results(sdpa, q, k, v)
    ref = results(sdpa, q.float(), k.float(), v.float())  # torch's memory-efficient backend, in fp32
    for what, got_t, flash_t, ref_t in zip(("out", "dq", "dk", "dv"), got, flash, ref):
        _close(got_t, flash_t, ref_t.double(), torch.bfloat16, what)


@pytest.mark.parametrize("causal, q_offset", [(False, 0), (True, 8), (True, 0)],
                         ids=["full", "causal-both-blocks-partly", "causal-second-block-hidden"])
def test_merge_of_two_key_blocks(causal, q_offset):
    """Attention on keys [0, 32) is the merge of attention on keys [0, 16) and [16, 32), gradients included. Queries
    at 8-23: each block is partly visible (queries 8-15 see nothing of the second); queries at 0-15: the second block
    is hidden from every query (lse -inf)."""
    q = _rand(1, 2, 16, 16, dtype=torch.float32, seed=1).requires_grad_()
    k = _rand(1, 1, 32, 16, dtype=torch.float32, seed=2).requires_grad_()
    v = _rand(1, 1, 32, 16, dtype=torch.float32, seed=3).requires_grad_()
    dout, dlse = _rand(1, 2, 16, 16, dtype=torch.float32, seed=4), _rand(1, 2, 16, dtype=torch.float32, seed=5)

    def blocks(q, k, v, **kw):
        first = attention(q, k[:, :, :16], v[:, :, :16], **kw)
        second = attention(q, k[:, :, 16:], v[:, :, 16:], **kw, k_offset=16)
        assert second[1].isfinite().any() != (causal and not q_offset)  # hidden: lse -inf for every query
        return merge(*first, *second)

    got = _results(blocks, q, k, v, dout, dlse, causal=causal, q_offset=q_offset)
    want = _results(attention, q, k, v, dout, dlse, causal=causal, q_offset=q_offset)
    for got_t, want_t in zip(got, want):
        torch.testing.assert_close(got_t, want_t)


def test_reference_gradients_in_fp64():
    """The reference's and merge's gradients, by finite differences in fp64 (the kernels' gradients are checked
    against the reference's): GQA, causal with offsets (query 0 at position 2 sees keys 0-2), out and lse both used;
    fp64 runs the reference whatever the kernels switch."""
    q = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 1, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    torch.autograd.gradcheck(lambda q, k, v: attention(q, k, v, causal=True, scale=0.7, q_offset=2), (q, k, v))
    parts = [torch.randn(2, 3, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    torch.autograd.gradcheck(lambda *t: merge(t[0][..., None], t[1], t[2][..., None], t[3]), parts)


def test_gradients_of_some_inputs():
    """Only q needs a gradient (the kv kernel does not run), then only v."""
    q, k, v = (_rand(1, 2, 21, 16, dtype=torch.float32, seed=s) for s in (1, 2, 3))
    for needs in ((True, False, False), (False, False, True)):
        inputs = [t.detach().requires_grad_(n) for t, n in zip((q, k, v), needs)]
        wanted = [t for t in inputs if t.requires_grad]
        dout = _rand(1, 2, 21, 16, dtype=torch.float32, seed=4)
        got = torch.autograd.grad(attention(*inputs, causal=True)[0], wanted, dout)
        want = torch.autograd.grad(attention_ref(*inputs, causal=True)[0], wanted, dout)
        torch.testing.assert_close(got, want)


def test_torch_path_is_the_reference():
    q, k, v = (_rand(1, 2, 5, 8, dtype=torch.float16, seed=s) for s in (1, 2, 3))
    with tpf.config.override(kernels="torch"):
        got = attention(q, k, v, causal=True, k_offset=2)
    for got_t, want_t in zip(got, attention_ref(q, k, v, causal=True, k_offset=2)):
        assert torch.equal(got_t, want_t)
    assert got[0].dtype == torch.float16 and got[1].dtype == torch.float32


def test_bad_arguments():
    q, kv = torch.ones(1, 4, 5, 16), torch.ones(1, 2, 7, 16)
    for args, match in [((q[0], kv, kv), r"takes q \[B, Hq, Lq, D\]"), ((q, kv, kv[:, :, :3]), r"takes q"),
                        ((q, kv[:, :1].expand(1, 3, 7, 16), kv[:, :1].expand(1, 3, 7, 16)), "sizes differ"),
                        ((q, kv[..., :8], kv[..., :8]), "sizes differ"), ((q, kv[:, :, :0], kv[:, :, :0]), "one key"),
                        ((torch.ones(1, 1, 2, 0),) * 3, "head dim of at least 1"),
                        ((q.half(), kv, kv), "one floating dtype"), ((q.int(), kv.int(), kv.int()), "one floating")]:
        with pytest.raises(ValueError, match=match):
            attention(*args, causal=False)
    wide = [_rand(1, 2, 5, 160, dtype=torch.float32, seed=s) for s in (1, 2, 3)]  # past the kernels' 128: the reference
    for got_t, want_t in zip(attention(*wide, causal=True), attention_ref(*wide, causal=True)):
        assert torch.equal(got_t, want_t)


@pytest.mark.parametrize("kernels", ["triton", "torch"])
@pytest.mark.parametrize("D, Dv", [(24, 16), (16, 24)], ids=["latent-narrower-values", "wider-values"])
def test_values_of_another_width(D, Dv, kernels):
    """Values narrower than the keys (every DeepSeek-V2 / V3-shaped latent attention: 192 / 128) or wider: the
    Triton kernels and torch's CPU flash kernel, which take one head dim, run on zero columns added to the narrower
    side, the reference as it is; out, lse and every gradient against fp64, whole and as a ring's two blocks of keys
    (``attention_backward`` from their merged result)."""
    with tpf.config.override(kernels=kernels):
        _check(torch.float32, 2, 4, 2, 21, 21, D, True, 0, 0, True, Dv=Dv)
        _check(torch.float32, 1, 2, 1, 16, 24, D, True, 16, 8, False, Dv=Dv)
        q = _rand(1, 4, 16, D, dtype=torch.float32, seed=1)
        k, v = _rand(1, 2, 32, D, dtype=torch.float32, seed=2), _rand(1, 2, 32, Dv, dtype=torch.float32, seed=3)
        dout = _rand(1, 4, 16, Dv, dtype=torch.float32, seed=4)
        whole = [t.double().requires_grad_() for t in (q, k, v)]
        out, lse = attention_ref(*whole, causal=True, q_offset=16)
        want = torch.autograd.grad(out, whole, dout.double())
        blocks = [attention(q, k[:, :, keys], v[:, :, keys], causal=True, q_offset=16, k_offset=keys.start)
                  for keys in (slice(0, 16), slice(16, 32))]
        torch.testing.assert_close(merge(*blocks[0], *blocks[1])[0].double(), out.detach(), rtol=1e-4, atol=1e-5)
        grads = [attention_backward(q, k[:, :, keys], v[:, :, keys], out.detach().float(), lse.detach().float(),
                                    dout, causal=True, q_offset=16, k_offset=keys.start)
                 for keys in (slice(0, 16), slice(16, 32))]
    got = (grads[0][0] + grads[1][0], torch.cat([grads[0][1], grads[1][1]], 2),
           torch.cat([grads[0][2], grads[1][2]], 2))
    for what, got_t, want_t in zip(("dq", "dk", "dv"), got, want):
        assert got_t.shape == want_t.shape, what
        torch.testing.assert_close(got_t.double(), want_t, rtol=1e-4, atol=1e-5, msg=what)


# (q_offset, where the keys split, softcap): the ring's blocks of one query part, from the queries' merged result
BLOCK_BACKWARDS = {
    "earlier-then-diagonal": (16, 16, None),
    "crossing-both": (8, 12, None),
    "softcapped": (16, 16, 2.5),
}


@pytest.mark.parametrize("kernels", ["triton", "torch"])
@pytest.mark.parametrize("case", BLOCK_BACKWARDS.values(), ids=BLOCK_BACKWARDS.keys())
def test_block_backward_from_the_merged_result(case, kernels):
    """``attention_backward`` of each of two key blocks, given only the queries' output and log-sum-exp over both (as
    a ring's backward has them), adds up to the gradients of attention over all the keys: dq summed over the blocks,
    dk and dv each block's own. Keys at 0-31 split in two; GQA; the Triton kernels, torch's CPU flash kernel (the
    diagonal block) and the reference (the rest, softcap)."""
    q_offset, cut, softcap = case
    q = _rand(1, 4, 16, 16, dtype=torch.float32, seed=1)
    k, v = (_rand(1, 2, 32, 16, dtype=torch.float32, seed=s) for s in (2, 3))
    dout = _rand(1, 4, 16, 16, dtype=torch.float32, seed=4)
    whole = [t.double().requires_grad_() for t in (q, k, v)]
    out, lse = attention_ref(*whole, causal=True, q_offset=q_offset, softcap=softcap)
    want = torch.autograd.grad(out, whole, dout.double())
    grads = []
    with tpf.config.override(kernels=kernels):
        for keys in (slice(0, cut), slice(cut, 32)):
            grads.append(attention_backward(q, k[:, :, keys], v[:, :, keys], out.detach().float(), lse.detach().float(),
                                            dout, causal=True, q_offset=q_offset, k_offset=keys.start,
                                            softcap=softcap))
    assert all(g.dtype == torch.float32 for block in grads for g in block)
    (dq_a, dk_a, dv_a), (dq_b, dk_b, dv_b) = grads
    got = (dq_a + dq_b, torch.cat([dk_a, dk_b], 2), torch.cat([dv_a, dv_b], 2))
    for what, got_t, want_t in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(got_t.double(), want_t, rtol=1e-4, atol=1e-5, msg=what)
