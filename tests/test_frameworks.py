"""A parallelized model in the loops people run (transformers' ``Trainer`` and TRL's ``SFTTrainer``, accelerate's
``Accelerator``, Lightning's Fabric) against the same loop on one device: losses, gradient norms, every parameter
(fp64) after steps of gradient accumulation, the evaluation's loss, the
saved model reloaded by ``from_pretrained`` on one device, a run resumed from the step-2 checkpoint on the same
ranks, from one device's checkpoint, and one device resumed from the ranks' checkpoint, each ending where the
uninterrupted run ended; 2 and 4 ranks, 1-D tensor parallel and 2 x 2 data x tensor with FSDP2."""

from __future__ import annotations

import contextlib
import io
import os

import pytest
import torch
import torch.distributed as dist

import tpflow as tpf
from tests import harness
from tests.checks import within

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

STEPS, BATCH = 3, 4  # a row's batch; the reference reads the rows' batches as one
EPS = 1e-4  # AdamW's: a near-zero gradient's rounding (summed in another order) must not become a whole step


def _rows(n: int = 32) -> list[dict]:
    from tests.models import VOCAB

    rows = [{"input_ids": torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(i)).tolist()}
            for i in range(n)]
    return [{**r, "labels": list(r["input_ids"])} for r in rows]


def _args(folder: str, batch: int) -> transformers.TrainingArguments:
    """Trainer's defaults but the run's length, lr, AdamW's eps, clipping (that bites), a checkpoint at step 2, and
    ``batch`` rows a step in two micro-batches (gradient accumulation)."""
    return transformers.TrainingArguments(folder, max_steps=STEPS, per_device_train_batch_size=batch // 2,
                                          gradient_accumulation_steps=2, per_device_eval_batch_size=4,
                                          learning_rate=1e-2, max_grad_norm=0.5, seed=0, logging_steps=1,
                                          save_steps=2, report_to=[], use_cpu=True, disable_tqdm=True,
                                          adam_epsilon=EPS)


def _resumed(model, folder: str, batch: int, checkpoint: str, adopt: bool) -> dict[str, torch.Tensor]:
    """``model``'s parameters after a Trainer resumed from ``checkpoint`` runs to the end."""
    trainer = transformers.Trainer(model=model, args=_args(folder, batch), train_dataset=_rows())
    if adopt:
        tpf.adopt(trainer)
    trainer.train(resume_from_checkpoint=checkpoint)
    return _whole(model)


def _whole(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def _logged(trainer) -> tuple[list[float], list[float]]:
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return [h["loss"] for h in logs], [h["grad_norm"] for h in logs]


def _accelerate_loop(model, accelerator, batch: int) -> list[float]:
    """accelerate's own loop: AdamW, its backward and clipping, over a data loader it prepared."""
    collate = transformers.default_data_collator
    loader = torch.utils.data.DataLoader(_rows(), batch_size=batch, collate_fn=collate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=EPS)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for _, inputs in zip(range(STEPS), loader):
        loss = model(**inputs).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _reference(rows: int, folder: str) -> dict:
    """One device: the Trainer's run (its checkpoints in ``folder``) and accelerate's loop over ``rows`` rows'
    batches at once."""
    from tests.models import tiny_lm

    model = tiny_lm("llama")
    trainer = transformers.Trainer(model=model, args=_args(folder, BATCH * rows), train_dataset=_rows())
    trainer.train()
    out = {"trainer": (*_logged(trainer), _whole(model)), "checkpoint": os.path.join(folder, "checkpoint-2"),
           "eval": trainer.evaluate(eval_dataset=_rows(8))["eval_loss"]}
    model = tiny_lm("llama")
    out["accelerate"] = (_accelerate_loop(model, accelerate.Accelerator(cpu=True), BATCH * rows), _whole(model))
    return out


def _parallel(layout: str, vocab_parallel: bool):
    from torch.distributed.fsdp import fully_shard

    from tests.models import tiny_lm

    model = tiny_lm("llama")
    plan = tpf.hf_plan(model, vocab_parallel=vocab_parallel)
    if layout == "2x2":
        placement = tpf.placement("cpu", [[0, 1], [2, 3]], names=("dp", "tp"))
        tpf.parallelize(model, placement=placement, plan=plan)
        for layer in model.model.layers:
            fully_shard(layer, mesh=placement.mesh["dp"])
        fully_shard(model, mesh=placement.mesh["dp"])
        return model
    return tpf.parallelize(model, placement=tpf.placement("cpu", list(range(dist.get_world_size()))), plan=plan)


def _equal(got: dict, want: dict, tol: float) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}: {m}")


