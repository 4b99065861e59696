"""The local matmul behind ``tpf.matmul`` and its backward.

One entry point so the Triton tiled kernel can take over every local product at once; until it
lands, ``matmul`` is torch's (cuBLAS on CUDA, MKL/OpenBLAS on CPU).
"""

from __future__ import annotations

import torch

__all__ = ["matmul", "matmul_ref"]


def matmul_ref(a: torch.Tensor, b: torch.Tensor, *, upcast: bool = False) -> torch.Tensor:
    """Reference product; ``upcast`` computes in float64 to measure other kernels' error."""
    if upcast:
        return torch.matmul(a.double(), b.double())
    return torch.matmul(a, b)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [..., M, K] @ b [..., K, N]`` on local shards."""
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"matmul inner sizes differ: a {tuple(a.shape)} @ b {tuple(b.shape)}")
    return torch.matmul(a, b)
