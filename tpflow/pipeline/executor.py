"""``tpf.Pipeline``: stages on their own ranks, run over micro-batches by one executor of a schedule table.

Every rank builds the same ``Pipeline`` (one SPMD script) and runs only its own stage's column of the
table (``schedule.build``): forwards and backwards of micro-batches, and the hand-offs between stages.
A hand-off is the cross-placement boxing of ``to_global`` split in two: the sending stage posts its
blocks and goes on (asynchronous sends), the receiving stage waits for them when its table says so.
Every hand-off is preceded by a small header from each sending rank to each receiving rank, carrying
the tensor's shape, dtype and SBP, so a stage needs to know nothing of its neighbours' outputs in
advance. A stage that fails sends an error header instead, on every link it still owes messages to:
its neighbours raise the same error and pass it on, so a mistake in one stage stops the whole
pipeline at once instead of leaving the other ranks waiting.

Gradients end up as one full-batch step leaves them: each micro-batch's loss is weighted by its share
of the batch (``loss_reduction="mean"``) or not at all (``"sum"``), and parameters accumulate.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tpflow import comm
from tpflow.comm.wire import FAILED, HEADER_BYTES, OK, header, read_header
from tpflow.global_tensor import from_local, get_sbp, tensor, to_global
from tpflow.global_tensor.boxing import post_across
from tpflow.pipeline import schedule as schedules
from tpflow.pipeline.stage import PipelineError, Stage
from tpflow.placement import Placement
from tpflow.sbp import Sbp, broadcast, dual

__all__ = ["Pipeline"]

# A failed step's sends, for the process's lifetime: a peer may take them after the pipeline is gone, and gloo
# drops a send whose work and buffer are freed before it is taken.
_UNFINISHED = comm.Pending()


class _Link:
    """The hand-offs between stage ``s`` (``src``) and stage ``s + 1`` (``dst``): activations forward, their
    gradients back. Micro-batch ``i`` travels with tags ``2 i`` (header) and ``2 i + 1`` (blocks)."""

    def __init__(self, src: Stage, dst: Stage) -> None:
        self.src, self.dst = src, dst
        self.reset()

    def reset(self) -> None:
        self.sent = {"act": 0, "grad": 0}  # hand-offs this rank has posted, per direction
        self.grads_received = 0  # on src: gradients taken from dst
        self.peer_failed = False  # an error header came over this link
        self.out_sbps: dict[int, tuple[Sbp, ...]] = {}  # on dst: each received activation's SBP on src

    def _post_headers(self, to: Placement, buf: torch.Tensor, micro_batch: int, pending: comm.Pending) -> None:
        comm.post([(r, buf) for r in to.flat_ranks], [], tag=2 * micro_batch, pending=pending)

    def _wait_headers(self, frm: Placement, micro_batch: int, stage: int) -> tuple[tuple[int, ...], torch.dtype,
                                                                                    tuple[Sbp, ...], bool]:
        bufs = [(r, torch.empty(HEADER_BYTES, dtype=torch.uint8)) for r in frm.flat_ranks]
        comm.post([], bufs, tag=2 * micro_batch).wait()
        headers = [read_header(b) for _, b in bufs]
        for status, *_, message, _ in headers:
            if status == FAILED:
                self.peer_failed = True
                raise PipelineError(message)
        metas = {(*h[1:4], h[5]) for h in headers}  # shape, dtype, SBP, requires_grad
        if len(metas) > 1:
            raise PipelineError(f"the ranks of stage {stage} hand off different tensors for micro-batch "
                                f"{micro_batch}: {sorted(map(str, metas))}")
        return metas.pop()

    def send_act(self, y: DTensor, micro_batch: int, pending: comm.Pending) -> None:
        src_pl, src_sbps = self.src.placement, get_sbp(y)
        dst_sbps = self.dst.input_sbp(src_pl, src_sbps, y.ndim)
        self._post_headers(self.dst.placement, header(OK, y.shape, y.dtype, src_sbps, requires_grad=y.requires_grad),
                           micro_batch, pending)
        post_across(y.detach(), src_pl, src_sbps, self.dst.placement, dst_sbps, tuple(y.shape), y.dtype,
                    2 * micro_batch + 1, pending)
        self.sent["act"] += 1

    def recv_act(self, micro_batch: int) -> DTensor:
        src_pl, dst_pl = self.src.placement, self.dst.placement
        shape, dtype, src_sbps, requires_grad = self._wait_headers(src_pl, micro_batch, self.src.stage_id)
        dst_sbps = self.dst.input_sbp(src_pl, src_sbps, len(shape))
        self.out_sbps[micro_batch] = src_sbps
        pending, local = post_across(None, src_pl, src_sbps, dst_pl, dst_sbps, shape, dtype, 2 * micro_batch + 1)
        pending.wait()
        x = from_local(local, dst_pl, dst_sbps, shape=shape, sync_data=False)
        return x.requires_grad_(requires_grad)  # a frozen stage before this one wants no gradient back

    def send_grad(self, x: DTensor, micro_batch: int, pending: comm.Pending) -> None:
        """The gradient of the input ``x`` this stage received, laid out as the sender's output needs it."""
        pl, sbps = self.dst.placement, dual(get_sbp(x))
        grad = x.grad if x.grad is not None else torch.zeros_like(x)
        grad = to_global(grad, sbp=sbps)  # partial sums (several ranks' contributions) are reduced here
        self._post_headers(self.src.placement, header(OK, grad.shape, grad.dtype, sbps), micro_batch, pending)
        want = dual(self.out_sbps.pop(micro_batch))
        post_across(grad, pl, sbps, self.src.placement, want, tuple(grad.shape), grad.dtype, 2 * micro_batch + 1,
                    pending)
        self.sent["grad"] += 1

    def recv_grad(self, y: DTensor, micro_batch: int) -> DTensor:
        """The gradient of this stage's output ``y``, from the stage after."""
        shape, dtype, dst_sbps, _ = self._wait_headers(self.dst.placement, micro_batch, self.dst.stage_id)
        if shape != tuple(y.shape):
            raise PipelineError(f"stage {self.dst.stage_id} sent a gradient of shape {shape} for an output of "
                                f"shape {tuple(y.shape)} (micro-batch {micro_batch})")
        want = dual(get_sbp(y))
        pending, local = post_across(None, self.dst.placement, dst_sbps, self.src.placement, want, shape, dtype,
                                     2 * micro_batch + 1)
        pending.wait()
        self.grads_received += 1
        return from_local(local, self.src.placement, want, shape=shape, sync_data=False)

    def fail(self, message: str, towards: str, outputs: dict, micro_batches: int, pending: comm.Pending) -> None:
        """Post an error header where the peer stage waits next, if this rank still owes it messages. A peer
        stage after this one that already has every activation runs on and sends its gradients, whose sends
        it waits on: those are taken here (and dropped), or it would wait for ever; the end message then tells
        it the step failed."""
        if self.peer_failed:
            return
        kind, to = ("act", self.dst.placement) if towards == "dst" else ("grad", self.src.placement)
        if self.sent[kind] < micro_batches:
            self._post_headers(to, header(FAILED, message=message), self.sent[kind], pending)
        elif towards == "dst":
            for i in range(self.grads_received, micro_batches):
                try:
                    self.recv_grad(outputs[i], i)
                except PipelineError:
                    return
            self.end(message, micro_batches, pending)

    def end(self, message: str | None, micro_batches: int, pending: comm.Pending) -> None:
        """On src, at the end of its step: whether it failed, to dst (tag ``2 m``, after the micro-batches'), so a
        stage that already had all it needed from src does not end its step as if nothing broke."""
        status = header(OK) if message is None else header(FAILED, message=message)
        self._post_headers(self.dst.placement, status, micro_batches, pending)

    def wait_end(self, micro_batches: int) -> None:
        """On dst: src's end of step; raises its error if it failed."""
        self._wait_headers(self.src.placement, micro_batches, self.src.stage_id)


