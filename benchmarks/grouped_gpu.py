"""GPU benchmark of tpflow's grouped GEMM (the experts' products) against torch's grouped_mm and a loop of
torch.matmul, forward + backward, one device, side by side in one run.

    PYTHONPATH=. python benchmarks/grouped_gpu.py [--experts 8 32 128] [--rows 16384] [--hidden 2048]
                                                  [--intermediate 768] [--skew 1.0] [--dtype bf16]

Rows are routed (token, expert) pairs sorted by expert (16384: 2048 tokens at top-8), shared out by a Zipf law
(expert of rank r gets a share 1 / r^skew, the ranks shuffled): a few experts hold most rows. Weights are stored as
transformers stores them, ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, and read through ``.mT``. Two
comparisons per expert count, each forward + both gradients (input and weights):

    gemm   x [rows, H] @ gate_up: one grouped product
    mlp    the expert MLP: gate_up, silu(gate) * up, down (tpflow: the gated epilogue fused into the first product)

Implementations: ``tpflow.kernels.grouped_mm``; ``torch.nn.functional.grouped_mm`` (``torch._grouped_mm`` before
it); a loop of torch.matmul over the experts after one host read of the offsets (``grouped_mm_ref``, what
transformers falls back to). Each is checked against torch's first (relative error of every result under 1e-2),
then timed (the median of ``triton.testing.do_bench``; the first call autotunes, outside the timing). Writes
``grouped_<device>_<time>.md`` in ``--out``; without a GPU it stops at once. ``--check-only`` runs the checks alone
and writes nothing, also on CPU through Triton's interpreter (``TRITON_INTERPRET=1 TPFLOW_KERNELS=triton``, fp32,
tiny sizes).
"""

from __future__ import annotations

import argparse
import pathlib
import shlex
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from benchmarks.kernels_gpu import need_gpu, results_stem
from tpflow.bench.report import markdown_table
from tpflow.kernels import grouped_mm, grouped_mm_ref

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TORCH_GROUPED = getattr(F, "grouped_mm", None) or torch._grouped_mm
PRODUCTS = {"tpflow": grouped_mm, "torch": lambda x, w, offs: TORCH_GROUPED(x, w, offs=offs), "loop": grouped_mm_ref}


def zipf_counts(rows: int, experts: int, skew: float, seed: int = 0) -> torch.Tensor:
    """Rows per expert: expert of rank r gets ``rows / r^skew`` (normalised, floored, the remainder to the largest),
    the ranks shuffled over the experts."""
    g = torch.Generator().manual_seed(seed)
    share = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** skew
    share = share[torch.randperm(experts, generator=g)]
    counts = (share / share.sum() * rows).floor().long()
    counts[share.argmax()] += rows - counts.sum()
    return counts


def steps(impl: str) -> dict[str, Callable]:
    """``what -> f(x, gate_up, down, offs)`` for one implementation: the products of a comparison."""
    product = PRODUCTS[impl]

    def mlp(x, gate_up, down, offs):
        if impl == "tpflow":
            h = grouped_mm(x, gate_up.mT, offs, activation="silu", gated=True)
        else:
            gate, up = product(x, gate_up.mT, offs).chunk(2, -1)
            h = F.silu(gate) * up
        return product(h, down.mT, offs)

    return {"gemm": lambda x, gate_up, down, offs: product(x, gate_up.mT, offs), "mlp": mlp}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def experts_rows(experts: int, args: argparse.Namespace, device: torch.device) -> list[dict]:
    """One expert count's rows: each implementation of each comparison, checked against torch's, then timed."""
    dtype = DTYPES[args.dtype]
    counts = zipf_counts(args.rows, experts, args.skew)
    offs = counts.cumsum(0).to(device=device, dtype=torch.int32)
    torch.manual_seed(0)
    h, i = args.hidden, args.intermediate
    x = torch.randn(args.rows, h, device=device, dtype=dtype, requires_grad=True)
    gate_up = (torch.randn(experts, 2 * i, h, device=device, dtype=dtype) / h**0.5).requires_grad_()
    down = (torch.randn(experts, h, i, device=device, dtype=dtype) / i**0.5).requires_grad_()
    inputs = (x, gate_up, down)
    rows = []
    for what in ("gemm", "mlp"):
        flops = 3 * 2 * args.rows * h * 2 * i * (1 if what == "gemm" else 1.5)  # forward, input and weight gradients
        dy = torch.randn(args.rows, 2 * i if what == "gemm" else h, device=device, dtype=dtype)
        want = None
        for impl in PRODUCTS:
            step = steps(impl)[what]

            def run(step=step, dy=dy):
                out = step(x, gate_up, down, offs)
                return (out, *torch.autograd.grad(out, inputs, dy, allow_unused=True))  # gemm: no down

            got = run()
            want = got if want is None else want
            for name, g, w in zip(("out", "dx", "dgate_up", "ddown"), got, want):
                if g is not None and relative_error(g, w) > 1e-2:
                    raise RuntimeError(f"{impl} {what}, {experts} experts: {name} is {relative_error(g, w):.3g} "
                                       "away from torch's (relative)")
            if args.check_only:
                continue
            ms = do_bench(run, return_mode="median")
            rows.append({"E": experts, "what": what, "impl": impl, "ms": round(ms, 3),
                         "TFLOP/s": round(flops / ms * 1e-9, 1)})
        print(f"{experts} experts ({counts.max().item()} to {counts.min().item()} rows each), {what}: checked",
              flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--rows", type=int, default=16384, help="routed (token, expert) pairs")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--skew", type=float, default=1.0, help="the Zipf exponent of the rows per expert")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--check-only", action="store_true", help="check every result, time nothing, write nothing")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if not args.check_only:
        need_gpu(parser)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = [row for experts in args.experts for row in experts_rows(experts, args, device)]
    if args.check_only:
        return
    for row in rows:
        base = next(r for r in rows if (r["E"], r["what"], r["impl"]) == (row["E"], row["what"], "torch"))
        row["time_vs_torch"] = round(row["ms"] / base["ms"], 2)
    name = torch.cuda.get_device_name()
    out = pathlib.Path(f"{results_stem(args.out, 'grouped')}.md")
    command = "PYTHONPATH=. python " + shlex.join(sys.argv)
    out.write_text(
        f"# The experts' grouped GEMM on one GPU\n\ntorch {torch.__version__}, triton {triton.__version__}, {name}, "
        f"{args.dtype}; `{command}`.\n{args.rows} rows shared out by a Zipf law of exponent {args.skew}, hidden "
        f"{args.hidden}, intermediate {args.intermediate}. Forward + input and weight gradients; torch is "
        f"{TORCH_GROUPED.__module__}.{TORCH_GROUPED.__name__}, loop is torch.matmul per expert. "
        "time_vs_torch = this one's time / torch's (below 1: faster).\n\n"
        + "\n".join(markdown_table(list(rows[0]), [list(r.values()) for r in rows], numbers=True)) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
