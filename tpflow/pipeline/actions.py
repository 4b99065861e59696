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

__all__ = [
    "COMPUTE",
    "RECVS",
    "SENDS",
    "UNIT_COSTS",
    "Action",
    "Table",
    "backward_actions",
    "forward_actions",
    "route",
]

COMPUTE = ("F", "B", "W")
SENDS, RECVS = ("send_act", "send_grad"), ("recv_act", "recv_grad")
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

        >>> from tpflow.pipeline.actions import Action
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
    return ([Action("recv_act", i, chunk)] if stage > 0 else []) + [Action("F", i, chunk)] + \
        ([Action("send_act", i, chunk)] if stage < stages - 1 else [])


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
    return ([Action("recv_grad", i, chunk)] if stage < stages - 1 else []) + [Action("B", i, chunk)] + \
        ([Action("send_grad", i, chunk)] if stage > 0 else [])



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
        ((0, Action(kind='recv_act', micro_batch=3, chunk=1)), 0)
    """
    k = a.chunk * ranks + rank
    j, kind = {"send_act": (k + 1, "recv_act"), "recv_act": (k - 1, "send_act"),
               "send_grad": (k - 1, "recv_grad"), "recv_grad": (k + 1, "send_grad")}[a.kind]
    return j % ranks, Action(kind, a.micro_batch, j // ranks)
