"""Mistakes that used to hang or train on silently, on 2 and 4 ranks: each fails on every rank with its cause named.

Each case runs inside the pool's ranks under pytest.raises and ``tests.checks.within``: a rank that raised nothing
fails the test at once, and a rank still in a case after 30 s prints where it waits and exits, which fails the test
(a timeout, not a timing assertion).
"""

from __future__ import annotations

import copy
import os
import re

import pytest
import torch
import torch.distributed as dist

import tpflow as tpf
from tests import harness
from tests.checks import all_ranks, within
from tests.models import BackwardFails

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
        expected = rf"parallelize: the ranks disagree on the plan entry of '{name}' \(.*rank {odd}: .*\): call " \
                   "parallelize with the same model"
        with within(), pytest.raises(ValueError, match=expected):
            tpf.parallelize(copy.deepcopy(ref), placement=P, plan=plan)
    plan = tpf.hf_plan(ref, sequence_parallel=rank == odd)
    with within(), pytest.raises(ValueError, match="parallelize: the ranks disagree on the plan entry of"):
        tpf.parallelize(copy.deepcopy(ref), placement=P, plan=plan)
    other = _tiny_llama()
    other.model.layers[0].mlp.up_proj = torch.nn.Linear(32, 64 + 8 * (rank == odd), bias=False)
    with within(), pytest.raises(ValueError, match=r"the ranks disagree on the model \(.*digest"):
        tpf.parallelize(other, placement=P, plan={"*.mlp.up_proj": "column"})
    # tensor-parallel ranks fed different rows: a sampler over them, or unseeded ids
    model = tpf.parallelize(copy.deepcopy(ref), placement=P, plan="auto")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(int(rank == odd)))
    expected = rf"the tensor-parallel ranks {re.escape(str(list(range(W))))} were fed different inputs: " \
               rf"'model.embed_tokens' read other values on ranks \[{odd}\]"
    with within(), pytest.raises(ValueError, match=expected):
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
        expected = r"the tensor-parallel ranks \[\d, \d\] were fed different inputs"
        with within(), pytest.raises(ValueError, match=expected):
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


def _optimizer_settings_rank():
    """A plain loop's optimizer built with another learning rate, weight decay or betas on one rank (every weight is
    split: no copies to compare) stops at its first step on every rank, naming the setting and the ranks; built alike,
    two steps are one device's. ``check_replicas`` compares the settings as they are later (one rank's scheduler) and,
    over a data x tensor placement, each split block's owners."""
    rank, W = dist.get_rank(), dist.get_world_size()
    odd = W - 1
    ref = _tiny_llama()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(7))
    model = tpf.parallelize(copy.deepcopy(ref), placement=all_ranks(), plan="auto")
    for setting, value, other in (("lr", 1e-2, 2e-2), ("weight_decay", 0.1, 0.0), ("betas", (0.9, 0.999), (0.9, 0.99))):
        opt = torch.optim.AdamW(model.parameters(), **{setting: other if rank == odd else value})
        model(ids, labels=ids).loss.backward()
        expected = rf"optimizer: the ranks disagree on {setting} of param group 0 \(ranks? 0[0-9, ]*: " \
                   rf"{re.escape(str(value))}; rank {odd}: {re.escape(str(other))}\): build the optimizer with the same"
        with within(), pytest.raises(ValueError, match=expected):
            opt.step()  # refused before it changes a parameter
        model.zero_grad()
    # eps: a near-zero gradient's rounding must not become a whole lr-sized step (as tests.models.train_lm)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    reference = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    with within(60):
        for m, o in ((model, opt), (ref, reference)):
            for _ in range(2):
                m(ids, labels=ids).loss.backward()
                o.step()
                o.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q, msg=name)
    opt.param_groups[0]["lr"] = 5e-3 if rank == odd else 1e-2  # a scheduler stepped on one rank only
    with within(), pytest.raises(ValueError, match=rf"check_replicas: the optimizers of the model: the ranks disagree "
                                                   rf"on lr of param group 0 \(.*rank {odd}: 0.005\)"):
        tpf.check_replicas(model)
    opt.param_groups[0]["lr"] = 1e-2
    tpf.check_replicas(model)
    if W == 4:  # 2 data-parallel rows of 2 tensor-parallel ranks: each block has a copy in the other row
        model = tpf.parallelize(copy.deepcopy(ref), placement=tpf.placement("cpu", [[0, 1], [2, 3]]), plan="auto")
        tpf.check_replicas(model)
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight.to_local().add_(1e-3 * (rank == 3))
        with within(), pytest.raises(ValueError, match=r"check_replicas: 'model.layers.0.mlp.down_proj.weight' is "
                                                       r"broadcast over ranks \[1, 3\] but its copies differ"):
            tpf.check_replicas(model)


