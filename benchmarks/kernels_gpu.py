"""GPU benchmark of tpflow's Triton matmul kernels against torch.matmul (cuBLAS), side by side in one run.

    PYTHONPATH=. python benchmarks/kernels_gpu.py [--dtypes bf16 fp16] [--kernels tiled persistent] [--quick]

Writes ``kernels_<device>_<time>.md`` (and ``.csv``) in ``--out``; without a GPU it stops at once. For each kernel
(the ``matmul`` switch) on square and LLM shapes: TFLOP/s against cuBLAS, the fused bias + GELU
epilogue against torch's matmul + bias + gelu, and the cost of computing one product as 8
row-range launches (the ring collectives' decomposition) against one launch: as launched from
Python, and replayed from a CUDA graph (the GPU's side alone, without the host's launch cost).
Also the host's cost of one launch (many tiny products, synchronised once). Every result is
checked against torch first. Times are medians of ``triton.testing.do_bench`` (and
``do_bench_cudagraph``); the first call of each variant autotunes (compiles every config), outside
the timing.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import pathlib
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

from tpflow import config
from tpflow.bench.report import markdown_table
from tpflow.kernels import matmul
from tpflow.kernels.launcher import KERNELS, kernel_choice

SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (8192, 4096, 4096), (8192, 14336, 4096), (8192, 4096, 14336)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def need_gpu(parser: argparse.ArgumentParser) -> None:
    """End the run with a clear message (exit status 2) where no CUDA GPU is visible, before any work."""
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (torch.cuda.is_available() is False)")


def results_stem(out_dir: str | pathlib.Path, prefix: str) -> pathlib.Path:
    """``out_dir/<prefix>_<GPU name>_<time>`` (the folder made): where a GPU benchmark writes its results files."""
    device = torch.cuda.get_device_name().replace(" ", "-")
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir / f"{prefix}_{device}_{datetime.datetime.now().strftime('%Y-%m-%d_%H%M')}"


def tflops(m: int, n: int, k: int, ms: float) -> float:
    return 2 * m * n * k / ms * 1e-9


def eight_ranges(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """One product as 8 row-range launches into one output, as the rings compute it."""
    m = a.shape[0]
    chunk = triton.cdiv(m, 8)
    for start in range(0, m, chunk):
        matmul(a, b, out=out[start:start + chunk], row_start=start, row_end=min(m, start + chunk))


def measure(kernel: str, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor, t_torch: float,
            t_torch_fused: float) -> dict:
    """One kernel's columns: checked against torch, then timed."""
    config.set(matmul=kernel)
    m, n, k = a.shape[0], b.shape[1], a.shape[1]
    out = torch.empty(m, n, device="cuda", dtype=a.dtype)
    if kernel_choice(a, b, out) != kernel:
        raise RuntimeError(f"{kernel} cannot run a {tuple(a.shape)} @ {tuple(b.shape)} {a.dtype} product here")
    want = torch.matmul(a, b)
    torch.testing.assert_close(matmul(a, b), want, rtol=2e-2, atol=2e-1)
    eight_ranges(a, b, out)
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-1)
    torch.testing.assert_close(matmul(a, b, bias=bias, activation="gelu"),
                               F.gelu(want + bias, approximate="tanh"), rtol=2e-2, atol=2e-1)
    t_one = do_bench(lambda: matmul(a, b))
    t_fused = do_bench(lambda: matmul(a, b, bias=bias, activation="gelu"))
    t_ranges = do_bench(lambda: eight_ranges(a, b, out))
    t_one_graph = do_bench_cudagraph(lambda: matmul(a, b, out=out), return_mode="median")
    t_ranges_graph = do_bench_cudagraph(lambda: eight_ranges(a, b, out), return_mode="median")
    return {f"{kernel}_tflops": round(tflops(m, n, k, t_one), 1),
            f"{kernel}_vs_cublas": round(t_torch / t_one, 3),
            f"{kernel}_bias_gelu_speedup": round(t_torch_fused / t_fused, 3),
            f"{kernel}_8_ranges_vs_1": round(t_ranges / t_one, 3),
            f"{kernel}_8_ranges_vs_1_graph": round(t_ranges_graph / t_one_graph, 3)}


