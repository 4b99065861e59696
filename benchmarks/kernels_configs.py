"""GPU sweep of the persistent kernel's configs, one config at a time, against torch.matmul (cuBLAS).

    PYTHONPATH=. python benchmarks/kernels_configs.py [--dtype bf16]    # from the repository root

Autotuning keeps only each shape's winner; this shows every candidate on every shape of
``benchmarks/kernels_gpu.py``, which is how the persistent configs of ``tpflow.kernels.tuning`` were
chosen (a config that wins nowhere costs compile and tuning time for nothing). Prints one line per config: its
cuBLAS time / its time on each shape, or the compile error (shared memory) where it does not fit. Without a GPU it
stops at once.
"""

from __future__ import annotations

import argparse
import functools

import torch
import triton
from triton.testing import do_bench

from benchmarks.kernels_gpu import DTYPES, SHAPES, need_gpu
from tpflow import config
from tpflow.kernels import matmul, tuning

# BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, C stored in halves, row tiles a group
CANDIDATES = [
    (128, 256, 64, 3, 8, True, 8), (128, 256, 64, 4, 8, True, 8), (128, 256, 64, 3, 8, False, 8),
    (128, 256, 64, 4, 8, False, 8), (128, 256, 64, 3, 8, True, 16), (128, 256, 64, 3, 8, True, 4),
    (256, 128, 64, 3, 8, True, 8), (256, 128, 64, 4, 8, False, 8), (128, 128, 64, 4, 8, True, 8),
    (128, 128, 128, 3, 8, True, 8), (128, 256, 128, 2, 8, True, 8), (128, 128, 64, 5, 4, False, 8),
    (64, 256, 64, 4, 4, True, 8),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    dtype = DTYPES[parser.parse_args().dtype]
    need_gpu(parser)
    config.set(matmul="persistent")
    operands = []
    for m, n, k in SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(n, k, device="cuda", dtype=dtype).mT  # nn.Linear's layout, read in place
        operands.append((a, b, do_bench(functools.partial(torch.matmul, a, b), warmup=50, rep=200)))
    print("shapes (M, N, K):", *SHAPES)
    for bm, bn, bk, stages, warps, subtile, group in CANDIDATES:
        candidate = triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group, "SUBTILE": subtile},
                                   num_stages=stages, num_warps=warps, pre_hook=tuning.set_blocks)
        line = [f"{bm}x{bn}x{bk} s{stages} w{warps} sub{int(subtile)} g{group}"]
        with tuning.use("persistent", tuning.Tuned("persistent", [candidate])):
            for a, b, t_torch in operands:
                try:
                    torch.testing.assert_close(matmul(a, b), torch.matmul(a, b), rtol=2e-2, atol=2e-1)
                    line.append(round(t_torch / do_bench(functools.partial(matmul, a, b), warmup=50, rep=200), 3))
                except triton.runtime.errors.OutOfResources as e:
                    line.append(f"does not fit: {e}"[:60])
        print(*line, flush=True)


if __name__ == "__main__":
    main()