@pytest.mark.parametrize("world", [2, 4])
def test_optimizer_settings_that_differ_between_ranks_fail_on_every_rank(world):
    harness.run(world, _optimizer_settings_rank, timeout=120)


def _pipeline_mistakes_rank():
    rank, W = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    blocks = [torch.nn.Linear(4, 4) for _ in range(W)]
    stages = [tpf.stage(b, stage_id=i, placement=tpf.placement("cpu", [i])) for i, b in enumerate(blocks)]
    odd = W - 1
    for name, change in (("micro_batches", {"micro_batches": 2 * W}), ("schedule", {"schedule": "gpipe"})):
        arguments = {"micro_batches": W, "schedule": "1f1b", **(change if rank == odd else {})}
        expected = rf"Pipeline: the ranks disagree on {name} \(.*rank {odd}: .*\): build the Pipeline with the same"
        with within(), pytest.raises(ValueError, match=expected):
            tpf.Pipeline(stages, loss_fn=torch.nn.functional.mse_loss, **arguments)
    pipe = tpf.Pipeline(stages, micro_batches=W, loss_fn=torch.nn.functional.mse_loss)
    x, y = torch.randn(2 * W, 4), torch.randn(2 * W - 2, 4)  # fewer target rows than input rows
    with within(), pytest.raises(tpf.PipelineError, match="takes as many target rows as input rows"):
        pipe.step(x, y)


@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_mistakes_fail_on_every_rank(world):
    try:
        harness.run(world, _pipeline_mistakes_rank, timeout=60)
    finally:
        harness.discard(world)  # the failed step leaves sends that no rank will take


class _FailsOnOneRank(torch.nn.Module):
    """The identity, but on rank ``rank`` while ``armed`` it raises in its forward (or in its output's backward)."""

    def __init__(self, rank, backward):
        super().__init__()
        self.rank, self.backward, self.armed = rank, backward, True

    def forward(self, x):
        if self.armed and dist.get_rank() == self.rank:
            if self.backward:
                return BackwardFails.apply(x)
            raise RuntimeError("a forward that fails on one rank")
        return x


def _one_device_check(pipe, ref, x, y):
    """Two SGD steps of ``pipe`` against the one-device ``ref``: the loss, every gradient and parameter."""
    opt, opt_ref = torch.optim.SGD(pipe.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        opt_ref.zero_grad()
        loss = pipe.step(x, y)
        ref_loss = torch.nn.functional.mse_loss(ref(x), y)
        ref_loss.backward()
        if loss is not None:
            torch.testing.assert_close(loss, ref_loss.detach())
        for p, q in zip(pipe.parameters(), ref.parameters(), strict=True):
            if dist.get_rank() in tpf.get_placement(p):
                torch.testing.assert_close(p.grad.full_tensor(), q.grad)
        opt.step()
        opt_ref.step()
    for p, q in zip(pipe.parameters(), ref.parameters(), strict=True):
        if dist.get_rank() in tpf.get_placement(p):
            torch.testing.assert_close(p.full_tensor(), q.detach())


def _multi_rank_stage_fails(backward, schedule):
    """Two stages, one of them (or both) data parallel on two ranks: on 3 ranks [0] and [1, 2] with rank 2 failing,
    on 4 ranks [0, 1] and [2, 3] with rank 1 failing. Then a Pipeline built anew over the same stages trains as one
    device does."""
    W = dist.get_world_size()
    sets, odd = ([[0], [1, 2]], 2) if W == 3 else ([[0, 1], [2, 3]], 1)
    torch.manual_seed(0)
    failing = _FailsOnOneRank(odd, backward)
    blocks = [torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh()), torch.nn.Linear(6, 3)]
    blocks[0 if odd in sets[0] else 1] = torch.nn.Sequential(blocks[0 if odd in sets[0] else 1], failing)
    ref = copy.deepcopy(torch.nn.Sequential(*blocks))
    ref.apply(lambda m: setattr(m, "armed", False) if isinstance(m, _FailsOnOneRank) else None)
    stages = [tpf.stage(b, stage_id=k, placement=tpf.placement("cpu", sets[k]),
                        sbp=tpf.sbp.split(0) if len(sets[k]) > 1 else None) for k, b in enumerate(blocks)]
    pipe = tpf.Pipeline(stages, micro_batches=4, schedule=schedule, loss_fn=torch.nn.functional.mse_loss)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)
    with within(), pytest.raises(tpf.PipelineError) as caught:
        pipe.step(x, y)
    with pytest.raises(tpf.PipelineError, match="an earlier step failed .*build a new Pipeline over the stages"):
        pipe.step(x, y)
    failing.armed = False  # the cause is fixed: a new pipeline over the same stages runs as one device
    _one_device_check(tpf.Pipeline(stages, micro_batches=4, schedule=schedule,
                                   loss_fn=torch.nn.functional.mse_loss), ref, x, y)
    return str(caught.value)


