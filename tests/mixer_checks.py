"""Checks of token mixers split over the ranks (state spaces, linear attention, recurrences) on transformers' own
models, run on every rank by ``tests.harness.run``: against one device, the logits, the loss, the gradient norm and
every parameter after AdamW steps with clipping, ``generate``'s greedy tokens (at 1 and 2 ranks), the recurrence's
inputs (each rank runs its share of heads), ``save_pretrained`` read back on one device bitwise, and the share of
values a rank holds."""

from __future__ import annotations

import copy
import dataclasses
import fnmatch
import functools
import os
import shutil
import sys
import tempfile

import torch

__all__ = ["Case", "checked", "matches_one_device", "scan_shapes", "share"]


@dataclasses.dataclass(frozen=True)
class Case:
    """A model to check: the zoo's tiny ``kind`` (fp64) with ``config`` changed; its mixers' recurrence, the
    module-level function ``scan`` of the mixer's modeling module (or ``"Class.method"`` there), reads a tensor
    (positional ``arg``) whose dim ``dim`` counts ``heads`` heads (or channels) on one device."""

    kind: str
    config: dict
    scan: str
    arg: int
    dim: int
    heads: int

    def model(self) -> torch.nn.Module:
        import transformers

        from tpflow.models.zoo import tiny_config

        config = tiny_config(self.kind)
        for name, value in self.config.items():
            setattr(config, name, value)
        torch.manual_seed(0)
        try:  # a mixture's experts as a loop, exact in fp64
            model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager")
        except (TypeError, ValueError):
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config)
        return model.double().train()


def share(model: torch.nn.Module, ref: torch.nn.Module) -> float:
    """The share of ``ref``'s values that this rank holds of ``model`` (``ref`` parallelized)."""
    from torch.distributed.tensor import DTensor

    held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    return held / sum(p.numel() for p in ref.parameters())


def scan_shapes(ref: torch.nn.Module, case: Case) -> list[torch.Size]:
    """Patch ``case.scan`` in the modeling module of ``ref``'s mixers to record the shape of the tensor whose dim
    ``case.dim`` counts the heads, at each call (a list, filled as they come)."""
    from tpflow.hf.mixer_styles import mixer_style

    mixer = next(m for m in ref.modules() if mixer_style(m) is not None)
    owner, _, name = case.scan.rpartition(".")  # a function, or a class's (an autograd Function's apply)
    module = sys.modules[type(mixer).__module__]
    module = getattr(module, owner) if owner else module
    if not hasattr(getattr(module, name), "seen"):
        original = getattr(module, name)

        @functools.wraps(original)
        def recorded(*args, **kwargs):
            recorded.seen.append(args[case.arg].shape)
            return original(*args, **kwargs)
        setattr(module, name, recorded)
    getattr(module, name).seen = []
    return getattr(module, name).seen


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def matches_one_device(cases: list[Case], folder: str, sequence_parallel: bool = False) -> dict[str, float]:
    """Each case parallelized by ``plan="auto"`` (``hf_plan(sequence_parallel=)``) against one device (see the
    module docstring; with sequence parallelism, training only): every mixer gets its style; the share this rank
    holds of each (by its kind and config)."""
    import torch.distributed as dist
    import transformers

    import tpflow as tpf
    from tests.models import train_lm
    from tpflow.hf.mixer_styles import mixer_style
    from tpflow.models.check import LOGITS_TOLERANCE, STEP_TOLERANCE  # (mixers' norms compute in fp32)

    world = dist.get_world_size()
    P = tpf.placement("cpu", ranks=list(range(world)))
    shares = {}
    for case in cases:
        ref = case.model()
        tokens = 12 if sequence_parallel else 9  # (a multiple of the ranks, split over them)
        ids = torch.randint(0, ref.config.vocab_size, (2, tokens), generator=torch.Generator().manual_seed(1))
        plan = tpf.hf_plan(ref, sequence_parallel=sequence_parallel)
        mixers = {n: type(mixer_style(m)) for n, m in ref.named_modules() if mixer_style(m) is not None}
        assert mixers and all(any(isinstance(s, style) and fnmatch.fnmatchcase(n, p) for p, s in plan.items())
                              for n, style in mixers.items()), (case.kind, plan)  # every mixer split
        model = tpf.parallelize(copy.deepcopy(ref), placement=P, plan=plan)
        shares[f"{case.kind} {case.config}"] = share(model, ref)
        shapes = scan_shapes(ref, case)
        out = model(ids).logits
        seen = [shape[case.dim] for shape in shapes]
        assert seen and set(seen) == {case.heads // world}, (case.kind, seen)  # this rank's heads only
        want = ref(ids).logits
        assert (_whole(out) - want).abs().max() <= LOGITS_TOLERANCE * want.abs().max(), case.kind
        losses, norms = train_lm(model, ids)
        ref_losses, ref_norms = train_lm(ref, ids)
        for got, expected in ((losses, ref_losses), (norms, ref_norms)):  # (losses in fp32, as the models')
            assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(got, expected)), (case.kind, got, expected)
        for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
            off = (_whole(p.detach()) - p_ref.detach()).abs().max() / p_ref.abs().max()
            assert off < STEP_TOLERANCE, f"{case.kind}: {name} after AdamW, {off:.1e} off (relative to its largest)"
        if sequence_parallel:
            continue
        model.eval()
        ref.eval()
        prompt = ids[:, :5]
        kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt))
        if world <= 2:  # (the caches of this rank's heads: generated at 1 and 2 ranks, the suite's time spared at 4)
            assert torch.equal(model.generate(prompt, **kwargs), ref.generate(prompt, **kwargs)), case.kind
        where = os.path.join(folder, f"{case.kind}-{world}")
        model.save_pretrained(where)
        whole = tpf.full_state_dict(model)
        if dist.get_rank() == 0:  # one device reads the stored layout back, bitwise (cast as the model keeps it:
            # OLMo-Hybrid's A_log in fp32)
            saved = transformers.AutoModelForCausalLM.from_pretrained(where, dtype=torch.float64).state_dict()
            assert all(torch.equal(saved[k], v.to(saved[k].dtype)) for k, v in whole.items()), case.kind
        dist.barrier()
    return shares


def checked(world: int, cases: list[Case], sequence_parallel: bool = False) -> dict[str, float]:
    """``matches_one_device`` of ``cases`` on ``world`` ranks (``tests.harness.run``), in a folder removed after;
    at 2 ranks each model's share a rank holds at most 1/2 + 0.06. The shares."""
    from tests.harness import run

    folder = tempfile.mkdtemp()
    try:
        shares = run(world, matches_one_device, cases, folder, sequence_parallel, timeout=600)[0]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if world == 2:
        for case, held in shares.items():
            assert held <= 1 / world + 0.06, f"{case} holds {held:.3f} of its values a rank"
    return shares
