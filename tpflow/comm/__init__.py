"""Communication on local shards: transfers and collectives with byte counters, the autograd pairs the layers'
hot path uses, the transports the ring collectives run over (torch.distributed, or ranks as threads on an
emulated link), and the metadata messages ranks exchange before blocks travel. Nothing here computes: products
live in ``tpflow.kernels``, and ``tpflow.ops`` combines the two.

    agreement     ranks that must share a plan, a schedule, an input: checked, the same error on every rank
    accounting    CommStats: the bytes and messages this rank sent; what a ring pass costs
    p2p           point-to-point transfers posted without waiting (Pending), grouped for NCCL (batch)
    collectives   all-reduce, all-gather / reduce-scatter with uneven chunks, all-to-all by counts
    shm           those collectives for CPU ranks on one host, through shared memory instead of gloo
    pairs         autograd pairs, a collective forward and its conjugate backward (gather_from_ranks, ...)
    transport     the Transport interface, its torch.distributed implementation, and the two rings
    fake          FakeWorld: ranks as threads joined by emulated links, for tests and benchmarks
    wire          a tensor's shape, dtype and SBP (or an error) as a fixed-size message
    peers         a peer's failure said plainly: gone (a closed connection) or late (the rank waited for)
    random_state  one random state for a group of ranks: the first rank's
"""

from __future__ import annotations

from tpflow.comm import shm, wire
from tpflow.comm.accounting import CommStats, count_ring, ring_bytes, stats
from tpflow.comm.agreement import agree
from tpflow.comm.collectives import all_gather, all_reduce, all_reduce_cat, all_to_all, exchange_counts, reduce_scatter
from tpflow.comm.fake import FakeTransport, FakeWorld
from tpflow.comm.p2p import Pending, batch, post
from tpflow.comm.pairs import (
    all_to_all_mirror,
    copy_to_ranks,
    gather_from_ranks,
    gather_shared,
    reduce_from_ranks,
    reduce_scatter_to_ranks,
    scatter_to_ranks,
)
from tpflow.comm.random_state import share_random_state
from tpflow.comm.transport import DistTransport, Handle, Transport, as_transport

__all__ = [
    "CommStats",
    "DistTransport",
    "FakeTransport",
    "FakeWorld",
    "Handle",
    "Pending",
    "Transport",
    "agree",
    "all_gather",
    "all_reduce",
    "all_reduce_cat",
    "all_to_all",
    "all_to_all_mirror",
    "as_transport",
    "batch",
    "copy_to_ranks",
    "count_ring",
    "exchange_counts",
    "gather_from_ranks",
    "gather_shared",
    "post",
    "reduce_from_ranks",
    "reduce_scatter",
    "reduce_scatter_to_ranks",
    "ring_bytes",
    "scatter_to_ranks",
    "share_random_state",
    "shm",
    "stats",
    "wire",
]
