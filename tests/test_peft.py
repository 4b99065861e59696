"""PEFT's LoRA adapters and a parallelized model (issue 44): both orders, every adapter in its base layer's layout and
trained as one device trains it; saved as PEFT saves, loaded, merged; what is refused rather than run unsplit."""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
import torch.distributed as dist

import tpflow as tpf
from tests import harness
from tests.checks import all_ranks, within

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

_MOE = ("qwen3_moe", "mixtral", "gpt_oss")
KINDS = ("llama", "qwen3", "gemma2", *_MOE)
_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head")


def _model(kind: str) -> torch.nn.Module:
    """A tiny fp64 model of ``kind``: 2 key/value heads (kept whole, each rank its head, on 4 ranks)."""
    from tests.models import tiny_lm, tiny_moe

    return tiny_moe(kind) if kind in _MOE else tiny_lm(kind, kv_heads=2)


def _config(model: torch.nn.Module, **options) -> object:
    """LoRA on every attention and dense MLP projection the model has, its embedding and its head (not its
    experts)."""
    targets = [t for t in _TARGETS if any(n == t or n.endswith("." + t) for n, _ in model.named_modules())]
    return peft.LoraConfig(target_modules=targets, **{"r": 4, "lora_alpha": 8, **options})


def _reference(base: torch.nn.Module, **options) -> torch.nn.Module:
    """One device's PEFT model of ``base``, in fp64, its ``lora_B`` drawn (PEFT starts it at zero, which would hide a
    wrong layout in the first step's output)."""
    torch.manual_seed(3)
    reference = peft.get_peft_model(copy.deepcopy(base), _config(base, **options)).double()
    with torch.no_grad():
        for i, (name, p) in enumerate(reference.named_parameters()):
            if "lora_B" in name:
                p.normal_(std=0.1, generator=torch.Generator().manual_seed(i))
    return reference


def _copy_adapters(model: torch.nn.Module, reference: torch.nn.Module, adapter: str = "") -> None:
    """The reference's adapter values (of ``adapter``, default every one) into ``model``'s, each rank its blocks."""
    with torch.no_grad():
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            if "lora_" in name and f".{adapter}." in name if adapter else "lora_" in name:
                whole = q.full_tensor() if isinstance(q, torch.distributed.tensor.DTensor) else q
                p.copy_(tpf.tensor(whole, placement=all_ranks(), sbp=tpf.get_sbp(p)))


def _folder() -> str:
    """Rank 0's new temporary folder, on every rank."""
    folder = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    return folder[0]


def _ids() -> torch.Tensor:
    from tests.models import VOCAB

    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))


def _orders_rank(kinds: tuple[str, ...]) -> None:
    """Both orders on each model: ``parallelize(get_peft_model(model), plan="auto")`` (the vocabulary split; and with
    sequence parallelism) and ``get_peft_model(parallelize(model), tpf.lora(config))`` (whole logits): every adapter
    follows its base, only the
    adapters train, and two AdamW steps with clipping give one device's losses, norms and every parameter, at fp32's
    rounding (the models are fp64, but their RMS norms, routers and loss compute in fp32)."""
    from tests.models import train_lm

    for kind in kinds:
        base = _model(kind)
        reference = _reference(base)
        peft_first = tpf.parallelize(copy.deepcopy(reference), placement=all_ranks(), plan="auto")
        sequence = tpf.parallelize(copy.deepcopy(reference), placement=all_ranks(),
                                   plan=tpf.hf_plan(reference, sequence_parallel=True))
        tpflow_first = tpf.parallelize(copy.deepcopy(base), placement=all_ranks(),
                                       plan=tpf.hf_plan(base, vocab_parallel=False))
        torch.manual_seed(3)
        tpflow_first = peft.get_peft_model(tpflow_first, tpf.lora(_config(base))).double()
        _copy_adapters(tpflow_first, reference)
        want = train_lm(reference, _ids())
        for model in (peft_first, tpflow_first, sequence):
            attention = model.base_model.model.model.layers[0].self_attn
            assert type(attention.q_proj.lora_B["default"]).__name__ == "ColumnParallelLinear", kind
            assert type(attention.o_proj.lora_A["default"]).__name__ == "RowParallelLinear", kind
            assert type(model.base_model.model.model.embed_tokens).__name__ == "EmbeddingLora", kind
            head = model.base_model.model.lm_head  # its adapter split as it is (whole where it stays tied, whole)
            assert type(head).__name__ == ("ColumnLora" if isinstance(head.base_layer, tpf.ColumnParallelLinear)
                                           else "WholeLora"), kind
            with within(90):
                got = train_lm(model, _ids())
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=kind)
            trainable = [n for n, p in model.named_parameters() if p.requires_grad]
            assert trainable and all("lora_" in n for n in trainable), trainable
            for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(p.full_tensor(), q, rtol=1e-6, atol=1e-6, msg=f"{kind}: {name}")
            tpf.check_replicas(model)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_lora_in_either_order_trains_as_one_device(world):
    harness.run(world, _orders_rank, KINDS, timeout=600)


