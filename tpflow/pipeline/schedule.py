"""Pipeline schedules as data: for each stage, the ordered actions its ranks perform in one step.

    F / B        forward / backward of micro-batch i on this stage
    recv_act     the input activation of micro-batch i, from the stage before
    send_act     this stage's output activation of micro-batch i, to the stage after
    recv_grad    the gradient of this stage's output for micro-batch i, from the stage after
    send_grad    the gradient of this stage's input for micro-batch i, to the stage before

Sends are asynchronous and receives wait, which is how the executor runs them; ``simulate``
replays a schedule under exactly those rules (unit time per forward and per backward, free
transfers), so a schedule that would deadlock, or whose sends and receives do not pair up, fails
there rather than on the ranks. ``render`` draws the replay as a step-by-stage grid.

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

import dataclasses
from collections.abc import Sequence

__all__ = ["Action", "RECVS", "SCHEDULES", "SENDS", "bubble", "build", "build_interleaved", "build_zero_bubble",
           "check_streams", "pairs", "peak_activations", "render", "route", "simulate"]

COMPUTE = ("F", "B", "W")
UNIT_COSTS = {"F": 1, "B": 1, "W": 1}


@dataclasses.dataclass(frozen=True)
class Action:
    """One entry of a schedule table: what a stage's ranks do next, for which micro-batch.

    Args:
        kind: ``"F"``, ``"B"``, ``"W"`` (a weight gradient computed apart from ``B``), ``"recv_act"``,
            ``"send_act"``, ``"recv_grad"`` or ``"send_grad"`` (see the module docstring).
        micro_batch: the micro-batch's index, from 0.
        chunk: which of the rank's chunks of the model (its virtual stages, ``build_interleaved``); 0 with one.

    Example::

        >>> from tpflow.pipeline.schedule import Action
        >>> a = Action("F", 3)
        >>> str(a), a.kind, a.micro_batch, str(Action("B", 3, chunk=1))
        ('F3', 'F', 3, 'B3.1')
    """

    kind: str  # "F", "B", "W", "recv_act", "send_act", "recv_grad", "send_grad"
    micro_batch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}" + (f".{self.chunk}" if self.chunk else "")


Table = list[list[Action]]  # per stage, in order


def _forward(stage: int, stages: int, i: int, chunk: int = 0) -> list[Action]:
    """Virtual stage ``stage`` of ``stages``: its forward of micro-batch ``i`` with its transfers."""
    return ([Action("recv_act", i, chunk)] if stage > 0 else []) + [Action("F", i, chunk)] + \
        ([Action("send_act", i, chunk)] if stage < stages - 1 else [])


def _backward(stage: int, stages: int, i: int, chunk: int = 0) -> list[Action]:
    return ([Action("recv_grad", i, chunk)] if stage < stages - 1 else []) + [Action("B", i, chunk)] + \
        ([Action("send_grad", i, chunk)] if stage > 0 else [])


def _gpipe(stage: int, stages: int, micro_batches: int) -> list[Action]:
    return [a for i in range(micro_batches) for a in _forward(stage, stages, i)] + \
        [a for i in range(micro_batches) for a in _backward(stage, stages, i)]


def _one_f_one_b(stage: int, stages: int, micro_batches: int) -> list[Action]:
    warmup = min(stages - stage - 1, micro_batches)
    actions = [a for i in range(warmup) for a in _forward(stage, stages, i)]
    for k in range(micro_batches - warmup):  # steady state: the next forward, then the oldest backward
        actions += _forward(stage, stages, warmup + k) + _backward(stage, stages, k)
    return actions + [a for i in range(micro_batches - warmup, micro_batches) for a in _backward(stage, stages, i)]


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
        >>> [str(a) for a in build("interleaved", stages=2, micro_batches=2, chunks=2)[1]][:4]
        ['recv_act0', 'F0', 'recv_act1', 'F1']
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
        return _forward(chunk * ranks + rank, ranks * chunks, i, chunk)

    def backward(k: int) -> list[Action]:
        chunk, i = chunk_and_batch(k, True)
        return _backward(chunk * ranks + rank, ranks * chunks, i, chunk)

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

        >>> from tpflow.pipeline.schedule import build_interleaved, render
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
    last = "send_grad" if stage > 0 else "B"  # a backward's last action: W goes after its gradient is sent
    for a in _one_f_one_b(stage, stages, micro_batches):
        actions.append(a)
        if a.kind == last and a.micro_batch >= stage:  # stage s's W lags its B by s micro-batches
            actions.append(Action("W", a.micro_batch - stage))
            weights += 1
    return actions + [Action("W", i) for i in range(weights, micro_batches)]


def build_zero_bubble(stages: int, micro_batches: int) -> Table:
    """ZB-H1: 1F1B with each backward split into the input's gradient (``B``) and the weights' (``W``), the ``W``
    of stage s lagging its ``B`` by s micro-batches; checked by ``simulate`` before it is returned.

    Args:
        stages: the number of stages, at least 1.
        micro_batches: the micro-batches in one step, at least ``stages``.

    Returns:
        Per stage, its ``Action``s in order.

    Example::

        >>> from tpflow.pipeline.schedule import build_zero_bubble, render
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