def _released(table: schedules.Table, s: int) -> dict[schedules.Action, list[schedules.Action]]:
    """For stage ``s``, the receives after which some of its sends are known to be taken: the peer posted that
    message after waiting for the send's. Waiting on those sends then is free, and their buffers (often the
    very activation) are freed when the schedule says, not at the end of the step."""
    out: dict[schedules.Action, list[schedules.Action]] = {}
    for peer, mine, theirs, later in ((s + 1, "send_act", "recv_act", "send_grad"),
                                      (s - 1, "send_grad", "recv_grad", "send_act")):
        if not 0 <= peer < len(table):
            continue
        actions = table[peer]
        for a in table[s]:
            if a.kind == mine:
                after = actions[actions.index(schedules.Action(theirs, a.micro_batch)):]
                proof = next((b for b in after if b.kind == later), None)
                if proof is not None:
                    kind = "recv_grad" if later == "send_grad" else "recv_act"
                    out.setdefault(schedules.Action(kind, proof.micro_batch), []).append(a)
    return out


def _collect(stages: object) -> list[Stage]:
    """The stages, ordered by ``stage_id``, from a sequence of them or a module that holds them."""
    if isinstance(stages, Stage):
        found = [stages]
    elif isinstance(stages, nn.Module):
        found = [m for m in stages.modules() if isinstance(m, Stage)]
    elif isinstance(stages, Sequence) and all(isinstance(st, Stage) for st in stages):
        found = list(stages)
    else:
        raise TypeError("Pipeline takes a list of tpf.stage(...) modules, or a module that holds them")
    ids = sorted(st.stage_id for st in found)
    if ids != list(range(len(found))) or not found:
        raise ValueError(f"a pipeline's stage ids must be 0, 1, ..., each once; got {ids}")
    found.sort(key=lambda st: st.stage_id)
    if len({st.placement.type for st in found}) > 1:
        raise ValueError(f"a pipeline's stages must share a device type, got {[str(st.placement) for st in found]}")
    owner: dict[int, int] = {}
    for st in found:
        for r in st.placement.flat_ranks:
            if r in owner:
                raise ValueError(f"rank {r} is in stage {owner[r]} and stage {st.stage_id}: a rank runs one stage of "
                                 "a pipeline, so give each stage its own ranks (or call the stages in order without "
                                 "a Pipeline, which lets stages share ranks)")
            owner[r] = st.stage_id
    return found


