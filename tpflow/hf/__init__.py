"""The Hugging Face wing: everything that knows transformers, PEFT, the trainers or a model family, above an engine
(``tpflow.plans``) that knows none.

    parallelize       tpf.parallelize, the front door: PEFT lifted, "auto" and HF's names read, heads said, the
                      engine run, save_pretrained / generate / the trainers readied
    plan, planner, left_out
                      tpf.hf_plan: a model's own plan as entries; tpflow's plan for a model that ships none, and for
                      what a model's own plan leaves out of its layers (else a Replicated entry saying why)
    styles            Hugging Face's style strings ("colwise", "rowwise", ...) as entries
    head_columns      SplitHeads and HeadColumns written where an attention's queries split
    heads, split_heads, multi_query, mla, in_place, summed
                      the entries of attention heads, multi-query and latent attention, Conv1D and fused blocks split
                      in place, modules whose own parameters split and whose output is summed
    mixers            what mixes tokens in a layer (attention, state spaces, convolutions)
    context, context_attention, context_batch
                      tpf.ContextParallel: the sequence split, through transformers' attention interface
    adapters, lora, peft_calls
                      PEFT's adapters laid out as their base layers; tpf.lora; PEFT's own calls on a split model
    pretrained, decoding
                      save_pretrained writing whole tensors; generate alike on every rank
    frameworks        tpf.adopt: transformers' Trainer, TRL, accelerate see the data-parallel rows as their processes
"""

from __future__ import annotations

from tpflow.hf import frameworks
from tpflow.hf.context_style import ContextParallel
from tpflow.hf.frameworks import adopt
from tpflow.hf.head_columns import HeadColumns
from tpflow.hf.in_place import BlocksParallel, Conv1DParallel
from tpflow.hf.mla import LatentKeyValue
from tpflow.hf.multi_query import MultiQueryColumns
from tpflow.hf.parallelize import parallelize
from tpflow.hf.peft_calls import lora
from tpflow.hf.plan import hf_plan
from tpflow.hf.split_heads import SplitHeads
from tpflow.hf.summed import SummedParameters

__all__ = ["BlocksParallel", "ContextParallel", "Conv1DParallel", "HeadColumns", "LatentKeyValue", "MultiQueryColumns",
           "SplitHeads", "SummedParameters", "adopt", "frameworks", "hf_plan", "lora", "parallelize"]
