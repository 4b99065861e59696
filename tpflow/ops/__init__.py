"""Operations that combine the kernels with communication, on local shards: matmul + reduce-scatter and
all-gather + matmul walked around a ring, each the other's backward; the cross-entropy over classes split
across ranks, and the head + loss fused chunk by chunk; attention over a sequence split across ranks (ring and
Ulysses context parallelism; the ring over packed documents and sliding windows fetching only the keys seen)."""

from __future__ import annotations

from tpflow.ops.bounded_ring import RingExchange, bounded_attention, bounded_ring_attention, pieces, ring_exchange
from tpflow.ops.collective_matmul import (
    ALGOS,
    all_gather_matmul,
    all_gather_matmul_ref,
    matmul_reduce_scatter,
    matmul_reduce_scatter_ref,
)
from tpflow.ops.context_attention import (
    attention_work,
    balanced,
    contiguous,
    head_tail,
    regroup,
    ring_attention,
    ulysses_attention,
    ulysses_degrees,
)
from tpflow.ops.cross_entropy import linear_cross_entropy, vocab_parallel_cross_entropy

__all__ = ["ALGOS", "RingExchange", "all_gather_matmul", "all_gather_matmul_ref", "attention_work", "balanced",
           "bounded_attention", "bounded_ring_attention", "contiguous", "head_tail", "linear_cross_entropy",
           "matmul_reduce_scatter", "matmul_reduce_scatter_ref", "pieces", "regroup", "ring_attention",
           "ring_exchange", "ulysses_attention", "ulysses_degrees", "vocab_parallel_cross_entropy"]
