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