def _experts_rank(kinds: tuple[str, ...]) -> None:
    """PEFT's ``target_parameters`` on the fused experts (``gate_up_proj``, ``down_proj``), beside LoRA on attention:
    with the experts split by the intermediate dim and shared out whole, two AdamW steps with clipping give one
    device's losses and every parameter; the saved adapter loads on one device with the trained logits, and
    merge_and_unload gives them too."""
    from tests.models import train_lm

    for kind in kinds:
        base = _model(kind)
        torch.manual_seed(3)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"],
                                 target_parameters=["experts.gate_up_proj", "experts.down_proj"])
        reference = peft.get_peft_model(copy.deepcopy(base), copy.deepcopy(config)).double()
        with torch.no_grad():
            for i, (name, p) in enumerate(reference.named_parameters()):
                if "lora_B" in name:
                    p.normal_(std=0.1, generator=torch.Generator().manual_seed(i))
        models = [tpf.parallelize(copy.deepcopy(reference), placement=all_ranks(),
                                  plan=tpf.hf_plan(reference, expert_parallel=ep)) for ep in (False, True)]
        want = train_lm(reference, _ids())
        trained = reference(_ids()).logits
        for model, layout in zip(models, ("split", "shared out")):
            experts = model.base_model.model.model.layers[0].mlp.experts
            assert type(experts).__name__ == type(experts.base_layer).__name__ == "ExpertsLora", (kind, layout)
            with within(90):
                got = train_lm(model, _ids())
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"{kind}, experts {layout}")
            wanted = dict(reference.named_parameters())  # by name: the experts' wrappers register theirs anew
            for name, p in model.named_parameters():
                torch.testing.assert_close(p.full_tensor(), wanted[name], rtol=1e-6, atol=1e-6,
                                           msg=f"{kind}, experts {layout}: {name}")
            folder = [_folder()]
            with within(60):
                model.save_pretrained(folder[0])
            if dist.get_rank() == 0:
                one = peft.PeftModel.from_pretrained(copy.deepcopy(base), folder[0]).double()
                torch.testing.assert_close(one(_ids()).logits, trained, rtol=1e-6, atol=1e-6, msg=kind)
            with within(60):
                merged = model.merge_and_unload()
                torch.testing.assert_close(merged(_ids()).logits.full_tensor(), trained, rtol=1e-6, atol=1e-6,
                                           msg=f"{kind}, experts {layout}: merged")


