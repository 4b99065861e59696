"""Byte accounting: what this rank has sent, counted where it is sent.

Every point-to-point transfer (``tpflow.comm.p2p``) and every library collective (``tpflow.comm.collectives``)
adds to ``stats``. A ring-shaped collective (all-reduce, all-gather, reduce-scatter) counts the bytes of the ring
algorithm that implements it, (W-1)/W of the tensor per pass, so counts compare across backends: a gloo
reduce-scatter is an all-reduce underneath and counts two passes. An all-to-all counts what it sends other ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CommStats", "count_ring", "ring_bytes", "stats"]


@dataclass
class CommStats:
    """Bytes and messages this rank has sent since the last ``reset()``.

    Transfers inside a graph torch.compile traces are not counted: dynamo would bake the count into the
    graph and guard on its value, so every call changed it and recompiled until the recompile limit.
    ``tpf.comm.stats`` is the one this rank's collectives count into; a ``FakeTransport`` keeps its own.

    Args:
        bytes_sent: bytes sent so far.
        messages_sent: messages sent so far (a ring pass over ``W`` ranks counts ``W - 1``).

    Example::

        >>> counter = tpf.comm.CommStats()
        >>> counter.add(4096, messages=2)
        >>> counter.bytes_sent, counter.messages_sent
        (4096, 2)
        >>> counter.reset()
        >>> counter.bytes_sent
        0
    """

    bytes_sent: int = 0
    messages_sent: int = 0

    def add(self, nbytes: int, messages: int = 1) -> None:
        """Count ``messages`` transfers of ``nbytes`` in all (nothing while torch.compile traces)."""
        if not torch.compiler.is_compiling():
            self.bytes_sent += nbytes
            self.messages_sent += messages

    def reset(self) -> None:
        """Start counting from zero."""
        self.bytes_sent = 0
        self.messages_sent = 0


stats = CommStats()


def ring_bytes(nbytes: int, world: int, passes: int) -> int:
    """Bytes one rank sends in ``passes`` ring passes over ``nbytes`` on ``world`` ranks: (W-1)/W of it each.

    Args:
        nbytes: the size of the whole tensor, in bytes.
        world: the number of ranks in the ring.
        passes: ring passes: 1 for an all-gather or a reduce-scatter, 2 for an all-reduce.

    Returns:
        ``passes * (world - 1) * nbytes // world``.

    Example::

        >>> tpf.comm.ring_bytes(1 << 20, world=4, passes=2)  # an all-reduce of 1 MiB on 4 ranks
        1572864
    """
    return passes * (world - 1) * nbytes // world


def count_ring(t: torch.Tensor, world: int, passes: int) -> None:
    """Count ``passes`` ring passes over ``t`` on a group of ``world`` ranks.

    Adds ``ring_bytes`` of ``t``'s bytes and ``passes * (world - 1)`` messages to ``stats``.

    Args:
        t: the whole tensor the ring passes over, not one rank's chunk.
        world: the number of ranks in the group.
        passes: ring passes, as in ``ring_bytes``.

    Example::

        >>> tpf.comm.stats.reset()
        >>> tpf.comm.count_ring(torch.empty(1024), world=4, passes=1)
        >>> tpf.comm.stats.bytes_sent, tpf.comm.stats.messages_sent
        (3072, 3)
    """
    stats.add(ring_bytes(t.numel() * t.element_size(), world, passes), passes * (world - 1))
