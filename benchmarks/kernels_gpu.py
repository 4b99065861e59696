"""GPU benchmark of tpflow's Triton matmul against torch.matmul (cuBLAS), side by side in one run.

    PYTHONPATH=. python benchmarks/kernels_gpu.py [--out benchmarks/results]

Writes ``kernels_<device>_<date>.md`` (and ``.csv``): TFLOP/s of both on square and LLM shapes
in bf16 and fp16, the fused bias + GELU epilogue against torch's matmul + bias + gelu, and the
cost of computing one product as 8 row-range launches (the ring collectives' decomposition).
Times are medians of ``triton.testing.do_bench``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import pathlib

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from tpflow.kernels import matmul

SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (8192, 4096, 4096), (8192, 14336, 4096), (8192, 4096, 14336)]
if os.environ.get("QUICK"):
    SHAPES = SHAPES[1:2]


def tflops(m: int, n: int, k: int, ms: float) -> float:
    return 2 * m * n * k / ms * 1e-9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    device = torch.cuda.get_device_name().replace(" ", "-")
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        for m, n, k in SHAPES:  # (M, N, K): a [M, K] @ b [K, N]
            a = torch.randn(m, k, device="cuda", dtype=dtype)
            w = torch.randn(n, k, device="cuda", dtype=dtype)  # nn.Linear layout; b = w.T read in place
            bias = torch.randn(n, device="cuda", dtype=dtype)
            b = w.mT
            torch.testing.assert_close(matmul(a, b), torch.matmul(a, b), rtol=2e-2, atol=2e-1)
            t_torch = do_bench(lambda: torch.matmul(a, b))
            t_ours = do_bench(lambda: matmul(a, b))
            t_torch_fused = do_bench(lambda: F.gelu(torch.matmul(a, b) + bias, approximate="tanh"))
            t_ours_fused = do_bench(lambda: matmul(a, b, bias=bias, activation="gelu"))
            out = torch.empty(m, n, device="cuda", dtype=dtype)
            chunk = triton.cdiv(m, 8)

            def eight_ranges():
                for start in range(0, m, chunk):
                    matmul(a, b, out=out[start:start + chunk], row_start=start, row_end=min(m, start + chunk))

            t_chunks = do_bench(eight_ranges)
            rows.append(dict(dtype=str(dtype).removeprefix("torch."), M=m, N=n, K=k,
                             torch_tflops=round(tflops(m, n, k, t_torch), 1), tpflow_tflops=round(tflops(m, n, k, t_ours), 1),
                             ratio=round(t_torch / t_ours, 3),
                             fused_bias_gelu_speedup=round(t_torch_fused / t_ours_fused, 3),
                             eight_row_ranges_vs_one=round(t_chunks / t_ours, 3)))
            print(rows[-1], flush=True)
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"kernels_{device}_{datetime.date.today().isoformat()}"
    with open(f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    header = "| " + " | ".join(rows[0]) + " |\n|" + "---|" * len(rows[0]) + "\n"
    table = "".join("| " + " | ".join(str(v) for v in r.values()) + " |\n" for r in rows)
    versions = f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}"
    pathlib.Path(f"{stem}.md").write_text(
        f"# tpflow.kernels.matmul vs torch.matmul\n\n{versions}; `PYTHONPATH=. python benchmarks/kernels_gpu.py`.\n"
        "ratio = torch time / tpflow time (>1: tpflow faster). fused_bias_gelu_speedup = torch matmul+bias+gelu "
        "time / tpflow fused time. eight_row_ranges_vs_one = 8 row-range launches / one launch.\n\n"
        + header + table)


if __name__ == "__main__":
    main()
