"""Context parallelism (``tpf.hf_plan(model, context_parallel=...)``, ``tpflow.ops.context_attention``) against one
device: Hugging Face causal LMs given whole token ids on every rank, each rank carrying its part of the sequence
through every layer; the logits (a global tensor split over the sequence), the ``labels=`` loss, every gradient, and
every parameter after AdamW steps with clipping equal one device's (fp64; fp32 through torch's CPU flash kernel, with
ignored labels at the parts' edges, labels that are not the ids, the user's positions and count); the ring and Ulysses
on their own against the fp64 reference (GQA, softcap, not causal; the ring through the Triton kernels too); what
cannot split is refused on every rank."""

from __future__ import annotations

import copy
import importlib.util
import itertools

import pytest
import torch
import torch.distributed as dist

import tpflow as tpf
from tests import harness
from tests.checks import within
from tests.models import VOCAB, adamw_steps, tiny_lm, train_lm

pytest.importorskip("transformers")

TOL = {"rtol": 1e-6, "atol": 1e-6}
# Gemma 2's own eager attention takes the softmax in fp32 (tpflow's ring in fp64): its tolerance is fp32's
LOOSE = {"rtol": 1e-5, "atol": 2e-6}


def _placement(tensor: int) -> tpf.Placement:
    world = dist.get_world_size()
    ranks = list(range(world)) if tensor == 1 else [list(range(r, r + tensor)) for r in range(0, world, tensor)]
    return tpf.placement("cpu", ranks)


def _equal(model, ref, what: str, tol: dict, grads: bool) -> None:
    """Every parameter (or its gradient) of the parallel ``model`` against ``ref``'s, whole."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        got, want = (p.grad, q.grad) if grads else (p, q)
        torch.testing.assert_close(got.full_tensor(), want, **tol, msg=lambda m, n=f"{what} {name}": f"{n}: {m}")


def _matches_one_device(cases, tensor: int = 1) -> None:
    """Each ``(family, kind)`` parallelized over the world (a context axis of world / tensor ranks by a tensor axis of
    ``tensor``): logits, loss, gradients, two AdamW steps with clipping and every parameter against one device."""
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(6))
    for family, kind in cases:
        ref = tiny_lm(family)
        model = tpf.parallelize(copy.deepcopy(ref), placement=_placement(tensor),
                                plan=tpf.hf_plan(ref, context_parallel=kind))
        tol, what = (LOOSE if family == "gemma2" else TOL), f"{family} {kind} tensor={tensor}"
        out, want = model(ids, labels=ids), ref(ids, labels=ids)
        assert tpf.get_sbp(out.logits)[0] == tpf.sbp.split(1), what
        torch.testing.assert_close(out.logits.full_tensor(), want.logits, **tol, msg=what)
        torch.testing.assert_close(out.loss, want.loss.float(), **tol, msg=what)
        out.loss.backward()
        want.loss.backward()
        _equal(model, ref, what, tol, grads=True)
        model.zero_grad()
        ref.zero_grad()
        got, expected = train_lm(model, ids), train_lm(ref, ids)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=what)
        _equal(model, ref, what, tol, grads=False)


def _checkpointed_and_embeds() -> None:
    """Gradient checkpointing (the ring again in the backward's recompute) and ``inputs_embeds`` instead of ids."""
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(2))
    ref = tiny_lm("qwen3")
    want = ref(ids, labels=ids)
    want.loss.backward()
    for kind in ("ring", "ulysses"):
        plan = tpf.hf_plan(ref, context_parallel=kind)
        model = tpf.parallelize(copy.deepcopy(ref), placement=_placement(1), plan=plan)
        model.zero_grad()
        model.gradient_checkpointing_enable()
        model.train()
        embeds = model.get_input_embeddings()(ids)
        loss = model(inputs_embeds=embeds, labels=ids).loss
        torch.testing.assert_close(loss, want.loss.float(), **TOL)
        loss.backward()
        _equal(model, ref, kind, TOL, grads=True)


def _labels_in_fp32() -> None:
    """fp32 (the ring's blocks in torch's CPU flash kernel), labels that are not the ids with ignored ones at the
    parts' edges, the user's own positions and token count: one device's loss, logits and gradients."""
    ref = tiny_lm("llama").float()
    g = torch.Generator().manual_seed(3)
    ids, labels = torch.randint(0, VOCAB, (2, 16), generator=g), torch.randint(0, VOCAB, (2, 16), generator=g)
    labels[:, [0, 4, 8, 9, 12]] = -100  # the labels of the tokens before 3, 7, 8, 11 (edges of 2 and 4 parts)
    calls = [{"labels": labels}, {"labels": labels, "num_items_in_batch": torch.tensor(50)},
             {"labels": labels, "position_ids": torch.arange(5, 21).expand(2, 16)}]
    for kind in ("ring", "ulysses"):
        plan = tpf.hf_plan(ref, context_parallel=kind)
        model = tpf.parallelize(copy.deepcopy(ref), placement=_placement(1), plan=plan)
        for kwargs in calls:
            out, want = model(ids, **kwargs), ref(ids, **kwargs)
            what = f"{kind} {sorted(kwargs)}"
            torch.testing.assert_close(out.logits.full_tensor(), want.logits, rtol=1e-4, atol=1e-5, msg=what)
            torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6, msg=what)
            out.loss.backward()
            want.loss.backward()
            _equal(model, ref, what, {"rtol": 1e-4, "atol": 1e-5}, grads=True)
            model.zero_grad()
            ref.zero_grad()


