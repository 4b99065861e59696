"""Plans: which modules of a model become which parallel layers, applied to an unchanged model.

    styles        plan entries: "column", "row", ColumnParallel(...), RowParallel(...)
    parallelize   glob patterns over module names -> layers swapped in place, fused groups joined
"""

from __future__ import annotations

from tpflow.plans.parallelize import parallelize
from tpflow.plans.styles import ColumnParallel, RowParallel

__all__ = ["ColumnParallel", "RowParallel", "parallelize"]
