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
from tpflow.pipeline.backward import WeightGrad, input_grad
from tpflow.pipeline.stage import PipelineError, Stage
from tpflow.placement import Placement
from tpflow.sbp import Sbp, broadcast, dual

__all__ = ["Pipeline"]

# A failed step's sends, for the process's lifetime: a peer may take them after the pipeline is gone, and gloo
# drops a send whose work and buffer are freed before it is taken.
_UNFINISHED = comm.Pending()


class _Link:
    """The hand-offs between stage ``s`` (``src``) and stage ``s + 1`` (``dst``): activations forward, their
    gradients back. Micro-batch ``i`` travels with tags ``base + 2 i`` (header) and ``base + 2 i + 1`` (blocks),
    the end of the step with ``base + 2 m``; each link has its own ``base``, so the links between the same two
    rank sets (the chunks of an interleaved pipeline) keep apart."""

    def __init__(self, src: Stage, dst: Stage, base: int) -> None:
        self.src, self.dst, self.base = src, dst, base
        self.reset()

    def reset(self) -> None:
        self.sent = {"act": 0, "grad": 0}  # hand-offs this rank has posted, per direction
        self.grads_received = 0  # on src: gradients taken from dst
        self.peer_failed = False  # an error header came over this link
        self.out_sbps: dict[int, tuple[Sbp, ...]] = {}  # on dst: each received activation's SBP on src
        self.ended = False  # on src: the end of the step was posted

    def _data(self, micro_batch: int) -> int:
        """The tag of micro-batch ``micro_batch``'s blocks (its header's is one less)."""
        return self.base + 2 * micro_batch + 1

    def _post_headers(self, to: Placement, buf: torch.Tensor, micro_batch: int, pending: comm.Pending) -> None:
        comm.post([(r, buf) for r in to.flat_ranks], [], tag=self.base + 2 * micro_batch, pending=pending)

    def _wait_headers(self, frm: Placement, micro_batch: int, stage: int) -> tuple[tuple[int, ...], torch.dtype,
                                                                                    tuple[Sbp, ...], bool]:
        bufs = [(r, torch.empty(HEADER_BYTES, dtype=torch.uint8)) for r in frm.flat_ranks]
        comm.post([], bufs, tag=self.base + 2 * micro_batch).wait()
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
                    self._data(micro_batch), pending)
        self.sent["act"] += 1

    def recv_act(self, micro_batch: int) -> DTensor:
        src_pl, dst_pl = self.src.placement, self.dst.placement
        shape, dtype, src_sbps, requires_grad = self._wait_headers(src_pl, micro_batch, self.src.stage_id)
        dst_sbps = self.dst.input_sbp(src_pl, src_sbps, len(shape))
        self.out_sbps[micro_batch] = src_sbps
        pending, local = post_across(None, src_pl, src_sbps, dst_pl, dst_sbps, shape, dtype, self._data(micro_batch))
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
        post_across(grad, pl, sbps, self.src.placement, want, tuple(grad.shape), grad.dtype, self._data(micro_batch),
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
                                     self._data(micro_batch))
        pending.wait()
        self.grads_received += 1
        return from_local(local, self.src.placement, want, shape=shape, sync_data=False)

    def fail(self, message: str, towards: str, micro_batches: int, pending: comm.Pending) -> bool:
        """Post an error header where the peer stage waits next, if this rank still owes it messages. Returns
        whether this rank must then ``drain`` the link: a peer stage after this one that already has every
        activation runs on and sends its gradients, whose sends it waits on."""
        if self.peer_failed or self.ended:
            return False
        kind, to = ("act", self.dst.placement) if towards == "dst" else ("grad", self.src.placement)
        if self.sent[kind] < micro_batches:
            self._post_headers(to, header(FAILED, message=message), self.sent[kind], pending)
            return False
        return towards == "dst"

    def drain(self, message: str, outputs: dict, micro_batches: int, pending: comm.Pending) -> None:
        """Take (and drop) the gradients the stage after this one still sends, then tell it the step failed, so that
        it does not end its step as if nothing broke."""
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
        self.ended = True

    def wait_end(self, micro_batches: int) -> None:
        """On dst: src's end of step; raises its error if it failed."""
        self._wait_headers(self.src.placement, micro_batches, self.src.stage_id)


_SENDS = ("send_act", "send_grad")


