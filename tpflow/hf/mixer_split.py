"""What every token mixer split over the tensor-parallel ranks does around the model's own code (a Mamba-2 mixer, a
gated DeltaNet): its parameters read as this rank's blocks, its input whole on every rank (its gradient, each rank's
partial sum, summed), its output this rank's partial sum (summed), parameters whole on every rank (a norm's weight
shared by every head) read for this rank's heads (their gradients summed), and rows that several ranks compute with
whole (a group's B / C, a key head's q / k) stored split over those ranks and gathered around each call."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate

from tpflow import comm
from tpflow.global_tensor import gradients
from tpflow.global_tensor.local_blocks import LocalReads
from tpflow.global_tensor.segments import Segments, segment
from tpflow.hf.context_attention import Batch
from tpflow.hf.heads import split_parameter
from tpflow.layers.regions import WHOLE, tag
from tpflow.placement import Placement, nested_index, placement
from tpflow.plans.style import Plan, Style
from tpflow.sbp import broadcast, split

__all__ = ["PADDED", "Gathered", "HeadRanks", "MixerStyle", "SplitMixer", "broadcast_parameter", "refuse_undivided",
           "sharing_group"]


PADDED = ("{} carries a state from token to token, which one device may keep the padding out of by its mask; "
          "under context parallelism it gets no padding mask, and padding before a row's tokens would reach their "
          "state: pad the rows on the right, pack them (position_ids restarting at each document), or train with "
          "tensor parallelism")


def broadcast_parameter(module: nn.Module, name: str, pl: Placement) -> None:
    """Make ``module``'s parameter ``name`` a global tensor whole on every rank here (left to ``parallelize``, a
    parameter of a module whose input is whole would get its gradient summed over the ranks again).

    Args:
        module: the module holding it.
        name: its name there.
        pl: the placement.

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> norm = nn.LayerNorm(4)
        >>> broadcast_parameter(norm, "weight", P)
        >>> norm.weight.placements
        (Replicate(),)
    """
    full = module._parameters[name]
    if pl.coordinate() is None:
        local = torch.empty(0, dtype=full.dtype)
    else:  # (on the meta device: allocated, for a checkpoint to fill)
        local = torch.empty(full.shape, dtype=full.dtype) if full.is_meta else full.detach().clone()
    value = DTensor.from_local(local.to(pl.device), pl.mesh, [Replicate()] * pl.ndim, run_check=False,
                               shape=full.shape, stride=full.stride())
    setattr(module, name, gradients.adopt(nn.Parameter(value, requires_grad=full.requires_grad)))


def refuse_undivided(name: str, what: str, count: int, world: int,
                     ranks: str = "tensor-parallel ranks") -> None:
    """Raise, naming the degrees that divide them, where ``count`` heads or channels do not split over ``world``.

    Args:
        name: the module's name.
        what: what the count counts ("heads", "inner channels (d_inner)", ...).
        count: how many there are.
        world: the ranks they split over.
        ranks: what those ranks are, for the message.

    Example::

        >>> refuse_undivided("m", "heads", 6, 4)
        Traceback (most recent call last):
        ...
        ValueError: 'm' has 6 heads, which do not split over 4 tensor-parallel ranks: use a degree among [1, 2, 3, 6]
    """
    if count % world:
        degrees = [d for d in range(1, count + 1) if count % d == 0]
        raise ValueError(f"{name!r} has {count} {what}, which do not split over {world} {ranks}: use "
                         f"a degree among {degrees}")


def sharing_group(pl: Placement, parts: int) -> dist.ProcessGroup:
    """The process group of this rank and the neighbours that share its part when the tensor-parallel ranks are cut
    in ``parts`` parts of consecutive ranks (a state space's B / C group, a key head): the tensor-parallel group for
    one part. Every rank of the world calls it alike (it makes groups); a rank outside ``pl`` gets None.

    Args:
        pl: the placement; its last axis is the tensor-parallel one, a multiple of ``parts``.
        parts: the parts.

    Returns:
        The group, or None outside ``pl``.

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> torch.distributed.get_world_size(sharing_group(P, 1))
        2
    """
    world = pl.hierarchy[-1]
    if parts == 1:
        return pl.mesh.get_group(pl.ndim - 1) if pl.coordinate() is not None else None
    ranks = torch.tensor(pl.flat_ranks).reshape(*pl.hierarchy[:-1], parts, world // parts)
    parted = placement(pl.type, ranks=ranks.tolist())  # (its groups made on every rank, in the same order)
    return parted.mesh.get_group(pl.ndim) if parted.coordinate() is not None else None


def _flat(pl: Placement) -> Placement:
    """``pl``'s ranks as one axis, in its flat order."""
    return placement(pl.type, ranks=pl.flat_ranks)


class HeadRanks:
    """The ranks a mixer's heads split over: the placement's last axis (tensor parallelism), or, under context
    parallelism, every axis (``(context, tensor)``: rank ``(c, t)`` holds head block ``c * T + t`` of ``C * T``,
    each parameter split over both axes, DTensor's nesting), the sequence gathered over the context axis around the
    mixer. The parameters' gradients are each rank's own: the mixer sees every token.

    Args:
        placement: the plan's placement (its last axis tensor parallel).
        context: the context-parallel batch (``tpflow.hf.context_attention.Batch``: every rank's segments of the
            sequence), or None: tensor parallelism alone.

    Example::

        >>> P = tpf.placement("cpu", [[0], [1]])                     # (context, tensor) = (2, 1)
        >>> ranks = HeadRanks(P, context=Batch())
        >>> ranks.world, ranks.index, ranks.placements(0)           # on rank 1: the context axis splits it
        (2, 1, (sbp.split(dim=0), sbp.broadcast))
    """

    def __init__(self, placement: Placement, context: Batch | None = None) -> None:
        self.placement, self.context = placement, context
        every = tuple(a for a in range(placement.ndim) if placement.hierarchy[a] > 1) or (placement.ndim - 1,)
        self.axes = every if context is not None else (placement.ndim - 1,)
        self.world = math.prod(placement.hierarchy[a] for a in self.axes)
        coord = placement.coordinate()
        self.index = None if coord is None else nested_index(coord, placement.hierarchy, self.axes)
        # the flat placement of every rank of the grid: its group made on every rank of the world, in the same order
        self.flat = placement if context is None else _flat(placement)
        self.group = None if coord is None or self.world == 1 else self._group()

    def _group(self) -> dist.ProcessGroup:
        """The group of the heads' ranks, in flat order (every rank of the placement under context parallelism)."""
        if self.context is None:
            return self.placement.mesh.get_group(self.placement.ndim - 1)
        return self.flat.mesh.get_group(0)

    def coordinate(self) -> tuple[int, ...] | None:
        return self.placement.coordinate()

    def placements(self, dim: int) -> tuple:
        """The SBP of a parameter split along ``dim`` over the heads' ranks."""
        return tuple(split(dim) if a in self.axes else broadcast for a in range(self.placement.ndim))

    def grads(self, p: DTensor) -> tuple:
        """A parameter's gradient layout: its own over the heads' axes, partial sums over the others (data axes,
        where the mixer's input differs)."""
        sizes = self.placement.hierarchy
        return tuple(p.placements[a] if a in self.axes else Partial() if sizes[a] > 1 else Replicate()
                     for a in range(self.placement.ndim))

    def split(self, module: nn.Module, name: str, dim: int) -> None:
        """``split_parameter`` over the heads' ranks."""
        split_parameter(module, name, dim, self.placement, axes=self.axes)

    def segment(self, module: nn.Module, name: str, sizes: Sequence[int], *, dim: int = 0, spans=None,
                read_by: nn.Module | None = None) -> None:
        """``segment`` of ``sizes`` along ``dim`` over the heads' ranks."""
        segment(module, name, Segments(dim, tuple(sizes), self.world, spans), self.placement, axes=self.axes,
                read_by=read_by)

    def broadcast(self, module: nn.Module, name: str) -> None:
        """``broadcast_parameter``: whole on every rank."""
        broadcast_parameter(module, name, self.placement)

    def split_outputs(self, *layers: nn.Module) -> None:
        """Each layer's weight and bias (where it has one) split along dim 0: its outputs are the heads' features."""
        for layer in layers:
            for name in ("weight", "bias"):
                if getattr(layer, name, None) is not None:
                    self.split(layer, name, 0)

    def split_inputs(self, layer: nn.Linear) -> nn.Linear | None:
        """A linear layer reading the heads' features: its weight split along dim 1 (its output a partial sum), its
        bias whole; returns ``layer`` where it has a bias (``SplitMixer``'s ``out_bias``: added once), else None."""
        self.split(layer, "weight", 1)
        if layer.bias is None:
            return None
        self.broadcast(layer, "bias")
        return layer

    def sharing(self, parts: int) -> dist.ProcessGroup | None:
        """The group of this rank and the neighbours sharing its part when the heads' ranks are cut in ``parts``
        parts of consecutive ranks (``sharing_group``: every rank of the world calls it alike; None outside)."""
        return sharing_group(self.flat, parts)


@dataclasses.dataclass(frozen=True)
class MixerStyle(Style):
    """A plan style for a token mixer split by heads or channels (its subclasses know which): its input whole on
    every rank, or, with ``sequence_parallel``, this rank's tokens, all-gathered on entry (the backward
    reduce-scatters the gradient) and its output reduce-scattered back to them (as a sequence-parallel attention's
    output projection does); with ``context``, split by heads over every rank of a context-parallel placement,
    the sequence gathered over the context axis around it (``HeadRanks``).

    Args:
        sequence_parallel: the mixer sits in a sequence-parallel model (``hf_plan(sequence_parallel=True)`` sets it).
        context: the mixer sits in a context-parallel model (``hf_plan(context_parallel=...)`` sets it): head
            parallel over the context and tensor axes.

    Example::

        >>> from tpflow.hf.state_space import StateSpaceHeads
        >>> StateSpaceHeads(sequence_parallel=True).sequence_dim, StateSpaceHeads().reads_whole(nn.Identity())
        (1, True)
    """

    sequence_parallel: bool = False
    context: bool = False

    def reads_whole(self, module: nn.Module) -> bool:
        return not self.sequence_parallel and not self.context

    @property
    def splits_sequence(self) -> bool:
        return self.sequence_parallel

    @property
    def sequence_dim(self) -> int | None:
        """The dim of the tokens each rank holds (1: ``[batch, seq, hidden]``), or None: every token."""
        return 1 if self.sequence_parallel or self.context else None

    @property
    def said(self) -> str:
        """The ranks its heads split over, in words (for errors)."""
        if self.context:
            return "ranks (context parallelism runs it head parallel, over every rank of the context x tensor grid)"
        return "tensor-parallel ranks"

    def world(self, plan: Plan) -> int:
        """The ranks this mixer's heads split over in ``plan`` (``head_ranks``' count, without making groups)."""
        return math.prod(plan.placement.hierarchy) if self.context else plan.world

    def head_ranks(self, plan: Plan) -> HeadRanks:
        """The ranks this mixer's heads split over in ``plan``: its tensor-parallel axis, or with ``context`` every
        axis of the context-parallel placement."""
        return HeadRanks(plan.placement, plan.shared("context batch", Batch) if self.context else None)


@dataclasses.dataclass(frozen=True)
class Gathered:
    """Rows of a submodule's parameter that the ranks of a sharing group store split and compute with whole: the
    parameter's local block cut in ``sizes`` (rows), the pieces at ``at`` gathered over the group.

    Args:
        module: the submodule holding the parameter (its ``weight`` and ``bias`` alike).
        sizes: the local block's pieces, rows each, in order.
        at: the pieces gathered whole over the sharing group.

    Example::

        >>> conv = nn.Conv1d(8, 8, 4, groups=8)      # [x | B | C]: 4 rows of x a rank, B and C shared
        >>> Gathered(conv, (4, 1, 1), (1, 2)).at
        (1, 2)
    """

    module: nn.Module
    sizes: tuple[int, ...]
    at: tuple[int, ...]


class SplitMixer:
    """A split mixer's hooks (see the module docstring): ``modules`` (the mixer and its submodules) read their own
    parameters as local blocks around each call of ``mixer``; ``gathered`` rows are gathered over ``shared``; an
    ``out_bias`` module's whole bias is added once (by the first rank). Under context parallelism (``ranks.context``)
    the sequence is gathered over the context ranks on entry, in sequence order (the ring's head-tail parts put
    back), the mixer runs on every token of its heads, and its output is summed over the heads' ranks, each context
    rank keeping its own tokens.

    Args:
        mixer: the mixer module.
        modules: the modules whose own global parameters its call reads.
        ranks: the ranks its heads split over (``HeadRanks``).
        shared: the sharing group of the ``gathered`` rows, or None.
        gathered: the rows gathered.
        out_bias: the output projection, whose bias is whole, or None.
        sequence_dim: the dim of the tokens each rank holds of the mixer's input and output, or None (every token).
        exit: the module whose output is the mixer's partial sum, where not ``mixer`` itself (an attention whose
            output projection sits beside it: BERT's ``attention.output.dense`` after ``attention.self``).
        masked: the mixer is given masks of the whole sequence (attention in the model's own code): padding before
            a row's tokens is allowed under context parallelism, which a recurrence (``PADDED``) refuses.

    Example::

        >>> from tpflow.hf.heads import split_parameter
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)
        >>> mixer = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4, bias=False))
        >>> x = torch.randn(2, 4)
        >>> want = mixer(x)
        >>> for name, dim in (("weight", 0), ("bias", 0)):
        ...     split_parameter(mixer[0], name, dim, P)      # this rank's 4 of the 8 features
        >>> split_parameter(mixer[2], "weight", 1, P)         # which its output's partial sum reads
        >>> hooks = SplitMixer(mixer, [mixer[0], mixer[2]], HeadRanks(P))
        >>> torch.testing.assert_close(mixer(x), want)       # summed over the ranks
    """

    def __init__(self, mixer: nn.Module, modules: Sequence[nn.Module], ranks: HeadRanks, *,
                 shared: dist.ProcessGroup | None = None, gathered: Sequence[Gathered] = (),
                 out_bias: nn.Module | None = None, sequence_dim: int | None = None,
                 exit: nn.Module | None = None, masked: bool = False) -> None:
        pl, self.context, self.masked = ranks.placement, ranks.context, masked
        self.sequence_dim = 1 if self.context is not None else sequence_dim
        self.group, self.first, self.axes = ranks.group, ranks.index == 0, ranks.axes
        if self.context is not None:  # the sequence over the context axis, the heads' sums over the tensor axis
            self.tokens = pl.mesh.get_group(0) if pl.hierarchy[0] > 1 else None
            self.tensor = pl.mesh.get_group(1) if pl.ndim > 1 and pl.hierarchy[1] > 1 else None
        self.reads = [(m, LocalReads([n for n, p in m.named_parameters(recurse=False)
                                      if isinstance(p, DTensor)], ranks.grads)) for m in modules]
        self.shared, self.gathered, self.out_bias = shared, list(gathered), out_bias
        self.share = dist.get_world_size(shared) if shared is not None else 1
        mixer.register_forward_pre_hook(self.before, with_kwargs=True)
        (mixer if exit is None else exit).register_forward_hook(self.after, always_call=True)
        if exit is not None:  # (the mixer raising before its exit ran: the parameters themselves again)
            mixer.register_forward_hook(self.abandoned, always_call=True)

    def _gather(self, t: torch.Tensor, rows: Gathered) -> torch.Tensor:
        pieces = list(t.split(rows.sizes, 0))
        for i in rows.at:
            pieces[i] = comm.gather_shared(pieces[i], 0, pieces[i].shape[0] * self.share, self.shared)
        return torch.cat(pieces, 0)

    def before(self, mixer: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        for m, reads in self.reads:
            reads.enter(m)
            for n in reads.names:  # whole on every rank, read for this rank's heads: gradients summed
                if all(m._parameters[n].placements[a].is_replicate() for a in self.axes):
                    m.__dict__[n] = comm.copy_to_ranks(m.__dict__[n], self.group)
        for rows in self.gathered:
            for n in ("weight", "bias"):
                if n in rows.module.__dict__:
                    rows.module.__dict__[n] = self._gather(rows.module.__dict__[n], rows)
        if self.out_bias is not None and "bias" in self.out_bias.__dict__:  # added once (its gradient summed)
            self.out_bias.__dict__["bias"] = self.out_bias.__dict__["bias"] * int(self.first)
        if self.context is not None and not self.masked and self.context.padded_before_tokens:
            raise ValueError(PADDED.format(type(mixer).__name__))
        positions = kwargs.get("position_ids")
        if self.context is not None and isinstance(positions, torch.Tensor):  # (RG-LRU resets at position 0)
            kwargs = {**kwargs, "position_ids": self.whole_sequence(positions, positions.ndim - 1)}
        if args:
            return (self._entering(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self._entering(kwargs["hidden_states"])}

    def whole_sequence(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every context rank's tokens along ``dim``, in sequence order (the gradient: reduce-scattered back),
        contiguous (code that views it: GPT-2's ``Conv1D``)."""
        whole = comm.gather_shared(x.contiguous(), dim, x.shape[dim] * dist.get_world_size(self.tokens), self.tokens) \
            if self.tokens is not None else x
        return whole.contiguous() if self.context.in_order else whole.index_select(dim, self.context.order(x.device)[0])

    def _entering(self, x: torch.Tensor) -> torch.Tensor:
        """The input whole (every rank's tokens gathered), its gradient summed (reduce-scattered to the tokens)."""
        if self.context is not None:
            return comm.copy_to_ranks(self.whole_sequence(x, 1), self.tensor)
        if self.sequence_dim is None:
            return comm.copy_to_ranks(x, self.group)
        dim, ranks = self.sequence_dim, 1 if self.group is None else dist.get_world_size(self.group)
        return comm.gather_shared(x.contiguous(), dim, x.shape[dim] * ranks, self.group)

    def _leaving(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum summed: whole, or this rank's tokens of the sum."""
        if self.context is not None:  # the context ranks' tokens back in their order, each rank its own, summed
            if not self.context.in_order:
                y = y.index_select(1, self.context.order(y.device)[1])
            y = y.contiguous()
            return comm.reduce_from_ranks(comm.reduce_scatter_to_ranks(y, 1, self.tokens), self.tensor)
        if self.sequence_dim is None:
            return tag(comm.reduce_from_ranks(y, self.group), WHOLE)
        return comm.reduce_scatter_to_ranks(y.contiguous(), self.sequence_dim, self.group)

    def abandoned(self, mixer: nn.Module, args: tuple, output: object) -> None:
        if output is None:  # (raised: no output)
            for m, reads in self.reads:
                reads.leave(m)

    def after(self, mixer: nn.Module, args: tuple, output: object) -> object:
        for m, reads in self.reads:
            reads.leave(m)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (self._leaving(output[0]), *output[1:])
        return self._leaving(output) if isinstance(output, torch.Tensor) else output
