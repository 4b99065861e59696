"""Operations that combine the kernels with communication, on local shards: matmul + reduce-scatter and
all-gather + matmul walked around a ring, each the other's backward."""

from __future__ import annotations

from tpflow.ops.collective_matmul import (
    ALGOS,
    all_gather_matmul,
    all_gather_matmul_ref,
    matmul_reduce_scatter,
    matmul_reduce_scatter_ref,
)

__all__ = ["ALGOS", "all_gather_matmul", "all_gather_matmul_ref", "matmul_reduce_scatter", "matmul_reduce_scatter_ref"]
