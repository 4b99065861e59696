"""One model type checked on this rank's process group against the same model on one device: the verdict a support
matrix row holds.

A mode is ``"tp"`` (``plan="auto"``: the model's own tensor-parallel plan, or tpflow's), ``"cp"`` (``hf_plan(
context_parallel="ring")``: the sequence split over the ranks, the weights whole), ``"sp"`` (the same with
``mixers="state_passing"``: linear attention and state spaces on each rank's own tokens, ``n/a`` for a model with
none), ``"ep"`` (``hf_plan(
expert_parallel=True)``: a mixture's experts shared out over the ranks whole, ``n/a`` for a dense model) or ``"hf"``
(transformers' own tensor parallelism, ``from_pretrained(tp_plan="auto")``, ``n/a`` where it ships no plan: what
tpflow's is compared with). The model and
its one-device copy take the same batch; the check compares the logits, the ``labels=`` loss, every parameter's
gradient, every parameter after an AdamW step and, but for context parallelism, ``generate``'s greedy tokens. A plan
``parallelize`` refuses is ``refused`` with its sentence; anything else raised is ``failing``; a number off, or a mode
that did not apply (no parameter split, logits not split over the sequence), is ``wrong``.
"""

from __future__ import annotations

import copy
import dataclasses
import shutil
import tempfile
import traceback
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tpflow.models.shares import SLACK, most_held, what_stays_whole
from tpflow.models.zoo import VOCAB, tiny_model
from tpflow.placement import Placement

__all__ = ["MODES", "Verdict", "check"]

MODES = ("tp", "cp", "sp", "ep", "hf")
_CONTEXT = ("cp", "sp")  # the modes that split the sequence
# relative to the largest value compared: logits to fp32's rounding (transformers' eager attention takes its softmax
# in fp32 for fp64 models); gradients too, as the models' own loss takes logits.float(); parameters after AdamW,
# whose normalized step magnifies a near-zero gradient's rounding, to a hundredth of a step
LOGITS_TOLERANCE = 1e-6
TOLERANCE = 5e-5  # (DeepSeek-V4 keeps its norms and hyper-connections in fp32)
_FLOOR = 1e-6  # the least scale a comparison is relative to
STEP_TOLERANCE = 1e-4
# state passing's gradients: transformers' torch recurrences compute in fp32 on both sides, and state passing sums a
# rank's fragments in another order; a gate's gradient (a sum over every token, whose terms cancel) magnifies that
# rounding (by hand, 2026-11-30: Qwen3.5's A_log 9.1e-5 at 2 ranks, 1.6e-4 at 4; 1.3e-7 with an fp64 delta rule)
PASSING_TOLERANCE = 1e-3
_ROUNDING = 1e-8  # below fp32's (1.2e-7): a gradient's difference this small relative to the largest is rounding
_SEQUENCE = 16  # a multiple of 2W for the ring at 2 and 4 ranks


@dataclasses.dataclass(frozen=True)
class Verdict:
    """How one model type fares under one mode.

    Args:
        status: ``"exact"``, ``"refused"``, ``"failing"``, ``"wrong"``, ``"n/a"`` (no experts to share out) or
            ``"not built"``.
        why: the sentence: the refusal's, the error's, what differs.
        share: under tensor parallelism, the share of the model's values the rank holding most holds
            (``tpflow.models.shares.most_held``); None where the model was not parallelized.
        whole: where ``share`` is above 1/W + ``tpflow.models.shares.SLACK``, what stays whole on every rank
            (``what_stays_whole``).

    Example::

        >>> Verdict("refused", "no plan").status
        'refused'
    """

    status: str
    why: str = ""
    share: float | None = None
    whole: str = ""


class _Wrong(Exception):
    pass


def _whole(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _close(what: str, got: torch.Tensor | None, want: torch.Tensor | None, tolerance: float = TOLERANCE,
           noise: float = 0.0) -> None:
    if (got is None) != (want is None):
        raise _Wrong(f"{what}: {'no' if got is None else 'a'} gradient where one device has "
                     f"{'one' if got is None else 'none'}")
    if want is None:
        return
    got, want = _whole(got).double(), want.double()
    if got.shape != want.shape:
        raise _Wrong(f"{what}: shape {list(got.shape)}, one device's {list(want.shape)}")
    scale = max(want.abs().max().item(), _FLOOR)  # a gradient that is rounding noise (an argument of 0) is 0
    off = (got - want).abs().max().item()
    err = off / scale
    if not (err <= tolerance or off <= noise):
        raise _Wrong(f"{what}: {err:.1e} off (relative to its largest value)")


def _split_somewhere(model: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) and not all(pl.is_replicate() for pl in p.placements)
               for p in model.parameters())


def _train_step(model: torch.nn.Module, ids: torch.Tensor):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    out = model(ids, labels=ids)
    out.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    opt.step()
    opt.zero_grad()
    return out, grads


