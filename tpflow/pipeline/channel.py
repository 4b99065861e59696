"""One direction of a pipeline's hand-offs between neighbouring stages (``tpflow.pipeline.handoff.Link`` pairs
two): the messages, their tags, the headers both ends remember and the receives posted ahead.

A hand-off of micro-batch ``i`` is a header from each sending rank to each receiving rank (shape, dtype, SBP, or
an error's text), tag ``base + 3 i``, and the blocks, tag ``base + 3 i + 1``; the end of the step is a header
with tag ``base + 3 m`` each way (whether the stages before, and after, ended it well). Each link has its own
``base``, so the links between the same two rank sets (the chunks of an interleaved pipeline) keep apart.

Both ends remember each micro-batch's header from the step before. A receiver that remembers one posts the
blocks' receive beside the header's, before either arrives, so taking a hand-off is one wait, not a header's
round trip and then the blocks'. Between stages of one rank each on the CPU (``direct_route``: one message), the
header rides in front of the blocks in that one message (a steady hand-off: one message to post on each side, not
two); between multi-rank stages every rank's header still goes to every rank, so that one rank's error, or ranks
of one stage that hand off different tensors, stop every rank of the next stage. When the header says otherwise
(a batch of another shape), the sender, who remembers the same, fills the receive that was posted with zeros of
the remembered layout and sends the blocks again under tag ``base + 3 i + 2``; an error goes in the remembered
layout's place too. On CPU (gloo) a receiver also posts micro-batch ``i + 1``'s receives as soon as it takes
micro-batch ``i``, so the blocks travel while the stage computes.

On CUDA (NCCL) a rank's sends and receives to one peer share a stream, where a send not yet matched holds up
what follows: 1F1B's stage s sends an activation and then receives a gradient while stage s + 1 sends that
gradient and then receives the activation. There (``pipeline_pairs``), a send followed in the table by a
receive from the same rank set goes out as one group with it (``comm.batch``): both headers first (over gloo),
then the two transfers of blocks together; nothing is posted ahead.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from tpflow import comm
from tpflow.comm.peers import closed_connection, timed_out, waiting_on
from tpflow.comm.wire import FAILED, HEADER_BYTES, OK, header, read_header
from tpflow.global_tensor import zeros
from tpflow.global_tensor.blocks import Block
from tpflow.global_tensor.boxing import direct_route, post_across
from tpflow.pipeline.stage import PipelineError
from tpflow.placement import Placement
from tpflow.sbp import Sbp

__all__ = ["Paired", "PeerDied"]


class Meta(NamedTuple):
    """What a header says of a hand-off (the receiver adds ``dst``); both ends remember it per micro-batch."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    src: tuple[Sbp, ...]  # the layout on the sending stage
    dst: tuple[Sbp, ...]  # and on the receiving one
    requires_grad: bool

    def block(self, local: torch.Tensor) -> Block:
        """The sender's block ``local`` of the tensor this header describes."""
        return Block(local, self.src, self.shape)

    def absent(self) -> Block:
        """What a receiver holds of it before the blocks arrive (it is not on the sending placement)."""
        return Block.absent(self.src, self.shape, self.dtype)


# a receive paired with a send: called after the send's header is out, it waits for the receive's header and
# returns what posts the receive's blocks (in the send's group)
Paired = Callable[[], Callable[[], None]]


def send(channel: Channel, x: torch.Tensor, meta: Meta, i: int, pending: comm.Pending,
          paired: Paired | None) -> None:
    """Post a hand-off of this rank's block ``x``. With ``paired``, the header goes first (the peer waits for it
    before its own group), then the blocks in one group with that receive's, once its header is in."""
    if paired is None:
        channel.send(x, meta, i, pending)
        return
    channel.send_header(meta, i, pending)
    post_receive = paired()
    with comm.batch(channel.frm.type):
        channel.send_blocks(x, meta, i, pending)
        post_receive()


@functools.lru_cache(maxsize=256)
def _ok_header(meta: Meta) -> torch.Tensor:
    """A header saying all is well with the layout ``meta`` (never written to: messages copy it)."""
    return header(OK, meta.shape, meta.dtype, meta.src, requires_grad=meta.requires_grad)


def _padded(head: torch.Tensor, nbytes: int) -> torch.Tensor:
    """A steady hand-off's message of ``nbytes`` that carries only its header ``head``: the rest zeros."""
    return torch.cat([head, torch.zeros(nbytes - HEADER_BYTES, dtype=torch.uint8)])


class PeerDied(RuntimeError):
    """A peer rank closed its connection while this rank waited for its hand-off: its process died or exited.

    Args:
        args: the message, naming the rank and its stage (as ``RuntimeError``'s).

    Example::

        >>> str(PeerDied("rank 2 of stage 1 died or closed its connection"))
        'rank 2 of stage 1 died or closed its connection'
    """


