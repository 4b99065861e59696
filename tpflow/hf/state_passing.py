"""State passing: context parallelism through linear attention and state spaces with each rank on its own tokens
(``tpf.hf_plan(model, context_parallel=..., mixers="state_passing")``), where head parallelism gathers the sequence
around the mixer. It runs gated DeltaNets (Qwen3-Next, Qwen3.5, OLMo-Hybrid), Kimi delta attention (Kimi Linear,
Bailing-hybrid), Mamba-2 (Nemotron-H, Bamba, Granite-4.0-H, Falcon-H1, Zamba2, Mamba2), Mamba-1 (Mamba,
Falcon-Mamba, Jamba, Zamba's heads), MiniMax's lightning attention and LFM2's short convolutions.

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
  - MiniMax's lightning attention, whose blocks run inline in its forward (``_Lightning``): its masked q, k, v read
    from ``apply_mask_to_padding_states``, its summary ``M = exp(-s n)`` per head, and each fragment's missing part
    of the state, ``(q_t exp(-s (t + 1))) (S_0 - S_run)``, added where its outputs enter its norm;

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
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tpflow.hf.context_attention import Batch
from tpflow.hf.delta_net import delta_net_counts, kimi_delta_counts
from tpflow.hf.fragments import CONV, RUNNING, Fragments, Halo, Passing, running, wrap_functions
from tpflow.hf.head_scans import head_scan_counts
from tpflow.hf.lightning import lightning_counts
from tpflow.hf.selective_scan import selective_scan_counts
from tpflow.hf.short_conv import short_conv_channels
from tpflow.hf.state_space import state_space_counts
from tpflow.plans.style import Plan, Style

__all__ = ["StatePassing"]

_FUSED = "mamba2_split_conv1d_scan_combined"
RULE = "recurrence"  # what a mixer with one must call while it runs (``Passing``'s check): one of its kind's
_DELTA_RULES, _CHUNK_SCAN, _SELECTIVE_SCAN = (("torch_chunk_gated_delta_rule", "chunk_kimi_delta_attention"),
                                              "mamba2_chunk_scan", "mamba_selective_scan")
_LIGHTNING_INPUTS = "apply_mask_to_padding_states"  # MiniMax's q, k, v as its lightning attention's blocks read them
# each mixer state passing runs (found by what it is, as the tensor-parallel styles find it) and the recurrences its
# modeling module must call (one of them), beside its short convolution (MiniMax's lightning attention: none)
_KINDS: list[tuple[Callable[[nn.Module], object], tuple[str, ...]]] = [
    (delta_net_counts, _DELTA_RULES), (kimi_delta_counts, _DELTA_RULES), (state_space_counts, (_CHUNK_SCAN,)),
    (selective_scan_counts, (_SELECTIVE_SCAN,)), (head_scan_counts, (_SELECTIVE_SCAN,)), (short_conv_channels, ()),
    (lightning_counts, (_LIGHTNING_INPUTS,))]


def _handed_over(frags: Fragments, summaries: list[torch.Tensor], start: torch.Tensor,
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


Run = Callable[[int, int, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor | None]]


def _passed(frags: Fragments, summary: Callable[[int, int], torch.Tensor], run: Run, start: torch.Tensor,
            step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], dim: int, inputs: tuple[torch.Tensor, ...],
            recompute: bool = True) -> torch.Tensor:
    """This rank's outputs of a recurrence, its fragments concatenated along ``dim``: ``run(at, n, state, final)``
    runs the fragment of ``n`` tokens at ``at`` from ``state`` (its outputs, and its final state when ``final``);
    ``summary(at, n)`` is its ``[F | M]``, which ``step`` applies to a state; ``inputs``, the recurrence's.

    In parallel, each fragment's summary (with ``recompute``, its activations recomputed in the backward rather
    than kept) gathered and combined, then each fragment run from its incoming state. Serially, the fragments run in
    sequence order, each from the state the one before it leaves, handed from its rank to every rank (the state one
    device has there: bitwise its outputs where the fragments start on the recurrence's chunk boundaries)."""
    if not frags.serial:
        recompute = recompute and torch.is_grad_enabled()
        summaries = [checkpoint(summary, at, n, use_reentrant=False) if recompute else summary(at, n)
                     for at, _, n in frags.local]
        return torch.cat([run(at, n, state, False)[0] for (at, _, n), state in
                          zip(frags.local, _handed_over(frags, summaries, start, step))], dim)
    out, state, last = {}, start, frags.order[-1]
    # (every rank's piece of each hand-over reads the inputs and the state before: on every rank alike, the backward
    # runs every hand-over's gather, in sequence order reversed, before the gathers that made the inputs)
    tie = sum(0 * t.sum() for t in inputs if t.requires_grad)
    for r, i in frags.order:
        if r == frags.rank:
            at, _, n = frags.local[i]
            out[i], final = run(at, n, state, (r, i) != last)
        if (r, i) != last:
            mine = final.to(state.dtype) if r == frags.rank else torch.zeros_like(state)
            state = frags.handed(mine + 0 * state + tie, r)
    return torch.cat([out[i] for i in range(len(frags.local))], dim) + 0 * state.sum()


class _Rule:
    """A recurrence of the modeling module (``original``), run per fragment while a state-passing mixer runs."""

    def __init__(self, original) -> None:
        self.original = original
        functools.update_wrapper(self, original, updated=())  # (not its attributes: a recorder's)

    def __call__(self, *args, **kwargs):
        now = running()
        if now is None:
            return self.original(*args, **kwargs)
        with now.calling(RULE) as frags:
            return self.passed(frags, *args, **kwargs)


def _refuse_state(name: str, *given) -> None:
    if any(g is not None and g is not False for g in given):
        raise ValueError(f"state passing runs {name} over the whole sequence, from no state, without a cache, "
                         f"cu_seqlens or seq_idx: call the model without them, or use mixers='head_parallel'")


class _DeltaRule(_Rule):
    """A chunked delta rule (gated DeltaNet, KDA): a fragment's summary, its final state from ``[0 | I]`` with ``k``
    zero columns beside its values."""

    def passed(self, frags: Fragments, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args,
               initial_state: torch.Tensor | None = None, output_final_state: bool = False, **kwargs):
        if args or not {"g", "beta"} <= set(kwargs):
            raise ValueError("state passing reads the delta rule's g and beta by keyword, as transformers passes "
                             "them: this model passes them otherwise; use mixers='head_parallel'")
        _refuse_state("the delta rule", initial_state, output_final_state, kwargs.get("cu_seqlens"))
        g, beta = kwargs.pop("g"), kwargs.pop("beta")
        batch, heads, (dk, dv) = value.shape[0], value.shape[2], (key.shape[-1], value.shape[-1])
        start = torch.cat((value.new_zeros(batch, heads, dk, dv, dtype=torch.float32),
                           torch.eye(dk, device=value.device).expand(batch, heads, dk, dk)), -1)

        def run(at: int, n: int, state: torch.Tensor, final: bool, v: torch.Tensor | None = None):
            cut = slice(at, at + n)
            return self.original(query[:, cut], key[:, cut], value[:, cut] if v is None else v, g=g[:, cut],
                                 beta=beta[:, cut], initial_state=state, output_final_state=final, **kwargs)

        def summary(at: int, n: int) -> torch.Tensor:
            v = torch.cat((value[:, at:at + n], value.new_zeros(batch, n, heads, dk)), -1)
            return run(at, n, start, True, v)[1].float()

        return _passed(frags, summary, run, start[..., :dv], lambda s, state: s[..., dv:] @ state + s[..., :dv],
                       1, (query, key, value, g, beta)), None


class _ChunkScan(_Rule):
    """Mamba-2's chunked scan: a fragment's summary, its final state from ``[0 | 1]`` (the head's decay in one more
    head-dim row, beside a zero input)."""

    def passed(self, frags: Fragments, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
               C: torch.Tensor, *args, initial_states: torch.Tensor | None = None, return_final_states: bool = False,
               z: torch.Tensor | None = None, **kwargs):
        if args:
            raise ValueError("state passing reads Mamba-2's chunked scan's arguments after C by keyword, as "
                             "transformers passes them: this model passes them otherwise; use "
                             "mixers='head_parallel'")
        _refuse_state("the chunked scan", initial_states, return_final_states, kwargs.get("cu_seqlens"),
                      kwargs.get("seq_idx"))
        batch, heads, dim, size = x.shape[0], x.shape[2], x.shape[3], B.shape[-1]
        start = x.new_zeros(batch, heads, dim + 1, size, dtype=torch.float32)
        start[:, :, dim] = 1

        def run(at: int, n: int, state: torch.Tensor, final: bool, xs: torch.Tensor | None = None):
            cut = slice(at, at + n)
            out = self.original(x[:, cut] if xs is None else xs, dt[:, cut], A, B[:, cut], C[:, cut], **kwargs,
                                z=None if z is None or xs is not None else z[:, cut], initial_states=state,
                                return_final_states=final)
            return out if final else (out, None)

        def summary(at: int, n: int) -> torch.Tensor:
            return run(at, n, start, True, torch.cat((x[:, at:at + n], x.new_zeros(batch, n, heads, 1)), -1))[1].float()

        return _passed(frags, summary, run, start[:, :, :dim], lambda s, state: s[:, :, dim:] * state + s[:, :, :dim],
                       1, (x, dt, B, C))


class _SelectiveScan(_Rule):
    """Mamba-1's selective scan (no initial state): a fragment run from zero, the incoming state's part of its
    outputs, ``C_t . (exp(A * cumsum(dt)_t) S_0)``, added before the gate; its summary ``[F | exp(A * sum(dt))]``."""

    def passed(self, frags: Fragments, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
               C: torch.Tensor, D: torch.Tensor | None = None, z: torch.Tensor | None = None,
               delta_bias: torch.Tensor | None = None, delta_softplus: bool = False, return_last_state: bool = False,
               **kwargs):
        _refuse_state("the selective scan", return_last_state)
        wide, size = torch.promote_types(x.dtype, torch.float32), A.shape[-1]  # x, dt: [batch, channels, tokens]
        step = dt if delta_bias is None else dt + delta_bias.to(dt.dtype)[..., None]
        step = F.softplus(step) if delta_softplus else step

        @functools.cache
        def from_zero(at: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            """The fragment's outputs from zero (ungated), final state and decays ``[batch, channels, tokens,
            state]``."""
            cut = slice(at, at + n)
            y, last = self.original(x[..., cut], dt[..., cut], A, B[..., cut], C[..., cut], D=D, z=None,
                                    delta_bias=delta_bias, delta_softplus=delta_softplus, return_last_state=True,
                                    **kwargs)
            decay = torch.exp(A.to(wide)[None, :, None] * step[..., cut].to(wide).cumsum(-1)[..., None])
            return y, last.to(wide), decay

        def run(at: int, n: int, state: torch.Tensor, final: bool):
            y, last, decay = from_zero(at, n)
            y = y + torch.einsum("bctn,bcn,bnt->bct", decay, state, C[..., at:at + n].to(wide)).to(y.dtype)
            return y if z is None else y * F.silu(z[..., at:at + n]), decay[:, :, -1] * state + last

        def summary(at: int, n: int) -> torch.Tensor:
            _, last, decay = from_zero(at, n)
            return torch.cat((last, decay[:, :, -1]), -1)

        start = x.new_zeros(x.shape[0], x.shape[1], size, dtype=wide)
        return _passed(frags, summary, run, start, lambda s, state: s[..., size:] * state + s[..., :size], -1,
                       (x, dt, B, C), recompute=False)  # (the summary is the run's own: nothing to recompute)


class _Unfused(_Rule):
    """Mamba-2's fused training kernel, declined (None: the model's unfused path) while a mixer passes its state."""

    def __call__(self, *args, **kwargs):
        return None if RUNNING else self.original(*args, **kwargs)


class _Held(_Rule):
    """A function whose output the module's hooks read (MiniMax's masked q, k, v), held on its ``Running``."""

    def __call__(self, *args, **kwargs):
        now, out = running(), self.original(*args, **kwargs)
        if now is not None:
            now.held.append(out)
        return out


class _Lightning:
    """MiniMax's lightning attention, whose blocks run inline in its forward from a zero state on this rank's tokens
    laid end to end: where its outputs enter its norm, each fragment's gets the part of the state it should have
    started from that it did not, ``(q_t * exp(-s (t + 1))) (S_in - S_run)`` (``s`` its head's decay rate, ``t`` the
    token's place in the fragment, ``S_run`` the state the blocks carried in from this rank's fragments before);
    its summary ``[sum_t exp(-s (n - 1 - t)) k_t^T v_t | exp(-s n)]`` from the q, k, v its blocks read."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        module.norm.register_forward_pre_hook(self.corrected)

    def corrected(self, norm: nn.Module, args: tuple) -> tuple | None:
        now = running()
        if now is None or len(now.held) != 1:  # (none held: its function replaced, which ``Passing`` names)
            return None
        with now.calling(RULE) as frags:
            return (args[0] + self.correction(frags, now.held.pop()).to(args[0].dtype),) + args[1:]

    def correction(self, frags: Fragments, qkv: torch.Tensor) -> torch.Tensor:
        batch, tokens = qkv.shape[:2]
        heads, dim, wide = self.module.num_attention_heads, self.module.head_dim, torch.promote_types(qkv.dtype,
                                                                                                       torch.float32)
        q, k, v = qkv.view(batch, tokens, heads, 3 * dim).to(wide).transpose(1, 2).split(dim, -1)  # [b, h, t, d]
        rate = self.module.slope_rate.to(wide)  # [heads, 1, 1]: this rank's heads'

        def decays(first: int, n: int) -> torch.Tensor:  # exp(-s * (first .. first + n - 1)): [heads, n, 1]
            return torch.exp(-rate * torch.arange(first, first + n, device=q.device, dtype=wide)[:, None])

        def summary(at: int, n: int) -> torch.Tensor:
            keys = k[:, :, at:at + n] * decays(0, n).flip(1)
            return torch.cat(((keys.transpose(-1, -2) @ v[:, :, at:at + n]),
                              torch.exp(-rate * n).expand(batch, heads, dim, 1)), -1)

        def step(made: torch.Tensor, state: torch.Tensor) -> torch.Tensor:  # [F | exp(-s n)] applied to a state
            return made[..., -1:] * state + made[..., :-1]

        start = q.new_zeros(batch, heads, dim, dim)
        summaries = [checkpoint(summary, at, n, use_reentrant=False) if torch.is_grad_enabled() else summary(at, n)
                     for at, _, n in frags.local]
        carried, out = start, []
        for (at, _, n), state, made in zip(frags.local, _handed_over(frags, summaries, start, step), summaries):
            out.append((q[:, :, at:at + n] * decays(1, n)) @ (state - carried))
            carried = step(made, carried)
        return torch.cat(out, 2).transpose(1, 2).reshape(batch, tokens, heads * dim)


_WRAPPERS = {CONV: Halo, _FUSED: _Unfused, _CHUNK_SCAN: _ChunkScan, _SELECTIVE_SCAN: _SelectiveScan,
             **dict.fromkeys(_DELTA_RULES, _DeltaRule)}


@dataclasses.dataclass(frozen=True)
class StatePassing(Style):
    """Plan style for a linear attention or state-space mixer under context parallelism, each rank running it on its
    own tokens with the state the tokens before them leave (see the module docstring); ``tpf.hf_plan(model,
    context_parallel=..., mixers="state_passing")`` stacks it on each mixer's tensor-parallel entry, beside
    ``ContextParallel`` (``mixers="state_passing_serial"``: ``serial=True``).

    Args:
        serial: hand the state from fragment to fragment in sequence order, each rank waiting for the ranks before
            it (one device's arithmetic: bitwise its recurrence's outputs where the fragments start on the
            recurrence's chunk boundaries), rather than combine every fragment's summary at once.

    Example::

        >>> from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
        >>> model = Qwen3NextForCausalLM(Qwen3NextConfig(
        ...     vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        ...     num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        ...     linear_key_head_dim=8, linear_value_head_dim=8, num_experts=0, layer_types=["linear_attention",
        ...     "full_attention"]))
        >>> plan = tpf.hf_plan(model, context_parallel="ring", mixers="state_passing")
        >>> plan["model.layers.*.linear_attn"].entries[1]
        StatePassing(serial=False)
    """

    serial: bool = False

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        found = sys.modules[type(module).__module__]
        kind = plan.shared(("state passing", name), lambda: next((counts for counts, _ in _KINDS
                                                                 if counts(module) is not None), None))
        rules = dict(_KINDS).get(kind)
        if kind is None or not (kind is lightning_counts or hasattr(found, CONV)) or (
                rules and not any(hasattr(found, r) for r in rules)):
            raise ValueError(f"{name!r} ({type(module).__name__}): state passing runs gated DeltaNets, Kimi delta "
                             f"attention, Mamba-2, Mamba-1 and short convolutions whose modeling module calls {CONV} "
                             f"and, but for the convolutions, {', '.join(_DELTA_RULES)}, {_CHUNK_SCAN} or "
                             f"{_SELECTIVE_SCAN}, and MiniMax's lightning attention; other mixers run head parallel: "
                             f"use mixers='head_parallel'")
        if kind is lightning_counts and self.serial:
            raise ValueError(f"{name!r}: MiniMax's lightning attention runs its blocks inline from a zero state, so "
                             f"state passing adds the incoming state's part to its outputs, never one device's "
                             f"arithmetic as the serial mode promises: use mixers='state_passing'")

    def apply(self, name: str, module: nn.Module, plan: Plan) -> None:
        kind = plan.shared(("state passing", name), lambda: None)  # (check's: the split mixer counts otherwise)
        rules = dict(_KINDS)[kind]
        if kind is lightning_counts:
            wrap_functions(module, {_LIGHTNING_INPUTS: _Held})
            _Lightning(module)
        else:
            wrap_functions(module, _WRAPPERS)
        Passing(module, plan.placement, plan.shared("context batch", Batch), self.serial, RULE if rules else CONV,
                " or ".join(rules or (CONV,)))
