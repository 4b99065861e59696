"""``tpf.Pipeline``: stages on their own ranks, run over micro-batches by one executor of a schedule table.

Every rank builds the same ``Pipeline`` (one SPMD script) and runs only its own rank set's column of the
table (``schedule.build``): forwards and backwards of micro-batches, and the hand-offs between stages
(``tpflow.pipeline.handoff``). Every hand-off carries a small header with the tensor's shape, dtype and SBP,
so a stage needs to know nothing of its neighbours' outputs in advance. A stage that fails sends an error
header instead, on every link it still owes messages to: its neighbours raise the same error and pass it
on, so a mistake in one stage stops the whole pipeline at once instead of leaving the other ranks waiting.

Gradients end up as one full-batch step leaves them: each micro-batch's loss is weighted by its share
of the batch's items (``loss_reduction="mean"``: its rows, or its targets other than ``ignore_index``, counted over
the whole batch before any loss is taken) or not at all (``"sum"``), and parameters accumulate. A loss that takes
``num_items_in_batch`` (Hugging Face's convention, ``causal_lm_loss``) is handed the whole batch's count and divides
its own sum by it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tpflow import comm, config
from tpflow.comm.peers import closed_connection
from tpflow.global_tensor.blocks import Block
from tpflow.pipeline import actions, replay
from tpflow.pipeline import schedule as schedules
from tpflow.pipeline.guard import UNFINISHED, Guard
from tpflow.pipeline.handoff import Link, PeerDied
from tpflow.pipeline.loss import BatchLoss
from tpflow.pipeline.stage import EAGER_TAG, PipelineError, Stage
from tpflow.pipeline.step import StepRun
from tpflow.placement import Placement

__all__ = ["Pipeline"]

# Each Pipeline a process builds takes tags no pipeline before it used (every rank builds the same pipelines in
# the same order, which Pipeline checks): a pipeline built over the same stages after a failed step never takes
# the failed step's messages still in flight. [pipelines built, the next free tag]
_BUILT = [0, 0]
_TAG_LIMIT = (1 << 31) - 1  # gloo's tags are int32


def _fresh_tags(span: int) -> int:
    """The first of ``span`` tags no earlier pipeline of this process used (nor a stage's eager header)."""
    start = _BUILT[1]
    if start + span > _TAG_LIMIT:  # after some billions of tags: from the start again
        start = 0
    if start <= EAGER_TAG < start + span:
        start = EAGER_TAG + 1
    _BUILT[0], _BUILT[1] = _BUILT[0] + 1, start + span
    return start


def _released(table: actions.Table, r: int) -> dict[actions.Action, list[actions.Action]]:
    """For rank set ``r``, the receives after which some of its sends are known to be taken: the peer posted that
    message after waiting for the send's. Waiting on those sends then is free, and their buffers (often the
    very activation) are freed when the schedule says, not at the end of the step."""
    out: dict[actions.Action, list[actions.Action]] = {}
    for a in table[r]:
        if a.kind not in actions.SENDS:
            continue
        peer, theirs = actions.route(len(table), r, a)
        row = table[peer]
        for b in row[row.index(theirs) + 1:]:
            if b.kind in actions.SENDS:
                to, proof = actions.route(len(table), peer, b)
                if to == r:
                    out.setdefault(proof, []).append(a)
                    break
    return out


def _cause(e: BaseException, ranks: Placement) -> str:
    """A stage's error as its message says it: a connection a peer closed (gloo's words) named as a dead peer."""
    if isinstance(e, PeerDied) or not closed_connection(e):
        return f"{type(e).__name__}: {e}"
    return (f"a peer rank died or closed its connection (one of this stage's ranks {ranks.ranks}, in a collective): "
            f"{type(e).__name__}: {e}")


def _still(fail: Callable, *args: object) -> object:
    """Part of a failed step's error path, which goes on where it raises (a send to a peer that died): the other
    links' error headers must still go out."""
    try:
        return fail(*args)
    except Exception:  # the step's own error is raised; this one only stops this link's messages
        return False


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


def _agree(found: list[Stage], sets: list[Placement], **arguments: object) -> None:
    """Every rank builds the pipeline alike, or every one of them stops here, before its checks (a rank with other
    micro-batches or another schedule would wait in a hand-off its peers never post). Checked where the pipeline's
    ranks are the world's, which is where its ranks can meet."""
    ranks = sorted({r for pl in sets for r in pl.flat_ranks})
    if len(ranks) < 2 or ranks != list(range(dist.get_world_size())):
        return
    facts = {name: repr(value) for name, value in arguments.items()}
    facts["the stages"] = "; ".join(f"stage {st.stage_id} on {st.placement!r}" for st in found)
    comm.agree("Pipeline", facts, [dist.group.WORLD],
               "build the Pipeline with the same stages, micro_batches, schedule and loss on every rank")


class Pipeline(nn.Module):
    """Stages run over ``micro_batches`` by ``schedule``, one rank set per stage (or per ``v`` stages, interleaved).

    ``step(inputs, targets)`` runs forward and backward of one batch and returns its loss (on the last
    stage's ranks; None elsewhere), leaving every parameter's gradient as one device would on the whole
    batch. ``pipe(x)`` runs the stages in order eagerly, on every rank. ``trace`` holds the last step's
    actions on this rank with their start and end times (seconds from the step's start); ``agreement_seconds``
    the time its last step spent on a multi-rank stage's agreement (0.0 on a one-rank stage).

    Every rank builds the same ``Pipeline`` (one SPMD script) and calls ``step`` with the whole batch, as one
    device would: the batch's rows (dim 0) are cut into ``micro_batches`` by ``torch.tensor_split``. Each
    rank runs only its own column of the schedule table (``schedule_table()`` draws it); stages hand
    activations and gradients to their neighbours by cross-placement boxing. An error in any stage reaches
    every rank as a ``tpf.PipelineError``, after which the pipeline runs no more steps. Fewer micro-batches
    than rank sets, gaps in the stage ids, overlapping placements or stages of different device types are
    refused here.

    A mean loss is one device's mean over the whole batch given to ``step``, whatever its targets mask: the
    batch's items (rows, or targets other than ``ignore_index``, or a causal LM's labelled tokens) are counted
    before any micro-batch's loss is taken. The targets are whole on every rank of the last stage, so a
    data-parallel last stage (``sbp=split(0)``, its output gathered for the loss) takes the same mean; separate
    pipelines over parts of a global batch (data parallelism outside the pipeline) each average over their own.

    Args:
        stages: the ``tpf.stage`` modules, in any order (they are sorted by ``stage_id``), or a module that
            holds them; their ids must be 0, 1, ..., each once. Stages on different placements must not share
            ranks; for ``"interleaved"``, stage k has the very placement of stage k - p (p rank sets, each
            holding v = stages / p of them: rank set r runs stages r, r + p, ...).
        micro_batches: the number of micro-batches a step cuts the batch into: at least the number of rank sets
            (a multiple of it for ``"interleaved"``), and at most the batch's rows. More of them shrink the
            bubble (``tpflow.pipeline.schedule.bubble`` gives each schedule's share).
        loss_fn: called on the last stage's ranks as ``loss_fn(output, target)`` for each micro-batch, with the
            stage's output and the micro-batch's targets, both whole on every rank of that stage (plain
            tensors; a split output is gathered first); returns a scalar, such as ``F.cross_entropy``. A
            ``loss_fn`` with a ``num_items_in_batch`` parameter (Hugging Face's convention, as
            ``tpf.pipeline.causal_lm_loss`` gives) is called as ``loss_fn(output, target, num_items_in_batch=n)``
            with n the whole batch's items, counted before any micro-batch's loss, and returns its micro-batch's
            sum over n; it counts them by its own ``num_items(targets)`` where it has that attribute (the causal
            LM's labels after the shift), else as the targets other than ``ignore_index``.
        schedule: ``"1f1b"`` (the default: PipeDream-flush, at most p - s micro-batches of activations held
            on stage s), ``"gpipe"`` (all forwards, then all backwards: m micro-batches held),
            ``"interleaved"`` (Megatron's interleaved 1F1B over v stages per rank set: the bubble v times
            smaller, for more activations held) or ``"zb-h1"`` (zero bubble: each backward split into the
            input's gradient and the weights', the latter run in what would be idle time; at most p
            micro-batches held on every stage).
        loss_reduction: ``"mean"`` when ``loss_fn`` averages over its items (its rows, or with ``ignore_index``
            its targets other than that value): each micro-batch's loss is weighted by its share of the whole
            batch's items, counted before any loss is taken, and a micro-batch without items adds no loss and
            zero gradients; ``"sum"`` when it sums them: no weights. Either way the gradients and the returned
            loss are those of the whole batch on one device, whatever the targets mask (a batch without a single
            item gives NaN, as one device does). Default: a torch loss module's own ``reduction``
            (``nn.MSELoss(reduction="sum")`` is ``"sum"``), else ``"mean"``; given beside a loss module, it must
            agree with it.
        ignore_index: the target value a mean leaves out (integer targets; class probabilities count by rows):
            the batch's items are then its targets other than this value, over every element of the targets
            (``(rows, tokens)`` labels count tokens). Default: a torch loss module's own (``nn.CrossEntropyLoss``,
            ``nn.NLLLoss``, whose class ``weight`` then weighs the count as their mean does), -100 for
            ``F.cross_entropy``, ``F.nll_loss`` and a ``loss_fn`` that takes ``num_items_in_batch``, else None:
            every row counts. Give it for a ``loss_fn`` of your own that leaves a value out
            (``lambda y, t: F.cross_entropy(y, t, ignore_index=-1)`` with ``ignore_index=-1``).

    Example::

        >>> import torch
        >>> import torch.nn.functional as F
        >>> from torch import nn
        >>> import tpflow as tpf
        >>> stages = [tpf.stage(nn.Sequential(nn.Linear(8, 32), nn.ReLU()), stage_id=0,
        ...                     placement=tpf.placement("cpu", ranks=[0])),
        ...           tpf.stage(nn.Linear(32, 4), stage_id=1, placement=tpf.placement("cpu", ranks=[1]))]
        >>> pipe = tpf.Pipeline(stages, micro_batches=4, loss_fn=F.cross_entropy)
        >>> print(pipe.schedule_table())
        1f1b: 2 stages, 4 micro-batches, bubble (p - 1) / (m + p - 1) = 20.0%
        step      0  1  2  3  4  5  6  7  8  9
        stage 0  F0 F1  . B0 F2 B1 F3 B2  . B3
        stage 1   . F0 B0 F1 B1 F2 B2 F3 B3  .
        >>> opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        >>> x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
        >>> loss = pipe.step(x, y)   # the batch's mean loss on rank 1, None on rank 0
        >>> opt.step()               # each rank updates its own stage's parameters
    """

    def __init__(self, stages: Sequence[Stage] | nn.Module, *, micro_batches: int, loss_fn: Callable,
                 schedule: str = "1f1b", loss_reduction: str | None = None, ignore_index: int | None = None) -> None:
        super().__init__()
        found = _collect(stages)
        sets = _rank_sets(found)
        _agree(found, sets, micro_batches=micro_batches, schedule=schedule, loss_reduction=loss_reduction,
               ignore_index=ignore_index, pipelines_built_before=_BUILT[0])
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
        self.batch_loss = BatchLoss(loss_fn, loss_reduction, ignore_index)
        self.ignore_index = self.batch_loss.ignore_index
        self.stages = nn.ModuleList(found)
        self.micro_batches, self.schedule, self.loss_fn, self.loss_reduction = \
            micro_batches, schedule, loss_fn, self.batch_loss.reduction
        self.rank_sets, self.chunks = sets, v
        self.table = schedules.build(schedule, p, micro_batches, chunks=v)
        self.split_backward = any(a.kind is actions.Kind.W for row in self.table for a in row)
        for st in found:  # process groups are made by every rank, in one order: here, not lazily inside a stage
            _ = st.placement.mesh
        rank = dist.get_rank()
        # this rank's rank set: its first stage's id, None off the pipeline
        self.stage_index = next((r for r, pl in enumerate(sets) if rank in pl), None)
        # a send and the next receive from the same ranks as one group (NCCL), or receives posted ahead (gloo)
        self.pairs = bool(config.get("pipeline_pairs", sets[0].type))
        if self.pairs:
            try:
                replay.check_streams(self.table)
            except ValueError as e:
                raise ValueError(f"schedule={schedule!r} with {micro_batches} micro-batches on {p} rank sets can "
                                 "deadlock where a rank's transfers to one peer run in order on one stream, as on "
                                 f"NCCL (pipeline_pairs is on): {e}. Use 'gpipe', '1f1b' or 'zb-h1', or as many "
                                 "micro-batches as rank sets, or turn pipeline_pairs off (gloo)") from e
        if self.pairs and sets[0].type == "cuda":  # batched transfers use the world's communicator: made here, by all
            dist.all_reduce(torch.zeros(1, device=sets[0].device))
        first = _fresh_tags(max(len(found) - 1, 1) * (3 * micro_batches + 1) + 1)  # the last: the guards'
        guards = [Guard(pl.flat_ranks, first + max(len(found) - 1, 1) * (3 * micro_batches + 1))
                  if len(pl.flat_ranks) > 1 else None for pl in sets]
        self.links = [Link(a, b, base=first + k * (3 * micro_batches + 1), micro_batches=micro_batches,
                           ahead=not self.pairs) for k, (a, b) in enumerate(itertools.pairwise(found))]
        self.trace: list[tuple[actions.Action, float, float]] = []
        self._failed: str | None = None
        # this rank set's: its stage's agreement, the receives that prove sends taken, the receives paired with sends
        self.guard = None if self.stage_index is None else guards[self.stage_index]
        self.released = {} if self.stage_index is None else _released(self.table, self.stage_index)
        self.recv_pairs = {} if self.stage_index is None or not self.pairs else \
            replay.pairs(self.table, self.stage_index)

    @property
    def agreement_seconds(self) -> float:
        """The seconds this rank's last step spent on its multi-rank stage's agreement (sending its word and
        waiting for its peers'); 0.0 on a one-rank stage."""
        return 0.0 if self.guard is None else self.guard.seconds

    def schedule_table(self) -> str:
        """The step as a grid of rank sets by time steps (unit time per forward, per backward and per weight
        gradient), under a line with the schedule's bubble by its formula."""
        p, m, v = len(self.rank_sets), self.micro_batches, self.chunks
        formula, share = schedules.bubble(self.schedule, p, m, v)
        where = f"{p} rank sets of {v} stages" if v > 1 else f"{p} stages"
        return f"{self.schedule}: {where}, {m} micro-batches, bubble {formula} = {share:.1%}\n" + \
            replay.render(self.table)

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

    def links_of(self, k: int) -> tuple[Link | None, Link | None]:
        """Stage ``k``'s links to the stage before and the stage after (None at the ends)."""
        return self.links[k - 1] if k > 0 else None, self.links[k] if k < len(self.stages) - 1 else None

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor | None:
        """One batch forward and backward; the first stage reads ``inputs``, the last ``targets`` (plain whole
        batches), so other ranks may pass None. Returns the batch's loss on the last stage's ranks (for a mean,
        over the whole batch's items), None elsewhere."""
        r = self.stage_index
        if r is None:
            return None
        if self._failed is not None:
            raise PipelineError(f"an earlier step failed ({self._failed}); its messages may still be in flight, so "
                                "this pipeline runs no more steps: build a new Pipeline over the stages (it takes "
                                "fresh message tags), or restart the job")
        p = len(self.rank_sets)
        mine = range(r, len(self.stages), p)  # this rank set's stages, chunk by chunk
        for k in mine:
            prev, nxt = self.links_of(k)
            for link, src in ((prev, False), (nxt, True)):
                if link is not None:
                    link.reset()
                    link.start(rank_in_src=src)
        sends: dict[actions.Action, comm.Pending] = {}  # each send's transfers, until known to be taken
        outputs: dict[int, dict[int, Block]] = {k: {} for k in mine}  # per stage, outputs until their backward
        self.trace, run, where = [], None, None
        if self.guard is not None:
            self.guard.seconds = 0.0
        for k in mine:
            self.stages[k].open_step()
        try:
            self._check_fsdp(r)
            n = len(self.stages)
            run = StepRun(self, r, self._micro(inputs, "inputs") if r == 0 else None,
                          self._micro(targets, "targets") if r == (n - 1) % p else None, targets, sends, outputs)
            loss = run.run()
            for k in mine:  # every micro-batch's gradients are in: to the parameters
                self.stages[k].close_step()
            where = "the end of the step"
            ended = comm.Pending()
            # Every rank set's stages are done: the ones before it say so over the links of chunk 0 (rank set r - 1's
            # first stage to r's), forward, and the ones after it back, each for itself and all beyond it. Per rank
            # set, not per stage: the waves of an interleaved pipeline of p rank sets cross p - 1 links each way, not
            # one per stage (the 2 x 2 stages of the harness: 1 link, not 3, at a gloo message's latency each). The last
            # rank set's word back waits on no one, so it goes out first and the two waves travel at once.
            before, after = self.links[r - 1] if r > 0 else None, self.links[r] if r < p - 1 else None
            if after is None and before is not None:
                before.end_up(None, ended)
            if before is not None:
                before.wait_end()
            if after is not None:
                after.end(None, ended)
                after.wait_end_up()
                if before is not None:
                    before.end_up(None, ended)
            for pending in sends.values():
                pending.wait()
            ended.wait()  # taken at once: the neighbours have finished their work and wait for these
            return loss
        except Exception as e:
            where = where or (run.action if run is not None else None)
            message = str(e) if isinstance(e, PipelineError) else self.failure_message(r, e, where)
            self._failed = message
            for pending in sends.values():  # a peer that failed may never take them: kept alive, never waited on
                UNFINISHED.works += pending.works
                UNFINISHED.buffers += pending.buffers
            drains = []
            for k in mine:  # every error header first, then the links that still send to this rank
                prev, nxt = self.links_of(k)
                if prev is not None:
                    _still(prev.fail, message, "src", UNFINISHED)
                if nxt is not None and _still(nxt.fail, message, "dst", UNFINISHED):
                    drains.append((nxt, outputs[k]))
            for link, outs in drains:
                _still(link.drain, message, outs, UNFINISHED)
            if isinstance(e, PipelineError):
                raise
            raise PipelineError(message) from e
        finally:
            for k in mine:  # a step that failed (or was interrupted) leaves no leaves behind
                self.stages[k].close_step(keep=False)

    def failure_message(self, r: int, e: BaseException, where: actions.Action | str | None) -> str:
        """Rank set ``r``'s error ``e`` on ``where`` (an action, or a part of the step), naming its stage, ranks,
        action and (in a multi-rank stage) rank."""
        on = "" if where is None else f" on {where}"
        chunk = where.chunk if isinstance(where, actions.Action) else 0
        return (f"stage {r + len(self.rank_sets) * chunk} (ranks {self.rank_sets[r].ranks}) failed{on}"
                f"{self._which()}: {_cause(e, self.rank_sets[r])}")

    def _which(self) -> str:
        """Which rank of a multi-rank stage failed (a one-rank stage's ranks say it)."""
        return f" (rank {dist.get_rank()})" if len(self.rank_sets[self.stage_index].flat_ranks) > 1 else ""

    def _check_fsdp(self, r: int) -> None:
        """FSDP2 over rank set ``r``'s stages: each stage's module is its root, and the whole backward runs at once
        (FSDP2 reduces a module's gradients when its input's gradient is computed, which a zero-bubble ``B`` does
        before its ``W`` computes the weights')."""
        if isinstance(self, FSDPModule):
            raise TypeError("the Pipeline itself is sharded by FSDP2, but its step runs each stage's module, never the "
                            "Pipeline's forward: call fully_shard on the stages' blocks and on each stage.module")
        fsdp = any(isinstance(m, FSDPModule) for k in range(r, len(self.stages), len(self.rank_sets))
                   for m in self.stages[k].modules())
        if fsdp and self.split_backward:
            raise ValueError(f"schedule={self.schedule!r} splits each backward into the input's gradient and the "
                             "weights', but FSDP2 reduces a module's gradients as soon as its input's gradient is "
                             "computed, before the weights' exist: use '1f1b', 'gpipe' or 'interleaved' with FSDP2 "
                             "stages")
