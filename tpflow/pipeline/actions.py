"""The vocabulary of pipeline schedules: an ``Action`` (what a stage's ranks do next, for which micro-batch), a
``Table`` (each rank's actions in order), and how a transfer in one rank's table meets its mirror in another's.

    F / B / W    forward / backward (or the input's gradient, where W computes the weights' apart) of micro-batch i
    recv_act     the input activation of micro-batch i, from the stage before
    send_act     this stage's output activation of micro-batch i, to the stage after
    recv_grad    the gradient of this stage's output for micro-batch i, from the stage after
    send_grad    the gradient of this stage's input for micro-batch i, to the stage before

``tpflow.pipeline.schedule`` builds tables from these, ``tpflow.pipeline.replay`` replays them.
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = [
    "COMPUTE",
    "RECVS",
    "SENDS",
    "UNIT_COSTS",
    "Action",
    "Kind",
    "Table",
    "backward_actions",
    "forward_actions",
    "route",
]


class Kind(str, enum.Enum):
    """What an action does (a ``str``: ``Kind.F == "F"``, so a table reads and compares by the short names).

    Args:
        value: the kind's name: ``"F"``, ``"B"``, ``"W"``, ``"recv_act"``, ``"send_act"``, ``"recv_grad"`` or
            ``"send_grad"``.

    Example::

        >>> Kind("send_act") is Kind.SEND_ACT, Kind.F == "F", str(Kind.RECV_GRAD)
        (True, True, 'recv_grad')
    """

    F = "F"  # forward
    B = "B"  # backward (or the input's gradient alone, where W computes the weights')
    W = "W"  # the weights' gradient, apart from B
    RECV_ACT = "recv_act"
    SEND_ACT = "send_act"
    RECV_GRAD = "recv_grad"
    SEND_GRAD = "send_grad"

    def __str__(self) -> str:
        return self.value

    def __hash__(self) -> int:  # as its name's, which it equals: a table's kinds key dicts either way
        return hash(self.value)


COMPUTE = (Kind.F, Kind.B, Kind.W)
SENDS, RECVS = (Kind.SEND_ACT, Kind.SEND_GRAD), (Kind.RECV_ACT, Kind.RECV_GRAD)
UNIT_COSTS = {Kind.F: 1, Kind.B: 1, Kind.W: 1}


@dataclasses.dataclass(frozen=True)
class Action:
    """One entry of a schedule table: what a stage's ranks do next, for which micro-batch.

    Args:
        kind: a ``Kind``, or its name: ``"F"``, ``"B"``, ``"W"`` (a weight gradient computed apart from ``B``),
            ``"recv_act"``, ``"send_act"``, ``"recv_grad"`` or ``"send_grad"`` (see the module docstring).
        micro_batch: the micro-batch's index, from 0.
        chunk: which of the rank's chunks of the model (its virtual stages, ``build_interleaved``); 0 with one.

    Example::

        >>> from tpflow.pipeline.actions import Action
        >>> a = Action("F", 3)
        >>> str(a), a.kind is Kind.F, a.micro_batch, str(Action("B", 3, chunk=1))
        ('F3', True, 3, 'B3.1')
    """

    kind: Kind
    micro_batch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Kind(self.kind))  # a name is read as its Kind; anything else raises

    def __repr__(self) -> str:
        return f"Action({self.kind.value!r}, {self.micro_batch}" + (f", chunk={self.chunk})" if self.chunk else ")")

    def __str__(self) -> str:
        return f"{self.kind.value}{self.micro_batch}" + (f".{self.chunk}" if self.chunk else "")


Table = list[list[Action]]  # per stage, in order


def forward_actions(stage: int, stages: int, i: int, chunk: int = 0) -> list[Action]:
    """Virtual stage ``stage`` of ``stages``: its forward of micro-batch ``i`` with its transfers.

    Args:
        stage: the virtual stage (``chunk * ranks + rank``).
        stages: how many virtual stages the pipeline has.
        i: the micro-batch.
        chunk: the rank's chunk the virtual stage is (0 without interleaving).

    Returns:
        The receive of the input (not on the first stage), the forward, the send of the output (not on the last).

    Example::

        >>> [str(a) for a in forward_actions(1, 3, i=4)]
        ['recv_act4', 'F4', 'send_act4']
    """
    return ([Action(Kind.RECV_ACT, i, chunk)] if stage > 0 else []) + [Action(Kind.F, i, chunk)] + \
        ([Action(Kind.SEND_ACT, i, chunk)] if stage < stages - 1 else [])


def backward_actions(stage: int, stages: int, i: int, chunk: int = 0) -> list[Action]:
    """Virtual stage ``stage`` of ``stages``: its backward of micro-batch ``i`` with its transfers.

    Args:
        stage, stages, i, chunk: as ``forward_actions`` takes them.

    Returns:
        The receive of the output's gradient (not on the last stage), the backward, the send of the input's
        gradient (not on the first).

    Example::

        >>> [str(a) for a in backward_actions(2, 3, i=0)]
        ['B0', 'send_grad0']
    """
    return ([Action(Kind.RECV_GRAD, i, chunk)] if stage < stages - 1 else []) + [Action(Kind.B, i, chunk)] + \
        ([Action(Kind.SEND_GRAD, i, chunk)] if stage > 0 else [])



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

        >>> from tpflow.pipeline.actions import Action, route
        >>> route(2, 1, Action("send_act", 3)), route(2, 1, Action("send_act", 3, chunk=0))[0]
        ((0, Action('recv_act', 3, chunk=1)), 0)
    """
    k = a.chunk * ranks + rank
    j, kind = {Kind.SEND_ACT: (k + 1, Kind.RECV_ACT), Kind.RECV_ACT: (k - 1, Kind.SEND_ACT),
               Kind.SEND_GRAD: (k - 1, Kind.RECV_GRAD), Kind.RECV_GRAD: (k + 1, Kind.SEND_GRAD)}[a.kind]
    return j % ranks, Action(kind, a.micro_batch, j // ranks)
