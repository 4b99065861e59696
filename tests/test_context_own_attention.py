"""Context parallelism through attention a model computes in its own code (``tpflow.hf.own_attention``): GPT-J's
(HeadColumns, rotary positions gathered), BLOOM's (ALiBi made again for every key), CodeGen's (four fused blocks),
GPT-1's (``Conv1D``, no mask), MegatronBERT's (the output projection beside the attention: ``attention.output``)
and RoFormer's (sinusoidal positions it counts from zero), head parallel over every rank of a 2 x 2 (context x
tensor) grid (the ring) or of 4 context ranks (Ulysses), by turns, trained with labels against one device: the
logits, the loss, every gradient and every parameter after two AdamW steps with clipping. A left-padded batch's mask
is made for the whole sequence by the model's own function, and packed documents are kept apart where one device
keeps them apart. Refused, on every rank: a model that makes no mask by transformers' functions, at its first
padded batch; a plan that does not run the heads over every rank, and Falcon's multi-query projection, at the plan;
XLM's mask of a rank's tokens at the first forward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import tpflow as tpf
from tests import harness
from tests.test_context_mixers import SEQ, _same_training

pytest.importorskip("transformers")

TYPES = ["gptj", "bloom", "codegen", "openai-gpt", "megatron-bert", "roformer"]


def _own_attention() -> None:
    from tpflow.models.zoo import tiny_model

    grid, flat = tpf.placement("cpu", [[0, 1], [2, 3]]), tpf.placement("cpu", ranks=[0, 1, 2, 3])
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(3))
    for i, kind in enumerate(TYPES):  # by turns: the ring on the grid, Ulysses over 4 context ranks
        for cut, P in ((("ring", grid), ("ulysses", flat))[i % 2],):
            ref = tiny_model(kind)
            model = tpf.parallelize(copy.deepcopy(ref), placement=P, plan=tpf.hf_plan(ref, context_parallel=cut))
            _same_training(model, ref, ids, {"labels": ids}, f"{kind} {cut}")
            if kind == "gptj":  # every rank holds a quarter of each projection: its heads
                q = model.transformer.h[0].attn.q_proj.weight
                assert q.to_local().shape[0] * 4 == q.shape[0], q.to_local().shape

    ref = tiny_model("gptj")  # left padding: the mask made for the whole sequence by transformers' function
    model = tpf.parallelize(copy.deepcopy(ref), placement=grid, plan=tpf.hf_plan(ref, context_parallel="ring"))
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[0, :5] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 5] = -100  # (nor the last pad's prediction of the first token: the shifted labels carry none)
    _same_training(model, ref, ids, {"labels": labels, "attention_mask": mask}, "gptj left-padded")

    positions = torch.arange(SEQ).remainder(SEQ // 2).expand(2, SEQ)  # two packed documents a row
    for kind in ("gptj", "megatron-bert"):  # kept apart as one device keeps them: GPT-J's mask by its positions,
        ref = tiny_model(kind)  # MegatronBERT's (which makes its mask without them) not
        model = tpf.parallelize(copy.deepcopy(ref), placement=grid, plan=tpf.hf_plan(ref, context_parallel="ring"))
        _same_training(model, ref, ids, {"labels": ids, "position_ids": positions}, f"{kind} packed")

    ref = tiny_model("openai-gpt")  # makes no mask by transformers' function: refused on every rank
    model = tpf.parallelize(copy.deepcopy(ref), placement=grid, plan=tpf.hf_plan(ref, context_parallel="ring"))
    with pytest.raises(ValueError, match=r"made its mask without transformers' create_causal_mask .* padding or "
                                         r"packed documents would be lost"):
        model(ids, labels=labels, attention_mask=mask)

    model = tiny_model("openai-gpt")  # a plan of its own that runs no heads over every rank: refused
    with pytest.raises(ValueError, match=r"the plan gives \['transformer.h.0.attn', .* none: each rank would attend "
                                         r"over its part of the sequence alone"):
        tpf.parallelize(model, placement=flat, plan={"transformer.h.*.attn": tpf.ContextParallel("ring")})

    with pytest.raises(ValueError, match=r"a multi-query projection \(Falcon's query_key_value"):
        tpf.hf_plan(tiny_model("falcon"), context_parallel="ring")

    ref = tiny_model("xlm")
    model = tpf.parallelize(copy.deepcopy(ref), placement=grid, plan=tpf.hf_plan(ref, context_parallel="ring"))
    with pytest.raises(ValueError, match=r"passes it mask \[2, 8\], not made for the whole sequence of 16 tokens"):
        model(ids)
    dist.barrier()


def test_attention_in_the_models_own_code_runs_head_parallel_and_matches_one_device():
    harness.run(4, _own_attention, timeout=900)
