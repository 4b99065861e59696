"""Local compute of tpflow: every local product of a global tensor goes through here.

Kernels know nothing of distribution; they see plain tensors.
"""

from __future__ import annotations

from tpflow.kernels.matmul import matmul, matmul_ref

__all__ = ["matmul", "matmul_ref"]
