"""The support matrix (``python -m tpflow.models``, ``docs/models.md``): a representative set of model types, one for
each mechanism the matrix reports, checked on 2 and 4 ranks gives the statuses the committed matrix records; the
matrix covers transformers' whole causal-LM registry at the installed version."""

from __future__ import annotations

import re

import pytest

from tests import harness
from tests.checks import all_ranks
from tests.harness import ROOT

transformers = pytest.importorskip("transformers")

MATRIX = ROOT / "docs" / "models.md"
REPRESENTATIVE = {
    2: ("llama",            # transformers' plan; context and expert parallelism
        "phi3",             # fused q / k / v under context parallelism
        "qwen3_next",       # a hybrid: its mixers read a replicated weight outside its module; context head parallel
        "deepseek_v2",      # MLA: mla_kv_a_proj
        "granite_swa",      # local_params, sinks split with the heads
        "minimax",          # lightning attention split by heads, its norm over every head; context head parallel
        "doge",             # a per-head projection: tensor refused; a mask of its own: context refused
        "mixtral",          # experts split or shared out
        "llama4_text",      # experts taking sorted rows, stored transposed without saying so
        "nemotron_h",       # ungated experts (up_proj); a hybrid: context head parallel
        "opt",              # tpflow's own plan (SplitHeads)
        "bert",             # tpflow's own plan, BERT's layout and its head's tied bias
        "persimmon",        # fused q / k / v viewed head by head
        "bloom",            # fused by head, ALiBi biases cut to the rank's heads
        "gpt2",             # tpflow's own plan: Conv1D, q | k | v fused as blocks
        "gpt_bigcode",      # a multi-query fused c_attn (MultiQueryColumns)
        "mpt",              # q | k | v blocks split in place (BlocksParallel), position_bias cut to the heads
        "codegen",          # four model-parallel blocks of q | v | k, its out_proj reading them (SplitHeads(groups))
        "gemma3n_text",     # activation sparsity: those MLPs whole; layers reusing another's keys and values
        "gemma4",           # reads its embedding's weight itself: the vocabulary stays whole
        "mamba"),           # a state space split by channels (Mamba-1: ScanChannels)
    4: ("mimo_v2_flash",    # a layer's own key/value head count, fewer than the ranks in others
        "olmo2",            # gathered q / k / v beside fewer key/value heads than ranks
        "stablelm",         # tpflow's own plan, k / v kept whole with fewer key/value heads than ranks
        "falcon",           # multi-query, one query head per rank, ALiBi off
        "gpt2"),
}


RATIOS = ROOT / "docs" / "models-ratios.md"
# at their real ratios: latent attention with keys wider than values beside 8 experts a token; one key/value head
# (fewer than the ranks) beside 8 experts a token; zero experts beside both
REPRESENTATIVE_RATIOS = ("deepseek_v3", "qwen3_moe", "longcat_flash")


def _rank(kinds, modes, ratios=False):
    import tpflow.models

    return {(kind, mode): tpflow.models.check(kind, mode, all_ranks(), ratios).status for kind in kinds
            for mode in modes}


@pytest.mark.parametrize("world", sorted(REPRESENTATIVE))
def test_representative_models_match_the_committed_matrix(world):
    from tpflow.models.check import MODES
    from tpflow.models.report import read_matrix

    recorded = read_matrix(MATRIX.read_text())
    got = harness.run(world, _rank, REPRESENTATIVE[world], [m for m in MODES if m != "hf"], timeout=600)[0]
    differ = {key: (status, recorded.get((*key, world))) for key, status in got.items()
              if recorded.get((*key, world)) != status}
    assert not differ, f"{world} ranks, (now, docs/models.md): {differ}; run python -m tpflow.models --out " \
                       f"docs/models.md"


