"""pytest-benchmark suite of the layers in one process (a world of one): a parallelized model against the
same model with plain ``nn.Linear`` layers, forward + backward. Multi-rank comparisons against
``parallelize_module``, measured inside the ranks: ``benchmarks/layers_cpu.py``. As there, glibc is set to
keep freed memory, for the rest of this pytest process."""

from __future__ import annotations

import copy

import pytest
import torch

import tpflow as tpf
from benchmarks.layers_cpu import step, workloads
from tpflow.bench.measure import hold_freed_memory


@pytest.mark.parametrize("case", ["tpflow parallelize", "plain nn.Linear"])
@pytest.mark.parametrize("workload", [0, 1], ids=["MLP stack", "decoder layer"])
def test_world_of_one(benchmark, workload, case):
    torch.set_num_threads(1)
    hold_freed_memory()  # as layers_cpu.py: no per-step page faults, whose cost follows the order of frees
    tpf.init_distributed()
    name, model, plan, _, x = workloads(512, 1408, 256)[workload]
    benchmark.group = f"{name}, forward + backward, one rank"
    if case != "plain nn.Linear":
        model = tpf.parallelize(copy.deepcopy(model), placement=tpf.placement("cpu", [0]), plan=plan)
    benchmark.pedantic(step, args=(model, x), warmup_rounds=2, rounds=9)
