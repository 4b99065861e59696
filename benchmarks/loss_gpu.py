"""GPU benchmark of tpflow's cross-entropy kernels against torch's (and Liger-Kernel's, where it is installed), one
device, side by side in one run.

    PYTHONPATH=. python benchmarks/loss_gpu.py [--tokens 4096] [--vocab 32000 152064] [--hidden 4096] [--dtype bf16]

Two comparisons per vocabulary, each forward + backward, every result checked against torch's first:

    loss    logits [tokens, V]: F.cross_entropy; tpflow's kernels (tpf.ops.vocab_parallel_cross_entropy on one
            device: the row-stats kernel, then the gradient kernel); Liger's cross-entropy
    fused   hidden [tokens, H] and a head [V, H]: F.linear + F.cross_entropy; tpf.linear_cross_entropy (chunks of
            ``--chunk`` tokens); Liger's fused linear cross-entropy

Time: the median of ``triton.testing.do_bench``; memory: the peak allocated during one forward + backward, less
what was allocated before. Writes ``loss_<device>_<time>.md`` in ``--out``; without a GPU it stops at once.
"""

from __future__ import annotations

import argparse
import pathlib

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

import tpflow as tpf
from benchmarks.kernels_gpu import need_gpu, results_stem
from tpflow.bench.report import markdown_table

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _liger():
    """Liger-Kernel's (cross-entropy, fused linear cross-entropy) callables, or None where it is not installed."""
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss, LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    ce, fused = LigerCrossEntropyLoss(), LigerFusedLinearCrossEntropyLoss()
    return (lambda x, t: ce(x, t)), (lambda h, w, t: fused(w, h, t))


def _run(step, inputs) -> tuple[float, float, float]:
    """(loss, ms, peak MiB) of ``step(*inputs)`` forward + backward."""
    def once():
        for x in inputs:
            x.grad = None
        loss = step(*inputs)
        loss.backward()
        return loss

    loss = once().item()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    once()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return loss, do_bench(once), peak


def vocab_rows(vocab: int, args: argparse.Namespace, liger: tuple | None) -> list[dict]:
    """One vocabulary's rows: each implementation of the loss and of the fused head + loss, checked against torch's
    loss value, then timed."""
    dtype, device = DTYPES[args.dtype], torch.device("cuda")
    torch.manual_seed(0)
    target = torch.randint(0, vocab, (args.tokens,), device=device)
    logits = torch.randn(args.tokens, vocab, device=device, dtype=dtype, requires_grad=True)
    losses = {"torch": lambda x: F.cross_entropy(x.float(), target),
              "tpflow": lambda x: tpf.ops.vocab_parallel_cross_entropy(x, target, start=0, classes=vocab, group=None)}
    if liger is not None:
        losses["liger"] = lambda x: liger[0](x, target)
    hidden = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, requires_grad=True)
    weight = (torch.randn(vocab, args.hidden, device=device, dtype=dtype) / args.hidden**0.5).requires_grad_()
    fused = {"torch": lambda h, w: F.cross_entropy(F.linear(h, w).float(), target),
             "tpflow": lambda h, w: tpf.ops.linear_cross_entropy(h, w, None, target, start=0, classes=vocab,
                                                                 group=None, chunk=args.chunk)}
    if liger is not None:
        fused["liger"] = lambda h, w: liger[1](h, w, target)
    rows = []
    for what, table, inputs in (("loss", losses, (logits,)), ("fused", fused, (hidden, weight))):
        reference = None
        for name, step in table.items():
            loss, ms, peak = _run(step, inputs)
            reference = loss if reference is None else reference
            torch.testing.assert_close(loss, reference, rtol=2e-2, atol=2e-2)
            rows.append({"V": vocab, "what": what, "impl": name, "ms": round(ms, 3), "peak_MiB": round(peak, 1)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 152064])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    need_gpu(parser)
    liger = _liger()
    rows = [row for vocab in args.vocab for row in vocab_rows(vocab, args, liger)]
    for row in rows:
        base = next(r for r in rows if (r["V"], r["what"], r["impl"]) == (row["V"], row["what"], "torch"))
        row["vs_torch"] = round(base["ms"] / row["ms"], 2)
    name = torch.cuda.get_device_name()
    out = pathlib.Path(f"{results_stem(args.out, 'loss')}.md")
    header = list(rows[0])
    out.write_text(f"# Cross-entropy kernels on one GPU\n\ntorch {torch.__version__}, triton {triton.__version__}, "
                   f"{name}, {args.dtype}, {args.tokens} tokens, hidden {args.hidden}, chunk {args.chunk}; "
                   f"Liger-Kernel {'installed' if liger else 'not installed'}.\n"
                   "vs_torch = torch's time / this one's (>1: faster).\n\n"
                   + "\n".join(markdown_table(header, [list(r.values()) for r in rows], numbers=True)) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
