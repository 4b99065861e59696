"""A Hugging Face model's training step: tpflow's ``plan="auto"`` against transformers' own tensor parallelism
(``from_pretrained(..., tp_plan="auto")``, which needs accelerate), the same checkpoint and batch, side by side.

    python -m tpflow.launch --nproc_per_node 2 benchmarks/hf_peer_cpu.py [--steps 6] [--rounds 3]

A Qwen3 (4 layers, dim 256, 8 heads / 4 key/value heads, vocabulary 2048) is saved to a temporary directory
and loaded by both; each round times ``--steps`` SGD steps of each (batch 4 x 128, the first step of each round
left out), alternating which goes first. Prints the median step times, their ratio and both losses, and writes
the table to benchmarks/results/hf_peer_<cpu>_w<W>_<date>.md.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import tpflow as tpf


def _model_dir() -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    holder = [tempfile.mkdtemp(prefix="tpflow-hf-peer-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    if dist.get_rank() == 0:
        config = AutoConfig.for_model("qwen3", vocab_size=2048, hidden_size=256, intermediate_size=768,
                                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                                      tie_word_embeddings=False)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(holder[0])
    dist.barrier()
    return holder[0]


def _load(kind: str, path: str):
    from transformers import AutoModelForCausalLM

    if kind == "transformers":
        return AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return tpf.parallelize(model, placement=tpf.placement("cpu", ranks=list(range(dist.get_world_size()))),
                           plan="auto")


def _steps(model, ids, steps: int) -> tuple[list[float], float]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times, loss = [], None
    for _ in range(steps + 1):
        dist.barrier()
        start = time.perf_counter()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return times[1:], loss.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = _model_dir()
    ids = torch.randint(0, 2048, (4, 128), generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {"tpflow": [], "transformers": []}
    losses: dict[str, float] = {}
    for r in range(args.rounds):
        for kind in (("tpflow", "transformers") if r % 2 == 0 else ("transformers", "tpflow")):
            model = _load(kind, path)
            t, losses[kind] = _steps(model, ids, args.steps)
            times[kind] += t
            del model
    if dist.get_rank() != 0:
        return
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    lo = {k: min(v) * 1e3 for k, v in times.items()}
    hi = {k: max(v) * 1e3 for k, v in times.items()}
    ratio = med["tpflow"] / med["transformers"]
    cpu = platform.processor() or platform.machine()
    lines = [f"# Hugging Face Qwen3 training step: tpflow plan=\"auto\" vs transformers tp_plan=\"auto\"", "",
             f"`python -m tpflow.launch --nproc_per_node {dist.get_world_size()} benchmarks/hf_peer_cpu.py "
             f"--steps {args.steps} --rounds {args.rounds}`, {dist.get_world_size()} gloo ranks, {cpu}, torch "
             f"{torch.__version__}, {datetime.date.today()}; Qwen3 4 layers, dim 256, 8/4 heads, vocab 2048, "
             f"batch 4 x 128, SGD.", "",
             "| | step median (ms) | min-max (ms) | last loss |", "|---|---|---|---|"]
    for k in times:
        lines.append(f"| {k} | {med[k]:.1f} | {lo[k]:.1f}-{hi[k]:.1f} | {losses[k]:.6f} |")
    lines += ["", f"tpflow / transformers: {ratio:.2f}x"]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(__file__).parent / "results" / f"hf_peer_w{dist.get_world_size()}_{datetime.date.today()}.md"
    out.write_text(text)


if __name__ == "__main__":
    main()
