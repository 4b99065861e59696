"""The parallel layers, parallelize() and fused column groups on tpflow's Triton kernels: the GPU's hot path.
Without a GPU they run through Triton's interpreter on 2 and 3 gloo ranks (small shapes, fp32 and fp16; the
interpreter mishandles bf16), sequence-parallel rings included. On a GPU machine (``make gpu-check``) NCCL gives each
rank a GPU of its own, so with one GPU they run on one rank: the layers' products and gradients on the compiled
kernels, bf16 too, with no collective (``test_cuda.py`` runs the compiled rings, its ranks threads of one process).

The rank functions are the torch-path tests' own (``tests.checks``), run with the ``kernels`` switch at
``"triton"``; each run also counts the kernel launches, so a path that silently fell back to torch's matmul fails.
Values are small integers, so fp32 results are exact whatever order the kernel sums in."""

from __future__ import annotations

import pytest
import torch

import tpflow as tpf
from tests import harness
from tests.checks import Counting, fused_columns_match_one_device, half_precision_rounds_once, mlp_matches_one_device

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GPU = DEVICE == "cuda"
WORLDS = [1] if GPU else [2, 3]
HALF = [torch.float16, torch.bfloat16] if GPU else [torch.float16]
# on one rank sequence parallelism has no collective: one case of each
MLP_CASES = [(False, "auto")] if GPU else [(False, "auto"), (True, "ring"), (True, "naive")]
FUSED_CASES = [(False, True)] if GPU else [(False, True), (True, True), (True, False)]


def _on_triton(fn, *args):
    """``fn(*args)`` with every local product on the Triton kernels, however few its rows; (its result, the launches
    it made)."""
    from tpflow.kernels import tuning

    tiled = Counting(tuning.tuned("tiled"))
    with tpf.config.override(kernels="triton", matmul="tiled", triton_min_rows={DEVICE: 0}), \
            tuning.use("tiled", tiled):
        return fn(*args), tiled.launches


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("sequence_parallel, algo", MLP_CASES, ids=["tp", "tp+sp ring", "tp+sp plain"][:len(MLP_CASES)])
def test_mlp_through_parallelize_on_the_kernels(world, sequence_parallel, algo):
    """Column -> relu -> row blocks, forward and every gradient equal to nn.Linear's; with sequence parallelism
    the ring collectives compute their chunks as row ranges of the kernels."""
    for _, launches in harness.run(world, _on_triton, mlp_matches_one_device, sequence_parallel, 4 * world, 7, False,
                                   torch.float32, algo, DEVICE, timeout=300):
        assert launches >= 12, f"{launches} kernel launches: the layers must compute on the Triton kernels"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("sequence_parallel, keep_gathered", FUSED_CASES,
                         ids=["tp", "tp+sp", "tp+sp regather"][:len(FUSED_CASES)])
def test_fused_columns_on_the_kernels(world, sequence_parallel, keep_gathered):
    """q / k / v-like column layers as one product on the kernels: each member's output and gradients equal
    nn.Linear's, and the group sends what one layer as wide as the three sends."""
    for (fused, one), launches in harness.run(world, _on_triton, fused_columns_match_one_device, sequence_parallel,
                                              keep_gathered, True, DEVICE, timeout=300):
        assert fused == one, f"fused layers sent {fused} bytes (forward, backward), one layer {one}"
        assert launches >= 6, f"{launches} kernel launches"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_precision_on_the_kernels(world, dtype):
    """fp16 (and on a GPU bf16) column and row layers round once, as one device does: their partial sums travel in
    fp32."""
    for _, launches in harness.run(world, _on_triton, half_precision_rounds_once, dtype, DEVICE, timeout=300):
        assert launches >= 2, f"{launches} kernel launches"


def test_decode_sized_products_run_torch():
    """Fewer rows than the triton_min_rows switch's: torch's matmul (no launch), with the same values, forward
    and backward; from that many rows on, the kernel."""
    from tpflow.kernels import linear, tuning

    w = torch.randint(-3, 4, (6, 5), device=DEVICE).float().requires_grad_()
    for rows, kernel in ((3, False), (4, True)):
        x = torch.randint(-3, 4, (rows, 5), device=DEVICE).float().requires_grad_()
        tiled = Counting(tuning.tuned("tiled"))
        with tpf.config.override(kernels="triton", matmul="tiled", triton_min_rows={DEVICE: 4}), \
                tuning.use("tiled", tiled):
            y = linear(x, w, activation="relu")
            y.sum().backward()
        assert (tiled.launches > 0) == kernel, (rows, tiled.launches)
        assert torch.equal(y, torch.relu(x.detach() @ w.detach().T))
