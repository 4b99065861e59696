"""Pipeline schedules as data: for each stage, the ordered actions its ranks perform in one step.

The actions (``F`` / ``B`` / ``W`` and the four transfers) live in ``tpflow.pipeline.actions``. Every table built
here is replayed (``tpflow.pipeline.replay.simulate``) before it is returned, so one that would deadlock fails here.

    gpipe   all forwards, then all backwards: holds m micro-batches of activations per stage
    1f1b    p - s - 1 warm-up forwards on stage s, then one forward / one backward alternately,
            then the remaining backwards: at most p - s micro-batches held (PipeDream-flush)

Both have the bubble (p - 1) / (m + p - 1) of the step when a backward costs as much as a forward.

``interleaved`` (``build_interleaved``, Megatron's interleaved 1F1B) gives each of p ranks v chunks of the model:
rank r holds virtual stages r, r + p, ..., r + (v - 1) p, and its table's actions name the chunk
(``Action.chunk``). Micro-batches go through the chunks in groups of p; rank r warms up with
2 (p - r - 1) + (v - 1) p chunk forwards, then alternates. The bubble shrinks v times, to (p - 1) / (v m) of
the compute, for min(2 (p - r - 1) + (v - 1) p + 1, v m) chunks' activations held on rank r.

``zb-h1`` (``build_zero_bubble``, Qi et al.'s ZB-H1) splits each backward in two: ``B`` the input's gradient
(what the stage before waits for) and ``W`` the weights' (which nobody waits for). It is 1F1B's order with stage
s's ``W`` of micro-batch i right after its ``B`` of micro-batch i + s, the rest at the end: every stage holds at
most p micro-batches (1F1B's stage 0), and with F, B and W of one cost the bubble falls from 1F1B's
(p - 1)(F + B + W) to (p - 1)(F + B - W).

``build`` makes any of the four by name; ``tpf.Pipeline`` runs them all.
"""

from __future__ import annotations

from tpflow.pipeline.actions import Action, Kind, Table, backward_actions, forward_actions
from tpflow.pipeline.replay import simulate

__all__ = ["SCHEDULES", "bubble", "build", "build_interleaved", "build_zero_bubble"]


def _gpipe(stage: int, stages: int, micro_batches: int) -> list[Action]:
    return [a for i in range(micro_batches) for a in forward_actions(stage, stages, i)] + \
        [a for i in range(micro_batches) for a in backward_actions(stage, stages, i)]


def _one_f_one_b(stage: int, stages: int, micro_batches: int) -> list[Action]:
    warmup = min(stages - stage - 1, micro_batches)
    actions = [a for i in range(warmup) for a in forward_actions(stage, stages, i)]
    for k in range(micro_batches - warmup):  # steady state: the next forward, then the oldest backward
        actions += forward_actions(stage, stages, warmup + k) + backward_actions(stage, stages, k)
    drain = range(micro_batches - warmup, micro_batches)
    return actions + [a for i in drain for a in backward_actions(stage, stages, i)]


SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def build(schedule: str, stages: int, micro_batches: int, chunks: int = 1) -> Table:
    """Every stage's (rank's) actions for one step of ``micro_batches`` through ``stages`` stages.

    The table is checked by ``simulate`` before it is returned, so a schedule that would deadlock fails here.

    Args:
        schedule: one of ``SCHEDULES``: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` (``build_interleaved``) or
            ``"zb-h1"`` (``build_zero_bubble``).
        stages: the number of stages (with chunks: of ranks, each holding ``chunks`` stages), at least 1.
        micro_batches: the number of micro-batches in one step, at least 1.
        chunks: the stages (model chunks) each rank holds: 1, or at least 2 for ``"interleaved"``.

    Returns:
        Per stage (rank), in order, the list of its ``Action``s in the order its ranks perform them.

    Example::

        >>> from tpflow.pipeline.schedule import build
        >>> table = build("1f1b", stages=2, micro_batches=2)
        >>> [str(a) for a in table[1]]
        ['recv_act0', 'F0', 'B0', 'send_grad0', 'recv_act1', 'F1', 'B1', 'send_grad1']
        >>> [str(a) for a in build("interleaved", stages=2, micro_batches=2, chunks=2)[1]][:8]   # .1: chunk 1
        ['recv_act0', 'F0', 'send_act0', 'recv_act1', 'F1', 'send_act1', 'recv_act0.1', 'F0.1']
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
    if stages < 1 or micro_batches < 1:
        raise ValueError(f"a pipeline needs at least 1 stage and 1 micro-batch, got {stages} and {micro_batches}")
    if schedule == "interleaved":
        return build_interleaved(stages, chunks, micro_batches)
    if chunks != 1:
        raise ValueError(f"{schedule!r} runs one stage per rank, got {chunks} chunks per rank: use 'interleaved'")
    if schedule == "zb-h1":
        return build_zero_bubble(stages, micro_batches)
    step = _gpipe if schedule == "gpipe" else _one_f_one_b
    table = [step(s, stages, micro_batches) for s in range(stages)]
    simulate(table)
    return table


def bubble(schedule: str, stages: int, micro_batches: int, chunks: int = 1) -> tuple[str, float]:
    """The share of a step each rank idles, by the schedule's formula, when a forward, a backward (and, split off
    it, a weight gradient) cost the same: ``simulate``'s replay with unit costs gives exactly this.

    Args:
        schedule: one of ``SCHEDULES``.
        stages: the stages (with chunks: the ranks).
        micro_batches: the micro-batches of a step.
        chunks: the stages each rank holds (``"interleaved"``).

    Returns:
        ``(formula, share)``: the formula as text, and its value.

    Example::

        >>> from tpflow.pipeline.schedule import bubble
        >>> bubble("1f1b", stages=4, micro_batches=8)
        ('(p - 1) / (m + p - 1)', 0.2727272727272727)
        >>> bubble("interleaved", stages=4, micro_batches=8, chunks=2)[0]
        '(p - 1) / (v m + p - 1)'
    """
    p, m, v = stages, micro_batches, chunks
    if schedule == "interleaved":
        return "(p - 1) / (v m + p - 1)", (p - 1) / (v * m + p - 1)
    if schedule == "zb-h1":  # idle (p - 1)(F + B - W), compute m (F + B + W)
        return "(p - 1) / (3 m + p - 1)", (p - 1) / (3 * m + p - 1)
    return "(p - 1) / (m + p - 1)", (p - 1) / (m + p - 1)


def _interleaved(rank: int, ranks: int, chunks: int, micro_batches: int) -> list[Action]:
    total = micro_batches * chunks

    def chunk_and_batch(k: int, backward: bool) -> tuple[int, int]:
        """The rank's k-th forward (backward): micro-batches in groups of ``ranks``, each through every chunk."""
        group, at = divmod(k, ranks * chunks)
        chunk = at // ranks
        return (chunks - 1 - chunk if backward else chunk), group * ranks + at % ranks

    def forward(k: int) -> list[Action]:
        chunk, i = chunk_and_batch(k, False)
        return forward_actions(chunk * ranks + rank, ranks * chunks, i, chunk)

    def backward(k: int) -> list[Action]:
        chunk, i = chunk_and_batch(k, True)
        return backward_actions(chunk * ranks + rank, ranks * chunks, i, chunk)

    warmup = total if micro_batches == ranks else min(2 * (ranks - rank - 1) + (chunks - 1) * ranks, total)
    actions = [a for k in range(warmup) for a in forward(k)]
    for k in range(total - warmup):  # steady state: the next forward, then the oldest backward
        actions += forward(warmup + k) + backward(k)
    return actions + [a for k in range(total - warmup, total) for a in backward(k)]