def _trainer_rank(reference: dict, layout: str, vocab_parallel: bool, folder: str) -> None:
    """``Trainer`` (one line: ``tpf.adopt``) trains as one device; ``save_model`` writes what ``from_pretrained``
    loads on one device; resumed from its step-2 checkpoint, or from one device's, it ends where the uninterrupted run
    ended. The vocabulary-parallel loss rounds its fp32 sum otherwise than torch's (the model's loss casts fp64
    logits to fp32), so its steps agree to 1e-4, the rest to 1e-8."""
    tol = 1e-8 if not vocab_parallel else 1e-4
    model = _parallel(layout, vocab_parallel)
    trainer = tpf.adopt(transformers.Trainer(model=model, args=_args(folder, BATCH), train_dataset=_rows()))
    with within(120):
        trainer.train()
        trainer.save_model(os.path.join(folder, "saved"))
    losses, norms = _logged(trainer)
    want_losses, want_norms, want_params = reference["trainer"]
    torch.testing.assert_close(losses, want_losses, rtol=1e-6, atol=0)
    torch.testing.assert_close(norms, want_norms, rtol=tol, atol=0)
    trained = _whole(model)
    _equal(trained, want_params, tol)
    with within(60):  # the evaluation's batches split over the rows, each row's losses gathered once
        torch.testing.assert_close(trainer.evaluate(eval_dataset=_rows(8))["eval_loss"], reference["eval"],
                                   rtol=1e-6, atol=0)
    if dist.get_rank() == 0:
        back = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(folder, "saved"), dtype=torch.float64)
        _equal(_whole(back), trained, 0.0)
    tpf.adopt(transformers.Trainer(model=model, args=_args(folder, BATCH), train_dataset=_rows()))  # a second one
    for checkpoint in (os.path.join(folder, "checkpoint-2"), reference["checkpoint"]):
        with within(120):
            resumed = _resumed(_parallel(layout, vocab_parallel), os.path.join(folder, "resumed"), BATCH,
                               checkpoint, adopt=True)
        _equal(resumed, want_params, tol)


def _accelerate_rank(reference: dict, layout: str) -> None:
    """accelerate's ``prepare(model, optimizer, data_loader)`` and its loop, after ``tpf.adopt(accelerator,
    model)``, train as one device does."""
    model = _parallel(layout, vocab_parallel=False)
    accelerator = tpf.adopt(accelerate.Accelerator(cpu=True), model)
    with within(120):
        losses = _accelerate_loop(model, accelerator, BATCH)
    want_losses, want_params = reference["accelerate"]
    if layout != "2x2":  # each row's own loss; the reference's is both rows'
        torch.testing.assert_close(losses, want_losses, rtol=1e-6, atol=0)
    _equal(_whole(model), want_params, 1e-8)


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[int, dict]:
    return {rows: _reference(rows, str(tmp_path_factory.mktemp(f"one-device-{rows}"))) for rows in (1, 2)}


@pytest.mark.parametrize("world, layout, vocab_parallel", [(2, "1d", False), (2, "1d", True), (4, "2x2", False)])
def test_trainer_trains_a_parallelized_model_as_one_device(references, tmp_path, world, layout, vocab_parallel):
    from tests.models import tiny_lm

    rows = 2 if layout == "2x2" else 1
    reference = references[rows]
    harness.run(world, _trainer_rank, reference, layout, vocab_parallel, str(tmp_path))
    # one device resumes from the ranks' checkpoint and ends where its own uninterrupted run ended
    resumed = _resumed(tiny_lm("llama"), str(tmp_path / "one-device"), BATCH * rows,
                       str(tmp_path / "checkpoint-2"), adopt=False)
    _equal(resumed, reference["trainer"][2], 1e-8 if not vocab_parallel else 1e-4)


@pytest.mark.parametrize("world, layout", [(2, "1d"), (4, "2x2")])
def test_accelerate_prepares_a_parallelized_model_as_one_device(references, world, layout):
    harness.run(world, _accelerate_rank, references[2 if layout == "2x2" else 1], layout)


def _texts() -> list[str]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 12, (40,), generator=g).tolist()
    return [" ".join(f"w{j}" for j in torch.randint(0, 90, (n,), generator=g).tolist()) for n in lengths]


