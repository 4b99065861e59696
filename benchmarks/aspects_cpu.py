"""What the aspects ``parallelize`` puts on a model cost a training step, on the harness's Llama beside transformers'
tensor-parallel step, side by side in one run on CPU ranks.

    python -m tpflow.launch --nproc_per_node 2 benchmarks/aspects_cpu.py [--rounds 40]

The aspects run on every call of a parallelized model: the input check (``tpflow.plans.inputs``: the ranks' inputs,
training flag and, for a model with dropout, random states compared), the random streams of split regions
(``tpflow.plans.random_streams``, on a model with dropout only), the split logits' hooks and type
(``tpflow.plans.logits``), the model-level read of its replicated parameters (``tpflow.layers.replicated``: the
model's code may read a child's parameter without calling it) and the late-rank context manager around each gloo
collective (``tpflow.comm.peers.naming_late``; collectives through shared memory do not take it).

The model is ``python -m tpflow.bench --workload hf``'s: a Llama of ``--layers`` layers of ``--dim`` (feed-forward
4x, 8 heads, 4 key / value heads, vocabulary 8x, untied head, fp32), its own ``labels=`` loss on ``--tokens`` token
ids in rows of ``--seq``, one SGD step as the harness takes it (``tpflow.bench.trainer``), glibc keeping freed memory
as the harness has it. Steps, each after a barrier, a step's time the slowest rank's, the cases taking turns in an
order shuffled round by round:

- ``tpflow``: ``tpf.parallelize(model, plan="auto")``, every aspect in place;
- the same model with one aspect taken off for the step (the ``check_inputs`` switch off; the model-level read's
  hooks lifted, each replicated module then reading its own parameters as it is called);
- the model with attention dropout 0.1 (random streams and the per-step input check apply), with its input check
  off, and with its random streams' hooks lifted (the masks then come from the shared stream: the same work);
- the model over gloo (the ``cpu_shared_memory`` switch off), with ``naming_late`` replaced by a null context;
- transformers' own tensor parallelism (``from_pretrained(path, tp_plan="auto")``, in training mode) on the same
  checkpoint, without and with the dropout: each tpflow case is compared with the one of its dropout.

An aspect's cost is the median over rounds of (the step with it) - (the step without it), in ms and as a ratio. Then
``--inside`` more steps of the two models (and of the first over gloo) with every aspect's hooks timed: the time spent
inside them a step and their calls a step. Each run is appended to ``benchmarks/results/aspects_cpu_<cpu>_<date>.md``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import dataclasses
import random
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

import tpflow as tpf
from benchmarks.collective_cpu import write
from tpflow.bench.layouts import from_checkpoint
from tpflow.bench.measure import hold_freed_memory, step_times
from tpflow.bench.trainer import Context, Trainer, forward_backward, make_trainer
from tpflow.bench.workloads import CausalLMLoss, Workload
from tpflow.bench.workloads import build as build_workload
from tpflow.comm import collectives

DROPOUT = 0.1
_ASPECTS = {  # a hook's class, or the module defining it -> the aspect it belongs to
    "tpflow.plans.inputs": "input check",
    "tpflow.plans.random_streams": "random streams",
    "tpflow.plans.logits": "split logits (loss routing, the logits' type)",
    "_Subtree": "model-level read of replicated parameters",
    "_Replica": "replicated modules' own reads",
    "ColumnGroup": "fused column groups",
}
LATE = "late-rank context manager (naming_late)"


def _aspect(hook: object) -> str | None:
    """The aspect ``hook`` (a forward hook of a parallelized model) belongs to, or None."""
    fn = getattr(hook, "__func__", hook)
    owner = getattr(fn, "__qualname__", type(hook).__qualname__).split(".")[0]
    return _ASPECTS.get(owner) or _ASPECTS.get(getattr(fn, "__module__", type(hook).__module__))


def _hooks(model: nn.Module) -> Iterator[tuple[dict, int, object, str]]:
    """Every forward hook of ``model``'s modules that belongs to an aspect: (its table, key, hook, aspect)."""
    for module in model.modules():
        for table in (module._forward_pre_hooks, module._forward_hooks):
            for key, hook in list(table.items()):
                aspect = _aspect(hook)
                if aspect is not None:
                    yield table, key, hook, aspect


@contextlib.contextmanager
def _lifted(model: nn.Module, aspect: str) -> Iterator[None]:
    """``aspect``'s hooks taken off ``model`` for the block."""
    found = [(table, key, hook) for table, key, hook, name in _hooks(model) if name == aspect]
    for table, key, _ in found:
        del table[key]
    try:
        yield
    finally:
        for table, key, hook in found:
            table[key] = hook