def _experts_over_data_rank() -> None:
    """LoRA on the experts shared out over the data axis of dp x tp = 2 x 2 (each expert split over the tensor axis
    too), tokens exchanged by all-to-all, FSDP2 over the data axis leaving the experts and their factors alone: each
    data row's half of the batch, three AdamW steps give one device's losses (the rows' mean; no auxiliary loss) and
    every parameter."""
    from torch.distributed.fsdp import fully_shard

    from tests.models import train_lm

    P = tpf.placement("cpu", [[0, 1], [2, 3]], names=("dp", "tp"))
    base = _model("qwen3_moe")
    base.config.output_router_logits = False  # each row's auxiliary loss is its own: their mean is not the batch's
    torch.manual_seed(3)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"],
                             target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    reference = peft.get_peft_model(copy.deepcopy(base), config).double()
    with torch.no_grad():
        for i, (name, p) in enumerate(reference.named_parameters()):
            if "lora_B" in name:
                p.normal_(std=0.1, generator=torch.Generator().manual_seed(i))
    model = tpf.parallelize(copy.deepcopy(reference), placement=P, plan=tpf.hf_plan(reference, expert_parallel="dp"))
    ignored = tpf.fsdp_ignored_params(model)
    assert sum("lora_" in n for n, p in model.named_parameters() if p in ignored) == 2 * 2 * 2  # 2 layers, A and B
    for block in [*model.base_model.model.model.layers, model]:
        fully_shard(block, mesh=P.mesh["dp"], ignored_params=ignored)
    ids = torch.randint(0, 101, (4, 10), generator=torch.Generator().manual_seed(1))
    with within(120):
        losses, _ = train_lm(model, ids.tensor_split(2)[P.coordinate()[0]], steps=3)
    want, _ = train_lm(reference, ids, steps=3)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, losses)
    mean = torch.tensor([every[0], every[2]], dtype=torch.float64).mean(0)
    torch.testing.assert_close(mean, torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=1e-6)
    wanted = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), wanted[name], rtol=1e-6, atol=1e-6, msg=name)


def _experts_split_beside_fsdp2_rank() -> None:
    """LoRA on gate_up_proj of experts split by the intermediate dim, beside FSDP2 on dp x tp, is refused before any
    change: FSDP2's split of lora_B's rows would nest in their gate / up halves, which DTensor gathers wrongly."""
    P = tpf.placement("cpu", [[0, 1], [2, 3]], names=("dp", "tp"))
    config = peft.LoraConfig(r=4, target_modules=["q_proj"], target_parameters=["experts.gate_up_proj"])
    wrapped = peft.get_peft_model(_model("qwen3_moe"), config)
    with pytest.raises(ValueError, match=r"LoRA on gate_up_proj of experts split by the intermediate dim beside "
                                         r"FSDP2 is not supported: .*expert_parallel=True or 'dp'"):
        tpf.parallelize(wrapped, placement=P, plan="auto")
    assert not any(type(m).__name__ == "ColumnParallelLinear" for m in wrapped.modules())


def test_lora_on_experts_shared_out_over_data_beside_fsdp2_trains_as_one_device():
    harness.run(4, _experts_split_beside_fsdp2_rank)
    harness.run(4, _experts_over_data_rank, timeout=300)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_lora_on_experts_split_or_shared_out_trains_as_one_device(world):
    harness.run(world, _experts_rank, _MOE, timeout=600)


def _fsdp_rank() -> None:
    """A PEFT model parallelized on a named placement (dp x tp = 2 x 2), FSDP2 over its data axis: three AdamW steps
    on each data row's half of the batch give one device's losses (their mean), norms and adapters."""
    from torch.distributed.fsdp import fully_shard

    from tests.models import train_lm

    P = tpf.placement("cpu", [[0, 1], [2, 3]], names=("dp", "tp"))
    base = _model("llama")
    reference = _reference(base)
    model = tpf.parallelize(copy.deepcopy(reference), placement=P, plan="auto")
    for block in [*model.base_model.model.model.layers, model]:
        fully_shard(block, mesh=P.mesh["dp"])
    ids = torch.randint(0, 101, (4, 10), generator=torch.Generator().manual_seed(1))
    with within(90):
        losses, norms = train_lm(model, ids.tensor_split(2)[P.coordinate()[0]], steps=3)
    want_losses, want_norms = train_lm(reference, ids, steps=3)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, losses)
    mean = torch.tensor([every[0], every[2]], dtype=torch.float64).mean(0)
    torch.testing.assert_close(mean, torch.tensor(want_losses, dtype=torch.float64), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(norms, want_norms, rtol=1e-6, atol=1e-6)
    wanted = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), wanted[name], rtol=1e-6, atol=1e-6, msg=name)


