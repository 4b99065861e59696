"""Hugging Face causal LMs from tiny configs (random weights, nothing downloaded), parallelized by their own plans
(plan="auto"), against the same model on one device: logits, the labels= loss, every parameter after AdamW steps
with torch's clip_grad_norm_, replicated copies bit-identical over the ranks, and generate()'s tokens."""

from __future__ import annotations

import copy
import io
import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import tpflow as tpf
from tests import harness
from tests.checks import all_ranks
from tests.models import VOCAB, train_lm
from tests.models import tiny_lm as tiny

transformers = pytest.importorskip("transformers")

MODELS = ("llama", "qwen2", "qwen3", "mistral", "gemma2")


def _same_copies(model, what):
    """Every replicated parameter holds the same bits on every rank."""
    for name, p in model.named_parameters():
        if all(pl.is_replicate() for pl in p.placements):
            local = p.to_local().contiguous()
            copies = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(copies, local)
            assert all(torch.equal(c, local) for c in copies), f"{what}: the copies of {name} differ over the ranks"


def _whole(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _check(kind, ref, model, ids, generate=True):
    out, out_ref = model(ids, labels=ids), ref(ids, labels=ids)
    torch.testing.assert_close(_whole(out.logits), out_ref.logits, rtol=1e-10, atol=1e-10, msg=f"{kind}: logits")
    # HF's loss takes logits.float(): fp32 for these fp64 models, where tpflow's vocabulary-parallel kernels and
    # torch's log_softmax round differently (~1e-8 in the gradients)
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=1e-6, atol=1e-6, msg=f"{kind}: loss")
    (losses, norms), (losses_ref, norms_ref) = train_lm(model, ids, on_dtensors=True), train_lm(ref, ids)
    assert min(norms_ref) > 0.5, f"{kind}: clipping should bite"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(losses_ref), rtol=1e-6, atol=1e-6,
                               msg=f"{kind}: losses")
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(norms_ref), rtol=1e-6, atol=1e-6,
                               msg=f"{kind}: gradient norms")
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), p_ref, rtol=1e-6, atol=1e-6,  # the norms compute in fp32
                                   msg=lambda m, name=name: f"{kind}: {name} after AdamW: {m}")
    _same_copies(model, kind)
    _round_trip(kind, model, ids)
    if not generate:
        return
    model.eval()
    ref.eval()
    prompt = ids[:, :5]
    kwargs = dict(max_new_tokens=6, pad_token_id=0, attention_mask=torch.ones_like(prompt))
    assert torch.equal(model.generate(prompt, do_sample=False, **kwargs),
                       ref.generate(prompt, do_sample=False, **kwargs)), f"{kind}: greedy tokens"
    torch.manual_seed(5)
    sampled = model.generate(prompt, do_sample=True, top_k=0, **kwargs)
    torch.manual_seed(5)
    assert torch.equal(sampled, ref.generate(prompt, do_sample=True, top_k=0, **kwargs)), f"{kind}: sampled tokens"


def _round_trip(kind, model, ids):
    """save_pretrained on every rank (rank 0 writes), from_pretrained on one device: the trained model's values bit
    for bit, its ties, its logits."""
    whole = {name: _whole(p) for name, p in model.named_parameters()}  # gathers: every rank
    logits = _whole(model(ids).logits)
    folder = tempfile.TemporaryDirectory(prefix="tpflow-export-")
    where = [folder.name]
    dist.broadcast_object_list(where)
    model.save_pretrained(where[0])
    if dist.get_rank() == 0:
        back = transformers.AutoModelForCausalLM.from_pretrained(where[0])
        assert (back.lm_head.weight is back.model.embed_tokens.weight) == model.config.tie_word_embeddings, kind
        for name, p in back.named_parameters():
            assert p.dtype == whole[name].dtype and torch.equal(p, whole[name]), f"{kind}: {name} exported"
        torch.testing.assert_close(back(ids).logits, logits, rtol=1e-10, atol=1e-10, msg=f"{kind}: exported logits")
    dist.barrier()  # rank 0 has read the files
    folder.cleanup()


