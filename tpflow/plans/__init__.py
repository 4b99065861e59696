"""Plans: which modules of a model become which parallel layers, applied to an unchanged model.

    style         tpf.Style: a plan entry checks a matched module, then applies itself to it; Plan: what they read
    matching      the plan read (names, "auto", torch's styles) and matched against a model
    parallelize   the driver: match, check every match, apply every match, replicate the rest
    linear        entries ColumnParallel, RowParallel (with the attention heads' rules, heads)
    vocab         entry VocabParallel: an embedding or a head split over the vocabulary (its loss: logits)
    sequence      entries SequenceParallel, GatherSequence: sequence-parallel regions
    replicated    entry Replicated: whole, with how its gradient is found
    experts       entries ExpertTensorParallel, ExpertParallel
    context       entry ContextParallel: the sequence cut at the model's entry, attention over the whole of it
    context_attention  the attention implementation context parallelism registers with transformers
    names         "column", "row", HF's style strings; torch_styles: torch's own styles, read as entries
    fusion, ties, agreement    what entries share: fused column groups, tied parameters, the ranks' agreement
    hf            plan="auto": a Hugging Face model's own plan, as entries; planner: tpflow's for a model without one
    summed        entry SummedParameters: a module's own parameters split, its output summed (HF's "all_reduce")
    split_heads   entry SplitHeads: an attention module given its rank's heads (and the biases made for them)
    in_place      entries Conv1DParallel, BlocksParallel: GPT-2's Conv1D and fused nn.Linear blocks split in place
    mla           entry LatentKeyValue: MLA's shared key / value projection (HF's "mla_kv_a_proj")
    multi_query   entry MultiQueryColumns: a fused q | k | v projection with one key/value head (GPT-BigCode, Falcon)
    mixers        what mixes tokens in a layer: attention context parallelism splits, and what it refuses
    inputs        the tensor-parallel ranks fed the same data: checked at the first layer reading it whole
    pretrained    save_pretrained of a parallelized Hugging Face model: whole tensors, rank 0 writing
    decoding      generate alike on every rank: one random state per tensor-parallel group, no rank left waiting
    fsdp          a named placement's data axes left to FSDP2
"""

from __future__ import annotations

from tpflow.plans.context import ContextParallel
from tpflow.plans.experts import ExpertParallel, ExpertTensorParallel
from tpflow.plans.fsdp import fsdp_ignored_params
from tpflow.plans.hf import hf_plan
from tpflow.plans.in_place import BlocksParallel, Conv1DParallel
from tpflow.plans.linear import ColumnParallel, RowParallel
from tpflow.plans.mla import LatentKeyValue
from tpflow.plans.multi_query import MultiQueryColumns
from tpflow.plans.parallelize import parallelize
from tpflow.plans.replicated import Replicated
from tpflow.plans.sequence import GatherSequence, SequenceParallel
from tpflow.plans.split_heads import SplitHeads
from tpflow.plans.style import Style
from tpflow.plans.summed import SummedParameters
from tpflow.plans.vocab import VocabParallel

__all__ = ["BlocksParallel", "ColumnParallel", "ContextParallel", "Conv1DParallel", "ExpertParallel",
           "ExpertTensorParallel", "GatherSequence", "LatentKeyValue", "MultiQueryColumns", "Replicated", "RowParallel",
           "SequenceParallel", "SplitHeads", "Style", "SummedParameters", "VocabParallel", "fsdp_ignored_params",
           "hf_plan", "parallelize"]
