"""The loss of a vocabulary-parallel head on CPU ranks: peak memory per rank and time, three ways side by side.

    python -m tpflow.launch --nproc_per_node W benchmarks/vocab_cpu.py [--tokens 2048] [--hidden 1024]

For each vocabulary (``--vocab``, default 32,000 and 152,064) a column-parallel head ``[V, H]`` over the W ranks
and ``--tokens`` hidden states (fp32), three losses:

    gathered        the head gathers whole logits onto every rank, then F.cross_entropy (HF's colwise_gather_output)
    vocab-parallel  the head's logits stay split; tpf.cross_entropy (one all-gather of 4 numbers per token)
    fused           tpf.linear_cross_entropy: the head and the loss chunk by chunk (``--chunk`` tokens)

``peak``: the most host memory a rank gains over one forward + backward of the loss (its peak resident set
after ``/proc/self/clear_refs`` reset it, less the set before; blocks of 64 KiB or more are mapped on their own,
so that freed memory leaves the resident set), with the head's weight frozen so that only the
loss's memory counts (logits, softmax, their gradients; the hidden states' gradient); the most on any rank.
``time``: one forward + backward with the weight trained too, the median of ``--reps`` after a warm-up, on the
slowest rank; ratios are to the gathered loss in the same run. Each run is appended to
``benchmarks/results/vocab_<cpu>_<date>.md``.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tpflow as tpf
from benchmarks.collective_cpu import write
from tpflow.bench.measure import every_rank, step_times

METHODS = ("gathered", "vocab-parallel", "fused")


def resident() -> tuple[int, int]:
    """(resident bytes now, the peak since the last reset), from /proc/self/status."""
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return tuple(int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM"))


def reset_peak() -> None:
    """Free memory back to the system first (glibc keeps freed blocks, which a later allocation would reuse unseen),
    then start the peak resident set again from the current one."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set starts again from the current one


def _loss(method: str, head, hidden, target, chunk: int) -> torch.Tensor:
    if method == "gathered":
        return F.cross_entropy(head(hidden), target)
    if method == "vocab-parallel":
        return tpf.cross_entropy(head(hidden), target)
    return tpf.linear_cross_entropy(hidden, head, target, chunk=chunk)


def _kept(method: str, head, hidden, target, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss, and its value kept."""
    loss = _loss(method, head, hidden, target, chunk)
    return loss, loss.detach()


def peak_and_time(step: Callable[[], tuple[torch.Tensor, object]], head: torch.nn.Module, hidden: torch.Tensor,
                  reps: int) -> tuple[float, float, object]:
    """A head's loss measured as the module docstring says: the most host memory any rank gains over one forward +
    backward of ``step`` (which returns the loss and a value to keep) with the head's weight frozen, the median time
    of ``reps`` steps with it trained after a warm-up on the slowest rank, and the measured step's value.

    Args:
        step: computes the loss (from ``hidden``, through ``head``) and a value to keep.
        head: the head, whose weight is frozen for the peak.
        hidden: the head's input, whose gradient is dropped after each step.
        reps: timed steps.

    Returns:
        ``(peak bytes, median seconds, value)``.
    """
    head.weight.requires_grad_(False)
    step()[0].backward()  # warm-up: lazy set-up is not the loss's
    hidden.grad = None
    reset_peak()
    before, _ = resident()
    loss, value = step()
    loss.backward()
    peak = resident()[1] - before
    del loss
    hidden.grad = None
    head.weight.requires_grad_(True)
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        step()[0].backward()
        times.append(time.perf_counter() - start)
        hidden.grad = head.weight.grad = None
    return every_rank([float(peak)]).max().item(), statistics.median(step_times(times[1:])), value


def _heads(vocab: int, hidden: int, P) -> dict:
    torch.manual_seed(0)
    vp = tpf.ColumnParallelLinear(hidden, vocab, bias=False, placement=P, global_output=True)
    gathered = tpf.ColumnParallelLinear(hidden, vocab, bias=False, placement=P, gather_output=True)
    gathered.weight = vp.weight  # the same block of the same matrix
    return {"gathered": gathered, "vocab-parallel": vp, "fused": vp}


def run(args) -> None:
    torch.set_num_threads(1)
    # every block of 64 KiB or more mapped on its own and given back when freed, so the resident set follows the
    # tensors alive (glibc's default raises this threshold as blocks are freed, and keeps later ones in its heap)
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD
    P = tpf.placement("cpu", ranks=list(range(dist.get_world_size())))
    world = dist.get_world_size()
    lines = [f"# Vocabulary-parallel loss: {world} CPU rank(s), {args.tokens} tokens, hidden {args.hidden}, fp32",
             "", f"Command: `python -m tpflow.launch --nproc_per_node {world} benchmarks/vocab_cpu.py --tokens "
             f"{args.tokens} --hidden {args.hidden} --chunk {args.chunk} --reps {args.reps}`", "",
             "| V | loss | peak MiB per rank | vs gathered | time ms | vs gathered | loss equal |",
             "|---|---|---|---|---|---|---|"]
    for vocab in args.vocab:
        heads = _heads(vocab, args.hidden, P)
        gen = torch.Generator().manual_seed(1)
        hidden = torch.randn(args.tokens, args.hidden, generator=gen).requires_grad_()
        target = torch.randint(0, vocab, (args.tokens,), generator=gen)
        results = {}
        for method in METHODS:
            step = functools.partial(_kept, method, heads[method], hidden, target, args.chunk)
            peak, seconds, loss = peak_and_time(step, heads[method], hidden, args.reps)
            results[method] = (peak, seconds, loss.item())
        base_peak, base_time, base_loss = results["gathered"]
        for method, (peak, seconds, value) in results.items():
            lines.append(f"| {vocab:,} | {method} | {peak / 2**20:,.0f} | {peak / base_peak:.3f} | "
                         f"{seconds * 1e3:,.0f} | {seconds / base_time:.2f} | {abs(value - base_loss) < 1e-4} |")
    if dist.get_rank() == 0:
        lines += ["", f"Gathered logits per rank: {args.tokens} x V x 4 bytes = "
                  + ", ".join(f"{args.tokens * v * 4 / 2**20:,.0f} MiB at V = {v:,}" for v in args.vocab) + "."]
        print("\n".join(lines))
        print(f"appended to {write('vocab', lines, args.out)}")


def head_arguments(description: str, vocab: list[int]) -> argparse.Namespace:
    """The command line of a benchmark of a vocabulary head: ``--vocab`` (default ``vocab``), ``--tokens``,
    ``--hidden``, ``--chunk``, ``--reps``, ``--out``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--vocab", type=int, nargs="+", default=vocab)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results")
    return parser.parse_args()


def main() -> None:
    args = head_arguments(__doc__.splitlines()[0], [32000, 152064])
    tpf.init_distributed()
    run(args)


if __name__ == "__main__":
    main()