def host_us(launch: Callable[[], object], n: int = 2000) -> float:
    """Microseconds a call takes, launched back to back: ``n`` calls synchronised once (the larger of the host's
    cost and the GPU's), so the host's cost of a launch where the product is tiny."""
    for _ in range(20):
        launch()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        launch()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


def host_costs(kernels: list[str]) -> str:
    """One line: the host's cost of a launch of each kernel and of torch.matmul, on a 128^3 bf16 product."""
    a, b = (torch.randn(128, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(a)
    costs = {"torch.matmul": host_us(lambda: torch.matmul(a, b.mT, out=out))}
    for kernel in kernels:
        config.set(matmul=kernel)
        costs[kernel] = host_us(lambda: matmul(a, b.mT, out=out))
    return ", ".join(f"{name} {us:.1f} us" for name, us in costs.items())


def write(rows: list[dict], host: str, out_dir: pathlib.Path, command: str) -> pathlib.Path:
    device = torch.cuda.get_device_name()
    stem = results_stem(out_dir, "kernels")
    with open(f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    table = "\n".join(markdown_table(list(rows[0]), [list(r.values()) for r in rows], numbers=True)) + "\n"
    pathlib.Path(f"{stem}.md").write_text(
        f"# tpflow.kernels.matmul vs torch.matmul\n\ntorch {torch.__version__}, triton {triton.__version__}, {device}; "
        f"`{command}`.\n"
        "K_vs_cublas = torch time / kernel K's time (>1: K faster). K_bias_gelu_speedup = torch matmul+bias+gelu "
        "time / K's fused time. K_8_ranges_vs_1 = 8 row-range launches / one launch, as launched from Python; "
        "_graph: the same replayed from a CUDA graph. b is nn.Linear's weight read transposed in place.\n\n"
        f"Host cost of one launch (128^3 bf16, 2000 launches): {host}.\n\n" + table)
    return pathlib.Path(f"{stem}.md")


def shape_row(name: str, m: int, n: int, k: int, kernels: list[str]) -> dict:
    """One shape's row: cuBLAS's TFLOP/s, then each kernel's columns (``measure``)."""
    dtype = DTYPES[name]
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(n, k, device="cuda", dtype=dtype).mT  # nn.Linear's layout, read in place
    bias = torch.randn(n, device="cuda", dtype=dtype)
    t_torch = do_bench(lambda: torch.matmul(a, b))
    t_torch_fused = do_bench(lambda: F.gelu(torch.matmul(a, b) + bias, approximate="tanh"))
    row = {"dtype": name, "M": m, "N": n, "K": k, "cublas_tflops": round(tflops(m, n, k, t_torch), 1)}
    for kernel in kernels:
        row.update(measure(kernel, a, b, bias, t_torch, t_torch_fused))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    parser.add_argument("--quick", action="store_true", help="only the 8192^3 product")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    need_gpu(parser)
    rows = []
    host = host_costs(args.kernels)
    print("host cost of a launch:", host, flush=True)
    for name in args.dtypes:
        for m, n, k in SHAPES[1:2] if args.quick else SHAPES:  # (M, N, K): a [M, K] @ b [K, N]
            rows.append(shape_row(name, m, n, k, args.kernels))
            print(rows[-1], flush=True)
    command = "PYTHONPATH=. python benchmarks/kernels_gpu.py " + " ".join(
        ["--dtypes", *args.dtypes, "--kernels", *args.kernels] + (["--quick"] if args.quick else []))
    print("wrote", write(rows, host, pathlib.Path(args.out), command))


if __name__ == "__main__":
    main()
