"""pytest-benchmark suite of the parallel modes, measured inside the ranks: each round runs one training step
of ``tpflow.bench``'s MLP on 2 real gloo ranks (the test harness's process pool), and the time recorded is
the slowest rank's own ``perf_counter`` around its step, so process start-up and the pool's messages are
not timed. Compare modes within the group, never across machines.

    pytest benchmarks/test_modes_bench.py --benchmark-only --benchmark-save=NAME   # then --benchmark-compare
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests import harness
from tpflow.bench import modes, trainer, workloads
from tpflow.bench.measure import hold_freed_memory

WORLD = 2
MLP = dict(dim=256, hidden=1024, depth=4, tokens=256, seq=32, heads=8, kv_heads=4)
_TRAINERS: dict[str, trainer.Trainer] = {}  # in each rank


def _build(mode: str) -> None:
    hold_freed_memory()
    ctx = trainer.Context(dist.get_world_size(), dist.get_rank(), torch.device("cpu"))
    _TRAINERS[mode] = modes.build(mode, workloads.build("mlp", **MLP), ctx)


def _step(mode: str) -> float:
    dist.barrier()
    start = time.perf_counter()
    _TRAINERS[mode].step()
    return time.perf_counter() - start


def _drop(mode: str) -> None:
    del _TRAINERS[mode]


class _RankClock:
    """A clock that moves only by the step times the ranks measured, so that pytest-benchmark, reading it
    before and after a round, records exactly those."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.mark.parametrize("mode", ["one device", "data, tpflow SBP", "data, DDP", "tensor, tpflow", "tensor, torch",
                                  "sequence, ring", "sequence, unfused", "pipeline, 1F1B"])
def test_mode_step(benchmark, mode):
    benchmark.group = f"mlp step (forward, backward, SGD), {WORLD} CPU ranks"
    harness.run(WORLD, _build, mode)
    clock = _RankClock()
    benchmark._timer = clock  # pytest-benchmark's timer (no public hook for a time measured elsewhere)
    try:
        benchmark.pedantic(lambda: clock.advance(max(harness.run(WORLD, _step, mode))), warmup_rounds=1, rounds=7)
    finally:
        harness.run(WORLD, _drop, mode)
