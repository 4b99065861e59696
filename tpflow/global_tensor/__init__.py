"""Global tensors: OneFlow's vocabulary over ``DTensor``.

    blocks      a global tensor as this rank's block; get_sbp, get_placement, to_local
    creation    randn, rand, full, zeros, ones, tensor: one device's values for any layout
    boxing      layout changes within a placement and across placements (no autograd)
    local       from_local: a global tensor from each rank's block
    local_blocks  the hot paths' reads of parameter blocks (one autograd node a module), blocks joined in one
                storage, and DTensors made from a layout computed once: the one module on DTensor's internals
    convert     to_global, for global tensors, plain tensors and modules (module, with held_share: the share of a
                module's values this rank holds)
    signatures  the matmul signatures legal on a placement axis, and what boxing to another costs
    matmul      matmul with SBP inference
    cross_entropy  the loss of logits split over the classes, and the mode routing F.cross_entropy to it
    gradients   partial-sum gradients summed in buckets by the backward (reducer) or before a step
    replicas    check_replicas: the copies of a broadcast parameter compared bit for bit over its ranks
    optimizer_settings  an optimizer's settings compared over the ranks holding its parameters, at its first step
    collectives torch.distributed's collectives given a global tensor: refused with what to do
    argmax      argmax / argmin along a split dim (the logits' over the vocabulary), whole indices
"""

from __future__ import annotations

from tpflow.global_tensor import argmax, collectives, gradients
from tpflow.global_tensor.blocks import get_placement, get_sbp, to_local
from tpflow.global_tensor.convert import to_global
from tpflow.global_tensor.creation import full, ones, rand, randn, tensor, zeros
from tpflow.global_tensor.cross_entropy import cross_entropy, vocab_parallel_loss
from tpflow.global_tensor.gradients import clip_grad_norm_
from tpflow.global_tensor.local import from_local
from tpflow.global_tensor.matmul import matmul
from tpflow.global_tensor.module import held_share
from tpflow.global_tensor.replicas import check_replicas

__all__ = ["argmax", "check_replicas", "clip_grad_norm_", "collectives", "cross_entropy", "from_local", "full",
           "get_placement", "get_sbp", "gradients", "held_share", "matmul", "ones", "rand", "randn", "tensor",
           "to_global", "to_local", "vocab_parallel_loss", "zeros"]
