"""CUDA placements (NCCL for CUDA tensors, gloo for CPU ones): skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

import tpflow as tpf
from tests import harness

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
