"""Every seed scenario in examples/ runs through the launcher (and as one plain process) and
checks its own values against one device."""

from __future__ import annotations

import pytest

from tests.conftest import EXAMPLES, FINETUNE, PIPELINES
from tests.harness import ROOT, run_scripts


def test_every_example_is_listed():
    assert sorted(p.name for p in (ROOT / "examples").glob("*.py")) == sorted([*EXAMPLES, FINETUNE.split("/")[1]])


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_under_launcher(name, launches):
    nproc = EXAMPLES[name]
    ran = launches.get(nproc)[0][f"examples/{name}"]
    assert ran.code == 0, ran.stdout[-4000:]
    assert ran.stdout.count("matches one device") + ran.stdout.count("w = [") >= nproc, ran.stdout


@pytest.mark.parametrize("name", sorted(set(EXAMPLES) - PIPELINES))
def test_example_as_one_process(name, launches):
    assert launches.get(None)[0][f"examples/{name}"].code == 0


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_pipeline_example_says_how_to_launch_it(name, launches):
    runs, stderr = launches.get(None)
    assert runs[f"examples/{name}"].code == 1
    assert f"python -m tpflow.launch --nproc_per_node {EXAMPLES[name]}" in stderr


def _losses(stdout: str) -> dict[int, float]:
    return {int(line.split()[1]): float(line.split()[3]) for line in stdout.splitlines() if line.startswith("step ")}


def _generated(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("generated "))


def test_finetune_hf_matches_one_device(launches):
    """A Hugging Face model by its own plan on 2 ranks, saved halfway and resumed: one device's losses and tokens;
    and on 4 ranks, FSDP2 over dp x tp = 2 x 2. Each checkpoint resumes on another layout (resharded on load) and
    goes on as the others do: the 2-rank one on one device and on 2 replicas x 2 tensor-parallel ranks, the FSDP2
    one on one device. Each run exports the trained model with save_pretrained and loads it back on one device (the
    example checks the logits)."""
    checkpoint, sharded = launches.folder("checkpoint"), launches.folder("checkpoint-fsdp")
    runs = {"2 ranks": launches.get(2)[0][f"{FINETUNE} --checkpoint {checkpoint}"],
            "fsdp x tp": launches.get(4)[0][f"{FINETUNE} --dp 2 --tp 2 --fsdp --checkpoint {sharded}"]}
    one = launches.get(None)[0][FINETUNE]
    resumed = {"2 ranks on one device": f"{FINETUNE} --resume {checkpoint}",
               "fsdp x tp on one device": f"{FINETUNE} --resume {sharded}"}
    plain = run_scripts(list(resumed.values()))[0]
    runs.update({name: plain[command] for name, command in resumed.items()})
    runs["2 ranks on replicas x tp"] = launches.get(4)[0][f"{FINETUNE} --dp 2 --resume {checkpoint}"]
    want = _losses(one.stdout)
    assert sorted(want) == list(range(6)) and want[5] < want[0], one.stdout
    for name, run in runs.items():
        got, steps = _losses(run.stdout), range(6) if name in ("2 ranks", "fsdp x tp") else range(3, 6)
        assert sorted(got) == list(steps), (name, run.stdout)
        for step in steps:
            assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-5), (name, step, run.stdout, one.stdout)
        assert _generated(run.stdout) == _generated(one.stdout), name
    for run in (*runs.values(), one):
        assert "from_pretrained on one device: logits within" in run.stdout, run.stdout
