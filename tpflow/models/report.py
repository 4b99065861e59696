"""The support matrix as Markdown (``docs/models.md``), and read back from it (what the test suite compares)."""

from __future__ import annotations

import dataclasses
import re

from tpflow.models.check import Verdict
from tpflow.models.shares import SLACK

__all__ = ["columns", "read_matrix", "read_verdicts", "render"]

_SHORT = {"exact": "exact", "refused": "refused", "failing": "**failing**", "wrong": "**wrong**", "n/a": "n/a",
          "not built": "not built"}
_NAMES = {"tp": "tensor", "held": "values held", "cp": "context (ring)", "sp": "context, state passing", "ep": "expert",
          "hf": "transformers' tensor"}


def columns(modes: list[str], worlds: list[int]) -> list[tuple[str, int]]:
    """The matrix's columns: each mode at each degree; after tensor parallelism's, the share of the model's values
    a rank holds under it at each degree (``"held"``).

    Args:
        modes: the modes (``tpflow.models.check.MODES``).
        worlds: the degrees.

    Returns:
        ``(mode, world)`` pairs, mode by mode.

    Example::

        >>> columns(["tp", "cp"], [2, 4])
        [('tp', 2), ('tp', 4), ('held', 2), ('held', 4), ('cp', 2), ('cp', 4)]
    """
    kinds = [kind for mode in modes for kind in ((mode, "held") if mode == "tp" else (mode,))]
    return [(kind, world) for kind in kinds for world in worlds]


def _held(v: Verdict, notes: dict[str, int]) -> str:
    """A share-held cell: the share, in bold with a note saying what stays whole above 1/W + ``SLACK``."""
    if v.share is None:
        return "-"
    if not v.whole:
        return f"{v.share:.2f}"
    number = notes.setdefault(v.whole, len(notes) + 1)
    return f"**{v.share:.2f}** [{number}](#n{number})"


def render(verdicts: dict[tuple[str, str, int], Verdict], kinds: list[str], modes: list[str], worlds: list[int],
           header: str) -> str:
    """The matrix: a summary of counts, a row per model type (each cell a status and, but for exact, a note number;
    each share held under tensor parallelism, with a note saying what stays whole above 1/W + ``SLACK``), and the
    notes, each reason once.

    Args:
        verdicts: ``{(kind, mode, world): Verdict}``.
        kinds: the rows, in order.
        modes, worlds: the columns.
        header: the text above the tables (what was run, when, on which versions).

    Returns:
        The Markdown.

    Example::

        >>> text = render({("llama", "tp", 2): Verdict("exact")}, ["llama"], ["tp"], [2], "# Models")
        >>> "| llama | exact |" in text
        True
    """
    cols = columns(modes, worlds)
    notes: dict[str, int] = {}
    rows = []
    for kind in kinds:
        cells = []
        for mode, world in cols:
            if mode == "held":
                cells.append(_held(verdicts[kind, "tp", world], notes))
                continue
            v = verdicts[kind, mode, world]
            if v.status in ("exact", "n/a") or not v.why:
                cells.append(_SHORT[v.status])
                continue
            number = notes.setdefault(v.why, len(notes) + 1)
            cells.append(f"{_SHORT[v.status]} [{number}](#n{number})")
        rows.append(f"| {kind} | " + " | ".join(cells) + " |")
    def titled(cols: list[tuple[str, int]]) -> list[str]:
        return [f"{_NAMES.get(mode, mode)}, {world} ranks" for mode, world in cols]

    titles = titled(cols)
    statuses = ("exact", "refused", "wrong", "failing", "not built", "n/a")
    checked, held = [c for c in cols if c[0] != "held"], [c for c in cols if c[0] == "held"]
    summary = ["| | " + " | ".join(titled(checked)) + " |", "|---" * (len(checked) + 1) + "|"]
    for status in statuses:
        counts = [sum(verdicts[k, m, w].status == status for k in kinds) for m, w in checked]
        if any(counts):
            summary.append(f"| {status} | " + " | ".join(str(c) for c in counts) + " |")
    if held:  # the types above 1/W + SLACK, each with a note saying what stays whole
        over = [sum(verdicts[k, "tp", w].whole != "" for k in kinds) for _, w in held]
        summary += ["", "| | " + " | ".join(titled(held)) + " |", "|---" * (len(held) + 1) + "|",
                    f"| above 1/W + {SLACK} | " + " | ".join(str(c) for c in over) + " |"]
    table = ["| model type | " + " | ".join(titles) + " |", "|---" * (len(cols) + 1) + "|", *rows]
    listed = [f'{n}. <a id="n{n}"></a>{why.replace("|", "/")}' for why, n in notes.items()]
    return "\n".join([header, "", *summary, "", *table, "", "## Notes", "", *listed, ""])


def read_matrix(text: str) -> dict[tuple[str, str, int], str]:
    """The statuses a rendered matrix holds, ``{(kind, mode, world): status}``.

    Args:
        text: what ``render`` wrote.

    Returns:
        Each cell's status.

    Example::

        >>> read_matrix(render({("llama", "tp", 2): Verdict("refused", "why")}, ["llama"], ["tp"], [2], "# Models"))
        {('llama', 'tp', 2): 'refused'}
    """
    return {key: v.status for key, v in read_verdicts(text).items()}


def read_verdicts(text: str) -> dict[tuple[str, str, int], Verdict]:
    """The verdicts a rendered matrix holds, each with its note: what ``python -m tpflow.models --update`` keeps of
    the rows it does not check again.

    Args:
        text: what ``render`` wrote.

    Returns:
        ``{(kind, mode, world): Verdict}``.

    Example::

        >>> read_verdicts(render({("llama", "tp", 2): Verdict("exact", share=0.9, whole="mixers")}, ["llama"], ["tp"],
        ...                      [2], "# M"))
        {('llama', 'tp', 2): Verdict(status='exact', why='', share=0.9, whole='mixers')}
    """
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| model type |"))
    titles = [t.strip() for t in lines[start].strip("|").split("|")[1:]]
    names = {v: k for k, v in _NAMES.items()}
    cols = []
    for title in titles:
        mode, world = re.fullmatch(r"(.+), (\d+) ranks", title).groups()
        cols.append((names.get(mode, mode), int(world)))
    notes = dict(re.findall(r'^(\d+)\. <a id="n\d+"></a>(.*)$', text, re.M))
    found = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        kind, *cells = [c.strip() for c in line.strip("|").split("|")]
        for (mode, world), cell in zip(cols, cells):
            note = re.search(r"\[(\d+)\]\(#n\d+\)", cell)
            value, noted = re.sub(r"\*|\s*\[\d+\]\(#n\d+\)", "", cell), notes.get(note.group(1), "") if note else ""
            if mode == "held":  # the tensor-parallel verdict's share and what stays whole (its column comes first)
                found[kind, "tp", world] = dataclasses.replace(
                    found[kind, "tp", world], share=None if value == "-" else float(value), whole=noted)
            else:
                found[kind, mode, world] = Verdict(value, noted)
    return found