def _reduction(loss_fn: Callable, given: str | None) -> str:
    """How ``loss_fn`` reduces its rows: ``given``, or a torch loss module's own ``reduction``, or "mean"."""
    own = getattr(loss_fn, "reduction", None) if isinstance(loss_fn, nn.Module) else None
    if own is not None and own not in ("mean", "sum"):
        raise ValueError(f"loss_fn {type(loss_fn).__name__}(reduction={own!r}) must return a scalar: give it "
                         f"reduction='mean' or 'sum'")
    if given is not None and given not in ("mean", "sum"):
        raise ValueError(f"loss_reduction must be 'mean' (loss_fn averages over its rows) or 'sum', got {given!r}")
    if given is not None and own is not None and given != own:
        raise ValueError(f"loss_reduction={given!r}, but loss_fn {type(loss_fn).__name__} has reduction={own!r}: "
                         f"leave loss_reduction out, and the loss module's own is used")
    return given or own or "mean"


class Pipeline(nn.Module):
    """Stages run over ``micro_batches`` by ``schedule`` ("gpipe" or "1f1b"), one rank set per stage.

    ``step(inputs, targets)`` runs forward and backward of one batch and returns its loss (on the last
    stage's ranks; None elsewhere), leaving every parameter's gradient as one device would on the whole
    batch. ``pipe(x)`` runs the stages in order eagerly, on every rank. ``trace`` holds the last step's
    actions on this rank with their start and end times (seconds from the step's start).

    Every rank builds the same ``Pipeline`` (one SPMD script) and calls ``step`` with the whole batch, as one
    device would: the batch's rows (dim 0) are cut into ``micro_batches`` by ``torch.tensor_split``. Each
    rank runs only its own stage's actions of the schedule table (``schedule_table()`` draws it); stages
    hand activations and gradients to their neighbours by cross-placement boxing. An error in any stage
    reaches every rank as a ``tpf.PipelineError``, after which the pipeline runs no more steps. Fewer
    micro-batches than stages, gaps in the stage ids, a rank in two stages or stages of different device
    types are refused here.

    Args:
        stages: the ``tpf.stage`` modules, in any order (they are sorted by ``stage_id``), or a module that
            holds them; their ids must be 0, 1, ..., each once, and each rank in at most one stage.
        micro_batches: the number of micro-batches a step cuts the batch into: at least the number of stages,
            and at most the batch's rows. More of them shrink the bubble, ``(p - 1) / (m + p - 1)`` of a step.
        loss_fn: called on the last stage's ranks as ``loss_fn(output, target)`` for each micro-batch, with the
            stage's output and the micro-batch's targets, both whole on every rank of that stage (global
            tensors, broadcast); returns a scalar, such as ``F.cross_entropy``.
        schedule: ``"1f1b"`` (the default: PipeDream-flush, at most p - s micro-batches of activations held
            on stage s) or ``"gpipe"`` (all forwards, then all backwards: m micro-batches held).
        loss_reduction: ``"mean"`` when ``loss_fn`` averages over its rows: each micro-batch's loss is weighted
            by its share of the batch's rows; ``"sum"`` when it sums them: no weights. Either way the gradients
            and the returned loss are those of the whole batch. Default: a torch loss module's own
            ``reduction`` (``nn.MSELoss(reduction="sum")`` is ``"sum"``), else ``"mean"``; given beside a loss
            module, it must agree with it.

    Example::

        >>> import torch
        >>> import torch.nn.functional as F
        >>> from torch import nn
        >>> import tpflow as tpf
        >>> stages = [tpf.stage(nn.Sequential(nn.Linear(8, 32), nn.ReLU()), stage_id=0,
        ...                     placement=tpf.placement("cpu", ranks=[0])),
        ...           tpf.stage(nn.Linear(32, 4), stage_id=1, placement=tpf.placement("cpu", ranks=[1]))]
        >>> pipe = tpf.Pipeline(stages, micro_batches=4, loss_fn=F.cross_entropy)
        >>> print(pipe.schedule_table())  # doctest: +SKIP
        >>> opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        >>> x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
        >>> loss = pipe.step(x, y)   # the batch's mean loss on rank 1, None on rank 0
        >>> opt.step()               # each rank updates its own stage's parameters
    """

    def __init__(self, stages: Sequence[Stage] | nn.Module, *, micro_batches: int, loss_fn: Callable,
                 schedule: str = "1f1b", loss_reduction: str | None = None) -> None:
        super().__init__()
        found = _collect(stages)
        p = len(found)
        if not isinstance(micro_batches, int) or micro_batches < p:
            raise ValueError(f"micro_batches={micro_batches!r} for {p} stages: use at least as many micro-batches as "
                             "stages, or each stage idles through most of the step")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(output, target), got {loss_fn!r}")
        loss_reduction = _reduction(loss_fn, loss_reduction)
        self.stages = nn.ModuleList(found)
        self.micro_batches, self.schedule, self.loss_fn, self.loss_reduction = \
            micro_batches, schedule, loss_fn, loss_reduction
        self.table = schedules.build(schedule, p, micro_batches)
        for st in found:  # process groups are made by every rank, in one order: here, not lazily inside a stage
            st.placement.mesh
        rank = dist.get_rank()
        self.stage_index = next((i for i, st in enumerate(found) if rank in st.placement), None)
        self.links = [_Link(a, b) for a, b in zip(found, found[1:])]
        self.trace: list[tuple[schedules.Action, float, float]] = []
        self._failed: str | None = None
        self._released = {} if self.stage_index is None else _released(self.table, self.stage_index)

    def schedule_table(self) -> str:
        """The step as a grid of stages by time steps (unit time per forward and per backward)."""
        p, m = len(self.stages), self.micro_batches
        return (f"{self.schedule}: {p} stages, {m} micro-batches, bubble (p - 1) / (m + p - 1) = "
                f"{(p - 1) / (m + p - 1):.1%}\n" + schedules.render(self.table))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for st in self.stages:
            x = st(x)
        return x

    def _micro(self, batch: object, what: str) -> tuple[torch.Tensor, ...]:
        if not isinstance(batch, torch.Tensor) or isinstance(batch, DTensor) or batch.ndim == 0:
            raise TypeError(f"Pipeline.step takes the whole batch of {what} as a plain tensor with rows in dim 0 "
                            f"(as one device would), got {type(batch).__name__}")
        if batch.shape[0] < self.micro_batches:
            raise ValueError(f"a batch of {batch.shape[0]} rows cannot make {self.micro_batches} micro-batches")
        return torch.tensor_split(batch, self.micro_batches)

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor | None:
        """One batch forward and backward; the first stage reads ``inputs``, the last ``targets`` (plain whole
        batches), so other ranks may pass None."""
        s = self.stage_index
        if s is None:
            return None
        if self._failed is not None:
            raise PipelineError(f"an earlier step failed ({self._failed}); its messages may still be in flight, so "
                                "this pipeline runs no more steps: restart the job")
        p, links = len(self.stages), self.links
        prev, nxt = links[s - 1] if s > 0 else None, links[s] if s < p - 1 else None
        for link in (prev, nxt):
            if link is not None:
                link.reset()
        sends: dict[schedules.Action, comm.Pending] = {}  # each send's transfers, until known to be taken
        outputs: dict[int, torch.Tensor] = {}  # outputs (on the last stage, weighted losses) until their backward
        self.trace, self._action = [], None
        try:
            loss = self._run(s, prev, nxt, inputs, targets, sends, outputs)
            self._action = "the end of the step"
            if prev is not None:
                prev.wait_end(self.micro_batches)
            for pending in sends.values():
                pending.wait()
            if nxt is not None:  # taken at once: the next stage has finished its work and waits for this
                ended = comm.Pending()
                nxt.end(None, self.micro_batches, ended)
                ended.wait()
            return loss
        except Exception as e:
            where = "" if self._action is None else f" on {self._action}"
            message = str(e) if isinstance(e, PipelineError) else (
                f"stage {s} (ranks {self.stages[s].placement.ranks}) failed{where}: {type(e).__name__}: {e}")
            self._failed = message
            for pending in sends.values():  # a peer that failed may never take them: kept alive, never waited on
                _UNFINISHED.works += pending.works
                _UNFINISHED.buffers += pending.buffers
            if prev is not None:
                prev.fail(message, "src", outputs, self.micro_batches, _UNFINISHED)
            if nxt is not None:
                nxt.fail(message, "dst", outputs, self.micro_batches, _UNFINISHED)
            if isinstance(e, PipelineError):
                raise
            raise PipelineError(message) from e

    def _run(self, s: int, prev: _Link | None, nxt: _Link | None, inputs: object, targets: object,
             sends: dict[schedules.Action, comm.Pending], outputs: dict[int, torch.Tensor]) -> torch.Tensor | None:
        stage, last = self.stages[s], s == len(self.stages) - 1
        micro_inputs = self._micro(inputs, "inputs") if s == 0 else None
        micro_targets = self._micro(targets, "targets") if last else None
        rows = sum(t.shape[0] for t in micro_targets) if last else 0
        received: dict[int, DTensor] = {}  # input activations, kept for their gradients
        grads: dict[int, DTensor] = {}
        total = None
        start = time.perf_counter()
        for action in self.table[s]:
            i, began, self._action = action.micro_batch, time.perf_counter(), action
            if action.kind == "recv_act":
                received[i] = prev.recv_act(i)
            elif action.kind == "F":
                y = stage.compute(received[i] if s > 0 else micro_inputs[i])
                if last:  # the loss sees the whole micro-batch on every rank: DTensor's mean over uneven
                    # split(0) blocks averages the blocks' means (biased), and its nll_loss refuses them
                    whole = (broadcast,) * stage.placement.ndim
                    y = to_global(y, sbp=whole)
                    target = tensor(micro_targets[i].to(stage.placement.device), placement=stage.placement, sbp=whole)
                    weight = target.shape[0] / rows if self.loss_reduction == "mean" else 1.0
                    y = self.loss_fn(y, target) * weight
                    value = (y.detach().full_tensor() if isinstance(y, DTensor) else y.detach()).float()
                    total = value if total is None else total + value
                outputs[i] = y
            elif action.kind == "send_act":
                sends[action] = comm.Pending()
                nxt.send_act(outputs[i], i, sends[action])
            elif action.kind == "recv_grad":
                grads[i] = nxt.recv_grad(outputs[i], i)
            elif action.kind == "B":
                y = outputs.pop(i)
                if y.requires_grad:  # a frozen stage (or one before it) has nothing to differentiate
                    torch.autograd.backward(y, grads.pop(i, None))
            elif action.kind == "send_grad":
                sends[action] = comm.Pending()
                prev.send_grad(received.pop(i), i, sends[action])
            for taken in self._released.get(action, ()):  # sends this receive proves taken: free their buffers
                sends.pop(taken).wait()
            self.trace.append((action, began - start, time.perf_counter() - start))
        return total