def build_interleaved(ranks: int, chunks: int, micro_batches: int) -> Table:
    """Megatron's interleaved 1F1B: every rank's actions over its ``chunks`` chunks of the model for one step.

    Rank r holds virtual stages ``r, r + ranks, ...``; the table is checked by ``simulate`` before it is returned.

    Args:
        ranks: the pipeline's ranks (physical stages), at least 2.
        chunks: the model chunks each rank holds (virtual stages per rank), at least 2 (one is ``"1f1b"``).
        micro_batches: a multiple of ``ranks`` (the micro-batches go through the chunks in groups of ``ranks``).

    Returns:
        Per rank, its ``Action``s in order, each naming its chunk.

    Example::

        >>> from tpflow.pipeline.replay import render
        >>> from tpflow.pipeline.schedule import build_interleaved
        >>> print(render(build_interleaved(ranks=2, chunks=2, micro_batches=2), costs={"F": 1, "B": 2}))
        step        0    1    2    3    4    5    6    7    8    9   10   11   12   13   14
        stage 0    F0   F1 F0.1 F1.1    .    .    . B0.1    - B1.1    -   B0    -   B1    -
        stage 1     .   F0   F1 F0.1 F1.1 B0.1    - B1.1    -   B0    -   B1    -    .    .
    """
    if ranks < 2 or chunks < 2:
        raise ValueError(f"interleaving needs at least 2 ranks and 2 chunks per rank (one chunk is '1f1b'), got "
                         f"{ranks} and {chunks}")
    if micro_batches < ranks or micro_batches % ranks:
        raise ValueError(f"the interleaved schedule takes the micro-batches in groups of the {ranks} ranks: use a "
                         f"multiple of {ranks}, got {micro_batches}")
    table = [_interleaved(r, ranks, chunks, micro_batches) for r in range(ranks)]
    simulate(table)
    return table


def _zero_bubble(stage: int, stages: int, micro_batches: int) -> list[Action]:
    actions, weights = [], 0
    last = Kind.SEND_GRAD if stage > 0 else Kind.B  # a backward's last action: W goes after its gradient is sent
    for a in _one_f_one_b(stage, stages, micro_batches):
        actions.append(a)
        if a.kind is last and a.micro_batch >= stage:  # stage s's W lags its B by s micro-batches
            actions.append(Action(Kind.W, a.micro_batch - stage))
            weights += 1
    return actions + [Action(Kind.W, i) for i in range(weights, micro_batches)]


def build_zero_bubble(stages: int, micro_batches: int) -> Table:
    """ZB-H1: 1F1B with each backward split into the input's gradient (``B``) and the weights' (``W``), the ``W``
    of stage s lagging its ``B`` by s micro-batches; checked by ``simulate`` before it is returned.

    Args:
        stages: the number of stages, at least 1.
        micro_batches: the micro-batches in one step, at least ``stages``.

    Returns:
        Per stage, its ``Action``s in order.

    Example::

        >>> from tpflow.pipeline.replay import render
        >>> from tpflow.pipeline.schedule import build_zero_bubble
        >>> print(render(build_zero_bubble(stages=2, micro_batches=3)))
        step      0  1  2  3  4  5  6  7  8  9
        stage 0  F0 F1  . B0 W0 F2 B1 W1 B2 W2
        stage 1   . F0 B0 F1 B1 W0 F2 B2 W1 W2
    """
    if stages < 1 or micro_batches < stages:
        raise ValueError(f"ZB-H1 needs at least 1 stage and as many micro-batches as stages, got {stages} and "
                         f"{micro_batches}")
    table = [_zero_bubble(s, stages, micro_batches) for s in range(stages)]
    simulate(table)
    return table

