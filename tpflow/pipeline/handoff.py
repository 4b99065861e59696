"""Hand-offs between neighbouring stages: activations forward, their gradients back, each the cross-placement
boxing of ``to_global`` split in two (the sender posts its blocks and goes on; the receiver waits when its table
says so).

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

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist

from tpflow import comm
from tpflow.comm.peers import closed_connection, timed_out, waiting_on
from tpflow.comm.wire import FAILED, HEADER_BYTES, OK, header, read_header
from tpflow.global_tensor import zeros
from tpflow.global_tensor.blocks import Block
from tpflow.global_tensor.boxing import direct_route, post_across
from tpflow.pipeline.stage import PipelineError, Stage
from tpflow.placement import Placement
from tpflow.sbp import Sbp, dual

__all__ = ["Link", "Paired", "PeerDied"]


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


def _send(channel: _Channel, x: torch.Tensor, meta: Meta, i: int, pending: comm.Pending,
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


class _PeerFailed(PipelineError):
    """The peer stage sent its error: it needs nothing more from this rank on that link."""


class _Incoming:
    """A hand-off's receives, posted: the header's, and the blocks' where the layout was remembered."""

    def __init__(self, headers: list[tuple[int, torch.Tensor]], pending: comm.Pending, guess: Meta | None,
                 blocks: tuple[comm.Pending, torch.Tensor | None] | None) -> None:
        self.headers, self.pending, self.guess, self.blocks = headers, pending, guess, blocks
        self.meta: Meta | None = None


class _Channel:
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
                    raise _PeerFailed(message)
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


