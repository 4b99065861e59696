"""What the harness's tables say, whatever shows them: the columns and how a row's values print, the time ratios, the
legend, the skipped modes' line and the tables as Markdown. ``tpflow.bench.terminal`` draws them on the terminal,
``tpflow.bench.results`` writes them to the results folder.

One ratio everywhere (the terminal, the files, the plot): a mode's time against one device's is its median step
time over one device's median step time, so below 1 is faster and the ratio agrees with the medians beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

__all__ = ["COLUMNS", "NARROWER", "implementation", "legend", "markdown", "markdown_table", "memory_table",
           "skipped_line", "time_ratios"]

Cell = Callable[[dict], str]


def _step(r: dict) -> str:
    return f"{r['step_ms']:.1f} ({r['step_ms_p20']:.1f}-{r['step_ms_p80']:.1f})"


def _peak(r: dict) -> str:
    return f"{r['peak_bytes'] / 2**20:.1f} ({r['param_bytes'] / 2**20:.1f})"


def _sent(r: dict) -> str:
    return f"{r['sent_bytes'] / 2**10:,.0f} ({r['minimum_bytes'] / 2**10:,.0f})"


LOSS = "loss vs\none device"

# header (a line break where the terminal may fold it; the Markdown joins the lines): how a row's values print
COLUMNS: dict[str, Cell] = {
    "mode": lambda r: r["mode"],
    "step ms\n(p20-p80)": _step,
    "time vs\none device\n(<1 faster)": lambda r: f"{r['time_vs_one_device']:.2f}x",
    "peak MiB/rank\n(params)": _peak,
    "sent KiB/rank\n(minimum)": _sent,
    LOSS: lambda r: f"{r['loss_rel_diff']:.1e}",
    "samples/s": lambda r: f"{r['samples_per_s']:,.0f}",
}

# while a table is wider than the terminal, in this order: a column left out (None) or made narrower
NARROWER: list[tuple[str, tuple[str, Cell] | None]] = [
    ("samples/s", None),
    ("step ms\n(p20-p80)", ("step ms", lambda r: f"{r['step_ms']:.1f}")),
    ("peak MiB/rank\n(params)", ("peak MiB\nper rank", lambda r: f"{r['peak_bytes'] / 2**20:.1f}")),
    (LOSS, None),  # its worst value then goes under the table
    ("sent KiB/rank\n(minimum)", ("sent KiB\nper rank", lambda r: f"{r['sent_bytes'] / 2**10:,.0f}")),
]

# the implementations of the rows, as the terminal and the plot color them
TERMINAL_STYLE = {"tpflow": "bold bright_blue", "PyTorch": "dark_orange", "transformers": "green3",
                  "one device": ""}


def implementation(mode: str) -> str:
    """Whose parallelism a mode runs: tpflow's, or a peer's that it is measured beside.

    Args:
        mode: a mode's name, as in the rows (``"tensor, torch"``).

    Returns:
        ``"one device"`` (the baseline), ``"PyTorch"`` (DDP, ``parallelize_module``, ``torch.distributed.pipelining``:
        the modes named ``..., torch``), ``"transformers"`` (its own tensor parallelism) or ``"tpflow"``.

    Example::

        >>> [implementation(m) for m in ("tensor, tpflow", "tensor, torch", "data, DDP", "pipeline, 1F1B, torch")]
        ['tpflow', 'PyTorch', 'PyTorch', 'PyTorch']
    """
    if mode == "one device":
        return "one device"
    if mode == "tensor, transformers":
        return "transformers"
    return "PyTorch" if mode == "data, DDP" or mode.endswith(", torch") else "tpflow"


def time_ratios(rows: list[dict]) -> list[dict]:
    """The rows with ``time_vs_one_device``: the mode's median step time over one device's on the same workload.

    The harness writes it into every row it runs; files written before it had none, so it is computed here from
    the medians (``step_ms``) where missing. Skipped rows are returned as they are.

    Args:
        rows: result rows, each with ``workload``, ``mode`` and, unless ``skipped``, ``step_ms``; every workload
            with a ``"one device"`` row.

    Returns:
        New dicts, in the same order.

    Example::

        >>> rows = time_ratios([{"workload": "mlp", "mode": "one device", "step_ms": 50.0},
        ...                     {"workload": "mlp", "mode": "tensor, tpflow", "step_ms": 60.0}])
        >>> [r["time_vs_one_device"] for r in rows]           # below 1 would be faster than one device
        [1.0, 1.2]
    """
    base = {r["workload"]: r["step_ms"] for r in rows if r["mode"] == "one device" and not r.get("skipped")}
    return [r if r.get("skipped") or "time_vs_one_device" in r else
            {**r, "time_vs_one_device": r["step_ms"] / base[r["workload"]]} for r in rows]


def cells(row: dict, columns: dict[str, Cell]) -> list[str]:
    return [fmt(row) for fmt in columns.values()]


def skipped_line(rows: list[dict]) -> str:
    """The skipped modes in one line, grouped by reason, for under a table rather than a row each.

    Args:
        rows: result rows; those with a ``skipped`` reason count, in their order.

    Returns:
        ``"skipped: a / b (reason); c (another reason)"`` (the modes' names have commas of their own), or ``""``
        when no row was skipped.

    Example::

        >>> skipped_line([{"mode": "one device", "skipped": None},
        ...               {"mode": "data x tensor", "skipped": "needs 4 ranks"},
        ...               {"mode": "pipeline x tensor", "skipped": "needs 4 ranks"}])
        'skipped: data x tensor / pipeline x tensor (needs 4 ranks)'
    """
    reasons: dict[str, list[str]] = {}
    for r in rows:
        if r.get("skipped"):
            reasons.setdefault(r["skipped"], []).append(r["mode"])
    return "skipped: " + "; ".join(f"{' / '.join(modes)} ({why})" for why, modes in reasons.items()) if reasons \
        else ""


def by_workload(rows: list[dict], meta: dict) -> Iterator[tuple[str, list[dict]]]:
    """(title, rows, with their time ratios) per workload."""
    rows = time_ratios(rows)
    for workload, described in zip(dict.fromkeys(r["workload"] for r in rows), meta["workloads"]):
        yield described, [r for r in rows if r["workload"] == workload]


def layouts() -> Iterator[tuple[dict[str, Cell], list[str]]]:
    """``COLUMNS``, then ever narrower sets of columns (``NARROWER``), each with what it left out or shortened."""
    columns, changed = dict(COLUMNS), []
    yield columns, changed
    for header, narrower in NARROWER:
        columns = dict(columns)
        if narrower is None:
            del columns[header]
        else:
            columns = {narrower[0] if h == header else h: narrower[1] if h == header else f for h, f in columns.items()}
        changed = [*changed, " ".join(header.split())]
        yield columns, changed


def run_line(meta: dict) -> str:
    steps = meta.get("settings", {}).get("reps")
    steps = f", {steps} timed steps a mode" if steps else ""
    if meta.get("device_type", "cpu") == "cpu":
        cores = f", {meta['cpus']} cores shared" if meta.get("cpus") else ""
        threads = meta.get("threads_per_rank") or 1
        return f"tpflow.bench on {meta['world']} CPU processes (gloo, {threads} thread each{cores}), " \
            f"{meta['device']}{steps}"
    return f"tpflow.bench on {meta['world']} ranks, a GPU each, {meta['device']}{steps}"


def legend(meta: dict, colors: bool = False, rows: list[dict] | None = None) -> list[str]:
    """Three lines to print under the tables: what the columns mean, and what to look at on this device.

    Args:
        meta: the run's metadata, as for :func:`show`; ``device_type``, ``world`` and ``cpus`` (the cores the ranks
            share) pick the last line's advice.
        colors: name the colors the terminal and the plot give tpflow's rows and the peers'.
        rows: the rows shown, to name only the peers among them; None for every peer.

    Returns:
        The three lines, no newlines.

    Example::

        >>> lines = legend({"device_type": "cpu", "world": 2, "cpus": 2})
        >>> lines[0].split(":")[0], len(lines)
        ('time vs one device', 3)
        >>> lines[2].split(":")[0]
        'On 2 CPU processes sharing 2 cores expect about 1x or slower'
    """
    shown = {implementation(r["mode"]) for r in rows} if rows is not None else {"PyTorch", "transformers"}
    named = {"PyTorch": "PyTorch's (orange)" if colors else "PyTorch's (data, DDP and the modes named '..., torch')",
             "transformers": "transformers' (green)" if colors else "transformers' (tensor, transformers)"}
    peers = "tpflow's rows" + (" (blue)" if colors else "") + " beside " + \
        " and ".join(text for who, text in named.items() if who in shown) if shown & set(named) else "tpflow's rows"
    lines = ["time vs one device: the mode's median step time / one device's, below 1 is faster. step ms: the "
             "slowest rank's, median (p20-p80); gaps within that spread are noise.",
             "peak MiB/rank: the most a rank holds during a step (its parameters in brackets). sent KiB/rank: what "
             "the busiest rank sends per step (the layout's minimum). loss: the largest relative gap to one device's "
             "(1e-7: the same training)."]
    if meta.get("device_type", "cpu") == "cpu":
        cores = f" sharing {meta['cpus']} cores" if meta.get("cpus") else " sharing the host's cores"
        lines.append(f"On {meta['world']} CPU processes{cores} expect about 1x or slower: tensor parallelism gains "
                     f"memory per rank here, not speed. Look at peak MiB/rank, and at {peers}.")
    else:
        lines.append(f"Each rank has a GPU of its own: below 1x is a real speed-up. Look at time and peak MiB/rank "
                     f"together, and at {peers}.")
    return lines


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


def markdown(rows: list[dict], columns: dict[str, Cell] | None = None) -> list[str]:
    """Result rows as a Markdown table, every column but the mode right-aligned, the skipped modes in a line under it.

    The headers are ``columns``' with their line breaks made spaces; the skipped modes are grouped by reason
    (``skipped: a / b (reason)``) after an empty line.

    Args:
        rows: result rows, as for :func:`show`, of one workload; each that ran with ``time_vs_one_device``
            (see :func:`time_ratios`).
        columns: headers and how a row's values print; None for ``COLUMNS``.

    Returns:
        The table's lines, as :func:`markdown_table` gives them, then the skipped line where a mode was skipped.

    Example::

        >>> markdown([{"mode": "data x tensor", "skipped": "needs 4 ranks"},
        ...           {"mode": "pipeline x tensor", "skipped": "needs 4 ranks"}], {"mode": COLUMNS["mode"]})
        ['| mode |', '|---|', '', 'skipped: data x tensor / pipeline x tensor (needs 4 ranks)']
    """
    columns = COLUMNS if columns is None else columns
    ran = [r for r in rows if not r.get("skipped")]
    lines = markdown_table([" ".join(h.split()) for h in columns], [cells(r, columns) for r in ran], numbers=True)
    skipped = skipped_line(rows)
    return lines + ["", skipped] if skipped else lines


def memory_table(rows: list[dict]) -> list[str]:
    """A workload's memory per rank split up (the most on any rank, MiB): parameters, their gradients after the
    backward, AdamW's two moments (twice the parameters: the harness steps with SGD, so this is computed), and the
    step's activations and buffers (its peak above its start, less the gradients). Rows without the split (results
    written before it) are left out.

    Args:
        rows: result rows of one workload.

    Returns:
        A line saying what the columns are, then the table's lines (none where no row has the split).

    Example::

        >>> memory_table([{"mode": "one device", "param_bytes": 2**20, "grad_bytes": 2**20, "adamw_bytes": 2**21,
        ...                "activation_bytes": 3 * 2**20}])[2:]
        ['| mode | parameters | gradients | AdamW state | activations and buffers |', '|---|---:|---:|---:|---:|', \
'| one device | 1.0 | 1.0 | 2.0 | 3.0 |']
    """
    split = [r for r in rows if not r.get("skipped") and "grad_bytes" in r]
    if not split:
        return []
    keys = ("param_bytes", "grad_bytes", "adamw_bytes", "activation_bytes")
    return ["Memory per rank, MiB (AdamW state: two moments per parameter, computed; the step itself uses SGD):",
            "", *markdown_table(["mode", "parameters", "gradients", "AdamW state", "activations and buffers"],
                                [[r["mode"], *(f"{r[k] / 2**20:.1f}" for k in keys)] for r in split],
                                numbers=True)]
