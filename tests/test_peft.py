"""PEFT's adapters and a parallelized model (issue 44): what runs, and what is refused rather than run unsplit."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import tpflow as tpf
from tests import harness
from tests.checks import all_ranks, within

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _wrapped_auto_rank() -> None:
    """parallelize(get_peft_model(model), plan="auto") found only the embedding and the head under PEFT's names and ran
    every layer whole on every rank, silently: it is refused on every rank, naming what was looked for."""
    from tests.models import tiny_lm

    wrapped = peft.get_peft_model(tiny_lm("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with within(30), pytest.raises(ValueError, match=r"plan='auto': PeftModel's plan names its layers "
                                                     r"\['model.layers.\*.self_attn.q_proj'.* none of its modules is "
                                                     r"so named .*base_model.model.model.layers.0"):
        tpf.parallelize(wrapped, placement=all_ranks(), plan="auto")
    assert not any(type(m).__name__ == "VocabParallelEmbedding" for m in wrapped.modules()), dist.get_rank()


@pytest.mark.parametrize("world", [1, 2])
def test_auto_plan_of_a_wrapped_model_is_refused_not_run_unsplit(world):
    harness.run(world, _wrapped_auto_rank)


def _split_adapters_rank() -> None:
    """get_peft_model(parallelized model, tpf.lora(config)): every adapter follows its base layer's layout, only the
    adapters train, and two AdamW steps with clipping give one device's losses, norms and every parameter."""
    import copy

    import torch

    from tests.models import VOCAB, tiny_lm, train_lm

    def config():
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                   "up_proj", "down_proj"])

    base = tiny_lm("llama", kv_heads=4)
    torch.manual_seed(3)
    reference = peft.get_peft_model(copy.deepcopy(base), config())
    with torch.no_grad():  # adapters that change the output from the first step (PEFT starts lora_B at zero)
        for i, (name, p) in enumerate(reference.named_parameters()):
            if "lora_B" in name:
                p.normal_(std=0.1, generator=torch.Generator().manual_seed(i))
    model = tpf.parallelize(copy.deepcopy(base), placement=all_ranks(), plan=tpf.hf_plan(base, vocab_parallel=False))
    torch.manual_seed(3)
    model = peft.get_peft_model(model, tpf.lora(config()))
    layer = model.base_model.model.model.layers[0]
    assert type(layer.self_attn.q_proj.lora_B["default"]).__name__ == "ColumnParallelLinear"
    assert type(layer.mlp.down_proj.lora_A["default"]).__name__ == "RowParallelLinear"
    with torch.no_grad():
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            if "lora_B" in name:
                p.copy_(tpf.tensor(q, placement=all_ranks(), sbp=tpf.get_sbp(p)))
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    with within(60):
        got = train_lm(model, ids)
    want = train_lm(reference, ids)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable), trainable
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-8, atol=1e-10, msg=name)
    tpf.check_replicas(model)


@pytest.mark.parametrize("world", [2, 4])
def test_lora_adapters_on_split_layers_train_as_one_device(world):
    harness.run(world, _split_adapters_rank)