def _ring_on_the_kernels() -> None:
    """The ring's blocks on the Triton kernels (the interpreter here): fp32, 2 sequences of 4 heads, head-tail, so a
    block's log-sum-exp is a slice of the rank's rows."""
    from tpflow.kernels.attention import attention_ref
    from tpflow.ops import head_tail, ring_attention

    g = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(2, h, 16, 16, generator=g) for h in (4, 2, 2, 4))
    whole = [t.double().requires_grad_() for t in (q, k, v)]
    want, _ = attention_ref(*whole, causal=True)
    want.backward(dout.double())
    parts = head_tail(dist.get_world_size(), 16)

    def cut(t):
        return torch.cat([t[:, :, a:a + n] for a, n in parts[dist.get_rank()]], 2)

    mine = [cut(t).requires_grad_() for t in (q, k, v)]
    with tpf.config.override(kernels="triton"):
        out = ring_attention(*mine, segments=parts, group=None)
        out.backward(cut(dout))
    torch.testing.assert_close(out.double(), cut(want), rtol=1e-4, atol=1e-5)
    for got, ref in zip(mine, whole):
        torch.testing.assert_close(got.grad.double(), cut(ref.grad), rtol=1e-4, atol=1e-5)


def _attention_ops(world: int) -> None:
    """``ring_attention`` (head-tail and contiguous parts) and ``ulysses_attention`` against the fp64 reference,
    forward and every gradient: GQA, fewer kv heads than ranks, Gemma 2's softcap, not causal."""
    from tpflow.kernels.attention import attention_ref
    from tpflow.ops import contiguous, head_tail, ring_attention, ulysses_attention

    rank, seq = dist.get_rank(), 8 * world
    for causal, heads, kv, softcap in ((True, 4, 2, None), (False, 4, 4, None), (True, 4, 1, 3.0)):
        g = torch.Generator().manual_seed(heads + kv)
        q, k, v = (torch.randn(2, h, seq, 16, generator=g, dtype=torch.float64) for h in (heads, kv, kv))
        dout = torch.randn(2, heads, seq, 16, generator=g, dtype=torch.float64)
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        want, _ = attention_ref(*whole, causal=causal, softcap=softcap)
        want.backward(dout)
        for layout in (head_tail, contiguous, "ulysses"):
            parts = (contiguous if layout == "ulysses" else layout)(world, seq)

            def cut(t, mine=parts[rank]):
                return torch.cat([t[:, :, a:a + n] for a, n in mine], 2)

            def attend(a, b, c, causal=causal, softcap=softcap):
                return attention_ref(a, b, c, causal=causal, softcap=softcap)[0]

            mine = [cut(t).requires_grad_() for t in (q, k, v)]
            if layout == "ulysses":
                out = ulysses_attention(*mine, attend, dist.group.WORLD)
            else:
                out = ring_attention(*mine, segments=parts, group=None, causal=causal, softcap=softcap)
            out.backward(cut(dout))
            what = f"{getattr(layout, '__name__', layout)} causal={causal} heads={heads}/{kv} softcap={softcap}"
            torch.testing.assert_close(out, cut(want), msg=what)
            for got, ref in zip(mine, whole):
                torch.testing.assert_close(got.grad, cut(ref.grad), msg=what)
    sinks = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)  # gpt-oss's, on the plain ring
    whole = [t.detach().clone().requires_grad_() for t in (q, k, v)] + [sinks.detach().clone().requires_grad_()]
    _with_sinks(*whole).backward(dout)
    parts = head_tail(world, seq)
    mine = [torch.cat([t.detach()[:, :, a:a + n] for a, n in parts[rank]], 2).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, segments=parts, group=None, sinks=sinks)
    out.backward(torch.cat([dout[:, :, a:a + n] for a, n in parts[rank]], 2))
    for got, ref in zip(mine, whole):
        torch.testing.assert_close(got.grad, torch.cat([ref.grad[:, :, a:a + n] for a, n in parts[rank]], 2))
    dist.all_reduce(sinks.grad)
    torch.testing.assert_close(sinks.grad, whole[3].grad)


