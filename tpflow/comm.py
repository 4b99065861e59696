"""Point-to-point transfers between ranks of the world, with byte counters.

Boxing across placements moves blocks between ranks that share no mesh, so it talks over
the default (world) group with ``isend`` / ``irecv``: gloo on CPU, NCCL on CUDA. Every
transfer is counted, so tests and benchmarks can check how many bytes a route moved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["CommStats", "stats", "exchange"]


@dataclass
class CommStats:
    """Bytes and messages this rank has sent since the last ``reset()``."""

    bytes_sent: int = 0
    messages_sent: int = 0

    def reset(self) -> None:
        self.bytes_sent = 0
        self.messages_sent = 0


stats = CommStats()


def exchange(sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]) -> None:
    """Post every send and receive of one step at once, then wait for all of them.

    Posting all before waiting on any means two ranks that send to each other cannot
    deadlock. ``recvs`` buffers are filled in place; empty tensors are skipped.
    """
    works, keep_alive = [], []  # the send buffers must outlive their works
    for peer, buf in recvs:
        if buf.numel():
            works.append(dist.irecv(buf, src=peer))
    for peer, tensor in sends:
        if tensor.numel():
            keep_alive.append(tensor.contiguous())
            works.append(dist.isend(keep_alive[-1], dst=peer))
            stats.bytes_sent += tensor.numel() * tensor.element_size()
            stats.messages_sent += 1
    for work in works:
        work.wait()
