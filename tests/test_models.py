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
        "qwen3_next",       # a hybrid: its mixers read a replicated weight outside its module; context refused
        "deepseek_v2",      # MLA: mla_kv_a_proj
        "granite_swa",      # local_params, sinks split with the heads
        "minimax",          # lightning attention: context refused
        "doge",             # a per-head projection: tensor refused; a mask of its own: context refused
        "mixtral",          # experts split or shared out
        "llama4_text",      # experts taking sorted rows, stored transposed without saying so
        "nemotron_h",       # ungated experts (up_proj); a hybrid: context refused
        "opt",              # tpflow's own plan (SplitHeads)
        "bert",             # tpflow's own plan, BERT's layout and its head's tied bias
        "persimmon",        # fused q / k / v viewed head by head
        "bloom",            # fused by head, ALiBi biases cut to the rank's heads
        "gpt2",             # tpflow's own plan: Conv1D, q | k | v fused as blocks
        "gpt_bigcode",      # a multi-query fused c_attn: refused
        "mamba"),           # a state space: refused
    4: ("mimo_v2_flash",    # a layer's own key/value head count, fewer than the ranks in others
        "olmo2",            # gathered q / k / v beside fewer key/value heads than ranks
        "stablelm",         # tpflow's own plan, k / v kept whole with fewer key/value heads than ranks
        "gpt2"),
}


def _rank(kinds, modes):
    import tpflow.models

    return {(kind, mode): tpflow.models.check(kind, mode, all_ranks()).status for kind in kinds for mode in modes}


@pytest.mark.parametrize("world", sorted(REPRESENTATIVE))
def test_representative_models_match_the_committed_matrix(world):
    from tpflow.models.check import MODES
    from tpflow.models.report import read_matrix

    recorded = read_matrix(MATRIX.read_text())
    got = harness.run(world, _rank, REPRESENTATIVE[world], MODES, timeout=600)[0]
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
    assert "wrong" not in {s for s in read_matrix(text).values()}, "a silently wrong number in the matrix"
    assert len(rows) >= len(causal_lm_types())


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
    harness.run(2, _export_rank, ("gpt2", "bert", "persimmon"), timeout=300)


def test_tpflows_own_plans_on_one_rank_match_one_device():
    """World size 1 (the matrix's degrees are 2 and 4): tpflow's planned layouts, the experts' new layouts and MLA's
    entry are exact on one rank too."""
    from tpflow.models.check import MODES

    got = harness.run(1, _rank, ("gpt2", "bert", "bloom", "llama4_text", "nemotron_h", "deepseek_v2"), MODES,
                      timeout=300)[0]
    assert {key: s for key, s in got.items() if s not in ("exact", "n/a")} == {
        ("llama4_text", "ep"): "refused", ("nemotron_h", "cp"): "refused", ("bloom", "cp"): "refused"}, got