def _auto_rank():
    W = dist.get_world_size()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    for kind in MODELS:
        ref = tiny(kind)
        model = tpf.parallelize(copy.deepcopy(ref), placement=all_ranks(), plan="auto")
        assert all(isinstance(p, DTensor) for p in model.parameters())
        if W > 2:  # fewer key/value heads than ranks: k / v stay whole, each rank keeps its head
            assert type(model.model.layers[0].self_attn.k_proj) is torch.nn.Linear
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == ref.config.tie_word_embeddings, kind
        out = model(ids, labels=ids)  # the vocabulary split: no rank holds [tokens, V], nor does the loss gather it
        start, end = tpf.sbp.chunk_bounds(VOCAB, W)[dist.get_rank()]
        assert isinstance(out.logits, DTensor) and out.logits.to_local().shape == (2, 8, end - start), kind
        assert type(out.loss.grad_fn).__name__ == "_VocabParallelCEBackward", kind
        if kind == "gemma2":  # a pickled model (its scaled embedding's class made at run time) comes back whole
            saved = io.BytesIO()
            torch.save(model, saved)
            saved.seek(0)
            back = torch.load(saved, weights_only=False)
            assert torch.equal(back(ids).logits.full_tensor(), out.logits.full_tensor())
        _check(kind, ref, model, ids)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_models_by_their_own_plans(world):
    harness.run(world, _auto_rank, timeout=600)


def _explicit_rank():
    """The issue's case: Qwen3 by a column / row plan that never names its q / k norms, and HF's style names."""
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    ref = tiny("qwen3")
    plan = {"*.[qkv]_proj": "colwise", "*.o_proj": "rowwise", "*.[gu][ap]*_proj": "column", "*.down_proj": "row",
            "lm_head": "colwise_rep"}
    model = tpf.parallelize(copy.deepcopy(ref), placement=all_ranks(), plan=plan)
    _check("qwen3 explicit", ref, model, ids, generate=False)
    from tpflow.layers.replicated import replicated_grads
    attn = model.model.layers[0].self_attn
    assert replicated_grads(attn.q_norm) == "partial" and replicated_grads(model.model.norm) == "whole"
    if dist.get_world_size() > 2:  # 2 key/value heads: the plan's own k / v kept whole, each rank its head
        assert type(attn.k_proj) is torch.nn.Linear and attn.num_key_value_groups == 1


@pytest.mark.parametrize("world", [2, 4])
def test_a_plan_of_hf_names_heads_included_matches_one_device(world):
    """A plan of the user's own, in Hugging Face's names, gets the heads' styles ``plan="auto"`` gets."""
    harness.run(world, _explicit_rank, timeout=600)


def _sequence_parallel_rank():
    W = dist.get_world_size()
    ids = torch.randint(0, VOCAB, (2, 4 * W), generator=torch.Generator().manual_seed(1))
    for kind in ("llama", "qwen2", "qwen3", "gemma2"):  # gemma2: its tied embedding and head split too
        ref = tiny(kind, kv_heads=4)
        plan = tpf.hf_plan(ref, sequence_parallel=True)
        model = tpf.parallelize(copy.deepcopy(ref), placement=all_ranks(), plan=plan)
        assert model.model.layers[0].mlp.down_proj.sequence_dim == 1
        _check(f"{kind} sequence parallel", ref, model, ids, generate=False)
        if W > 1:
            with pytest.raises(ValueError, match=f"pad the sequence to a multiple of {W}"):
                model(ids[:, :W + 1])


@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_batch_first(world):
    harness.run(world, _sequence_parallel_rank, timeout=600)