def test_matrix_covers_the_registry_at_this_version():
    from tpflow.models.report import read_matrix
    from tpflow.models.zoo import causal_lm_types

    text = MATRIX.read_text()
    assert f"transformers {transformers.__version__}" in text, "docs/models.md was made with another transformers"
    assert {kind for kind, _, _ in read_matrix(text)} == set(causal_lm_types())
    rows = re.findall(r"^\| (\S+) \|", text, re.M)
    matrix = read_matrix(text)
    assert "wrong" not in {s for (_, mode, _), s in matrix.items() if mode != "hf"}, "a silently wrong number"
    assert len(rows) >= len(causal_lm_types())
    behind = sorted(key for key, s in matrix.items() if key[1] == "hf" and s == "exact"
                    and matrix[key[0], "tp", key[2]] != "exact")
    assert not behind, f"transformers' own tensor parallelism is exact where tpflow's is not: {behind}"


def test_real_ratios_match_their_committed_matrix():
    """``python -m tpflow.models --ratios`` (``docs/models-ratios.md``): every type whose real ratios the tiny config
    hides, none silently wrong under tpflow's modes; representative ones checked again on 2 ranks give its statuses."""
    from tpflow.models.check import MODES
    from tpflow.models.report import read_matrix
    from tpflow.models.zoo import ratio_types

    text = RATIOS.read_text()
    assert f"transformers {transformers.__version__}" in text, "docs/models-ratios.md: made with another transformers"
    matrix = read_matrix(text)
    assert {kind for kind, _, _ in matrix} == set(ratio_types())
    assert "wrong" not in {s for (_, mode, _), s in matrix.items() if mode != "hf"}, "a silently wrong number"
    got = harness.run(2, _rank, REPRESENTATIVE_RATIOS, [m for m in MODES if m != "hf"], True, timeout=600)[0]
    differ = {key: (status, matrix.get((*key, 2))) for key, status in got.items() if matrix.get((*key, 2)) != status}
    assert not differ, f"(now, docs/models-ratios.md): {differ}; run python -m tpflow.models --ratios --out " \
                       f"docs/models-ratios.md"


def _export_rank(kinds):
    """A model tpflow plans, trained a step, saved by save_pretrained on every rank: from_pretrained on one device
    holds its values and gives its logits (GPT-2's Conv1D blocks, q | k | v fused, in their checkpoint layout)."""
    import copy
    import tempfile

    import torch
    import torch.distributed as dist

    import tpflow as tpf
    from tpflow.models.zoo import VOCAB, tiny_model

    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    for kind in kinds:
        model = tpf.parallelize(copy.deepcopy(tiny_model(kind)), placement=all_ranks(), plan="auto")
        model(ids, labels=ids).loss.backward()
        torch.optim.AdamW(model.parameters(), lr=1e-2).step()
        whole = {name: p.full_tensor() for name, p in model.named_parameters()}
        logits = model(ids).logits.full_tensor()
        where = [tempfile.mkdtemp(prefix="tpflow-models-")]
        dist.broadcast_object_list(where)
        model.save_pretrained(where[0])
        if dist.get_rank() == 0:
            back = transformers.AutoModelForCausalLM.from_pretrained(where[0], dtype=torch.float64)
            for name, p in back.named_parameters():
                assert torch.equal(p, whole[name]), f"{kind}: {name} exported"
            torch.testing.assert_close(back(ids).logits, logits, rtol=1e-9, atol=1e-9, msg=f"{kind}: logits")
        dist.barrier()


def test_planned_models_export_in_their_own_layout():
    harness.run(2, _export_rank, ("gpt2", "bert", "persimmon", "gpt_bigcode", "codegen"), timeout=300)


def test_tpflows_own_plans_on_one_rank_match_one_device():
    """World size 1 (the matrix's degrees are 2 and 4): tpflow's planned layouts, the experts' new layouts and MLA's
    entry, and attention in a model's own code run head parallel (BLOOM's, CodeGen's), are exact on one rank too."""
    from tpflow.models.check import MODES

    got = harness.run(1, _rank, ("gpt2", "bert", "bloom", "llama4_text", "nemotron_h", "deepseek_v2", "gpt_bigcode",
                                 "codegen"), [m for m in MODES if m != "hf"], timeout=300)[0]
    assert {key: s for key, s in got.items() if s not in ("exact", "n/a")} == {("llama4_text", "ep"): "refused"}, got


