"""``python -m tpflow.bench.plot [RESULTS.json ...]``: the harness's rows as a PNG beside the JSON.

Apart from the run so that the GPU machines, which have no matplotlib, need only the JSON. For each
workload, three panels side by side, a bar per mode colored by whose parallelism it runs (tpflow's, or a
peer's: PyTorch's, transformers'): the step time against one device's (the ratio of the medians, below 1
faster, as in the table), the peak memory per rank (where tensor parallelism wins), and the bytes the
busiest rank sent per step against the minimum for the mode's layout. With no file named, the newest
``benchmarks/results/bench_*.json``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import textwrap

from tpflow.bench.report import implementation, legend, skipped_line, time_ratios

__all__ = ["COLORS", "main", "plot"]

COLORS = {"tpflow": "tab:blue", "PyTorch": "tab:orange", "transformers": "tab:green", "one device": "tab:gray"}
WHO = {"tpflow": "tpflow", "PyTorch": "PyTorch (DDP, parallelize_module, pipelining)",
       "transformers": "transformers' own tensor parallelism", "one device": "one device (the baseline)"}


def _time_panel(ax, part: list[dict], colors: list[str]) -> None:
    ys = range(len(part))
    base = next(r["step_ms"] for r in part if r["mode"] == "one device")
    ratios = [r["time_vs_one_device"] for r in part]
    low = [max(0.0, q - r["step_ms_p20"] / base) for q, r in zip(ratios, part)]  # the mode's p20-p80, same scale
    high = [max(0.0, r["step_ms_p80"] / base - q) for q, r in zip(ratios, part)]
    ax.barh(ys, ratios, xerr=[low, high], color=colors, error_kw=dict(ecolor="0.35", lw=1, capsize=2))
    ax.axvline(1.0, color="0.2", lw=1, ls="--")
    for y, q, r in zip(ys, ratios, part):  # the value past the whisker
        ax.text(max(q, r["step_ms_p80"] / base), y, f"  {q:.2f}x", va="center", ha="left", fontsize=7.5,
                color="0.15")
    ax.set_xlabel("step time / one device's (median; whiskers p20-p80)\n< 1 is faster", fontsize=8.5)
    ax.set_xlim(0, max(r["step_ms_p80"] / base for r in part) * 1.2)


def _memory_panel(ax, part: list[dict], colors: list[str]) -> None:
    ys = list(range(len(part)))
    peak = [r["peak_bytes"] / 2**20 for r in part]
    params = [r["param_bytes"] / 2**20 for r in part]
    ax.barh(ys, peak, color=colors, alpha=0.45, label="peak during a step")
    ax.barh(ys, params, color=colors, height=0.8, label="parameters")
    base = next(p for p, r in zip(peak, part) if r["mode"] == "one device")
    ax.axvline(base, color="0.2", lw=1, ls="--")
    for y, p in zip(ys, peak):
        ax.text(p, y, f" {p:.1f}", va="center", ha="left", fontsize=7.5, color="0.15")
    ax.set_xlim(0, max(peak) * 1.18)
    ax.set_xlabel("MiB per rank: peak during a step (light),\nparameters (solid); dashed: one device", fontsize=8.5)


def _traffic_panel(ax, part: list[dict], colors: list[str]) -> None:
    ys = list(range(len(part)))
    sent = [r["sent_bytes"] / 2**10 for r in part]
    least = [r["minimum_bytes"] / 2**10 for r in part]
    ax.barh(ys, sent, color=colors)
    ax.scatter(least, ys, marker="|", s=180, color="black", zorder=3, label="minimum for the layout")
    for y, s in zip(ys, sent):
        ax.text(s, y, f" {s:,.0f}", va="center", ha="left", fontsize=7.5, color="0.15")
    ax.set_xlim(0, max([*sent, 1.0]) * 1.22)
    ax.set_xlabel("KiB sent per step by the busiest rank\n(black tick: the layout's minimum)", fontsize=8.5)


def plot(results: pathlib.Path) -> pathlib.Path:
    """Draw one results file of ``python -m tpflow.bench`` as a PNG beside it.

    A row of three panels per workload, a bar per mode that ran, colored by whose parallelism it is (``COLORS``:
    tpflow's, PyTorch's, transformers', one device's), with the mode names in the same colors:

    - the step time against one device's: the ratio of the medians (below 1 is faster), whiskers the mode's
      p20-p80 on the same scale; the table's ``time vs one device``;
    - the memory per rank: the peak during a step (parameters, gradients, activations) and the parameters;
    - the KiB the busiest rank sent per step, with the minimum for the mode's layout.

    The skipped modes are named in one line at the foot. Needs matplotlib (drawn with its Agg backend).

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
    from matplotlib.patches import Patch

    data = json.loads(results.read_text())
    meta, every = data["meta"], time_ratios(data["rows"])
    rows = [r for r in every if not r.get("skipped")]
    workloads = list(dict.fromkeys(r["workload"] for r in every))
    heights = [max(2.2, 0.3 * sum(r["workload"] == w for r in rows) + 1.3) for w in workloads]
    fig, axes = plt.subplots(len(workloads), 3, figsize=(15, sum(heights) + 1.2), squeeze=False,
                             gridspec_kw=dict(height_ratios=heights, width_ratios=[1.15, 1, 1]))
    for panels, workload, described in zip(axes, workloads, meta["workloads"]):
        part = [r for r in rows if r["workload"] == workload]
        who = [implementation(r["mode"]) for r in part]
        colors = [COLORS[w] for w in who]
        _time_panel(panels[0], part, colors)
        _memory_panel(panels[1], part, colors)
        _traffic_panel(panels[2], part, colors)
        for i, ax in enumerate(panels):
            ax.set_yticks(range(len(part)), [r["mode"] for r in part] if i == 0 else [""] * len(part))
            ax.set_ylim(len(part) - 0.5, -0.5)
            ax.tick_params(axis="x", labelsize=8)
            ax.grid(axis="x", color="0.9")
            ax.set_axisbelow(True)
            for side in ("top", "right"):
                ax.spines[side].set_visible(False)
        for label, w in zip(panels[0].get_yticklabels(), who):
            label.set_color(COLORS[w] if w != "one device" else "black")
            label.set_fontweight("bold" if w == "tpflow" else "normal")
        panels[0].set_title(described, fontsize=10, loc="left", fontweight="bold")
    shown = [w for w in COLORS if any(implementation(r["mode"]) == w for r in rows)]
    fig.legend([Patch(color=COLORS[w]) for w in shown], [WHO[w] for w in shown], loc="upper center",
               ncol=len(shown), fontsize=9, frameon=False, bbox_to_anchor=(0.5, 1 - 0.3 / fig.get_figheight()))
    where = "CPU processes over gloo" if meta.get("device_type", "cpu") == "cpu" else "GPUs"
    fig.suptitle(f"tpflow.bench: {meta['world']} {where}, {meta['device']}, {meta['timestamp']}   "
                 f"({meta['command']})", fontsize=10.5, y=1 - 0.08 / fig.get_figheight())
    notes = [legend(meta, colors=True, rows=rows)[2],  # what to look at on this device
             *(s for s in dict.fromkeys(skipped_line([r for r in every if r["workload"] == w]) for w in workloads)
               if s)]
    notes = [line for note in notes for line in textwrap.wrap(note, 230)]
    fig.text(0.01, 0.12 / fig.get_figheight(), "\n".join(notes), fontsize=8.5, color="0.25", va="bottom")
    fig.tight_layout(rect=(0, 0.15 * len(notes) / fig.get_figheight() + 0.3 / fig.get_figheight(), 1,
                           1 - 0.6 / fig.get_figheight()))
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
