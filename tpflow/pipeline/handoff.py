"""Hand-offs between neighbouring stages: activations forward, their gradients back, each the cross-placement
boxing of ``to_global`` split in two (the sender posts its blocks and goes on; the receiver waits when its table
says so).

Each direction of a link is a ``tpflow.pipeline.channel.Channel`` (its messages, tags, remembered headers and
receives posted ahead); a ``Link`` pairs the two between neighbouring stages, and ends or fails a step on both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from tpflow import comm
from tpflow.comm.wire import FAILED, OK, header
from tpflow.global_tensor.blocks import Block
from tpflow.pipeline.channel import Channel, Meta, Paired, PeerDied, PeerFailed, send
from tpflow.pipeline.stage import PipelineError, Stage
from tpflow.sbp import Sbp, dual

__all__ = ["Link", "Paired", "PeerDied"]


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
        self.acts = Channel(src.placement, dst.placement, base, ahead)
        self.grads = Channel(dst.placement, src.placement, base, ahead)
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
        except PeerFailed:
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
        send(self.acts, y.local.detach(), meta, i, pending, paired)
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
        send(self.grads, grad, meta, i, pending, paired)
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

    def _wait_end(self, channel: Channel, peer: Stage) -> None:
        with self._watching():
            channel.header(self.m, lambda src, ndim: src, peer.stage_id)
        channel.incoming.pop(self.m)