def test_own_plans_say_what_stays_whole_and_refuse_by_name():
    """What tpflow's plans keep whole is said in the plan (a state space, an MLP with activation sparsity); what
    they cannot split is a sentence naming it and the way out (no ranks needed: the plan is read before any)."""
    import tpflow as tpf
    from tpflow.hf.selective_scan import ScanChannels
    from tpflow.hf.styles import hf_style
    from tpflow.models.zoo import tiny_config, tiny_model

    plan = tpf.hf_plan(tiny_model("mamba"))
    assert plan["backbone.layers.*.mixer"] == ScanChannels()  # (Mamba-1 mixers split by channels)
    assert isinstance(plan["backbone.embeddings"], tpf.VocabParallel)
    gemma3n = tpf.hf_plan(tiny_model("gemma3n_text"))
    assert "activation sparsity" in gemma3n["model.layers.0.mlp"].why
    assert "model.layers.0.mlp.gate_proj" not in gemma3n and "model.layers.2.mlp.gate_proj" in gemma3n
    bigcode = tpf.hf_plan(tiny_model("gpt_bigcode"))
    assert bigcode["transformer.h.*.attn.c_attn"] == tpf.MultiQueryColumns(16)
    codegen = tpf.hf_plan(tiny_model("codegen"))
    assert codegen["transformer.h.*.attn"] == tpf.SplitHeads(groups=4)
    assert codegen["transformer.h.*.attn.out_proj"] == tpf.BlocksParallel("row", 4)

    sparse = transformers.AutoModelForCausalLM.from_config(tiny_config("big_bird").__class__(
        **{**tiny_config("big_bird").to_dict(), "attention_type": "block_sparse"}))
    with pytest.raises(ValueError, match=r"bert.encoder.layer.0 \(BigBirdLayer\) runs block-sparse "
                                         r"attention.*attention_type='original_full'"):
        tpf.hf_plan(sparse)
    gemma4 = tiny_model("gemma4")
    with pytest.raises(ValueError, match=r"vocab_parallel=True: Gemma4Model's forward reads "
                                         r"model.language_model.embed_tokens.weight itself"):
        tpf.hf_plan(gemma4, vocab_parallel=True)
    assert not any(isinstance(e, tpf.VocabParallel) for e in tpf.hf_plan(gemma4).values())
    with pytest.raises(ValueError, match=r"'all_reduce' splits the module's own parameters.*tpf.SummedParameters"):
        hf_style("layers.*.mlp.shared_experts", "all_reduce")
    with pytest.raises(ValueError, match=r"XLNetLMHeadModel carries no tensor-parallel plan.*transformer.layer.0 "
                                         r"\(XLNetLayer\) has no attention with separate q / k / v"):
        tpf.hf_plan(tiny_model("xlnet"))
    with pytest.raises(ValueError, match=r"sequence_parallel=True runs the layers on each rank's tokens.*"
                                         r"model.layers.0.attn_sconv \(InklingShortConvolution\)"):  # (kept whole)
        tpf.hf_plan(tiny_model("inkling_text"), sequence_parallel=True)
    with pytest.raises(ValueError, match=r"sequence_parallel=True: transformer.h.\*.attn.c_attn \(MultiQueryColumns"):
        tpf.hf_plan(tiny_model("gpt_bigcode"), sequence_parallel=True)
    falcon = tiny_config("falcon")
    alibi = transformers.AutoModelForCausalLM.from_config(type(falcon)(**{**falcon.to_dict(), "alibi": True}))
    with pytest.raises(ValueError, match=r"self_attention \(FalconAttention\) takes ALiBi biases its model folds"):
        tpf.hf_plan(alibi)


def test_new_layouts_on_three_ranks_are_exact_or_refused():
    """3 ranks (the matrix's degrees are 2 and 4): heads, blocks and intermediate sizes that do not split over 3 are
    refused by name; what splits is exact (logits, loss, every gradient, every parameter after AdamW, tokens)."""
    kinds = ("gpt_bigcode", "falcon", "mpt", "codegen", "inkling_text", "longcat_flash", "deepseek_v2", "mamba",
             "gemma3n_text")
    got = harness.run(3, _rank, kinds, ("tp",), timeout=600)[0]
    assert {key: s for key, s in got.items() if s not in ("exact", "refused")} == {}, got
