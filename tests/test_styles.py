"""Plan entries that apply themselves: a user's own ``tpf.Style`` (the one docs/layers-and-plans.md writes) and torch's
own styles in the shape of torchtitan's Llama ``apply_tp``, each against one device: the loss, every parameter's
gradient and every parameter after AdamW steps, on 1 to 4 ranks (the user's on uneven features); and torch's styles
tpflow cannot honour refused before the model changes."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

import tpflow as tpf
from tests import harness
from tests.checks import all_ranks
from tests.harness import ROOT
from tests.models import TitanLlama


def titan_plan(loss_parallel: bool) -> dict:
    """torchtitan's ``apply_tp`` for Llama (sequence parallel), written as it writes it: the model's plan and each
    block's, here one dict."""
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    layer_plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    return {**plan, **{f"layers.*.{name}": style for name, style in layer_plan.items()}}


def plain_plan() -> dict:
    """The same model without sequence parallelism, as torch's tutorial plans it."""
    return {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
            "layers.*.attention.w[qkv]": ColwiseParallel(), "layers.*.attention.wo": RowwiseParallel(),
            "layers.*.feed_forward.w[13]": ColwiseParallel(), "layers.*.feed_forward.w2": RowwiseParallel()}


PLANS = {"sequence-parallel": lambda: titan_plan(False), "loss-parallel": lambda: titan_plan(True),
         "plain": plain_plan}


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _trains_like_one_device(model: nn.Module, reference: nn.Module, batch: torch.Tensor, loss_of, steps: int = 2):
    """AdamW steps of ``model`` and ``reference`` side by side: the losses, every gradient and every parameter after
    each step equal one device's."""
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (model, reference))
    for step in range(steps):
        loss, ref_loss = loss_of(model, batch, tpf.cross_entropy), loss_of(reference, batch, F.cross_entropy)
        torch.testing.assert_close(_whole(loss), ref_loss, msg=f"step {step}: the loss")
        loss.backward()
        ref_loss.backward()
        pairs = list(zip(model.named_parameters(), reference.named_parameters(), strict=True))
        for (name, p), (_, r) in pairs:
            torch.testing.assert_close(_whole(p.grad), r.grad, msg=f"step {step}: the gradient of {name}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for (name, p), (_, r) in pairs:
            torch.testing.assert_close(_whole(p.detach()), r.detach(), msg=f"step {step}: {name} after AdamW")
        tpf.check_replicas(model)  # the broadcast parameters' copies bit for bit alike


def _lm_loss(model: nn.Module, ids: torch.Tensor, cross_entropy) -> torch.Tensor:
    return cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _titan_rank(variant: str) -> None:
    torch.manual_seed(0)
    model = TitanLlama().double()  # the same on every rank
    reference = copy.deepcopy(model)
    tpf.parallelize(model, placement=all_ranks(), plan=PLANS[variant]())
    assert isinstance(model.layers["0"].attention.wq, tpf.ColumnParallelLinear)
    assert isinstance(model.tok_embeddings, tpf.VocabParallelEmbedding)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    _trains_like_one_device(model, reference, ids, _lm_loss)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("variant", sorted(PLANS))
def test_torchtitan_plan_runs_on_tpflow_layers(world, variant):
    if world == 1 and variant != "loss-parallel":
        pytest.skip("one rank: the variants differ only in their collectives")
    harness.run(world, _titan_rank, variant)


def documented_style() -> dict:
    """The namespace of docs/layers-and-plans.md's snippet that writes a ``tpf.Style`` from scratch."""
    text = (ROOT / "docs" / "layers-and-plans.md").read_text()
    code = next(block for block in re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
                if "(tpf.Style)" in block)
    namespace: dict = {"__name__": __name__}  # dataclasses look their module up
    exec(code, namespace)
    return namespace


def _mlp_loss(model: nn.Module, x: torch.Tensor, cross_entropy) -> torch.Tensor:
    return model(x).square().mean()


def _user_style_rank() -> None:
    ScaledGradient = documented_style()["ScaledGradient"]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 23), nn.GELU(), nn.Linear(23, 12), nn.Linear(12, 5)).double()  # uneven
    reference = copy.deepcopy(model)
    reference[3] = ScaledGradient(0.25).apply("3", reference[3], None)  # one device: the same layer, unsplit
    tpf.parallelize(model, placement=all_ranks(), plan={"0": "column", "2": "row", "3": ScaledGradient(0.25)})
    assert type(model[3]) is type(reference[3]) and tpf.get_sbp(model[3].weight) == (tpf.sbp.broadcast,)
    x = torch.randn(6, 12, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    _trains_like_one_device(model, reference, x, _mlp_loss, steps=3)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_a_style_users_write_runs_like_a_builtin_one(world):
    harness.run(world, _user_style_rank)


class _Refuses(tpf.Style):
    def check(self, name, module, plan):
        raise ValueError(f"{name!r}: refused")

    def apply(self, name, module, plan):
        raise AssertionError("apply after a failed check")


def _refusals_rank() -> None:
    placement = all_ranks()
    refused = {
        "tpflow does not": ({"tok_embeddings": ColwiseParallel()}, "'vocab'"),
        "PrepareModuleOutput": ({"layers.*.attention": PrepareModuleOutput(output_layouts=Replicate(),
                                                                            desired_output_layouts=Shard(1))},
                                "GatherSequence"),
        "turns Shard(dim=1) into Shard(dim=0)": ({"norm": PrepareModuleInput(input_layouts=(Shard(1),),
                                                                desired_input_layouts=(Shard(0),))}, "tpflow gathers"),
        "refused": ({"layers.*.attention.wq": "column", "output": _Refuses()}, "'output'"),
    }
    for what, (plan, fix) in refused.items():
        torch.manual_seed(0)
        model = TitanLlama()
        before = {name: type(m) for name, m in model.named_modules()}
        with pytest.raises(ValueError) as error:
            tpf.parallelize(model, placement=placement, plan=plan)
        message = str(error.value)
        assert what in message and fix in message, message
        assert {name: type(m) for name, m in model.named_modules()} == before, f"{what}: the model changed"
        assert not any(isinstance(p, DTensor) for p in model.parameters()), f"{what}: a parameter changed"


def test_torch_styles_tpflow_cannot_honour_are_refused_before_any_change():
    harness.run(2, _refusals_rank)


class _TwoHeads(nn.Module):
    """A model whose own loss reads its second vocabulary head's logits."""

    def __init__(self) -> None:
        super().__init__()
        self.h1, self.h2 = nn.Linear(8, 10, bias=False), nn.Linear(8, 10, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.h1(x)
        return F.cross_entropy(self.h2(x), y)


def _entries_apply_alike_rank() -> None:
    """What the driver shares between entries: every vocabulary head routes the model's own loss; a module shared
    under two names takes its gradient rule under both; fused groups and the layers' options are checked before any
    change, on a named placement too; torch's keyword-only input preparation is read."""
    placement = all_ranks()
    torch.manual_seed(0)
    heads = _TwoHeads()
    reference = copy.deepcopy(heads)
    tpf.parallelize(heads, placement=placement, plan={"h*": "vocab"})
    x, y = torch.randn(4, 8), torch.randint(0, 10, (4,))
    torch.testing.assert_close(heads(x, y), reference(x, y))

    norm = nn.LayerNorm(4)
    shared = nn.ModuleDict({"a": nn.Sequential(norm), "b": nn.Sequential(norm)})
    tpf.parallelize(shared, placement=placement,
                    plan={"b.0": tpf.Replicated(grads="partial"), "a.0": tpf.Replicated(grads="partial")})
    from tpflow.layers.replicated import replicated_grads
    assert replicated_grads(shared.a[0]) == "partial"

    def attention() -> nn.Module:
        attn = nn.Module()
        attn.q_proj, attn.k_proj = nn.Linear(8, 8), nn.Linear(6, 4)
        return nn.ModuleDict({"attn": attn})

    named = tpf.placement("cpu", [[r] for r in range(dist.get_world_size())], names=("dp", "tp"))
    for where in (placement, named):
        model = attention()
        with pytest.raises(ValueError, match="fuse=True joins"):
            tpf.parallelize(model, placement=where, plan={"attn.[qk]_proj": tpf.ColumnParallel(fuse=True)})
        assert type(model.attn.q_proj) is nn.Linear
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    with pytest.raises(ValueError, match="needs sequence_parallel=True"):
        tpf.parallelize(model, placement=placement, plan={"0": "column", "1": tpf.RowParallel(algo="ring")})
    assert type(model[0]) is nn.Linear, "the column layer was built before the row entry's options were checked"

    from tpflow.plans.torch_styles import from_torch
    gather = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                desired_input_kwarg_layouts={"hidden_states": Replicate()})
    assert from_torch("attn", gather, nn.Identity()) == tpf.GatherSequence(sequence_dim=1)
    with pytest.raises(ValueError, match="output head"):
        from_torch("wq", ColwiseParallel(use_local_output=False), nn.Linear(4, 4))


def test_entries_share_what_they_must_and_check_before_any_change():
    harness.run(2, _entries_apply_alike_rank)


def test_entries_said_in_sbp_are_the_entries_their_flags_say():
    """``input_sbp=`` / ``output_sbp=`` (``hidden_sbp=``) and the older flags, their aliases, give one entry: equal,
    one hash, one repr, one ``asdict``; ``dataclasses.replace`` with the flags still works; the SBPs read back from
    either spelling; an SBP the entry cannot take, or one beside a flag that says otherwise, is refused by name."""
    S, B = tpf.sbp.split, tpf.sbp.broadcast
    spellings = [  # (entry, its SBP spelling, the flags it stands for)
        (tpf.ColumnParallel, {"output_sbp": B}, {"gather_output": True}),
        (tpf.ColumnParallel, {"input_sbp": S(1), "output_sbp": S(-1)}, {"sequence_parallel": True, "sequence_dim": 1}),
        (tpf.RowParallel, {"input_sbp": B}, {"input_is_parallel": False}),
        (tpf.RowParallel, {"input_sbp": S(-1), "output_sbp": S(0)}, {"sequence_parallel": True}),
        (tpf.SequenceParallel, {"input_sbp": B}, {"split_input": True}),
        (tpf.SequenceParallel, {"input_sbp": B, "output_sbp": S(0)}, {"split_input": True, "sequence_dim": 0}),
        (tpf.SequenceParallel, {"input_sbp": S(0), "output_sbp": S(0)}, {"sequence_dim": 0}),
        (tpf.GatherSequence, {"output_sbp": S(1)}, {"split_output": True}),
        (tpf.GatherSequence, {"input_sbp": S(0), "output_sbp": None}, {"sequence_dim": 0}),
        (tpf.VocabParallel, {"hidden_sbp": S(1)}, {"sequence_parallel": True, "sequence_dim": 1}),
    ]
    for kind, sbps, flags in spellings:
        said, flagged = kind(**sbps), kind(**flags)
        assert said == flagged and hash(said) == hash(flagged), (said, flagged)
        assert repr(said) == repr(flagged) and dataclasses.asdict(said) == dataclasses.asdict(flagged)
        assert dataclasses.replace(kind(), **flags) == said, "replace with the flags, as hf_plan writes it"
        assert dataclasses.replace(said) == said
        assert {k: getattr(flagged, k) for k in sbps} == sbps, f"{flagged!r} reads back {sbps}"
        assert set(sbps) <= set(inspect.signature(kind).parameters), "the SBP keywords in the signature"
    assert tpf.ColumnParallel(output_sbp=B, gather_output=True) == tpf.ColumnParallel(gather_output=True)  # agreeing
    refusals = [
        (lambda: tpf.ColumnParallel(input_sbp=S(-1)),
         r"ColumnParallel takes input_sbp=sbp.broadcast \(the whole input\) or, for sequence parallelism, .*got "
         r"sbp.split\(dim=-1\)"),
        (lambda: tpf.ColumnParallel(output_sbp=B, gather_output=False),
         "ColumnParallel: output_sbp=sbp.broadcast says gather_output=True, but gather_output=False is given beside "
         "it: drop gather_output"),
        (lambda: tpf.RowParallel(output_sbp=tpf.sbp.partial_sum), "RowParallel takes output_sbp=sbp.broadcast"),
        (lambda: tpf.RowParallel(output_sbp=S(0), sequence_parallel=False), "drop sequence_parallel"),
        (lambda: tpf.SequenceParallel(input_sbp=S(0), output_sbp=S(1)),
         r"input_sbp=sbp.split\(dim=0\) says sequence_dim=0, but output_sbp=sbp.split\(dim=1\) says sequence_dim=1: "
         "give layouts that agree"),
        (lambda: tpf.GatherSequence(output_sbp=B),
         r"GatherSequence takes output_sbp=None \(as the module returns it\)"),
        (lambda: tpf.GatherSequence(output_sbp=None, split_output=True), "drop split_output"),
        (lambda: tpf.VocabParallel(hidden_sbp=S(2)), "VocabParallel takes hidden_sbp=sbp.broadcast"),
    ]
    for build, message in refusals:
        with pytest.raises(ValueError, match=message):
            build()


def _drifted_replica_rank() -> None:
    """On 2 ranks the layer norm's weight, broadcast, drifts on rank 1; on 2 x 2 ranks (data x tensor) a column
    layer's block drifts on rank 3 only, so its copy on rank 1 (the same block, the other data-parallel row) differs.
    Every rank names the parameter and the ranks."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4), nn.LayerNorm(4))
    four = dist.get_world_size() == 4
    tpf.parallelize(model, placement=tpf.placement("cpu", [[0, 1], [2, 3]] if four else [0, 1]),
                    plan={"0": "column", "2": "row"})
    tpf.check_replicas(model)
    if dist.get_rank() == dist.get_world_size() - 1:
        with torch.no_grad():
            (model[0].weight if four else model[3].weight).to_local().view(-1)[0] += 1e-6
    with pytest.raises(ValueError, match=r"'0.weight' is broadcast over ranks \[1, 3\]" if four else
                       r"'3.weight' is broadcast over ranks \[0, 1\]"):
        tpf.check_replicas(model)


@pytest.mark.parametrize("world", [2, 4])
def test_a_replica_that_drifts_is_named_on_every_rank(world):
    harness.run(world, _drifted_replica_rank)
