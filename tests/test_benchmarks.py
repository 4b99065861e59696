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
], ids=["layers", "collectives", "pipeline"])
def test_benchmark_scripts_run_under_the_launcher(nproc, args, tmp_path):
    proc = _run(["-m", "tpflow.launch", "--nproc_per_node", str(nproc), *args, "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert len(list(tmp_path.glob("*.md"))) == 1, proc.stdout
