"""State passing: context parallelism through a gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo-Hybrid) or a Kimi delta
attention (Kimi Linear, Bailing-hybrid) with each rank on its own tokens (``tpf.hf_plan(model, context_parallel=...,
mixers="state_passing")``), where head parallelism gathers the sequence around the mixer.

The mixer runs the model's own code on this rank's fragments of the sequence (the ring's head and tail parts, or
Ulysses' one part), its heads split over the tensor-parallel ranks alone. While it runs, two functions of its
modeling module are wrapped:

- the short convolution (``causal_conv1d_fn``): each fragment gets the ``k - 1`` tokens before it (its halo), from
  the fragments' tails gathered over the context ranks;
- the chunked delta rule (``torch_chunk_gated_delta_rule``, KDA's ``chunk_kimi_delta_attention``, or the kernel
  transformers put in its place): its state after a fragment is affine in the state before it,
  ``S_end = M S_0 + F``. Each fragment runs once from ``S_0 = [0 | I]`` with ``v = [v | 0]`` (``k`` identity columns
  beside its values: the columns evolve apart), its final state ``[F | M]``; the fragments' summaries are gathered
  over the context ranks and combined in sequence order, in fp32, the same on every rank
  (``S_{j+1} = M_j S_j + F_j``); each fragment runs again from its incoming state.

The gathers' backward reduce-scatters their gradient: the backward is autograd's, through the same composition. A
layer sends one summary per fragment (heads x k x (v + k) values) and the halos, whatever the sequence's length.
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpflow import comm
from tpflow.hf.context_attention import Batch, context_group
from tpflow.hf.delta_net import delta_net_counts, kimi_delta_counts
from tpflow.hf.mixer_split import PADDED
from tpflow.placement import Placement
from tpflow.plans.style import Plan, Style

__all__ = ["StatePassing"]

_CONV, _RULES = "causal_conv1d_fn", ("torch_chunk_gated_delta_rule", "chunk_kimi_delta_attention")
_RUNNING: list[_Fragments] = []  # the state-passing mixers running now (the innermost last)
_WRAPPED: set[str] = set()  # the modeling modules whose functions are wrapped (once: others may wrap them after)


@dataclasses.dataclass(frozen=True)
class _Fragments:
    """This rank's fragments of the sequence and every rank's, as the gathers lay them out."""

    local: tuple[tuple[int, int, int], ...]  # (offset among this rank's tokens, start in the sequence, length)
    order: tuple[tuple[int, int], ...]  # every fragment in sequence order: (its rank, its index there)
    runs: tuple[tuple[int, int, int], ...]  # every fragment in sequence order: (start, end, its slot in a gather)
    slots: int  # fragments per rank in a gather (the most any rank holds)
    rank: int
    group: dist.ProcessGroup | None

    def halo(self, start: int, k: int) -> list[int]:
        """Where the ``k`` tokens before ``start`` (those there are) sit among the fragments' gathered tails of
        ``k`` tokens each (a fragment's tail holds every token of it a later fragment's halo can need)."""
        at = []
        for p in range(max(start - k, 0), start):
            _, end, slot = next(run for run in self.runs if run[0] <= p < run[1])
            at.append(slot * k + k - (end - p))
        return at

    def gather(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """This rank's ``pieces`` (one per fragment) stacked, padded to ``slots`` and gathered over the context
        ranks: ``[ranks * slots, ...]``, rank after rank (the backward reduce-scatters the gradient)."""
        stacked = torch.stack(pieces + [torch.zeros_like(pieces[0])] * (self.slots - len(pieces)))
        world = 1 if self.group is None else dist.get_world_size(self.group)
        return comm.gather_shared(stacked, 0, self.slots * world, self.group)


@functools.lru_cache(maxsize=8)
def _fragments(segments: tuple, rank: int, group: dist.ProcessGroup | None) -> _Fragments:
    runs = [_coalesced(parts) for parts in segments]
    slots = max(len(r) for r in runs)
    order = sorted((start, n, r, i) for r, parts in enumerate(runs) for i, (start, n) in enumerate(parts))
    local, at = [], 0
    for start, n in runs[rank]:
        local.append((at, start, n))
        at += n
    return _Fragments(tuple(local), tuple((r, i) for _, _, r, i in order),
                      tuple((start, start + n, r * slots + i) for start, n, r, i in order), slots, rank, group)


def _coalesced(parts) -> list[tuple[int, int]]:
    """Segments laid end to end, runs that continue each other in the sequence merged."""
    runs: list[tuple[int, int]] = []
    for start, n in parts:
        if runs and runs[-1][0] + runs[-1][1] == start:
            runs[-1] = (runs[-1][0], runs[-1][1] + n)
        else:
            runs.append((start, n))
    return runs


class _Halo:
    """The modeling module's short convolution, each fragment with the ``k - 1`` tokens before it."""

    def __init__(self, original) -> None:
        self.original = original

    def __call__(self, hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 activation: str | None = None, **kwargs) -> torch.Tensor:
        if not _RUNNING:
            return self.original(hidden_states, weight, bias, activation, **kwargs)
        frags, k, x = _RUNNING[-1], weight.shape[-1] - 1, hidden_states  # x: [batch, channels, tokens]
        if not k:
            return self.original(x, weight, bias, activation, **kwargs)
        tails = frags.gather([F.pad(x[:, :, max(at, at + n - k):at + n], (max(k - n, 0), 0))
                              for at, _, n in frags.local])  # [ranks * slots, batch, channels, k]
        tails = tails.permute(1, 2, 0, 3).flatten(2)  # [batch, channels, ranks * slots * k]
        out = []
        for at, start, n in frags.local:
            halo = tails[:, :, frags.halo(start, k)]  # (none at the sequence's start: the graph reaches the gather)
            piece = torch.cat((halo, x[:, :, at:at + n]), 2)
            out.append(self.original(piece, weight, bias, activation, **kwargs)[:, :, -n:])
        return torch.cat(out, 2)


