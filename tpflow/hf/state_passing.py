"""State passing: context parallelism through linear attention and state spaces with each rank on its own tokens
(``tpf.hf_plan(model, context_parallel=..., mixers="state_passing")``), where head parallelism gathers the sequence
around the mixer. It runs gated DeltaNets (Qwen3-Next, Qwen3.5, OLMo-Hybrid), Kimi delta attention (Kimi Linear,
Bailing-hybrid), Mamba-2 (Nemotron-H, Bamba, Granite-4.0-H, Falcon-H1, Zamba2, Mamba2), Mamba-1 (Mamba,
Falcon-Mamba, Jamba, Zamba's heads) and LFM2's short convolutions.

The mixer runs the model's own code on this rank's fragments of the sequence (the ring's head and tail parts, the
balanced pieces of packed documents, or Ulysses' one part), its heads split over the tensor-parallel ranks alone.
While it runs, the functions of its modeling module that carry tokens forward are wrapped:

- the short convolution (``causal_conv1d_fn``): each fragment gets the ``k - 1`` tokens before it (its halo), from
  the fragments' tails gathered over the context ranks;
- the recurrence, whose state after a fragment is affine in the state before it, ``S_end = M S_0 + F``:

  - the chunked delta rules (``torch_chunk_gated_delta_rule``, KDA's ``chunk_kimi_delta_attention``, or the kernel
    transformers put in its place): each fragment runs once from ``S_0 = [0 | I]`` with ``v = [v | 0]`` (``k``
    identity columns beside its values: the columns evolve apart), its final state ``[F | M]``;
  - Mamba-2's chunked scan (``mamba2_chunk_scan``): ``M`` is one decay per head, the final state of one more
    head-dim row started at ones beside a zero value: the fragment runs once from ``[0 | 1]`` with ``x = [x | 0]``;
  - Mamba-1's selective scan (``mamba_selective_scan``, which takes no initial state): the fragment runs once from
    zero; ``M`` is its per-channel, per-state decay ``exp(A * sum(dt))``, and the incoming state's part of each
    output, ``C_t . (exp(A * cumsum(dt)_t) S_0)``, is added to the output from zero (before the ``z`` gate);

  the fragments' summaries are gathered over the context ranks and combined in sequence order in at least fp32,
  the same on every rank (``S_{j+1} = M_j S_j + F_j``); each fragment of a delta rule or a Mamba-2 scan then runs
  again from its incoming state. The summary runs keep no activations: the backward recomputes them.

The gathers' backward reduce-scatters their gradient: the backward is autograd's, through the same composition. A
layer sends one summary per fragment (the state's size, twice) and the halos, whatever the sequence's length.
Mamba-2's fused training kernel (``mamba2_split_conv1d_scan_combined``, convolution and scan in one) is declined
while the mixer passes its state, so the model takes its unfused path through the two functions above.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tpflow import comm
from tpflow.hf.context_attention import Batch, context_group
from tpflow.hf.delta_net import delta_net_counts, kimi_delta_counts
from tpflow.hf.head_scans import head_scan_counts
from tpflow.hf.mixer_split import PADDED
from tpflow.hf.selective_scan import selective_scan_counts
from tpflow.hf.short_conv import short_conv_channels
from tpflow.hf.state_space import state_space_counts
from tpflow.placement import Placement
from tpflow.plans.style import Plan, Style

__all__ = ["StatePassing"]

_CONV, _FUSED = "causal_conv1d_fn", "mamba2_split_conv1d_scan_combined"
_DELTA_RULES, _CHUNK_SCAN, _SELECTIVE_SCAN = (("torch_chunk_gated_delta_rule", "chunk_kimi_delta_attention"),
                                              "mamba2_chunk_scan", "mamba_selective_scan")
# each mixer state passing runs (found by what it is, as the tensor-parallel styles find it) and the recurrences its
# modeling module must call (one of them), beside its short convolution
_KINDS: list[tuple[Callable[[nn.Module], object], tuple[str, ...]]] = [
    (delta_net_counts, _DELTA_RULES), (kimi_delta_counts, _DELTA_RULES), (state_space_counts, (_CHUNK_SCAN,)),
    (selective_scan_counts, (_SELECTIVE_SCAN,)), (head_scan_counts, (_SELECTIVE_SCAN,)), (short_conv_channels, ())]
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


def _handed_over(frags: _Fragments, summaries: list[torch.Tensor], start: torch.Tensor,
                 step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """The state each of this rank's fragments starts from: every fragment's summary gathered over the context ranks
    and combined from ``start`` in sequence order by ``step(summary, state)``, alike on every rank."""
    every = frags.gather(summaries)
    # (every rank's graph reaches the gather, whose backward brings it the other ranks' gradients of its own
    # summaries: a collective every rank runs, whether or not its tokens read another's summary)
    state, incoming = start + 0 * every.sum(), {}
    for r, i in frags.order:
        if r == frags.rank:
            incoming[i] = state
        state = step(every[r * frags.slots + i], state)
    return [incoming[i] for i in range(len(frags.local))]


def _summary(run: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A fragment's summary run, its activations recomputed in the backward rather than kept."""
    return checkpoint(run, use_reentrant=False) if torch.is_grad_enabled() else run()