@contextlib.contextmanager
def _over_gloo(named: bool = True) -> Iterator[None]:
    """The block's collectives over gloo (the ``cpu_shared_memory`` switch off), with the late-rank context manager
    around them or (``named=False``) a null context in its place."""
    kept = collectives.naming_late
    if not named:
        collectives.naming_late = lambda what, group: contextlib.nullcontext()
    try:
        with tpf.config.override(cpu_shared_memory=False):
            yield
    finally:
        collectives.naming_late = kept


class _TimedContext:
    """A context manager whose ``__enter__`` and ``__exit__`` are timed (not the block inside)."""

    def __init__(self, inner: contextlib.AbstractContextManager, timer: _Timer, aspect: str) -> None:
        self.inner, self.timer, self.aspect = inner, timer, aspect

    def __enter__(self) -> object:
        start = time.perf_counter()
        try:
            return self.inner.__enter__()
        finally:
            self.timer.seconds[self.aspect] += time.perf_counter() - start

    def __exit__(self, *exc: object) -> bool | None:
        start = time.perf_counter()
        try:
            return self.inner.__exit__(*exc)
        finally:
            self.timer.seconds[self.aspect] += time.perf_counter() - start


class _Timer:
    """Seconds spent inside each aspect's hooks, and their calls."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()

    def wrap(self, fn: Callable, aspect: str) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[aspect] += time.perf_counter() - start
                self.calls[aspect] += 1
        return timed

    @contextlib.contextmanager
    def around(self, model: nn.Module) -> Iterator[None]:
        """Every aspect's hooks on ``model``, and ``naming_late``, timed for the block."""
        found = list(_hooks(model))
        for table, key, hook, aspect in found:
            table[key] = self.wrap(hook, aspect)
        kept = collectives.naming_late
        made = self.wrap(kept, LATE)  # made, entered and left: the collective inside is not counted
        collectives.naming_late = lambda what, group: _TimedContext(made(what, group), self, LATE)
        try:
            yield
        finally:
            collectives.naming_late = kept
            for table, key, hook, _ in found:
                table[key] = hook


def _with_dropout(model: nn.Module, p: float) -> nn.Module:
    """``model`` (a copy of the workload's) with attention dropout ``p``: its config's and its layers'."""
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = p
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "attention_dropout"):
            config.attention_dropout = p
    return model


def _trainer(model: nn.Module, w: Workload, ctx: Context) -> Trainer:
    """The harness's step of ``model`` (in training mode)."""
    model.train()
    return make_trainer(list(model.parameters()), forward_backward(model, w.inputs, w.targets, w.loss_fn,
                                                                   float(ctx.rank == 0)), 0, range(ctx.world))


def _transformers(w: Workload, ctx: Context) -> nn.Module:
    """transformers' tensor parallelism on the checkpoint of ``w``'s model, as the harness loads it."""
    from transformers import AutoModelForCausalLM

    return CausalLMLoss(from_checkpoint(w, ctx, AutoModelForCausalLM, tp_plan="auto"))


def _timed(trainer: Trainer) -> float:
    dist.barrier()
    start = time.perf_counter()
    trainer.step()
    return time.perf_counter() - start


