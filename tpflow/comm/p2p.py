"""Point-to-point transfers over the world group: boxing across placements (ranks that share no mesh) and a
pipeline's hand-offs between stages.

``post`` posts sends and receives without waiting and collects them in a ``Pending``; ``batch`` makes the
transfers posted inside it one NCCL group, so that two ranks sending to each other do not wait on each other.
Every send is counted in ``tpflow.comm.stats``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from tpflow.comm.accounting import stats

__all__ = ["Pending", "batch", "post"]


class Pending:
    """Posted point-to-point transfers; their send buffers stay alive until ``wait`` returns.

    ``post`` makes one, or adds to the one it is given, so that the transfers of several calls are waited on
    together. The receive buffers hold their data once ``wait`` has returned.

    Example::

        >>> pending = tpf.comm.Pending()
        >>> peer = 1 - tpf.get_rank()                   # on 2 ranks: each sends the other its rank, in two calls
        >>> buf = torch.empty(2)
        >>> _ = tpf.comm.post([(peer, torch.full((2,), float(tpf.get_rank())))], [], pending=pending)
        >>> _ = tpf.comm.post([], [(peer, buf)], pending=pending)
        >>> pending.wait()
        >>> buf                                         # on rank 0
        tensor([1., 1.])
    """

    def __init__(self) -> None:
        self.works: list = []
        self.buffers: list[torch.Tensor] = []

    def wait(self) -> None:
        """Wait for every transfer, then let go of the send buffers."""
        for work in self.works:
            work.wait()
        self.works, self.buffers = [], []


def post(sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]], tag: int = 0,
         pending: Pending | None = None) -> Pending:
    """Post sends and receives without waiting (added to ``pending`` if given).

    ``recvs`` buffers are filled in place once waited on; empty tensors travel nowhere, on both sides.
    Peers are ranks of the world group. Receives are posted before sends, so two ranks that send to each other
    in one call cannot deadlock; every send is counted in ``stats``, and the tensor it reads (made contiguous)
    is kept in the ``Pending`` until ``wait``.

    Args:
        sends: ``(peer, tensor)`` pairs: what to send to which rank.
        recvs: ``(peer, buffer)`` pairs: the buffers to receive into, and from which rank.
        tag: the tag of every message posted; both ends must use the same.
        pending: a ``Pending`` to add the transfers to; default: a new one.

    Returns:
        The ``Pending`` holding the transfers: call its ``wait()`` before reading the receive buffers.

    Example::

        >>> peer = 1 - tpf.get_rank()                   # on 2 ranks: swap blocks
        >>> buf = torch.empty(3)
        >>> tpf.comm.post([(peer, torch.full((3,), 10.0 + tpf.get_rank()))], [(peer, buf)]).wait()
        >>> buf                                         # on rank 1
        tensor([10., 10., 10.])
    """
    pending = Pending() if pending is None else pending
    for peer, buf in recvs:
        if buf.numel():
            _issue(dist.irecv, buf, peer, tag, pending)
    for peer, tensor in sends:
        if tensor.numel():
            pending.buffers.append(tensor.contiguous())
            _issue(dist.isend, pending.buffers[-1], peer, tag, pending)
            stats.add(tensor.numel() * tensor.element_size())
    return pending


_BATCH: list[tuple[str, list, list[Pending]]] = []  # the open batch(): its device type, its ops, their Pendings


def _issue(op, tensor: torch.Tensor, peer: int, tag: int, pending: Pending) -> None:
    if _BATCH and _BATCH[-1][0] == tensor.device.type:
        _BATCH[-1][1].append(dist.P2POp(op, tensor, peer, tag=tag))
        _BATCH[-1][2].append(pending)
    else:
        pending.works.append(op(tensor, peer, tag=tag))


@contextlib.contextmanager
def batch(device: str) -> Iterator[None]:
    """Post the point-to-point transfers of the block's ``post`` calls on ``device`` tensors as one group
    (``dist.batch_isend_irecv``), when the block ends without an error; others are posted at once.

    On NCCL a rank's sends and receives to one peer share a stream, where a send that is not yet matched holds
    up everything behind it: two ranks that each send, then receive from the other, wait for ever. In one group
    the send and the receive progress together (how a pipeline's stage sends an activation and receives a
    gradient at once).

    Args:
        device: the device type whose transfers are grouped (``"cuda"``; gloo's CPU tensors travel apart).

    Returns:
        A context manager; the transfers are posted when it exits, and waited on through their ``Pending``.

    Example::

        >>> peer, pending, buf = 1 - tpf.get_rank(), tpf.comm.Pending(), torch.empty(2)
        >>> with tpf.comm.batch("cpu"):                 # on 2 ranks: one group of a send and a receive each
        ...     _ = tpf.comm.post([(peer, torch.ones(2))], [(peer, buf)], pending=pending)
        >>> pending.wait()
        >>> buf
        tensor([1., 1.])
    """
    _BATCH.append((device, [], []))
    try:
        yield
        _, ops, pendings = _BATCH[-1]
    finally:
        _BATCH.pop()
    if ops:
        works = dist.batch_isend_irecv(ops)
        if len(works) == len(ops):  # one per op (gloo), whose wait() must run once
            for pending, work in zip(pendings, works):
                pending.works.append(work)
        else:  # one for the group (NCCL), which any number of waits may wait on
            for pending in {id(p): p for p in pendings}.values():
                pending.works.extend(works)