def _sft(model, folder: str, batch: int, strategy: str) -> tuple[list[float], list[float], dict]:
    """TRL's SFTTrainer with packing: its losses, its token counts and the trained parameters. ``"bfd"`` packs
    padding-free (a batch flattened into one row, which attention without flash's per-sequence masks reads across);
    ``"wrapped"`` into rows of ``max_length``, which a batch split over data-parallel rows computes alike."""
    import datasets
    from trl import SFTConfig, SFTTrainer

    from tests.models import tiny_tokenizer

    args = SFTConfig(folder, max_steps=STEPS, per_device_train_batch_size=batch, learning_rate=1e-2, packing=True,
                     packing_strategy=strategy,
                     max_length=16, max_grad_norm=0.5, seed=0, logging_steps=1, save_strategy="no", report_to=[],
                     use_cpu=True, disable_tqdm=True, bf16=False, adam_epsilon=EPS)  # fp64 here: no autocast
    trainer = SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict({"text": _texts()}),
                         processing_class=tiny_tokenizer())
    if isinstance(next(model.parameters()), torch.distributed.tensor.DTensor):
        tpf.adopt(trainer)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return [h["loss"] for h in logs], [h["num_tokens"] for h in logs], _whole(model)


def _sft_rank(reference: tuple, layout: str, folder: str, strategy: str) -> None:
    """SFTTrainer (a Trainer) with packed sequences, after tpf.adopt: one device's losses, token counts (each row's
    tokens once, not once per tensor-parallel rank) and parameters."""
    with within(120):
        losses, tokens, params = _sft(_parallel(layout, vocab_parallel=False), folder, BATCH // 2, strategy)
    torch.testing.assert_close(losses, reference[0], rtol=1e-6, atol=0)
    assert tokens == reference[1], (tokens, reference[1])
    # TRL's fused head computes the logits' statistics in fp32 (an fp64 model's too): on the vocabulary's blocks they
    # are summed in another order, fp32's rounding after the steps (1e-7 .. 1e-6)
    _equal(params, reference[2], 2e-6)


@pytest.mark.parametrize("world, layout", [(2, "1d"), (4, "2x2")])
def test_trl_sft_trainer_with_packing_trains_as_one_device(tmp_path, world, layout):
    pytest.importorskip("trl")
    from tests.models import tiny_lm

    rows, strategy = (2, "wrapped") if layout == "2x2" else (1, "bfd")
    reference = _sft(tiny_lm("llama"), str(tmp_path / "one-device"), BATCH // 2 * rows, strategy)
    harness.run(world, _sft_rank, reference, layout, str(tmp_path / "ranks"), strategy)


class _PackedToMultiple:
    """``DataCollatorWithFlattening``'s packed row, padded on the right to a multiple of ``multiple`` tokens (labels
    -100, positions counting on): the lengths a context-parallel cut takes."""

    def __init__(self, multiple: int) -> None:
        self.multiple, self.flatten = multiple, transformers.DataCollatorWithFlattening()

    def __call__(self, features: list[dict]) -> dict:
        batch = self.flatten(features)
        extra = -batch["input_ids"].shape[1] % self.multiple
        last = batch["position_ids"][:, -1:]
        batch["input_ids"] = torch.nn.functional.pad(batch["input_ids"], (0, extra))
        batch["labels"] = torch.nn.functional.pad(batch["labels"], (0, extra), value=-100)
        batch["position_ids"] = torch.cat([batch["position_ids"], last + 1 + torch.arange(extra)[None]], 1)
        return batch


def _packed_trainer(model, folder: str) -> tuple[list[float], dict]:
    """Trainer on packed documents (4 a step), its losses and the trained parameters."""
    import datasets

    from tests.models import VOCAB

    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(3, VOCAB, (n,), generator=g).tolist()}
            for n in (5, 7, 4, 9, 6, 3, 8, 6, 5, 7, 4, 9)]
    args = transformers.TrainingArguments(folder, max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-2,
                                          max_grad_norm=0.5, seed=0, logging_steps=1, save_strategy="no",
                                          report_to=[], use_cpu=True, disable_tqdm=True, adam_epsilon=EPS)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                                   data_collator=_PackedToMultiple(4))
    if isinstance(next(model.parameters()), torch.distributed.tensor.DTensor):
        tpf.adopt(trainer)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], _whole(model)