def _firsts(rows: int, seq: int, window: int | None, seed: int) -> torch.Tensor:
    """Random packed documents (the second row left-padded: its padding sees itself alone), under a sliding window:
    each query's first key, ``[rows, seq]``."""
    g = torch.Generator().manual_seed(seed)
    at = torch.arange(seq)
    out = []
    for row in range(rows):
        starts = torch.zeros(seq, dtype=torch.bool)
        starts[torch.randint(0, seq, (3,), generator=g)] = True
        starts[0] = True
        first = torch.where(starts, at, 0).cummax(0).values
        if row == 1:
            first = torch.where(at < seq // 3, at, first.clamp(min=seq // 3))
        out.append(first if window is None else torch.maximum(first, at - window + 1))
    return torch.stack(out)


def _with_sinks(q, k, v, sinks, first=None):
    """Attention with gpt-oss's sinks written out as transformers' eager attention does (a sink logit per head
    concatenated to the scores, the softmax over both, the sink's column dropped), fp64, causal."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    at = torch.arange(q.shape[2])
    seen = at[:, None] >= at[None, :]
    if first is not None:
        seen = seen & (at[None, None, :] >= first[:, :, None])
    scores = (q @ k.mT * q.shape[-1] ** -0.5).masked_fill(~seen[:, None] if seen.ndim == 3 else ~seen, float("-inf"))
    logits = torch.cat([scores, sinks[None, :, None, None].expand(*scores.shape[:3], 1)], -1)
    return logits.softmax(-1)[..., :-1] @ v


def _bounded_ring(world: int) -> None:
    """``bounded_ring_attention`` against the fp64 reference, forward and every gradient: random packed documents and
    left padding, with and without a sliding window (narrower than a part, and wider), GQA, softcap; head-tail,
    contiguous and a shuffled cut into 4W parts; fp32 through torch's CPU flash kernel with each block's mask, and
    through the Triton kernels on 2 ranks; attention sinks
    (gpt-oss's) against transformers' way of computing them. Each rank's bytes are what its queries see: a window of 3
    sends at most 2 tokens a segment."""
    from tpflow.kernels.attention import attention_ref
    from tpflow.ops import contiguous, head_tail
    from tpflow.ops.bounded_ring import bounded_ring_attention, ring_exchange

    rank, seq = dist.get_rank(), 8 * world
    chunk = seq // (4 * world)
    order = torch.randperm(4 * world, generator=torch.Generator().manual_seed(world)).view(world, 4)
    shuffled = [tuple((int(p) * chunk, chunk) for p in sorted(parts)) for parts in order]
    # fp64: the reference; fp32: torch's CPU flash kernel with each block's mask, or the Triton kernels
    kernels = [("torch", torch.float64), ("torch", torch.float32)]
    kernels += [("triton", torch.float32)] if world == 2 and importlib.util.find_spec("triton") else []
    for (heads, kv, softcap, window, sinks), layout, (kernel, dtype) in itertools.product(
            ((4, 2, None, None, False), (4, 1, 3.0, 3, False), (2, 2, None, 11, False), (4, 2, None, 5, True)),
            (head_tail, contiguous, shuffled), kernels):
        g = torch.Generator().manual_seed(heads + kv)
        q, k, v = (torch.randn(2, h, seq, 16, generator=g, dtype=dtype) for h in (heads, kv, kv))
        dout = torch.randn(2, heads, seq, 16, generator=g, dtype=dtype)
        first = _firsts(2, seq, window, seed=seq + kv)
        sink = torch.randn(heads, generator=g, dtype=dtype).requires_grad_() if sinks else None
        whole = [t.detach().double().requires_grad_() for t in (q, k, v)]
        if sinks:
            whole.append(sink.detach().double().requires_grad_())
            want = _with_sinks(*whole, first=first)
        else:
            want, _ = attention_ref(*whole, causal=True, softcap=softcap, first=first)
        want.backward(dout.double())
        parts = layout if isinstance(layout, list) else layout(world, seq)

        def cut(t, mine=parts[rank]):
            return torch.cat([t[:, :, a:a + n] for a, n in mine], 2)

        mine = [cut(t.detach()).requires_grad_() for t in (q, k, v)]
        exchange = ring_exchange(parts, first)
        if window == 3:  # the 2 tokens before each of a rank's segments, at most
            assert all(sum(n for ranges in need for _, n in ranges) <= 2 * len(parts[dst])
                       for dst, need in enumerate(exchange.needs)), exchange.needs
        with tpf.config.override(kernels=kernel):
            out = bounded_ring_attention(*mine, exchange=exchange, group=None, softcap=softcap, sinks=sink)
            out.backward(cut(dout))
        tol = {} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
        what = f"{kernel} {dtype} {getattr(layout, '__name__', 'shuffled')} heads={heads}/{kv} window={window}"
        torch.testing.assert_close(out.double(), cut(want), **tol, msg=what)
        for got, ref in zip(mine, whole):
            torch.testing.assert_close(got.grad.double(), cut(ref.grad), **tol, msg=what)
        if sinks:  # each rank's share of the sinks' gradient: its queries'
            total = sink.grad.clone()
            dist.all_reduce(total)
            torch.testing.assert_close(total.double(), whole[3].grad, **tol, msg=what)


def test_which_calls_read_packed_documents():
    """Restarting position_ids are documents where one device keeps them apart in that call: Llama's and Gemma 2's
    mask builders read them without a padding mask and without a cache (use_cache off, given or by gradient
    checkpointing in training), gpt-oss's never; the flash kernels read cu_seq_lens_* (with max_length_*) or one
    row's positions, whatever the cache."""
    from tests.models import tiny_moe
    from tpflow.hf.context_batch import PackedDocuments

    flash = {k: torch.tensor([0, 4]) for k in ("cu_seq_lens_q", "cu_seq_lens_k")} | {"max_length_q": 4,
                                                                                       "max_length_k": 4}
    for family in ("llama", "gemma2"):
        model = tiny_lm(family)
        reader = PackedDocuments(model)
        assert reader.reading({"use_cache": False}, 2) == "positions"
        assert reader.reading({}, 2) is None and reader.reading({"use_cache": True}, 2) is None
        assert reader.reading({"use_cache": False, "attention_mask": torch.ones(2, 4)}, 2) is None
        assert reader.reading({"use_cache": False} | flash, 1) == "positions"  # sdpa ignores cu_seq_lens
        model.gradient_checkpointing_enable()
        assert reader.reading({}, 2) == "positions"
        model.eval()
        assert reader.reading({}, 2) is None
    oss = tiny_moe("gpt_oss")
    assert PackedDocuments(oss).reading({"use_cache": False}, 1) is None
    oss.config._attn_implementation = "flash_attention_2"
    reader = PackedDocuments(oss)
    assert reader.reading({}, 1) == "positions" and reader.reading({}, 2) is None
    assert reader.reading({"attention_mask": torch.ones(1, 4)}, 1) == "positions"
    assert reader.reading({"attention_mask": torch.tensor([[0, 1, 1, 1]])}, 1) is None
    assert reader.reading(flash, 2) == "lengths"


def test_bounded_attention_on_whole_sequences():
    """``bounded_attention`` (Ulysses' heads over packed documents): pieces of 5 of 23 tokens, uneven, documents
    and left padding under a window of 7, GQA, sinks; fp64 (the reference) and fp32 (torch's CPU flash kernel with
    each pair's mask), forward and every gradient against the whole-sequence reference."""
    from tpflow.ops.bounded_ring import bounded_attention, pieces, ring_exchange

    g = torch.Generator().manual_seed(3)
    first = _firsts(2, 23, 7, seed=2)
    for dtype in (torch.float64, torch.float32):
        q, k, v = (torch.randn(2, h, 23, 16, generator=g, dtype=dtype, requires_grad=True) for h in (4, 2, 2))
        sinks = torch.randn(4, generator=g, dtype=dtype, requires_grad=True)
        dout = torch.randn(2, 4, 23, 16, generator=g, dtype=dtype)
        whole = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
        _with_sinks(*whole, first=first).backward(dout.double())
        out = bounded_attention(q, k, v, exchange=ring_exchange([pieces(23, 5)], first), sinks=sinks)
        out.backward(dout)
        tol = {} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
        torch.testing.assert_close(out.double(), _with_sinks(*whole, first=first).detach(), **tol)
        for got, want in zip((q, k, v, sinks), whole):
            torch.testing.assert_close(got.grad.double(), want.grad, **tol)


@pytest.mark.parametrize("world", [2, 4])
def test_bounded_ring_attention_matches_the_reference(world):
    harness.run(world, _bounded_ring, world, timeout=300)


def _right_padding() -> None:
    """Rows padded with an ``attention_mask`` and labels = -100 at the padding: on the right (the mask dropped:
    causal attention keeps the real tokens from the padding after them), ring and Ulysses; inside a row, Ulysses by a
    mask on whole sequences, and the ring refuses it, naming Ulysses. The real tokens' logits, the loss, every
    gradient and every parameter after two AdamW steps equal one device's with the mask (left padding:
    ``_families``)."""
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    right = torch.ones_like(ids)
    right[1, 11:] = 0  # the second row: 11 tokens, then 5 of padding
    inside = torch.ones_like(ids)
    inside[1, 6:9] = 0
    inside_labels = ids.masked_fill(inside == 0, -100)
    inside_labels[1, 9] = -100  # scored at the last padded position
    for mask, labels, kinds in ((right, ids.masked_fill(right == 0, -100), ("ring", "ulysses")),
                                (inside, inside_labels, ("ulysses",))):
        for kind in kinds:
            ref = tiny_lm("llama")
            model = tpf.parallelize(copy.deepcopy(ref), placement=_placement(1),
                                    plan=tpf.hf_plan(ref, context_parallel=kind))
            _same_training(model, ref, ids, {"attention_mask": mask, "labels": labels}, f"{kind} padded", TOL)
    with within(60), pytest.raises(ValueError, match="padding on the left or the right .* context_parallel='ulysses'"):
        ref = tiny_lm("llama")
        model = tpf.parallelize(ref, placement=_placement(1), plan=tpf.hf_plan(ref, context_parallel="ring"))
        model(ids, attention_mask=inside, labels=inside_labels)


def _counted_positions() -> None:
    """RoBERTa's decoder, given no ``position_ids``, counts them itself from ``padding_idx + 1``, past the padding:
    each rank is given its tokens' share of the whole rows' count (the model's own function), on a row padded on the
    left, ring and Ulysses. Built bidirectional (``is_decoder=False``, as the zoo's), a padded row is refused by the
    ring (naming Ulysses) and runs under Ulysses with the padding hidden from every query, as on one device."""
    import transformers

    from tpflow.models.zoo import tiny_config

    for decoder in (True, False):
        config = tiny_config("roberta")
        config.is_decoder = decoder
        ids = torch.randint(2, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
        ids[1, slice(0, 4) if decoder else slice(12, 16)] = config.pad_token_id  # left padding; right padding
        mask = (ids != config.pad_token_id).long()
        labels = ids.masked_fill(mask == 0, -100)
        labels[1, 4] = -100  # (scored at the last padded position)
        for kind in ("ring", "ulysses"):
            torch.manual_seed(0)
            ref = transformers.AutoModelForCausalLM.from_config(config).double()
            model = tpf.parallelize(copy.deepcopy(ref), placement=_placement(1),
                                    plan=tpf.hf_plan(ref, context_parallel=kind))
            if kind == "ring" and not decoder:
                with within(60), pytest.raises(ValueError, match="is not causal: .*context_parallel='ulysses'"):
                    model(ids, attention_mask=mask, labels=labels)
                continue
            _same_training(model, ref, ids, {"attention_mask": mask, "labels": labels},
                           f"roberta {kind}, decoder {decoder}", TOL)


def _packed_documents() -> None:
    """Documents packed into rows, their position_ids restarting at each (as DataCollatorWithFlattening gives them,
    labels -100 at each document's first token): Ulysses (under sdpa and eager) and the ring (its cut balanced by the
    documents' work) keep attention inside each document, so the loss, logits, every gradient and every parameter
    after two AdamW steps equal one device's (which masks them alike, without a cache); context x tensor on 4
    ranks. Given as cu_seq_lens (one row, as DataCollatorWithFlattening(return_flash_attn_kwargs=True) packs it)
    beside the position_ids, the same."""
    tensor = 2 if dist.get_world_size() == 4 else 1
    # rows of 16 tokens: documents of random-ish lengths; then long documents first, which the ring's head-tail cut
    # would leave unbalanced (its cut balanced by work moves the parts before the head)
    for lengths, kind, implementation in (([[5, 3, 8], [16], [2, 7, 4, 3]], "ulysses", "sdpa"),
                                          ([[5, 3, 8], [16], [2, 7, 4, 3]], "ulysses", "eager"),
                                          ([[5, 3, 8], [16], [2, 7, 4, 3]], "ring", "sdpa"),
                                          ([[12, 4], [11, 5]], "ring", "eager")):
        positions = torch.tensor([[p for n in row for p in range(n)] for row in lengths])
        ids = torch.randint(0, VOCAB, positions.shape, generator=torch.Generator().manual_seed(5))
        labels = ids.masked_fill(positions == 0, -100)  # no document predicts the next one's first token
        ref = tiny_lm("qwen3", attn_implementation=implementation)
        model = tpf.parallelize(copy.deepcopy(ref), placement=_placement(tensor),
                                plan=tpf.hf_plan(ref, context_parallel=kind))
        what = f"packed, {kind}, {implementation}, tensor={tensor}"
        with within(60):  # use_cache on (the config's default): one device attends across the documents
            out = model(ids, position_ids=positions, labels=labels)
        want = ref(ids, position_ids=positions, labels=labels)
        torch.testing.assert_close(out.loss, want.loss.float(), **TOL, msg=f"{what}, use_cache")
        torch.testing.assert_close(out.logits.full_tensor(), want.logits, **TOL, msg=f"{what}, use_cache")
        # use_cache=False: transformers masks packed documents (only without a cache)
        out = model(ids, position_ids=positions, labels=labels, use_cache=False)
        want = ref(ids, position_ids=positions, labels=labels, use_cache=False)
        torch.testing.assert_close(out.loss, want.loss.float(), **TOL, msg=what)
        torch.testing.assert_close(out.logits.full_tensor(), want.logits, **TOL, msg=what)
        out.loss.backward()
        want.loss.backward()
        _equal(model, ref, what, TOL, grads=True)
        model.zero_grad()
        ref.zero_grad()
        # eps as train_lm's: a near-zero gradient's rounding must not become a whole lr-sized step
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-4) for m in (model, ref)]
        for _ in range(2):
            for m, opt in zip((model, ref), opts):
                m(ids, position_ids=positions, labels=labels, use_cache=False).loss.backward()
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
                opt.step()
                opt.zero_grad()
        _equal(model, ref, what, TOL, grads=False)
    lengths = [3, 9, 4]
    positions = torch.tensor([[p for n in lengths for p in range(n)]])
    cu = torch.tensor([0, 3, 12, 16], dtype=torch.int32)
    flash = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 9, "max_length_k": 9}
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(8))
    labels = ids.masked_fill(positions == 0, -100)
    ref = tiny_lm("llama")
    want = ref(ids, position_ids=positions, labels=labels, use_cache=False)
    for kind in ("ring", "ulysses"):
        model = tpf.parallelize(copy.deepcopy(ref), placement=_placement(tensor),
                                plan=tpf.hf_plan(ref, context_parallel=kind))
        with within(60):  # sdpa reads the documents from the positions, cu_seq_lens are the flash kernels'
            out = model(ids, position_ids=positions, labels=labels, use_cache=False, **flash)
        torch.testing.assert_close(out.loss, want.loss.float(), **TOL, msg=f"cu_seq_lens {kind}")
        torch.testing.assert_close(out.logits.full_tensor(), want.logits, **TOL, msg=f"cu_seq_lens {kind}")