def _compare(mode: str, model: torch.nn.Module, ref: torch.nn.Module, ids: torch.Tensor) -> None:
    if mode not in _CONTEXT and not _split_somewhere(model):
        raise _Wrong("no parameter is split: the model runs whole on every rank")
    out, grads = _train_step(model, ids)
    out_ref, grads_ref = _train_step(ref, ids)
    if mode in _CONTEXT and not (isinstance(out.logits, DTensor) and any(
            pl.is_shard(1) for pl in out.logits.placements)):
        raise _Wrong("the logits are not split over the sequence: the model ran without context parallelism")
    _close("logits", out.logits, out_ref.logits, LOGITS_TOLERANCE)
    _close("loss", out.loss, out_ref.loss)
    names = dict(ref.named_parameters())
    # a gradient that is 0 but for an fp32 router's rounding (top-1 routing renormalized: every weight 1) differs
    # by that rounding alone: below fp32's rounding of the model's largest gradient, it is 0
    noise = _ROUNDING * max((g.abs().max().item() for g in grads_ref.values() if g is not None), default=0.0)
    for name, g in grads.items():
        _close(f"{name}'s gradient", g, grads_ref[name], PASSING_TOLERANCE if mode == "sp" else TOLERANCE, noise)
    for name, p in model.named_parameters():
        _close(f"{name} after AdamW", p.detach(), names[name].detach(), STEP_TOLERANCE)
    if mode not in _CONTEXT:
        model.eval()
        ref.eval()
        prompt = ids[:, :5]
        kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt))
        if not torch.equal(model.generate(prompt, **kwargs), ref.generate(prompt, **kwargs)):
            raise _Wrong("generate's greedy tokens differ")


def check(kind: str, mode: str, placement: Placement, ratios: bool = False) -> Verdict:
    """Check model type ``kind`` under ``mode`` on ``placement``'s ranks (every rank calls it alike).

    Args:
        kind: a model type (``tpflow.models.zoo.causal_lm_types()``).
        mode: one of ``MODES``.
        placement: the ranks (``tpf.placement``), 1-D; for ``"hf"``, every rank of the default group.
        ratios: the tiny model at the family's real ratios (``tiny_config(kind, ratios=True)``).

    Returns:
        The ``Verdict``.

    Example::

        >>> check("llama", "tp", tpf.placement("cpu", ranks=[0, 1]))
        Verdict(status='exact', why='', share=0.5, whole='')
    """
    ids = torch.randint(0, VOCAB, (2, _SEQUENCE), generator=torch.Generator().manual_seed(1))
    try:  # a config transformers cannot build or run tiny: said, not checked
        ref = tiny_model(kind, ratios=ratios)
        with torch.no_grad():
            copy.deepcopy(ref)(ids, labels=ids)  # (a copy: the reference trains from where it starts)
    except Exception as e:
        return Verdict("not built", _first_line(e))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model, plan = (_transformers_model(ref), {}) if mode == "hf" else _parallelized(ref, mode, placement)
        except ValueError as e:
            if mode == "hf" and "has no `tp_plan`" in str(e):
                return Verdict("n/a", "transformers ships no tensor-parallel plan")
            return Verdict("failing" if mode == "hf" else "refused", _first_line(e))
        except Exception as e:
            return Verdict("failing", f"{'from_pretrained' if mode == 'hf' else 'parallelize'}: {type(e).__name__}: "
                                      f"{_first_line(e)}")
        if model is None:
            return Verdict("n/a", "no experts" if mode == "ep" else "no mixer passes its state")
        held = _held(model, plan, placement) if mode == "tp" else {}
        try:
            _compare(mode, model, ref, ids)
        except _Wrong as e:
            return Verdict("wrong", str(e), **held)
        except ValueError as e:  # what only a batch shows (a mask an attention module builds itself)
            if mode == "hf" or "/tpflow/" not in traceback.extract_tb(e.__traceback__)[-1].filename:
                return Verdict("failing", f"{type(e).__name__}: {_first_line(e)}")  # the model's, not a refusal
            return Verdict("refused", f"at the first forward: {_first_line(e)}")
        except Exception as e:
            return Verdict("failing", f"{type(e).__name__}: {_first_line(e)}")
    return Verdict("exact", **held)


def _held(model: torch.nn.Module, plan: dict, placement: Placement) -> dict[str, object]:
    """The share of the model's values the rank holding most holds, and what stays whole where that is more than a
    split leaves."""
    share = most_held(model, placement)
    over = share > 1 / placement.hierarchy[-1] + SLACK
    return {"share": share, "whole": what_stays_whole(model, plan) if over else ""}


def _parallelized(ref: torch.nn.Module, mode: str, placement: Placement) -> tuple[torch.nn.Module | None, dict]:
    """A copy of ``ref`` parallelized under ``mode`` by tpflow (None for expert parallelism without experts, state
    passing without a mixer passing its state), and its plan."""
    import tpflow as tpf
    from tpflow.hf.state_passing import StatePassing

    model = copy.deepcopy(ref)
    plan = tpf.hf_plan(model, context_parallel="ring" if mode in _CONTEXT else None, expert_parallel=mode == "ep",
                       mixers="state_passing" if mode == "sp" else "head_parallel")
    wanted = {"ep": tpf.ExpertParallel, "sp": StatePassing}.get(mode)
    if wanted and not any(isinstance(s, wanted) for entry in plan.values() if isinstance(entry, tpf.Style)
                          for s in entry.styles):
        return None, plan
    return tpf.parallelize(model, placement=placement, plan=plan), plan


def _transformers_model(ref: torch.nn.Module) -> torch.nn.Module:
    """``ref`` saved, then loaded by transformers with its own tensor parallelism (``tp_plan="auto"``, over the
    default group's ranks): what tpflow's is compared with."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    folder = [tempfile.mkdtemp(prefix="tpflow-models-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)
    try:
        if dist.get_rank() == 0:
            ref.save_pretrained(folder[0])
        dist.barrier()
        model = transformers.AutoModelForCausalLM.from_pretrained(folder[0], tp_plan="auto", dtype=torch.float64,
                                                                  experts_implementation="eager")
        dtypes = {name: p.dtype for name, p in ref.named_parameters()}  # (a module the zoo keeps in fp32)
        for name, p in list(model.named_parameters()):
            if dtypes.get(name, p.dtype) != p.dtype:
                model.get_submodule(name.rpartition(".")[0]).to(dtypes[name])
        return model.train()
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(folder[0], ignore_errors=True)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:400]
