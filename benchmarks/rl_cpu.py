"""Log-probabilities and entropies of sampled tokens on a vocabulary-parallel head, on CPU ranks: peak memory per rank
and time, two ways side by side.

    python -m tpflow.launch --nproc_per_node W benchmarks/rl_cpu.py [--vocab 152064] [--tokens 2048] [--hidden 1024]

For each vocabulary (``--vocab``) a column-parallel head ``[V, H]`` over the W ranks and ``--tokens`` hidden states
(fp32), each token's log-probability at temperature 0.7 and each position's entropy, and a policy-gradient loss of
both (``-mean(log p) - 0.01 mean(entropy)``), two ways:

    gathered   the head gathers whole logits onto every rank, then torch's log_softmax, gather and entropy, as code
               written for one device computes them
    tpf.rl     the head's logits stay split; ``tpf.rl.logprobs(..., entropy=True)`` (one all-gather of 4 numbers a
               token, ``--chunk`` tokens of a block at a time)
    fused      no logits kept: ``tpf.rl.linear_logprobs(hidden, head, ...)`` makes ``--chunk`` tokens' block of them at
               a time (in the backward again)

``peak``: the most host memory a rank gains over one forward + backward (the logits and everything computed from
them; the hidden states' gradient), with the head's weight frozen, measured as ``benchmarks/vocab_cpu.py`` measures
it; against the gathered way's, and against this rank's block of the logits (``tokens x V / W x 4`` bytes).
``time``: one forward + backward with the weight trained too, the median of ``--reps`` after a warm-up, on the
slowest rank. Each run is appended to ``benchmarks/results/rl_<cpu>_<date>.md``.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.distributed as dist

import tpflow as tpf
from benchmarks.collective_cpu import write
from benchmarks.vocab_cpu import head_arguments, peak_and_time

TEMPERATURE = 0.7


def _loss(method: str, head, hidden, target, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss, and the tokens' log-probabilities (detached)."""
    if method == "fused":
        logp, entropy = tpf.rl.linear_logprobs(hidden, head, target, temperature=TEMPERATURE, entropy=True,
                                               chunk=chunk)
        return -logp.mean() - 0.01 * entropy.mean(), logp.detach()
    logits = head(hidden)
    if method == "gathered":
        every = torch.log_softmax(logits / TEMPERATURE, -1)
        logp, entropy = every.gather(-1, target[:, None])[:, 0], -(every.exp() * every).sum(-1)
    else:
        logp, entropy = tpf.rl.logprobs(logits, target, temperature=TEMPERATURE, entropy=True, chunk=chunk)
    return -logp.mean() - 0.01 * entropy.mean(), logp.detach()


def run(args) -> None:
    torch.set_num_threads(1)
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: freed blocks leave the resident set
    world = dist.get_world_size()
    P = tpf.placement("cpu", ranks=list(range(world)))
    lines = [f"# Log-probabilities and entropies on a vocabulary-parallel head: {world} CPU rank(s), {args.tokens} "
             f"tokens, hidden {args.hidden}, fp32", "",
             f"Command: `python -m tpflow.launch --nproc_per_node {world} benchmarks/rl_cpu.py --vocab "
             f"{' '.join(map(str, args.vocab))} --tokens {args.tokens} --hidden {args.hidden} --chunk {args.chunk} "
             f"--reps {args.reps}`", "",
             "| V | method | peak MiB per rank | vs gathered | vs the rank's block of logits | time ms | vs gathered | "
             "log-probs equal |", "|---|---|---|---|---|---|---|---|"]
    for vocab in args.vocab:
        torch.manual_seed(0)
        split = tpf.ColumnParallelLinear(args.hidden, vocab, bias=False, placement=P, global_output=True)
        gathered = tpf.ColumnParallelLinear(args.hidden, vocab, bias=False, placement=P, gather_output=True)
        gathered.weight = split.weight  # the same block of the same matrix
        heads = {"gathered": gathered, "tpf.rl": split, "fused": split}
        gen = torch.Generator().manual_seed(1)
        hidden = torch.randn(args.tokens, args.hidden, generator=gen).requires_grad_()
        target = torch.randint(0, vocab, (args.tokens,), generator=gen)
        block = args.tokens * -(-vocab // world) * 4
        results = {method: peak_and_time(functools.partial(_loss, method, head, hidden, target, args.chunk), head,
                                         hidden, args.reps) for method, head in heads.items()}
        base_peak, base_time, base_logp = results["gathered"]
        for method, (peak, seconds, logp) in results.items():
            lines.append(f"| {vocab:,} | {method} | {peak / 2**20:,.0f} | {peak / base_peak:.3f} | "
                         f"{peak / block:.2f} | {seconds * 1e3:,.0f} | {seconds / base_time:.2f} | "
                         f"{torch.allclose(logp, base_logp, rtol=1e-4, atol=1e-4)} |")
    if dist.get_rank() == 0:
        lines += ["", "A rank's block of the logits: " + ", ".join(
            f"{args.tokens} x {-(-v // world):,} x 4 bytes = {args.tokens * -(-v // world) * 4 / 2**20:,.0f} MiB at "
            f"V = {v:,}" for v in args.vocab) + "."]
        print("\n".join(lines))
        print(f"appended to {write('rl', lines, args.out)}")


def main() -> None:
    args = head_arguments(__doc__.splitlines()[0], [152064])
    tpf.init_distributed()
    run(args)


if __name__ == "__main__":
    main()