def _three_batches(ids: torch.Tensor) -> list[tuple[str, dict]]:
    """Whole rows; packed documents (position_ids restarting, labels -100 at each document's first token); the
    second row padded on the left (labels -100 at the padding and at the first real token, scored at the last padded
    position)."""
    positions = torch.tensor([[p for n in row for p in range(n)] for row in ([3, 10, 3], [8, 8])])
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    padded = ids.masked_fill(mask == 0, -100)
    padded[1, 5] = -100
    return [("whole", {"labels": ids}),
            ("packed", {"position_ids": positions, "labels": ids.masked_fill(positions == 0, -100)}),
            ("left-padded", {"attention_mask": mask, "labels": padded})]


def _same_training(model, ref, ids: torch.Tensor, kwargs: dict, what: str, tol: dict) -> None:
    """The logits (the real tokens'), the loss and every gradient of one call, then every parameter after two AdamW
    steps with clipping, against one device (called without a cache, which transformers' packed masks need)."""
    real = kwargs.get("attention_mask", torch.ones_like(ids)).bool()
    with within(60):
        out = model(ids, **kwargs, use_cache=False)
        out.loss.backward()
    want = ref(ids, **kwargs, use_cache=False)
    want.loss.backward()
    torch.testing.assert_close(out.logits.full_tensor()[real], want.logits[real], **tol, msg=what)
    torch.testing.assert_close(out.loss, want.loss.float(), **tol, msg=what)
    _equal(model, ref, what, tol, grads=True)
    model.zero_grad()
    ref.zero_grad()
    adamw_steps((model, ref), ids, kwargs)  # (eps: a near-zero gradient's rounding is no lr-sized step)
    _equal(model, ref, what, tol, grads=False)


