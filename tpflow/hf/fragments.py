"""Fragments of the sequence under context parallelism, as a module that mixes tokens on each rank's own tokens sees
them: this rank's runs of consecutive tokens (the ring's head and tail parts, the balanced pieces of packed documents,
Ulysses' one part; runs that continue each other merged) and every rank's, in sequence order. While such a module
runs (``Passing``'s hooks), its fragments are on the ``RUNNING`` stack, where the wrapped functions of its modeling
module read them: the short convolution (``Halo``), each fragment with the ``k - 1`` tokens before it, and the
recurrences of ``tpflow.hf.state_passing``.
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

from tpflow import comm
from tpflow.hf.context_attention import Batch, context_group
from tpflow.hf.mixer_split import PADDED
from tpflow.placement import Placement

__all__ = ["CONV", "RUNNING", "Fragments", "Halo", "Passing", "wrap_functions"]

CONV = "causal_conv1d_fn"  # the short convolution's function in transformers' modeling modules
RUNNING: list[Fragments] = []  # the fragments of the modules running on them now (the innermost last)
_WRAPPED: set[tuple[str, str]] = set()  # (modeling module, function) wrapped (once: others may wrap them after)


@dataclasses.dataclass(frozen=True)
class Fragments:
    """This rank's fragments of the sequence and every rank's, as the gathers lay them out."""

    local: tuple[tuple[int, int, int], ...]  # (offset among this rank's tokens, start in the sequence, length)
    order: tuple[tuple[int, int], ...]  # every fragment in sequence order: (its rank, its index there)
    runs: tuple[tuple[int, int, int], ...]  # every fragment in sequence order: (start, end, its slot in a gather)
    slots: int  # fragments per rank in a gather (the most any rank holds)
    rank: int
    group: dist.ProcessGroup | None
    serial: bool  # the state handed fragment to fragment in sequence order, not summarized

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

    def handed(self, state: torch.Tensor, rank: int) -> torch.Tensor:
        """``rank``'s ``state``, on every rank (gathered over the context ranks: the backward sums its gradient)."""
        world = 1 if self.group is None else dist.get_world_size(self.group)
        return comm.gather_shared(state[None], 0, world, self.group)[rank]


@functools.lru_cache(maxsize=8)
def fragments(segments: tuple, rank: int, group: dist.ProcessGroup | None, serial: bool) -> Fragments:
    """The fragments of a batch's ``segments`` (each rank's ``(start, length)`` parts, in its tokens' order)."""
    runs = [_coalesced(parts) for parts in segments]
    slots = max(len(r) for r in runs)
    order = sorted((start, n, r, i) for r, parts in enumerate(runs) for i, (start, n) in enumerate(parts))
    local, at = [], 0
    for start, n in runs[rank]:
        local.append((at, start, n))
        at += n
    return Fragments(tuple(local), tuple((r, i) for _, _, r, i in order),
                     tuple((start, start + n, r * slots + i) for start, n, r, i in order), slots, rank, group, serial)


def _coalesced(parts) -> list[tuple[int, int]]:
    """Segments laid end to end, runs that continue each other in the sequence merged."""
    runs: list[tuple[int, int]] = []
    for start, n in parts:
        if runs and runs[-1][0] + runs[-1][1] == start:
            runs[-1] = (runs[-1][0], runs[-1][1] + n)
        else:
            runs.append((start, n))
    return runs


class Halo:
    """The modeling module's short convolution, each fragment with the ``k - 1`` tokens before it."""

    def __init__(self, original) -> None:
        self.original = original

    def __call__(self, hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 activation: str | None = None, **kwargs) -> torch.Tensor:
        if not RUNNING:
            return self.original(hidden_states, weight, bias, activation, **kwargs)
        frags, k, x = RUNNING[-1], weight.shape[-1] - 1, hidden_states  # x: [batch, channels, tokens]
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


class Passing:
    """A module's hooks: its fragments of this call's sequence on the stack while it runs (refused: rows padded before
    their tokens, whose padding the module would carry into its tokens, and a cache)."""

    def __init__(self, mixer: nn.Module, placement: Placement, batch: Batch, serial: bool) -> None:
        self.batch, self.group, self.serial = batch, context_group(placement), serial
        self.rank = placement.coordinate()[0] if placement.coordinate() is not None else 0
        mixer.register_forward_pre_hook(self.enter, with_kwargs=True)
        mixer.register_forward_hook(self.leave, always_call=True)

    def enter(self, mixer: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.batch.padded_before_tokens:
            raise ValueError(PADDED.format(type(mixer).__name__))
        if kwargs.get("cache_params") is not None or kwargs.get("past_key_values") is not None:
            raise ValueError(f"{type(mixer).__name__}: under context parallelism it runs on each rank's tokens without "
                             f"a cache (training and scoring)")
        RUNNING.append(fragments(self.batch.segments, self.rank, self.group, self.serial))

    def leave(self, mixer: nn.Module, args: tuple, output: object) -> None:
        if RUNNING:
            RUNNING.pop()


def wrap_functions(module: nn.Module, wrappers: dict[str, Callable]) -> None:
    """Wrap the functions of ``module``'s modeling module that ``wrappers`` names (each by its wrapper, given the
    function), each once."""
    found = sys.modules[type(module).__module__]
    for function, wrapper in wrappers.items():
        if hasattr(found, function) and (found.__name__, function) not in _WRAPPED:
            _WRAPPED.add((found.__name__, function))
            setattr(found, function, wrapper(getattr(found, function)))
