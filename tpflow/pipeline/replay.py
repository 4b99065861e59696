"""Schedule tables replayed before any rank runs them, so that a table that would deadlock, or whose sends and
receives do not pair up, fails here rather than on the ranks.

    simulate          the executor's rules: sends asynchronous, receives wait, transfers free, unit time per
                      compute action (or given costs); each stage's compute with its start times
    check_streams     NCCL's rules: a rank's transfers to one peer in order on one stream, a send done only once
                      the matching receive runs; pairs (a send and the receive after it as one group) make
                      GPipe, 1F1B and ZB-H1 safe
    peak_activations  the most micro-batches' activations each stage holds
    render            the replay as a step-by-stage grid
"""

from __future__ import annotations

from collections.abc import Sequence

from tpflow.pipeline.actions import (
    COMPUTE,
    RECVS,
    SENDS,
    UNIT_COSTS,
    Action,
    Kind,
    backward_actions,
    forward_actions,
    route,
)

__all__ = ["check_streams", "pairs", "peak_activations", "render", "simulate"]


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

        >>> from tpflow.pipeline.replay import pairs
        >>> from tpflow.pipeline.schedule import build
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

        >>> from tpflow.pipeline.replay import check_streams
        >>> from tpflow.pipeline.schedule import build
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

        >>> from tpflow.pipeline.replay import simulate
        >>> from tpflow.pipeline.schedule import build
        >>> [(t, str(a)) for t, a in simulate(build("gpipe", stages=2, micro_batches=2))[1]]
        [(1, 'F0'), (2, 'F1'), (3, 'B0'), (4, 'B1')]
    """
    costs = {**UNIT_COSTS, **(costs or {})}
    stages = len(table)
    micro_batches = 1 + max((a.micro_batch for actions in table for a in actions), default=-1)
    chunks = 1 + max((a.chunk for actions in table for a in actions), default=0)
    virtual = stages * chunks
    split = any(a.kind is Kind.W for actions in table for a in actions)  # backwards split in B and W
    for s, actions in enumerate(table):
        want = sorted(str(a) for c in range(chunks) for i in range(micro_batches)
                      for a in forward_actions(c * stages + s, virtual, i, c)
                      + backward_actions(c * stages + s, virtual, i, c) + ([Action(Kind.W, i, c)] if split else []))
        if sorted(str(a) for a in actions) != want:
            raise ValueError(f"stage {s} must do each forward, backward and transfer of micro-batches "
                             f"0..{micro_batches - 1} exactly once, got {[str(a) for a in actions]}")
    sent: dict[tuple[Kind, int, int], int] = {}  # (kind, receiving virtual stage, micro-batch) -> time it is there
    position, clock = [0] * stages, [0] * stages
    timeline: list[list[tuple[int, Action]]] = [[] for _ in range(stages)]
    computed: list[set[Action]] = [set() for _ in range(stages)]
    peer = {Kind.SEND_ACT: (Kind.RECV_ACT, 1), Kind.SEND_GRAD: (Kind.RECV_GRAD, -1)}
    while any(p < len(actions) for p, actions in zip(position, table)):
        progressed = False
        for s, actions in enumerate(table):
            while position[s] < len(actions):
                a = actions[position[s]]
                at = a.chunk * stages + s  # the virtual stage
                if a.kind in COMPUTE:
                    before = {Kind.B: (Kind.F, "the backward", "forward"),
                              Kind.W: (Kind.B, "the weight gradient (W)", "input gradient (B)")}.get(a.kind)
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

        >>> from tpflow.pipeline.replay import peak_activations
        >>> from tpflow.pipeline.schedule import build
        >>> peak_activations(build("1f1b", stages=4, micro_batches=8))
        [4, 3, 2, 1]
    """
    last = Kind.W if any(a.kind is Kind.W for actions in table for a in actions) else Kind.B  # what frees them
    peaks = []
    for actions in table:
        live = peak = 0
        for a in actions:
            live += 1 if a.kind is Kind.F else -1 if a.kind is last else 0
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

        >>> from tpflow.pipeline.replay import render
        >>> from tpflow.pipeline.schedule import build
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