def _route(ranks: int, rank: int, a: schedules.Action) -> tuple[int, schedules.Action]:
    """For a transfer in rank set ``rank``'s table: the peer rank set, and the matching action in its table
    (chunk c of rank set r is stage ``c * ranks + r``)."""
    k = a.chunk * ranks + rank
    j, kind = {"send_act": (k + 1, "recv_act"), "recv_act": (k - 1, "send_act"),
               "send_grad": (k - 1, "recv_grad"), "recv_grad": (k + 1, "send_grad")}[a.kind]
    return j % ranks, schedules.Action(kind, a.micro_batch, j // ranks)


def _released(table: schedules.Table, r: int) -> dict[schedules.Action, list[schedules.Action]]:
    """For rank set ``r``, the receives after which some of its sends are known to be taken: the peer posted that
    message after waiting for the send's. Waiting on those sends then is free, and their buffers (often the
    very activation) are freed when the schedule says, not at the end of the step."""
    out: dict[schedules.Action, list[schedules.Action]] = {}
    for a in table[r]:
        if a.kind not in _SENDS:
            continue
        peer, theirs = _route(len(table), r, a)
        actions = table[peer]
        for b in actions[actions.index(theirs) + 1:]:
            if b.kind in _SENDS:
                to, proof = _route(len(table), peer, b)
                if to == r:
                    out.setdefault(proof, []).append(a)
                    break
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
    return found


def _rank_sets(found: list[Stage]) -> list[Placement]:
    """The pipeline's rank sets (placements) in stage order: stage k runs on set ``k mod p``; stages on one set are
    its chunks (an interleaved pipeline). Sets that overlap without being equal are refused."""
    sets: list[Placement] = []
    for st in found:
        if st.placement in sets:
            continue
        for other in sets:
            shared = sorted(set(st.placement.flat_ranks) & set(other.flat_ranks))
            if shared:
                first = next(o.stage_id for o in found if o.placement == other)
                raise ValueError(f"rank {shared[0]} is in stage {first} and stage {st.stage_id}: a rank runs one "
                                 "rank set of a pipeline, so give each stage its own ranks, or the very same placement "
                                 "as the stage p before it (an interleaved pipeline), or call the stages in order "
                                 "without a Pipeline, which lets stages share ranks")
        sets.append(st.placement)
    p = len(sets)
    for st in found:
        if st.placement != sets[st.stage_id % p]:
            raise ValueError(f"stage {st.stage_id} is on {st.placement}, but the pipeline's {p} rank sets take the "
                             f"stages in turn: stage {st.stage_id} belongs on {sets[st.stage_id % p]} (stage k on the "
                             f"placement of stage k mod {p})")
    if len(found) % p:
        raise ValueError(f"{len(found)} stages over {p} rank sets: each rank set must hold the same number of stages")
    return sets


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
    """Stages run over ``micro_batches`` by ``schedule``, one rank set per stage (or per ``v`` stages, interleaved).

    ``step(inputs, targets)`` runs forward and backward of one batch and returns its loss (on the last
    stage's ranks; None elsewhere), leaving every parameter's gradient as one device would on the whole
    batch. ``pipe(x)`` runs the stages in order eagerly, on every rank. ``trace`` holds the last step's
    actions on this rank with their start and end times (seconds from the step's start).

    Every rank builds the same ``Pipeline`` (one SPMD script) and calls ``step`` with the whole batch, as one
    device would: the batch's rows (dim 0) are cut into ``micro_batches`` by ``torch.tensor_split``. Each
    rank runs only its own column of the schedule table (``schedule_table()`` draws it); stages hand
    activations and gradients to their neighbours by cross-placement boxing. An error in any stage reaches
    every rank as a ``tpf.PipelineError``, after which the pipeline runs no more steps. Fewer micro-batches
    than rank sets, gaps in the stage ids, overlapping placements or stages of different device types are
    refused here.

    Args:
        stages: the ``tpf.stage`` modules, in any order (they are sorted by ``stage_id``), or a module that
            holds them; their ids must be 0, 1, ..., each once. Stages on different placements must not share
            ranks; for ``"interleaved"``, stage k has the very placement of stage k - p (p rank sets, each
            holding v = stages / p of them: rank set r runs stages r, r + p, ...).
        micro_batches: the number of micro-batches a step cuts the batch into: at least the number of rank sets
            (a multiple of it for ``"interleaved"``), and at most the batch's rows. More of them shrink the
            bubble (``tpflow.pipeline.schedule.bubble`` gives each schedule's share).
        loss_fn: called on the last stage's ranks as ``loss_fn(output, target)`` for each micro-batch, with the
            stage's output and the micro-batch's targets, both whole on every rank of that stage (global
            tensors, broadcast); returns a scalar, such as ``F.cross_entropy``.
        schedule: ``"1f1b"`` (the default: PipeDream-flush, at most p - s micro-batches of activations held
            on stage s), ``"gpipe"`` (all forwards, then all backwards: m micro-batches held),
            ``"interleaved"`` (Megatron's interleaved 1F1B over v stages per rank set: the bubble v times
            smaller, for more activations held) or ``"zb-h1"`` (zero bubble: each backward split into the
            input's gradient and the weights', the latter run in what would be idle time; at most p
            micro-batches held on every stage).
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
        sets = _rank_sets(found)
        p, v = len(sets), len(found) // len(sets)
        if schedule not in schedules.SCHEDULES:
            raise ValueError(f"schedule must be one of {list(schedules.SCHEDULES)}, got {schedule!r}")
        if v > 1 and schedule != "interleaved":
            raise ValueError(f"{len(found)} stages on {p} rank sets: a rank set holds several stages only under "
                             f"schedule='interleaved' (given {schedule!r}); otherwise give each stage its own ranks")
        if schedule == "interleaved" and (v < 2 or p < 2):
            raise ValueError(f"schedule='interleaved' needs at least 2 rank sets holding at least 2 stages each (stage "
                             f"k on the placement of stage k - p), got {len(found)} stages on {p} rank sets")
        if not isinstance(micro_batches, int) or micro_batches < p:
            raise ValueError(f"micro_batches={micro_batches!r} for {p} stages: use at least as many micro-batches as "
                             "stages, or each stage idles through most of the step")
        if schedule == "interleaved" and micro_batches % p:
            raise ValueError(f"schedule='interleaved' takes the micro-batches in groups of the {p} rank sets: use a "
                             f"multiple of {p}, got micro_batches={micro_batches}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable as loss_fn(output, target), got {loss_fn!r}")
        loss_reduction = _reduction(loss_fn, loss_reduction)
        self.stages = nn.ModuleList(found)
        self.micro_batches, self.schedule, self.loss_fn, self.loss_reduction = \
            micro_batches, schedule, loss_fn, loss_reduction
        self.rank_sets, self.chunks = sets, v
        self.table = schedules.build(schedule, p, micro_batches, chunks=v)
        self.split_backward = any(a.kind == "W" for actions in self.table for a in actions)
        for st in found:  # process groups are made by every rank, in one order: here, not lazily inside a stage
            st.placement.mesh
            st.weights_apart = self.split_backward
        rank = dist.get_rank()
        # this rank's rank set: its first stage's id, None off the pipeline
        self.stage_index = next((r for r, pl in enumerate(sets) if rank in pl), None)
        self.links = [_Link(a, b, base=k * (2 * micro_batches + 2)) for k, (a, b) in enumerate(zip(found, found[1:]))]
        self.trace: list[tuple[schedules.Action, float, float]] = []
        self._failed: str | None = None
        self._released = {} if self.stage_index is None else _released(self.table, self.stage_index)

    def schedule_table(self) -> str:
        """The step as a grid of rank sets by time steps (unit time per forward, per backward and per weight
        gradient), under a line with the schedule's bubble by its formula."""
        p, m, v = len(self.rank_sets), self.micro_batches, self.chunks
        formula, share = schedules.bubble(self.schedule, p, m, v)
        where = f"{p} rank sets of {v} stages" if v > 1 else f"{p} stages"
        return f"{self.schedule}: {where}, {m} micro-batches, bubble {formula} = {share:.1%}\n" + \
            schedules.render(self.table)

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

    def _links(self, k: int) -> tuple[_Link | None, _Link | None]:
        """Stage ``k``'s links to the stage before and the stage after."""
        return self.links[k - 1] if k > 0 else None, self.links[k] if k < len(self.stages) - 1 else None

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor | None:
        """One batch forward and backward; the first stage reads ``inputs``, the last ``targets`` (plain whole
        batches), so other ranks may pass None."""
        r = self.stage_index
        if r is None:
            return None
        if self._failed is not None:
            raise PipelineError(f"an earlier step failed ({self._failed}); its messages may still be in flight, so "
                                "this pipeline runs no more steps: restart the job")
        p, m = len(self.rank_sets), self.micro_batches
        mine = range(r, len(self.stages), p)  # this rank set's stages, chunk by chunk
        for k in mine:
            for link in self._links(k):
                if link is not None:
                    link.reset()
        sends: dict[schedules.Action, comm.Pending] = {}  # each send's transfers, until known to be taken
        outputs: dict[int, dict[int, torch.Tensor]] = {k: {} for k in mine}  # per stage, outputs until their backward
        self.trace, self._action = [], None
        try:
            loss = self._run(r, inputs, targets, sends, outputs)
            self._action = "the end of the step"
            ended = comm.Pending()
            for k in mine:  # in stage order: each stage's end follows the one before it
                prev, nxt = self._links(k)
                if prev is not None:
                    prev.wait_end(m)
                if nxt is not None:
                    nxt.end(None, m, ended)
            for pending in sends.values():
                pending.wait()
            ended.wait()  # taken at once: the next stages have finished their work and wait for these
            return loss
        except Exception as e:
            where = "" if self._action is None else f" on {self._action}"
            message = str(e) if isinstance(e, PipelineError) else (
                f"stage {self._stage_of(r)} (ranks {self.rank_sets[r].ranks}) failed{where}: {type(e).__name__}: {e}")
            self._failed = message
            for pending in sends.values():  # a peer that failed may never take them: kept alive, never waited on
                _UNFINISHED.works += pending.works
                _UNFINISHED.buffers += pending.buffers
            drains = []
            for k in mine:  # every error header first, then the links that still send to this rank
                prev, nxt = self._links(k)
                if prev is not None:
                    prev.fail(message, "src", m, _UNFINISHED)
                if nxt is not None and nxt.fail(message, "dst", m, _UNFINISHED):
                    drains.append((nxt, outputs[k]))
            for link, outs in drains:
                link.drain(message, outs, m, _UNFINISHED)
            if isinstance(e, PipelineError):
                raise
            raise PipelineError(message) from e

    def _stage_of(self, r: int) -> int:
        """The stage rank set ``r`` was at when it failed."""
        action = self._action if isinstance(self._action, schedules.Action) else None
        return r + len(self.rank_sets) * (action.chunk if action is not None else 0)

    def _run(self, r: int, inputs: object, targets: object, sends: dict[schedules.Action, comm.Pending],
             outputs: dict[int, dict[int, torch.Tensor]]) -> torch.Tensor | None:
        p, n = len(self.rank_sets), len(self.stages)
        micro_inputs = self._micro(inputs, "inputs") if r == 0 else None
        micro_targets = self._micro(targets, "targets") if r == (n - 1) % p else None
        rows = sum(t.shape[0] for t in micro_targets) if micro_targets is not None else 0
        received: dict[tuple[int, int], DTensor] = {}  # input activations, kept for their gradients
        grads: dict[tuple[int, int], DTensor] = {}
        later: dict[tuple[int, int], WeightGrad] = {}  # what each micro-batch's W needs, after its B
        total = None
        start = time.perf_counter()
        for action in self.table[r]:
            i, began, self._action = action.micro_batch, time.perf_counter(), action
            k = action.chunk * p + r
            stage, (prev, nxt), key = self.stages[k], self._links(k), (k, i)
            if action.kind == "recv_act":
                received[key] = prev.recv_act(i)
            elif action.kind == "F":
                y = stage.compute(received[key] if k > 0 else micro_inputs[i])
                if k == n - 1:  # the loss sees the whole micro-batch on every rank: DTensor's mean over uneven
                    # split(0) blocks averages the blocks' means (biased), and its nll_loss refuses them
                    whole = (broadcast,) * stage.placement.ndim
                    y = to_global(y, sbp=whole)
                    target = tensor(micro_targets[i].to(stage.placement.device), placement=stage.placement, sbp=whole)
                    weight = target.shape[0] / rows if self.loss_reduction == "mean" else 1.0
                    y = self.loss_fn(y, target) * weight
                    value = (y.detach().full_tensor() if isinstance(y, DTensor) else y.detach()).float()
                    total = value if total is None else total + value
                outputs[k][i] = y
            elif action.kind == "send_act":
                sends[action] = comm.Pending()
                nxt.send_act(outputs[k][i], i, sends[action])
            elif action.kind == "recv_grad":
                grads[key] = nxt.recv_grad(outputs[k][i], i)
            elif action.kind == "B":
                y = outputs[k].pop(i)
                if y.requires_grad:  # a frozen stage (or one before it) has nothing to differentiate
                    if self.split_backward:  # the input's gradient now, the weights' at this micro-batch's W
                        later[key] = input_grad(y, grads.pop(key, None), received.get(key), list(stage.parameters()))
                    else:
                        torch.autograd.backward(y, grads.pop(key, None))
            elif action.kind == "W":
                if key in later:
                    later.pop(key).run()
            elif action.kind == "send_grad":
                sends[action] = comm.Pending()
                prev.send_grad(received.pop(key), i, sends[action])
            for taken in self._released.get(action, ()):  # sends this receive proves taken: free their buffers
                sends.pop(taken).wait()
            self.trace.append((action, began - start, time.perf_counter() - start))
        return total
