"""The harness on the terminal: a progress bar per workload, then the tables fitted to its width and their legend
(rich, where it is installed; else plain Markdown lines)."""

from __future__ import annotations

import shutil
from collections.abc import Callable

from tpflow.bench.report import (
    LOSS,
    TERMINAL_STYLE,
    Cell,
    by_workload,
    cells,
    implementation,
    layouts,
    legend,
    markdown,
    run_line,
    skipped_line,
)

__all__ = ["Progress", "show"]

try:
    import rich.box
    import rich.console
    import rich.progress
    import rich.table
except ImportError:  # the GPU machines have no rich: plain text there
    rich = None


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


def _rich_table(title: str, columns: dict[str, Cell], part: list[dict]) -> rich.table.Table:
    table = rich.table.Table(title=title, title_justify="left", box=rich.box.SIMPLE_HEAD, pad_edge=False,
                             show_edge=False, padding=(0, 1, 0, 0))
    for i, header in enumerate(columns):
        table.add_column(header, justify="left" if i == 0 else "right", no_wrap=True)
    for row in part:
        table.add_row(*cells(row, columns), style=TERMINAL_STYLE[implementation(row["mode"])] or None)
    return table


def _fitting(width: int, measure: Callable[[dict[str, Cell], list[dict]], int],
             ran: list[dict]) -> tuple[dict[str, Cell], list[str]]:
    """The widest layout whose table of ``ran`` ``measure`` finds within ``width`` (else the narrowest)."""
    found = list(layouts())
    return next((layout for layout in found if measure(layout[0], ran) <= width), found[-1])


def show(rows: list[dict], meta: dict, width: int | None = None) -> None:
    """The tables on the terminal, within its width, and their legend.

    A line on the run (ranks, device, time), then a table per workload titled with its description, with the
    skipped modes folded into one line under it; then :func:`legend`'s three lines and the command that repeats
    the run. A table too wide for the terminal leaves out or shortens columns (``NARROWER``, the least read first)
    rather than wrapping, and says which. Drawn with rich where it is installed (tpflow's rows in blue, the peers'
    in orange and green), else as :func:`markdown`'s lines.

    Args:
        rows: the result rows of every workload: dicts with ``workload`` and the keys ``COLUMNS`` reads, or,
            for a skipped mode, ``workload``, ``mode`` and ``skipped`` (the reason). Rows without
            ``time_vs_one_device`` get it from :func:`time_ratios`.
        meta: the run's metadata: ``workloads`` (their descriptions, in the rows' order), ``world``,
            ``device``, ``device_type``, ``timestamp``, ``command``, ``code`` and ``torch``.
        width: the columns to fit in; None for the terminal's (``shutil.get_terminal_size``, 80 when not a
            terminal, or the ``COLUMNS`` environment variable).

    Example::

        >>> import json
        >>> import pathlib
        >>> data = json.loads(pathlib.Path("benchmarks/results/bench_AMD-EPYC_w2_2026-11-22_200828.json").read_text())
        >>> import contextlib
        >>> import io
        >>> with contextlib.redirect_stdout(io.StringIO()) as out:
        ...     show(data["rows"], data["meta"], width=100)
        >>> lines = out.getvalue().splitlines()
        >>> max(len(line) for line in lines) <= 100      # fitted: no line wider than the terminal
        True
        >>> lines[-1]                                    # after the tables, the command that repeats the run
        'command: python -m tpflow.bench --nproc_per_node 2  (commit 8cf5d8a, torch 2.13.0+cpu)'
    """
    width = width or shutil.get_terminal_size().columns
    console = rich.console.Console(width=width, highlight=False, soft_wrap=False) if rich is not None else None
    emit = console.print if console is not None else print

    def measure(columns: dict[str, Cell], ran: list[dict]) -> int:  # the table's own width, not the terminal's
        if console is None:
            return max(len(line) for line in markdown(ran, columns))
        return console.measure(_rich_table("", columns, ran), options=console.options.update_width(10**4)).maximum
    emit(run_line(meta))
    changed: list[str] = []
    for title, part in by_workload(rows, meta):
        ran, skipped = [r for r in part if not r.get("skipped")], skipped_line(part)
        columns, now = _fitting(width, measure, ran)
        emit("")
        if console is None:
            print("\n".join([title, *markdown(ran, columns)]))
        else:
            console.print(_rich_table(title, columns, ran))
        changed = now if len(now) > len(changed) else changed
        if LOSS not in columns and ran:  # the column left out: its worst value
            emit(f"loss vs one device: at most {max(r['loss_rel_diff'] for r in ran):.1e} in every mode and step")
        if skipped:
            emit(skipped)
    emit("")
    for line in legend(meta, colors=console is not None, rows=[r for r in rows if not r.get("skipped")]):
        emit(line)
    if changed:
        emit(f"(narrowed to {width} columns, without: {'; '.join(changed)}; the results files have every column)")
    print(f"command: {meta['command']}  ({meta['code']}, torch {meta['torch']})")