def _multi_rank_stage_cases(cases):
    return [_multi_rank_stage_fails(backward, schedule) for backward, schedule in cases]


@pytest.mark.parametrize("world, cases", [(3, [(False, "1f1b"), (True, "zb-h1")]),
                                          (4, [(False, "gpipe"), (True, "1f1b")])])
def test_one_rank_of_a_multi_rank_stage_fails(world, cases):
    try:
        results = harness.run(world, _multi_rank_stage_cases, cases, timeout=120)
    finally:
        harness.discard(world)
    stage, odd = (1, 2) if world == 3 else (0, 1)
    ranks = [1, 2] if world == 3 else [0, 1]
    for texts in results:
        for (backward, _), text in zip(cases, texts, strict=True):
            action = "B0" if backward else "F0"
            error = "FloatingPointError: a backward that fails" if backward else "RuntimeError: a forward that fails"
            assert f"stage {stage} (ranks {ranks}) failed on {action} (rank {odd}): {error}" in text, text


class _Dies(torch.nn.Module):
    """The identity, whose process exits (as a killed rank's) on its ``at``-th call."""

    def __init__(self, at):
        super().__init__()
        self.calls, self.at = 0, at

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at:
            os._exit(3)
        return x


def _a_rank_dies(sets, dead):
    torch.manual_seed(0)
    blocks = [torch.nn.Linear(4, 4) for _ in sets]
    k = next(k for k, ranks in enumerate(sets) if dead in ranks)
    if dist.get_rank() == dead:  # in the second step's second micro-batch
        blocks[k] = torch.nn.Sequential(blocks[k], _Dies(at=6))
    stages = [tpf.stage(b, stage_id=k, placement=tpf.placement("cpu", sets[k]),
                        sbp=tpf.sbp.split(0) if len(sets[k]) > 1 else None) for k, b in enumerate(blocks)]
    pipe = tpf.Pipeline(stages, micro_batches=4, loss_fn=torch.nn.functional.mse_loss)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipe.step(x, y)
    with within(), pytest.raises(tpf.PipelineError) as caught:
        pipe.step(x, y)
    raise RuntimeError(f"survived: {caught.value}")  # the harness reports it


@pytest.mark.parametrize("sets, dead", [([[0], [1], [2]], 1), ([[0], [1, 2]], 2)], ids=["one-rank", "two-rank"])
def test_a_rank_that_dies_is_named_on_every_other_rank(sets, dead):
    world = sum(map(len, sets))
    try:
        with pytest.raises(AssertionError) as caught:
            harness.run(world, _a_rank_dies, sets, dead, timeout=60)
    finally:
        harness.discard(world)
    report = str(caught.value)
    assert f"rank {dead} died" in report, report
    for rank in range(world):
        if rank == dead:
            continue
        part = report.split(f"--- rank {rank} ---")[1].split("--- rank")[0]
        found = re.search(r"survived: stage \d \(ranks \[[\d, ]+\]\) failed on \w+\d( \(rank \d\))?: "
                          r"(PeerDied: rank \d of stage \d died or closed its connection|a peer rank died or closed "
                          r"its connection)", part)
        assert found, part