def test_lora_under_fsdp2_on_a_named_placement_trains_as_one_device():
    harness.run(4, _fsdp_rank)


def _modules_to_save_rank() -> None:
    """PEFT's ``modules_to_save`` (a trainable copy beside each module) on the embedding and the head, both split over
    the vocabulary, and on a norm left whole: the copies split as their modules, two AdamW steps give one device's
    losses and parameters, and the saved adapter (the copies with it) loads on one device with the trained logits."""
    from tests.models import train_lm

    base = _model("llama")
    reference = _reference(base, modules_to_save=["embed_tokens", "lm_head", "norm"])
    model = tpf.parallelize(copy.deepcopy(reference), placement=all_ranks(), plan="auto")
    inner = model.base_model.model
    assert type(inner.lm_head.modules_to_save["default"]).__name__ == "ColumnParallelLinear"
    assert type(inner.model.embed_tokens.modules_to_save["default"]).__name__ == "VocabParallelEmbedding"
    with within(60):
        got = train_lm(model, _ids())
    torch.testing.assert_close(got, train_lm(reference, _ids()), rtol=1e-6, atol=1e-6)
    wanted = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), wanted[name], rtol=1e-6, atol=1e-6, msg=name)
    trained = model(_ids()).logits.full_tensor()
    folder = [_folder()]
    with within(60):
        model.save_pretrained(folder[0])
    if dist.get_rank() == 0:
        one = peft.PeftModel.from_pretrained(copy.deepcopy(base), folder[0]).double()
        torch.testing.assert_close(one(_ids()).logits, trained, rtol=1e-9, atol=1e-9)
    dist.barrier()


@pytest.mark.parametrize("world", [2, 4])
def test_modules_to_save_copies_split_as_their_modules(world):
    harness.run(world, _modules_to_save_rank)


def _dcp_rank() -> None:
    """A torch.distributed.checkpoint of a PEFT model's adapters (attention, MLP, the head split over the vocabulary)
    and their AdamW state loads into another split copy and into one device's PEFT model, each of which took other
    steps first, bit for bit. (Experts split by the intermediate dim are left out: DCP refuses their strided blocks,
    the experts' own as their factors'.)"""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    reference = _reference(_model("llama"))
    split, other = (tpf.parallelize(copy.deepcopy(reference), placement=all_ranks(), plan="auto") for _ in range(2))
    optimizers = {}
    for model, steps in ((split, 1), (other, 2), (reference, 3)):  # each its own values and state
        optimizer = optimizers[model] = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(steps):
            with within(60):
                model(_ids(), labels=_ids()).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    where = [_folder()]
    with within(60):
        model_state, optimizer_state = get_state_dict(split, optimizers[split])
        dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=where[0])
    for model in (other, reference):
        model_state, optimizer_state = get_state_dict(model, optimizers[model])
        state = {"model": model_state, "optim": optimizer_state}
        with within(60):
            dcp.load(state, checkpoint_id=where[0])
        set_state_dict(model, optimizers[model], model_state_dict=state["model"], optim_state_dict=state["optim"])
        loaded = dict(model.named_parameters())
        for name, p in split.named_parameters():
            q = loaded[name]
            whole = q.full_tensor() if isinstance(q, torch.distributed.tensor.DTensor) else q
            assert torch.equal(p.full_tensor(), whole), name
            if p.requires_grad:
                moment = optimizers[model].state[q]["exp_avg"]
                moment = moment.full_tensor() if isinstance(moment, torch.distributed.tensor.DTensor) else moment
                assert torch.equal(optimizers[split].state[p]["exp_avg"].full_tensor(), moment), name


