"""The parallel modules: what a model computes through.

    sharded  ShardedModule: parameters split over a placement, made from whole values, read as local blocks
    vocab    VocabParallelEmbedding (the vocabulary split over the ranks), and the head + loss without logits
    linear   ParallelLinear: what the column and row layers share (storage, init, inputs, local blocks)
    layouts  input_sbp= / output_sbp=: the SBPs a layer's (or an entry's) sides take, the older flags their aliases
    column   ColumnParallelLinear: W split(1), a block of output features per rank
    row      RowParallelLinear: W split(0), a block of input features per rank
    fused    column layers of one parent reading one input (q / k / v) run as one product
    regions  which activations are split over the ranks, read off tags on the autograd graph
    replicated  modules left whole on every rank, as global parameters with one device's gradient
"""

from __future__ import annotations

from tpflow.layers.column import ColumnParallelLinear
from tpflow.layers.fused import ColumnGroup
from tpflow.layers.linear import ParallelLinear
from tpflow.layers.row import RowParallelLinear
from tpflow.layers.sharded import ShardedModule
from tpflow.layers.vocab import VocabParallelEmbedding, linear_cross_entropy

__all__ = ["ColumnGroup", "ColumnParallelLinear", "ParallelLinear", "RowParallelLinear", "ShardedModule",
           "VocabParallelEmbedding", "linear_cross_entropy"]
