"""``tpf.rl.logprobs`` and ``tpf.rl.kl``: each sampled token's log-probability and each position's entropy, computed as
GRPO computes them (a causal LM's logits at positions 0 .. n - 2 against the ids at 1 .. n - 1, divided by the sampler's
temperature, the prompt's positions ignored), and on-policy distillation's KL divergence from a teacher's logits, on
parallelized models' logits split over the vocabulary or whole on every rank. Against one device, fp64: the
log-probabilities, the entropies, the KL divergences, and every parameter's gradient of a loss built of the three (the
experts' fp32 router rounds the MoE families') and every parameter after two AdamW steps with clipping, for Llama,
Qwen3-MoE and gpt-oss at 1, 2 and 4 ranks and a vocabulary the ranks do not divide evenly; bad input refused by name."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import tpflow as tpf
from tests import harness

pytest.importorskip("transformers")

FAMILIES = ("llama", "qwen3_moe", "gpt_oss")
PROMPT, TEMPERATURE = 3, 0.7  # positions before PROMPT are the prompt's: ignored


def _model(kind: str) -> torch.nn.Module:
    from tests.models import tiny_lm, tiny_moe

    return tiny_lm(kind) if kind == "llama" else tiny_moe(kind)


def _scored(model: torch.nn.Module, teacher: torch.nn.Module, ids: torch.Tensor, advantages: torch.Tensor,
            split: bool = True) -> tuple[torch.Tensor, ...]:
    """GRPO's per-token terms of ``model`` on ``ids`` (log-probabilities and entropies of the completion's tokens)
    and on-policy distillation's (the KL divergence from ``teacher``), and a loss of the three, backward run: by
    ``tpf.rl`` on parallelized models, by torch's ``log_softmax`` on one device."""
    logits = model(ids, use_cache=False).logits[:, :-1] / TEMPERATURE
    with torch.no_grad():
        taught = teacher(ids, use_cache=False).logits[:, :-1] / TEMPERATURE
    prompt = torch.arange(ids.shape[1] - 1) < PROMPT - 1
    hidden = model.model(ids, use_cache=False).last_hidden_state[:, :-1]  # for the head's product made in chunks
    if split:
        labels = ids[:, 1:].masked_fill(prompt, -100)
        logp, entropy = tpf.rl.logprobs(logits, labels, entropy=True, chunk=5)
        kl = tpf.rl.kl(logits, taught, chunk=5)
        fused = tpf.rl.linear_logprobs(hidden, model.get_output_embeddings(), labels, temperature=TEMPERATURE,
                                       entropy=True, chunk=5)
    else:
        every, other = torch.log_softmax(logits, -1), torch.log_softmax(taught, -1)
        logp = every.gather(-1, ids[:, 1:, None])[..., 0].masked_fill(prompt, 0.0)
        entropy = -(every.exp() * every).sum(-1)
        kl = (every.exp() * (every - other)).sum(-1)
        again = torch.log_softmax(model.get_output_embeddings()(hidden) / TEMPERATURE, -1)
        fused = again.gather(-1, ids[:, 1:, None])[..., 0].masked_fill(prompt, 0.0), -(again.exp() * again).sum(-1)
    (-(logp * advantages[:, None]).sum() - 0.01 * entropy.sum() + 0.1 * kl.sum() - 0.3 * (fused[0] * advantages.flip(
        0)[:, None]).sum() - 0.02 * fused[1].sum()).backward()
    return logp.detach(), entropy.detach(), kl.detach(), fused[0].detach(), fused[1].detach()


