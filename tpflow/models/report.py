"""The support matrix as Markdown (``docs/models.md``), and read back from it (what the test suite compares)."""

from __future__ import annotations

import re

from tpflow.models.check import Verdict

__all__ = ["columns", "read_matrix", "read_verdicts", "render"]

_SHORT = {"exact": "exact", "refused": "refused", "failing": "**failing**", "wrong": "**wrong**", "n/a": "n/a",
          "not built": "not built"}
_NAMES = {"tp": "tensor", "cp": "context (ring)", "ep": "expert", "hf": "transformers' tensor"}


def columns(modes: list[str], worlds: list[int]) -> list[tuple[str, int]]:
    """The matrix's columns: each mode at each degree.

    Args:
        modes: the modes (``tpflow.models.check.MODES``).
        worlds: the degrees.

    Returns:
        ``(mode, world)`` pairs, mode by mode.

    Example::

        >>> columns(["tp", "cp"], [2, 4])
        [('tp', 2), ('tp', 4), ('cp', 2), ('cp', 4)]
    """
    return [(mode, world) for mode in modes for world in worlds]


def render(verdicts: dict[tuple[str, str, int], Verdict], kinds: list[str], modes: list[str], worlds: list[int],
           header: str) -> str:
    """The matrix: a summary of counts, a row per model type (each cell a status and, but for exact, a note number),
    and the notes, each reason once.

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
            v = verdicts[kind, mode, world]
            if v.status in ("exact", "n/a") or not v.why:
                cells.append(_SHORT[v.status])
                continue
            number = notes.setdefault(v.why, len(notes) + 1)
            cells.append(f"{_SHORT[v.status]} [{number}](#n{number})")
        rows.append(f"| {kind} | " + " | ".join(cells) + " |")
    titles = [f"{_NAMES.get(mode, mode)}, {world} ranks" for mode, world in cols]
    statuses = ("exact", "refused", "wrong", "failing", "not built", "n/a")
    summary = ["| | " + " | ".join(titles) + " |", "|---" * (len(cols) + 1) + "|"]
    for status in statuses:
        counts = [sum(verdicts[k, m, w].status == status for k in kinds) for m, w in cols]
        if any(counts):
            summary.append(f"| {status} | " + " | ".join(str(c) for c in counts) + " |")
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

        >>> read_verdicts(render({("llama", "tp", 2): Verdict("refused", "why")}, ["llama"], ["tp"], [2], "# M"))
        {('llama', 'tp', 2): Verdict(status='refused', why='why')}
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
            found[kind, mode, world] = Verdict(re.sub(r"\*|\s*\[\d+\]\(#n\d+\)", "", cell),
                                               notes.get(note.group(1), "") if note else "")
    return found
