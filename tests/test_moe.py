"""Mixtures of experts on the tensor-parallel ranks by their own plans: each expert split over the ranks
(``plan="auto"``) or the experts shared out whole (``hf_plan(model, expert_parallel=True)``). Qwen3-MoE, Mixtral,
OLMoE, Qwen2-MoE, DeepSeek-V3 and gpt-oss (tpflow's own plan: it ships none) against one device: the logits, the
``labels=`` loss with the router's auxiliary loss, 2 AdamW steps with clipping that bites (every parameter after
them, the routers included), greedy and sampled decoding; each rank holds 1/W of every expert's parameters. The
default experts implementation (``torch._grouped_mm``) in fp32 too, a rank whose experts get no token, LongCat-Flash's
zero experts (a layer routing every token to them) through training, checkpoints (transformers' per-expert files read
by slices, the export, DCP resharded), gradient checkpointing, and the mistakes: experts that do not split, an expert
id out of range, a layout tpflow does not know."""

from __future__ import annotations

import copy
import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import tpflow as tpf
from tests import harness
from tests.models import MOE_KINDS, VOCAB, tiny_moe, train_lm
from tpflow.layers.experts import check_experts, split_experts

pytest.importorskip("transformers")


def _experts(model):
    return [m for name, m in model.named_modules() if name.endswith("mlp.experts")]


def _matches_one_device(kind, expert_parallel):
    P = tpf.placement("cpu", list(range(dist.get_world_size())))
    ref = tiny_moe(kind)
    model = copy.deepcopy(ref)
    model = tpf.parallelize(model, placement=P, plan=tpf.hf_plan(model, expert_parallel=expert_parallel))
    # Qwen2-MoE's shared expert, which its own plan leaves whole, is split too
    shared = [m for name, m in model.named_modules() if name.endswith("shared_expert.gate_proj")]
    assert all(isinstance(m, tpf.ColumnParallelLinear) for m in shared), kind
    for experts in _experts(model):  # each rank its slice of every expert, or E / W whole experts
        for p in (experts.gate_up_proj, experts.down_proj):
            assert p.to_local().numel() * dist.get_world_size() == p.numel(), (kind, p.shape)
            assert p.to_local().shape[0] == p.shape[0] // (dist.get_world_size() if expert_parallel else 1)
    ids = torch.randint(0, VOCAB, (4, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, want = model(ids).logits, ref(ids).logits
    torch.testing.assert_close(logits.full_tensor(), want, rtol=1e-6, atol=1e-6, msg=f"{kind}: logits")
    losses, norms = train_lm(model, ids, steps=2)
    ref_losses, ref_norms = train_lm(ref, ids, steps=2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=1e-6,
                               msg=f"{kind}: losses")
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-6, atol=1e-6,
                               msg=f"{kind}: norms")
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-6, atol=1e-6,
                                   msg=lambda m, name=name: f"{kind}: {name} after AdamW: {m}")
    prompt = ids[:2, :4]
    tokens = model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(tokens, ref.generate(prompt, max_new_tokens=6, do_sample=False)), kind
    sampled = []
    for m in (model, ref):  # sampling: the same draws from the same distribution
        torch.manual_seed(5)
        sampled.append(m.generate(prompt, max_new_tokens=6, do_sample=True, top_k=0))
    assert torch.equal(*sampled), kind


def _grouped_mm():
    """The default experts implementation, torch._grouped_mm, in fp32: one device's loss and gradients."""
    P = tpf.placement("cpu", list(range(dist.get_world_size())))
    ref = tiny_moe("qwen3_moe", experts="grouped_mm", dtype=torch.float32)
    model = tpf.parallelize(copy.deepcopy(ref), placement=P, plan="auto")
    ids = torch.randint(0, VOCAB, (4, 10), generator=torch.Generator().manual_seed(2))
    loss, want = model(ids, labels=ids).loss, ref(ids, labels=ids).loss
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    loss.backward()
    want.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-4, atol=1e-5, msg=name)