class Link:
    """The hand-offs between stage ``s`` (``src``) and stage ``s + 1`` (``dst``): activations forward, their
    gradients back, and the end of each step.

    Args:
        src, dst: the two stages.
        base: the link's first tag.
        micro_batches: the micro-batches of a step.
        ahead: post receives ahead (the blocks of a remembered layout, and the next micro-batch's): on gloo.

    Example::

        >>> from torch import nn
        >>> stages = [tpf.stage(nn.Linear(8, 8), stage_id=k, placement=tpf.placement("cpu", [k])) for k in range(2)]
        >>> link = Link(stages[0], stages[1], base=0, micro_batches=4, ahead=True)   # as tpf.Pipeline makes it
        >>> link.acts.frm.ranks, link.acts.to.ranks, link.grads.to.ranks           # activations on, gradients back
        ([0], [1], [0])
    """

    def __init__(self, src: Stage, dst: Stage, base: int, micro_batches: int, ahead: bool) -> None:
        self.src, self.dst, self.m, self.ahead = src, dst, micro_batches, ahead
        self.acts = _Channel(src.placement, dst.placement, base, ahead)
        self.grads = _Channel(dst.placement, src.placement, base, ahead)
        self.reset()

    def reset(self) -> None:
        """A new step: nothing sent or taken yet on this rank."""
        self.sent = {"act": 0, "grad": 0}  # hand-offs this rank has posted, per direction
        self.grads_received = 0  # on src: gradients taken from dst
        self.peer_failed = False  # an error header came over this link
        self.out_sbps: dict[int, tuple[Sbp, ...]] = {}  # on dst: each received activation's SBP on src
        self.in_sbps: dict[int, tuple[Sbp, ...]] = {}  # on dst: and on dst
        self.ended = False  # on src: the end of the step was posted
        self.ended_up = False  # on dst: the end of the step was posted back to src

    @contextlib.contextmanager
    def _watching(self) -> Iterator[None]:
        """Waits on the peer stage: its error header marks the link failed (the peer needs nothing more on it)."""
        try:
            yield
        except _PeerFailed:
            self.peer_failed = True
            raise

    def start(self, rank_in_src: bool) -> None:
        """Post the step's first receives ahead: micro-batch 0's gradient on src, its activation on dst."""
        if self.ahead:
            (self.grads if rank_in_src else self.acts).post(0)

    # activations, src -> dst

    def _dst_of(self, src: tuple[Sbp, ...], ndim: int) -> tuple[Sbp, ...]:
        return self.dst.input_sbp(self.src.placement, src, ndim)

    def send_act(self, y: Block, i: int, pending: comm.Pending, paired: Paired | None = None) -> None:
        """Micro-batch ``i``'s activation (this rank's block ``y``) to dst; ``paired``: a receive to post in one group
        with it."""
        meta = Meta(y.shape, y.local.dtype, y.sbp, self._dst_of(y.sbp, len(y.shape)), y.local.requires_grad)
        _send(self.acts, y.local.detach(), meta, i, pending, paired)
        self.sent["act"] += 1

    def recv_act(self, i: int) -> Block:
        """Micro-batch ``i``'s activation: this rank's block of it (a leaf, needing a gradient unless the stage
        before is frozen), laid out as dst computes on it."""
        with self._watching():
            local, meta = self.acts.take(i, self._dst_of, self.src.stage_id)
        if self.ahead and i + 1 < self.m:
            self.acts.post(i + 1)
        self.out_sbps[i], self.in_sbps[i] = meta.src, meta.dst
        return Block(local.requires_grad_(meta.requires_grad), meta.dst, meta.shape)

    # gradients, dst -> src

    def send_grad(self, grad: torch.Tensor, i: int, pending: comm.Pending, paired: Paired | None = None) -> None:
        """The gradient of micro-batch ``i``'s activation (this rank's block, laid out as the input's gradient:
        ``dual`` of its SBP), to src; ``paired``: a receive to post in one group with it."""
        sbps = dual(self.in_sbps.pop(i))
        meta = Meta(self.acts_shape(i), grad.dtype, sbps, dual(self.out_sbps.pop(i)), False)
        _send(self.grads, grad, meta, i, pending, paired)
        self.sent["grad"] += 1

    def acts_shape(self, i: int) -> tuple[int, ...]:
        """The global shape of micro-batch ``i``'s activation, as its header said."""
        return self.acts.remembered[i].shape

    def recv_grad(self, y: Block, i: int) -> torch.Tensor:
        """The gradient of this stage's output ``y`` (a block), from the stage after: this rank's block of it."""
        with self._watching():
            local, meta = self.grads.take(i, lambda src, ndim: dual(y.sbp), self.dst.stage_id)
        if meta.shape != tuple(y.shape):
            raise PipelineError(f"stage {self.dst.stage_id} sent a gradient of shape {meta.shape} for an output of "
                                f"shape {tuple(y.shape)} (micro-batch {i})")
        if self.ahead and i + 1 < self.m:
            self.grads.post(i + 1)
        self.grads_received += 1
        return local

    # pairs: a send and the next receive from the same rank set as one group (NCCL)

    def paired_act(self, i: int) -> Paired:
        """Micro-batch ``i``'s activation receive, for a send to post in one group with it."""
        def header() -> Callable[[], None]:
            with self._watching():
                meta = self.acts.header(i, self._dst_of, self.src.stage_id)
            return lambda: self.acts.post_blocks(i, meta)
        return header

    def paired_grad(self, y: Block, i: int) -> Paired:
        """Micro-batch ``i``'s gradient receive (of the output block ``y``), for a send to post in one group with
        it."""
        def header() -> Callable[[], None]:
            with self._watching():
                meta = self.grads.header(i, lambda src, ndim: dual(y.sbp), self.dst.stage_id)
            return lambda: self.grads.post_blocks(i, meta)
        return header

    # failures and the end of the step

    def fail(self, message: str, towards: str, pending: comm.Pending) -> bool:
        """Post an error header where the peer stage waits next, if this rank still owes it messages. Returns
        whether this rank must then ``drain`` the link: a peer stage after this one that already has every
        activation runs on and sends its gradients, whose sends it waits on."""
        kind, channel, incoming = ("act", self.acts, self.grads) if towards == "dst" else \
            ("grad", self.grads, self.acts)
        drain = not (self.peer_failed or self.ended) and self.sent[kind] == self.m and towards == "dst"
        if not drain:  # receives this rank posted ahead from the peer, which it will never take
            incoming.abandon(pending)
        if not (self.peer_failed or self.ended) and self.sent[kind] < self.m:
            channel.send_status(header(FAILED, message=message), self.sent[kind], pending)
        elif towards == "src" and not (self.peer_failed or self.ended_up):  # every gradient sent (a W failed after)
            self.end_up(message, pending)
        return drain

    def drain(self, message: str, outputs: dict, pending: comm.Pending) -> None:
        """Take (and drop) the gradients the stage after this one still sends, then tell it the step failed, so that
        it does not end its step as if nothing broke."""
        for i in range(self.grads_received, self.m):
            try:
                self.recv_grad(outputs[i], i)
            except PipelineError:
                self.grads.abandon(pending)
                return
        self.end(message, pending)

    def end(self, message: str | None, pending: comm.Pending) -> None:
        """On src, at the end of its step: whether it failed, to dst (after the micro-batches' tags), so a stage
        that already had all it needed from src does not end its step as if nothing broke."""
        self.acts.send_status(header(OK) if message is None else header(FAILED, message=message), self.m, pending)
        self.ended = True

    def end_up(self, message: str | None, pending: comm.Pending) -> None:
        """On dst, at the end of its step, once the stages after it ended theirs: whether it (or one of them) failed,
        to src, so that a stage before it does not end its step as if nothing broke (a zero-bubble stage computes
        weight gradients after its last gradient is sent)."""
        self.grads.send_status(header(OK) if message is None else header(FAILED, message=message), self.m, pending)
        self.ended_up = True

    def wait_end_up(self) -> None:
        """On src: dst's end of step (and of the stages after it); raises its error if it failed."""
        self._wait_end(self.grads, self.dst)

    def wait_end(self) -> None:
        """On dst: src's end of step; raises its error if it failed."""
        self._wait_end(self.acts, self.src)

    def _wait_end(self, channel: _Channel, peer: Stage) -> None:
        with self._watching():
            channel.header(self.m, lambda src, ndim: src, peer.stage_id)
        channel.incoming.pop(self.m)