def run(args) -> None:
    allocator = hold_freed_memory()
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    ctx = Context(world=world, rank=rank, device=torch.device("cpu"))
    w = build_workload("hf", dim=args.dim, hidden=4 * args.dim, depth=args.layers, tokens=args.tokens, seq=args.seq,
                       heads=8, kv_heads=4)
    dropped = _with_dropout(copy.deepcopy(w.model), DROPOUT)
    theirs, theirs_dropped = _transformers(w, ctx), _transformers(dataclasses.replace(w, model=dropped), ctx)
    P = ctx.placement(range(world))
    # the harness's model as the harness parallelizes it (its wrapper); the dropout one by the Llama inside it
    llama = tpf.parallelize(copy.deepcopy(w.model), placement=P, plan="auto")
    tpf.parallelize(dropped.lm, placement=P, plan="auto")
    ours, drop = _trainer(llama, w, ctx), _trainer(dropped, w, ctx)
    torch.manual_seed(5)  # alike on every rank: the ranks of the dropout models draw alike
    null, gloo = contextlib.nullcontext, "tpflow over gloo"
    drop_name, reference = f"tpflow, dropout {DROPOUT}", f"transformers' TP, dropout {DROPOUT}"
    cases = {  # name -> (trainer, the block it steps in, the case it is compared with, its transformers' case)
        "tpflow": (ours, null, None, "transformers' TP"),
        "tpflow, input check off": (ours, lambda: tpf.config.override(check_inputs="off"), "tpflow",
                                    "transformers' TP"),
        "tpflow, model-level read off": (ours, lambda: _lifted(llama, _ASPECTS["_Subtree"]), "tpflow",
                                         "transformers' TP"),
        drop_name: (drop, null, None, reference),
        f"{drop_name}, input check off": (drop, lambda: tpf.config.override(check_inputs="off"), drop_name,
                                          reference),
        f"{drop_name}, random streams off": (drop, lambda: _lifted(dropped, "random streams"), drop_name, reference),
        gloo: (ours, _over_gloo, None, "transformers' TP"),
        f"{gloo}, naming_late off": (ours, lambda: _over_gloo(named=False), gloo, "transformers' TP"),
        "transformers' TP": (_trainer(theirs, w, ctx), null, None, "transformers' TP"),
        reference: (_trainer(theirs_dropped, w, ctx), null, None, reference),
    }
    for trainer, block, *_ in cases.values():
        for _ in range(args.warmup):
            with block():
                trainer.step()
    local: dict[str, list[float]] = {name: [] for name in cases}
    for k in range(args.rounds):
        order = list(cases)
        random.Random(k).shuffle(order)  # the same on every rank: no case always follows the same one
        for name in order:
            trainer, block, *_ = cases[name]
            with block():
                local[name].append(_timed(trainer))
    times = {name: step_times(t) for name, t in local.items()}
    inside = {}
    for name in ("tpflow", drop_name, gloo):
        trainer, block, *_ = cases[name]
        timer = _Timer()
        model = dropped if trainer is drop else llama
        with block(), timer.around(model):
            for _ in range(args.inside):
                trainer.step()
        inside[name] = timer
    if rank == 0:
        _report(args, world, allocator, w, cases, times, inside)


def _report(args, world: int, allocator: str, w: Workload, cases: dict, times: dict, inside: dict) -> None:
    lines = [f"# The aspects of a parallelized model, a training step on {world} CPU ranks: {w.describe()}", "",
             f"Command: `python -m tpflow.launch --nproc_per_node {world} benchmarks/aspects_cpu.py --rounds "
             f"{args.rounds} --dim {args.dim} --layers {args.layers} --tokens {args.tokens} --seq {args.seq}`; "
             f"{allocator}.", "",
             "| case | step ms (median) | against its case with the aspect: ms (median of rounds) | ratio | "
             "vs transformers' TP, same dropout (median of rounds) |", "|---|---|---|---|---|"]
    for name, (_, _, base, theirs) in cases.items():
        t = times[name]
        against = "" if base is None else \
            f"{statistics.median(a - b for a, b in zip(times[base], t)) * 1e3:+.2f} ({base} - this) | " \
            f"{statistics.median(a / b for a, b in zip(times[base], t)):.3f}x"
        ratio = statistics.median(a / b for a, b in zip(t, times[theirs]))
        lines.append(f"| {name} | {statistics.median(t) * 1e3:.1f} | {against or '- | -'} | {ratio:.3f}x |")
    lines.append("")
    for name, (_, _, base, theirs) in cases.items():
        if name.startswith("tpflow") and base is None and "gloo" not in name:
            ours = [a / b for a, b in zip(times[name], times[theirs])]
            q = statistics.quantiles(ours, n=4) if len(ours) > 1 else [ours[0]] * 3
            lines.append(f"{name} / {theirs}, round by round: median {statistics.median(ours):.3f}x, quartiles "
                         f"{q[0]:.3f}-{q[2]:.3f}x ({args.rounds} rounds).")
    lines += ["",
              f"Inside each aspect's hooks, rank 0, over {args.inside} steps (the time of the calls, in the step, "
              f"with the collectives they wait on):", "",
              "| aspect | " + " | ".join(f"{n}: us a step (calls)" for n in inside) + " |",
              "|---|" + "---|" * len(inside)]
    aspects = sorted({a for timer in inside.values() for a in timer.calls})
    for aspect in aspects:
        cells = [f"{t.seconds[aspect] / args.inside * 1e6:.1f} ({t.calls[aspect] / args.inside:g})"
                 if t.calls[aspect] else "- (0)" for t in inside.values()]
        lines.append(f"| {aspect} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    print(f"appended to {write('aspects_cpu', lines, args.out)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--inside", type=int, default=20, help="steps with the aspects' hooks timed")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--out", default="benchmarks/results")
    tpf.init_distributed()
    run(parser.parse_args())


if __name__ == "__main__":
    main()
