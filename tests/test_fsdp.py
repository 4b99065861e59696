"""Tensor parallelism under PyTorch's FSDP2 on named placements: a Hugging Face Llama and a tied Qwen3 parallelized by
their own plans on dp x tp = 2 x 2 and on HSDP (replicate x shard x tensor = 1 x 2 x 2), then ``fully_shard`` per
decoder layer and on the model over the data axes, train AdamW steps with torch's clipping to one device's loss,
norms and every parameter; each rank holds a quarter of the parameters. The training loop's other pieces: gradient
accumulation without syncs, a bf16 MixedPrecisionPolicy, activation checkpointing, and the export of whole tensors.
A model left without FSDP2, or sharded over another placement's axes, stops at its first forward."""

from __future__ import annotations

import copy
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import tpflow as tpf
from tests import harness
from tests.models import VOCAB, tiny_lm, train_lm

pytest.importorskip("transformers")

LAYOUTS = {  # the placement's ranks and names, and the names FSDP2 shards over
    "dp x tp": ([[0, 1], [2, 3]], ("dp", "tp"), "dp"),
    "hsdp": ([[[0, 1], [2, 3]]], ("replicate", "shard", "tp"), ("replicate", "shard")),
}


def _fsdp_matches_one_device(kind, layout):
    ranks, names, data = LAYOUTS[layout]
    P = tpf.placement("cpu", ranks, names=names)
    ref = tiny_lm(kind, **({"tie_word_embeddings": True} if kind == "qwen3" else {}))
    model = tpf.parallelize(copy.deepcopy(ref), placement=P, plan="auto")
    for layer in model.model.layers:
        fully_shard(layer, mesh=P.mesh[data])
    fully_shard(model, mesh=P.mesh[data])
    ids = torch.randint(0, VOCAB, (4, 10), generator=torch.Generator().manual_seed(1))
    shard = P[data].coordinate()
    row = shard[0] * (P[data].hierarchy[1] if len(shard) > 1 else 1) + (shard[1] if len(shard) > 1 else 0)
    rows = len(P[data].flat_ranks)
    mine = ids.tensor_split(rows)[row]  # each data-parallel rank its own rows, the tensor-parallel ranks the same
    losses, norms = (torch.tensor(v, dtype=torch.float64) for v in train_lm(model, mine, steps=3, on_dtensors=True))
    ref_losses, ref_norms = (torch.tensor(v, dtype=torch.float64) for v in train_lm(ref, ids, steps=3))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, losses)
    mean = torch.stack([every[r] for r in P[data].flat_ranks]).mean(0)  # equal rows: the batch's mean
    torch.testing.assert_close(mean, ref_losses, rtol=1e-6, atol=1e-6, msg=f"{kind} {layout}: losses")
    torch.testing.assert_close(norms, ref_norms, rtol=1e-6, atol=1e-6, msg=f"{kind} {layout}: norms")
    held = 0
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters(), strict=True):
        held += p.to_local().numel()
        torch.testing.assert_close(p.full_tensor(), p_ref.detach(), rtol=1e-6, atol=1e-6,
                                   msg=lambda m, name=name: f"{kind} {layout}: {name} after AdamW: {m}")
    total = sum(p.numel() for p in ref.parameters())
    assert held <= 1.1 * total / 4, (held, total)  # parameters, and so gradients and AdamW's state, a quarter


def _sharded(ref, policy=None, checkpointing=False):
    P = tpf.placement("cpu", [[0, 1], [2, 3]], names=("dp", "tp"))
    model = tpf.parallelize(copy.deepcopy(ref), placement=P, plan="auto")
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.train()
    for layer in [*model.model.layers, model]:
        fully_shard(layer, mesh=P.mesh["dp"], **({} if policy is None else {"mp_policy": policy}))
    return model, P.coordinate()[0]


def _grads(model):
    return [p.grad.full_tensor() for p in model.parameters()]


