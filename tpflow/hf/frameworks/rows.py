"""The data-parallel rows of a placement: what a framework sees as its processes.

A model ``parallelize`` split over a placement is computed by each row's tensor-parallel ranks together, on the same
batch: to ``Trainer``, TRL and accelerate a row is one process. ``Rows`` says, for this rank, which row it computes
(the frameworks' process index), how many rows there are (their process count), whether it is its row's leader (the
rank at tensor-parallel coordinate 0, which writes what the row's process writes), and the group of ranks that holds
its tensor-parallel coordinate in every row (its *column*: one rank a row, in row order), over which the frameworks'
gathers and reductions run.

``show(placement)`` makes a placement's rows what the frameworks see (``tpflow.hf.frameworks.view`` says how they see
them); ``parallelize`` calls it, so arguments, trainers and accelerators built after it see the rows from the start.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from tpflow.placement import Placement

__all__ = ["Rows", "current", "data_rows", "release", "rows_of", "show"]


@dataclass(frozen=True)
class Rows:
    """This rank's place among a placement's data-parallel rows (``rows_of`` makes it).

    Args:
        row: the row this rank computes (the frameworks' process index).
        rows: how many rows (the frameworks' process count).
        leader: whether this rank is its row's first (tensor-parallel coordinate 0), which writes what the row's
            process writes.
        leaders: each row's leader's global rank, in row order.
        column: the ranks at this rank's tensor-parallel coordinate, one a row, in row order.
        row_group: the ranks of this rank's row (its tensor-parallel group).

    Example::

        >>> rows = rows_of(tpf.placement("cpu", ranks=[[0], [1]]))     # two rows of one rank
        >>> rows.rows, rows.row == tpf.get_rank(), rows.leader, rows.leaders
        (2, True, True, (0, 1))
    """

    row: int
    rows: int
    leader: bool
    leaders: tuple[int, ...]
    column: dist.ProcessGroup
    row_group: dist.ProcessGroup


_COLUMNS: dict[tuple, dict] = {}  # placement's ranks -> {tensor-parallel coordinate: its column's group}
_CURRENT: Rows | None = None


def data_rows(placement: Placement) -> tuple[int, int]:
    """This rank's data-parallel row and the number of rows of ``placement``: its axes but the last (the tensor axis)
    are data axes, flattened in order; a 1-D placement is one row.

    Args:
        placement: the placement a model was parallelized over.

    Returns:
        ``(row, rows)``: the index of the batch this rank reads and how many different batches there are.

    Example::

        >>> tpf.frameworks.data_rows(tpf.placement("cpu", ranks=[0, 1]))                # one row of 2 ranks
        (0, 1)
        >>> tpf.frameworks.data_rows(tpf.placement("cpu", ranks=[[0], [1]]))[1]         # 2 rows of one rank
        2
    """
    return _row_of(placement, dist.get_rank())


def _row_of(placement: Placement, rank: int) -> tuple[int, int]:
    coordinate = placement.coordinate(rank)
    if coordinate is None:
        raise ValueError(f"rank {rank} holds no part of {placement!r}: every rank that trains must be in it")
    row, rows = 0, 1
    for c, n in zip(coordinate[:-1], placement.hierarchy[:-1]):
        row, rows = row * n + c, rows * n
    return row, rows


def rows_of(placement: Placement) -> Rows:
    """The rows of ``placement`` as this rank sees them; the columns' process groups are made on first use, so every
    rank calls it alike (``parallelize`` does, on every rank).

    Args:
        placement: a placement over every rank of the world.

    Returns:
        This rank's ``Rows``.

    Example::

        >>> rows = rows_of(tpf.placement("cpu", ranks=[0, 1]))           # one row of two ranks
        >>> rows.row, rows.rows, rows.leaders, rows.leader == (tpf.get_rank() == 0)
        (0, 1, (0,), True)
    """
    world = dist.get_world_size()
    if sorted(placement.flat_ranks) != list(range(world)):
        raise ValueError(f"the frameworks see a placement's data-parallel rows as their processes, so it must hold "
                         f"every rank of the world: {placement!r} holds {len(placement.flat_ranks)} of {world}")
    rank, tp = dist.get_rank(), placement.hierarchy[-1]
    by_rank = {r: _row_of(placement, r) for r in range(world)}
    columns = [sorted((r for r in range(world) if placement.coordinate(r)[-1] == c), key=lambda r: by_rank[r][0])
               for c in range(tp)]
    if any(column != sorted(column) for column in columns):  # a group orders its ranks: it must be the rows' order
        raise ValueError(f"the data-parallel rows of {placement!r} do not increase with the ranks of each column "
                         f"({columns}): order the data axes so that later rows hold higher ranks")
    key = tuple(placement.flat_ranks), placement.hierarchy
    if key not in _COLUMNS:  # every rank makes every column's group, in one order
        _COLUMNS[key] = {c: dist.new_group(column) for c, column in enumerate(columns)}
    row, rows = by_rank[rank]
    coordinate = placement.coordinate(rank)[-1]
    return Rows(row, rows, coordinate == 0, tuple(columns[0]), _COLUMNS[key][coordinate],
                placement.mesh.get_group(placement.ndim - 1))


def current() -> Rows | None:
    """The rows the frameworks see now, or None (they see the world's processes).

    Returns:
        The ``Rows`` ``show`` last set, or None.

    Example::

        >>> tpf.frameworks.rows.current() is None or tpf.frameworks.rows.current().rows >= 1
        True
    """
    return _CURRENT


def show(placement: Placement) -> Rows | None:
    """Make ``placement``'s rows the processes the frameworks see from now on in this process (what they read of it:
    ``tpflow.hf.frameworks.view``). A placement that does not hold every rank changes nothing.

    Args:
        placement: the placement a model was parallelized over.

    Returns:
        The rows now seen, or None.

    Example::

        >>> rows = show(tpf.placement("cpu", ranks=[0, 1]))               # what parallelize does
        >>> rows.rows
        1
    """
    global _CURRENT
    if not dist.is_initialized() or sorted(placement.flat_ranks) != list(range(dist.get_world_size())):
        return None
    _CURRENT = rows_of(placement)
    return _CURRENT


def release() -> None:
    """The frameworks see the world's processes again (``view.forget`` also resets what they read under the rows).

    Example::

        >>> release()
        >>> tpf.frameworks.rows.current() is None
        True
    """
    global _CURRENT
    _CURRENT = None