# a dense model, and a hybrid whose gated DeltaNets pass their state from rank to rank (the delta rule computes in
# fp32 on one device as under the split, whose summaries it combines in another order: its steps agree to 1e-5)
PACKED = {"llama": ({}, None, 1e-8),
          "qwen3_5_text": ({"layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2,
                            "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8},
                           "state_passing", 1e-5)}


def _packed_rank(reference: tuple, kind: str, family: str, folder: str) -> None:
    """A context-parallel model under Trainer (``tpf.adopt``: every rank reads the same packed rows) trains as one
    device: its losses and every parameter."""
    from tests.models import tiny_lm

    extra, mixers, tol = PACKED[family]
    ref = tiny_lm(family, **extra)
    plan = tpf.hf_plan(ref, context_parallel=kind, **({"mixers": mixers} if mixers else {}))
    model = tpf.parallelize(ref, placement=tpf.placement("cpu", [0, 1]), plan=plan)
    with within(120):
        losses, params = _packed_trainer(model, folder)
    torch.testing.assert_close(losses, reference[0], rtol=1e-6, atol=0)
    _equal(params, reference[1], tol)


@pytest.mark.parametrize("kind,family", [("ring", "llama"), ("ulysses", "llama"), ("ring", "qwen3_5_text")])
def test_trainer_trains_a_context_parallel_model_on_packed_documents_as_one_device(tmp_path, kind, family):
    pytest.importorskip("datasets")
    from tests.models import tiny_lm

    reference = _packed_trainer(tiny_lm(family, **PACKED[family][0]), str(tmp_path / "one-device"))
    harness.run(2, _packed_rank, reference, kind, family, str(tmp_path / "ranks"))


def _plain_loop(model, ids: torch.Tensor, backward=None, clip=None) -> list[float]:
    """AdamW steps with clipping on ``ids`` (``backward`` / ``clip``: a framework's own)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=EPS)
    losses = []
    for _ in range(STEPS):
        loss = model(ids, labels=ids).loss
        (backward or torch.Tensor.backward)(loss)
        (clip or (lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _fabric_rank(reference: tuple, layout: str) -> None:
    """Lightning Fabric's ModelParallelStrategy with ``tpf.parallelize`` (and FSDP2 over a data axis) as its
    ``parallelize_fn``: one device's losses and parameters; each data-parallel row reads its rows of the batch."""
    import lightning
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from tests.models import VOCAB, tiny_lm

    def parallelize_fn(model, device_mesh):  # the user's: tensor parallel over Fabric's mesh, FSDP2 over its data axis
        P = tpf.placement("cpu", device_mesh.mesh.tolist(), names=("dp", "tp"))
        tpf.parallelize(model, placement=P, plan=tpf.hf_plan(model, vocab_parallel=False))
        if P.hierarchy[0] > 1:
            for layer in model.model.layers:
                fully_shard(layer, mesh=P.mesh["dp"])
            fully_shard(model, mesh=P.mesh["dp"])
        return model

    rows = 2 if layout == "2x2" else 1
    strategy = ModelParallelStrategy(parallelize_fn, data_parallel_size=rows,
                                     tensor_parallel_size=dist.get_world_size() // rows)
    fabric = lightning.Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy)
    fabric.launch()
    with fabric.init_module():
        model = fabric.setup(tiny_lm("llama"))
    ids = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(0))
    mine = ids.tensor_split(rows)[dist.get_rank() // (dist.get_world_size() // rows)]
    optimizer = None

    def clip():
        fabric.clip_gradients(model, optimizer, max_norm=0.5)

    with within(120):
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, eps=EPS))
        losses = []
        for _ in range(STEPS):
            loss = model(mine, labels=mine).loss
            fabric.backward(loss)
            clip()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    if layout == "1d":
        torch.testing.assert_close(losses, reference[0], rtol=1e-6, atol=0)
    params = {n.removeprefix("_forward_module."): p for n, p in _whole(model).items()}
    _equal(params, reference[1], 1e-8 if layout == "1d" else 1e-7)


@pytest.mark.parametrize("world, layout", [(2, "1d"), (4, "2x2")])
def test_lightning_fabric_model_parallel_strategy_trains_as_one_device(world, layout):
    pytest.importorskip("lightning")
    from tests.models import VOCAB, tiny_lm

    model = tiny_lm("llama")
    losses = _plain_loop(model, torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(0)))
    harness.run(world, _fabric_rank, (losses, _whole(model)), layout)


