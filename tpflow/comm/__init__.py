"""Communication on local shards: collectives with byte counters, the transports the ring collectives run
over (torch.distributed, or ranks as threads on an emulated link), and the metadata messages ranks
exchange before blocks travel. Nothing here computes: products live in ``tpflow.kernels``, and
``tpflow.ops`` combines the two.

    collectives   point-to-point transfers, all-gather / reduce-scatter with uneven chunks, autograd pairs
    transport     the Transport interface, its torch.distributed implementation, and the two rings
    fake          FakeWorld: ranks as threads joined by emulated links, for tests and benchmarks
    wire          a tensor's shape, dtype and SBP (or an error) as a fixed-size message
"""

from __future__ import annotations

from tpflow.comm import collectives, wire
from tpflow.comm.collectives import (
    CommStats,
    Pending,
    all_gather,
    all_reduce,
    batch,
    bounds,
    count_ring,
    exchange,
    gather,
    post,
    reduce,
    reduce_chunk,
    reduce_scatter,
    ring_bytes,
    scatter,
    stats,
)
from tpflow.comm.fake import FakeTransport, FakeWorld
from tpflow.comm.transport import DistTransport, Handle, Transport, as_transport, row_bounds

__all__ = ["CommStats", "DistTransport", "FakeTransport", "FakeWorld", "Handle", "Pending", "Transport", "all_gather",
           "all_reduce", "as_transport", "batch", "bounds", "collectives", "count_ring", "exchange", "gather", "post",
           "reduce", "reduce_chunk", "reduce_scatter", "ring_bytes", "row_bounds", "scatter", "stats", "wire"]
