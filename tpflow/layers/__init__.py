"""Parallel layers and pipeline stages: what a model uses tpflow through."""

from __future__ import annotations

from tpflow.layers.linear import ColumnParallelLinear, RowParallelLinear
from tpflow.layers.parallelize import ColumnParallel, RowParallel, parallelize
from tpflow.layers.pipeline import Pipeline, PipelineError
from tpflow.layers.stage import Stage, stage

__all__ = ["ColumnParallel", "ColumnParallelLinear", "Pipeline", "PipelineError", "RowParallel", "RowParallelLinear",
           "Stage", "parallelize", "stage"]