def _wait(pending: comm.Pending, peers: list[int], sender: int) -> None:
    """Wait for receives from ``peers`` (ranks of stage ``sender``), one work each; a peer that closed its
    connection is named."""
    for j, work in enumerate(pending.works):
        try:
            work.wait()
        except RuntimeError as e:
            if not closed_connection(e) and not timed_out(e):
                raise
            who = f"rank {peers[j]}" if len(peers) == len(pending.works) else f"one of ranks {peers}"
            if timed_out(e):
                raise waiting_on(f"the hand-off from stage {sender}", who, e) from e
            raise PeerDied(f"{who} of stage {sender} died or closed its connection: {type(e).__name__}: {e}") from e
    pending.works, pending.buffers = [], []


def _post_each(sends: list[tuple[int, torch.Tensor]], tag: int, pending: comm.Pending) -> None:
    """A failed step's messages, each on its own: a send to a peer that died raises, and must not stop the
    others."""
    for peer, buf in sends:
        try:
            comm.post([(peer, buf)], [], tag=tag, pending=pending)
        except RuntimeError:
            continue


class PeerFailed(PipelineError):
    """The peer stage sent its error: it needs nothing more from this rank on that link."""


class _Incoming:
    """A hand-off's receives, posted: the header's, and the blocks' where the layout was remembered."""

    def __init__(self, headers: list[tuple[int, torch.Tensor]], pending: comm.Pending, guess: Meta | None,
                 blocks: tuple[comm.Pending, torch.Tensor | None] | None) -> None:
        self.headers, self.pending, self.guess, self.blocks = headers, pending, guess, blocks
        self.meta: Meta | None = None


