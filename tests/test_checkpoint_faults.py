"""Checkpoint faults that used to load a silently wrong model, hang, or end in words that name nothing: each ends on
every rank within seconds with its cause named, or is avoided (issue 54, item 7).

- ranks loading checkpoints that differ in one tensor (a split one, in any rank's block; a broadcast one);
- a save that fails on one rank while the others are in it, ``save_pretrained`` called on rank 0 only,
  ``atomic_folder`` given another path on each rank;
- a Trainer checkpoint torn by a killed rank, picked by ``resume_from_checkpoint=True``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

import tpflow as tpf
from tests import harness
from tests.checks import all_ranks, within

safetensors = pytest.importorskip("safetensors.torch")
transformers = pytest.importorskip("transformers")


def _shared_folder() -> str:
    """A temporary folder rank 0 makes, the same on every rank."""
    holder = [tempfile.mkdtemp(prefix="tpflow-checkpoint-faults-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


@contextlib.contextmanager
def _removed(folder: str) -> Iterator[None]:
    """Every rank's block, then ``folder`` removed by rank 0 once every rank is done with it."""
    try:
        yield
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(folder)


def _placement() -> tpf.Placement:
    """Every rank: 1-D on 2 ranks; 2 data-parallel rows of 2 tensor-parallel ranks on 4 (blocks read twice)."""
    W = dist.get_world_size()
    return all_ranks() if W == 2 else tpf.placement("cpu", [[0, 1], [2, 3]])


