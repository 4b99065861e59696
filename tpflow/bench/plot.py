"""``python -m tpflow.bench.plot [RESULTS.json ...]``: the harness's rows as a PNG beside the JSON.

Apart from the run so that the GPU machines, which have no matplotlib, need only the JSON. For each
workload: the speed-up of every mode against one device (bars, with the p20-p80 of its per-step ratios
as whiskers), and the bytes the busiest rank sent per step against the minimum for the mode's layout. With no
file named, the newest ``benchmarks/results/bench_*.json``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

__all__ = ["main", "plot"]


def plot(results: pathlib.Path) -> pathlib.Path:
    """Draw one results file of ``python -m tpflow.bench`` as a PNG beside it.

    A row of two panels per workload: the speed-up of every mode against one device (bars: the median of
    its per-step ratios, whiskers: their p20-p80), and the KiB the busiest rank sent per step against the
    minimum for the mode's layout. Skipped modes are left out. Needs matplotlib (drawn with its Agg backend).

    Args:
        results: a ``bench_*.json`` file that ``python -m tpflow.bench`` wrote.

    Returns:
        The PNG's path: ``results`` with the suffix ``.png``.

    Example::

        >>> import shutil
        >>> import tempfile
        >>> folder = tempfile.TemporaryDirectory()         # a copy: the PNG is drawn beside it
        >>> results = shutil.copy("benchmarks/results/bench_AMD-EPYC_w2_2026-11-22_200828.json", folder.name)
        >>> plot(pathlib.Path(results)).name
        'bench_AMD-EPYC_w2_2026-11-22_200828.png'
        >>> folder.cleanup()
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(results.read_text())
    meta, rows = data["meta"], [r for r in data["rows"] if not r.get("skipped")]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(len(workloads), 2, figsize=(13, 0.45 * len(rows) + 2.5), squeeze=False)
    for (speed, traffic), workload, described in zip(axes, workloads, meta["workloads"]):
        part = [r for r in rows if r["workload"] == workload]
        names = [r["mode"] for r in part]
        ys = range(len(part))
        low = [r["speedup"] - r["speedup_p20"] for r in part]  # p20-p80 of the per-step ratios
        high = [r["speedup_p80"] - r["speedup"] for r in part]
        speed.barh(ys, [r["speedup"] for r in part], xerr=[low, high], color="tab:blue")
        speed.axvline(1.0, color="gray", lw=0.8)
        speed.set_yticks(list(ys), names)
        speed.invert_yaxis()
        speed.set_xlabel("speed-up vs one device (median of per-step ratios; whiskers: their p20-p80)")
        speed.set_title(described, fontsize=9, loc="left")
        sent = [r["sent_bytes"] / 2**10 for r in part]
        least = [r["minimum_bytes"] / 2**10 for r in part]
        traffic.barh([y - 0.2 for y in ys], sent, height=0.4, label="sent (counted)", color="tab:orange")
        traffic.barh([y + 0.2 for y in ys], least, height=0.4, label="minimum for the layout", color="tab:gray")
        traffic.set_yticks(list(ys), [""] * len(part))
        traffic.invert_yaxis()
        traffic.set_xlabel("KiB sent per step, busiest rank")
        traffic.legend(fontsize=8)
    fig.suptitle(f"tpflow.bench: {meta['world']} ranks on {meta['device']}, {meta['timestamp']}\n{meta['command']}",
                 fontsize=10)
    fig.tight_layout()
    out = results.with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m tpflow.bench.plot``: plot each results file named, or the newest ``bench_*.json`` in ``--folder``.

    Prints each PNG's path. With no file named, the newest by modification time in ``--folder`` (default
    ``benchmarks/results``); when there is none, argparse's error exits with status 2.

    Args:
        argv: the command line's arguments after the program's name; None for ``sys.argv[1:]``.

    Returns:
        The exit status, 0.

    Example::

        >>> import shutil
        >>> import tempfile
        >>> folder = tempfile.TemporaryDirectory()
        >>> _ = shutil.copy("benchmarks/results/bench_AMD-EPYC_w2_2026-11-22_200828.json", folder.name)
        >>> main(["--folder", folder.name])                # its newest results file  # doctest: +ELLIPSIS
        plot: .../bench_AMD-EPYC_w2_2026-11-22_200828.png
        0
        >>> folder.cleanup()
    """
    p = argparse.ArgumentParser(prog="python -m tpflow.bench.plot", description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="*", type=pathlib.Path, help="JSON files of python -m tpflow.bench")
    p.add_argument("--folder", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    args = p.parse_args(argv)
    files = args.results or sorted(args.folder.glob("bench_*.json"), key=lambda f: f.stat().st_mtime)[-1:]
    if not files:
        p.error(f"no bench_*.json in {args.folder}: run python -m tpflow.bench first")
    for f in files:
        print(f"plot: {plot(f)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
