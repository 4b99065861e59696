"""The weight stream for an inference engine against ``save_pretrained``, on CPU ranks: time of one sync and the most
host memory a rank gains during it, side by side.

    python -m tpflow.launch --nproc_per_node W benchmarks/rl_weights_cpu.py [--hidden 768] [--layers 6]
        [--vocab 32000] [--bucket-mib 64] [--reps 3]

A Llama of ``--layers`` layers, ``--hidden`` wide (MLP 8/3 x, 12 heads, 4 key/value heads), vocabulary ``--vocab``,
fp32, split over the W ranks (``plan="auto"``), refit three ways:

    save_pretrained    every rank gathers, rank 0 writes the checkpoint (into a temporary folder), as a refit through
                       the disk does
    stream, rank 0     ``tpf.rl.weights(model, bucket_bytes=--bucket-mib)`` consumed on rank 0 (each bucket handed over
                       and dropped, as an engine copies it in), the others gathering alongside
    stream, every rank the same, ``receiver=None``: every rank keeps each bucket (an engine rank beside each)

``extra MiB``: the most host memory any rank gains over one refit (its peak resident set above the one before,
``benchmarks/vocab_cpu.py``'s measure), against a bucket plus the largest parameter. ``time``: the median of ``--reps``
refits after a warm-up, on the slowest rank. Each run is appended to
``benchmarks/results/rl_weights_<cpu>_<date>.md``.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import tpflow as tpf
from benchmarks.collective_cpu import write
from benchmarks.vocab_cpu import reset_peak, resident
from tpflow.bench.measure import every_rank, step_times


def _model(args) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                      intermediate_size=args.hidden * 8 // 3 // 64 * 64, num_attention_heads=12,
                                      num_key_value_heads=4, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _measured(refit, reps: int) -> tuple[float, float]:
    """(the most bytes any rank gained over one refit, the median seconds of ``reps`` after a warm-up)."""
    refit()
    reset_peak()
    before = resident()[0]
    refit()
    peak = resident()[1] - before
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        refit()
        times.append(time.perf_counter() - start)
    return every_rank([float(peak)]).max().item(), statistics.median(step_times(times))


def run(args) -> None:
    torch.set_num_threads(1)
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: freed blocks leave the resident set
    world = dist.get_world_size()
    model = tpf.parallelize(_model(args), placement=tpf.placement("cpu", list(range(world))), plan="auto")
    bucket = args.bucket_mib << 20
    folder = [tempfile.mkdtemp()]
    dist.broadcast_object_list(folder, src=0)
    streams = {"stream, rank 0": tpf.rl.weights(model, bucket_bytes=bucket),
               "stream, every rank": tpf.rl.weights(model, bucket_bytes=bucket, receiver=None)}
    meta = streams["stream, rank 0"].metadata()
    total = sum(m.dtype.itemsize * torch.Size(m.shape).numel() for m in meta)
    largest = max(m.dtype.itemsize * torch.Size(m.shape).numel() for m in meta)
    ways = {"save_pretrained": lambda: model.save_pretrained(folder[0])}
    ways.update({name: (lambda s=s: s.sync(lambda items, last: None)) for name, s in streams.items()})
    results = {name: _measured(refit, args.reps) for name, refit in ways.items()}
    base_peak, base_time = results["save_pretrained"]
    lines = [f"# The weight stream against save_pretrained: {world} CPU rank(s), a Llama of {total / 2**20:,.0f} MiB "
             f"(fp32), buckets of {args.bucket_mib} MiB", "",
             f"Command: `python -m tpflow.launch --nproc_per_node {world} benchmarks/rl_weights_cpu.py --hidden "
             f"{args.hidden} --layers {args.layers} --vocab {args.vocab} --bucket-mib {args.bucket_mib} --reps "
             f"{args.reps}`", "",
             "| way | extra MiB (most, a rank) | vs a bucket + the largest parameter | time ms | vs save_pretrained |",
             "|---|---|---|---|---|"]
    bound = min(bucket, total) + largest
    for name, (peak, seconds) in results.items():
        lines.append(f"| {name} | {peak / 2**20:,.0f} | {peak / bound:.2f} | {seconds * 1e3:,.0f} | "
                     f"{seconds / base_time:.2f} |")
    if dist.get_rank() == 0:
        lines += ["", f"{len(meta)} tensors; the largest {largest / 2**20:,.0f} MiB; a bucket {args.bucket_mib} MiB; "
                      f"save_pretrained's extra {base_peak / 2**20:,.0f} MiB."]
        print("\n".join(lines))
        print(f"appended to {write('rl_weights', lines, args.out)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    tpf.init_distributed()
    run(args)


if __name__ == "__main__":
    main()
