"""Ranks that must have been given the same thing, checked: a set-up step whose ranks disagree (another plan, other
micro-batches, other inputs) would hang in a later collective or train on silently wrong numbers.

Each rank describes what it was given as named facts (short strings); one small all-gather per placement axis
compares them, and on a difference every rank raises the same error, naming the first fact that differs and
which ranks hold which value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch.distributed as dist

__all__ = ["agree", "difference"]


def difference(what: str, facts: Sequence[Mapping[str, str]], ranks: Sequence[int]) -> str | None:
    """The first fact the ranks' ``facts`` give differently, said with who gives what (what ``agree`` raises, for
    facts gathered otherwise).

    Args:
        what: who checks, the sentence's first word.
        facts: each rank's facts (name -> a short description), in the order of ``ranks``.
        ranks: the ranks that gave them.

    Returns:
        ``"{what}: the ranks disagree on {name} (rank 0: ...; rank 1: ...)"``, or None if they agree.

    Example::

        >>> difference("optimizer", [{"lr": "0.1"}, {"lr": "0.2"}], [0, 1])
        'optimizer: the ranks disagree on lr (rank 0: 0.1; rank 1: 0.2)'
    """
    keys = list(dict.fromkeys(k for f in facts for k in f))
    for key in keys:
        values = [f.get(key, "(nothing)") for f in facts]
        if len(set(values)) > 1:
            holders: dict[str, list[int]] = {}
            for rank, value in zip(ranks, values):
                holders.setdefault(value, []).append(rank)
            said = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {v}"
                             for v, r in holders.items())
            return f"{what}: the ranks disagree on {key} ({said})"
    return None


def agree(what: str, facts: Mapping[str, str], groups: Sequence[dist.ProcessGroup], fix: str) -> None:
    """Raise the same ``ValueError`` on every rank of ``groups`` unless they were all given the same ``facts``.

    ``groups`` are a placement's axis groups (all of them, in any order): one all-gather of the facts per group,
    each passing on the first difference any group found, so that every rank of the placement reaches the same
    verdict and none goes on to wait for a rank that stopped. Every rank of the placement must call it.

    Args:
        what: who checks (``"parallelize"``), the error's first word.
        facts: name -> a short description of one thing the ranks must share (a plan entry, a placement, a count).
        groups: process groups spanning the ranks, e.g. each axis of a placement's mesh; groups of one rank pass.
        fix: what to do, the error's last sentence.

    Raises:
        ValueError: on every rank, when any two ranks' facts differ: the first fact that differs, each value with
            the ranks that hold it, and ``fix``.

    Example::

        >>> import torch.distributed as dist
        >>> facts = {"micro-batches": "4", "schedule": "1F1B" if tpf.get_rank() == 0 else "GPipe"}
        >>> agree("Pipeline", facts, [dist.group.WORLD], "pass the same arguments on every rank")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
            ...
        ValueError: Pipeline: the ranks disagree on schedule (rank 0: 1F1B; rank 1: GPipe): pass the same ...
    """
    verdict: str | None = None
    for group in groups:
        if group is None or dist.get_world_size(group) == 1:
            continue
        seen: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(seen, (dict(facts), verdict), group=group)
        verdict = next((v for _, v in seen if v), None) or difference(
            what, [f for f, _ in seen], dist.get_process_group_ranks(group))
    if verdict is not None:
        raise ValueError(f"{verdict}: {fix}")
