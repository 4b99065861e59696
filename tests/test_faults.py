"""Mistakes that used to hang or train on silently, on 2 and 4 ranks: each fails on every rank with its cause named.

Each case runs inside the pool's ranks under pytest.raises, so a rank that hung instead would fail the test by the
harness's timeout (not a timing assertion), and a rank that raised nothing fails it at once.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed as dist

import tpflow as tpf
from tests import harness
from tests.checks import all_ranks

transformers = pytest.importorskip("transformers")


def _tiny_llama() -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=4)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def _disagreeing_rank():
    rank, W, P = dist.get_rank(), dist.get_world_size(), all_ranks()
    odd = W - 1  # the rank that was given something else
    ref = _tiny_llama()
    plans = {  # what one rank changes: fused or not, the vocabulary split or not, sequence parallelism or not
        "fuse": ("model.layers.0.mlp.up_proj", {"model.layers.*.mlp.up_proj": tpf.ColumnParallel(fuse=False)}),
        "vocabulary": ("lm_head", {"lm_head": "colwise_rep"}),
    }
    for name, change in plans.values():
        plan = {**tpf.hf_plan(ref), **(change if rank == odd else {})}
        with pytest.raises(ValueError, match=rf"parallelize: the ranks disagree on the plan entry of '{name}' "
                                             rf"\(.*rank {odd}: .*\): call parallelize with the same model"):
            tpf.parallelize(copy.deepcopy(ref), placement=P, plan=plan)
    plan = tpf.hf_plan(ref, sequence_parallel=rank == odd)
    with pytest.raises(ValueError, match="parallelize: the ranks disagree on the plan entry of"):
        tpf.parallelize(copy.deepcopy(ref), placement=P, plan=plan)
    other = _tiny_llama()
    other.model.layers[0].mlp.up_proj = torch.nn.Linear(32, 64 + 8 * (rank == odd), bias=False)
    with pytest.raises(ValueError, match=r"the ranks disagree on the model \(.*digest"):
        tpf.parallelize(other, placement=P, plan={"*.mlp.up_proj": "column"})
    # tensor-parallel ranks fed different rows: a sampler over them, or unseeded ids
    model = tpf.parallelize(copy.deepcopy(ref), placement=P, plan="auto")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(int(rank == odd)))
    with pytest.raises(ValueError, match=rf"the tensor-parallel ranks {re.escape(str(list(range(W))))} were fed "
                                         rf"different inputs: "
                                         rf"'model.embed_tokens' read other values on ranks \[{odd}\]"):
        model(ids, labels=ids)
    same = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(7))
    model(same, labels=same).loss.backward()  # the same rows: it trains
    with tpf.config.override(check_inputs="off"):
        model(ids)  # checked no more: the switch is off
    if W == 4:  # 2 data-parallel rows of 2 tensor-parallel ranks: rows may differ, a row's ranks may not
        P2 = tpf.placement("cpu", [[0, 1], [2, 3]])
        model = tpf.parallelize(copy.deepcopy(ref), placement=P2, plan="auto")
        row = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank // 2))
        model(row, labels=row)
        bad = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(rank))  # a new shape: checked
        with pytest.raises(ValueError, match=r"the tensor-parallel ranks \[\d, \d\] were fed different inputs"):
            model(bad, labels=bad)


    # once cryptic: the fused head + loss of a head the plan left whole (its weight broadcast) computes
    model = tpf.parallelize(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 10)), placement=P,
                            plan={"0": "column"})
    reference = torch.nn.Linear(16, 10)
    reference.load_state_dict({k: v.full_tensor() for k, v in model[1].state_dict().items()})
    hidden, target = torch.randn(6, 16, generator=torch.Generator().manual_seed(3)), torch.arange(6)
    loss = tpf.linear_cross_entropy(hidden, model[1], target)
    loss.backward()
    loss_ref = torch.nn.functional.cross_entropy(reference(hidden), target)
    loss_ref.backward()
    torch.testing.assert_close(loss, loss_ref)
    torch.testing.assert_close(model[1].weight.grad.full_tensor(), reference.weight.grad)


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_that_disagree_fail_on_every_rank(world):
    harness.run(world, _disagreeing_rank, timeout=120)


def _pipeline_mistakes_rank():
    rank, W = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    blocks = [torch.nn.Linear(4, 4) for _ in range(W)]
    stages = [tpf.stage(b, stage_id=i, placement=tpf.placement("cpu", [i])) for i, b in enumerate(blocks)]
    odd = W - 1
    for name, change in (("micro_batches", {"micro_batches": 2 * W}), ("schedule", {"schedule": "gpipe"})):
        arguments = {"micro_batches": W, "schedule": "1f1b", **(change if rank == odd else {})}
        with pytest.raises(ValueError, match=rf"Pipeline: the ranks disagree on {name} \(.*rank {odd}: .*\): build "
                                             rf"the Pipeline with the same"):
            tpf.Pipeline(stages, loss_fn=torch.nn.functional.mse_loss, **arguments)
    pipe = tpf.Pipeline(stages, micro_batches=W, loss_fn=torch.nn.functional.mse_loss)
    x, y = torch.randn(2 * W, 4), torch.randn(2 * W - 2, 4)  # fewer target rows than input rows
    with pytest.raises(tpf.PipelineError, match="takes as many target rows as input rows"):
        pipe.step(x, y)


@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_mistakes_fail_on_every_rank(world):
    try:
        harness.run(world, _pipeline_mistakes_rank, timeout=60)
    finally:
        harness.discard(world)  # the failed step leaves sends that no rank will take
