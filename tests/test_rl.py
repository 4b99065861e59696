"""``tpf.rl.logprobs``: each sampled token's log-probability and each position's entropy, computed as GRPO computes them
(a causal LM's logits at positions 0 .. n - 2 against the ids at 1 .. n - 1, divided by the sampler's temperature, the
prompt's positions ignored), on a parallelized model's logits split over the vocabulary or whole on every rank. Against
one device, fp64: the log-probabilities, the entropies, and every parameter's gradient of a policy-gradient loss built
of both (the experts' fp32 router rounds the MoE families' gradients), for Llama, Qwen3-MoE and gpt-oss at 1, 2 and 4
ranks and a vocabulary the ranks do not divide evenly; bad input refused by name."""

from __future__ import annotations

import copy

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


def _scored(model: torch.nn.Module, ids: torch.Tensor, advantages: torch.Tensor,
            split: bool = True) -> tuple[torch.Tensor, ...]:
    """GRPO's per-token terms of ``model`` on ``ids``: log-probabilities and entropies of the completion's tokens,
    and the policy-gradient loss of both, backward run (by ``tpf.rl.logprobs`` on a parallelized model, by torch's
    ``log_softmax`` on one device)."""
    logits = model(ids, use_cache=False).logits[:, :-1] / TEMPERATURE
    prompt = torch.arange(ids.shape[1] - 1) < PROMPT - 1
    if split:
        logp, entropy = tpf.rl.logprobs(logits, ids[:, 1:].masked_fill(prompt, -100), entropy=True, chunk=5)
    else:
        every = torch.log_softmax(logits, -1)
        logp = every.gather(-1, ids[:, 1:, None])[..., 0].masked_fill(prompt, 0.0)
        entropy = -(every.exp() * every).sum(-1)
    (-(logp * advantages[:, None]).sum() - 0.01 * entropy.sum()).backward()
    return logp.detach(), entropy.detach()


def _logprobs(kinds: tuple[str, ...]) -> None:
    from tests.models import VOCAB

    ranks = list(range(dist.get_world_size()))
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    advantages = torch.tensor([1.0, -0.5], dtype=torch.float64)
    for kind in kinds:
        ref = _model(kind)
        want = _scored(ref, ids, advantages, split=False)
        for vocab_parallel in (True, False):
            model = copy.deepcopy(ref)
            model.zero_grad(set_to_none=True)  # (the copy's gradients: one device's)
            model = tpf.parallelize(model, placement=tpf.placement("cpu", ranks),
                                    plan=tpf.hf_plan(ref, vocab_parallel=vocab_parallel))
            what = f"{kind}, {len(ranks)} ranks, vocab_parallel={vocab_parallel}"
            if vocab_parallel and len(ranks) > 1:
                assert tpf.get_sbp(model(ids[:, :2], use_cache=False).logits)[-1] == tpf.sbp.split(2), what
            got = _scored(model, ids, advantages)
            tol = 1e-10 if kind == "llama" else 1e-5  # (the experts' router's softmax is fp32 on one device too)
            for g, w, name in zip(got, want, ("log-probabilities", "entropies")):
                torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=lambda m, n=name, w=what: f"{w} {n}: {m}")
            assert (got[0][:, :PROMPT - 1] == 0).all(), what
            for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
                if q.grad is None:
                    assert p.grad is None, f"{what} {name} has a gradient one device does not"
                    continue
                torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=tol, atol=tol,
                                           msg=lambda m, n=name, w=what: f"{w} {n}'s gradient: {m}")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_logprobs_and_entropies_match_one_device(world):
    harness.run(world, _logprobs, FAMILIES if world == 2 else FAMILIES[:2], timeout=600)


def _refused() -> None:
    logits = tpf.randn(2, 4, 11, placement=tpf.placement("cpu", [0, 1]), sbp=tpf.sbp.split(2))
    labels = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature must be > 0, got 0"):
        tpf.rl.logprobs(logits, labels, temperature=0)
    with pytest.raises(ValueError, match="target 11 is outside the 11 classes"):
        tpf.rl.logprobs(logits, labels.index_fill(1, torch.tensor([2]), 11))
    with pytest.raises(ValueError, match=r"align them first: logits\[:, :-1\] score ids\[:, 1:\]"):
        tpf.rl.logprobs(logits, labels[:, 1:])


def test_bad_input_is_refused_on_every_rank():
    harness.run(2, _refused)
