"""The scripts users run (``tests/real_scripts.py``: transformers' run_clm.py, accelerate's complete_nlp_example.py,
TRL's trainers), with tpflow's documented lines, on 2 ranks (1-D tensor parallel) and 4 (1-D, and 2 x 2 data x
tensor with FSDP2), against the same script as one plain process with the same seeds: every logged number, every
evaluation (the first one too), the trained parameters, a resume from a checkpoint, and every file written (none
lost, none touched that the script did not write)."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

from tests import harness
from tests.checks import within

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets").disable_progress_bars()

from tests import real_scripts  # noqa: E402  (after the skips: it imports transformers' and datasets' users)

PARAMS_TOL = 1e-4  # the vocabulary-parallel loss sums its fp32 terms in another order than the model's own fp32 loss
_TIMINGS = ("runtime", "per_second", "total_flos", "step_time")  # how long, not what


def _clm_argv(folder: str, batch: int, resume: str | None = None) -> list[str]:
    argv = ["--output_dir", folder, "--do_train", "--do_eval", "--max_steps", "4", "--per_device_train_batch_size",
            str(batch), "--gradient_accumulation_steps", "2", "--per_device_eval_batch_size", "4", "--learning_rate",
            "1e-2", "--adam_epsilon", "1e-4", "--max_grad_norm", "0.5", "--eval_strategy", "steps", "--eval_steps",
            "2", "--save_steps", "2", "--logging_steps", "1", "--seed", "0", "--report_to", "none", "--use_cpu",
            "--disable_tqdm", "true", "--log_level", "warning"]
    return argv + (["--resume_from_checkpoint", resume] if resume else [])


def _close_logs(got: list[dict], want: list[dict]) -> None:
    """Every logged number of every step and evaluation: the same keys, losses and norms to the loss's fp32
    rounding, accuracies and counts exactly."""
    assert [sorted(k for k in h if not k.endswith(_TIMINGS)) for h in got] == \
        [sorted(k for k in h if not k.endswith(_TIMINGS)) for h in want], (got, want)
    for g, w in zip(got, want):
        for key, value in w.items():
            if key.endswith(_TIMINGS):
                continue
            if key.endswith(("accuracy", "step", "epoch", "samples")):
                assert g[key] == value, (key, g[key], value)
            else:
                assert g[key] == pytest.approx(value, rel=1e-4, abs=1e-7), (key, g[key], value)


def _close_params(got: dict, want: dict, tol: float = PARAMS_TOL) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}: {m}")


def _split(runs: list[dict], world: int) -> None:
    """Each rank held its share of the model, not the whole: about 1/world (its tensor-parallel block, and on 2 x 2
    FSDP2's half of it), norms and the key / value heads kept whole where there are fewer than ranks aside."""
    for rank, run in enumerate(runs):
        assert run["held"] <= 1 / world + 0.1, (rank, run["held"])


def _files(digests: dict[str, str]) -> set[str]:
    """A folder's files, the random states aside (one a process: the rows' count of them)."""
    return {f for f in digests if not os.path.basename(f).startswith("rng_state")}


def _run_clm_rank(layout: str, folder: str, batch: int, lora: bool) -> dict:
    """run_clm.py, then run_clm.py resumed from its step-2 checkpoint into another folder."""
    with within(300):
        first = real_scripts.run_clm(_clm_argv(os.path.join(folder, "out"), batch), layout, lora)
        resumed = real_scripts.run_clm(_clm_argv(os.path.join(folder, "resumed"), batch,
                                                 os.path.join(folder, "out", "checkpoint-2")), layout, lora)
    return {"first": first, "resumed": resumed}


@pytest.mark.parametrize("world, layout, lora", [(2, "1d", False), (4, "2x2", False), (2, "1d", True),
                                                 (4, "2x2", True)])  # (4 ranks in a row: the 2 x 2 grid's axes hold it)
def test_run_clm_trains_evaluates_saves_and_resumes_as_one_process(tmp_path, world, layout, lora):
    rows = 2 if layout == "2x2" else 1
    batch = 2
    reference = real_scripts.run_clm(_clm_argv(str(tmp_path / "one" / "out"), batch * rows), None, lora)
    runs = harness.run(world, _run_clm_rank, layout, str(tmp_path / "ranks"), batch, lora, timeout=600)
    _split([run["first"] for run in runs], world)
    got = runs[0]
    first = got["first"]
    _close_logs(first["history"], reference["history"])
    _close_logs([first["eval"]], [reference["eval"]])
    _close_params(first["params"], reference["params"])
    # save_model() into the folder that holds the checkpoints: every file already there kept, byte for byte, and the
    # folder holds what one process's holds
    before, after = first["before_save"], first["after_save"]
    assert {f: d for f, d in after.items() if f in before and f.startswith("checkpoint-")} == \
        {f: d for f, d in before.items() if f.startswith("checkpoint-")}
    assert _files(after) == _files(reference["after_save"]), _files(after) ^ _files(reference["after_save"])
    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    assert {f"checkpoint-2/{weights}", f"checkpoint-4/{weights}", weights} <= after.keys()
    # resumed from the ranks' step-2 checkpoint, on the ranks and on one process: where the uninterrupted run ended,
    # every number logged after the resume one process's (the run's mean training loss is of the resumed steps)
    one = real_scripts.run_clm(_clm_argv(str(tmp_path / "one" / "resumed"), batch * rows,
                                         str(tmp_path / "ranks" / "out" / "checkpoint-2")), None, lora)
    _close_params(one["params"], reference["params"])
    _close_params(got["resumed"]["params"], reference["params"])
    _close_logs(got["resumed"]["history"], one["history"])
    _close_logs([got["resumed"]["eval"]], [reference["eval"]])


def _nlp_rank(layout: str | None, folder: str) -> dict:
    """complete_nlp_example.py, then the same resumed from its step-4 state (``load_state``). Its last line,
    ``end_training``, destroys the world of plain processes: the pool's is kept (tpflow keeps its own itself)."""
    with within(300), mock.patch.object(torch.distributed, "destroy_process_group", lambda group=None: None):
        first = real_scripts.complete_nlp_example(os.path.join(folder, "out"), layout)
        resumed = real_scripts.complete_nlp_example(os.path.join(folder, "resumed"), layout,
                                                    os.path.join(folder, "out", "step_4"))
    return {"first": first, "resumed": resumed}


def _close_run(got: dict, want: dict) -> None:
    assert got["evals"] == want["evals"]  # the epochs' accuracies over the gathered predictions
    torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-6, atol=0)
    assert got["rates"] == pytest.approx(want["rates"], rel=1e-12)  # the schedule stepped as the processes step it
    _close_params(got["params"], want["params"])