SENDS, RECVS = ("send_act", "send_grad"), ("recv_act", "recv_grad")


def route(ranks: int, rank: int, a: Action) -> tuple[int, Action]:
    """For a transfer in rank ``rank``'s table: the peer rank, and the matching action in its table (chunk c of
    rank r is virtual stage ``c * ranks + r``).

    Args:
        ranks: the table's ranks (rank sets).
        rank: whose action ``a`` is.
        a: a ``send_*`` or ``recv_*`` action.

    Returns:
        ``(peer rank, the peer's matching action)``.

    Example::

        >>> from tpflow.pipeline.schedule import Action, route
        >>> route(2, 1, Action("send_act", 3)), route(2, 1, Action("send_act", 3, chunk=0))[0]
        ((0, Action(kind='recv_act', micro_batch=3, chunk=1)), 0)
    """
    k = a.chunk * ranks + rank
    j, kind = {"send_act": (k + 1, "recv_act"), "recv_act": (k - 1, "send_act"),
               "send_grad": (k - 1, "recv_grad"), "recv_grad": (k + 1, "send_grad")}[a.kind]
    return j % ranks, Action(kind, a.micro_batch, j // ranks)


def _next_transfer(actions: Sequence[Action], t: int) -> int | None:
    """The position of the first transfer after position ``t``, past compute (None: there is none)."""
    return next((u for u in range(t + 1, len(actions)) if actions[u].kind in SENDS + RECVS), None)


def pairs(table: Sequence[Sequence[Action]], r: int) -> dict[int, int]:
    """The sends of rank ``r``'s table that go out in one group with the next transfer after them, a receive
    (``tpf.Pipeline`` with ``pipeline_pairs``): where that receive comes from the same rank, and that rank's table
    has the mirror pair (its send of what ``r`` receives, then, past compute, its receive of what ``r`` sends), as
    1F1B's steady state has. The receive is posted with the send, before any compute between them.

    Args:
        table: per rank, its actions in order.
        r: the rank.

    Returns:
        Position of each such send in ``table[r]`` -> position of its receive.

    Example::

        >>> from tpflow.pipeline.schedule import build, pairs
        >>> table = build("1f1b", stages=2, micro_batches=2)
        >>> [(str(table[0][s]), str(table[0][t])) for s, t in pairs(table, 0).items()]
        [('send_act1', 'recv_grad0')]
    """
    out, actions = {}, table[r]
    for t, send in enumerate(actions):
        u = _next_transfer(actions, t) if send.kind in SENDS else None
        if u is None or actions[u].kind not in RECVS:
            continue
        (peer, theirs_recv), (peer_too, theirs_send) = route(len(table), r, send), route(len(table), r, actions[u])
        if peer == peer_too and _next_transfer(table[peer], table[peer].index(theirs_send)) == \
                table[peer].index(theirs_recv):
            out[t] = u
    return out


def check_streams(table: Sequence[Sequence[Action]], paired: bool = True) -> None:
    """Check that the table cannot deadlock where a rank's transfers to one peer run in order on one stream and a
    send completes only once the peer's matching receive runs (NCCL's point-to-point): with ``paired``, the
    ``pairs`` of each table go out as one group, whose transfers run together.

    Per pair of ranks, each side's transfers to the other are queued in table order (a pair as one unit); the
    heads run, a transfer completes when both its ends are running, a unit when all its transfers have, and the
    queues must empty. ``simulate`` checks the order of compute; this checks the order on the wire.

    Args:
        table: per rank, its actions in order.
        paired: group each table's ``pairs``.

    Example::

        >>> from tpflow.pipeline.schedule import build, check_streams
        >>> check_streams(build("1f1b", stages=3, micro_batches=6))        # the sends paired: fine
        >>> check_streams(build("1f1b", stages=3, micro_batches=6), paired=False)  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        ValueError: ranks 0 and 1 deadlock on their stream: ...
    """
    ranks = len(table)
    units: dict[tuple[int, int], list[list[tuple]]] = {}  # (rank, peer) -> queue of units, each a list of transfers
    for r, actions in enumerate(table):
        grouped = pairs(table, r) if paired else {}
        later = set(grouped.values())  # receives posted with their send
        for t, a in enumerate(actions):
            if (a.kind in SENDS or a.kind in RECVS) and t not in later:
                unit = [a] + ([actions[grouped[t]]] if t in grouped else [])
                units.setdefault((r, route(ranks, r, a)[0]), []).append([_transfer(ranks, r, b) for b in unit])
    for (r, peer), mine in units.items():
        if r > peer:
            continue
        theirs = units.get((peer, r), [])
        while mine or theirs:
            running = set(mine[0] if mine else ()) & set(theirs[0] if theirs else ())
            if not running:
                raise ValueError(f"ranks {r} and {peer} deadlock on their stream: rank {r} runs "
                                 f"{mine[0] if mine else []} while rank {peer} runs {theirs[0] if theirs else []}")
            for queue in (mine, theirs):
                queue[0] = [x for x in queue[0] if x not in running]
                if not queue[0]:
                    queue.pop(0)


def _transfer(ranks: int, r: int, a: Action) -> tuple:
    """A transfer's name, the same at both its ends: (sending rank, its send action)."""
    if a.kind in SENDS:
        return r, a
    return route(ranks, r, a)


def simulate(table: Sequence[Sequence[Action]],
             costs: dict[str, int] | None = None) -> list[list[tuple[int, Action]]]:
    """Replay ``table``: each stage's compute actions with their start times (unit time each). Raises if an
    action repeats or is missing, a send has no receive (or the other way round), or the stages deadlock.

    The replay follows the executor's rules: sends are asynchronous, receives wait, transfers are free,
    and a forward or a backward takes ``costs`` time steps (one each by default). With chunks
    (``build_interleaved``), rank r's chunk c is virtual stage ``c * ranks + r``, and transfers go between
    consecutive virtual stages.

    Args:
        table: per stage (rank), its actions in order, as ``build`` makes them.
        costs: the time steps of ``"F"``, ``"B"`` and ``"W"`` (default one each; those not given take one).

    Returns:
        Per stage, its ``"F"`` and ``"B"`` actions in order, each as ``(start time, action)``.

    Example::

        >>> from tpflow.pipeline.schedule import build, simulate
        >>> [(t, str(a)) for t, a in simulate(build("gpipe", stages=2, micro_batches=2))[1]]
        [(1, 'F0'), (2, 'F1'), (3, 'B0'), (4, 'B1')]
    """
    costs = {**UNIT_COSTS, **(costs or {})}
    stages = len(table)
    micro_batches = 1 + max((a.micro_batch for actions in table for a in actions), default=-1)
    chunks = 1 + max((a.chunk for actions in table for a in actions), default=0)
    virtual = stages * chunks
    split = any(a.kind == "W" for actions in table for a in actions)  # backwards split in B and W
    for s, actions in enumerate(table):
        want = sorted(str(a) for c in range(chunks) for i in range(micro_batches)
                      for a in _forward(c * stages + s, virtual, i, c) + _backward(c * stages + s, virtual, i, c)
                      + ([Action("W", i, c)] if split else []))
        if sorted(str(a) for a in actions) != want:
            raise ValueError(f"stage {s} must do each forward, backward and transfer of micro-batches "
                             f"0..{micro_batches - 1} exactly once, got {[str(a) for a in actions]}")
    sent: dict[tuple[str, int, int], int] = {}  # (kind, receiving virtual stage, micro-batch) -> time it is there
    position, clock = [0] * stages, [0] * stages
    timeline: list[list[tuple[int, Action]]] = [[] for _ in range(stages)]
    computed: list[set[Action]] = [set() for _ in range(stages)]
    peer = {"send_act": ("recv_act", 1), "send_grad": ("recv_grad", -1)}
    while any(p < len(actions) for p, actions in zip(position, table)):
        progressed = False
        for s, actions in enumerate(table):
            while position[s] < len(actions):
                a = actions[position[s]]
                at = a.chunk * stages + s  # the virtual stage
                if a.kind in COMPUTE:
                    before = {"B": ("F", "the backward", "forward"),
                              "W": ("B", "the weight gradient (W)", "input gradient (B)")}.get(a.kind)
                    if before and Action(before[0], a.micro_batch, a.chunk) not in computed[s]:
                        raise ValueError(f"stage {s} runs {before[1]} of micro-batch {a.micro_batch} before its "
                                         f"{before[2]}")
                    timeline[s].append((clock[s], a))
                    computed[s].add(a)
                    clock[s] += costs[a.kind]
                elif a.kind in peer:
                    kind, step = peer[a.kind]
                    sent[(kind, at + step, a.micro_batch)] = clock[s]
                elif (a.kind, at, a.micro_batch) in sent:
                    clock[s] = max(clock[s], sent.pop((a.kind, at, a.micro_batch)))
                else:
                    break  # waits for a send that has not happened yet
                position[s] += 1
                progressed = True
        if not progressed:
            waiting = {s: str(table[s][p]) for s, p in enumerate(position) if p < len(table[s])}
            raise ValueError(f"the schedule deadlocks: stages wait on {waiting} with no matching send")
    return timeline


def peak_activations(table: Sequence[Sequence[Action]]) -> list[int]:
    """Per stage (rank), the most forwards whose backward has not run yet at any point of the replay (whose ``W``
    has not, where backwards are split): the activations it holds at its peak, in chunks' (or stages') worth of
    one micro-batch.

    Args:
        table: per stage, its actions in order.

    Returns:
        The peak count for each stage.

    Example::

        >>> from tpflow.pipeline.schedule import build, peak_activations
        >>> peak_activations(build("1f1b", stages=4, micro_batches=8))
        [4, 3, 2, 1]
    """
    last = "W" if any(a.kind == "W" for actions in table for a in actions) else "B"  # what frees them
    peaks = []
    for actions in table:
        live = peak = 0
        for a in actions:
            live += 1 if a.kind == "F" else -1 if a.kind == last else 0
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def render(table: Sequence[Sequence[Action]], costs: dict[str, int] | None = None) -> str:
    """The replay as a grid: a row per stage, a column per time step, ``F3`` / ``B3`` where it computes (``F3.1``
    for chunk 1 of an interleaved table), from the step it starts.

    ``Pipeline.schedule_table`` prints this under a line with the bubble's share of the step.

    Args:
        table: per stage, its actions in order, as ``build`` makes them (replayed by ``simulate``).
        costs: the time steps of ``"F"``, ``"B"`` and ``"W"`` (default one each), as ``simulate`` takes them.

    Returns:
        The grid as text, one line per stage under a header of time steps; ``-`` where an action that takes more
        than one step goes on, ``.`` where a stage idles.

    Example::

        >>> from tpflow.pipeline.schedule import build, render
        >>> print(render(build("1f1b", stages=2, micro_batches=3)))
        step      0  1  2  3  4  5  6  7
        stage 0  F0 F1  . B0 F2 B1  . B2
        stage 1   . F0 B0 F1 B1 F2 B2  .
    """
    costs = {**UNIT_COSTS, **(costs or {})}
    timeline = simulate(table, costs)
    steps = max((t + costs[a.kind] for row in timeline for t, a in row), default=0)
    cells = [["."] * steps for _ in timeline]
    for s, row in enumerate(timeline):
        for t, a in row:
            cells[s][t:t + costs[a.kind]] = [str(a)] + ["-"] * (costs[a.kind] - 1)  # "-": still computing
    width = max((len(c) for row in cells for c in row), default=1)
    lines = ["step     " + " ".join(f"{t:>{width}}" for t in range(steps))]
    lines += [f"stage {s:<2} " + " ".join(f"{c:>{width}}" for c in row) for s, row in enumerate(cells)]
    return "\n".join(lines)
