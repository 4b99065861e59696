"""The benchmark scripts and suites keep running (tiny sizes, no timing asserted: timings are not tests); the GPU
ones, which cannot run here, at least exist, compile and stop clearly without a GPU; every results file is cited by a
page and every file a page cites exists."""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys

import pytest
import torch

from tests.harness import ROOT, run_python

RESULTS = ROOT / "benchmarks" / "results"
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_pytest_benchmark_suites_run():
    proc = run_python(["-m", "pytest", "benchmarks/", "--benchmark-disable", "-q", "-p", "no:cacheprovider"])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


@pytest.mark.parametrize("nproc, name", [(2, "layers"), (2, "collectives"), (4, "pipeline"), (2, "vocab"), (2, "rl"),
                                         (2, "rl-weights"),
                                         (4, "checks"), (2, "loading"), (2, "context"), (2, "context-overlap"),
                                         (2, "context-packed"),
                                         (2, "decode"), (2, "shm"), (2, "heap"), (2, "loaded"), (2, "trainer"),
                                         (2, "lora"), (2, "profile"), (2, "aspects")])
def test_benchmark_scripts_run_under_the_launcher(nproc, name, launches):
    assert launches.get(nproc)[0]  # every script ran (a failed one fails the run)
    written = list(launches.folder(name).glob("*.md"))
    assert len(written) == 1, written
    text = written[0].read_text()
    if name == "loading":
        assert "bit-identical on every rank: True" in text
    if name == "context":  # each mode sends its layout's minimum, with one device's loss
        rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| 32 | ")]
        assert [r[1] for r in rows] == ["one device", "ring", "ulysses"], text
        assert all(r[8] == "1.000" and abs(float(r[9].rstrip(" |"))) < 1e-5 for r in rows[1:]), text
    if name == "context-packed":  # the balanced cut within 10% of even; the minimum sent, one device's loss
        balance = [line.split(" | ") for line in text.splitlines() if line.startswith("| 2 | ")]
        assert balance and float(balance[0][4].rstrip(" |")) <= 1.1, text
        rows = [line.split(" | ") for line in text.splitlines() if line.startswith(("| packed | ", "| window 8 | "))]
        assert [r[1] for r in rows] == ["one device", "ring", "ulysses", "one device", "ring",
                                        "whole-sequence ring"], text
        assert all(r[8] == "1.000" for r in rows if r[1] != "one device"), text
        assert all(abs(float(r[9].rstrip(" |"))) < 1e-5 for r in rows if r[1] in ("ring", "ulysses")), text
    if name == "rl":  # the three ways timed, with the same log-probabilities
        assert text.count("| True |") == 3 and "| tpf.rl |" in text and "| fused |" in text, text
    if name == "rl-weights":  # the three ways timed
        assert all(f"| {way} |" in text for way in ("save_pretrained", "stream, rank 0", "stream, every rank")), text
    if name == "decode":  # tpflow's tokens equal transformers' and one device's
        assert "| 2 |" in text and text.rstrip().endswith("| True |"), text
    if name == "shm":  # both transports measured at every size
        assert text.count("x |") == 8, text
    if name == "heap":  # both transports stressed, every result right
        assert text.count(" | 3 | True |") == 2 and "| gloo (the cpu_shared_memory switch is off) |" in text, text
    if name == "trainer":  # the three modes timed
        assert text.count("x |") == 6 and "| Trainer + tpflow (tpf.adopt) |" in text, text
    if name == "lora":  # both modes timed; tpflow sends its layout's minimum
        assert text.count("x |") == 2 and "layout's minimum" in text and "(1.00x)" in text, text
    if name == "loaded":  # both steps measured both ways, with the same results
        assert text.count("| True |") == 2, text
    if name == "profile":  # the three pairs timed and profiled on both ranks, and the posts of a send
        assert text.count("self CPU time under torch.profiler") == 12 and "| pipeline, 1F1B, torch |" in text, text
        assert "Rank 1's self CPU time under torch.profiler, pipeline, 1F1B:" in text, text
        assert "against data, DDP, transformer (dim 32)" in text, text
        assert "with the receive posted before it" in text, text
    if name == "aspects":  # every case stepped beside transformers' TP; the hooks of each aspect that applies timed
        rows = [line.split(" | ")[0] for line in text.splitlines() if line.endswith("x |")]
        assert len(rows) == 10 and {"| transformers' TP", "| transformers' TP, dropout 0.1"} <= set(rows), text
        assert all(f"| {aspect} | " in text for aspect in ("input check", "random streams", "model-level read of "
                                                            "replicated parameters")), text
    if name == "checks":  # on 4 ranks, a pipeline of two tensor-parallel stages too
        assert "Pipeline: 2 stages x 2 tensor-parallel ranks" in text, text


def _gpu_check_scripts() -> list[str]:
    """The Python files ``make gpu-check`` runs, read from make's dry run (which also parses the Makefile)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    dry = subprocess.run(["make", "-n", "gpu-check"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
                         check=False)
    assert dry.returncode == 0, dry.stderr
    return sorted(set(re.findall(r"\b(?:benchmarks|tests)/\w+\.py", dry.stdout)))


def test_gpu_check_names_files_that_exist_and_compile():
    scripts = _gpu_check_scripts()
    assert {"benchmarks/kernels_gpu.py", "benchmarks/loss_gpu.py", "benchmarks/decode_gpu.py",
            "tests/test_kernels.py", "tests/test_cuda.py"} <= set(scripts), scripts
    for path in scripts:
        compile((ROOT / path).read_text(), path, "exec")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the run without a GPU")
def test_gpu_benchmarks_stop_clearly_without_a_gpu(monkeypatch, capsys):
    for path in (s for s in _gpu_check_scripts() if s.startswith("benchmarks/")):
        monkeypatch.setattr(sys, "argv", [path])
        with pytest.raises(SystemExit) as stop:  # as `python path` would, imports included
            runpy.run_path(str(ROOT / path), run_name="__main__")
        assert stop.value.code == 2, path
        assert "needs a CUDA GPU" in capsys.readouterr().err, path


def test_every_results_file_is_cited_and_every_cited_file_exists():
    """A result set (the files sharing a stem) counts as cited where a page names its stem. Only committed files
    count: ``make demo`` writes a new set on every run, which is the user's to keep or not."""
    text = "\n".join(page.read_text() for page in PAGES)
    listed = subprocess.run(["git", "ls-files", "-z", str(RESULTS)], cwd=ROOT, capture_output=True, text=True)
    files = [ROOT / f for f in listed.stdout.split("\0") if f] if listed.returncode == 0 else \
        [p for p in RESULTS.rglob("*") if p.is_file()]
    uncited = [str(p.relative_to(RESULTS)) for p in files if not re.search(re.escape(p.stem) + r"(?![\w-])", text)]
    assert not uncited, f"results no page cites (cite them or git rm them): {uncited}"
    cited = set(re.findall(r"results/([\w./+-]+?\.(?:md|csv|json|png))", text))
    assert cited, "no page cites a results file"
    missing = sorted(c for c in cited if not (RESULTS / c).is_file())
    assert not missing, f"pages cite results files that do not exist: {missing}"
