"""Pipelines: modules on placements run as stages over micro-batches.

    stage      tpf.stage: a module on a placement (OneFlow's set_stage), its input boxed there
    plain_reads  a plain stage's module reading its parameters' local blocks (eagerly, and over a pipeline step)
    actions    what a schedule table holds: forwards, backwards, weight gradients, transfers
    schedule   schedules as data: per-stage tables of actions (GPipe, 1F1B, interleaved, ZB-H1)
    replay     a table replayed before it runs: the executor's rules, NCCL's streams, peaks, a grid
    backward   a stage's backward split into the input's gradient and the weights' (zero-bubble schedules)
    handoff    activations and gradients between neighbouring stages: headers, receives posted ahead, pairs
    executor   tpf.Pipeline: one runner of a schedule table
    cut        a model cut into stages: an nn.Sequential, or a Hugging Face causal LM by its pipeline plan
"""

from __future__ import annotations

from tpflow.pipeline import actions, replay, schedule
from tpflow.pipeline.cut import CausalLMStage, causal_lm_loss, cut
from tpflow.pipeline.executor import Pipeline
from tpflow.pipeline.stage import PipelineError, Stage, stage

__all__ = ["CausalLMStage", "Pipeline", "PipelineError", "Stage", "actions", "causal_lm_loss", "cut", "replay",
           "schedule", "stage"]
