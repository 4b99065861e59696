"""transformers' ``Trainer`` with tpflow's tensor parallelism, beside the same steps in a plain loop and beside
transformers' own tensor parallelism, side by side in one run on CPU ranks.

    python -m tpflow.launch --nproc_per_node 2 benchmarks/trainer_cpu.py [--rounds 5] [--steps 4]

A Llama (vocabulary ``--vocab``, ``--layers`` layers of ``--hidden``, 8 heads of 32 with 4 key / value heads, fp32,
random weights) is saved by rank 0 and loaded three ways, each trained by AdamW (lr 1e-4) with clipping at 1.0
(the whole gradient's norm) on ``--batch`` x ``--seq`` tokens by the model's ``labels=`` loss:

- ``Trainer`` on ``tpf.parallelize(plan="auto")`` after ``tpf.adopt`` (a step: ``on_step_begin`` to ``on_step_end``
  of a callback: forward, backward, clipping, the optimizer and the scheduler; ``Trainer`` fetches the batch before);
- the same tpflow model in a plain loop (Trainer's overhead is the ratio of the two);
- transformers' ``from_pretrained(path, tp_plan="auto")`` in the same plain loop: accelerate refuses its
  ``ParallelismConfig`` on CPU ranks (``DistributedType.MULTI_CPU``), so ``Trainer`` cannot run it here.

The three take turns, ``--steps`` steps each per round over ``--rounds`` rounds; a step's time is the median over
every round's steps but each round's first, on the slowest rank. Memory per rank: the bytes of this rank's
parameters, gradients and AdamW state after the run. Each run is appended to
``benchmarks/results/trainer_cpu_<cpu>_<date>.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import tpflow as tpf
from benchmarks.collective_cpu import write
from tpflow.bench.measure import step_times


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _held_mib(model, optimizer) -> float:
    """This rank's bytes of parameters, gradients and optimizer state, in MiB."""
    total = 0
    for p in model.parameters():
        total += _local(p).numel() * p.element_size()
        if p.grad is not None:
            total += _local(p.grad).numel() * p.grad.element_size()
    for state in optimizer.state.values():
        total += sum(_local(v).numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    return total / 2**20


def _rows(args) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch * args.steps, args.seq), generator=g)
    return [{"input_ids": row.tolist(), "labels": row.tolist()} for row in ids]


class _Stopwatch:
    """A ``Trainer`` callback timing each step."""

    def __init__(self) -> None:
        import transformers

        class Callback(transformers.TrainerCallback):
            def on_step_begin(cb, *a, **k):
                self.start = time.perf_counter()

            def on_step_end(cb, *a, **k):
                self.times.append(time.perf_counter() - self.start)

        self.callback, self.times, self.start = Callback(), [], 0.0


def _trainer_round(model, args, folder: str, rows: list[dict]) -> tuple[list[float], object]:
    import transformers

    watch = _Stopwatch()
    targs = transformers.TrainingArguments(folder, max_steps=args.steps, per_device_train_batch_size=args.batch,
                                           learning_rate=1e-4, max_grad_norm=1.0, save_strategy="no", report_to=[],
                                           use_cpu=True, disable_tqdm=True, logging_strategy="no",
                                           lr_scheduler_type="constant")
    trainer = tpf.adopt(transformers.Trainer(model=model, args=targs, train_dataset=rows, callbacks=[watch.callback]))
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    return watch.times, trainer.optimizer


def _clip(model, max_norm: float) -> None:
    """Clipping by the whole gradient's norm, global and plain gradients each by torch's foreach norm (transformers'
    tensor parallelism leaves some parameters plain, which ``clip_grad_norm_`` refuses beside global ones), as
    ``Trainer`` does for such a model; on tpflow's (all global) it is ``clip_grad_norm_``."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    groups = [[g for g in grads if hasattr(g, "full_tensor")], [g for g in grads if not hasattr(g, "full_tensor")]]
    norms = [torch.nn.utils.get_total_norm(group) for group in groups if group]
    total = torch.stack([n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]).norm()
    for group in groups:
        if group:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)


def _loop_round(model, optimizer, args, rows: list[dict]) -> list[float]:
    times = []
    for k in range(args.steps):
        batch = rows[k * args.batch:(k + 1) * args.batch]
        ids = torch.tensor([r["input_ids"] for r in batch])
        dist.barrier()
        start = time.perf_counter()
        loss = model(ids, labels=ids).loss
        loss.backward()
        _clip(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return times


def run(args) -> None:
    import transformers

    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    holder = [tempfile.mkdtemp(prefix="tpflow-trainer-") if rank == 0 else None]
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
    P = tpf.placement("cpu", list(range(world)))
    ours = tpf.parallelize(transformers.AutoModelForCausalLM.from_pretrained(f"{folder}/model"), placement=P,
                           plan="auto")
    plain = tpf.parallelize(transformers.AutoModelForCausalLM.from_pretrained(f"{folder}/model"), placement=P,
                            plan="auto")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(f"{folder}/model", tp_plan="auto")
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (plain, theirs)]
    rows = _rows(args)
    times: list[list[float]] = [[], [], []]
    trainer_optimizer = None
    for _ in range(args.rounds):
        dist.barrier()
        got, trainer_optimizer = _trainer_round(ours, args, f"{folder}/out", rows)
        times[0] += got[1:]
        times[1] += _loop_round(plain, optimizers[0], args, rows)[1:]
        times[2] += _loop_round(theirs, optimizers[1], args, rows)[1:]
    ms = [statistics.median(step_times(t)) * 1e3 for t in times]
    mib = [_held_mib(ours, trainer_optimizer), _held_mib(plain, optimizers[0]), _held_mib(theirs, optimizers[1])]
    most = [max(v) for v in _every(mib)]
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder)
        lines = [f"# Trainer on {world} CPU ranks: Llama vocabulary {args.vocab}, {args.layers} layers of "
                 f"{args.hidden}, fp32, {args.batch} x {args.seq} tokens a step", "",
                 f"Command: `python -m tpflow.launch --nproc_per_node {world} benchmarks/trainer_cpu.py --rounds "
                 f"{args.rounds} --steps {args.steps}`", "",
                 "| mode | ms / step | vs transformers' TP, plain loop | vs tpflow, plain loop | MiB per rank (params, "
                 "grads, AdamW) |", "|---|---|---|---|---|"]
        names = ["Trainer + tpflow (tpf.adopt)", "tpflow, plain loop", "transformers' TP (tp_plan='auto'), plain loop"]
        for name, t, m in zip(names, ms, most):
            lines.append(f"| {name} | {t:.1f} | {t / ms[2]:.2f}x | {t / ms[1]:.2f}x | {m:.1f} |")
        print("\n".join(lines))
        print(f"appended to {write('trainer_cpu', lines, args.out)}")


def _every(values: list[float]) -> list[list[float]]:
    """Each value as every rank has it."""
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, values)
    return [list(v) for v in zip(*every)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", default="benchmarks/results")
    tpf.init_distributed()
    run(parser.parse_args())


if __name__ == "__main__":
    main()
