"""CUDA placements (NCCL for CUDA tensors, gloo for CPU ones): skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

import tpflow as tpf
from tests import harness
from tests.checks import Counting
from tpflow.comm import FakeWorld, as_transport
from tpflow.kernels import matmul, matmul_ref
from tpflow.ops import all_gather_matmul, matmul_reduce_scatter
from tpflow.sbp import chunk_bounds

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _cuda_matmul_and_boxing():
    pl = tpf.placement("cuda", [0])
    torch.manual_seed(0)
    x = tpf.randn(64, 96, placement=pl, sbp=tpf.sbp.split(0), requires_grad=True)
    w = tpf.randn(96, 32, placement=pl, sbp=tpf.sbp.broadcast, dtype=torch.float32, requires_grad=True)
    out = tpf.matmul(x, w)
    assert out.device.type == "cuda" and tpf.get_sbp(out) == (tpf.sbp.split(0),)
    partial = tpf.to_global(tpf.to_global(out, sbp=tpf.sbp.partial_sum), sbp=tpf.sbp.split(1))
    torch.manual_seed(0)
    x_ref = torch.randn(64, 96, device="cuda", requires_grad=True)
    w_ref = torch.randn(96, 32, device="cuda", requires_grad=True)
    ref = x_ref @ w_ref
    torch.testing.assert_close(tpf.to_local(partial), ref)
    g = torch.randn_like(ref)
    ref.backward(g)
    torch.autograd.backward(partial, tpf.from_local(g, pl, tpf.sbp.split(1), shape=g.shape).detach())
    torch.testing.assert_close(tpf.to_local(x.grad), x_ref.grad)
    torch.testing.assert_close(tpf.to_local(w.grad), w_ref.grad)
    bf16 = tpf.matmul(tpf.to_global(x, sbp=tpf.sbp.broadcast).to(torch.bfloat16), w.to(torch.bfloat16))
    torch.testing.assert_close(tpf.to_local(bf16).float(), ref.detach(), rtol=2e-2, atol=2e-1)


def test_cuda_world_of_one():
    harness.run(1, _cuda_matmul_and_boxing)


# The ring collectives with compiled Triton kernels: ranks as threads on one GPU (the schedule and
# the fused accumulator epilogue in bf16 / fp16), and over NCCL where there are two GPUs.

def _ring_case(group, X, Wt, b, rows, k_cols):
    t = as_transport(group)
    rs = matmul_reduce_scatter(X[:, slice(*k_cols[t.rank])], Wt[slice(*k_cols[t.rank])], group, bias=b, algo="ring")
    ag = all_gather_matmul(X[slice(*rows[t.rank])], Wt, group, rows=X.shape[0], bias=b, activation="gelu",
                           algo="ring")
    return rs, ag


def _check_rings(results, X, Wt, b, dtype):
    X64, Wt64, b64 = X.double(), Wt.double(), b.double()
    for got, ref64, ref in (
        (torch.cat([r[0] for r in results]), matmul_ref(X64, Wt64, bias=b64),
         matmul_ref(X, Wt, bias=b)),
        (results[-1][1], matmul_ref(X64, Wt64, bias=b64, activation="gelu"),
         matmul_ref(X, Wt, bias=b, activation="gelu")),
    ):
        err, torch_err = (got.to(ref64.device).double() - ref64).abs().max(), (ref.double() - ref64).abs().max()
        atol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype] * ref64.abs().max()
        assert err <= 2 * torch_err + atol, f"{dtype}: error {err:.3g} > {2 * torch_err + atol:.3g}"


@pytest.mark.parametrize("kernel", ["tiled", "persistent"])  # persistent: fp16 / bf16 only; fp32 stays tiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_rings_compiled_on_one_gpu(dtype, kernel):
    from tpflow.kernels import tuning

    persistent = Counting(tuning.tuned("persistent"))
    world, (m, k, n) = 3, (1000, 768, 512)
    gen = torch.Generator(device="cuda").manual_seed(0)
    X, Wt, b = (torch.randn(*s, device="cuda", generator=gen).to(dtype) for s in ((m, k), (k, n), (n,)))
    rows, k_cols = chunk_bounds(m, world), chunk_bounds(k, world)
    with tpf.config.override(matmul=kernel), tuning.use("persistent", persistent):
        _check_rings(FakeWorld(world).run(_ring_case, X, Wt, b, rows, k_cols), X, Wt, b, dtype)
    assert bool(persistent.launches) == (kernel == "persistent" and dtype != torch.float32), persistent.launches


def _nccl_rings(dtype):
    torch.manual_seed(0)  # every rank draws the same full operands
    X, Wt, b = (torch.randn(*s, device="cuda").to(dtype) for s in ((1000, 768), (768, 512), (512,)))
    world = torch.distributed.get_world_size()
    rs, ag = _ring_case(None, X, Wt, b, chunk_bounds(1000, world), chunk_bounds(768, world))
    return rs.cpu(), ag.cpu(), X.cpu(), Wt.cpu(), b.cpu()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rings_over_nccl(dtype):
    results = harness.run(2, _nccl_rings, dtype)
    X, Wt, b = results[0][2:]
    _check_rings([(r[0], r[1]) for r in results], X.cuda(), Wt.cuda(), b.cuda(), dtype)


def test_accumulating_in_place_survives_autotuning():
    """``matmul(a, b, acc=s, out=s)`` (the rings' weight gradients) with autotuning on (the tests pin one config):
    the tuning runs, every config several times on s, must not add into s."""
    from tpflow.kernels import launcher

    torch.manual_seed(0)
    a = torch.randn(256, 192, device="cuda", dtype=torch.float16)
    b = torch.randn(128, 192, device="cuda", dtype=torch.float16).mT
    for kernel in ("tiled", "persistent"):
        with tpf.config.override(matmul=kernel, autotune=True):
            s = torch.ones(256, 128, device="cuda")
            assert launcher.kernel_choice(a, b, s) == kernel
            want = s + a.float() @ b.float()
            matmul(a, b, acc=s, out=s)  # the first call of this key autotunes
            torch.testing.assert_close(s, want, rtol=2e-3, atol=2e-2, msg=lambda m, kernel=kernel: f"{kernel}: {m}")
