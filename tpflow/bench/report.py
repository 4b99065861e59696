"""The harness's outputs: a progress bar and a table on the terminal (rich, when installed), and the rows
as JSON, CSV and a Markdown table in the results folder, each naming the device and the command."""

from __future__ import annotations

import csv
import datetime
import json
import pathlib
import re

__all__ = ["COLUMNS", "Progress", "markdown", "markdown_table", "show", "write"]

try:
    import rich.console
    import rich.progress
    import rich.table
except ImportError:  # the GPU machines have no rich: plain text there
    rich = None

# header, how a row's values print
COLUMNS = {
    "mode": lambda r: r["mode"],
    "step ms (p20-p80)": lambda r: f"{r['step_ms']:.1f} ({r['step_ms_p20']:.1f}-{r['step_ms_p80']:.1f})",
    "samples/s": lambda r: f"{r['samples_per_s']:,.0f}",
    "vs one device": lambda r: f"{r['speedup']:.2f}x",
    "peak MiB/rank": lambda r: f"{r['peak_bytes'] / 2**20:.1f}",
    "params MiB/rank": lambda r: f"{r['param_bytes'] / 2**20:.2f}",
    "sent KiB/rank": lambda r: f"{r['sent_bytes'] / 2**10:,.0f}",
    "minimum KiB": lambda r: f"{r['minimum_bytes'] / 2**10:,.0f}",
    "loss vs one device": lambda r: f"{r['loss_rel_diff']:.1e}",
}


def _cells(row: dict) -> list[str]:
    if row.get("skipped"):
        return [row["mode"], f"skipped: {row['skipped']}", *[""] * (len(COLUMNS) - 2)]
    return [fmt(row) for fmt in COLUMNS.values()]


def _by_workload(rows: list[dict], meta: dict):
    """(title, rows) per workload."""
    for workload, described in zip(dict.fromkeys(r["workload"] for r in rows), meta["workloads"]):
        title = f"{described} | {meta['world']} ranks, {meta['device']} | {meta['timestamp']}"
        yield title, [r for r in rows if r["workload"] == workload]


class Progress:
    """A bar per workload on rank 0's terminal; nothing elsewhere.

    A context manager around ``rich.progress.Progress`` (transient: the bars go when it exits). Disabled, or
    without rich installed, it does nothing, so every rank makes the same calls: ``add(description, total)``
    starts a bar and returns its task (None when it does nothing), ``advance(task)`` moves that bar one step.

    Args:
        enabled: show the bars; the harness passes ``rank == 0``.

    Example::

        >>> with Progress(enabled=tpf.get_rank() == 0) as progress:     # bars on rank 0's terminal only
        ...     task = progress.add("mlp on 2 ranks", total=24)
        ...     for _ in range(24):
        ...         progress.advance(task)
    """

    def __init__(self, enabled: bool) -> None:
        self.bar = rich.progress.Progress(transient=True) if enabled and rich is not None else None

    def __enter__(self) -> Progress:
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def add(self, description: str, total: int) -> object:
        return None if self.bar is None else self.bar.add_task(description, total=total)

    def advance(self, task: object) -> None:
        if self.bar is not None:
            self.bar.advance(task)


def show(rows: list[dict], meta: dict) -> None:
    """The tables on the terminal.

    A table per workload, titled with its description, the world's size, the device and the time; then the
    command that repeats the run. Drawn with rich where it is installed, else as :func:`markdown`'s lines.

    Args:
        rows: the result rows of every workload: dicts with ``workload`` and the keys ``COLUMNS`` reads, or,
            for a skipped mode, ``workload``, ``mode`` and ``skipped`` (the reason).
        meta: the run's metadata: ``workloads`` (their descriptions, in the rows' order), ``world``,
            ``device``, ``timestamp``, ``command``, ``code`` and ``torch``.

    Example::

        >>> data = json.loads(pathlib.Path("benchmarks/results/bench_AMD-EPYC_w2_2026-11-22_200828.json").read_text())
        >>> import contextlib
        >>> import io
        >>> with contextlib.redirect_stdout(io.StringIO()) as out:
        ...     show(data["rows"], data["meta"])
        >>> out.getvalue().splitlines()[-1]              # after the tables, the command that repeats the run
        'command: python -m tpflow.bench --nproc_per_node 2  (commit 8cf5d8a, torch 2.13.0+cpu)'
    """
    for title, part in _by_workload(rows, meta):
        if rich is None:
            print("\n".join(["", title, *markdown(part)]))
            continue
        table = rich.table.Table(title=title)
        for i, header in enumerate(COLUMNS):
            table.add_column(header, justify="left" if i == 0 else "right")
        for row in part:
            table.add_row(*_cells(row))
        rich.console.Console(width=200).print(table)
    print(f"command: {meta['command']}  ({meta['code']}, torch {meta['torch']})")


