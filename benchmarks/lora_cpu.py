"""A LoRA fine-tune step: tpflow against transformers' tensor parallelism with PEFT's own path for it, side by side in
one run on CPU ranks.

    python -m tpflow.launch --nproc_per_node 2 benchmarks/lora_cpu.py [--rounds 5] [--steps 4]

A Llama (vocabulary ``--vocab``, ``--layers`` layers of ``--hidden``, 8 heads of 32 with 4 key / value heads, fp32,
random weights) is saved by rank 0 and loaded two ways, each wrapped by PEFT's ``get_peft_model`` with LoRA of rank
``--rank`` on every attention and MLP projection, and trained by AdamW (lr 1e-4, the adapters only) with clipping at
1.0 on ``--batch`` x ``--seq`` tokens by the model's ``labels=`` loss:

- tpflow: ``tpf.parallelize(get_peft_model(model, config), plan="auto")``;
- transformers: ``get_peft_model(from_pretrained(path, tp_plan="auto"), config)`` (PEFT's LoRA on transformers'
  DTensor tensor parallelism).

They take turns, ``--steps`` steps each per round over ``--rounds`` rounds; a step's time is the median over every
round's steps but each round's first, on the slowest rank. Per rank: the AdamW state's bytes (the adapters', split as
they are) and, for tpflow, the bytes sent in a step (``tpflow.comm.stats``) against the layout's minimum: per layer
the base's four all-reduces of ``T x H`` (o / down forward, the attention's and the MLP's input gradients backward),
the embedding's one, and the adapters' own: a row adapter's ``lora_A`` output forward and a column adapter's ``lora_B``
input gradient backward (``T x r`` each), each all-reduce 2 (W-1)/W of its bytes. Each run is appended to
``benchmarks/results/lora_cpu_<cpu>_<date>.md``.

``--targets`` picks the LoRA layers (default every projection). PEFT's LoRA on transformers' row-parallel layers
(``o_proj``, ``down_proj``) fails in its forward here ("shape '[32, 64]' is invalid for input of size 4096", PEFT
0.21, transformers 5.23, gloo), so the side by side runs on the column layers (``q/k/v_proj``, ``gate/up_proj``).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import tpflow as tpf
from benchmarks.collective_cpu import write
from benchmarks.trainer_cpu import _clip, _every, _local
from tpflow import comm
from tpflow.bench.measure import step_times

_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _state_mib(optimizer) -> float:
    """This rank's bytes of AdamW state, in MiB."""
    return sum(_local(v).numel() * v.element_size() for state in optimizer.state.values() for v in state.values()
               if torch.is_tensor(v)) / 2**20


def _minimum_bytes(args, world: int) -> int:
    """The layout's fewest bytes a rank sends in a step (fp32), as the module docstring counts them."""
    tokens = args.batch * args.seq
    all_reduce = 2 * (world - 1) / world * 4  # bytes sent per element of an all-reduce
    adapters = len(args.targets.split(","))  # each: one all-reduce of T x r (row ones forward, column ones backward)
    per_layer = 4 * tokens * args.hidden + adapters * tokens * args.rank
    return int(all_reduce * (args.layers * per_layer + tokens * args.hidden))


def _round(model, optimizer, ids: list[torch.Tensor]) -> tuple[list[float], list[int]]:
    times, sent = [], []
    for batch in ids:
        dist.barrier()
        before = comm.stats.bytes_sent
        start = time.perf_counter()
        loss = model(batch, labels=batch).loss
        loss.backward()
        _clip(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        sent.append(comm.stats.bytes_sent - before)
    return times, sent


def run(args) -> None:
    import peft
    import transformers

    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    holder = [tempfile.mkdtemp(prefix="tpflow-lora-") if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    folder = holder[0]
    if rank == 0:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                          intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                                          num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                                          max_position_embeddings=max(256, args.seq))
        transformers.LlamaForCausalLM(config).save_pretrained(f"{folder}/model")
    dist.barrier()

    def lora():
        return peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=args.targets.split(","))

    P = tpf.placement("cpu", list(range(world)))
    torch.manual_seed(1)
    ours = tpf.parallelize(peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(f"{folder}/model"),
                                               lora()), placement=P, plan="auto")
    torch.manual_seed(1)
    theirs = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(f"{folder}/model", tp_plan="auto"),
                                 lora())
    models = (ours, theirs)
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4) for m in models]
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(args.steps)]
    times: list[list[float]] = [[], []]
    sent: list[int] = []
    for _ in range(args.rounds):
        for k, (model, optimizer) in enumerate(zip(models, optimizers)):
            got, nbytes = _round(model, optimizer, ids)
            times[k] += got[1:]
            if k == 0:
                sent += nbytes[1:]
    ms = [statistics.median(step_times(t)) * 1e3 for t in times]
    state = [max(v) for v in _every([_state_mib(o) for o in optimizers])]
    trainable = [sum(_local(p).numel() for p in m.parameters() if p.requires_grad) for m in models]
    most = [max(v) for v in _every(trainable)]
    minimum = _minimum_bytes(args, world)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder)
        lines = [f"# LoRA (r={args.rank}, on {args.targets}) on {world} CPU ranks: Llama vocabulary {args.vocab}, "
                 f"{args.layers} layers of {args.hidden}, fp32, {args.batch} x {args.seq} tokens a step", "",
                 f"Command: `python -m tpflow.launch --nproc_per_node {world} benchmarks/lora_cpu.py --rounds "
                 f"{args.rounds} --steps {args.steps} --rank {args.rank} --targets {args.targets}`", "",
                 "| mode | ms / step | vs transformers' TP + PEFT | trainable values per rank | AdamW MiB per rank |",
                 "|---|---|---|---|---|"]
        names = ["tpflow: parallelize(get_peft_model(...))", "transformers' TP (tp_plan='auto') + get_peft_model"]
        for name, t, n, s in zip(names, ms, most, state):
            lines.append(f"| {name} | {t:.1f} | {t / ms[1]:.2f}x | {n} | {s:.2f} |")
        median = statistics.median(sent)
        lines += ["", f"tpflow's bytes sent per step on rank 0: {median:.0f}, the layout's minimum {minimum} "
                      f"({median / minimum:.2f}x)"]
        print("\n".join(lines))
        print(f"appended to {write('lora_cpu', lines, args.out)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default=",".join(_TARGETS), help="the LoRA layers, comma-separated")
    parser.add_argument("--out", default="benchmarks/results")
    tpf.init_distributed()
    run(parser.parse_args())


if __name__ == "__main__":
    main()