@pytest.mark.parametrize("world", [2, 4])
def test_lora_checkpoint_reshards_to_another_copy_and_one_device(world):
    harness.run(world, _dcp_rank)


def _trainers_rank(folder: str) -> None:
    """transformers' Trainer on ``parallelize(get_peft_model(model))`` and TRL's SFTTrainer given a parallelized model
    and ``peft_config=tpf.lora(config)``, each after tpf.adopt: they train the adapters only, and their save_model
    writes PEFT's adapter files, which load on one device with the trained logits."""
    import contextlib
    import io

    import datasets
    import transformers
    from trl import SFTConfig, SFTTrainer

    from tests.models import tiny_tokenizer

    base = _model("llama")
    texts = [" ".join(f"w{(7 * i + j) % 90}" for j in range(6 + i % 5)) for i in range(16)]
    rows = datasets.Dataset.from_dict({"text": texts})
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(_TARGETS[:-2]))  # TRL refuses the head's
    trainers = {
        "Trainer": lambda out: transformers.Trainer(
            model=tpf.parallelize(peft.get_peft_model(copy.deepcopy(base), copy.deepcopy(lora)), placement=all_ranks(),
                                  plan="auto"),
            args=transformers.TrainingArguments(out, **options),
            train_dataset=[{"input_ids": row, "labels": row} for row in ([3 + (5 * i + j) % 90 for j in range(8)]
                                                                          for i in range(8))]),
        "SFTTrainer": lambda out: SFTTrainer(
            model=tpf.parallelize(copy.deepcopy(base), placement=all_ranks(), plan="auto"),
            args=SFTConfig(out, max_length=16, bf16=False, **options), train_dataset=rows,
            processing_class=tiny_tokenizer(), peft_config=tpf.lora(copy.deepcopy(lora))),
    }
    options = {"max_steps": 2, "per_device_train_batch_size": 2, "learning_rate": 1e-2, "save_strategy": "no",
               "report_to": [], "use_cpu": True, "disable_tqdm": True}
    ids = _ids()
    for name, make in trainers.items():
        trainer = tpf.adopt(make(f"{folder}/{name}"))
        with within(120), contextlib.redirect_stdout(io.StringIO()):
            trainer.train()
            trainer.save_model(f"{folder}/{name}/final")
        model = trainer.model
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        assert trainable and all("lora_" in n for n in trainable), (name, trainable)
        trained = model(ids).logits.full_tensor()
        if dist.get_rank() == 0:
            one = peft.PeftModel.from_pretrained(copy.deepcopy(base), f"{folder}/{name}/final").double()
            torch.testing.assert_close(one(ids).logits, trained, rtol=1e-9, atol=1e-9, msg=name)
        dist.barrier()


def test_trainer_and_trl_train_and_save_lora_on_a_split_model(tmp_path):
    pytest.importorskip("trl")
    harness.run(2, _trainers_rank, str(tmp_path), timeout=300)