def markdown_table(header: list[str], rows: list[list], numbers: bool = False) -> list[str]:
    """A Markdown table's lines; ``numbers`` right-aligns every column but the first.

    Args:
        header: the columns' headers.
        rows: the table's rows, a value per column, each written with ``str``.
        numbers: right-align every column but the first (columns of numbers).

    Returns:
        The header's line, the alignment rule, then a line per row; no newlines.

    Example::

        >>> markdown_table(["mode", "step ms"], [["one device", 1.5], ["data, DDP", 0.9]], numbers=True)
        ['| mode | step ms |', '|---|---:|', '| one device | 1.5 |', '| data, DDP | 0.9 |']
    """
    rule = "|---" + ("|---:" if numbers else "|---") * (len(header) - 1) + "|"
    return ["| " + " | ".join(header) + " |", rule, *("| " + " | ".join(str(v) for v in r) + " |" for r in rows)]


def markdown(rows: list[dict]) -> list[str]:
    """Result rows as a Markdown table under ``COLUMNS``' headers, every column but the mode right-aligned.

    A skipped mode's row gives its name and ``skipped: <reason>``, its other cells empty.

    Args:
        rows: result rows, as for :func:`show`; usually one workload's.

    Returns:
        The table's lines, as :func:`markdown_table` gives them.

    Example::

        >>> markdown([{"mode": "data, DDP", "skipped": "needs 4 ranks"}])[2]
        '| data, DDP | skipped: needs 4 ranks |  |  |  |  |  |  |  |'
    """
    return markdown_table(list(COLUMNS), [_cells(r) for r in rows], numbers=True)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-")


def write(rows: list[dict], meta: dict, out: str) -> dict[str, pathlib.Path]:
    """``bench_<device>_w<W>_<time>.json`` (meta and rows), ``.csv`` (a row per mode, meta repeated) and
    ``.md`` (the tables with their device, date and command).

    The folder is created when missing. ``<device>`` is the device's name with each run of characters other
    than letters and digits made one hyphen, ``<time>`` the run's timestamp as ``YYYY-mm-dd_HHMMSS``. The CSV
    leaves out list values (per-rank bytes, losses) and the meta's nested values (settings, workloads).

    Args:
        rows: the result rows, as for :func:`show`.
        meta: the run's metadata, as for :func:`show`, with ``allocator`` as well; ``timestamp`` in ISO format.
        out: the results folder.

    Returns:
        The files' paths by kind: ``"json"``, ``"csv"`` and ``"table"`` (the Markdown).

    Example::

        >>> import tempfile
        >>> data = json.loads(pathlib.Path("benchmarks/results/bench_AMD-EPYC_w2_2026-11-22_200828.json").read_text())
        >>> folder = tempfile.TemporaryDirectory()          # the harness writes to benchmarks/results
        >>> paths = write(data["rows"], data["meta"], folder.name)
        >>> sorted(paths), paths["json"].name
        (['csv', 'json', 'table'], 'bench_AMD-EPYC_w2_2026-11-22_200828.json')
        >>> folder.cleanup()
    """
    folder = pathlib.Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.fromisoformat(meta["timestamp"]).strftime("%Y-%m-%d_%H%M%S")
    stem = folder / f"bench_{_slug(meta['device'])}_w{meta['world']}_{stamp}"
    paths = {"json": stem.with_suffix(".json"), "csv": stem.with_suffix(".csv"), "table": stem.with_suffix(".md")}
    paths["json"].write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    flat_meta = {k: v for k, v in meta.items() if not isinstance(v, (dict, list))}
    fields = list(dict.fromkeys(k for r in rows for k in r if not isinstance(r[k], list))) + list(flat_meta)
    with paths["csv"].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({**flat_meta, **row})
    lines = [f"# tpflow.bench, {meta['world']} ranks on {meta['device']}", "",
             f"{meta['timestamp']}; tpflow {meta['code']}; torch {meta['torch']}; {meta['allocator']}.",
             f"Command: `{meta['command']}`", "",
             "Step: forward, backward and SGD of an MSE loss (hf: the model's own labels= loss), fp32; time on the "
             "slowest rank, modes interleaved; "
             "'vs one device' is the median of per-step ratios; bytes are every rank's sends counted by tpflow "
             "(the most on any rank) and the minimum for the mode's layout."]
    for title, part in _by_workload(rows, meta):
        lines += ["", f"## {title}", "", *markdown(part)]
    paths["table"].write_text("\n".join(lines) + "\n")
    return paths
