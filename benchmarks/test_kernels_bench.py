"""pytest-benchmark suite of the kernels; compare within a group, never across machines.

    pip install -e .[bench]
    pytest benchmarks/ --benchmark-only --benchmark-save=NAME     # then --benchmark-compare

GPU (skipped without one): ``tpflow.kernels.matmul``'s tiled and persistent kernels against
``torch.matmul`` in bf16 and fp16 on square and LLM shapes, and the fused bias + GELU epilogue
against torch's matmul + bias + gelu.
CPU: the ring matmul + reduce-scatter on an emulated link whose transfer takes half the compute
time (four messages per chunk, and one with the accumulator added late or in the epilogue),
against the unfused matmul then reduce-scatter; and
one product computed as 8 row ranges against one matmul (the rings' decomposition).
Multi-rank gloo timings, measured inside the ranks: ``benchmarks/collective_cpu.py``.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

import tpflow as tpf
from tpflow.comm import FakeWorld
from tpflow.kernels import matmul
from tpflow.ops import matmul_reduce_scatter

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a GPU")


@pytest.fixture
def switches():
    """What a benchmark sets with tpf.config.set is put back after it."""
    yield
    tpf.config.reset("matmul", "ring_add_late")

GPU_SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (8192, 4096, 14336), (8192, 14336, 4096)]  # M, N, K


def _synced(fn):
    def run():
        fn()
        torch.cuda.synchronize()
    return run


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m, n, k", GPU_SHAPES)
@pytest.mark.parametrize("impl", ["tpflow tiled", "tpflow persistent", "torch"])
def test_matmul_gpu(switches, benchmark, impl, m, n, k, dtype):
    benchmark.group = f"matmul {m}x{n}x{k} {dtype}"
    if impl != "torch":
        tpf.config.set(matmul=impl.removeprefix("tpflow "))
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(n, k, device="cuda", dtype=dtype).mT  # nn.Linear's layout, read in place
    fn = (lambda: torch.matmul(a, b)) if impl == "torch" else (lambda: matmul(a, b))
    benchmark.extra_info["flops"] = 2 * m * n * k
    benchmark.pedantic(_synced(fn), warmup_rounds=3, rounds=20)


@gpu
@pytest.mark.parametrize("impl", ["tpflow tiled", "tpflow persistent", "torch"])
def test_bias_gelu_gpu(switches, benchmark, impl):
    if impl != "torch":
        tpf.config.set(matmul=impl.removeprefix("tpflow "))
    m, n, k = 8192, 4096, 4096
    benchmark.group = f"matmul + bias + gelu {m}x{n}x{k} bf16"
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    fn = (lambda: matmul(a, b, bias=bias, activation="gelu")) if impl != "torch" else \
        (lambda: F.gelu(torch.matmul(a, b) + bias, approximate="tanh"))
    benchmark.pedantic(_synced(fn), warmup_rounds=3, rounds=20)


RING = dict(world=2, size=512)


def _ring_operands():
    gen = torch.Generator().manual_seed(0)
    w, s = RING["world"], RING["size"]
    return ([torch.randn(s, s // w, generator=gen) for _ in range(w)],
            [torch.randn(s // w, s, generator=gen) for _ in range(w)])


def _link_bandwidth(xs, ws) -> float:
    """Bytes/s at which one rank's transfers take half of its compute."""
    def compute_only(t):
        return matmul_reduce_scatter(xs[t.rank], ws[t.rank], t, algo="ring")

    world = FakeWorld(RING["world"])
    world.run(compute_only)
    start = time.perf_counter()
    world.run(compute_only)
    compute = time.perf_counter() - start
    nbytes = (RING["world"] - 1) * RING["size"] // RING["world"] * RING["size"] * 4
    return nbytes / (0.5 * compute)


RING_CASES = {  # (messages per chunk, algo, late add)
    "ring, 4 msgs/chunk, add in epilogue": (4, "ring", False), "ring, 1 msg/chunk, late add": (1, "ring", True),
    "ring, 1 msg/chunk, add in epilogue": (1, "ring", False), "matmul then reduce-scatter": (1, "naive", False)}


@pytest.mark.parametrize("case", list(RING_CASES))
def test_ring_on_emulated_link(switches, benchmark, case):
    torch.set_num_threads(1)
    benchmark.group = f"matmul + reduce-scatter, fake link, transfer = 0.5x compute, {RING}"
    splits, algo, late = RING_CASES[case]
    tpf.config.set(ring_add_late=late)
    xs, ws = _ring_operands()
    bandwidth = _link_bandwidth(xs, ws)

    def step(t):
        return matmul_reduce_scatter(xs[t.rank], ws[t.rank], t, algo=algo, splits=splits)

    benchmark.pedantic(lambda: FakeWorld(RING["world"], bandwidth=bandwidth).run(step), warmup_rounds=1, rounds=7)


@pytest.mark.parametrize("case", ["one matmul", "8 row ranges"])
def test_row_range_decomposition_cpu(benchmark, case):
    torch.set_num_threads(1)
    benchmark.group = "512^3 fp32 matmul, whole or in 8 row ranges (CPU)"
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    out = torch.empty(512, 512)

    def ranges():
        for start in range(0, 512, 64):
            matmul(a, b, out=out[start:start + 64], row_start=start, row_end=start + 64)

    benchmark.pedantic(ranges if case != "one matmul" else (lambda: matmul(a, b, out=out)), warmup_rounds=2,
                       rounds=15)
