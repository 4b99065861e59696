"""The vocabulary split over the ranks, against one device: the loss of split logits (``tpf.cross_entropy``, and
``F.cross_entropy`` under ``tpf.vocab_parallel_loss()``), the fused head + loss, the vocabulary-parallel
embedding, and a tied embedding and head kept one parameter; forward, backward and parameters after optimizer
steps, on uneven vocabularies over 1-4 ranks, with ignore_index and label smoothing. The local kernels run
through Triton's interpreter against their torch references."""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate

import tpflow as tpf
from tests import harness
from tests.checks import all_ranks
from tpflow.kernels import logit_grad, logit_grad_ref, logit_stats, logit_stats_ref
from tpflow.layers import VocabParallelEmbedding

VOCABS = (37, 101)  # uneven blocks over 2, 3 and 4 ranks


def _targets(shape, vocab, seed):
    t = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))
    t.view(-1)[::4] = -100  # every fourth token ignored
    return t


def _close(got, want, dtype, what):
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def _loss_checks(dtype):
    """tpf.cross_entropy on logits split over the classes, and F.cross_entropy routed to it: every reduction, with
    and without label smoothing, 2-D and 3-D logits; the bytes sent are the row stats, never the logits."""
    P, g = all_ranks(), torch.Generator().manual_seed(0)
    for vocab in VOCABS:
        whole = torch.randn(3, 5, vocab, generator=g, dtype=torch.float64).to(dtype) * 3
        target = _targets((3, 5), vocab, seed=vocab)
        weights = torch.rand(3, 5, generator=g, dtype=torch.float64).to(dtype)
        for reduction in ("mean", "sum", "none"):
            for smoothing in (0.0, 0.1):
                ref = whole.clone().requires_grad_()
                want = F.cross_entropy(ref.flatten(0, 1), target.flatten(), reduction=reduction,
                                       label_smoothing=smoothing)
                want = want.view(3, 5) if reduction == "none" else want
                (want * weights if reduction == "none" else want).sum().backward()
                logits = tpf.tensor(whole, placement=P, sbp=tpf.sbp.split(2)).requires_grad_()
                tpf.comm.stats.reset()
                got = tpf.cross_entropy(logits, target, reduction=reduction, label_smoothing=smoothing)
                assert tpf.comm.stats.bytes_sent <= 4 * 15 * 8 * dist.get_world_size(), "the logits travelled"
                (got * weights if reduction == "none" else got).sum().backward()
                what = f"V={vocab} {reduction} smoothing={smoothing} {dtype}"
                _close(got, want, dtype, what)
                _close(logits.grad.full_tensor(), ref.grad, dtype, f"{what}: gradient")
        flat = tpf.tensor(whole.flatten(0, 1), placement=P, sbp=tpf.sbp.split(1))
        with tpf.vocab_parallel_loss():
            routed = F.cross_entropy(flat, target.flatten(), label_smoothing=0.2)
        _close(routed, F.cross_entropy(whole.flatten(0, 1), target.flatten(), label_smoothing=0.2), dtype, "routed")


def _fused_checks(dtype):
    """The fused head + loss against nn.Linear + F.cross_entropy: loss, every gradient, and the head and hidden
    states after SGD steps; chunks that do not divide the tokens."""
    P = all_ranks()
    for vocab, reduction, smoothing in ((37, "mean", 0.0), (101, "sum", 0.1)):
        torch.manual_seed(vocab)
        lin = nn.Linear(16, vocab, dtype=dtype)
        head = tpf.ColumnParallelLinear.from_linear(lin, placement=P)
        hidden = torch.randn(2, 5, 16, dtype=dtype)
        h, h_ref = nn.Parameter(hidden.clone()), nn.Parameter(hidden.clone())
        target = _targets((2, 5), vocab, seed=1)
        opt, opt_ref = (torch.optim.SGD([*m.parameters(), x], lr=0.5) for m, x in ((head, h), (lin, h_ref)))
        for step in range(3):
            loss = tpf.linear_cross_entropy(h, head, target, reduction=reduction, label_smoothing=smoothing, chunk=3)
            want = F.cross_entropy(lin(h_ref).flatten(0, 1), target.flatten(), reduction=reduction,
                                   label_smoothing=smoothing)
            (2 * loss).backward()
            (2 * want).backward()
            what = f"fused V={vocab} {reduction} step {step}"
            _close(loss, want, dtype, what)
            _close(h.grad, h_ref.grad, dtype, f"{what}: hidden gradient")
            _close(head.weight.grad.full_tensor(), lin.weight.grad, dtype, f"{what}: weight gradient")
            _close(head.bias.grad.full_tensor(), lin.bias.grad, dtype, f"{what}: bias gradient")
            for o in (opt, opt_ref):
                o.step()
                o.zero_grad()
        _close(head.weight.full_tensor(), lin.weight, dtype, "fused: weight after SGD")
        _close(head.bias.full_tensor(), lin.bias, dtype, "fused: bias after SGD")
        _close(h, h_ref, dtype, "fused: hidden states after SGD")