def _sequence_parallel(kinds):
    """Under sequence parallelism (``hf_plan(sequence_parallel=True)``) each family's MoE block runs on every token,
    gathered on entry and its output cut back to this rank's tokens (so do OLMoE's attention, whose q / k / v gather
    their outputs, and DeepSeek-V3's, which its plan leaves whole): one device's loss and gradients, both layouts."""
    P = tpf.placement("cpu", list(range(dist.get_world_size())))
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(6))
    for kind in kinds:
        ref = tiny_moe(kind, layers=1)
        want = ref(ids, labels=ids).loss
        want.backward()
        for expert_parallel in (False, True):
            model = copy.deepcopy(ref)
            model.zero_grad()
            plan = tpf.hf_plan(model, sequence_parallel=True, expert_parallel=expert_parallel)
            tpf.parallelize(model, placement=P, plan=plan)
            loss = model(ids, labels=ids).loss
            torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6, msg=kind)
            loss.backward()
            for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
                torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-6, atol=1e-7,
                                           msg=lambda m, name=f"{kind}: {name}": f"{name}: {m}")


def _no_tokens_on_a_rank():
    """Expert parallel, every token routed to expert 0: the other ranks' experts get none. One device's output and
    gradients; an expert id out of range is an error on every rank, not a token silently dropped."""
    P = tpf.placement("cpu", list(range(dist.get_world_size())))
    ref = _experts(tiny_moe("qwen3_moe"))[0]
    experts = split_experts(copy.deepcopy(ref), P, by="experts")
    x = torch.randn(6, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    weights = torch.rand(6, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    ids = torch.zeros(6, 2, dtype=torch.long)
    ids[:, 1] = 1 if dist.get_world_size() < 4 else 0
    inputs = [x.clone().requires_grad_(), weights.clone().requires_grad_()]
    ref_inputs = [x.clone().requires_grad_(), weights.clone().requires_grad_()]
    out, want = experts(inputs[0], ids, inputs[1]), ref(ref_inputs[0], ids, ref_inputs[1])
    torch.testing.assert_close(out, want)
    (out * want.detach()).sum().backward()
    (want * want.detach()).sum().backward()
    for a, b in zip([*inputs, experts.gate_up_proj, experts.down_proj], [*ref_inputs, ref.gate_up_proj, ref.down_proj]):
        got = a.grad.full_tensor() if isinstance(a.grad, DTensor) else a.grad
        torch.testing.assert_close(got, b.grad)
    ids[0, 0] = 4
    split = split_experts(copy.deepcopy(ref), P)  # by the intermediate dim too
    for module in (experts, split):
        with pytest.raises(ValueError, match="the router chose expert 4 .* there are 4 experts"):
            module(x, ids, weights)


def _checkpoints(kind, expert_parallel):
    """A checkpoint as save_pretrained writes it, read by tpf.load_safetensors into a model built on meta and
    parallelized (each rank reads its slices of the experts: two of gate_up_proj, the gate's and the up's): bit for
    bit the regular from_pretrained + parallelize; and the parallelized model's save_pretrained read back on one
    device."""
    import transformers

    ref = tiny_moe(kind, dtype=torch.float32)
    where = [tempfile.mkdtemp(prefix="tpflow-moe-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where)
    saved, exported = os.path.join(where[0], "saved"), os.path.join(where[0], "exported")
    if dist.get_rank() == 0:
        ref.save_pretrained(saved, max_shard_size="100KB")
    dist.barrier()
    P = tpf.placement("cpu", list(range(dist.get_world_size())))
    regular = transformers.AutoModelForCausalLM.from_pretrained(saved)
    tpf.parallelize(regular, placement=P, plan=tpf.hf_plan(regular, expert_parallel=expert_parallel))
    with tpf.meta_parameters():
        model = transformers.AutoModelForCausalLM.from_config(ref.config)
    tpf.parallelize(model, placement=P, plan=tpf.hf_plan(model, expert_parallel=expert_parallel))
    tpf.load_safetensors(model, saved)
    theirs = regular.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value.to_local(), theirs[name].to_local()), f"{name} differs from the regular load"
    model.save_pretrained(exported)
    if dist.get_rank() == 0:
        back = transformers.AutoModelForCausalLM.from_pretrained(exported)
        for (name, p), q in zip(back.named_parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q), f"{name} exported"
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(where[0])


def _loads_on_one_device(model, opt, one, ids):
    """A torch.distributed.checkpoint of ``model`` and its AdamW state ``opt`` loads on ``one`` (the same model on
    one device, after a step of its own on ``ids``, whose values and state it overwrites) bit for bit."""
    where = [tempfile.mkdtemp(prefix="tpflow-moe-dcp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where)
    model_state, opt_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": opt_state}, checkpoint_id=where[0])
    one_opt = torch.optim.AdamW(one.parameters(), lr=1e-2)
    one(ids, labels=ids).loss.backward()
    one_opt.step()  # its state exists, to be overwritten
    model_state, opt_state = get_state_dict(one, one_opt)
    state = {"model": model_state, "optim": opt_state}
    dcp.load(state, checkpoint_id=where[0])
    set_state_dict(one, one_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for (name, p), q in zip(model.named_parameters(), one.parameters(), strict=True):
        assert torch.equal(p.full_tensor(), q), name
        assert torch.equal(opt.state[p]["exp_avg"].full_tensor(), one_opt.state[q]["exp_avg"]), name
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(where[0])


def _recompute_and_reshard():
    """Gradient checkpointing recomputes the split experts' forward (hooks and all) to one device's gradients; a
    torch.distributed.checkpoint of the expert-parallel model and its AdamW state loads resharded on one device."""
    P = tpf.placement("cpu", list(range(dist.get_world_size())))
    ref = tiny_moe("qwen3_moe")
    ids = torch.randint(0, VOCAB, (4, 10), generator=torch.Generator().manual_seed(5))
    for expert_parallel in (False, True):
        model = copy.deepcopy(ref)
        tpf.parallelize(model, placement=P, plan=tpf.hf_plan(model, expert_parallel=expert_parallel))
        model.gradient_checkpointing_enable()
        model.train()
        model(ids, labels=ids).loss.backward()
        ref.zero_grad()
        ref(ids, labels=ids).loss.backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-6, atol=1e-7, msg=name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.step()
    _loads_on_one_device(model, opt, copy.deepcopy(ref), ids)


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _experts_over_data(kind, tp, reshard):
    """Experts shared out over the data axis of dp x tp (EP x TP where tp > 1) beside FSDP2, tokens exchanged by
    all-to-all: each data rank's logits, 2 AdamW steps with clipping to one device's data-parallel run (each rank's
    rows' loss, averaged: the router's auxiliary loss is each rank's batch's, as under any data parallelism), every
    parameter after them, each rank's greedy tokens; each rank holds 1/W of every expert's matrices. ``reshard``: a
    torch.distributed.checkpoint of the model and its AdamW state loads on one device."""
    dp = dist.get_world_size() // tp
    P = tpf.placement("cpu", ranks=[[d * tp + t for t in range(tp)] for d in range(dp)], names=("dp", "tp"))
    ref = tiny_moe(kind)
    model = copy.deepcopy(ref)
    tpf.parallelize(model, placement=P, plan=tpf.hf_plan(model, expert_parallel="dp"))
    ignored = tpf.fsdp_ignored_params(model)
    assert len(ignored) == sum(len(list(e.parameters())) for e in _experts(model)) > 0
    for layer in model.model.layers:
        fully_shard(layer, mesh=P.mesh["dp"], ignored_params=ignored)
    fully_shard(model, mesh=P.mesh["dp"], ignored_params=ignored)
    for p in (p for e in _experts(model) for p in (e.gate_up_proj, e.down_proj)):
        assert p.to_local().numel() * dist.get_world_size() == p.numel(), (kind, p.shape, p.placements)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)  # before FSDP2's first forward
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4)
    ids = torch.randint(0, VOCAB, (2 * dp, 10), generator=torch.Generator().manual_seed(1))
    blocks = ids.tensor_split(dp)
    mine = blocks[P.coordinate()[0]]
    with torch.no_grad():
        torch.testing.assert_close(_full(model(mine).logits), ref(mine).logits, rtol=1e-6, atol=1e-6, msg=kind)
    for _ in range(2):
        loss = model(mine, labels=mine).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        wants = [ref(b, labels=b).loss for b in blocks]
        (sum(wants) / dp).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss, wants[P.coordinate()[0]].detach(), rtol=1e-6, atol=1e-6, msg=kind)
        torch.testing.assert_close(_full(norm), ref_norm, rtol=1e-6, atol=1e-6, msg=kind)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-6, atol=1e-6,
                                   msg=lambda m, name=name: f"{kind}: {name} after AdamW: {m}")
    prompt = mine[:, :4]  # each rank its own prompts; every rank decodes as many steps (no early stop)
    tokens = model.generate(prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert torch.equal(tokens, ref.generate(prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False)), kind
    if not reshard:
        return
    _loads_on_one_device(model, opt, tiny_moe(kind), mine)


def _exchange_without_tokens():
    """Experts over the data axis of 4 ranks, every token routed to rank 0's experts and rank 3 without tokens:
    ranks 1 to 3 receive none, and still take part in both exchanges of the backward. Each rank's output and its
    tokens' gradients are one device's; each expert's gradient is one device's averaged over the ranks (FSDP2's
    mean). An expert id out of range on one rank stops every rank."""
    rank = dist.get_rank()
    P = tpf.placement("cpu", ranks=[[r] for r in range(dist.get_world_size())], names=("dp", "tp"))
    ref = _experts(tiny_moe("qwen3_moe"))[0]
    experts = split_experts(copy.deepcopy(ref), P, by="experts", axis="dp")
    rows = [5, 3, 1, 0]
    xs = [torch.randn(n, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(r))
          for r, n in enumerate(rows)]
    ws = [torch.rand(n, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(9 + r))
          for r, n in enumerate(rows)]
    ids = [torch.tensor([0, 1]).repeat(n, 1) for n in rows]
    x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
    out = experts(x, ids[rank], w)
    (out * out.detach()).sum().backward()
    for r in range(len(rows)):  # one device, each rank's loss; the mean of them for the experts
        rx, rw = xs[r].clone().requires_grad_(), ws[r].clone().requires_grad_()
        want = ref(rx, ids[r], rw)
        if rows[r]:  # one device's loop over no tokens leaves nothing to differentiate
            (want * want.detach() / len(rows)).sum().backward()
        if r == rank:
            torch.testing.assert_close(out, want)
            torch.testing.assert_close(x.grad, rx.grad * len(rows) if rows[r] else torch.zeros_like(x))
            torch.testing.assert_close(w.grad, rw.grad * len(rows) if rows[r] else torch.zeros_like(w))
    for p, q in ((experts.gate_up_proj, ref.gate_up_proj), (experts.down_proj, ref.down_proj)):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad)
    for by, placement in (("experts", tpf.placement("cpu", list(range(4)))), ("intermediate", P)):
        with pytest.raises(ValueError, match=r"named placement of two axes|it takes by='experts'"):
            split_experts(copy.deepcopy(ref), placement, by=by, axis="dp")
    bad = ids[rank].clone()
    if rank == 2:
        bad[0, 1] = 7
    with pytest.raises(ValueError, match=r"the router chose expert ids outside 0 to 3 on ranks \[2\] of the experts"):
        experts(x, bad, w)


# LongCat-Flash: 4 experts and 2 zero experts (identity_expert, past the experts' ids), 2 a token, MLA attention
_LONGCAT = {"n_routed_experts": 4, "zero_expert_num": 2, "moe_topk": 2, "expert_ffn_hidden_size": 48,
            "ffn_hidden_size": 96, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
            "v_head_dim": 16, "head_dim": 8, "num_key_value_heads": 4}


def _zero_experts():
    """LongCat-Flash's zero experts under the experts split by the intermediate dim (``plan="auto"``): layer 0 routes
    tokens to experts and zero experts, layer 1's router (its score correction biased) every token to its two zero
    experts, so that no token reaches an expert there and only the first rank's identity output carries the tokens'
    gradient. One device's logits, loss, every gradient, the losses and norms of 2 AdamW steps and every parameter
    after them; each rank holds 1/W of every expert's matrices."""
    P = tpf.placement("cpu", list(range(dist.get_world_size())))
    ref = tiny_moe("longcat_flash", layers=4, **_LONGCAT)  # 2 layers of LongCat's 2 sublayers
    with torch.no_grad():
        ref.model.layers[1].mlp.router.e_score_correction_bias[4:] = 10.0
    model = tpf.parallelize(copy.deepcopy(ref), placement=P, plan="auto")
    for p in (p for e in _experts(model) for p in (e.gate_up_proj, e.down_proj)):
        assert p.to_local().numel() * dist.get_world_size() == p.numel(), p.shape
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    routed = []
    hook = ref.model.layers[1].mlp.experts.register_forward_pre_hook(lambda m, args: routed.append(args[1]))
    out, want = model(ids, labels=ids), ref(ids, labels=ids)
    hook.remove()
    assert bool((routed[0] >= 4).all()), routed  # layer 1: every token to zero experts only
    torch.testing.assert_close(out.logits.full_tensor(), want.logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-6, atol=1e-6)
    out.loss.backward()
    want.loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-6, atol=1e-7,
                                       msg=lambda m, name=name: f"{name}'s gradient: {m}")
    model.zero_grad()
    ref.zero_grad()
    losses, norms = train_lm(model, ids, steps=2)
    ref_losses, ref_norms = train_lm(ref, ids, steps=2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-6, atol=1e-6,
                                   msg=lambda m, name=name: f"{name} after AdamW: {m}")


def _cases(kinds, modes, more):
    for kind in kinds:
        for expert_parallel in modes:
            _matches_one_device(kind, expert_parallel)
    for kind, expert_parallel in zip(("qwen3_moe", "mixtral"), modes * 2, strict=False):  # Mixtral's names differ
        _checkpoints(kind, expert_parallel)
    if more:
        _sequence_parallel(kinds)
        _grouped_mm()
        _no_tokens_on_a_rank()
        _recompute_and_reshard()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_experts_split_or_shared_out_over_tensor_ranks_match_one_device(world):
    """Every family in both layouts on 2 ranks, with the rest of the checks; on 4 ranks (one expert a rank, one head
    a rank) the two whose layouts differ most (gpt-oss: experts transposed with biases, gate / up interleaved,
    attention sinks) and a rank whose experts get no token; on 1 (nothing split) every family."""
    if world == 1:
        harness.run(1, _cases, MOE_KINDS, (False, True), False, timeout=300)
    elif world == 2:
        harness.run(2, _cases, MOE_KINDS, (False, True), True, timeout=300)
    else:
        harness.run(4, _cases, ("qwen3_moe", "gpt_oss"), (False, True), False, timeout=300)
        harness.run(4, _no_tokens_on_a_rank, timeout=120)


@pytest.mark.parametrize("world", [2, 4])
def test_experts_shared_out_over_data_ranks_by_all_to_all_match_one_device(world):
    """Beside FSDP2: on 2 ranks (dp 2) Qwen3-MoE, resharded by DCP onto one device; on 4, gpt-oss on dp 2 x tp 2
    (EP x TP: experts transposed with biases, gate / up interleaved) and the exchanges with ranks that get no
    tokens."""
    if world == 2:
        harness.run(2, _experts_over_data, "qwen3_moe", 1, True, timeout=300)
    else:
        harness.run(4, _experts_over_data, "gpt_oss", 2, False, timeout=300)
        harness.run(4, _exchange_without_tokens, timeout=120)


@pytest.mark.parametrize("world", [2, 4])
def test_zero_experts_match_one_device(world):
    """LongCat-Flash's zero experts split by the intermediate dim, a layer routing every token to them: one device's
    numbers through training (a backward whose ranks ran different collectives before)."""
    harness.run(world, _zero_experts, timeout=180)


def test_experts_that_do_not_split_are_refused():
    experts = _experts(tiny_moe("qwen3_moe"))[0]
    with pytest.raises(ValueError, match=r"intermediate size 48 does not split over 5 tensor-parallel ranks: use 1, 2, "
                                         r"3, 4, 6, 8, 12, 16, 24 or 48 ranks, or expert parallelism"):
        check_experts("model.layers.0.mlp.experts", experts, 5)
    with pytest.raises(ValueError, match=r"its 4 experts do not split over 3 ranks: use 1, 2 or 4 ranks"):
        check_experts("model.layers.0.mlp.experts", experts, 3, by="experts")
    experts.extra_bias = torch.nn.Parameter(torch.zeros(4, 64))
    with pytest.raises(ValueError, match=r"has parameters \['extra_bias'\] besides gate_up_proj, down_proj and "
                                         r"their biases"):
        check_experts("model.layers.0.mlp.experts", experts, 2)
    check_experts("model.layers.0.mlp.experts", experts, 2, by="experts")  # per expert: shared out with the others
    with pytest.raises(ValueError, match=r"is not a layout tpflow knows for experts: it needs 3-D gate_up_proj"):
        check_experts("model.layers.0.mlp", torch.nn.Linear(4, 4), 2)