def _families() -> None:
    """Whole, packed and left-padded batches (not under eager, whose one-device rows of left padding are nan), each
    then two AdamW steps with clipping, on Llama and Qwen3 (no window), sliding windows shorter than the sequence
    (Mistral's on every layer under sdpa; Gemma 2's and Gemma 3's local layers beside their global ones, softcapped,
    under eager) and Llama 4's attention chunks (of 6 tokens, its chunked layers beside a global one, dense): the
    ring fetches the keys each query's document, window or chunk reaches, Ulysses runs them on whole sequences; the
    logits, the loss, every gradient and every parameter equal one device's; one rank, two, and context x tensor on
    4 ranks, each family under the ring at one of 2 and 4 ranks and Ulysses at the other."""
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
    tensor = 2 if dist.get_world_size() == 4 else 1
    gemma3 = {"layers": 3, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
              "attn_logit_softcapping": 5.0, "final_logit_softcapping": 30.0}
    llama4 = {"layers": 4, "attention_chunk_size": 6, "intermediate_size_mlp": 96, "num_local_experts": 4,
              "num_experts_per_tok": 1, "interleave_moe_layer_step": 8, "no_rope_layers": [1, 1, 1, 0]}
    families = (("llama", "sdpa", {}), ("qwen3", "sdpa", {}), ("mistral", "sdpa", {}), ("gemma2", "eager", {}),
                ("gemma3_text", "eager", gemma3), ("llama4_text", "sdpa", llama4))
    world = dist.get_world_size()  # each family under each cut once over 2 and 4 ranks, the ring alone on one
    for i, (family, implementation, extra) in enumerate(families):
        kind = "ring" if world == 1 else ("ring", "ulysses")[(i + world // 2) % 2]
        tol = LOOSE if family.startswith("gemma") else TOL
        for batch, kwargs in _three_batches(ids):  # each from the same start: AdamW's drift does not add up
            if batch == "left-padded" and implementation == "eager":
                continue  # transformers' eager attention gives a left-padded row nan on one device (fp64)
            ref = tiny_lm(family, sliding_window=6, attn_implementation=implementation, **extra)
            model = tpf.parallelize(copy.deepcopy(ref), placement=_placement(tensor),
                                    plan=tpf.hf_plan(ref, context_parallel=kind))
            _same_training(model, ref, ids, kwargs, f"{family} {kind} {batch}, tensor={tensor}", tol)


def _sinks() -> None:
    """gpt-oss: attention sinks (a logit per head in each softmax's denominator) and sliding windows on alternate
    layers, its experts beside; whole, packed (gpt-oss's masks ignore restarting position_ids: one device attends
    across the documents, and so does the split) and left-padded batches, ring and Ulysses (its eager attention, or
    the bounded one, on the rank's heads and sinks): the loss, logits, every gradient and every parameter after two
    AdamW steps equal one device's; context x tensor on 4 ranks. The router's auxiliary loss is off: it is not a sum
    over tokens, so a rank's share of it is not one device's."""
    from tests.models import tiny_moe

    tensor = 2 if dist.get_world_size() == 4 else 1
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(7))
    for kind, (batch, kwargs) in itertools.product(("ring", "ulysses"), _three_batches(ids)):
        ref = tiny_moe("gpt_oss", sliding_window=5, output_router_logits=False)
        ref.config._attn_implementation = "eager"
        model = tpf.parallelize(copy.deepcopy(ref), placement=_placement(tensor),
                                plan=tpf.hf_plan(ref, context_parallel=kind))
        _same_training(model, ref, ids, kwargs, f"gpt-oss {kind} {batch}, tensor={tensor}", TOL)


def _latent() -> None:
    """DeepSeek-V3-shaped latent attention, its real ratios (keys of 16 + 8 rotary columns, values of 16: wider keys
    than values, as in every DeepSeek-V2 / V3, Kimi K2, GLM-4-MoE-Lite, MiniCPM3), its experts beside: whole and
    packed batches under the ring (keys and values travel side by side; the kernels run the values padded to the
    keys' width) and Ulysses; the logits, loss, every gradient and every parameter after two AdamW steps equal one
    device's; context x tensor on 4 ranks. The router's auxiliary loss is off (not a sum over tokens)."""
    from tests.models import tiny_moe

    tensor = 2 if dist.get_world_size() == 4 else 1
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(9))
    for kind, (batch, kwargs) in itertools.product(("ring", "ulysses"), _three_batches(ids)[:2]):
        ref = tiny_moe("deepseek_v3", output_router_logits=False, attn_implementation="sdpa")
        assert ref.config.qk_nope_head_dim + ref.config.qk_rope_head_dim != ref.config.v_head_dim
        model = tpf.parallelize(copy.deepcopy(ref), placement=_placement(tensor),
                                plan=tpf.hf_plan(ref, context_parallel=kind))
        _same_training(model, ref, ids, kwargs, f"deepseek-v3 {kind} {batch}, tensor={tensor}", TOL)