def _rows_rank() -> None:
    """From parallelize on, accelerate and Trainer's arguments see the data-parallel rows as their processes: the
    counts, the main process (one rank), their collectives (a gather over the rows, a broadcast from a row's leader
    to every rank, an explicit group passing through, a global tensor gathered whole)."""
    from accelerate.utils import broadcast_object_list, gather, gather_object, reduce

    from tests.models import tiny_lm

    rank, world = dist.get_rank(), dist.get_world_size()
    layout = "2x2" if world == 4 else "1d"
    args = transformers.TrainingArguments("unused", report_to=[], use_cpu=True)  # built before: read live
    if world == 3:  # heads that split over 3 ranks; the vocabulary's 101 rows do not evenly
        model = tpf.parallelize(tiny_lm("qwen3", heads=6, kv_heads=3), placement=tpf.placement("cpu", [0, 1, 2]),
                                plan="auto")
    else:
        model = _parallel(layout, vocab_parallel=True)
    rows, row = (2, rank // 2) if layout == "2x2" else (1, 0)
    state = accelerate.PartialState(cpu=True)
    assert (state.num_processes, state.process_index, state.local_process_index) == (rows, row, rank)  # its GPU's
    assert (args.world_size, args.process_index) == (rows, row)
    assert state.is_main_process == args.should_save == args.should_log == (rank == 0)
    assert state.is_last_process == (rank == world - world // rows)
    assert state.use_distributed == (world > 1)  # rows of several ranks: main-process-only code on one
    ran = []
    state.on_main_process(lambda: ran.append(rank))()
    state.on_process(lambda: ran.append(-rank), process_index=rows - 1)()
    assert ran == ([0] if rank == 0 else []) + ([-rank] if rank == world - world // rows else [])
    assert gather(torch.tensor([float(row)])).tolist() == list(map(float, range(rows)))
    assert reduce(torch.tensor([row + 1.0]), reduction="sum").item() == rows * (rows + 1) / 2
    assert gather_object([row]) == list(range(rows))
    told = broadcast_object_list([rank if state.is_main_process or rank == 2 else None], from_process=rows - 1)
    assert told == [2 if rows == 2 else 0]  # from the last row's leader, to every rank
    world_sum = torch.ones(1)
    accelerate.utils.operations.torch.distributed.all_reduce(world_sum, group=dist.group.WORLD)
    assert world_sum.item() == world  # an explicit group is the caller's
    ids = torch.randint(0, 50, (1, 6))  # a batch of one: the argmax torch's own handler fails on
    logits = model(ids).logits
    whole = gather(logits.argmax(-1))  # split logits' argmax, gathered whole (accelerate's own gather)
    assert not isinstance(whole, torch.distributed.tensor.DTensor)
    assert torch.equal(whole, torch.cat([logits.full_tensor().argmax(-1)] * rows))
    with pytest.raises(ValueError, match="got a global tensor laid out .* take the whole value first"):
        dist.all_gather([torch.empty(1, 6, dtype=torch.int64)] * world, logits.argmax(-1))  # the user's own


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_frameworks_see_the_rows_as_their_processes(world):
    harness.run(world, _rows_rank)  # world 1: a world of one, one row


def _refusals_rank() -> None:
    trl = pytest.importorskip("trl")
    with pytest.raises(ValueError, match="was not parallelized"):
        tpf.adopt(accelerate.Accelerator(cpu=True), torch.nn.Linear(2, 2))
    early = trl.GRPOConfig("unused", per_device_train_batch_size=2, num_generations=2, report_to=[], use_cpu=True)
    model = _parallel("1d", vocab_parallel=True)
    late = trl.GRPOConfig("unused", per_device_train_batch_size=2, num_generations=2, report_to=[], use_cpu=True)
    assert (early.generation_batch_size, late.generation_batch_size) == (4, 2)  # 2 processes; then one row
    with pytest.raises(ValueError, match=r"GRPOConfig was built before tpf.parallelize: it took "
                                         r"generation_batch_size=4 from 2 processes, .* generation_batch_size=2"):
        tpf.adopt(transformers.Trainer(model=model, args=early))
    tpf.adopt(transformers.Trainer(model=model, args=late))


def test_adopt_refuses_a_model_parallelize_did_not_change_and_a_config_counted_over_every_rank():
    harness.run(2, _refusals_rank)
