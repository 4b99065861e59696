"""The harness's results files: the rows as JSON, CSV and a Markdown page in the results folder, each named by the
device and the run's time, each naming the command."""

from __future__ import annotations

import csv
import datetime
import json
import pathlib
import re

from tpflow.bench.report import by_workload, legend, markdown, memory_table, run_line

__all__ = ["file_slug", "write"]


def file_slug(text: str) -> str:
    """``text`` (a device's name) as a piece of a results file's name: runs of anything but letters and digits become
    one ``-``, so that pages can cite the file by a plain pattern.

    Args:
        text: any text.

    Returns:
        The slug.

    Example::

        >>> file_slug("Intel(R) Xeon(R) Processor @ 2.50GHz")
        'Intel-R-Xeon-R-Processor-2-50GHz'
    """
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-")


def write(rows: list[dict], meta: dict, out: str) -> dict[str, pathlib.Path]:
    """``bench_<device>_w<W>_<time>.json`` (meta and rows), ``.csv`` (a row per mode, meta repeated) and
    ``.md`` (the tables with their device, date, command and legend).

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
    stem = folder / f"bench_{file_slug(meta['device'])}_w{meta['world']}_{stamp}"
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
             f"{run_line(meta)}; tpflow {meta['code']}; torch {meta['torch']}; {meta['allocator']}.", "",
             f"Command: `{meta['command']}`", "",
             "Step: forward, backward and SGD of an MSE loss (hf: the model's own labels= loss), fp32; modes "
             "interleaved step by step, so drift hits all alike. Bytes are every rank's sends counted by tpflow "
             "(torch's collectives included), the most on any rank.", "",
             *(f"- {line}" for line in legend(meta, rows=[r for r in rows if not r.get("skipped")]))]
    for title, part in by_workload(rows, meta):
        lines += ["", f"## {title}", "", *markdown(part), "", *memory_table(part)]
    paths["table"].write_text("\n".join(lines) + "\n")
    return paths