@pytest.mark.parametrize("world", [2, 4])
def test_sinks_match_one_device(world):
    harness.run(world, _sinks, timeout=300)


@pytest.mark.parametrize("world", [2, 4])
def test_latent_attention_matches_one_device(world):
    harness.run(world, _latent, timeout=300)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_whole_packed_and_padded_batches_match_one_device(world):
    harness.run(world, _families, timeout=300)


@pytest.mark.parametrize("world", [2, 4])
def test_padded_rows_match_one_device(world):
    harness.run(world, _right_padding)


def test_positions_counted_past_the_padding_match_one_device():
    harness.run(2, _counted_positions)


@pytest.mark.parametrize("world", [2, 4])
def test_packed_documents_match_one_device(world):
    harness.run(world, _packed_documents)


def _refusals() -> None:
    """Every rank raises the same clear error, before any collective could hang: a length the parts do not divide,
    padding inside a row under the ring, decoding, heads Ulysses cannot split, ranks fed
    different ids, a named placement."""
    ref = tiny_lm("mistral", sliding_window=8)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    ring = tpf.parallelize(copy.deepcopy(ref), placement=_placement(1), plan=tpf.hf_plan(ref, context_parallel="ring"))
    with within():
        with pytest.raises(ValueError, match="not a multiple of 4; pad it to 16"):
            ring(ids[:, :14], labels=ids[:, :14])
        with pytest.raises(ValueError, match=r"labels \[2, 15\] must have the tokens' shape \[2, 16\]"):
            ring(ids, labels=ids[:, 1:])
        with pytest.raises(ValueError, match=r"cu_seq_lens_q \[0, 5, 12\] must count up from 0 to the 16 tokens"):
            cu = torch.tensor([0, 5, 12], dtype=torch.int32)
            ring(ids[:1], cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)
        with pytest.raises(ValueError, match="cu_seq_lens_q and cu_seq_lens_k equal"):
            ring(ids[:1], cu_seq_lens_q=torch.tensor([0, 16]), cu_seq_lens_k=torch.tensor([0, 8, 16]))
        with pytest.raises(ValueError, match="position_ids go from 5 to 3 at token 6 of row 0: packed documents count"):
            ring(ids, position_ids=torch.tensor([0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]).expand(2, 16),
                 use_cache=False)  # (with a cache, one device reads no documents: positions as they are)
        with pytest.raises(ValueError, match="the ring takes padding on the left or the right"):
            ring(ids, attention_mask=torch.ones_like(ids).index_fill_(1, torch.tensor([3]), 0))
        with pytest.raises(ValueError, match=r"takes a 2-D padding mask \[batch, seq\] = \[2, 16\]"):
            ring(ids, attention_mask=torch.ones(2, 1, 16, 16))
        padded = torch.ones_like(ids).index_fill_(1, torch.tensor([14, 15]), 0)
        with pytest.raises(ValueError, match="the padding carries labels: give the padded positions labels = -100"):
            ring(ids, attention_mask=padded, labels=ids)
        with pytest.raises(ValueError, match="generate with a model parallelized by"):
            ring.generate(ids[:, :4], max_new_tokens=2)
        with pytest.raises(ValueError, match="context-parallel ranks .* were fed different inputs"):
            ring(ids[:, :8] + dist.get_rank())
        lm = tiny_lm("llama", kv_heads=1, heads=1)  # 1 head: Ulysses cannot split it over 2 ranks
        with pytest.raises(ValueError, match="drop sequence_parallel"):
            tpf.hf_plan(lm, context_parallel="ring", sequence_parallel=True)
        with pytest.raises(ValueError, match="use 'ring' or 'ulysses'"):
            tpf.hf_plan(lm, context_parallel="zigzag")
        with pytest.raises(ValueError, match=r"Ulysses splits .* 1 query heads .* use \[1\] context ranks"):
            tpf.parallelize(copy.deepcopy(lm), placement=_placement(1),
                            plan=tpf.hf_plan(lm, context_parallel="ulysses"))
        named = tpf.placement("cpu", [[0, 1]], names=("dp", "tp"))
        with pytest.raises(ValueError, match="unnamed 2-D one"):
            tpf.parallelize(copy.deepcopy(lm), placement=named, plan=tpf.hf_plan(lm, context_parallel="ring"))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_context_parallel_language_models_match_one_device(world):
    if world == 1:
        harness.run(1, _matches_one_device, [("llama", "ring"), ("gemma2", "ulysses")], timeout=300)
    elif world == 2:
        harness.run(2, _matches_one_device, [(f, k) for f in ("llama", "qwen3", "mistral", "gemma2")
                                             for k in ("ring", "ulysses")], timeout=600)
        harness.run(2, _checkpointed_and_embeds, timeout=300)
        harness.run(2, _labels_in_fp32, timeout=300)
    else:
        harness.run(4, _matches_one_device, [(f, k) for f in ("llama", "qwen3", "mistral", "gemma2")
                                             for k in ("ring", "ulysses")], timeout=600)
        harness.run(4, _matches_one_device, [("qwen3", "ring"), ("gemma2", "ulysses")], 2, timeout=600)


@pytest.mark.parametrize("world", [2, 4])
def test_ring_and_ulysses_attention_match_the_reference(world):
    harness.run(world, _attention_ops, world, timeout=300)
    if world == 2:
        pytest.importorskip("triton")
        harness.run(2, _ring_on_the_kernels, timeout=300)


def test_context_parallel_refuses_what_it_cannot_split():
    harness.run(2, _refusals, timeout=300)