def _save_load_merge_rank() -> None:
    """A trained PEFT model saves PEFT's adapter files, which load on one device with the trained logits and into a
    split model; a second adapter switches in as in PEFT; merge_and_unload gives the merged logits, and the merged
    model's save_pretrained reloads on one device."""
    import transformers

    base = _model("llama")
    reference = _reference(base)
    model = tpf.parallelize(copy.deepcopy(reference), placement=all_ranks(), plan="auto")
    from tests.models import train_lm

    with within(60):
        train_lm(model, _ids())
    trained = model(_ids()).logits.full_tensor()
    folder = [_folder()]
    adapter, merged_dir = f"{folder[0]}/adapter", f"{folder[0]}/merged"
    with within(60):
        model.save_pretrained(adapter)  # every rank; rank 0 writes PEFT's files
    if dist.get_rank() == 0:
        one = peft.PeftModel.from_pretrained(copy.deepcopy(base), adapter).double()
        torch.testing.assert_close(one(_ids()).logits, trained, rtol=1e-9, atol=1e-9)
    split = tpf.parallelize(copy.deepcopy(base), placement=all_ranks(), plan="auto")
    config = tpf.lora(peft.LoraConfig.from_pretrained(adapter))
    other = tpf.adopt(peft.get_peft_model(copy.deepcopy(split), tpf.lora(_config(base))).double())  # other order
    _copy_adapters(other, model)
    with within(60):
        other.save_pretrained(f"{adapter}-other")
    if dist.get_rank() == 0:
        one = peft.PeftModel.from_pretrained(copy.deepcopy(base), f"{adapter}-other").double()
        torch.testing.assert_close(one(_ids()).logits, trained, rtol=1e-9, atol=1e-9)
    with within(60):
        loaded = peft.PeftModel.from_pretrained(split, adapter, config=config).double()
        torch.testing.assert_close(loaded(_ids()).logits.full_tensor(), trained, rtol=1e-9, atol=1e-9)

    second = _config(base, r=2, use_rslora=True)  # a second adapter (rsLoRA's scaling), in fp64
    torch.set_default_dtype(torch.float64)
    try:
        reference.add_adapter("second", copy.deepcopy(second))
        model.add_adapter("second", second)
    finally:
        torch.set_default_dtype(torch.float32)
    reference.set_adapter("second")
    model.set_adapter("second")
    _copy_adapters(model, reference, "second")
    torch.testing.assert_close(model(_ids()).logits.full_tensor(), reference(_ids()).logits, rtol=1e-9, atol=1e-9)
    reference.set_adapter("default")
    model.set_adapter("default")

    with within(60):
        merged = model.merge_and_unload()
        torch.testing.assert_close(merged(_ids()).logits.full_tensor(), trained, rtol=1e-9, atol=1e-9)
        assert type(merged.model.layers[0].self_attn.q_proj).__name__ == "ColumnParallelLinear"
        merged.save_pretrained(merged_dir)
    if dist.get_rank() == 0:
        back = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float64)
        torch.testing.assert_close(back(_ids()).logits, trained, rtol=1e-9, atol=1e-9)
    dist.barrier()


@pytest.mark.parametrize("world", [2, 4])
def test_lora_saves_loads_and_merges_as_peft_does(world):
    harness.run(world, _save_load_merge_rank)


