"""Distribution: collectives on local shards with byte counters, the transports the ring collectives
run over (torch.distributed, or ranks as threads on an emulated link), and the metadata messages
ranks exchange before blocks travel. Nothing here computes: products live in ``tpflow.kernels``,
and ``tpflow.ops`` combines the two."""

from __future__ import annotations

from tpflow.dist import comm, wire
from tpflow.dist.comm import CommStats, stats
from tpflow.dist.fake import FakeTransport, FakeWorld
from tpflow.dist.transport import DistTransport, Handle, Transport, as_transport, row_bounds

__all__ = ["CommStats", "DistTransport", "FakeTransport", "FakeWorld", "Handle", "Transport", "as_transport", "comm",
           "row_bounds", "stats", "wire"]
