"""Pipelines: modules on placements run as stages over micro-batches.

    stage      tpf.stage: a module on a placement (OneFlow's set_stage), its input boxed there
    schedule   schedules as data: per-stage tables of actions (GPipe, 1F1B), replayed and drawn
    backward   a stage's backward split into the input's gradient and the weights' (zero-bubble schedules)
    handoff    activations and gradients between neighbouring stages: headers, receives posted ahead, pairs
    executor   tpf.Pipeline: one runner of a schedule table
    cut        a model cut into stages: an nn.Sequential, or a Hugging Face causal LM by its pipeline plan
"""

from __future__ import annotations

from tpflow.pipeline import schedule
from tpflow.pipeline.cut import CausalLMStage, causal_lm_loss, cut
from tpflow.pipeline.executor import Pipeline
from tpflow.pipeline.stage import PipelineError, Stage, stage

__all__ = ["CausalLMStage", "Pipeline", "PipelineError", "Stage", "causal_lm_loss", "cut", "schedule", "stage"]
