"""Parallel layers: what a model uses tpflow through."""

from __future__ import annotations

from tpflow.layers.linear import ColumnParallelLinear, RowParallelLinear
from tpflow.layers.parallelize import ColumnParallel, RowParallel, parallelize

__all__ = ["ColumnParallel", "ColumnParallelLinear", "RowParallel", "RowParallelLinear", "parallelize"]
