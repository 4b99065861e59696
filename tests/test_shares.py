"""The share of a model's values each rank holds under ``plan="auto"``: the parts of the decoder layers a model's own
plan leaves out (HunYuan-dense's, DiffLlama's and Emu3's name the head alone, GraniteMoE's its experts alone,
DeepSeek-V3's its MLP alone) planned
by tpflow, exact against one device with each rank holding at most 1/W + 0.1 of the values, and what stays whole
named in the plan with why; complete plans unchanged."""

from __future__ import annotations

import pytest

from tests import harness
from tests.checks import all_ranks

transformers = pytest.importorskip("transformers")

FILLED = ("hunyuan_v1_dense", "emu3", "granitemoe", "deepseek_v3", "diffllama")


def _rank(kinds):
    from tpflow.models import check

    return {kind: check(kind, "tp", all_ranks()) for kind in kinds}


@pytest.mark.parametrize("world", [2, 4])
def test_layers_a_models_own_plan_leaves_out_split_exactly(world):
    """logits, loss, every gradient, every parameter after AdamW and generate's tokens match one device (``check``),
    and no rank holds more than 1/W + 0.1 of the values, but for DiffLlama's attention, whole and said why."""
    from tpflow.models.shares import SLACK

    got = harness.run(world, _rank, FILLED, timeout=600)[0]
    assert {kind: v.status for kind, v in got.items()} == dict.fromkeys(FILLED, "exact"), got
    for kind in FILLED[:-1]:
        assert got[kind].share <= 1 / world + SLACK and got[kind].whole == "", (kind, got[kind])
    diff = got["diffllama"]  # its MLP split; its attention, pairing heads half the heads apart, whole
    assert diff.share <= 1 / world + 0.34 * (1 - 1 / world) + SLACK, diff
    assert diff.whole.startswith("whole on every rank: model.layers.*.self_attn (33% of the values): "
                                 "DiffLlamaAttention norms 2 heads' features together (groupnorm)"), diff


def test_what_a_models_own_plan_leaves_out_is_planned_or_named():
    """No ranks needed: the plan says it. A complete plan is unchanged; what the planner cannot split in an attention
    (AFMoE's output gate) or cannot read (DBRX's fused q / k / v and packed experts) stays whole, named with why,
    beside what it splits; a latent attention gets DeepSeek-V2's entries."""
    import tpflow as tpf
    from tpflow.hf.left_out import with_left_out
    from tpflow.models.zoo import tiny_model

    for kind in ("llama", "qwen3_moe", "mixtral", "deepseek_v2", "phi3", "olmoe", "gemma2"):
        model = tiny_model(kind)
        assert with_left_out(model, dict(model.tp_plan)) == dict(model.tp_plan), kind
    hunyuan = tpf.hf_plan(tiny_model("hunyuan_v1_dense"))
    assert hunyuan["model.layers.*.self_attn"] == tpf.SplitHeads()
    assert hunyuan["model.layers.*.mlp.down_proj"] == tpf.RowParallel()
    afmoe = tpf.hf_plan(tiny_model("afmoe"))
    assert afmoe["model.layers.*.self_attn"].why.startswith("AfmoeAttention computes with gate_proj beside the q / k "
                                                            "/ v and output projections")
    assert not any(p.startswith("model.layers.*.self_attn.") for p in afmoe)
    deepseek = tpf.hf_plan(tiny_model("deepseek_v3"))  # latent attention, as DeepSeek-V2's plan splits it
    assert deepseek["model.layers.*.self_attn.kv_a_proj_with_mqa"] == tpf.LatentKeyValue()
    assert deepseek["model.layers.*.self_attn"] == tpf.SplitHeads()
    dbrx = tpf.hf_plan(tiny_model("dbrx"))  # its own plan names the head alone; its layers tpflow cannot read
    why = "the model's own plan leaves it out, and tpflow cannot read DbrxForCausalLM's layers"
    assert dbrx["transformer.blocks.*.ffn"] == dbrx["transformer.blocks.*.norm_attn_norm"] == tpf.Replicated(why=why)
    jamba = tpf.hf_plan(tiny_model("jamba"))  # its own plan names neither its attention, its MLP nor its mixer
    assert "model.layers.*.mamba" in jamba and jamba["model.layers.*.self_attn"] == tpf.SplitHeads()
    assert jamba["model.layers.*.feed_forward.down_proj"] == tpf.RowParallel()
