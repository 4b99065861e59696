"""Plans, the engine: which modules of a model become which parallel layers, applied to an unchanged model. It knows
no model family: Hugging Face's plans, names, heads and adapters are the wing's (``tpflow.hf``).

    style         tpf.Style: a plan style checks a matched module, then applies itself to it; Stacked: several on one
                  module; Plan: the plan matched, which every entry reads
    matching      the plan read (tpflow's names, torch's styles) and matched against a model
    parallelize   the driver: checked (match, check every match), applied (apply every match), settled (replicate the
                  rest; the aspects: random streams, the inputs checked alike, FSDP2 expected)
    linear        entries ColumnParallel, RowParallel
    vocab         entry VocabParallel: an embedding or a head split over the vocabulary (its loss: logits)
    sequence      entries SequenceParallel, GatherSequence: sequence-parallel regions
    replicated    entry Replicated: whole, with how its gradient is found
    experts       entries ExpertTensorParallel, ExpertParallel
    names         "column", "row", "vocab"; torch_styles: torch's own styles, read as entries
    fusion, ties, agreement    what entries share: fused column groups, tied parameters, the ranks' agreement
    inputs        the tensor-parallel ranks fed the same data: checked at the first layer reading it whole
    random_streams    dropout's random numbers per rank where the layers split the features
    logits        a head's split logits and the loss on them
    fsdp          a named placement's data axes left to FSDP2
"""

from __future__ import annotations

from tpflow.plans.experts import ExpertParallel, ExpertTensorParallel
from tpflow.plans.fsdp import fsdp_ignored_params
from tpflow.plans.linear import ColumnParallel, RowParallel
from tpflow.plans.parallelize import parallelize
from tpflow.plans.replicated import Replicated
from tpflow.plans.sequence import GatherSequence, SequenceParallel
from tpflow.plans.style import Plan, Stacked, Style
from tpflow.plans.vocab import VocabParallel

__all__ = ["ColumnParallel", "ExpertParallel", "ExpertTensorParallel", "GatherSequence", "Plan", "Replicated",
           "RowParallel", "SequenceParallel", "Stacked", "Style", "VocabParallel", "fsdp_ignored_params",
           "parallelize"]