def _training_loop():
    """Each piece of a training loop under FSDP2 x TP against one device's gradients on the whole batch."""
    ref = tiny_lm("llama")
    ids = torch.randint(0, VOCAB, (4, 10), generator=torch.Generator().manual_seed(2))
    ref(ids, labels=ids).loss.backward()
    want = [p.grad for p in ref.parameters()]
    model, row = _sharded(ref)
    for k, part in enumerate(ids.tensor_split(2)[row].split(1)):  # 2 micro-batches, the gradients synced once
        model.set_requires_gradient_sync(k == 1)
        (model(part, labels=part).loss / 2).backward()
    for got, expected in zip(_grads(model), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6, msg="accumulated")
    model, row = _sharded(ref, checkpointing=True)
    mine = ids.tensor_split(2)[row]
    model(mine, labels=mine).loss.backward()
    for got, expected in zip(_grads(model), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6, msg="activation checkpointing")
    model, _ = _sharded(ref, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    model(mine, labels=mine).loss.backward()
    norm, ref_norm = (torch.linalg.vector_norm(torch.stack([g.norm() for g in gs])) for gs in (_grads(model), want))
    torch.testing.assert_close(norm, ref_norm.to(norm.dtype), rtol=2e-2, atol=0, msg="bf16 parameters")
    whole = tpf.full_state_dict(model)  # whole tensors on the first rank, as save_pretrained writes them
    if dist.get_rank() == 0:
        assert all(torch.equal(whole[name], value) for name, value in ref.state_dict().items())
    folder = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)
    model.save_pretrained(folder[0])
    if dist.get_rank() == 0:
        import transformers

        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder[0], dtype=torch.float64)
        shutil.rmtree(folder[0])
        assert all(torch.equal(loaded.state_dict()[name], value) for name, value in ref.state_dict().items())


def _mistakes():
    """A model left without FSDP2, or sharded over another placement's axis (torch joins the meshes of two roots
    without a word): each stops at its first forward, on every rank, naming the call to make."""
    P = tpf.placement("cpu", [[0, 1], [2, 3]], names=("dp", "tp"))
    model = tpf.parallelize(tiny_lm("llama"), placement=P, plan="auto")
    call = r"call torch.distributed.fsdp.fully_shard\(block, mesh=P.mesh\[\"dp\"\]\) on each block and then on the " \
           r"model"
    with pytest.raises(RuntimeError, match=r"leaves the data axes \('dp',\) to FSDP2, but its parameters "
                                           r"model.embed_tokens.weight, .* are not sharded by FSDP2: " + call):
        model(torch.zeros(2, 4, dtype=torch.long))
    for layer in model.model.layers:  # the blocks only: the root's parameters would train apart
        fully_shard(layer, mesh=P.mesh["dp"])
    with pytest.raises(RuntimeError, match=r"its parameters model.embed_tokens.weight, model.norm.weight, "
                                           r"lm_head.weight are not sharded by FSDP2: " + call):
        model(torch.zeros(2, 4, dtype=torch.long))
    model = tpf.parallelize(tiny_lm("llama"), placement=P, plan="auto")
    other = tpf.placement("cpu", [[0, 1], [2, 3]], names=("data", "model"))  # the same ranks, another root
    for block in [*model.model.layers, model]:
        fully_shard(block, mesh=other.mesh["data"])
    with pytest.raises(RuntimeError, match=r"sharded by FSDP2 over other axes than \('dp',\) \(meshes .*'data'"):
        model(torch.zeros(2, 4, dtype=torch.long))


def _fsdp_stages(v, tp):
    """A Llama of 2 x ``v`` layers cut into 2 x ``v`` stages on two rank sets of the world's halves, each a named
    dp x tp placement, each rank's stages sharded by FSDP2 as torchtitan shards a pipeline's model parts: one device's
    model, the stages and this rank's own."""
    half = dist.get_world_size() // 2
    P0, P1 = (tpf.placement("cpu", [[r + i, r + i + 1][:tp] for i in range(0, half, tp)], names=("dp", "tp"))
              for r in (0, half))
    ref = tiny_lm("llama", layers=2 * v)
    stages = tpf.pipeline.cut(copy.deepcopy(ref), [P0, P1] * v, plan="auto")  # split(0) over "dp" by default
    mine = [st for st in stages if st.placement.coordinate() is not None]
    for st in mine:
        for layer in st.module.layers:
            fully_shard(layer, mesh=st.placement.mesh["dp"])
        fully_shard(st.module, mesh=st.placement.mesh["dp"])
    return ref, stages, mine