def _compile_rank():
    """torch.compile of a parallelized model with labels= (after one eager call): the loss still vocabulary-parallel,
    the loss and every gradient of the eager call; save_pretrained's failure on rank 0 raises on every rank."""
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    ref = tiny("qwen3", layers=1)  # each layer adds graphs: its fused groups run eagerly between them
    model = tpf.parallelize(copy.deepcopy(ref), placement=all_ranks(), plan="auto")
    eager = model(ids, labels=ids).loss
    eager.backward()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    model.zero_grad()
    from torch._dynamo.testing import CompileCounterWithBackend

    graphs = CompileCounterWithBackend("aot_eager")  # dynamo and AOT autograd, as inductor gets them (faster here)
    compiled = torch.compile(model, backend=graphs)
    counts = []
    for _ in range(2):
        loss = compiled(ids, labels=ids).loss
        counts.append(graphs.frame_count)
        assert type(loss.grad_fn).__name__ == "_VocabParallelCEBackward"
        loss.backward()
        torch.testing.assert_close(loss, eager, rtol=1e-12, atol=1e-12)
        for name, p in model.named_parameters():  # HF's loss computes in fp32 (see _check)
            torch.testing.assert_close(p.grad.full_tensor(), grads[name], rtol=1e-6, atol=1e-7, msg=name)
        model.zero_grad()
    assert counts[0] == counts[1], f"the second call compiled {counts[1] - counts[0]} graphs more"
    torch.testing.assert_close(eager, ref(ids, labels=ids).loss, rtol=1e-6, atol=1e-6)
    with tempfile.TemporaryDirectory() as folder:
        failure = (r"Unit 'US' not supported" if dist.get_rank() == 0 else
                   r"save_pretrained failed on rank 0 \(ValueError: Unit 'US' not supported")
        with pytest.raises((ValueError, RuntimeError), match=failure):
            model.save_pretrained(folder, max_shard_size="bogus")
        with pytest.raises(TypeError, match="leave state_dict out"):
            model.save_pretrained(folder, state_dict=model.state_dict())
        # a model on rank 1 alone: its values whole on rank 1; save_pretrained (transformers writes from rank 0)
        # refuses on every rank, before any gather
        ref = tiny("llama", layers=1)
        alone = tpf.parallelize(copy.deepcopy(ref), placement=tpf.placement("cpu", [1]), plan="auto")
        whole = tpf.full_state_dict(alone)
        if dist.get_rank() == 1:
            assert whole.keys() == ref.state_dict().keys()
            assert all(torch.equal(whole[k], v) for k, v in ref.state_dict().items())
        else:
            assert whole == {}
        with pytest.raises(ValueError, match=r"writes from rank 0 \(transformers' rule\), which holds no block"):
            alone.save_pretrained(folder)
        # stages on two placements: no one rank can gather them
        stages = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 4))
        for r in (0, 1):
            tpf.to_global(stages[r], placement=tpf.placement("cpu", [r]), sbp=tpf.sbp.broadcast)
        with pytest.raises(ValueError, match=r"live on 2 placements .*: no one rank can gather them"):
            tpf.full_state_dict(stages)


def test_compile_with_labels_and_export_failures():
    harness.run(2, _compile_rank, timeout=600)


def _captured_decode_rank():
    """A decode step over a static cache traced whole by torch.compile (fullgraph: no break from tpflow's layers; the
    unfused plan, whose column layers are each one product), greedy tokens and logits those of one device."""
    from transformers import StaticCache

    ref = tiny("qwen3").eval()
    model = tpf.parallelize(copy.deepcopy(ref), placement=all_ranks(), plan=tpf.hf_plan(ref, fuse=False)).eval()
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    step = torch.compile(model.forward, backend="eager", fullgraph=True)
    tokens = {}
    for name, forward in (("one device", ref.forward), ("tpflow", model.forward), ("compiled", step)):
        cache = StaticCache(config=ref.config, max_batch_size=2, max_cache_len=16)
        with torch.no_grad():
            logits = forward(ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(6)).logits
            out = [_whole(logits)[:, -1].argmax(-1, keepdim=True)]
            for t in range(6, 10):  # the decode steps, one token each
                logits = (step if name == "compiled" else forward)(
                    out[-1], past_key_values=cache, use_cache=True, cache_position=torch.tensor([t])).logits
                out.append(_whole(logits)[:, -1].argmax(-1, keepdim=True))
        tokens[name] = (torch.cat(out, 1), _whole(logits))
    for name in ("tpflow", "compiled"):
        assert torch.equal(tokens[name][0], tokens["one device"][0]), name
        torch.testing.assert_close(tokens[name][1], tokens["one device"][1], rtol=1e-9, atol=1e-9)


def test_decode_step_is_captured_whole_by_torch_compile():
    harness.run(2, _captured_decode_rank, timeout=600)