@pytest.mark.parametrize("world, layout", [(2, "1d"), (4, "2x2")])
def test_accelerate_complete_nlp_example_as_its_processes(tmp_path, world, layout):
    """1-D: one plain process; 2 x 2: its two data-parallel rows as two plain processes (DDP), each row's numbers
    its process's. A prepared scheduler steps once a step a row; save_state / load_state resume where the run
    ended; the argmax of the split logits gathers for metrics."""
    pytest.importorskip("accelerate")
    rows = 2 if layout == "2x2" else 1
    if rows == 1:
        want = [real_scripts.complete_nlp_example(str(tmp_path / "one" / "out"))]
        want[0]["resumed"] = real_scripts.complete_nlp_example(str(tmp_path / "one" / "resumed"), None,
                                                               str(tmp_path / "one" / "out" / "step_4"))
        want = [{"first": want[0], "resumed": want[0].pop("resumed")}]
    else:
        want = harness.run(rows, _nlp_rank, None, str(tmp_path / "one"), timeout=600)
    got = harness.run(world, _nlp_rank, layout, str(tmp_path / "ranks"), timeout=600)
    _split([run["first"] for run in got], world)
    for rank, run in enumerate(got):
        reference = want[rank * rows // world]
        _close_run(run["first"], reference["first"])
        _close_run(run["resumed"], reference["resumed"])
    files = got[0]["first"]["files"]
    assert files.keys() == want[0]["first"]["files"].keys(), files.keys() ^ want[0]["first"]["files"].keys()
    # one process resumes from the ranks' step-4 state as from its own
    if rows == 1:
        one = real_scripts.complete_nlp_example(str(tmp_path / "one" / "cross"), None,
                                                str(tmp_path / "ranks" / "out" / "step_4"))
        _close_run(one, want[0]["resumed"])


def _trl_rank(kind: str, model_path: str, folder: str, layout: str | None, config: dict) -> dict:
    with within(300), mock.patch.object(torch.distributed, "destroy_process_group", lambda group=None: None):
        return real_scripts.trl_trainer(kind, model_path, folder, layout, **config)


# beta > 0: the KL from the reference model, a difference of nearly equal log-probabilities, compared without TRL's
# bf16 autocast (which runs the fused head's product in bf16 for an fp64 model too: the split models' hidden states,
# an fp64 rounding off one process's, flip a bf16 rounding of a logit now and then, and the KL magnifies it)
_TRL = [("grpo", 2, "1d", {"num_generations": 4, "scale_rewards": "group", "beta": 0.0}),
        ("grpo", 2, "1d", {"num_generations": 2, "scale_rewards": "batch", "beta": 0.04, "bf16": False}),
        ("grpo", 4, "2x2", {"num_generations": 2, "scale_rewards": "batch", "beta": 0.04, "bf16": False}),
        ("dpo", 2, "1d", {}), ("dpo", 4, "2x2", {}), ("reward", 2, "1d", {}), ("reward", 4, "2x2", {}),
        ("sft", 4, "2x2", {})]


@pytest.mark.parametrize("kind, world, layout, config", _TRL, ids=[f"{k}-{w}-{lay}-{'-'.join(map(str, c.values()))}"
                                                                  for k, w, lay, c in _TRL])
def test_trl_trainers_as_their_processes(tmp_path, kind, world, layout, config):
    """TRL's GRPO (scale_rewards both ways, beta 0 and above, num_generations above 1: sampled completions, rewards
    and their statistics over the batch), DPO (its reference model built from the model's folder), Reward and SFT
    trainers, with TRL's default bf16 autocast: every logged number and the trained parameters of one plain process
    (1-D), or of the rows as plain DDP processes (2 x 2)."""
    pytest.importorskip("trl")
    rows = 2 if layout == "2x2" else 1
    model_path = real_scripts.saved_model(str(tmp_path / "model"), reward=kind == "reward")
    if rows == 1:
        want = [real_scripts.trl_trainer(kind, model_path, str(tmp_path / "one"), None, **config)]
    else:
        want = harness.run(rows, _trl_rank, kind, model_path, str(tmp_path / "one"), None, config, timeout=600)
    got = harness.run(world, _trl_rank, kind, model_path, str(tmp_path / "ranks"), layout, config, timeout=600)
    _split(got, world)
    if config.get("beta", 0.1) > 0 and kind in ("grpo", "dpo"):  # the reference model, split as the policy is
        _split([{"held": run["held_reference"]} for run in got], world)
    for rank, run in enumerate(got):
        reference = want[rank * rows // world]
        _close_logs(run["history"], reference["history"])
        _close_params(run["params"], reference["params"])