def _logprobs(kinds: tuple[str, ...]) -> None:
    from tests.models import VOCAB

    ranks = list(range(dist.get_world_size()))
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    advantages = torch.tensor([1.0, -0.5], dtype=torch.float64)
    for kind in kinds:
        ref = _model(kind)
        teacher = copy.deepcopy(ref)
        with torch.no_grad():
            for p in teacher.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype) / 10)
        want = _scored(ref, teacher, ids, advantages, split=False)
        for vocab_parallel in (True, False):
            plan = tpf.hf_plan(ref, vocab_parallel=vocab_parallel)
            model, taught = copy.deepcopy(ref), copy.deepcopy(teacher)
            model, taught = (tpf.parallelize(m, placement=tpf.placement("cpu", ranks), plan=plan)
                             for m in (model, taught))
            what = f"{kind}, {len(ranks)} ranks, vocab_parallel={vocab_parallel}"
            if vocab_parallel and len(ranks) > 1:
                assert tpf.get_sbp(model(ids[:, :2], use_cache=False).logits)[-1] == tpf.sbp.split(2), what
            got = _scored(model, taught, ids, advantages)
            tol = 1e-10 if kind == "llama" else 1e-5  # (the experts' router's softmax is fp32 on one device too)
            for g, w, name in zip(got, want, ("log-probabilities", "entropies", "KL divergences",
                                              "fused head's log-probabilities", "fused head's entropies")):
                torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=lambda m, n=name, w=what: f"{w} {n}: {m}")
            assert (got[0][:, :PROMPT - 1] == 0).all(), what
            for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
                if q.grad is None:
                    assert p.grad is None, f"{what} {name} has a gradient one device does not"
                    continue
                torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=tol, atol=tol,
                                           msg=lambda m, n=name, w=what: f"{w} {n}'s gradient: {m}")
            alone = copy.deepcopy(ref)  # (deepcopy leaves the gradients behind)
            for a, q in zip(alone.parameters(), ref.parameters(), strict=True):
                a.grad = None if q.grad is None else q.grad.clone()
            _same_steps(model, alone, taught, teacher, ids, advantages, what)


def _same_steps(model, alone, taught, teacher, ids, advantages, what: str) -> None:
    """Two AdamW steps with clipping that bites, from the gradients ``model`` and ``alone`` (one device's, the same
    values) hold: every parameter as one device's after them."""
    from tests.models import ShardAdamW
    from tpflow.models.check import STEP_TOLERANCE

    opts = [ShardAdamW(m, lr=1e-2, eps=1e-4) for m in (model, alone)]
    for step in range(2):
        if step:
            _scored(model, taught, ids, advantages)
            _scored(alone, teacher, ids, advantages, split=False)
        for opt in opts:
            opt.step(0.5)
    for (name, p), q in zip(model.named_parameters(), alone.parameters(), strict=True):
        off = (p.detach().full_tensor() - q.detach()).abs().max() / max(q.detach().abs().max().item(), 1e-6)
        assert off <= STEP_TOLERANCE, f"{what} {name} after AdamW: {off:.1e} off"


@pytest.mark.parametrize("world", [1, 2, 4])
def test_logprobs_and_entropies_match_one_device(world):
    harness.run(world, _logprobs, FAMILIES, timeout=600)


def _both_sides() -> None:
    """``tpf.rl.kl``'s gradient in both logits (split unevenly: 6 and 5 of 11), against torch's."""
    whole = [torch.randn(3, 4, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) for i in (1, 2)]
    split = [tpf.tensor(t, placement=tpf.placement("cpu", [0, 1]), sbp=tpf.sbp.split(2)).requires_grad_()
             for t in whole]
    weights = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    (tpf.rl.kl(*split, temperature=1.3, chunk=5) * weights).sum().backward()
    for t in whole:
        t.requires_grad_()
    p, q = (torch.log_softmax(t / 1.3, -1) for t in whole)
    ((p.exp() * (p - q)).sum(-1) * weights).sum().backward()
    for got, want in zip(split, whole):
        torch.testing.assert_close(got.grad.full_tensor(), want.grad, rtol=1e-12, atol=1e-12)