class _States:
    """The modeling module's chunked delta rule, run per fragment from the state the fragments before it leave."""

    def __init__(self, original) -> None:
        self.original = original

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args,
                 initial_state: torch.Tensor | None = None, output_final_state: bool = False, **kwargs):
        if not _RUNNING:
            return self.original(query, key, value, *args, initial_state=initial_state,
                                 output_final_state=output_final_state, **kwargs)
        if args or not {"g", "beta"} <= set(kwargs):
            raise ValueError("state passing reads the delta rule's g and beta by keyword, as transformers passes "
                             "them: this model passes them otherwise; use mixers='head_parallel'")
        if initial_state is not None or output_final_state or kwargs.get("cu_seqlens") is not None:
            raise ValueError("state passing runs the delta rule over the whole sequence, from no state, without a "
                             "cache or cu_seqlens: call the model without them, or use mixers='head_parallel'")
        frags = _RUNNING[-1]
        g, beta = kwargs.pop("g"), kwargs.pop("beta")
        batch, heads, (dk, dv) = value.shape[0], value.shape[2], (key.shape[-1], value.shape[-1])

        def run(at: int, n: int, v: torch.Tensor, state: torch.Tensor, final: bool):
            cut = slice(at, at + n)
            return self.original(query[:, cut], key[:, cut], v, g=g[:, cut], beta=beta[:, cut], initial_state=state,
                                 output_final_state=final, **kwargs)

        # [F | M] of each fragment: from [0 | I], its values beside k zero columns
        start = torch.cat((value.new_zeros(batch, heads, dk, dv, dtype=torch.float32),
                           torch.eye(dk, device=value.device).expand(batch, heads, dk, dk)), -1)
        summaries = [run(at, n, torch.cat((value[:, at:at + n], value.new_zeros(batch, n, heads, dk)), -1),
                         start, True)[1].float() for at, _, n in frags.local]
        every = frags.gather(summaries)
        # (every rank's graph reaches the gather, whose backward brings it the other ranks' gradients of its own
        # summaries: a collective every rank runs, whether or not its tokens read another's summary)
        state, incoming = start[..., :dv] + 0 * every.sum(), {}
        for r, i in frags.order:  # in sequence order, alike on every rank
            if r == frags.rank:
                incoming[i] = state
            summary = every[r * frags.slots + i]
            state = summary[..., dv:] @ state + summary[..., :dv]
        out = [run(at, n, value[:, at:at + n], incoming[i], False)[0] for i, (at, _, n) in enumerate(frags.local)]
        return torch.cat(out, 1), None


@dataclasses.dataclass(frozen=True)
class StatePassing(Style):
    """Plan style for a gated DeltaNet or a Kimi delta attention under context parallelism, each rank running it on
    its own tokens with the state the tokens before them leave (see the module docstring); ``tpf.hf_plan(model,
    context_parallel=..., mixers="state_passing")`` stacks it on each mixer's tensor-parallel entry, beside
    ``ContextParallel``.

    Example::

        >>> from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
        >>> model = Qwen3NextForCausalLM(Qwen3NextConfig(
        ...     vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        ...     num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        ...     linear_key_head_dim=8, linear_value_head_dim=8, num_experts=0, layer_types=["linear_attention",
        ...     "full_attention"]))
        >>> plan = tpf.hf_plan(model, context_parallel="ring", mixers="state_passing")
        >>> plan["model.layers.*.linear_attn"].entries[1]
        StatePassing()
    """

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        found = sys.modules[type(module).__module__]
        if (delta_net_counts(module) is None and kimi_delta_counts(module) is None) or not hasattr(found, _CONV) or \
                not any(hasattr(found, f) for f in _RULES):
            raise ValueError(f"{name!r} ({type(module).__name__}): state passing runs gated DeltaNets and Kimi delta "
                             f"attention whose modeling module calls {_CONV} and {' or '.join(_RULES)} (Qwen3-Next, "
                             f"Qwen3.5, OLMo-Hybrid, Kimi Linear, Bailing-hybrid); other mixers run head parallel: use "
                             f"mixers='head_parallel'")

    def apply(self, name: str, module: nn.Module, plan: Plan) -> None:
        found = sys.modules[type(module).__module__]
        if found.__name__ not in _WRAPPED:
            _WRAPPED.add(found.__name__)
            setattr(found, _CONV, _Halo(getattr(found, _CONV)))
            for rule in (r for r in _RULES if hasattr(found, r)):
                setattr(found, rule, _States(getattr(found, rule)))
        _Passing(module, plan.placement, plan.shared("context batch", Batch))


class _Passing:
    """A mixer's hooks: its fragments of this call's sequence on the stack while it runs."""

    def __init__(self, mixer: nn.Module, placement: Placement, batch: Batch) -> None:
        self.batch, self.group = batch, context_group(placement)
        self.rank = placement.coordinate()[0] if placement.coordinate() is not None else 0
        mixer.register_forward_pre_hook(self.enter, with_kwargs=True)
        mixer.register_forward_hook(self.leave, always_call=True)

    def enter(self, mixer: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.batch.padded_before_tokens:
            raise ValueError(PADDED.format(type(mixer).__name__))
        if kwargs.get("cache_params") is not None:
            raise ValueError(f"{type(mixer).__name__}: state passing runs without a cache (training and scoring)")
        _RUNNING.append(_fragments(self.batch.segments, self.rank, self.group))

    def leave(self, mixer: nn.Module, args: tuple, output: object) -> None:
        if _RUNNING:
            _RUNNING.pop()
