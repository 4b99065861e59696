"""Fragments of the sequence under context parallelism, as a module that mixes tokens on each rank's own tokens sees
them: this rank's runs of consecutive tokens (the ring's head and tail parts, the balanced pieces of packed documents,
Ulysses' one part; runs that continue each other merged) and every rank's, in sequence order. While such a module
runs (``Passing``'s hooks), its fragments are on the ``RUNNING`` stack, where the wrapped functions of its modeling
module read them: the short convolution (``Halo``), each fragment with the ``k - 1`` tokens before it, and the
recurrences of ``tpflow.hf.state_passing``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpflow import comm
from tpflow.hf.context_attention import Batch, context_group
from tpflow.hf.mixer_split import PADDED
from tpflow.placement import Placement

__all__ = ["CONV", "RUNNING", "Fragments", "Halo", "Passing", "Running", "running", "wrap_functions"]

CONV = "causal_conv1d_fn"  # the short convolution's function in transformers' modeling modules


@dataclasses.dataclass(frozen=True)
class Fragments:
    """This rank's fragments of the sequence and every rank's, as the gathers lay them out (``fragments`` makes them).

    Args:
        local: this rank's fragments: (offset among its tokens, start in the sequence, length).
        order: every fragment in sequence order: (its rank, its index there).
        runs: every fragment in sequence order: (start, end, its slot in a gather).
        slots: fragments per rank in a gather (the most any rank holds).
        rank: this rank's index in the context group.
        group: the context group (None: one rank).
        serial: the state handed fragment to fragment in sequence order, not summarized.

    Example::

        >>> frags = fragments((((0, 4), (12, 4)), ((4, 4), (8, 4))), 0, None, False)   # the ring's cut of 16
        >>> frags.local, frags.order
        (((0, 0, 4), (4, 12, 4)), ((0, 0), (1, 0), (0, 1)))
        >>> frags.halo(12, 3)                  # tokens 9-11: the last 3 of rank 1's tail, in gather slot 2
        [6, 7, 8]
    """

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
    """The fragments of a batch's ``segments``, runs that continue each other merged.

    Args:
        segments: each context rank's ``(start, length)`` parts of the sequence, in its tokens' order.
        rank: this rank's index among them.
        group: the context group (None: one rank).
        serial: hand the state from fragment to fragment (``Fragments.serial``).

    Returns:
        The ``Fragments``.

    Example::

        >>> fragments((((0, 8),), ((8, 8),)), 1, None, False).local         # Ulysses' parts of 16 tokens
        ((0, 8, 8),)
    """
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


@dataclasses.dataclass
class Running:
    """A module running on its fragments: what the wrapped functions of its modeling module read, and which of them
    it called.

    Args:
        fragments: its fragments of this call's sequence.
        called: the wrapped functions it called (what ``calling`` recorded).
        inside: a wrapped function runs: one it calls (a wrapper wrapped again) runs as the original.
        held: what wrapped functions returned for the module's hooks to read.

    Example::

        >>> now = Running(fragments((((0, 16),),), 0, None, False))
        >>> with now.calling(CONV) as frags:
        ...     running() is None                   # inside: a wrapper beneath calls its original
        True
        >>> now.called
        {'causal_conv1d_fn'}
    """

    fragments: Fragments
    called: set[str] = dataclasses.field(default_factory=set)
    inside: bool = False  # a wrapped function runs: one it calls (a wrapper wrapped again) runs as the original
    held: list[torch.Tensor] = dataclasses.field(default_factory=list)  # wrapped functions' outputs, for its hooks

    @contextlib.contextmanager
    def calling(self, function: str) -> Iterator[Fragments]:
        """While the wrapper of ``function`` runs the fragments."""
        self.called.add(function)
        self.inside = True
        try:
            yield self.fragments
        finally:
            self.inside = False


RUNNING: list[Running] = []  # the modules running on their fragments now (the innermost last)


def running() -> Running | None:
    """The module running on its fragments now, where a wrapper is to split its call.

    Returns:
        The innermost ``Running`` on ``RUNNING``; None where none runs, or a wrapper runs already (call the original).

    Example::

        >>> running() is None                       # no mixer running on its fragments
        True
    """
    return RUNNING[-1] if RUNNING and not RUNNING[-1].inside else None


class Halo:
    """The modeling module's short convolution (``causal_conv1d_fn``) wrapped: while a module runs on its fragments,
    each fragment convolved with the ``k - 1`` tokens before it, from every fragment's tail gathered over the context
    ranks; the original otherwise.

    Args:
        original: the function wrapped.

    Example::

        >>> conv = Halo(lambda x, weight, bias=None, activation=None: x + 1)
        >>> conv(torch.zeros(1, 2, 3), torch.ones(2, 4))                      # no module running: the original
        tensor([[[1., 1., 1.],
                 [1., 1., 1.]]])
    """

    def __init__(self, original) -> None:
        self.original = original
        functools.update_wrapper(self, original, updated=())  # (not its attributes: a recorder's)

    def __call__(self, hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 activation: str | None = None, **kwargs) -> torch.Tensor:
        now = running()
        if now is None:
            return self.original(hidden_states, weight, bias, activation, **kwargs)
        with now.calling(CONV) as frags:
            if weight.shape[-1] == 1:  # (no token before is read)
                return self.original(hidden_states, weight, bias, activation, **kwargs)
            return self._halo(frags, hidden_states, weight, bias, activation, **kwargs)

    def _halo(self, frags: Fragments, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              activation: str | None, **kwargs) -> torch.Tensor:
        k = weight.shape[-1] - 1  # x: [batch, channels, tokens]
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
    their tokens, whose padding the module would carry into its tokens, and a cache); once it ran, the wrapped
    function it must call (``expects``) must have run on them, else it ran on this rank's tokens alone (the function
    replaced after ``parallelize``), which is an error.

    Args:
        mixer: the module.
        placement: the plan's placement (its first axis the context ranks).
        batch: the context plan's ``Batch`` (this call's segments and padding).
        serial: hand the state from fragment to fragment.
        expects: what ``Running.calling`` records for the function the module must call.
        named: that function's name (or names), for the error.

    Example::

        >>> from transformers import Lfm2Config, Lfm2ForCausalLM
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> model = Lfm2ForCausalLM(Lfm2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        ...                                    num_attention_heads=4, num_key_value_heads=2,
        ...                                    layer_types=["conv", "full_attention"]))
        >>> plan = tpf.hf_plan(model, context_parallel="ring", mixers="state_passing")
        >>> model = tpf.parallelize(model, placement=tpf.placement("cpu", ranks=[0, 1]), plan=plan)
        >>> ids = torch.arange(16)[None] * 3 % 64
        >>> model(ids, labels=ids).loss.dim()        # each rank's 8 tokens, its short convolution given their halo
        0
    """

    def __init__(self, mixer: nn.Module, placement: Placement, batch: Batch, serial: bool, expects: str,
                 named: str) -> None:
        self.batch, self.group, self.serial = batch, context_group(placement), serial
        self.expects, self.named = expects, named  # (what ``Running.calling`` records, and its functions' names)
        self.rank = placement.coordinate()[0] if placement.coordinate() is not None else 0
        mixer.register_forward_pre_hook(self.enter, with_kwargs=True)
        mixer.register_forward_hook(self.check)
        mixer.register_forward_hook(self.leave, always_call=True)

    def enter(self, mixer: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.batch.padded_before_tokens:
            raise ValueError(PADDED.format(type(mixer).__name__))
        if kwargs.get("cache_params") is not None or kwargs.get("past_key_values") is not None:
            raise ValueError(f"{type(mixer).__name__}: under context parallelism it runs on each rank's tokens without "
                             f"a cache (training and scoring)")
        RUNNING.append(Running(fragments(self.batch.segments, self.rank, self.group, self.serial)))

    def check(self, mixer: nn.Module, args: tuple, output: object) -> None:
        if self.expects not in RUNNING[-1].called:
            raise ValueError(f"{type(mixer).__name__} ran without calling its modeling module's {self.named} as "
                             f"tpflow wrapped it (replaced after tpf.parallelize?): it ran on this rank's tokens "
                             f"alone, without the state the tokens before them leave. Replace it before parallelize")

    def leave(self, mixer: nn.Module, args: tuple, output: object) -> None:
        if RUNNING:
            RUNNING.pop()


def wrap_functions(module: nn.Module, wrappers: dict[str, Callable]) -> None:
    """Wrap the functions of ``module``'s modeling module that ``wrappers`` names (each by its wrapper class, given
    the function), where it is not that wrapper already (a function replaced, or wrapped by another since, is wrapped
    again: the wrapper beneath runs as the original, ``Running.inside``).

    Args:
        module: a module of a transformers model.
        wrappers: function names to wrapper classes.

    Example::

        >>> from transformers import Lfm2Config, Lfm2ForCausalLM
        >>> model = Lfm2ForCausalLM(Lfm2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        ...                                    num_attention_heads=4, num_key_value_heads=2, layer_types=["conv"]))
        >>> wrap_functions(model.model.layers[0].conv, {CONV: Halo})
        >>> type(sys.modules[type(model.model.layers[0].conv).__module__].causal_conv1d_fn).__name__
        'Halo'
    """
    found = sys.modules[type(module).__module__]
    for function, wrapper in wrappers.items():
        if hasattr(found, function) and not isinstance(getattr(found, function), wrapper):
            setattr(found, function, wrapper(getattr(found, function)))
