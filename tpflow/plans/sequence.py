"""Sequence-parallel regions of a model: modules that run on this rank's tokens (norms between a sequence-parallel
row layer and the next column layer), and modules that gather every token on entry (attention, whose code reshapes
by its input's shape; a mixture of experts' block)."""

from __future__ import annotations

import dataclasses

from torch import nn

from tpflow import comm
from tpflow.layers.regions import SPLIT, WHOLE, tag
from tpflow.placement import Placement
from tpflow.plans.style import Plan, Style

__all__ = ["GatherSequence", "SequenceParallel"]


@dataclasses.dataclass(frozen=True)
class SequenceParallel(Style):
    """Plan entry for a module that runs on this rank's tokens (HF's ``"sequence_parallel"``): a norm between
    a sequence-parallel row layer and the next sequence-parallel column layer, or the first module of such a
    region, which cuts its whole input to this rank's tokens.

    Its parameters stay whole on every rank and their gradients are summed over the tensor-parallel ranks.

    Args:
        split_input: the module's first input (or ``hidden_states``) arrives whole and is cut to this rank's
            chunk of ``sequence_dim`` (the backward all-gathers its gradient): the entry of a sequence-parallel
            region (default False: it arrives cut, from a sequence-parallel row layer).
        sequence_dim: the sequence dim: 1 (default, ``[batch, seq, hidden]``) or 0.

    Example::

        >>> import tpflow as tpf
        >>> from torch import nn
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)                                            # the same model on every rank
        >>> model = nn.Sequential()
        >>> model.norm, model.fc1, model.act = nn.LayerNorm(16), nn.Linear(16, 64), nn.GELU()
        >>> model.fc2, model.out_norm = nn.Linear(64, 16), nn.LayerNorm(16)
        >>> model = tpf.parallelize(model, placement=P, plan={
        ...     "norm": tpf.SequenceParallel(split_input=True),                   # cuts the whole input to its tokens
        ...     "fc1": tpf.ColumnParallel(sequence_parallel=True, sequence_dim=1),
        ...     "fc2": tpf.RowParallel(sequence_parallel=True, sequence_dim=1),
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


@dataclasses.dataclass(frozen=True)
class GatherSequence(Style):
    """Plan entry for a module whose first input (or ``hidden_states``) arrives as this rank's tokens and is
    all-gathered whole before it runs (the backward keeps this rank's chunk of the gradient): an attention
    module in a sequence-parallel model, whose own code reshapes the projections' outputs by its input's shape.

    Args:
        sequence_dim: the sequence dim: 1 (default, ``[batch, seq, hidden]``) or 0.
        split_output: cut the module's output (whole on every rank) back to this rank's tokens (the backward
            all-gathers its gradient): a mixture of experts' block, whose router and experts run on every token
            and whose output goes on to the next sequence-parallel norm (default False: a sequence-parallel row
            layer inside the module cuts it).

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
        >>> plan["model.layers.*.self_attn"]
        GatherSequence(sequence_dim=1, split_output=False)
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
