"""The parallel modules: what a model computes through.

    linear   ColumnParallelLinear (W split(1)) and RowParallelLinear (W split(0)), on local blocks
    fused    column layers of one parent reading one input (q / k / v) run as one product
    blocks   parameters' local blocks as one autograd node, and blocks joined in one storage
"""

from __future__ import annotations

from tpflow.layers.fused import ColumnGroup
from tpflow.layers.linear import ColumnParallelLinear, ParallelLinear, RowParallelLinear

__all__ = ["ColumnGroup", "ColumnParallelLinear", "ParallelLinear", "RowParallelLinear"]