def _plain_peft_rank() -> None:
    """PEFT's own calls on a parallelized model, with neither ``tpf.lora`` nor ``tpf.adopt`` (issue 54): a plain
    ``get_peft_model`` puts each adapter in its base's layout, and two AdamW steps give one device's losses, norms and
    every parameter; its ``save_pretrained`` writes one device's file, once; an adapter trained for a base 1/W the size
    (its factors the shape of this rank's blocks) is refused by ``from_pretrained`` and ``load_adapter`` with one
    device's size mismatch, or dropped as there with ``ignore_mismatched_sizes``."""
    import os
    import warnings

    from safetensors.torch import load_file

    from tests.models import tiny_lm, train_lm

    base = _model("llama")
    reference = _reference(base)
    split = tpf.parallelize(copy.deepcopy(base), placement=all_ranks(), plan="auto")
    torch.manual_seed(3)
    model = peft.get_peft_model(split, _config(base)).double()
    _copy_adapters(model, reference)
    attention = model.base_model.model.model.layers[0].self_attn
    assert type(attention.q_proj.lora_B["default"]).__name__ == "ColumnParallelLinear"
    assert type(attention.o_proj.lora_A["default"]).__name__ == "RowParallelLinear"
    with within(90):
        got = train_lm(model, _ids())
    torch.testing.assert_close(got, train_lm(reference, _ids()), rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-6, atol=1e-6, msg=name)

    folder = _folder()
    with within(60):
        model.save_pretrained(f"{folder}/split")  # every rank; rank 0 writes
    if dist.get_rank() == 0:
        reference.save_pretrained(f"{folder}/one")
        assert sorted(os.listdir(f"{folder}/split")) == sorted(os.listdir(f"{folder}/one"))
        written, want = (load_file(f"{folder}/{which}/adapter_model.safetensors") for which in ("split", "one"))
        assert written.keys() == want.keys(), (written.keys() - want.keys(), want.keys() - written.keys())
        for key, value in want.items():
            torch.testing.assert_close(written[key], value, rtol=1e-6, atol=1e-6, msg=key)

    world = dist.get_world_size()  # q_proj's lora_B and o_proj's lora_A of a base with 1/W the heads: a block's shape
    small = peft.get_peft_model(tiny_lm("llama", kv_heads=2 // world, heads=4 // world),
                                peft.LoraConfig(r=4, target_modules=["q_proj", "o_proj"]))
    if dist.get_rank() == 0:
        small.save_pretrained(f"{folder}/small")
    dist.barrier()
    mismatch = r"size mismatch for .*q_proj.lora_B.\w+.weight: copying a param with shape torch.Size\(\[32, 4\]\)"
    with pytest.raises(RuntimeError, match=mismatch):
        peft.PeftModel.from_pretrained(copy.deepcopy(base), f"{folder}/small")  # one device's refusal
    split = tpf.parallelize(copy.deepcopy(base), placement=all_ranks(), plan="auto")
    with within(60), pytest.raises(RuntimeError, match=mismatch):
        peft.PeftModel.from_pretrained(copy.deepcopy(split), f"{folder}/small")
    with within(60), pytest.raises(RuntimeError, match=mismatch):
        model.load_adapter(f"{folder}/small", adapter_name="small")
    with within(60), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = peft.PeftModel.from_pretrained(split, f"{folder}/small", adapter_name="kept",
                                              ignore_mismatched_sizes=True)
    assert any("ignore_mismatched_sizes" in str(w.message) and "q_proj.lora_B" in str(w.message) for w in caught)
    for layer in kept.base_model.model.model.layers:  # PEFT's start, as one device leaves it: lora_B zero
        assert not layer.self_attn.q_proj.lora_B["kept"].weight.full_tensor().any()


def test_plain_peft_calls_on_a_parallelized_model_act_as_on_one_device():
    harness.run(2, _plain_peft_rank, timeout=300)


def _refusals_rank() -> None:
    """What the adapters cannot follow is refused on every rank, naming it, before the model changes."""
    from tests.models import tiny_lm

    base = _model("llama")
    dora = peft.get_peft_model(copy.deepcopy(base), _config(base, use_dora=True))
    with pytest.raises(ValueError, match=r"DoRA .* on a split layer is not supported.*use_dora=False"):
        tpf.parallelize(dora, placement=all_ranks(), plan="auto")
    assert not any(type(m).__name__ == "ColumnParallelLinear" for m in dora.modules())
    assert type(dora.base_model.model.model.layers[0].self_attn.q_proj).__name__ == "Linear"  # PEFT's, put back
    split = tpf.parallelize(copy.deepcopy(base), placement=all_ranks(), plan="auto")
    with pytest.raises(ValueError, match=r"DoRA .* on a split (ColumnParallelLinear|VocabParallelEmbedding) is not "
                                         r"supported"):
        peft.get_peft_model(split, tpf.lora(_config(base, use_dora=True)))

    copies = peft.get_peft_model(_model("qwen3_moe"), peft.LoraConfig(r=4, target_modules=["q_proj"],
                                                                       modules_to_save=["experts"]))
    with pytest.raises(ValueError, match=r"modules_to_save='experts': PEFT's trainable copy of .*cannot take its "
                                         r"entry ExpertTensorParallel"):
        tpf.parallelize(copies, placement=all_ranks(), plan="auto")
    assert type(copies.base_model.model.model.layers[0].mlp.experts).__name__ == "ModulesToSaveWrapper"
    experts = peft.LoraConfig(r=4, target_modules=[], target_parameters=["experts.gate_up_proj"])
    with pytest.raises(ValueError, match=r"target_parameters=.* of a parallelized model is not supported: .*"
                                         r"tpf.parallelize\(get_peft_model"):
        tpf.lora(copy.deepcopy(experts))

    class Holder(torch.nn.Module):  # a wrapper of the user's own: the plan's names miss every layer
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner, self.config = inner, inner.config

    held = Holder(tiny_lm("llama"))
    with within(30), pytest.raises(ValueError, match=r"plan='auto': Holder's plan names its layers "
                                                     r"\['layers.\*.self_attn.q_proj'.* none of its modules is so "
                                                     r"named .*inner.model.layers.0"):
        tpf.parallelize(held, placement=all_ranks(), plan="auto")
    assert not any(type(m).__name__ == "VocabParallelEmbedding" for m in held.modules()), dist.get_rank()

    # an adapter of another base (8 heads, not 4): refused, into the whole base as into the split one (of a base 1/W
    # the size, whose tensors have a block's shape, too: _plain_peft_rank)
    other = peft.get_peft_model(tiny_lm("llama", kv_heads=2, heads=8), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    folder = [_folder()]
    tpf.parallelize(other, placement=all_ranks(), plan="auto").save_pretrained(folder[0])
    with pytest.raises(RuntimeError, match=r"size mismatch for .*q_proj.lora_B"):
        peft.PeftModel.from_pretrained(copy.deepcopy(base), folder[0])
    with pytest.raises(RuntimeError, match=r"size mismatch for .*q_proj.lora_B"):
        peft.PeftModel.from_pretrained(split, folder[0], config=tpf.lora(peft.LoraConfig.from_pretrained(folder[0])))


@pytest.mark.parametrize("world", [1, 2])
def test_what_adapters_cannot_follow_is_refused(world):
    harness.run(world, _refusals_rank)


def _planned_rank(kinds: dict[str, tuple[str, ...]]) -> None:
    """LoRA on models tpflow plans itself (issue 46), PEFT first: GPT-BigCode's multi-query ``c_attn`` (whole on
    every rank, each computing its query heads' and the key / value features: its adapter's B does the same) trains
    as one device; a layer split in place (MPT's ``Wqkv`` blocks) is refused by name, never run unsplit."""
    from tests.models import train_lm
    from tpflow.models.zoo import tiny_model

    for kind, targets in kinds.items():
        base = tiny_model(kind)
        torch.manual_seed(3)
        reference = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=4, target_modules=list(targets)))
        with torch.no_grad():
            for i, (name, p) in enumerate(reference.named_parameters()):
                if "lora_B" in name:
                    p.normal_(std=0.1, generator=torch.Generator().manual_seed(i))
        model = copy.deepcopy(reference)
        try:
            tpf.parallelize(model, placement=all_ranks(), plan="auto")
        except ValueError as e:
            assert kind == "mpt" and "Wqkv" in str(e), (kind, e)
            continue
        want = train_lm(reference, _ids())
        torch.testing.assert_close(train_lm(model, _ids()), want, rtol=1e-6, atol=1e-6, msg=kind)
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.full_tensor(), q, rtol=1e-6, atol=1e-6, msg=f"{kind}: {name}")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_lora_on_tpflows_own_plans_trains_as_one_device(world):
    harness.run(world, _planned_rank, {"gpt_bigcode": ("c_attn", "c_proj", "c_fc"), "mpt": ("Wqkv", "up_proj")},
                timeout=300)
