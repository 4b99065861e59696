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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["Action", "SCHEDULES", "build", "simulate", "render"]

COMPUTE = ("F", "B")


@dataclasses.dataclass(frozen=True)
class Action:
    """One entry of a schedule table: what a stage's ranks do next, for which micro-batch.

    Args:
        kind: ``"F"``, ``"B"``, ``"recv_act"``, ``"send_act"``, ``"recv_grad"`` or ``"send_grad"`` (see the
            module docstring).
        micro_batch: the micro-batch's index, from 0.

    Example::

        >>> from tpflow.pipeline.schedule import Action
        >>> a = Action("F", 3)
        >>> str(a), a.kind, a.micro_batch
        ('F3', 'F', 3)
    """

    kind: str  # "F", "B", "recv_act", "send_act", "recv_grad", "send_grad"
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}"


Table = list[list[Action]]  # per stage, in order


def _forward(stage: int, stages: int, i: int) -> list[Action]:
    return ([Action("recv_act", i)] if stage > 0 else []) + [Action("F", i)] + \
        ([Action("send_act", i)] if stage < stages - 1 else [])


def _backward(stage: int, stages: int, i: int) -> list[Action]:
    return ([Action("recv_grad", i)] if stage < stages - 1 else []) + [Action("B", i)] + \
        ([Action("send_grad", i)] if stage > 0 else [])


def _gpipe(stage: int, stages: int, micro_batches: int) -> list[Action]:
    return [a for i in range(micro_batches) for a in _forward(stage, stages, i)] + \
        [a for i in range(micro_batches) for a in _backward(stage, stages, i)]


def _one_f_one_b(stage: int, stages: int, micro_batches: int) -> list[Action]:
    warmup = min(stages - stage - 1, micro_batches)
    actions = [a for i in range(warmup) for a in _forward(stage, stages, i)]
    for k in range(micro_batches - warmup):  # steady state: the next forward, then the oldest backward
        actions += _forward(stage, stages, warmup + k) + _backward(stage, stages, k)
    return actions + [a for i in range(micro_batches - warmup, micro_batches) for a in _backward(stage, stages, i)]


SCHEDULES = {"gpipe": _gpipe, "1f1b": _one_f_one_b}


def build(schedule: str, stages: int, micro_batches: int) -> Table:
    """Every stage's actions for one step of ``micro_batches`` through ``stages`` stages.

    The table is checked by ``simulate`` before it is returned, so a schedule that would deadlock fails here.

    Args:
        schedule: ``"gpipe"`` or ``"1f1b"`` (the keys of ``SCHEDULES``).
        stages: the number of stages, at least 1.
        micro_batches: the number of micro-batches in one step, at least 1.

    Returns:
        Per stage, in stage order, the list of its ``Action``s in the order its ranks perform them.

    Example::

        >>> from tpflow.pipeline.schedule import build
        >>> table = build("1f1b", stages=2, micro_batches=2)
        >>> [str(a) for a in table[1]]
        ['recv_act0', 'F0', 'B0', 'send_grad0', 'recv_act1', 'F1', 'B1', 'send_grad1']
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
    if stages < 1 or micro_batches < 1:
        raise ValueError(f"a pipeline needs at least 1 stage and 1 micro-batch, got {stages} and {micro_batches}")
    table = [SCHEDULES[schedule](s, stages, micro_batches) for s in range(stages)]
    simulate(table)
    return table


def simulate(table: Sequence[Sequence[Action]]) -> list[list[tuple[int, Action]]]:
    """Replay ``table``: each stage's compute actions with their start times (unit time each). Raises if an
    action repeats or is missing, a send has no receive (or the other way round), or the stages deadlock.

    The replay follows the executor's rules: sends are asynchronous, receives wait, transfers are free,
    and a forward or a backward takes one time step.

    Args:
        table: per stage, its actions in order, as ``build`` makes them.

    Returns:
        Per stage, its ``"F"`` and ``"B"`` actions in order, each as ``(start time, action)``.

    Example::

        >>> from tpflow.pipeline.schedule import build, simulate
        >>> [(t, str(a)) for t, a in simulate(build("gpipe", stages=2, micro_batches=2))[1]]
        [(1, 'F0'), (2, 'F1'), (3, 'B0'), (4, 'B1')]
    """
    stages = len(table)
    micro_batches = 1 + max((a.micro_batch for actions in table for a in actions), default=-1)
    for s, actions in enumerate(table):
        want = sorted(str(a) for i in range(micro_batches) for a in _forward(s, stages, i) + _backward(s, stages, i))
        if sorted(str(a) for a in actions) != want:
            raise ValueError(f"stage {s} must do each forward, backward and transfer of micro-batches "
                             f"0..{micro_batches - 1} exactly once, got {[str(a) for a in actions]}")
    sent: dict[tuple[str, int, int], int] = {}  # (kind, receiving stage, micro-batch) -> time it is there
    position, clock = [0] * stages, [0] * stages
    timeline: list[list[tuple[int, Action]]] = [[] for _ in range(stages)]
    computed: list[set[Action]] = [set() for _ in range(stages)]
    peer = {"send_act": ("recv_act", 1), "send_grad": ("recv_grad", -1)}
    while any(p < len(actions) for p, actions in zip(position, table)):
        progressed = False
        for s, actions in enumerate(table):
            while position[s] < len(actions):
                a = actions[position[s]]
                if a.kind in COMPUTE:
                    if a.kind == "B" and Action("F", a.micro_batch) not in computed[s]:
                        raise ValueError(f"stage {s} runs the backward of micro-batch {a.micro_batch} before its "
                                         "forward")
                    timeline[s].append((clock[s], a))
                    computed[s].add(a)
                    clock[s] += 1
                elif a.kind in peer:
                    kind, step = peer[a.kind]
                    sent[(kind, s + step, a.micro_batch)] = clock[s]
                elif (a.kind, s, a.micro_batch) in sent:
                    clock[s] = max(clock[s], sent.pop((a.kind, s, a.micro_batch)))
                else:
                    break  # waits for a send that has not happened yet
                position[s] += 1
                progressed = True
        if not progressed:
            waiting = {s: str(table[s][p]) for s, p in enumerate(position) if p < len(table[s])}
            raise ValueError(f"the schedule deadlocks: stages wait on {waiting} with no matching send")
    return timeline


def render(table: Sequence[Sequence[Action]]) -> str:
    """The replay as a grid: a row per stage, a column per time step, ``F3`` / ``B3`` where it computes.

    ``Pipeline.schedule_table`` prints this under a line with the bubble's share of the step.

    Args:
        table: per stage, its actions in order, as ``build`` makes them (replayed by ``simulate``).

    Returns:
        The grid as text, one line per stage under a header of time steps; ``.`` where a stage idles.

    Example::

        >>> from tpflow.pipeline.schedule import build, render
        >>> print(render(build("1f1b", stages=2, micro_batches=3)))
        step      0  1  2  3  4  5  6  7
        stage 0  F0 F1  . B0 F2 B1  . B2
        stage 1   . F0 B0 F1 B1 F2 B2  .
    """
    timeline = simulate(table)
    steps = max((t + 1 for row in timeline for t, _ in row), default=0)
    cells = [["."] * steps for _ in timeline]
    for s, row in enumerate(timeline):
        for t, a in row:
            cells[s][t] = str(a)
    width = max((len(c) for row in cells for c in row), default=1)
    lines = ["step     " + " ".join(f"{t:>{width}}" for t in range(steps))]
    lines += [f"stage {s:<2} " + " ".join(f"{c:>{width}}" for c in row) for s, row in enumerate(cells)]
    return "\n".join(lines)
