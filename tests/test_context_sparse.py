"""Context parallelism through sparse attention with an indexer (DeepSeek-V3.2's DSA; GLM-MoE-DSA, AXK2, dots.3,
HY-V4 with its shared indexer layers; Qwen4-Exp's over keys pooled in blocks, beside gated DeltaNets): each rank's
queries pick their top-k keys (or blocks) over the whole sequence, as one device picks, and attend to them (ring and
Ulysses). Against one device, fp64, a top-k of 4 keys out of 16 (Qwen4-Exp: 2 blocks of 4 and the open block's
tail), so the pick matters: the logits, the loss, every gradient and every parameter after two AdamW steps with
clipping, on whole and packed batches, at 2 and 4 ranks and 2 x 2 context x tensor; DeepSeek-V4's indexer, which pools
its keys before any mask or cache, is refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import tpflow as tpf
from tests import harness
from tests.test_context import _placement
from tests.test_context_mixers import SEQ, _batches, _same_training

pytest.importorskip("transformers")

TOP = 4  # keys each query picks, of SEQ
TYPES = ["deepseek_v32", "glm_moe_dsa", "axk2", "dots3_note", "hy_v4", "qwen4_exp_text"]


def _model(kind: str) -> torch.nn.Module:
    """The zoo's tiny ``kind`` in fp64, its indexer picking ``TOP`` keys with 2 heads of 16."""
    import transformers

    from tpflow.models.zoo import tiny_config

    config = tiny_config(kind)
    text = getattr(config, "text_config", config)
    text.index_topk, text.index_n_heads, text.index_head_dim = TOP, 2, 16
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager").double().train()


def _picks(model: torch.nn.Module) -> list[torch.Tensor]:
    """Record every indexer's picks (``[B, this rank's tokens, TOP]``; Qwen4-Exp's: ``[B, 1, this rank's tokens,
    SEQ]``, True at the picked positions)."""
    seen = []
    for m in model.modules():
        if "Indexer" in type(m).__name__:
            m.register_forward_hook(lambda mod, args, out: seen.append(out))
    return seen


def _sparse(kinds: list[str], tensor: int) -> None:
    """Each of ``kinds`` under the ring and Ulysses over the world (context x ``tensor``): its indexers pick among
    every rank's keys; trained alike on whole and packed batches."""
    from tpflow.ops import contiguous, head_tail

    world = dist.get_world_size()
    context = world // tensor
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(3))
    for kind_model in kinds:
        for kind in ("ring", "ulysses"):
            ref = _model(kind_model)
            model = tpf.parallelize(copy.deepcopy(ref), placement=_placement(tensor),
                                    plan=tpf.hf_plan(ref, context_parallel=kind))
            what = f"{kind_model} {kind}, context {context} x tensor {tensor}"
            picks = _picks(model)
            with torch.no_grad():
                model(ids, use_cache=False)
            shape = (2, 1, SEQ // context, SEQ) if picks[0].dtype == torch.bool else (2, SEQ // context, TOP)
            assert picks and all(p.shape == shape for p in picks), (what, picks)
            cut = (head_tail if kind == "ring" else contiguous)(context, SEQ)[dist.get_rank() // tensor]
            mine = {p for a, n in cut for p in range(a, a + n)}
            picked = [p.nonzero()[:, -1] if p.dtype == torch.bool else p.flatten() for p in picks]
            other = torch.tensor(float(bool(set(torch.cat(picked).tolist()) - mine)))
            dist.all_reduce(other)  # (Qwen4-Exp picks among the keys a query sees: Ulysses' first part sees its own)
            assert other > 0, what  # keys of other ranks picked
            for batch, kwargs in _batches(ids):
                _same_training(model, ref, ids, kwargs, f"{what}, {batch}")


def test_sparse_attention_matches_one_device_at_2_ranks():
    harness.run(2, _sparse, TYPES, 1, timeout=900)


def test_sparse_attention_matches_one_device_at_4_ranks_and_2_by_2():
    harness.run(4, _sparse, ["deepseek_v32", "hy_v4"], 1, timeout=900)
    harness.run(4, _sparse, ["glm_moe_dsa", "qwen4_exp_text"], 2, timeout=900)


def _refusal() -> None:
    from tpflow.models.zoo import tiny_model

    model = tiny_model("deepseek_v4")
    with pytest.raises(ValueError, match=r"DeepseekV4Attention\): a sparse-attention indexer tpflow does not split"):
        tpf.parallelize(model, placement=tpf.placement("cpu", ranks=[0, 1]),
                        plan=tpf.hf_plan(model, context_parallel="ring"))


def test_an_indexer_over_compressed_keys_is_refused_by_name():
    harness.run(2, _refusal)
