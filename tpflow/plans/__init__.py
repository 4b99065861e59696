"""Plans: which modules of a model become which parallel layers, applied to an unchanged model.

    styles        plan entries: "column", "row", HF's names, ColumnParallel(...), RowParallel(...), ...
    hf            plan="auto": a Hugging Face model's own plan, as entries
    logits        a vocabulary-parallel head's model: its own loss routed vocab-parallel, generate on whole logits
    inputs        the tensor-parallel ranks fed the same data: checked at the first layer reading it whole
    context       context parallelism: the sequence cut at the model's entry, attention over the whole of it
    pretrained    save_pretrained of a parallelized Hugging Face model: whole tensors, rank 0 writing
    heads         attention heads checked against the ranks; key/value heads replicated when too few
    parallelize   glob patterns over module names -> layers swapped in place, fused groups joined, the rest
                  replicated as global tensors
"""

from __future__ import annotations

from tpflow.plans.fsdp import fsdp_ignored_params
from tpflow.plans.hf import hf_plan
from tpflow.plans.parallelize import parallelize
from tpflow.plans.styles import (
    ColumnParallel,
    ContextParallel,
    ExpertParallel,
    ExpertTensorParallel,
    GatherSequence,
    Replicated,
    RowParallel,
    SequenceParallel,
    VocabParallel,
)

__all__ = ["ColumnParallel", "ContextParallel", "ExpertParallel", "ExpertTensorParallel", "GatherSequence",
           "Replicated", "RowParallel", "SequenceParallel", "VocabParallel", "fsdp_ignored_params", "hf_plan",
           "parallelize"]
