"""Local compute of tpflow: every local product of a global tensor or layer goes through here.

The tile kernels know nothing of distribution; they see plain tensors. The collective kernels
see a ``Transport`` (point-to-point messages between the ranks of one group), so they run the
same on torch.distributed and in one process on a fake one.
"""

from __future__ import annotations

from tpflow.kernels.collective import (
    ADD_LATE,
    RING_MIN_ELEMENTS,
    SPLITS,
    all_gather_matmul,
    all_gather_matmul_ref,
    matmul_reduce_scatter,
    matmul_reduce_scatter_ref,
)
from tpflow.kernels.fake_transport import FakeTransport, FakeWorld
from tpflow.kernels.linear import linear, linear_ref
from tpflow.kernels.matmul import ACTIVATIONS, matmul, matmul_ref, use_triton
from tpflow.kernels.transport import DistTransport, Handle, Transport, as_transport, row_bounds

__all__ = ["ACTIVATIONS", "ADD_LATE", "RING_MIN_ELEMENTS", "SPLITS", "DistTransport", "FakeTransport", "FakeWorld",
           "Handle", "Transport", "all_gather_matmul", "all_gather_matmul_ref", "as_transport", "linear", "linear_ref",
           "matmul", "matmul_ref", "matmul_reduce_scatter", "matmul_reduce_scatter_ref", "row_bounds", "use_triton"]