class _Rule:
    """A recurrence of the modeling module (``original``), run per fragment while a state-passing mixer runs."""

    def __init__(self, original) -> None:
        self.original = original
        functools.update_wrapper(self, original)

    def __call__(self, *args, **kwargs):
        return self.passed(_RUNNING[-1], *args, **kwargs) if _RUNNING else self.original(*args, **kwargs)


def _refuse_state(name: str, *given) -> None:
    if any(g is not None and g is not False for g in given):
        raise ValueError(f"state passing runs {name} over the whole sequence, from no state, without a cache, "
                         f"cu_seqlens or seq_idx: call the model without them, or use mixers='head_parallel'")


class _DeltaRule(_Rule):
    """A chunked delta rule (gated DeltaNet, KDA): each fragment summarized from ``[0 | I]``, then run again from
    its incoming state."""

    def passed(self, frags: _Fragments, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args,
               initial_state: torch.Tensor | None = None, output_final_state: bool = False, **kwargs):
        if args or not {"g", "beta"} <= set(kwargs):
            raise ValueError("state passing reads the delta rule's g and beta by keyword, as transformers passes "
                             "them: this model passes them otherwise; use mixers='head_parallel'")
        _refuse_state("the delta rule", initial_state, output_final_state, kwargs.get("cu_seqlens"))
        g, beta = kwargs.pop("g"), kwargs.pop("beta")
        batch, heads, (dk, dv) = value.shape[0], value.shape[2], (key.shape[-1], value.shape[-1])

        def run(at: int, n: int, v: torch.Tensor, state: torch.Tensor, final: bool):
            cut = slice(at, at + n)
            return self.original(query[:, cut], key[:, cut], v, g=g[:, cut], beta=beta[:, cut], initial_state=state,
                                 output_final_state=final, **kwargs)

        start = torch.cat((value.new_zeros(batch, heads, dk, dv, dtype=torch.float32),
                           torch.eye(dk, device=value.device).expand(batch, heads, dk, dk)), -1)
        summaries = [_summary(lambda at=at, n=n: run(at, n, torch.cat((value[:, at:at + n], value.new_zeros(
            batch, n, heads, dk)), -1), start, True)[1].float()) for at, _, n in frags.local]
        incoming = _handed_over(frags, summaries, start[..., :dv], lambda s, state: s[..., dv:] @ state + s[..., :dv])
        return torch.cat([run(at, n, value[:, at:at + n], state, False)[0]
                          for (at, _, n), state in zip(frags.local, incoming)], 1), None


class _ChunkScan(_Rule):
    """Mamba-2's chunked scan: each fragment summarized from ``[0 | 1]`` (the head's decay in one more row), then run
    again from its incoming state."""

    def passed(self, frags: _Fragments, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
               C: torch.Tensor, *args, initial_states: torch.Tensor | None = None, return_final_states: bool = False,
               z: torch.Tensor | None = None, **kwargs):
        if args:
            raise ValueError("state passing reads Mamba-2's chunked scan's arguments after C by keyword, as "
                             "transformers passes them: this model passes them otherwise; use "
                             "mixers='head_parallel'")
        _refuse_state("the chunked scan", initial_states, return_final_states, kwargs.get("cu_seqlens"),
                      kwargs.get("seq_idx"))
        batch, heads, dim, size = x.shape[0], x.shape[2], x.shape[3], B.shape[-1]

        def run(at: int, n: int, xs: torch.Tensor, state: torch.Tensor, gate: torch.Tensor | None, final: bool):
            cut = slice(at, at + n)
            return self.original(xs, dt[:, cut], A, B[:, cut], C[:, cut], **kwargs, z=gate, initial_states=state,
                                 return_final_states=final)

        start = x.new_zeros(batch, heads, dim + 1, size, dtype=torch.float32)
        start[:, :, dim] = 1
        summaries = [_summary(lambda at=at, n=n: run(at, n, torch.cat((x[:, at:at + n], x.new_zeros(
            batch, n, heads, 1)), -1), start, None, True)[1].float()) for at, _, n in frags.local]
        incoming = _handed_over(frags, summaries, start[:, :, :dim], lambda s, state: s[:, :, dim:] * state +
                                s[:, :, :dim])
        return torch.cat([run(at, n, x[:, at:at + n], state, None if z is None else z[:, at:at + n], False)
                          for (at, _, n), state in zip(frags.local, incoming)], 1)


