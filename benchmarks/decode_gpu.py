"""Decode-sized products on one GPU: from how many rows tpflow's Triton matmul beats torch's, and a launch's host cost.

The ``triton_min_rows`` switch sends products of fewer rows to torch's matmul on CUDA (its default, 256, an estimate);
this measures the crossover it stands for, and what a decode-sized launch costs the host.

    PYTHONPATH=. python benchmarks/decode_gpu.py [--k 4096] [--n 4096] [--dtype bf16] [--rows 1 2 4 ... 1024]
                                                 [--kernels tiled persistent] [--calls 1000] [--rounds 3]

A decode step multiplies a few tokens' activations ``[M, K]`` by a layer's weight (``nn.Linear``'s ``[N, K]``,
read transposed in place). For each row count M, ``tpflow.kernels.matmul`` computes the product on each side of
the switch: on each kernel (``triton_min_rows`` at 0, the ``matmul`` switch naming the kernel) and on its torch
path (``triton_min_rows`` above M: torch.matmul), each checked against torch.matmul first, then timed two ways:

- ``us``: a call's wall time as a decode loop sees it, host included: ``--calls`` calls launched back to back
  from Python, synchronised once (``kernels_gpu.host_us``), so the larger of the host's cost and the GPU's; the
  median of ``--rounds`` rounds, the implementations alternating within each;
- ``gpu_us``: the same call replayed from a CUDA graph (``do_bench_cudagraph``): the GPU's side alone.

The crossover is the smallest M from which a kernel is at least as fast as the torch path at every larger M
measured: the value for ``triton_min_rows``. The smallest M's row is the host cost of a decode-sized launch
(where ``us`` exceeds ``gpu_us``, the call is bound by the host). Writes ``decode_<device>_<time>.md`` in
``--out``; without a GPU it stops at once.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import pathlib
import shlex
import statistics
import sys
from collections.abc import Iterator

import torch
import triton
from triton.testing import do_bench_cudagraph

from benchmarks.kernels_gpu import DTYPES, host_us, need_gpu, results_stem
from tpflow import config
from tpflow.bench.report import markdown_table
from tpflow.kernels import matmul
from tpflow.kernels.launcher import KERNELS, kernel_choice

ROWS = [1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024]


@contextlib.contextmanager
def side(impl: str, rows: int) -> Iterator[None]:
    """``tpflow.kernels.matmul`` of ``rows`` rows on ``impl``: a kernel's name, or ``"torch"`` for the torch path."""
    if impl == "torch":
        with config.override(triton_min_rows=rows + 1):
            yield
    else:
        with config.override(matmul=impl, triton_min_rows=0):
            yield


def row_times(m: int, w: torch.Tensor, impls: list[str], calls: int, rounds: int) -> dict:
    """One row count's columns: every implementation checked against torch.matmul, then timed."""
    a = torch.randn(m, w.shape[1], device="cuda", dtype=w.dtype)
    b = w.mT
    out = torch.empty(m, w.shape[0], device="cuda", dtype=w.dtype)
    want = torch.matmul(a, b)
    call = functools.partial(matmul, a, b, out=out)
    for impl in impls:
        with side(impl, m):
            if impl != "torch" and kernel_choice(a, b, out) != impl:
                raise RuntimeError(f"{impl} cannot run a {tuple(a.shape)} @ {tuple(b.shape)} {a.dtype} product here")
            torch.testing.assert_close(call(), want, rtol=2e-2, atol=2e-1)  # a kernel's first call tunes M's key
    wall: dict[str, list[float]] = {impl: [] for impl in impls}
    for _ in range(rounds):
        for impl in impls:
            with side(impl, m):
                wall[impl].append(host_us(call, calls))
    row: dict[str, object] = {"M": m}
    for impl in impls:
        with side(impl, m):
            gpu = do_bench_cudagraph(call, return_mode="median") * 1e3
        row[f"{impl}_us"], row[f"{impl}_gpu_us"] = round(statistics.median(wall[impl]), 1), round(gpu, 1)
        if impl != "torch":
            row[f"{impl}_vs_torch"] = round(row["torch_us"] / row[f"{impl}_us"], 3)
    return row


def crossover(rows: list[dict], kernel: str) -> int | None:
    """The smallest M from which ``kernel`` is at least as fast as the torch path at every larger M of ``rows``
    (sorted by M); None where it loses at the largest."""
    found = None
    for row in reversed(rows):
        if row[f"{kernel}_us"] > row["torch_us"]:
            break
        found = row["M"]
    return found


def summary(rows: list[dict], kernels: list[str], default: str) -> str:
    """Two paragraphs: each kernel's crossover, and what the smallest M's call costs on each side."""
    found = {kernel: crossover(rows, kernel) for kernel in kernels}
    none = f"none up to {rows[-1]['M']}"
    crossings = ", ".join(f"{kernel} {none if m is None else m}" for kernel, m in found.items())
    first = rows[0]
    costs = ", ".join(f"{impl} {first[f'{impl}_us']} us a call (GPU alone {first[f'{impl}_gpu_us']})"
                      for impl in ["torch", *kernels])
    return (f"Crossover (the smallest M from which the kernel is at least as fast as the torch path at every larger M "
            f"measured): {crossings}. This device's kernel for these products: {default}; the triton_min_rows switch "
            f"is {config.get('triton_min_rows', 'cuda')} on CUDA.\n\n"
            f"A decode-sized launch (M = {first['M']}): {costs}.\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4096, help="the activations' width (the weight's in_features)")
    parser.add_argument("--n", type=int, default=4096, help="the output's width (the weight's out_features)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--rows", type=int, nargs="+", default=ROWS, help="the row counts M")
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    parser.add_argument("--calls", type=int, default=1000, help="calls a round, synchronised once")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    need_gpu(parser)
    torch.manual_seed(0)
    w = torch.randn(args.n, args.k, device="cuda", dtype=DTYPES[args.dtype])
    rows = []
    for m in sorted(set(args.rows)):
        rows.append(row_times(m, w, ["torch", *args.kernels], args.calls, args.rounds))
        print(rows[-1], flush=True)
    a = torch.empty(rows[-1]["M"], args.k, device="cuda", dtype=w.dtype)
    default = kernel_choice(a, w.mT, torch.empty(a.shape[0], args.n, device="cuda", dtype=w.dtype))
    device = torch.cuda.get_device_name()
    out = pathlib.Path(f"{results_stem(args.out, 'decode')}.md")
    out.write_text(
        f"# Decode-sized products: tpflow's kernels against the torch path by row count\n\ntorch {torch.__version__}, "
        f"triton {triton.__version__}, {device}; `{shlex.join(['PYTHONPATH=.', 'python', *sys.argv])}`.\n"
        f"a [M, {args.k}] @ nn.Linear's weight [{args.n}, {args.k}] read transposed, {args.dtype}, through "
        "tpflow.kernels.matmul: K_us on kernel K (triton_min_rows 0), torch_us on its torch path (torch.matmul). "
        f"us: wall time a call, {args.calls} calls launched from Python and synchronised once (host included), "
        f"median of {args.rounds} alternating rounds; gpu_us: the call replayed from a CUDA graph (the GPU alone). "
        "K_vs_torch = torch_us / K_us (>1: K faster).\n\n"
        + "\n".join(markdown_table(list(rows[0]), [list(r.values()) for r in rows], numbers=True)) + "\n\n"
        + summary(rows, args.kernels, default))
    print(out.read_text())


if __name__ == "__main__":
    main()