class Channel:
    """One direction of a link: hand-offs from rank set ``frm`` to rank set ``to``, tags from ``base``."""

    def __init__(self, frm: Placement, to: Placement, base: int, ahead: bool) -> None:
        self.frm, self.to, self.base, self.ahead = frm, to, base, ahead
        self.remembered: dict[int, Meta] = {}  # per micro-batch, the last header (both ends keep the same)
        self.incoming: dict[int, _Incoming] = {}  # on the receiving end: receives posted ahead

    def _tags(self, i: int) -> tuple[int, int, int]:
        return self.base + 3 * i, self.base + 3 * i + 1, self.base + 3 * i + 2

    def _steady(self, i: int, sending: bool) -> tuple[int, tuple[int, ...], int] | None:
        """Where micro-batch ``i``'s remembered layout makes its hand-off one message, header in front (stages of
        one rank): this rank's peer (the receiver when ``sending``, else the sender), its blocks' shape and the
        message's bytes; None where the header travels apart."""
        meta = self.remembered.get(i) if self.ahead and self.frm.type == "cpu" else None
        if meta is None:
            return None
        route = direct_route(self.frm, meta.src, self.to, meta.dst, meta.shape)
        if route is None or len(route) > 1:  # between multi-rank stages every rank's header goes to every rank
            return None
        (sender, receiver, lengths), = route
        if dist.get_rank() != (sender if sending else receiver):
            return None
        return receiver if sending else sender, lengths, HEADER_BYTES + math.prod(lengths) * meta.dtype.itemsize

    def send(self, x: torch.Tensor, meta: Meta, i: int, pending: comm.Pending) -> None:
        """Post micro-batch ``i``'s hand-off (this rank's block ``x`` in the layout ``meta`` names), unpaired. A
        steady one is one message, header in front (the blocks after the layout changed: under tag
        ``base + 3 i + 2``, first, so an error while posting them leaves the message's tag for the error). Else
        the blocks go first and then the header, for the same reason."""
        steady = self._steady(i, sending=True)
        if steady is None:
            self.send_blocks(x, meta, i, pending)
            self.send_header(meta, i, pending)
            return
        peer, _, nbytes = steady
        if meta == self.remembered[i]:
            message = torch.cat([_ok_header(meta), x.contiguous().view(-1).view(torch.uint8)])
        else:
            post_across(meta.block(x), self.frm, self.to, meta.dst, self._tags(i)[2], pending)
            message = _padded(_ok_header(meta), nbytes)
        comm.post([(peer, message)], [], tag=self._tags(i)[1], pending=pending)
        self.remembered[i] = meta

    def send_header(self, meta: Meta, i: int, pending: comm.Pending) -> None:
        comm.post([(r, _ok_header(meta)) for r in self.to.flat_ranks], [], tag=self._tags(i)[0], pending=pending)

    def send_status(self, buf: torch.Tensor, i: int, pending: comm.Pending) -> None:
        """An error header in micro-batch ``i``'s place (a steady hand-off's: in front of zeros of its size), or the
        end of the step (``i = m``)."""
        steady = self._steady(i, sending=True)
        if steady is None:
            _post_each([(r, buf) for r in self.to.flat_ranks], self._tags(i)[0], pending)
            return
        peer, _, nbytes = steady
        _post_each([(peer, _padded(buf, nbytes))], self._tags(i)[1], pending)

    def send_blocks(self, x: torch.Tensor, meta: Meta, i: int, pending: comm.Pending) -> None:
        """Micro-batch ``i``'s blocks (this rank's block ``x`` in the layout ``meta`` names)."""
        _, tag, again = self._tags(i)
        guess = self.remembered.get(i) if self.ahead else None
        if guess is not None and guess != meta:  # the receiver posted blocks of the remembered layout: fill them
            filler = zeros(*guess.shape, dtype=guess.dtype, placement=self.frm, sbp=guess.src)
            post_across(Block.of(filler), self.frm, self.to, guess.dst, tag, pending)
            tag = again
        post_across(meta.block(x), self.frm, self.to, meta.dst, tag, pending)
        self.remembered[i] = meta

    def post(self, i: int) -> _Incoming:
        """Post micro-batch ``i``'s receives: its header's, and (``ahead``) its blocks' where the layout is
        remembered, in one message where it is steady."""
        if i in self.incoming:
            return self.incoming[i]
        guess = self.remembered.get(i) if self.ahead else None
        steady = self._steady(i, sending=False)
        if steady is not None:
            peer, lengths, nbytes = steady
            message = torch.empty(nbytes, dtype=torch.uint8)
            pending = comm.post([], [(peer, message)], tag=self._tags(i)[1])
            body = message[HEADER_BYTES:].view(guess.dtype).view(lengths)
            self.incoming[i] = _Incoming([(peer, message[:HEADER_BYTES])], pending, guess, (comm.Pending(), body))
            return self.incoming[i]
        headers = [(r, torch.empty(HEADER_BYTES, dtype=torch.uint8)) for r in self.frm.flat_ranks]
        pending = comm.post([], headers, tag=self._tags(i)[0])
        posted = None
        if guess is not None:
            posted = post_across(guess.absent(), self.frm, self.to, guess.dst, self._tags(i)[1])
        self.incoming[i] = _Incoming(headers, pending, guess, posted)
        return self.incoming[i]

    def header(self, i: int, dst_of: Callable[[tuple[Sbp, ...], int], tuple[Sbp, ...]], sender: int) -> Meta:
        """Micro-batch ``i``'s header (its receive posted now if it was not); raises a failed sender's error."""
        incoming = self.post(i)
        if incoming.meta is None:
            _wait(incoming.pending, [r for r, _ in incoming.headers], sender)
            read = [read_header(b) for _, b in incoming.headers]
            for status, *_, message, _ in read:
                if status == FAILED:
                    raise PeerFailed(message)
            metas = {(*h[1:4], h[5]) for h in read}  # shape, dtype, SBP, requires_grad
            if len(metas) > 1:
                raise PipelineError(f"the ranks of stage {sender} hand off different tensors for micro-batch {i}: "
                                    f"{sorted(map(str, metas))}")
            shape, dtype, src, requires_grad = metas.pop()
            incoming.meta = Meta(shape, dtype, src, dst_of(src, len(shape)), requires_grad)
        return incoming.meta

    def post_blocks(self, i: int, meta: Meta) -> None:
        """Post micro-batch ``i``'s blocks' receive for the layout its header gave (where none was posted ahead)."""
        incoming = self.incoming[i]
        if incoming.guess == meta:
            return
        _, tag, again = self._tags(i)
        if incoming.guess is not None:
            incoming.blocks[0].wait()  # the sender's filler (in a steady hand-off's message, already in)
            tag = again
        incoming.blocks = post_across(meta.absent(), self.frm, self.to, meta.dst, tag)
        incoming.guess = meta

    def abandon(self, keep: comm.Pending) -> None:
        """A failed step: hand the receives still posted (never to be taken) to ``keep``, which holds them for the
        process's lifetime: gloo must not see a posted receive's work and buffer freed."""
        for incoming in self.incoming.values():
            keep.works += incoming.pending.works
            keep.buffers += [b for _, b in incoming.headers]
            if incoming.blocks is not None:
                keep.works += incoming.blocks[0].works
                keep.buffers += [t for t in (incoming.blocks[1],) if t is not None]
        self.incoming = {}

    def take(self, i: int, dst_of: Callable[[tuple[Sbp, ...], int], tuple[Sbp, ...]],
             sender: int) -> tuple[torch.Tensor, Meta]:
        """Micro-batch ``i``'s blocks on this rank, once arrived, and the header's layout."""
        meta = self.header(i, dst_of, sender)
        self.post_blocks(i, meta)
        pending, local = self.incoming.pop(i).blocks
        _wait(pending, self.frm.flat_ranks, sender)
        self.remembered[i] = meta
        return local, meta


