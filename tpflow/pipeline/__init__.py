"""Pipelines: modules on placements run as stages over micro-batches.

    stage      tpf.stage: a module on a placement (OneFlow's set_stage), its input boxed there
    schedule   schedules as data: per-stage tables of actions (GPipe, 1F1B), replayed and drawn
    executor   tpf.Pipeline: one runner of a schedule table, hand-offs as cross-placement boxing
"""

from __future__ import annotations

from tpflow.pipeline import schedule
from tpflow.pipeline.executor import Pipeline
from tpflow.pipeline.stage import PipelineError, Stage, stage

__all__ = ["Pipeline", "PipelineError", "Stage", "schedule", "stage"]
