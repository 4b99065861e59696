"""Local compute of tpflow: every local product of a global tensor or layer goes through here.

Kernels know nothing of distribution; they see plain tensors.
"""

from __future__ import annotations

from tpflow.kernels.linear import linear, linear_ref
from tpflow.kernels.matmul import ACTIVATIONS, matmul, matmul_ref, use_triton

__all__ = ["ACTIVATIONS", "linear", "linear_ref", "matmul", "matmul_ref", "use_triton"]