def _errors_rank():
    P = all_ranks()
    with pytest.raises(ValueError, match=r"has 4 attention heads, which do not split over 3 tensor-parallel ranks: "
                                         r"use a degree that divides them \(\[1, 2, 4\]\)"):
        tpf.parallelize(tiny("llama"), placement=P, plan="auto")
    with pytest.raises(ValueError, match="ties its head to its embedding"):
        tpf.hf_plan(tiny("gemma2"), sequence_parallel=True, vocab_parallel=False)
    model = tiny("llama")
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="'sharded' is not a style tpflow knows"):
        tpf.parallelize(model, placement=P, plan={"*.q_proj": "colwise", "*.o_proj": "sharded"})
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "the model changed"


def test_errors_name_the_fix():
    harness.run(3, _errors_rank)


def _autocast_and_checkpointing_rank():
    """bf16 autocast (the kernels take one dtype: tpflow casts as autocast casts F.linear, an fp64 model left fp64)
    and the model's own gradient checkpointing with dropout where the data is replicated: one device's numbers."""
    W = dist.get_world_size()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    ref = tiny("llama").float()
    model = tpf.parallelize(copy.deepcopy(ref), placement=all_ranks(), plan="auto")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, out_ref = model(ids, labels=ids), ref(ids, labels=ids)
    assert out.logits.dtype == out_ref.logits.dtype
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=2e-2, atol=2e-2)
    out.loss.backward()
    out_ref.loss.backward()
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        assert p.grad.dtype == p_ref.grad.dtype == torch.float32, name
        torch.testing.assert_close(p.grad.full_tensor(), p_ref.grad, rtol=0.1, atol=2e-2, msg=name)
    # an fp64 model under a bf16 autocast (TRL's default bf16=True) stays fp64, as F.linear leaves fp64 alone
    ref = tiny("llama")
    model = tpf.parallelize(copy.deepcopy(ref), placement=all_ranks(), plan="auto")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, out_ref = model(ids, labels=ids), ref(ids, labels=ids)
    assert out.logits.dtype == out_ref.logits.dtype == torch.float64
    torch.testing.assert_close(out.logits.full_tensor(), out_ref.logits, rtol=1e-12, atol=1e-12)
    # gradient checkpointing: the recomputed forward draws the dropout masks of the first one, the same on every
    # rank where the data is replicated (the residual stream), as one device draws them
    ref = tiny("llama")
    for block in ref.model.layers:  # inside each checkpointed layer, on the replicated residual stream
        block.input_layernorm = torch.nn.Sequential(torch.nn.Dropout(0.3), block.input_layernorm)
    model = tpf.parallelize(copy.deepcopy(ref), placement=all_ranks(), plan="auto")
    for m in (model, ref):
        m.train()
        m.gradient_checkpointing_enable()
    torch.manual_seed(7)
    loss = model(ids, labels=ids).loss
    loss.backward()
    torch.manual_seed(7)
    loss_ref = ref(ids, labels=ids).loss
    loss_ref.backward()
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=1e-6)  # HF's loss in fp32: see _check
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), p_ref.grad, rtol=1e-6, atol=1e-7, msg=name)
    return W


def test_autocast_and_gradient_checkpointing():
    harness.run(2, _autocast_and_checkpointing_rank, timeout=300)


