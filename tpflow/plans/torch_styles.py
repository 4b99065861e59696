"""torch's own styles (``torch.distributed.tensor.parallel``) read as tpflow's entries, so that a plan written for
``parallelize_module`` (torchtitan's ``apply_tp``, a tutorial's) runs through ``tpf.parallelize`` on tpflow's layers.

    ColwiseParallel()                                      ColumnParallel()
    ColwiseParallel(output_layouts=Replicate())            ColumnParallel(output_sbp=broadcast)
    ColwiseParallel(input_layouts=Shard(1))                ColumnParallel(input_sbp=split(1))
    ColwiseParallel(output_layouts=Shard(-1),
                    use_local_output=False)                VocabParallel(): logits global, split over the vocabulary
    RowwiseParallel()                                      RowParallel()
    RowwiseParallel(input_layouts=Replicate())             RowParallel(input_sbp=broadcast)
    RowwiseParallel(output_layouts=Shard(1))               RowParallel(output_sbp=split(1))
    RowwiseParallel(input_layouts=Replicate()) on an
        nn.Embedding (output_layouts=Shard(1))             VocabParallel(hidden_sbp=split(1))
    SequenceParallel(sequence_dim=1)                       SequenceParallel(input_sbp=split(1))
    PrepareModuleInput(input_layouts=(Shard(1), ...),
        desired_input_layouts=(Replicate(), ...))          GatherSequence(input_sbp=split(1))
    PrepareModuleInput(Replicate() -> Shard(1))            SequenceParallel(input_sbp=broadcast, output_sbp=split(1))
    PrepareModuleInputOutput(Shard(1) -> Replicate() in,
        Replicate() -> Shard(1) out)                       GatherSequence(input_sbp=split(1), output_sbp=split(1))

(``split`` and ``broadcast`` are ``tpf.sbp``'s, DTensor's ``Shard`` and ``Replicate()``; the entries store them as
their older flags, ``ColumnParallel(output_sbp=broadcast) == ColumnParallel(gather_output=True)``.)

tpflow's layers hand plain local tensors from one to the next (the ``use_local_output=True`` way) wherever torch's
would hand DTensors that the next style redistributes to the same values. Anything else is refused entry by entry,
naming what to write instead: never run with another layout than the one asked for.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
)
from torch.distributed.tensor.parallel import SequenceParallel as TorchSequenceParallel

from tpflow.plans.linear import ColumnParallel, RowParallel
from tpflow.plans.sequence import GatherSequence, SequenceParallel
from tpflow.plans.style import Style
from tpflow.plans.vocab import VocabParallel

__all__ = ["from_torch", "is_torch_style"]


def is_torch_style(value: object) -> bool:
    """Whether ``value`` is one of torch's styles (a ``torch.distributed.tensor.parallel.ParallelStyle``).

    Args:
        value: a plan's value.

    Returns:
        True or False.

    Example::

        >>> from torch.distributed.tensor.parallel import ColwiseParallel
        >>> is_torch_style(ColwiseParallel()), is_torch_style("colwise")
        (True, False)
    """
    return isinstance(value, ParallelStyle)


class _Refused(ValueError):
    pass


def _tokens(layout: object) -> int | None:
    """The sequence dim of a layout: None for Replicate(), 0 or 1 for Shard(0) / Shard(1)."""
    if isinstance(layout, Replicate):
        return None
    if isinstance(layout, Shard) and layout.dim in (0, 1):
        return layout.dim
    raise _Refused(f"{layout!r} is neither Replicate() nor a sequence split (Shard(0) or Shard(1))")


def _sequence(dim: int | None) -> dict:
    return {} if dim is None else {"sequence_parallel": True, "sequence_dim": dim}


def _features(layout: object) -> bool:
    return isinstance(layout, Shard) and layout.dim in (-1, 2)


def _colwise(style: ColwiseParallel, module: nn.Module, head: bool) -> Style:
    if not isinstance(module, nn.Linear):
        raise _Refused("ColwiseParallel splits an nn.Embedding's embedding dim, which tpflow does not: split it by "
                       "its vocabulary, RowwiseParallel(input_layouts=Replicate()) or 'vocab'" if isinstance(
                           module, nn.Embedding) else "tpflow's column entry takes an nn.Linear")
    tokens = _tokens(style.input_layouts[0])
    output = style.output_layouts[0]
    if _features(output) and style.use_local_output:
        return ColumnParallel(**_sequence(tokens))
    if _features(output) and head:  # a loss-parallel head: its logits global, split over the vocabulary
        return VocabParallel(**_sequence(tokens))
    if _features(output):
        raise _Refused("tpflow hands a layer's block on as a plain tensor (use_local_output=True); a global output "
                       "split over the last dim is the model's output head's (loss parallelism), read as 'vocab'")
    if isinstance(output, Replicate):
        return ColumnParallel(gather_output=True, **_sequence(tokens))
    raise _Refused(f"its output {output!r} is neither its features' split (Shard(-1)) nor whole (Replicate())")


def _rowwise(style: RowwiseParallel, module: nn.Module, head: bool) -> Style:
    tokens = _tokens(style.output_layouts[0])
    source = style.input_layouts[0]
    if isinstance(module, nn.Embedding):
        if not isinstance(source, Replicate):
            raise _Refused("an embedding split by its vocabulary reads every token id: give input_layouts=Replicate()")
        return VocabParallel(**_sequence(tokens))
    if not isinstance(module, nn.Linear):
        raise _Refused("tpflow's row entry takes an nn.Linear (or an nn.Embedding, split by its vocabulary)")
    if _features(source):
        return RowParallel(**_sequence(tokens))
    if isinstance(source, Replicate) and tokens is None:
        return RowParallel(input_is_parallel=False)
    raise _Refused(f"its input {source!r} is neither its features' split (Shard(-1)) nor, with a whole output, whole "
                   f"(Replicate())")


def _input_pair(style: PrepareModuleInput) -> tuple[object, object]:
    """The one input it prepares, ``(layout, desired)``: the first positional one or ``hidden_states``."""
    given = zip(style.input_layouts or (), style.desired_input_layouts or ())  # None where only kwargs are given
    pairs = [(i, (have, want)) for i, (have, want) in enumerate(given) if have is not None or want is not None]
    kwargs = style.input_kwarg_layouts or {}
    if not pairs and set(kwargs) == {"hidden_states"}:
        return kwargs["hidden_states"], style.desired_input_kwarg_layouts.get("hidden_states")
    if len(pairs) == 1 and pairs[0][0] == 0 and not kwargs:
        return pairs[0][1]
    raise _Refused("tpflow prepares one input, the first positional one or hidden_states")


def _prepare(have: object, want: object) -> Style:
    if isinstance(want, Replicate) and (dim := _tokens(have)) is not None:
        return GatherSequence(sequence_dim=dim)
    if isinstance(have, Replicate) and (dim := _tokens(want)) is not None:
        return SequenceParallel(split_input=True, sequence_dim=dim)
    raise _Refused(f"it turns {have!r} into {want!r}; tpflow gathers a sequence split whole (Shard(d) -> "
                   f"Replicate()) or cuts a whole input to this rank's tokens (Replicate() -> Shard(d))")


def _prepare_both(style: PrepareModuleInputOutput) -> Style:
    have, want = _input_pair(style.prepare_module_input)
    _prepare(have, want)  # (an input pair tpflow cannot take refused by its own sentence)
    dim = _tokens(have) if isinstance(want, Replicate) else None  # gathered on entry
    outputs = style.prepare_module_output
    pairs = list(zip(outputs.output_layouts, outputs.desired_output_layouts))
    if dim is not None and len(pairs) == 1 and isinstance(pairs[0][0], Replicate) \
            and isinstance(pairs[0][1], Shard) and pairs[0][1].dim == dim:
        return GatherSequence(sequence_dim=dim, split_output=True)
    raise _Refused("tpflow gathers a module's tokens on entry and cuts its output back to this rank's tokens on exit "
                   "(Shard(d) -> Replicate() in, Replicate() -> Shard(d) out), nothing else")


def from_torch(pattern: str, style: ParallelStyle, module: nn.Module, head: bool = False) -> Style:
    """The tpflow entry that does what torch's ``style`` does to ``module`` (the table in this module's docstring);
    a ValueError naming ``pattern``, the style and what to write instead where there is none.

    Args:
        pattern: the plan's key, named in errors.
        style: one of torch's styles.
        module: the module it matched.
        head: whether ``module`` is the model's output head, where ``ColwiseParallel(output_layouts=Shard(-1),
            use_local_output=False)`` (loss parallelism) is read as ``VocabParallel``; elsewhere it is refused.

    Returns:
        The entry.

    Example::

        >>> from torch import nn
        >>> from torch.distributed.tensor import Replicate, Shard
        >>> from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
        >>> from_torch("output", ColwiseParallel(output_layouts=Replicate()), nn.Linear(8, 50))
        ColumnParallel(gather_output=True, sequence_parallel=False, algo='auto', keep_gathered=True, sequence_dim=0, \
fuse=False)
        >>> from_torch("tok_embeddings", RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        ...            nn.Embedding(50, 8))
        VocabParallel(sequence_parallel=True, sequence_dim=1)
    """
    readers = {ColwiseParallel: _colwise, RowwiseParallel: _rowwise,
               TorchSequenceParallel: lambda s, m, h: SequenceParallel(sequence_dim=s.sequence_sharding[0].dim),
               PrepareModuleInput: lambda s, m, h: _prepare(*_input_pair(s)),
               PrepareModuleInputOutput: lambda s, m, h: _prepare_both(s)}
    reader = readers.get(type(style))
    try:
        if reader is None:
            raise _Refused("tpflow reads torch's ColwiseParallel, RowwiseParallel, SequenceParallel, "
                           "PrepareModuleInput and PrepareModuleInputOutput (a PrepareModuleOutput alone: write "
                           "tpf.GatherSequence(split_output=True) on the module whose input it gathers)")
        return reader(style, module, head)
    except _Refused as why:
        raise ValueError(f"plan[{pattern!r}] = torch's {type(style).__name__} ({_layouts(style)}) on "
                         f"{type(module).__name__}: {why}. Write a tpflow entry instead (tpf.ColumnParallel, "
                         f"tpf.RowParallel, tpf.VocabParallel, tpf.SequenceParallel, tpf.GatherSequence)") from None


def _layouts(style: ParallelStyle) -> str:
    fields = ("input_layouts", "output_layouts", "desired_input_layouts", "use_local_output", "sequence_sharding")
    return ", ".join(f"{f}={getattr(style, f)}" for f in fields if hasattr(style, f)) or "its defaults"