def _pipeline_of_fsdp_stages(tp, schedule):
    """Pipeline x FSDP2 (x tensor): prompt-masked labels, 2 AdamW steps with clipping over every stage, against one
    device's losses, norms and every parameter; each data-parallel rank computes its own rows, and holds its share
    of its stages' parameters."""
    v = 2 if schedule == "interleaved" else 1
    ref, stages, mine = _fsdp_stages(v, tp)
    rows = []
    for st in mine:
        st.module.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[0]))
    pipe = tpf.Pipeline(stages, micro_batches=2, loss_fn=tpf.pipeline.causal_lm_loss(ref), schedule=schedule)
    ids = torch.randint(0, VOCAB, (8, 10), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, :6] = labels[3, :2] = labels[5, :4] = -100  # prompts of different lengths
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-4) for m in (pipe, ref))
    for _ in range(2):
        loss = pipe.step(ids, labels)
        norm = tpf.clip_grad_norm_(pipe.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        ref_loss = ref(ids, labels=labels).loss
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(norm.double(), ref_norm.double(), rtol=1e-6, atol=1e-6, msg=f"{schedule}: norm")
        if loss is not None:
            torch.testing.assert_close(loss.double(), ref_loss.detach().double(), rtol=1e-6, atol=1e-6,
                                       msg=f"{schedule}: loss")
    dp = len(mine[0].placement.flat_ranks) // tp
    assert set(rows) == {4 // dp}, rows  # micro-batches of 4 rows, each data-parallel rank its share
    want = dict(ref.named_parameters())
    held = whole = 0
    for name, p in (x for st in mine for x in st.module.model.named_parameters()):
        held, whole = held + p.to_local().numel(), whole + p.numel()
        torch.testing.assert_close(p.full_tensor(), want[name].detach(), rtol=1e-6, atol=1e-6,
                                   msg=lambda m, name=name: f"{schedule}: {name} after AdamW: {m}")
    assert held <= 1.1 * whole / (dp * tp), (held, whole)


def _fsdp_stage_mistakes():
    """A zero-bubble schedule (FSDP2 reduces before the weights' gradients exist) and FSDP2 over a stage itself
    (a pipeline never runs the stage's forward): a PipelineError on every rank at the first step."""
    ref, stages, mine = _fsdp_stages(1, 1)
    ids = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(4))
    pipe = tpf.Pipeline(stages, micro_batches=2, loss_fn=tpf.pipeline.causal_lm_loss(ref), schedule="zb-h1")
    with pytest.raises(tpf.PipelineError, match="schedule='zb-h1' splits each backward .* use '1f1b', 'gpipe'"):
        pipe.step(ids, ids)
    ref, stages, mine = _fsdp_stages(1, 1)
    fully_shard(mine[0], mesh=mine[0].placement.mesh["dp"])
    pipe = tpf.Pipeline(stages, micro_batches=2, loss_fn=tpf.pipeline.causal_lm_loss(ref))
    with pytest.raises(tpf.PipelineError, match="stage 0 itself is sharded by FSDP2, .* on stage.module"):
        pipe.step(ids, ids)


def _cases():
    for kind, layout in (("llama", "dp x tp"), ("qwen3", "dp x tp"), ("llama", "hsdp")):
        _fsdp_matches_one_device(kind, layout)
    _training_loop()
    _mistakes()
    for schedule in ("1f1b", "interleaved"):
        _pipeline_of_fsdp_stages(1, schedule)
    _fsdp_stage_mistakes()


def test_fsdp2_over_tensor_parallelism_matches_one_device():
    try:
        harness.run(4, _cases, timeout=300)
    finally:
        harness.discard(4)  # the failed pipelines' messages stay with their processes


def test_pipeline_of_fsdp_x_tensor_stages_matches_one_device():
    """3-D: pipeline x data x tensor = 2 x 2 x 2 on 8 ranks."""
    try:
        harness.run(8, _pipeline_of_fsdp_stages, 2, "1f1b", timeout=300)
    finally:
        harness.discard(8)
