"""The benchmark scripts and suites keep running (tiny sizes, no timing asserted: timings are not tests)."""

from __future__ import annotations

import pytest

from tests.test_examples import _run


def test_pytest_benchmark_suites_run():
    proc = _run(["-m", "pytest", "benchmarks/", "--benchmark-disable", "-q", "-p", "no:cacheprovider"])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


@pytest.mark.parametrize("nproc, args", [
    (2, ["benchmarks/layers_cpu.py", "--dim", "32", "--hidden", "64", "--tokens", "16", "--reps", "1"]),
    (2, ["benchmarks/collective_cpu.py", "gloo", "--size", "64", "--reps", "1"]),
    (3, ["benchmarks/pipeline_cpu.py", "--reps", "1", "--forward-ms", "1", "--dim", "8", "--rows", "2"]),
    (2, ["benchmarks/vocab_cpu.py", "--vocab", "101", "--tokens", "16", "--hidden", "8", "--chunk", "4",
         "--reps", "1"]),
], ids=["layers", "collectives", "pipeline", "vocab"])
def test_benchmark_scripts_run_under_the_launcher(nproc, args, tmp_path):
    proc = _run(["-m", "tpflow.launch", "--nproc_per_node", str(nproc), *args, "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert len(list(tmp_path.glob("*.md"))) == 1, proc.stdout


def test_loading_benchmark_runs(tmp_path):
    pytest.importorskip("transformers")
    sizes = ["--vocab", "64", "--hidden", "128", "--ffn", "64", "--layers", "1"]
    proc = _run(["benchmarks/loading_cpu.py", "--prepare", str(tmp_path / "model"), *sizes])
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc = _run(["-m", "tpflow.launch", "--nproc_per_node", "2", "benchmarks/loading_cpu.py", "--dir",
                 str(tmp_path / "model"), "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "bit-identical on every rank: True" in next(tmp_path.glob("loading_*.md")).read_text()
