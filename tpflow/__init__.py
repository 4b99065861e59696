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
    plans                    the engine: Style, Plan, the driver, the generic entries; knows no model family
    hf                       the Hugging Face wing: parallelize's front door, hf_plan, heads, context
                             parallelism, PEFT, save_pretrained / generate, the trainers (adopt)
    pipeline                 stages, schedules as tables, the executor
    rl                       reinforcement-learning post-training: log-probabilities on split vocabularies,
                             weights streamed to engines, device memory lent (offload, reload)
    models                   the support matrix: every causal LM of transformers' registry checked (python -m)
    bench, launch            the benchmark harness; python -m tpflow.launch
"""

from __future__ import annotations

from tpflow import checkpoint, comm, config, hf, kernels, ops, pipeline, rl, sbp
from tpflow.checkpoint import full_state_dict, load_safetensors, meta_parameters, unique_state_dict
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
from tpflow.hf import (
    BlocksParallel,
    ContextParallel,
    Conv1DParallel,
    LatentKeyValue,
    MultiQueryColumns,
    SplitHeads,
    SummedParameters,
    adopt,
    frameworks,
    hf_plan,
    lora,
    parallelize,
)
from tpflow.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, linear_cross_entropy
from tpflow.pipeline import Pipeline, PipelineError, Stage, stage
from tpflow.placement import Placement, placement
from tpflow.plans import (
    ColumnParallel,
    ExpertParallel,
    ExpertTensorParallel,
    GatherSequence,
    Replicated,
    RowParallel,
    SequenceParallel,
    Stacked,
    Style,
    VocabParallel,
    fsdp_ignored_params,
)
from tpflow.rl import offload, reload
from tpflow.world import get_rank, get_world_size, init_distributed

# the model-family entries are tpf.hf's, kept here as aliases
__all__ = [  # noqa: RUF022  (grouped as the README's API table)
    # placements, layouts, global tensors
    "Placement", "placement", "sbp",
    "full", "ones", "rand", "randn", "tensor", "zeros",
    "to_global", "from_local", "to_local", "get_sbp", "get_placement", "matmul",
    # parallel layers and the loss on split logits
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "cross_entropy", "linear_cross_entropy", "vocab_parallel_loss",
    # plans: the engine's styles, and parallelize (the Hugging Face wing's front door)
    "parallelize", "hf_plan", "Style", "Stacked",
    "ColumnParallel", "RowParallel", "VocabParallel", "Replicated", "SequenceParallel", "GatherSequence",
    "ExpertTensorParallel", "ExpertParallel", "fsdp_ignored_params",
    # the Hugging Face wing (tpf.hf) and its model-family styles, PEFT, the trainers
    "hf", "ContextParallel", "SplitHeads", "LatentKeyValue", "MultiQueryColumns", "Conv1DParallel",
    "BlocksParallel", "SummedParameters", "lora", "adopt", "frameworks",
    # checkpoints
    "checkpoint", "meta_parameters", "load_safetensors", "unique_state_dict", "full_state_dict",
    # pipelines
    "pipeline", "Pipeline", "PipelineError", "Stage", "stage",
    # reinforcement-learning post-training
    "rl", "offload", "reload",
    # processes, checks, gradients, switches, the layers below
    "get_rank", "get_world_size", "init_distributed", "check_replicas", "gradients", "clip_grad_norm_",
    "config", "kernels", "ops", "comm",
]

__version__ = "0.1.0"
