"""Token mixers split by heads against the same mixers whole, on a Nemotron-H-shaped and a Qwen3.5-shaped model, side
by side in one run on CPU ranks.

    python -m tpflow.launch --nproc_per_node 2 benchmarks/mixers_cpu.py [--rounds 6]
    python -m tpflow.launch --nproc_per_node 4 benchmarks/mixers_cpu.py [--rounds 6]

The models (fp32, random weights, a few layers at a realistic width, transformers' own code):

- ``nemotron_h``: hidden 1024; two Mamba-2 layers (32 heads of 64, 8 groups, a 128-wide state), an attention layer
  (8 heads of 128, 2 key / value heads) and an MLP layer (2816);
- ``qwen3_5``: Qwen3.5's dense text model, hidden 1024; three gated DeltaNet layers (8 key heads and 16 value heads of
  128) and one attention layer (8 heads of 128, 2 key / value heads), MLPs of 2816.

The cases, each on the same ranks and batch (1 x ``--seq`` tokens, the model's ``labels=`` loss, one AdamW step):

- ``split``: ``tpf.parallelize(model, plan="auto")``: the mixers split by heads (``tpflow.hf.state_space``,
  ``tpflow.hf.delta_net``);
- ``whole``: the same plan with each mixer whole on every rank (``tpf.Replicated``), as tpflow ran them before:
  every rank holds and computes every head;
- ``transformers``: transformers' own tensor parallelism (``from_pretrained(path, tp_plan="auto")``): for Qwen3.5 its
  plan gathers each DeltaNet projection's output onto every rank (``colwise_gather_output``); Nemotron-H's splits its
  attention and MLP (where it runs).

For each: the share of the model's values one rank holds, the bytes the forward saves for the backward on one rank
(``torch.autograd.graph.saved_tensors_hooks``, each storage once), and the step's time, the slowest rank's, the
median over ``--rounds`` rounds in which the cases take turns. Each run is appended to
``benchmarks/results/mixers_cpu_<cpu>_<date>.md``.
"""

from __future__ import annotations

import argparse
import copy
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import transformers
from torch import nn
from torch.distributed.tensor import DTensor

import tpflow as tpf
from benchmarks.collective_cpu import write
from tpflow.bench.measure import cpu_name, hold_freed_memory, step_times
from tpflow.hf.mixer_split import MixerStyle

VOCAB = 8192


def _configs() -> dict[str, transformers.PretrainedConfig]:
    attention = {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 2816,
                 "hidden_size": 1024, "vocab_size": VOCAB, "max_position_embeddings": 4096}
    nemotron = transformers.NemotronHConfig(
        **attention, mamba_num_heads=32, mamba_head_dim=64, n_groups=8, ssm_state_size=128, chunk_size=128,
        layers_block_type=["mamba", "mamba", "attention", "mlp"])
    qwen = transformers.Qwen3_5TextConfig(
        **attention, linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"])
    return {"nemotron_h": nemotron, "qwen3_5": qwen}


def _share(model: nn.Module, total: int) -> float:
    held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    return held / total


def _saved_bytes(model: nn.Module, ids: torch.Tensor) -> int:
    """The bytes a forward saves for the backward on this rank, each storage once."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = t._local_tensor if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def _cases(name: str, config: transformers.PretrainedConfig, placement: tpf.Placement) -> dict[str, nn.Module]:
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config).train()
    plan = tpf.hf_plan(ref)
    whole = {p: tpf.Replicated(why="the mixer whole, as before") if isinstance(e, MixerStyle) else e
             for p, e in plan.items()}
    cases = {"split": tpf.parallelize(copy.deepcopy(ref), placement=placement, plan=plan),
             "whole": tpf.parallelize(copy.deepcopy(ref), placement=placement, plan=whole)}
    folder = [tempfile.mkdtemp(prefix="tpflow-mixers-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)
    try:
        if dist.get_rank() == 0:
            ref.save_pretrained(folder[0])
        dist.barrier()
        cases["transformers"] = transformers.AutoModelForCausalLM.from_pretrained(
            folder[0], tp_plan="auto", dtype=torch.float32).train()
    except Exception as e:  # a plan transformers cannot run here is said in the results
        cases["transformers"] = f"does not run: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(folder[0], ignore_errors=True)
    return cases, sum(p.numel() for p in ref.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    allocator = hold_freed_memory()
    torch.set_num_threads(1)
    world = dist.get_world_size()
    placement = tpf.placement("cpu", ranks=list(range(world)))
    ids = torch.randint(0, VOCAB, (1, args.seq), generator=torch.Generator().manual_seed(1))
    lines = [f"## Mixers split by heads, {world} ranks", "",
             f"`python -m tpflow.launch --nproc_per_node {world} benchmarks/mixers_cpu.py --rounds {args.rounds} "
             f"--seq {args.seq}`: {cpu_name()}, torch {torch.__version__}, transformers {transformers.__version__}, "
             f"{allocator}; one thread a rank.", "",
             "| model | case | values held a rank | saved for backward a rank (MiB) | step (s, median) | / split |",
             "|---|---|---|---|---|---|"]
    for name, config in _configs().items():
        cases, total = _cases(name, config, placement)
        saved = {}
        for k, m in list(cases.items()):
            try:  # (every rank alike)
                saved[k] = _saved_bytes(m, ids) if isinstance(m, nn.Module) else None
            except RuntimeError as e:
                cases[k] = f"fails: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        runnable = {k: m for k, m in cases.items() if isinstance(m, nn.Module)}
        optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in runnable.items()}
        times: dict[str, list[float]] = {k: [] for k in runnable}
        for r in range(args.rounds):
            for k in (list(runnable) if r % 2 == 0 else list(reversed(runnable))):  # turns, both orders
                dist.barrier()
                start = time.perf_counter()
                runnable[k](ids, labels=ids).loss.backward()
                optimizers[k].step()
                optimizers[k].zero_grad(set_to_none=True)
                times[k].append(time.perf_counter() - start)
        medians = {k: statistics.median(step_times(v)) for k, v in times.items()}
        held = {k: torch.tensor(_share(m, total)) for k, m in runnable.items()}
        for k, case in cases.items():
            if not isinstance(case, nn.Module):
                lines.append(f"| {name} | {k} | {case} | | | |")
                continue
            lines.append(f"| {name} | {k} | {held[k].item():.3f} | {saved[k] / 2**20:.1f} | {medians[k]:.3f} | "
                         f"{medians[k] / medians['split']:.2f}x |")
        del cases, runnable, optimizers
    if dist.get_rank() == 0:
        print("\n".join(lines))
        print(f"appended to {write('mixers_cpu', lines, args.out)}")


if __name__ == "__main__":
    main()