def _refused() -> None:
    logits = tpf.randn(2, 4, 11, placement=tpf.placement("cpu", [0, 1]), sbp=tpf.sbp.split(2))
    labels = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature must be > 0, got 0"):
        tpf.rl.logprobs(logits, labels, temperature=0)
    with pytest.raises(ValueError, match="target 11 is outside the 11 classes"):
        tpf.rl.logprobs(logits, labels.index_fill(1, torch.tensor([2]), 11))
    with pytest.raises(ValueError, match=r"align them first: logits\[:, :-1\] score ids\[:, 1:\]"):
        tpf.rl.logprobs(logits, labels[:, 1:])
    with pytest.raises(ValueError, match="must be laid out alike"):
        tpf.rl.kl(logits, logits.full_tensor())


def test_bad_input_is_refused_on_every_rank_and_kl_differentiates_both_sides():
    harness.run(2, _refused)
    harness.run(2, _both_sides)


def _trl_fused_head() -> None:
    """TRL's fused head (``add_fused_lm_head``, what its GRPO, DPO, KTO and SFT trainers score tokens with), routed
    as ``tpf.adopt`` routes it, on a vocabulary-parallel Llama with a softcap and a logit scale: every output TRL
    asks for and every gradient as TRL's own on one device, and the head never gathered whole."""
    import trl.trainer.utils as utils
    from torch.distributed.tensor import DTensor

    from tests.models import VOCAB, tiny_lm
    from tpflow.hf.frameworks.trl_heads import route_fused_heads

    outputs = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    ref = tiny_lm("llama")
    ref.config.final_logit_softcapping, ref.config.logit_scale = 3.0, 0.5
    model = tpf.parallelize(copy.deepcopy(ref), placement=tpf.placement("cpu", [0, 1]), plan="auto")
    for m in (ref, model):
        utils.add_fused_lm_head(m, temperature=0.7, outputs=outputs)
    route_fused_heads(model)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    for k in (4, 6):  # tokens that are the argmax after them (the logits at k do not see the token at k + 1)
        with torch.no_grad():
            ids[:, k + 1] = ref(input_ids=ids).logits[:, k].argmax(-1)
    labels = ids.masked_fill(torch.arange(9) < 3, -100)
    gathered = []
    full_tensor = DTensor.full_tensor
    with mock.patch.object(DTensor, "full_tensor", lambda t, **kw: gathered.append(t.shape) or full_tensor(t, **kw)):
        got = model(input_ids=ids, labels=labels, fused_lm_head=True)
        (got.loss + (got.entropy * torch.linspace(0, 1, 8)).sum()).backward()
    assert (VOCAB, ref.config.hidden_size) not in gathered, gathered
    want = ref(input_ids=ids, labels=labels, fused_lm_head=True)
    (want.loss + (want.entropy * torch.linspace(0, 1, 8)).sum()).backward()
    for name in ("loss", *outputs):
        if name == "is_top1":
            assert torch.equal(got.is_top1, want.is_top1) and want.is_top1.any(), (got.is_top1, want.is_top1)
        else:
            torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-6, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6,  # TRL's fp32 statistics
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_trl_fused_head_scores_on_the_head_blocks():
    pytest.importorskip("trl")
    harness.run(2, _trl_fused_head)
    from tpflow.hf.frameworks.trl_heads import route_fused_heads

    model = torch.nn.Linear(2, 2)  # a forward of TRL's this route does not know is refused, not gathered unsaid
    model.forward = _renamed_trl_forward(model)
    with pytest.raises(ValueError, match="not the fused head tpflow routes"):
        route_fused_heads(model)


def _renamed_trl_forward(model: torch.nn.Module):
    """A bound method whose code claims to be TRL's, under another name than its fused forward's."""
    import types

    import trl.trainer.utils as utils

    def forward(self, x):
        return x

    forward.__code__ = forward.__code__.replace(co_filename=utils.__file__, co_name="_tiled_forward")
    return types.MethodType(forward, model)
