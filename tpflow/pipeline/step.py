"""One step of a pipeline on one rank set: its column of the schedule table run action by action, each kind of action
(``tpflow.pipeline.actions.Kind``) one method, over the state the step's actions share (the blocks received, the
outputs awaiting their backward, the gradients received, the weights' gradients put off)."""

from __future__ import annotations

import time

import torch

from tpflow import comm
from tpflow.global_tensor.blocks import Block
from tpflow.global_tensor.local import from_block
from tpflow.pipeline.actions import COMPUTE, Action, Kind
from tpflow.pipeline.backward import WeightGrad, input_grad
from tpflow.pipeline.handoff import Paired
from tpflow.pipeline.stage import PipelineError, Stage

__all__ = ["StepRun"]


def _forward(stage: Stage, x: Block) -> Block:
    """``stage`` on the block ``x``: on local tensors where it can, else on global ones (its own global parameters),
    with the autograd graph reaching ``x``'s block either way."""
    got = stage.compute_block(x)
    return got if got is not None else Block.of(stage.check_output(stage.module(from_block(x, stage.placement))))


class StepRun:
    """Rank set ``r``'s actions of one step of ``pipeline`` (a ``tpf.Pipeline``; its public attributes are read).

    Args:
        pipeline: the pipeline.
        r: the rank set, this rank's.
        micro_inputs: the micro-batches' inputs on the first stage's ranks, else None.
        micro_targets: their targets on the last stage's ranks, else None.
        targets: the whole batch's targets there (its items counted for a mean), else None.
        sends: each send's pending transfers, kept until known to be taken (the step's caller waits on the rest).
        outputs: per stage of this rank set, each micro-batch's output until its backward.

    Example::

        >>> import torch.nn.functional as F
        >>> from torch import nn
        >>> stages = [tpf.stage(nn.Linear(4, 4), stage_id=k, placement=tpf.placement("cpu", ranks=[k]))
        ...           for k in range(2)]
        >>> pipe = tpf.Pipeline(stages, micro_batches=2, loss_fn=F.mse_loss)   # its step runs a StepRun
        >>> loss = pipe.step(torch.randn(4, 4), torch.randn(4, 4))
        >>> [str(action) for action, _, _ in pipe.trace][:3]    # the actions StepRun ran, in order; on rank 0
        ['F0', 'send_act0', 'F1']
    """

    def __init__(self, pipeline, r: int, micro_inputs: tuple[torch.Tensor, ...] | None,
                 micro_targets: tuple[torch.Tensor, ...] | None, targets: torch.Tensor | None,
                 sends: dict[Action, comm.Pending], outputs: dict[int, dict[int, Block]]) -> None:
        self.pipeline, self.r, self.sends, self.outputs = pipeline, r, sends, outputs
        self.micro_inputs, self.micro_targets = micro_inputs, micro_targets
        loss = pipeline.batch_loss
        self.items, self.total_items = loss.items(micro_targets, targets) if micro_targets is not None else ([], 0)
        self.received: dict[tuple[int, int], Block] = {}  # input activations' blocks, kept for their gradients
        self.grads: dict[tuple[int, int], torch.Tensor] = {}
        self.later: dict[tuple[int, int], WeightGrad] = {}  # what each micro-batch's W needs, after its B
        self.loss: torch.Tensor | None = None
        self.action: Action | None = None  # the action running (or that failed)
        self._kinds = {Kind.RECV_ACT: self.recv_act, Kind.F: self.forward, Kind.SEND_ACT: self.send_act,
                       Kind.RECV_GRAD: self.recv_grad, Kind.B: self.backward, Kind.W: self.weights,
                       Kind.SEND_GRAD: self.send_grad}

    def run(self) -> torch.Tensor | None:
        """Every action of the rank set's column in order; returns the batch's loss on the last stage's ranks."""
        pipe, start = self.pipeline, time.perf_counter()
        for index, action in enumerate(pipe.table[self.r]):
            began, self.action = time.perf_counter(), action
            k = action.chunk * len(pipe.rank_sets) + self.r
            try:
                self._kinds[action.kind](k, action.micro_batch, action, index)
            except Exception as e:  # a multi-rank stage's other ranks must not go on without this one
                if pipe.guard is not None and action.kind in COMPUTE and not isinstance(e, PipelineError):
                    pipe.guard.check(pipe.failure_message(self.r, e, action))
                raise
            if pipe.guard is not None and action.kind in COMPUTE:
                pipe.guard.check(None)
            for taken in pipe.released.get(action, ()):  # sends this receive proves taken: free their buffers
                self.sends.pop(taken).wait()
            pipe.trace.append((action, began - start, time.perf_counter() - start))
        return self.loss

    def recv_act(self, k: int, i: int, action: Action, index: int) -> None:
        """The input activation of micro-batch ``i`` from the stage before."""
        self.received[(k, i)] = self.pipeline.links_of(k)[0].recv_act(i)

    def forward(self, k: int, i: int, action: Action, index: int) -> None:
        """Stage ``k`` on micro-batch ``i``; on the last stage, its loss (whose backward starts the stage's)."""
        pipe, stage = self.pipeline, self.pipeline.stages[k]
        if k == 0:  # the batch's rows: data, the same on every rank, laid out as the stage takes them
            self.received[(k, i)] = stage.enter_block(self.micro_inputs[i])
        y = _forward(stage, self.received[(k, i)])
        if k == len(pipe.stages) - 1:
            if pipe.guard is not None:  # every rank computed the output, before its gathering
                pipe.guard.check(None)
            loss = pipe.batch_loss(stage.placement, y, self.micro_targets[i], self.items[i], self.total_items)
            self.loss = loss.detach().float() if self.loss is None else self.loss + loss.detach().float()
            y = Block(loss, (), ())  # a plain value: its backward starts the stage's
        self.outputs[k][i] = y

    def send_act(self, k: int, i: int, action: Action, index: int) -> None:
        """Stage ``k``'s output of micro-batch ``i`` to the stage after."""
        self.sends[action] = comm.Pending()
        self.pipeline.links_of(k)[1].send_act(self.outputs[k][i], i, self.sends[action], self._paired(index))

    def recv_grad(self, k: int, i: int, action: Action, index: int) -> None:
        """The gradient of stage ``k``'s output of micro-batch ``i``, from the stage after."""
        self.grads[(k, i)] = self.pipeline.links_of(k)[1].recv_grad(self.outputs[k][i], i)

    def backward(self, k: int, i: int, action: Action, index: int) -> None:
        """Stage ``k``'s backward of micro-batch ``i`` (the input's gradient alone where a W computes the weights')."""
        pipe, key = self.pipeline, (k, i)
        y = self.outputs[k].pop(i).local
        if y.requires_grad:  # a frozen stage (or one before it) has nothing to differentiate
            if pipe.split_backward:  # the input's gradient now, the weights' at this micro-batch's W
                x = self.received[key].local if k > 0 else None
                self.later[key] = input_grad(y, self.grads.pop(key, None), x, pipe.stages[k].weights())
            else:
                torch.autograd.backward(y, self.grads.pop(key, None))
        if k == 0:
            self.received.pop(key, None)

    def weights(self, k: int, i: int, action: Action, index: int) -> None:
        """The weights' gradient of stage ``k`` for micro-batch ``i``, put off from its backward."""
        if (k, i) in self.later:
            self.later.pop((k, i)).run()

    def send_grad(self, k: int, i: int, action: Action, index: int) -> None:
        """The gradient of stage ``k``'s input of micro-batch ``i``, to the stage before."""
        self.sends[action] = comm.Pending()
        x = self.received.pop((k, i)).local
        grad = x.grad if x.grad is not None else torch.zeros_like(x)
        self.pipeline.links_of(k)[0].send_grad(grad, i, self.sends[action], self._paired(index))

    def _paired(self, index: int) -> Paired | None:
        """With ``pipeline_pairs``: the receive to post in one group with send ``index`` of the column."""
        pipe = self.pipeline
        if index not in pipe.recv_pairs:
            return None
        recv = pipe.table[self.r][pipe.recv_pairs[index]]
        k, i = recv.chunk * len(pipe.rank_sets) + self.r, recv.micro_batch
        prev, nxt = pipe.links_of(k)
        return prev.paired_act(i) if recv.kind is Kind.RECV_ACT else nxt.paired_grad(self.outputs[k][i], i)