def _embedding_checks():
    """The vocabulary-parallel embedding: uneven rows, a padding row on the last rank, ids at the blocks' edges,
    the sequence-parallel reduce-scatter, a whole checkpoint loaded, and SGD steps."""
    P, W = all_ranks(), dist.get_world_size()
    for vocab in VOCABS:
        torch.manual_seed(vocab)
        ref = nn.Embedding(vocab, 8, padding_idx=vocab - 2, dtype=torch.float64)
        emb = VocabParallelEmbedding.from_embedding(ref, placement=P)
        edges = [s for bounds in tpf.sbp.chunk_bounds(vocab, W) for s in (bounds[0], bounds[1] - 1)]
        lo, hi = tpf.sbp.chunk_bounds(vocab, W)[tpf.get_rank()]
        assert f"rows [{lo}, {hi}) of {vocab} on this rank" in repr(emb), repr(emb)  # half-open, as written
        ids = torch.tensor([edges + [vocab - 2, vocab - 1, 0]] * 2)
        grad = torch.randn(*ids.shape, 8, dtype=torch.float64)
        opt, opt_ref = torch.optim.SGD(emb.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
        for _ in range(2):
            out, want = emb(ids), ref(ids)
            torch.testing.assert_close(out, want, rtol=0, atol=0)
            (out * grad).sum().backward()
            (want * grad).sum().backward()
            torch.testing.assert_close(emb.weight.grad.full_tensor(), ref.weight.grad, rtol=0, atol=0)
            assert not ref.weight.grad[vocab - 2].any(), "the padding row got a gradient"
            for o in (opt, opt_ref):
                o.step()
                o.zero_grad()
        torch.testing.assert_close(emb.weight.full_tensor(), ref.weight, rtol=0, atol=0)
        sp = VocabParallelEmbedding.from_embedding(ref, placement=P, sequence_parallel=True, sequence_dim=1)
        tokens = torch.randint(0, vocab, (2, 2 * W))
        mine = sp(tokens)
        start, end = tpf.sbp.chunk_bounds(2 * W, W)[tpf.get_rank()]
        torch.testing.assert_close(mine, ref(tokens)[:, start:end], rtol=0, atol=0)
        mine.sum().backward()
        ref.zero_grad()
        ref(tokens).sum().backward()
        torch.testing.assert_close(sp.weight.grad.full_tensor(), ref.weight.grad, rtol=0, atol=0)
        fresh = VocabParallelEmbedding(vocab, 8, padding_idx=vocab - 2, placement=P, dtype=torch.float64)
        fresh.load_state_dict(ref.state_dict())  # a single-device checkpoint, whole tensors
        torch.testing.assert_close(fresh.weight.full_tensor(), ref.weight, rtol=0, atol=0)
    with pytest.raises(IndexError, match=r"id 37 is outside the vocabulary \[0, 37\)"):
        VocabParallelEmbedding(37, 4, placement=P)(torch.tensor([0, 37]))
    with pytest.raises(ValueError, match="max_norm=1.0, which needs the whole table"):
        VocabParallelEmbedding.from_embedding(nn.Embedding(37, 4, max_norm=1.0), placement=P)


class TiedLM(nn.Module):
    """An embedding, an MLP and a head tied to the embedding, as small language models are built."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 3 * dim), nn.Linear(3 * dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        return self.head(self.norm(x + self.fc2(F.gelu(self.fc1(x)))))


PLAN = {"embed": "vocab", "head": "vocab", "fc1": "column", "fc2": "row"}


def _tied_checks():
    """A tied pair: one parameter with one device's gradient (the embedding's and the head's summed), the same
    after AdamW steps, trained through tpf.cross_entropy on the split logits; and the plans that would untie it."""
    P = all_ranks()
    torch.manual_seed(0)
    ref = TiedLM(101, 16).double()
    model = tpf.parallelize(copy.deepcopy(ref), placement=P, plan=PLAN)
    assert model.head.weight is model.embed.weight, "the tie came undone"
    assert len(list(model.parameters())) == len(list(ref.parameters()))
    ids, target = torch.randint(0, 101, (2, 6)), _targets((2, 6), 101, seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        logits = model(ids)
        assert isinstance(logits, torch.distributed.tensor.DTensor) and tpf.get_sbp(logits) == (tpf.sbp.split(2),)
        loss = tpf.cross_entropy(logits, target, label_smoothing=0.1)
        want = F.cross_entropy(ref(ids).flatten(0, 1), target.flatten(), label_smoothing=0.1)
        torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12, msg=f"tied: loss at step {step}")
        loss.backward()
        want.backward()
        torch.testing.assert_close(model.embed.weight.grad.full_tensor(), ref.embed.weight.grad, rtol=1e-10,
                                   atol=1e-12, msg="tied: the gradient of the tied weight")
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad()
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), p_ref, rtol=1e-10, atol=1e-10, msg=f"tied: {name} after AdamW")
    folder = [tempfile.mkdtemp(prefix="tpflow-tied-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)
    dcp.save(tpf.unique_state_dict(model), checkpoint_id=folder[0])
    assert "head.weight" not in dcp.FileSystemReader(folder[0]).read_metadata().state_dict_metadata  # once on disk
    restored = tpf.parallelize(TiedLM(101, 16).double(), placement=P, plan=PLAN)
    dcp.load(tpf.unique_state_dict(restored), checkpoint_id=folder[0])  # in place: both names get the values
    assert restored.head.weight is restored.embed.weight
    for (name, p), q in zip(restored.named_parameters(), model.parameters()):
        assert torch.equal(p.to_local(), q.to_local()), f"tied: {name} after dcp save and load"
    loaded = tpf.parallelize(TiedLM(101, 16).double(), placement=P, plan=PLAN)
    loaded.load_state_dict(ref.state_dict())  # one device's checkpoint: both names, one tensor
    assert loaded.head.weight is loaded.embed.weight
    torch.testing.assert_close(loaded.head.weight.full_tensor(), ref.head.weight, rtol=0, atol=0)
    aliased = TiedLM(101, 16)
    aliased.encoder = nn.Module()
    aliased.encoder.embed_tokens = aliased.embed  # one module under two names (T5's shared embedding)
    tpf.parallelize(aliased, placement=P, plan=PLAN)
    assert aliased.encoder.embed_tokens is aliased.embed and aliased.head.weight is aliased.embed.weight
    with pytest.raises(ValueError, match=r"shared with \['embed.weight'\]; parallelizing it alone would untie them"):
        tpf.parallelize(TiedLM(101, 16), placement=P, plan={"head": "vocab"})
    with pytest.raises(ValueError, match="their plan entries split it differently"):
        tpf.parallelize(TiedLM(101, 16), placement=P, plan={"embed": "vocab", "head": "row"})


def _two_d_checks():
    """On a 2-D placement (data x tensor) the head's logits are a global tensor over this rank's tensor-parallel
    ranks, and the loss and the gradients (partial sums over the data axis, here of the same data twice) are one
    device's."""
    P = tpf.placement("cpu", ranks=[[0, 1], [2, 3]])
    torch.manual_seed(0)
    ref = TiedLM(101, 16).double()
    model = tpf.parallelize(copy.deepcopy(ref), placement=P, plan=PLAN)
    ids, target = torch.randint(0, 101, (2, 6)), _targets((2, 6), 101, seed=3)  # the same batch on every rank
    logits = model(ids)
    assert tpf.get_placement(logits).ranks == [0, 1] if tpf.get_rank() < 2 else [2, 3]
    torch.testing.assert_close(logits.full_tensor(), ref(ids), rtol=1e-12, atol=1e-12)
    loss = tpf.cross_entropy(logits, target)
    want = F.cross_entropy(ref(ids).flatten(0, 1), target.flatten())
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    loss.backward()
    want.backward()
    torch.testing.assert_close(model.embed.weight.grad.full_tensor(), 2 * ref.embed.weight.grad, rtol=1e-10,
                               atol=1e-12)


def _edge_checks(dtype):
    """Infinite logits (a masked tail of the vocabulary, a rank whose block is all -inf for a row), a rank holding
    no classes, and a batch whose targets are all ignored: one device's loss and gradients, nan where torch's."""
    P, W = all_ranks(), dist.get_world_size()
    vocab = 9  # over 4 ranks torch.chunk leaves the last one no class
    whole = torch.randn(6, vocab, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(dtype)
    whole[:, -3:] = float("-inf")  # the last rank's block (and over 2 ranks, part of one) is all -inf
    whole[0, 3] = float("-inf")  # the first or last logit of a middle block
    target = torch.tensor([0, 1, 2, 4, -100, 5])
    ref = whole.clone().requires_grad_()
    want = F.cross_entropy(ref, target, label_smoothing=0.0)
    want.backward()
    logits = tpf.tensor(whole, placement=P, sbp=tpf.sbp.split(1)).requires_grad_()
    got = tpf.cross_entropy(logits, target)
    got.backward()
    _close(got, want, dtype, f"-inf logits, {vocab} classes over {W} ranks")
    _close(logits.grad.full_tensor(), ref.grad, dtype, "-inf logits: gradient")
    head = tpf.ColumnParallelLinear.from_linear(nn.Linear(8, 37, dtype=dtype), placement=P)
    hidden = torch.randn(4, 8, dtype=dtype, requires_grad=True)
    ignored = torch.full((4,), -100)
    loss = tpf.linear_cross_entropy(hidden, head, ignored)
    loss.backward()
    assert loss.isnan() and F.cross_entropy(hidden @ head.weight.full_tensor().T, ignored).isnan()
    assert not hidden.grad.any() and not head.weight.grad.full_tensor().any(), "all ignored: zero gradients"
    if W == 4:
        with pytest.raises(ValueError, match=r"leaves ranks \[3\] no rows"):
            VocabParallelEmbedding(vocab, 4, placement=P)
        small = TiedLM(vocab, 8)
        before = copy.deepcopy(small.state_dict())
        with pytest.raises(ValueError, match=r"'embed' has 9 rows, which leave ranks \[3\] of 4 none"):
            tpf.parallelize(small, placement=P, plan=PLAN)
        assert all(type(m) in (TiedLM, nn.Embedding, nn.Linear, nn.LayerNorm) for m in small.modules())
        assert all(torch.equal(v, before[k]) for k, v in small.state_dict().items()), "a refused plan changed it"


def _autocast_checks():
    """Under bf16 autocast (fp32 parameters): the split loss and the fused one against torch's under the same
    autocast, each loss in fp32 as autocast gives F.cross_entropy's, gradients in the parameters' dtype."""
    P = all_ranks()
    torch.manual_seed(0)
    lin = nn.Linear(16, 37)
    head = tpf.ColumnParallelLinear.from_linear(lin, placement=P, global_output=True)
    hidden = torch.randn(2, 5, 16)
    target = _targets((2, 5), 37, seed=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.cross_entropy(lin(hidden).flatten(0, 1), target.flatten())
        split = tpf.cross_entropy(head(hidden), target)
        fused = tpf.linear_cross_entropy(hidden, head, target)
    assert want.dtype == split.dtype == fused.dtype == torch.float32
    torch.testing.assert_close(split, want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fused, want, rtol=2e-2, atol=2e-2)
    want.backward()
    fused.backward()
    assert head.weight.grad.dtype == torch.float32
    torch.testing.assert_close(head.weight.grad.full_tensor(), lin.weight.grad, rtol=5e-2, atol=5e-3)
    torch.testing.assert_close(head.bias.grad.full_tensor(), lin.bias.grad, rtol=5e-2, atol=5e-3)


def _argmax_checks():
    """argmax / argmin along a split dim (the logits' over the vocabulary, or any other), with ties, a leading dim of
    1 (generate's batch; torch's own handler fails there), uneven blocks and keepdim: one device's indices, whole on
    every rank; split along another dim, torch's own result."""
    for shape in [(1, 8, 37), (4, 8, 37), (1, 1, 37), (2, 5), (3,)]:
        x = torch.randint(0, 3, shape, generator=torch.Generator().manual_seed(len(shape))).double()
        for dim in range(len(shape)):
            split = tpf.tensor(x, placement=all_ranks(), sbp=tpf.sbp.split(dim))
            for op, keepdim in ((torch.argmax, False), (torch.argmin, False), (torch.argmax, True)):
                got = op(split, dim, keepdim=keepdim)
                assert got.placements == (Replicate(),) and torch.equal(got.full_tensor(), op(x, dim, keepdim)), \
                    (shape, dim, op.__name__, keepdim)
            if len(shape) > 1:
                other = tpf.tensor(x, placement=all_ranks(), sbp=tpf.sbp.split((dim + 1) % len(shape)))
                assert torch.equal(other.argmax(dim).full_tensor(), x.argmax(dim)), (shape, dim)


def _vocab_rank():
    # the Triton kernels (the interpreter here) compute on each rank's block alike: 1 rank, and 3 (uneven blocks)
    kinds = ((torch.float64, "torch"), (torch.float32, "triton"))[:2 if dist.get_world_size() in (1, 3) else 1]
    for dtype, kernels in kinds:
        with tpf.config.override(kernels=kernels):  # fp32 through the Triton kernels (the interpreter on CPU)
            _loss_checks(dtype)
            _fused_checks(dtype)
            _edge_checks(dtype)
    _embedding_checks()
    _tied_checks()
    _autocast_checks()
    _argmax_checks()
    if dist.get_world_size() == 4:
        _two_d_checks()
    with pytest.raises(ValueError, match=r"target 37 is outside the 37 classes \[0, 37\)"):
        tpf.cross_entropy(tpf.tensor(torch.zeros(2, 37), placement=all_ranks(), sbp=tpf.sbp.split(1)),
                          torch.tensor([0, 37]))
    return dist.get_world_size()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_vocabulary_parallel(world):
    pytest.importorskip("triton")
    assert harness.run(world, _vocab_rank, timeout=600) == [world] * world


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,classes,start", [(5, 37, 0), (7, 5000, 100), (3, 1, 2), (4, 64, 64)])
def test_loss_kernels_match_their_references(dtype, rows, classes, start):
    """The Triton kernels (interpreted on CPU, compiled on a GPU): the row stats, and the gradient both into a
    new tensor and over the logits themselves, against the torch references."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(rows * classes)
    x = (torch.randn(rows, classes, generator=g) * 3).to(device, dtype)
    target = torch.randint(0, classes + start + 10, (rows,), generator=g).to(device)
    target[0] = -100
    with tpf.config.override(kernels="triton"):
        stats = logit_stats(x, target, start, smoothing=True)
        torch.testing.assert_close(stats, logit_stats_ref(x, target, start, smoothing=True), rtol=1e-5, atol=1e-4)
        lse = torch.logsumexp(x.float(), 1) + 0.3  # other ranks' classes add to the row's logsumexp
        scale = torch.rand(rows, generator=g).to(device)
        scale[-1] = 0  # an ignored row
        want = logit_grad_ref(x, target, start, lse, scale, 0.1, classes + start + 10)
        tol = 1e-3 if dtype == torch.float16 else 1e-6
        torch.testing.assert_close(logit_grad(x, target, start, lse, scale, 0.1, classes + start + 10), want,
                                   rtol=tol, atol=tol)
        logit_grad(x, target, start, lse, scale, 0.1, classes + start + 10, out=x)
        torch.testing.assert_close(x, want, rtol=tol, atol=tol)
