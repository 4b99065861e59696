"""Mixtures of experts split over the tensor-parallel ranks by their own plans (``plan="auto"``): Qwen3-MoE, Mixtral,
OLMoE, Qwen2-MoE and DeepSeek-V3 on 1, 2 and 4 ranks against one device: the logits, the ``labels=`` loss with the
router's auxiliary loss, 3 AdamW steps with clipping that bites (every parameter after them, the routers included),
greedy and sampled decoding; each rank holds 1/W of every expert. The default experts implementation
(``torch._grouped_mm``) in fp32 too, and the mistakes: experts that do not split, a layout tpflow does not know."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import tpflow as tpf
from tests import harness
from tests.models import MOE_KINDS, VOCAB, tiny_moe, train_lm
from tpflow.layers.experts import check_experts

pytest.importorskip("transformers")


def _experts(model):
    return [m for name, m in model.named_modules() if name.endswith("mlp.experts")]


def _matches_one_device(kind):
    P = tpf.placement("cpu", list(range(dist.get_world_size())))
    ref = tiny_moe(kind)
    model = tpf.parallelize(copy.deepcopy(ref), placement=P, plan="auto")
    # Qwen2-MoE's shared expert, which its own plan leaves whole, is split too
    shared = [m for name, m in model.named_modules() if name.endswith("shared_expert.gate_proj")]
    assert all(isinstance(m, tpf.ColumnParallelLinear) for m in shared), kind
    for experts in _experts(model):  # each rank its slice of every expert
        for p in (experts.gate_up_proj, experts.down_proj):
            assert p.to_local().numel() * dist.get_world_size() == p.numel(), (kind, p.shape)
    ids = torch.randint(0, VOCAB, (4, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, want = model(ids).logits, ref(ids).logits
    torch.testing.assert_close(logits.full_tensor(), want, rtol=1e-6, atol=1e-6, msg=f"{kind}: logits")
    losses, norms = train_lm(model, ids, steps=3)
    ref_losses, ref_norms = train_lm(ref, ids, steps=3)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=1e-6,
                               msg=f"{kind}: losses")
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-6, atol=1e-6,
                               msg=f"{kind}: norms")
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-6, atol=1e-6,
                                   msg=lambda m, name=name: f"{kind}: {name} after AdamW: {m}")
    prompt = ids[:2, :4]
    tokens = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(tokens, ref.generate(prompt, max_new_tokens=6, do_sample=False)), kind
    sampled = []
    for m in (model, ref):  # sampling: the same draws from the same distribution
        torch.manual_seed(5)
        sampled.append(m.generate(prompt, max_new_tokens=6, do_sample=True, top_k=0))
    assert torch.equal(*sampled), kind


def _grouped_mm():
    """The default experts implementation, torch._grouped_mm, in fp32: one device's loss and gradients."""
    P = tpf.placement("cpu", list(range(dist.get_world_size())))
    ref = tiny_moe("qwen3_moe", experts="grouped_mm", dtype=torch.float32)
    model = tpf.parallelize(copy.deepcopy(ref), placement=P, plan="auto")
    ids = torch.randint(0, VOCAB, (4, 10), generator=torch.Generator().manual_seed(2))
    loss, want = model(ids, labels=ids).loss, ref(ids, labels=ids).loss
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    loss.backward()
    want.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-4, atol=1e-5, msg=name)


def _cases(kinds):
    for kind in kinds:
        _matches_one_device(kind)
    _grouped_mm()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_experts_split_over_tensor_ranks_match_one_device(world):
    harness.run(world, _cases, MOE_KINDS if world > 1 else MOE_KINDS[:2], timeout=300)


def test_experts_that_do_not_split_are_refused():
    experts = _experts(tiny_moe("qwen3_moe"))[0]
    with pytest.raises(ValueError, match=r"intermediate size 48 does not split over 5 tensor-parallel ranks: use 1, 2, "
                                         r"3, 4, 6, 8, 12, 16, 24 or 48 ranks, or expert parallelism"):
        check_experts("model.layers.0.mlp.experts", experts, 5)
    experts.extra_bias = torch.nn.Parameter(torch.zeros(4, 64))
    with pytest.raises(ValueError, match=r"has parameters \['extra_bias'\] besides gate_up_proj and down_proj"):
        check_experts("model.layers.0.mlp.experts", experts, 2)
    with pytest.raises(ValueError, match=r"is not a layout tpflow knows for experts: it needs 3-D gate_up_proj"):
        check_experts("model.layers.0.mlp", torch.nn.Linear(4, 4), 2)
