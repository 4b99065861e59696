"""Sequence-parallel regions of a model: modules that run on this rank's tokens (norms between a sequence-parallel
row layer and the next column layer), and modules that gather every token on entry (attention, whose code reshapes
by its input's shape; a mixture of experts' block)."""

from __future__ import annotations

import dataclasses

from torch import nn

from tpflow import comm
from tpflow.layers.layouts import Layouts, Side, sequence_splits
from tpflow.layers.regions import SPLIT, WHOLE, tag
from tpflow.placement import Placement
from tpflow.plans.style import Plan, Style
from tpflow.sbp import broadcast

__all__ = ["GatherSequence", "SequenceParallel"]

_TOKENS = ("sbp.split(1) / sbp.split(0) (this rank's tokens along the sequence dim of [batch, seq, hidden] / [seq, "
           "batch, hidden])")
_ON_TOKENS = Layouts(  # SequenceParallel's: its module runs on this rank's tokens
    input_sbp=Side({**sequence_splits(split_input=False), broadcast: {"split_input": True}},
                   f"{_TOKENS}, or sbp.broadcast (whole, cut to this rank's tokens on entry)"),
    output_sbp=Side(sequence_splits(), _TOKENS))
_ON_EVERY_TOKEN = Layouts(  # GatherSequence's: its module runs on every token
    input_sbp=Side(sequence_splits(), _TOKENS),
    output_sbp=Side({None: {"split_output": False}, **sequence_splits(split_output=True)},
                    f"None (as the module returns it) or {_TOKENS}, cut from the module's whole output"))


@_ON_TOKENS.said_in_sbp  # input_sbp= / output_sbp=, stored as the flags they stand for
@dataclasses.dataclass(frozen=True)
class SequenceParallel(Style):
    """Plan style for a module that runs on this rank's tokens (HF's ``"sequence_parallel"``): a norm between
    a sequence-parallel row layer and the next sequence-parallel column layer, or the first module of such a
    region, which cuts its whole input to this rank's tokens.

    Its parameters stay whole on every rank and their gradients are summed over the tensor-parallel ranks.

    Args:
        input_sbp: the module's first input (or ``hidden_states``): ``sbp.split(1)`` (the default) or
            ``sbp.split(0)``, this rank's chunk of the sequence dim of ``[batch, seq, hidden]`` / ``[seq, batch,
            hidden]``, as a sequence-parallel row layer hands it on; or ``sbp.broadcast``: it arrives whole and is
            cut to this rank's chunk (the backward all-gathers its gradient), the entry of a sequence-parallel
            region.
        output_sbp: the module's output, this rank's tokens: ``sbp.split(1)`` (the default) or ``sbp.split(0)``;
            says the sequence dim beside ``input_sbp=sbp.broadcast``.
        split_input: alias of ``input_sbp``: True is ``sbp.broadcast``, False (default) the sequence dim's split.
        sequence_dim: alias of the sequence dim both SBPs split: 1 (default) or 0.

    Example::

        >>> import tpflow as tpf
        >>> from torch import nn
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)                                            # the same model on every rank
        >>> model = nn.Sequential()
        >>> model.norm, model.fc1, model.act = nn.LayerNorm(16), nn.Linear(16, 64), nn.GELU()
        >>> model.fc2, model.out_norm = nn.Linear(64, 16), nn.LayerNorm(16)
        >>> tokens = tpf.sbp.split(1)                                             # [batch, seq, hidden]
        >>> model = tpf.parallelize(model, placement=P, plan={
        ...     "norm": tpf.SequenceParallel(input_sbp=tpf.sbp.broadcast),        # cuts the whole input to its tokens
        ...     "fc1": tpf.ColumnParallel(input_sbp=tokens),
        ...     "fc2": tpf.RowParallel(output_sbp=tokens),
        ...     "out_norm": "sequence_parallel",                                  # on this rank's tokens, from fc2
        ... })
        >>> model(torch.randn(2, 8, 16)).shape     # [batch, seq, hidden]: all 8 tokens in, this rank's 4 out
        torch.Size([2, 4, 16])
    """

    split_input: bool = False
    sequence_dim: int = 1

    def apply(self, name: str, module: nn.Module, plan: Plan) -> None:
        plan.replicate_as(name, "partial")
        if self.split_input:
            module.register_forward_pre_hook(_Tokens(self.sequence_dim, plan.placement, gather=False),
                                             with_kwargs=True)

    @property
    def splits_sequence(self) -> bool:
        return True