def _variants(state: dict[str, torch.Tensor], folder: str) -> dict[str, str]:
    """Checkpoints that differ from ``state`` in one tensor only, where the files' sampled windows do not look
    (asserted): a row of the embedding in the first block, one in the last block, the final norm (broadcast). Name ->
    the tensor that differs."""
    from tpflow.checkpoint.digests import fingerprint

    good = os.path.join(folder, "good", "model.safetensors")
    rows = state["model.embed_tokens.weight"].shape[0]
    variants = {}
    for name, key, candidates in (("first", "model.embed_tokens.weight", range(rows // 4)),
                                  ("last", "model.embed_tokens.weight", range(rows - 1, rows - rows // 4, -1)),
                                  ("norm", "model.norm.weight", range(1))):
        file = os.path.join(folder, name, "model.safetensors")
        os.makedirs(os.path.dirname(file))
        for row in candidates:
            changed = state[key].clone()
            changed[row] += 0.5
            safetensors.save_file({**state, key: changed}, file)
            if fingerprint(file) == fingerprint(good):
                break
        else:
            raise AssertionError(f"every changed row of {key} lies in a window the file check samples")
        variants[name] = key
    return variants


def _read_digests_rank() -> None:
    from tests.models import tiny_lm

    rank, odd = dist.get_rank(), dist.get_world_size() - 1
    folder = _shared_folder()
    reference = tiny_lm("llama")
    state = {k: v.contiguous() for k, v in reference.state_dict().items()}
    with _removed(folder):
        if rank == 0:
            os.makedirs(os.path.join(folder, "good"))
            safetensors.save_file(state, os.path.join(folder, "good", "model.safetensors"))
            variants = [_variants(state, folder)]
        else:
            variants = [None]
        dist.broadcast_object_list(variants, src=0)

        def split() -> torch.nn.Module:
            with tpf.meta_parameters():
                model = transformers.AutoModelForCausalLM.from_config(reference.config).double()
            return tpf.parallelize(model, placement=_placement(), plan="auto")

        for name, key in variants[0].items():  # the last rank reads a checkpoint that differs in one tensor
            mine = os.path.join(folder, name if rank == odd else "good")
            expected = rf"load_safetensors: the ranks read different values for '{key}' \[[0-9:, +]*\] \(rank .*" \
                       rf"rank {odd} from {folder}/{name}/model.safetensors: CRC-32 .*\): point every rank at the same"
            with within(60), pytest.raises(ValueError, match=expected):
                tpf.load_safetensors(split(), mine)
        model = tpf.load_safetensors(split(), os.path.join(folder, "good"))  # one checkpoint: one device's model
        for key, value in model.state_dict().items():
            torch.testing.assert_close(value.full_tensor(), state[key], rtol=0, atol=0, msg=key)
        ids = torch.randint(0, reference.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
        logits = model(ids).logits
        torch.testing.assert_close(logits.full_tensor() if hasattr(logits, "full_tensor") else logits,
                                   reference(ids).logits, rtol=0, atol=1e-12)


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_reading_another_checkpoint_in_one_tensor_is_named(world):
    harness.run(world, _read_digests_rank)


def _saves_on_some_ranks_rank() -> None:
    """save_pretrained and atomic_folder on rank 0 alone (the data-parallel habit, the others in a barrier) end within
    seconds on rank 0, naming the ranks that did not call them; a rank calling after raises the same; then every rank
    saves. atomic_folder given another path on each rank is refused on every rank, naming each path, before the block
    runs: nothing staged, nothing published."""
    from tests.models import tiny_lm

    rank, W = dist.get_rank(), dist.get_world_size()
    folder = _shared_folder()
    reference = tiny_lm("llama")
    model = tpf.parallelize(reference, placement=all_ranks(), plan="auto")
    whole = {k: v.full_tensor() for k, v in model.state_dict().items()}
    target = os.path.join(folder, "model")
    others = "rank 1" if W == 2 else f"ranks {', '.join(map(str, range(1, W)))}"
    cases = (
        (lambda: model.save_pretrained(target),
         rf"save_pretrained: {others} did not call it within 2 s of rank 0: call model.save_pretrained on every rank, "
         r"not under `if rank == 0`"),
        (lambda: tpf.checkpoint.atomic_folder(target).__enter__(),
         rf"atomic_folder: {others} did not call it within 2 s of rank 0: enter tpf.checkpoint.atomic_folder on every "
         "rank"),
    )
    with _removed(folder):
        for call, expected in cases:
            if rank == 0:
                start = time.monotonic()
                with within(30), tpf.config.override(timeout=2), pytest.raises(RuntimeError, match=expected):
                    call()
                assert time.monotonic() - start < 10, f"rank 0 waited {time.monotonic() - start:.0f} s"
            dist.barrier()  # where the other ranks were meanwhile
            if rank != 0:  # a rank that comes after: the same error at once
                with within(30), pytest.raises(RuntimeError, match=expected):
                    call()
        assert os.listdir(folder) == [], os.listdir(folder)
        with within(60):
            model.save_pretrained(target)  # every rank: it saves
        if rank == 0:
            saved = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float64).state_dict()
            for key, value in whole.items():
                torch.testing.assert_close(saved[key], value, rtol=0, atol=0, msg=key)
        mine = os.path.join(folder, f"step-of-rank-{rank}")
        paths = "; ".join(f"rank {r}: {folder}/step-of-rank-{r}" for r in range(W))
        refused = rf"tpf.checkpoint.atomic_folder: the ranks disagree on the path \({paths}\): enter it with the " \
                  "same path on every"
        with within(30), pytest.raises(ValueError, match=refused), tpf.checkpoint.atomic_folder(mine):
            raise AssertionError("the block ran")
        dist.barrier()
        assert sorted(os.listdir(folder)) == ["model"], os.listdir(folder)


@pytest.mark.parametrize("world", [2, 4])
def test_a_save_called_on_some_ranks_or_with_other_paths_is_named_at_once(world):
    harness.run(world, _saves_on_some_ranks_rank)


FAILING_SAVE = """
import sys
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
import tpflow as tpf

P = tpf.placement("cpu", ranks=[0, 1])
model = tpf.parallelize(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)), placement=P,
                        plan={"0": "column", "1": "row"})
with tpf.checkpoint.atomic_folder(sys.argv[1]) as folder:
    if tpf.get_rank() == 1:  # before its part of dcp.save, in whose first collective rank 0 waits for it
        raise CheckpointException("planning failed", {1: (OSError("no space left on rank 1's disk"), None)})
    dcp.save(model.state_dict(), checkpoint_id=folder)
"""


def test_a_rank_failing_in_a_save_ends_the_launch_at_once_with_its_error(tmp_path, monkeypatch):
    # rank 1 raises torch.distributed.checkpoint's CheckpointException (a BaseException) in atomic_folder while rank 0
    # waits for it in dcp.save: the launch ends within seconds, not the timeout, and says rank 1's error
    monkeypatch.setenv("TPFLOW_TIMEOUT", "120")
    script = tmp_path / "save.py"
    script.write_text(FAILING_SAVE)
    start = time.monotonic()
    proc = harness.run_python(["-m", "tpflow.launch", "--nproc_per_node", "2", str(script), str(tmp_path / "step")])
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr[-4000:]
    report = proc.stderr[proc.stderr.index("Traceback"):].splitlines()
    assert "torch.distributed.checkpoint.api.CheckpointException: CheckpointException ranks:dict_keys([1])" in report
    assert "OSError: no space left on rank 1's disk" in report, report
    assert "tpflow.launch: rank 1 raised this error" in report, report
    assert "no Python error" not in proc.stderr, proc.stderr[-4000:]
    assert elapsed < 60, f"the launch took {elapsed:.0f} s to fail: a rank waited out the timeout"
    assert not (tmp_path / "step").exists(), "a failed save was published"


def _torn_trainer_checkpoint_rank() -> None:
    """A Trainer's last checkpoint torn by a killed rank (the model only; then empty): resume_from_checkpoint=True
    passes over it, saying so, and ends where the uninterrupted run ended; named, it is refused by name; with every
    checkpoint torn, resuming names them all."""
    from tests.models import VOCAB, tiny_lm

    rank = dist.get_rank()
    folder = _shared_folder()
    rows = [{"input_ids": ids, "labels": ids} for ids in
            (torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(16))]
    args = transformers.TrainingArguments(folder, max_steps=4, save_steps=2, per_device_train_batch_size=2,
                                          learning_rate=1e-2, seed=0, report_to=[], use_cpu=True, disable_tqdm=True)

    def trainer() -> transformers.Trainer:
        model = tiny_lm("llama")
        tpf.parallelize(model, placement=all_ranks(), plan=tpf.hf_plan(model, vocab_parallel=False))
        return tpf.adopt(transformers.Trainer(model=model, args=args, train_dataset=rows))

    def whole(model) -> dict[str, torch.Tensor]:
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}

    with _removed(folder):
        first = trainer()
        with within(120):
            first.train()
        want = whole(first.model)
        last, earlier = os.path.join(folder, "checkpoint-4"), os.path.join(folder, "checkpoint-2")
        if rank == 0:  # a rank killed while the others saved: the model written, nothing after it
            for name in os.listdir(last):
                if name != "model.safetensors":
                    os.remove(os.path.join(last, name))
        dist.barrier()
        again = trainer()
        with within(120), pytest.warns(UserWarning, match=r"resuming from checkpoint-2, the last whole checkpoint in "
                                                          r".*; passed over: checkpoint-4 is torn \(it lacks "
                                                          r"trainer_state.json, which the Trainer writes last; it "
                                                          r"holds \['model.safetensors'\]\)"):
            again.train(resume_from_checkpoint=True)
        for name, value in whole(again.model).items():
            torch.testing.assert_close(value, want[name], rtol=1e-8, atol=1e-8, msg=name)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(last)
            os.makedirs(last)  # killed before the model was written
        dist.barrier()
        with within(60), pytest.raises(ValueError, match=rf"{last} is a torn checkpoint: it is empty \(a save that "
                                                         r"did not finish, a rank killed half way\): resume from an "
                                                         r"earlier one"):
            trainer().train(resume_from_checkpoint=last)
        dist.barrier()
        if rank == 0:
            os.remove(os.path.join(earlier, "trainer_state.json"))
        dist.barrier()
        with within(60), pytest.raises(ValueError, match=r"resume_from_checkpoint=True: no whole checkpoint in .*: "
                                                         r"checkpoint-4 is torn \(it is empty\); checkpoint-2 is torn"):
            trainer().train(resume_from_checkpoint=True)


def test_a_torn_trainer_checkpoint_is_passed_over_or_named():
    harness.run(2, _torn_trainer_checkpoint_rank)
