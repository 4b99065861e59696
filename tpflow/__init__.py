"""tpflow: tensor-parallel layers for PyTorch with OneFlow's global view.

Every global tensor has a placement (which ranks) and an SBP (split / broadcast / partial sum per
placement axis); underneath it is a ``DTensor``. The package is layered, each folder using only
those below it:

    config, world, placement, sbp   switches; the process group; which ranks; how a tensor is laid out
    comm                     collectives on local shards with byte counters; transports; metadata messages
    kernels                  Triton kernels and their torch references (nothing distributed)
    ops                      kernels x transports: the ring matmul collectives, the vocabulary-parallel loss
    global_tensor            creation, boxing, to_global / from_local, matmul with SBP inference
    checkpoint               safetensors read block by block into a parallelized model; whole tensors out
    layers                   ColumnParallelLinear, RowParallelLinear, fused column groups, VocabParallelEmbedding
    plans                    parallelize: plans of module-name patterns
    pipeline                 stages, schedules as tables, the executor
    bench, launch            the benchmark harness; python -m tpflow.launch
"""

from __future__ import annotations

from tpflow import comm, config, frameworks, kernels, ops, sbp
from tpflow.checkpoint import full_state_dict, load_safetensors, meta_parameters, unique_state_dict
from tpflow.frameworks import adopt
from tpflow.global_tensor import (
    check_replicas,
    clip_grad_norm_,
    cross_entropy,
    from_local,
    full,
    get_placement,
    get_sbp,
    gradients,
    matmul,
    ones,
    rand,
    randn,
    tensor,
    to_global,
    to_local,
    vocab_parallel_loss,
    zeros,
)
from tpflow.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, linear_cross_entropy
from tpflow.pipeline import Pipeline, PipelineError, Stage, stage
from tpflow.placement import Placement, placement
from tpflow.plans import (
    BlocksParallel,
    ColumnParallel,
    ContextParallel,
    Conv1DParallel,
    ExpertParallel,
    ExpertTensorParallel,
    GatherSequence,
    LatentKeyValue,
    MultiQueryColumns,
    Replicated,
    RowParallel,
    SequenceParallel,
    SplitHeads,
    Style,
    SummedParameters,
    VocabParallel,
    fsdp_ignored_params,
    hf_plan,
    parallelize,
)
from tpflow.plans.lora import lora
from tpflow.world import get_rank, get_world_size, init_distributed

__all__ = [
    "BlocksParallel",
    "ColumnParallel",
    "ColumnParallelLinear",
    "ContextParallel",
    "Conv1DParallel",
    "ExpertParallel",
    "ExpertTensorParallel",
    "GatherSequence",
    "LatentKeyValue",
    "MultiQueryColumns",
    "Pipeline",
    "PipelineError",
    "Placement",
    "Replicated",
    "RowParallel",
    "RowParallelLinear",
    "SequenceParallel",
    "SplitHeads",
    "Stage",
    "Style",
    "SummedParameters",
    "VocabParallel",
    "VocabParallelEmbedding",
    "adopt",
    "check_replicas",
    "clip_grad_norm_",
    "comm",
    "config",
    "cross_entropy",
    "frameworks",
    "from_local",
    "fsdp_ignored_params",
    "full",
    "full_state_dict",
    "get_placement",
    "get_rank",
    "get_sbp",
    "get_world_size",
    "gradients",
    "hf_plan",
    "init_distributed",
    "kernels",
    "linear_cross_entropy",
    "load_safetensors",
    "lora",
    "matmul",
    "meta_parameters",
    "ones",
    "ops",
    "parallelize",
    "placement",
    "rand",
    "randn",
    "sbp",
    "stage",
    "tensor",
    "to_global",
    "to_local",
    "unique_state_dict",
    "vocab_parallel_loss",
    "zeros",
]

__version__ = "0.1.0"
