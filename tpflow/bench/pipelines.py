"""The harness's pipeline modes: tpflow's schedules beside PyTorch's ``torch.distributed.pipelining`` running the
schedule of the same name on the same cut of the same model, micro-batches, loss and optimizer.

    pipeline, <schedule>          tpf.Pipeline over tpf.pipeline.cut stages, one rank set of one rank a stage
                                  (two stages a rank for interleaved: stage k on rank k mod p)
    pipeline, <schedule>, torch   PipelineStage + ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B /
                                  ScheduleInterleavedZeroBubble (torch's zero-bubble schedule for one stage a rank
                                  or more; tpflow's is ZB-H1)
    pipeline x tensor             2 stages, each tensor parallel over half the ranks (parallelize), 1F1B

Both send each micro-batch's activation forward (but from the last stage) and its gradient back (but to the
first): the layout's minimum. torch's point-to-point sends are counted as its schedules make them
(``dist.P2POp``), tpflow's by ``tpflow.comm``, which also counts its 1 KiB headers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tpflow as tpf
from tpflow import comm
from tpflow.bench.trainer import Context, Skip, Trainer, make_trainer
from tpflow.bench.workloads import Workload
from tpflow.pipeline.cut import balanced_runs

__all__ = ["SCHEDULES", "counting_p2p", "pipeline_mode", "pipeline_x_tensor", "torch_pipeline_mode"]

# the harness's name -> (tpflow's schedule, torch's schedule class, stages a rank)
SCHEDULES = {"GPipe": ("gpipe", "ScheduleGPipe", 1), "1F1B": ("1f1b", "Schedule1F1B", 1),
             "interleaved": ("interleaved", "ScheduleInterleaved1F1B", 2),
             "ZB-H1": ("zb-h1", "ScheduleInterleavedZeroBubble", 1)}


def _activation_bytes(w: Workload) -> int:
    return w.inputs.numel() * w.inputs.element_size()


def _layout(w: Workload, ctx: Context, name: str) -> tuple[int, int, int]:
    """Stages, stages a rank and micro-batches for schedule ``name`` on this world (or Skip)."""
    per_rank = SCHEDULES[name][2]
    stages = per_rank * ctx.world
    if ctx.world < 2:
        raise Skip("a pipeline needs at least 2 ranks")
    if len(w.model) < stages:
        raise Skip(f"{len(w.model)} blocks cannot make {stages} stages")
    m = ctx.micro_batches or 2 * ctx.world
    if w.samples % m:  # torch's schedules average equal micro-batches' gradients
        raise Skip(f"{w.samples} samples do not split into {m} equal micro-batches")
    return stages, per_rank, m


def _minimum(w: Workload, mine: list[int], stages: int, layers: int = 0) -> int:
    """Each of this rank's stages ``mine`` sends its activation forward (but the last) and its gradient back (but
    the first), and its tensor-parallel layers send ``layers``."""
    return sum((k < stages - 1) + (k > 0) for k in mine) * _activation_bytes(w) + layers


def _tpflow_trainer(w: Workload, ctx: Context, pipe: tpf.Pipeline, minimum: int) -> Trainer:
    x, y = w.inputs.to(ctx.device), w.targets.to(ctx.device)
    last = pipe.stages[-1].placement
    reports = ctx.rank == last.flat_ranks[0]  # one copy of the loss, from the last stage's first rank

    def step():
        loss = pipe.step(x, y)
        return loss if reports else None
    return make_trainer(list(pipe.parameters()), step, minimum, range(ctx.world))


def pipeline_mode(name: str) -> Callable[[Workload, Context], Trainer]:
    """The harness mode running tpflow's schedule ``name`` on ``tpf.pipeline.cut`` stages of one rank each.

    Args:
        name: a key of ``SCHEDULES``.

    Returns:
        The mode's builder: ``build(workload, context) -> Trainer`` (raises ``Skip`` where the world or the
        model cannot make the stages).

    Example::

        >>> from tpflow.bench.workloads import build as build_workload
        >>> w = build_workload("mlp", dim=8, hidden=16, depth=4, tokens=16, seq=4, heads=2, kv_heads=1)
        >>> trainer = pipeline_mode("ZB-H1")(w, Context(world=2, rank=tpf.get_rank(), device=torch.device("cpu")))
        >>> trainer.step()                     # on rank 1, the last stage's: the batch's loss
        tensor(2.4722)
    """
    def build(w: Workload, ctx: Context) -> Trainer:
        stages, _, m = _layout(w, ctx, name)
        placements = [ctx.placement([k % ctx.world]) for k in range(stages)]
        cut = tpf.pipeline.cut(w.model.to(ctx.device), placements)
        pipe = tpf.Pipeline(cut, micro_batches=m, schedule=SCHEDULES[name][0], loss_fn=F.mse_loss)
        return _tpflow_trainer(w, ctx, pipe, _minimum(w, list(range(ctx.rank, stages, ctx.world)), stages))
    return build


@contextlib.contextmanager
def counting_p2p() -> Iterator[None]:
    """Count in ``comm.stats`` the sends torch's pipelining makes in the block: each is a ``dist.P2POp`` of
    ``dist.isend``, counted as it is made.

    Returns:
        A context manager; inside it each ``P2POp`` of a send adds its tensor's bytes to ``comm.stats``.

    Example::

        >>> buf, peer = torch.zeros(256), 1 - dist.get_rank()
        >>> comm.stats.reset()
        >>> with counting_p2p():
        ...     works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(256), peer),
        ...                                     dist.P2POp(dist.irecv, buf, peer)])
        >>> _ = [work.wait() for work in works]
        >>> comm.stats.bytes_sent             # the send's 1 KiB; a receive sends nothing
        1024
    """
    own = dist.P2POp.__init__

    def counted(op: dist.P2POp, kind, tensor: torch.Tensor, *args, **kwargs) -> None:
        own(op, kind, tensor, *args, **kwargs)
        if kind is dist.isend:
            comm.stats.add(tensor.numel() * tensor.element_size())
    dist.P2POp.__init__ = counted
    try:
        yield
    finally:
        dist.P2POp.__init__ = own


def torch_pipeline_mode(name: str) -> Callable[[Workload, Context], Trainer]:
    """The harness mode running ``torch.distributed.pipelining``'s schedule of the same name (``SCHEDULES``) on the
    same runs of blocks as ``pipeline_mode``'s, with its own ``PipelineStage`` and loss scaling.

    Args:
        name: a key of ``SCHEDULES``.

    Returns:
        The mode's builder, as ``pipeline_mode``'s.

    Example::

        >>> from tpflow.bench.workloads import build as build_workload
        >>> w = build_workload("mlp", dim=8, hidden=16, depth=4, tokens=16, seq=4, heads=2, kv_heads=1)
        >>> trainer = torch_pipeline_mode("1F1B")(w, Context(world=2, rank=tpf.get_rank(), device=torch.device("cpu")))
        >>> trainer.step()                     # on rank 1: the loss tpflow's 1F1B gives too
        tensor(2.4722)
    """
    def build(w: Workload, ctx: Context) -> Trainer:
        from torch.distributed.pipelining import PipelineStage, schedules
        stages, per_rank, m = _layout(w, ctx, name)
        model = w.model.to(ctx.device)
        runs = balanced_runs(len(model), stages)  # tpf.pipeline.cut's
        mine = [PipelineStage(model[a:b], k, stages, ctx.device) for k, (a, b) in enumerate(runs)
                if k % ctx.world == ctx.rank]
        schedule = getattr(schedules, SCHEDULES[name][1])
        pipe = schedule(mine if per_rank > 1 or name == "ZB-H1" else mine[0], n_microbatches=m, loss_fn=F.mse_loss)
        x, y = w.inputs.to(ctx.device), w.targets.to(ctx.device)
        first, last = ctx.rank == 0, ctx.rank == (stages - 1) % ctx.world

        def step():
            losses: list[torch.Tensor] = []
            with counting_p2p():
                pipe.step(*([x] if first else []), target=y if last else None, losses=losses if last else None)
            # equal micro-batches: the batch's mean; detached, as every mode's share (the schedule ran the backward)
            return torch.stack(losses).detach().mean() if last else None
        params = [p for st in mine for p in st.submod.parameters()]
        return make_trainer(params, step, _minimum(w, list(range(ctx.rank, stages, ctx.world)), stages),
                            range(ctx.world))
    return build


def pipeline_x_tensor(w: Workload, ctx: Context, plan: dict,
                      layers_bytes: Callable[[torch.nn.Module, torch.Tensor], int]) -> Trainer:
    """Two stages, each tensor parallel over half the ranks (``tpf.pipeline.cut`` with ``plan``), under 1F1B.

    Args:
        w: the workload.
        ctx: this rank's world.
        plan: the plan each stage is parallelized by.
        layers_bytes: ``layers_bytes(part, stage_input)``, the bytes this rank's tensor-parallel layers must send.

    Returns:
        The trainer.

    Example (4 ranks)::

        >>> from tpflow.bench.workloads import build as build_workload
        >>> w = build_workload("mlp", dim=8, hidden=16, depth=4, tokens=16, seq=4, heads=2, kv_heads=1)
        >>> ctx = Context(world=4, rank=tpf.get_rank(), device=torch.device("cpu"))
        >>> trainer = pipeline_x_tensor(w, ctx, w.plan, lambda part, stage_input: 0)   # stages on [0, 1] and [2, 3]
        >>> trainer.step()                     # on rank 2, the last stage's first rank
        tensor(2.4722)
    """
    if ctx.world < 4 or ctx.world % 2:
        raise Skip("needs an even world of at least 4 ranks")
    half = ctx.world // 2
    ranks = [list(range(half)), list(range(half, ctx.world))]
    m = ctx.micro_batches or 4
    if w.samples < m:
        raise Skip(f"{w.samples} samples cannot make {m} micro-batches")
    mine = ctx.rank // half
    cut = len(w.model) // 2
    stage_input = w.inputs.detach().requires_grad_(mine > 0)  # a later stage's input is an activation
    layers = layers_bytes(w.model[:cut] if mine == 0 else w.model[cut:], stage_input)
    placements = [ctx.placement(rs) for rs in ranks]
    stages = tpf.pipeline.cut(w.model.to(ctx.device), placements, at=[str(cut)], plan=plan, sbp=tpf.sbp.broadcast)
    pipe = tpf.Pipeline(stages, micro_batches=m, schedule="1f1b", loss_fn=F.mse_loss)
    # each of the next stage's ranks needs the whole activation: with as many senders as receivers, one
    # activation per sender (and one gradient per sender back)
    return _tpflow_trainer(w, ctx, pipe, _minimum(w, [mine], 2, layers))