def _loading_rank():
    """Built under meta_parameters, parallelized, filled by load_safetensors from a directory as save_pretrained
    writes it (sharded files and their index, a tied head saved under the embedding's name): bit for bit the
    regular from_pretrained + parallelize, on every rank; a plain model (nothing parallelized) loads too. Strict:
    a larger model's checkpoint is an error on every rank naming its extra tensors and strict=False, which loads
    the model's part of it. Made global without a plan, the blocks still on meta are allocated as they are read.
    Built under torch.device("meta") instead, the model is refused: its rotary frequencies were never computed."""
    P = all_ranks()
    root = [tempfile.mkdtemp(prefix="tpflow-load-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root)
    for kind in ("llama", "gemma2"):
        folder = [os.path.join(root[0], kind)]
        ref = tiny(kind).float()
        if dist.get_rank() == 0:
            ref.save_pretrained(folder[0], max_shard_size="50KB")
        dist.barrier()
        regular = tpf.parallelize(transformers.AutoModelForCausalLM.from_pretrained(folder[0]), placement=P,
                                  plan="auto")
        with tpf.meta_parameters():
            model = transformers.AutoModelForCausalLM.from_config(ref.config)
        assert all(p.is_meta for p in model.parameters()) and not model.model.rotary_emb.inv_freq.is_meta
        tpf.parallelize(model, placement=P, plan="auto")
        tpf.load_safetensors(model, folder[0])
        ours, theirs = model.state_dict(), regular.state_dict()
        assert ours.keys() == theirs.keys()
        for name, value in ours.items():
            mine, want = value.to_local(), theirs[name].to_local()
            assert mine.dtype == want.dtype and torch.equal(mine, want), f"{kind}: {name} differs from the regular load"
        ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
        assert torch.equal(model(ids, labels=ids).loss, regular(ids, labels=ids).loss)
        with tpf.meta_parameters():
            plain = transformers.AutoModelForCausalLM.from_config(ref.config)
        tpf.load_safetensors(plain, folder[0])
        assert (plain.lm_head.weight is plain.model.embed_tokens.weight) == ref.config.tie_word_embeddings
        for (name, p), p_ref in zip(plain.named_parameters(), ref.parameters()):
            assert torch.equal(p, p_ref), f"{kind}: {name} of the plain model"
    with pytest.raises(KeyError, match=r"has no tensor for \['lm_head.weight'\] \(1 in all\) and has 4 tensors that "
                                       r"the model does not have: \['model.layers.0.post_feedforward_layernorm"
                                       r"\.weight', .*\] \(4 in all\): is it this model's\?"):
        with tpf.meta_parameters():
            llama = transformers.AutoModelForCausalLM.from_config(tiny("llama").config)
        tpf.load_safetensors(llama, [f"{folder[0]}/{n}" for n in sorted(os.listdir(folder[0]))
                                      if n.endswith(".safetensors")])
    from safetensors.torch import save_file

    # strict: a larger model's checkpoint (4 layers into 2) is an error; strict=False loads the model's part of it
    bigger = tiny("llama", layers=4).float()
    larger = os.path.join(root[0], "llama-4-layers")
    if dist.get_rank() == 0:
        bigger.save_pretrained(larger, max_shard_size="50KB")
    dist.barrier()
    whole = bigger.state_dict()
    with tpf.meta_parameters():
        llama = transformers.AutoModelForCausalLM.from_config(tiny("llama").config)
    tpf.parallelize(llama, placement=P, plan="auto")
    with pytest.raises(KeyError, match=r"has 18 tensors that the model does not have: \['model.layers.2.input_layernorm"
                                       r"\.weight', .*\] \.\.\. \(18 in all\): .* or pass strict=False"):
        tpf.load_safetensors(llama, larger)
    tpf.load_safetensors(llama, larger, strict=False)
    for name, p in llama.named_parameters():
        assert torch.equal(p.full_tensor(), whole[name]), f"strict=False: {name}"
    # made global without a plan: the blocks on meta are allocated (the same parameters) and filled
    with tpf.meta_parameters():
        llama = transformers.AutoModelForCausalLM.from_config(bigger.config)
    tpf.to_global(llama, placement=P, sbp=tpf.sbp.broadcast)
    assert all(p.to_local().is_meta for p in llama.parameters())
    tpf.load_safetensors(llama, larger)
    for name, p in llama.named_parameters():
        assert not p.to_local().is_meta and torch.equal(p.to_local(), whole[name]), f"to_global: {name}"
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    if dist.get_rank() == 0:
        save_file(mlp.state_dict(), os.path.join(root[0], "mlp.safetensors"))
    dist.barrier()
    with tpf.meta_parameters():
        split = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    tpf.to_global(split, placement=P, sbp=tpf.sbp.split(0))  # uneven blocks, rank 3 of 4 holds no row of 3
    weight = split[2].weight
    tpf.load_safetensors(split, os.path.join(root[0], "mlp.safetensors"))
    assert split[2].weight is weight and tpf.get_sbp(weight) == (tpf.sbp.split(0),)
    x = torch.randn(5, 6)
    torch.testing.assert_close(split(tpf.to_global(x, placement=P, sbp=tpf.sbp.broadcast)).full_tensor(), mlp(x))
    with torch.device("meta"):
        llama = transformers.AutoModelForCausalLM.from_config(tiny("llama").config)
    with pytest.raises(ValueError, match=r"\['model.rotary_emb.inv_freq', .*\] are buffers on the meta device .* "
                                         r"Build it under tpf.meta_parameters\(\) instead"):
        tpf.parallelize(llama, placement=P, plan="auto")
    tpf.to_global(llama, placement=P)
    with pytest.raises(ValueError, match=r"\['model.rotary_emb.inv_freq', .*\] \(2 in all\) are buffers on the meta "
                                         r"device .* Build it under tpf.meta_parameters\(\) instead"):
        tpf.load_safetensors(llama, larger)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root[0])


@pytest.mark.parametrize("world", [1, 2, 4])
def test_meta_load_reads_only_its_blocks(world):
    harness.run(world, _loading_rank, timeout=300)


def _stage_loading_rank():
    """A checkpoint of the whole model loads into each stage of pipeline.cut, by the whole model's names: every
    parameter bit for bit the whole model's, each on its stage, the other stages' tensors not unexpected; with a
    plan (pipeline x tensor) and without (the blocks allocated from meta as they are read), and the stages then
    give the whole model's logits. A larger model's checkpoint is an error on every rank; strict=False loads the
    stages' part of it. An nn.Sequential's stages load its checkpoint the same way."""
    from safetensors.torch import save_file

    W, rank = dist.get_world_size(), dist.get_rank()
    root = [tempfile.mkdtemp(prefix="tpflow-stage-load-") if rank == 0 else None]
    dist.broadcast_object_list(root)
    ref = tiny("llama", layers=4, tie_word_embeddings=False).float()
    if rank == 0:
        ref.save_pretrained(root[0], max_shard_size="50KB")
    dist.barrier()
    whole = ref.state_dict()
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    expected = ref(ids).logits
    halves = [tpf.placement("cpu", list(range(W // 2))), tpf.placement("cpu", list(range(W // 2, W)))]
    singles = [tpf.placement("cpu", [r]) for r in range(W)]
    for placements, plan in ((halves, "auto"), (singles, None)):
        with tpf.meta_parameters():  # cut (and parallelize) inside the block too: global parameters are left alone
            stages = tpf.pipeline.cut(transformers.AutoModelForCausalLM.from_config(ref.config), placements, plan=plan)
        names = set()
        for stage in stages:
            tpf.load_safetensors(stage, root[0])
            for name, p in stage.module.model.named_parameters():  # the whole model's names
                names.add(name)
                if rank in stage.placement:
                    assert torch.equal(p.full_tensor(), whole[name]), f"plan={plan}: {name}"
        assert names == set(whole), f"plan={plan}: the stages hold {sorted(names ^ set(whole))} apart"
        x = ids
        for stage in stages:
            x = stage(x)
        if rank in stages[-1].placement:
            exact = {} if plan else {"rtol": 0, "atol": 0}
            torch.testing.assert_close(x.to_local(), expected, **exact, msg=f"plan={plan}: the stages' logits")
    with tpf.meta_parameters():
        smaller = transformers.AutoModelForCausalLM.from_config(tiny("llama", tie_word_embeddings=False).config)
    for stage in tpf.pipeline.cut(smaller, halves):
        with pytest.raises(KeyError, match=r"has 18 tensors that the model does not have: \['model.layers.2.input_"
                                           r"layernorm.weight', .*\] \.\.\. \(18 in all\): .* or pass strict=False"):
            tpf.load_safetensors(stage, root[0])
        tpf.load_safetensors(stage, root[0], strict=False)
        for name, p in stage.module.model.named_parameters():
            if rank in stage.placement:
                assert torch.equal(p.to_local(), whole[name]), f"strict=False: {name}"
    torch.manual_seed(0)
    chain = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    if rank == 0:
        save_file(chain.state_dict(), os.path.join(root[0], "chain.safetensors"))
    dist.barrier()
    with tpf.meta_parameters():
        parts = tpf.pipeline.cut(torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)]), halves, at=["2"])
    for part in parts:
        tpf.load_safetensors(part, os.path.join(root[0], "chain.safetensors"))
        for name, p in part.module.named_parameters():
            if rank in part.placement:
                assert torch.equal(p.to_local(), chain.get_parameter(name)), f"nn.Sequential: {name}"
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root[0])


@pytest.mark.parametrize("world", [2, 4])
def test_whole_checkpoint_loads_into_each_stage(world):
    harness.run(world, _stage_loading_rank, timeout=300)