class _SelectiveScan(_Rule):
    """Mamba-1's selective scan (no initial state): each fragment run from zero, the incoming state's part of its
    outputs added before the gate."""

    def passed(self, frags: _Fragments, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
               C: torch.Tensor, D: torch.Tensor | None = None, z: torch.Tensor | None = None,
               delta_bias: torch.Tensor | None = None, delta_softplus: bool = False, return_last_state: bool = False,
               **kwargs):
        _refuse_state("the selective scan", return_last_state)
        wide, size = torch.promote_types(x.dtype, torch.float32), A.shape[-1]  # x, dt: [batch, channels, tokens]
        step = dt if delta_bias is None else dt + delta_bias.to(dt.dtype)[..., None]
        step = F.softplus(step) if delta_softplus else step
        outputs, decays, summaries = [], [], []
        for at, _, n in frags.local:
            cut = slice(at, at + n)
            y, last = self.original(x[..., cut], dt[..., cut], A, B[..., cut], C[..., cut], D=D, z=None,
                                    delta_bias=delta_bias, delta_softplus=delta_softplus, return_last_state=True,
                                    **kwargs)
            decay = torch.exp(A.to(wide)[None, :, None] * step[..., cut].to(wide).cumsum(-1)[..., None])
            outputs.append(y), decays.append(decay)  # decay: [batch, channels, tokens, state]
            summaries.append(torch.cat((last.to(wide), decay[:, :, -1]), -1))
        incoming = _handed_over(frags, summaries, summaries[0].new_zeros(summaries[0].shape[:-1] + (size,)),
                                lambda s, state: s[..., size:] * state + s[..., :size])
        out = []
        for (at, _, n), y, decay, state in zip(frags.local, outputs, decays, incoming):
            y = y + torch.einsum("bctn,bcn,bnt->bct", decay, state, C[..., at:at + n].to(wide)).to(y.dtype)
            out.append(y if z is None else y * F.silu(z[..., at:at + n]))
        return torch.cat(out, -1)


class _Unfused:
    """Mamba-2's fused training kernel, declined (None: the model's unfused path) while a mixer passes its state."""

    def __init__(self, original) -> None:
        self.original = original
        functools.update_wrapper(self, original)

    def __call__(self, *args, **kwargs):
        return None if _RUNNING else self.original(*args, **kwargs)


_WRAPPERS = {_CONV: _Halo, _FUSED: _Unfused, _CHUNK_SCAN: _ChunkScan, _SELECTIVE_SCAN: _SelectiveScan,
             **dict.fromkeys(_DELTA_RULES, _DeltaRule)}


@dataclasses.dataclass(frozen=True)
class StatePassing(Style):
    """Plan style for a linear attention or state-space mixer under context parallelism, each rank running it on its
    own tokens with the state the tokens before them leave (see the module docstring); ``tpf.hf_plan(model,
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
        rules = next((rules for counts, rules in _KINDS if counts(module) is not None), None)
        if rules is None or not hasattr(found, _CONV) or (rules and not any(hasattr(found, r) for r in rules)):
            raise ValueError(f"{name!r} ({type(module).__name__}): state passing runs gated DeltaNets, Kimi delta "
                             f"attention, Mamba-2, Mamba-1 and short convolutions whose modeling module calls {_CONV} "
                             f"and, but for the convolutions, {', '.join(_DELTA_RULES)}, {_CHUNK_SCAN} or "
                             f"{_SELECTIVE_SCAN}; other mixers run head parallel: use mixers='head_parallel'")

    def apply(self, name: str, module: nn.Module, plan: Plan) -> None:
        found = sys.modules[type(module).__module__]
        if found.__name__ not in _WRAPPED:
            _WRAPPED.add(found.__name__)
            for function, wrapper in _WRAPPERS.items():
                if hasattr(found, function):
                    setattr(found, function, wrapper(getattr(found, function)))
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
        if kwargs.get("cache_params") is not None or kwargs.get("past_key_values") is not None:
            raise ValueError(f"{type(mixer).__name__}: state passing runs without a cache (training and scoring)")
        _RUNNING.append(_fragments(self.batch.segments, self.rank, self.group))

    def leave(self, mixer: nn.Module, args: tuple, output: object) -> None:
        if _RUNNING:
            _RUNNING.pop()