@_ON_EVERY_TOKEN.said_in_sbp  # input_sbp= / output_sbp=, stored as the flags they stand for
@dataclasses.dataclass(frozen=True)
class GatherSequence(Style):
    """Plan style for a module whose first input (or ``hidden_states``) arrives as this rank's tokens and is
    all-gathered whole before it runs (the backward keeps this rank's chunk of the gradient): an attention
    module in a sequence-parallel model, whose own code reshapes the projections' outputs by its input's shape.

    Args:
        input_sbp: the module's first input, this rank's tokens: ``sbp.split(1)`` (the default, ``[batch, seq,
            hidden]``) or ``sbp.split(0)`` (``[seq, batch, hidden]``).
        output_sbp: None (the default: the output as the module returns it, cut by a sequence-parallel row layer
            inside it) or ``sbp.split(1)`` / ``sbp.split(0)``: the module's output, whole on every rank, cut back
            to this rank's tokens (the backward all-gathers its gradient): a mixture of experts' block, whose
            router and experts run on every token and whose output goes on to the next sequence-parallel norm.
        sequence_dim: alias of the sequence dim both SBPs split: 1 (default) or 0.
        split_output: alias of ``output_sbp``: True is the sequence dim's split, False (default) None.

    Example::

        >>> import tpflow as tpf
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)                                            # the same model on every rank
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
        ...                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        >>> ids = torch.randint(0, 64, (2, 8))
        >>> model(ids, labels=ids).loss                                         # one device's
        tensor(4.1710, grad_fn=<NllLossBackward0>)
        >>> plan = tpf.hf_plan(model, sequence_parallel=True)
        >>> plan["model.layers.*.self_attn"]                                   # its heads split too
        Stacked(entries=(SplitHeads(groups=1), GatherSequence(sequence_dim=1, split_output=False)))
        >>> model = tpf.parallelize(model, placement=P, plan=plan)
        >>> model(ids, labels=ids).loss
        tensor(4.1710, grad_fn=<_VocabParallelCEBackward>)
    """

    sequence_dim: int = 1
    split_output: bool = False

    def apply(self, name: str, module: nn.Module, plan: Plan) -> None:
        module.register_forward_pre_hook(_Tokens(self.sequence_dim, plan.placement, gather=True), with_kwargs=True)
        if self.split_output:
            module.register_forward_hook(_OutputTokens(self.sequence_dim, plan.placement))

    @property
    def splits_sequence(self) -> bool:
        return True


def _tp_group(placement: Placement):
    """The tensor-parallel axis' process group, None on one rank or outside the placement."""
    if placement.hierarchy[-1] == 1 or placement.coordinate() is None:
        return None
    return placement.mesh.get_group(placement.ndim - 1)


class _Tokens:
    """A module's first input (or ``hidden_states``) cut to this rank's chunk of ``dim`` (the entry of a
    sequence-parallel region: the backward all-gathers its gradient), or, with ``gather``, this rank's chunk
    all-gathered whole (the backward keeps this rank's chunk)."""

    def __init__(self, dim: int, placement: Placement, gather: bool) -> None:
        self.dim, self.placement, self.gather = dim, placement, gather

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        dim, world, group = self.dim, self.placement.hierarchy[-1], _tp_group(self.placement)
        args, kwargs = list(args), dict(kwargs)
        x = args[0] if args else kwargs["hidden_states"]
        if self.gather:  # contiguous: the module's own code may view it (an MoE block flattens its tokens)
            x = tag(comm.gather_from_ranks(x, dim, x.shape[dim] * world, group).contiguous(), WHOLE)
        elif x.shape[dim] % world:
            raise ValueError(f"sequence parallelism splits dim {dim} ({x.shape[dim]} tokens) over {world} ranks: pad "
                             f"the sequence to a multiple of {world}, or parallelize without sequence_parallel "
                             f"(generation)")
        else:
            x = tag(comm.scatter_to_ranks(x, dim, group), SPLIT)
        if args:
            args[0] = x
        else:
            kwargs["hidden_states"] = x
        return tuple(args), kwargs


class _OutputTokens:
    """A module's output (or its first element), whole on every rank, cut to this rank's chunk of ``dim`` (the
    backward all-gathers its gradient)."""

    def __init__(self, dim: int, placement: Placement) -> None:
        self.dim, self.placement = dim, placement

    def __call__(self, module: nn.Module, args: tuple, output: object) -> object:
        group = _tp_group(self.placement)
        if isinstance(output, tuple):
            return (tag(comm.scatter_to_ranks(output[0], self.dim, group), SPLIT), *output[1:])
        return tag(comm.scatter_to_ranks(output, self.dim, group), SPLIT)
