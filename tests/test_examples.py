"""Every seed scenario in examples/ runs through the launcher (and as one plain process) and
checks its own values against one device."""

from __future__ import annotations

import pytest

from tests import harness
from tests.harness import ROOT

EXAMPLES = {  # ranks under the launcher
    "data_parallel.py": 2,
    "model_parallel.py": 2,
    "pipeline_two_stage.py": 2,
    "hybrid_module_model.py": 4,
    "data_parallel_training.py": 2,
    "hybrid_mlp_digits.py": 2,
    "pipeline_lenet.py": 2,
    "pipeline_module_model.py": 4,
}
PIPELINES = {"pipeline_lenet.py", "pipeline_module_model.py"}  # a rank per stage: no one-process run
FINETUNE = "finetune_hf.py"  # compares its runs with each other (test_finetune_hf_matches_one_device)


def test_every_example_is_listed():
    assert sorted(p.name for p in (ROOT / "examples").glob("*.py")) == sorted([*EXAMPLES, FINETUNE])


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_under_launcher(name):
    nproc = EXAMPLES[name]
    proc = harness.run_python(["-m", "tpflow.launch", "--nproc_per_node", str(nproc), f"examples/{name}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("matches one device") + proc.stdout.count("w = [") >= nproc, proc.stdout


@pytest.mark.parametrize("name", sorted(set(EXAMPLES) - PIPELINES))
def test_example_as_one_process(name):
    proc = harness.run_python([f"examples/{name}"])
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_pipeline_example_says_how_to_launch_it(name):
    proc = harness.run_python([f"examples/{name}"])
    assert proc.returncode == 1 and f"python -m tpflow.launch --nproc_per_node {EXAMPLES[name]}" in proc.stderr


def _losses(stdout: str) -> dict[int, float]:
    return {int(line.split()[1]): float(line.split()[3]) for line in stdout.splitlines() if line.startswith("step ")}


def _generated(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("generated "))


def test_finetune_hf_matches_one_device(tmp_path):
    """A Hugging Face model by its own plan on 2 ranks, saved halfway and resumed: one device's losses and tokens;
    and the 2-rank checkpoint resumed on one rank (resharded on load) goes on as the others do. Each run exports
    the trained model with save_pretrained and loads it back on one device (the example checks the logits)."""
    pytest.importorskip("transformers")
    two = harness.run_python(["-m", "tpflow.launch", "--nproc_per_node", "2", f"examples/{FINETUNE}", "--checkpoint",
                str(tmp_path / "ckpt")])
    assert two.returncode == 0, two.stderr[-4000:]
    one = harness.run_python([f"examples/{FINETUNE}"])
    assert one.returncode == 0, one.stderr[-4000:]
    resumed = harness.run_python([f"examples/{FINETUNE}", "--resume", str(tmp_path / "ckpt")])
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    want = _losses(one.stdout)
    assert sorted(want) == list(range(6)) and want[5] < want[0], one.stdout
    for run, steps in ((two, range(6)), (resumed, range(3, 6))):
        got = _losses(run.stdout)
        assert sorted(got) == list(steps), run.stdout
        for step in steps:
            assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-5), (step, run.stdout, one.stdout)
        assert _generated(run.stdout) == _generated(one.stdout)
    for run in (two, one, resumed):
        assert "from_pretrained on one device: logits within" in run.stdout, run.stdout
