"""The plan style of context parallelism (``tpf.hf_plan(model, context_parallel=...)`` gives every attention module
of the model one): what it checks of the model and the plan before anything changes, and what it attaches; the
model-level hooks it installs once every entry applied itself are ``tpflow.hf.context``'s."""

from __future__ import annotations

import dataclasses

from torch import nn

from tpflow.hf import heads
from tpflow.hf.context import context_parallel, output_head, refuse_unsplit
from tpflow.hf.context_attention import ULYSSES_ORIGINALS, Batch, attach
from tpflow.hf.context_indexer import attach_indexer
from tpflow.hf.mixers import head_parallel_attentions, interface_attention
from tpflow.hf.own_attention import OwnAttentionHeads
from tpflow.ops import ulysses_degrees
from tpflow.placement import Placement
from tpflow.plans.style import Plan, Style

__all__ = ["ContextParallel"]


@dataclasses.dataclass(frozen=True)
class ContextParallel(Style):
    """Plan style for a Hugging Face attention module under context parallelism (``tpf.hf_plan(model,
    context_parallel="ring")``): the sequence is split over the context axis (a 1-D placement's ranks, or the first
    axis of a 2-D one, the second being tensor parallel), every layer runs on this rank's part of it, and the
    attention module's own code runs with its attention computed over the whole sequence (``tpflow.hf.context``).
    Every attention module of the model takes the same entry.

    Args:
        kind: ``"ring"``: the key / value blocks go around the ranks (``tpflow.ops.ring_attention``), each rank
            holding two parts of the sequence (head-tail) so causal work is balanced; ``"ulysses"``: an all-to-all
            turns the sequence split into a split of the heads around the model's own attention
            (``tpflow.ops.ulysses_attention``), the heads (per tensor-parallel rank) a multiple of the ranks.
        layers_whole: the plan splits nothing in the layers by heads (``hf_plan`` of a model it finds nothing to
            split in): context parallelism alone, a tensor axis refused.

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
        >>> plan = tpf.hf_plan(model, context_parallel="ring")
        >>> plan["model.layers.*.self_attn"]                                   # its heads too, on a 2-D placement
        Stacked(entries=(SplitHeads(groups=1), ContextParallel(kind='ring')))
        >>> model = tpf.parallelize(model, placement=P, plan=plan)
        >>> out = model(ids, labels=ids)                                        # whole ids in, 4 tokens a rank
        >>> out.loss, tpf.get_sbp(out.logits)
        (tensor(4.1710, grad_fn=<_ReduceFromRanksBackward>), (sbp.split(dim=1),))
    """

    kind: str = "ring"
    layers_whole: bool = dataclasses.field(default=False, repr=False, compare=False)

    @property
    def one_batch(self) -> bool:
        """Every rank reads the whole batch (the entry cuts it): trainers shard no data over the context ranks."""
        return True

    def __post_init__(self) -> None:
        if self.kind not in ("ring", "ulysses"):
            raise ValueError(f"ContextParallel(kind={self.kind!r}): use 'ring' or 'ulysses'")

    def arrange(self, placement: Placement) -> Placement:
        """``(context, tensor)``: a 1-D placement's ranks all context parallel (a tensor axis of one rank), a 2-D
        one's first axis."""
        if placement.names is not None or placement.ndim > 2:
            raise ValueError(f"context parallelism runs on a 1-D placement (context alone) or an unnamed 2-D one "
                             f"(context x tensor), got {placement!r}")
        if placement.ndim == 1:
            return Placement(placement.type, [[rank] for rank in placement.flat_ranks])
        return placement

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        model = plan.model
        if not hasattr(model, "config") or not hasattr(model, "set_attn_implementation"):
            raise ValueError(f"tpf.ContextParallel plans a Hugging Face model's attention modules (through its "
                             f"AttentionInterface); {type(model).__name__} is not one")
        sequence = sorted({pattern for pattern, entry in plan.matches.values() if entry.splits_sequence})
        if sequence:
            raise ValueError(f"context parallelism splits the sequence through every layer already: drop the "
                             f"sequence-parallel entries {sequence}")
        plan.shared("context mixers", lambda: refuse_unsplit(model))
        plan.shared("attention in its own code", lambda: _refuse_unplanned_heads(plan))
        kinds = {entry.kind for entry in plan.distinct() if isinstance(entry, ContextParallel)}
        missed = [n for n, m in plan.modules.items()
                  if interface_attention(m) and not any(isinstance(p, ContextParallel) for p in plan.styles_of(n))]
        if len(kinds) > 1 or missed:
            raise ValueError(f"context parallelism splits the sequence through every attention module alike: plan "
                             f"each with the same tpf.ContextParallel entry (got kinds {sorted(kinds)}; unplanned: "
                             f"{missed})")
        original = model.config._attn_implementation
        if self.kind == "ulysses" and original not in ULYSSES_ORIGINALS:
            raise ValueError(f"Ulysses runs the model's own attention on whole sequences, causal without a mask of its "
                             f"own: {original!r} is not one of {ULYSSES_ORIGINALS}; load the model with one, or use "
                             f"context_parallel='ring'")
        if self.kind == "ring" and output_head(model) is None:
            raise ValueError(f"the ring needs the model's output head (get_output_embeddings()), before which its "
                             f"parts become contiguous; {type(model).__name__} has none: use context_parallel="
                             f"'ulysses'")
        context, tensor = plan.named.hierarchy
        if self.layers_whole and tensor > 1:
            raise ValueError(f"tpflow splits nothing in {type(model).__name__}'s layers by heads (no tensor-parallel "
                             f"plan of its own, none tpflow can read off them), so its {tensor} tensor-parallel ranks "
                             f"would each hold and compute them whole: use context parallelism alone, on a 1-D "
                             f"placement")
        counts = heads.attention_heads(module) if interface_attention(module) else None
        if self.kind == "ulysses" and counts is not None:
            local, kv = counts[0] // tensor, max(counts[1] // tensor, 1)  # this tensor rank's
            if context not in ulysses_degrees(local, kv):
                raise ValueError(f"{name!r}: Ulysses splits each tensor-parallel rank's {local} query heads and {kv} "
                                 f"key/value heads over the {context} context ranks, which they do not divide: use "
                                 f"{ulysses_degrees(local, kv)} context ranks, or tpf.ContextParallel('ring')")

    def apply(self, name: str, module: nn.Module, plan: Plan) -> None:
        batch = plan.shared("context batch", Batch)
        if interface_attention(module):  # (a mixer split by heads, or attention in the model's own code, beside it
            # gathers the sequence itself)
            attach(module, name, self.kind, plan.placement, plan.model.config._attn_implementation, batch)
            attach_indexer(module, name, plan.placement, batch)
        plan.at_end("context", lambda: context_parallel(plan.model, self.kind, plan.placement, plan.given, batch))


def _refuse_unplanned_heads(plan: Plan) -> None:
    """Raise where an attention the model computes in its own code is not planned head parallel
    (``OwnAttentionHeads``, on it or on its parent): it would attend over this rank's part of the sequence alone."""
    def planned(name: str) -> bool:
        parent, _, child = name.rpartition(".")
        return any(isinstance(s, OwnAttentionHeads) for s in plan.styles_of(name)) or any(
            isinstance(s, OwnAttentionHeads) and s.heads == child for s in plan.styles_of(parent))

    missed = [n for n in head_parallel_attentions(plan.model) if not planned(n)]
    if missed:
        raise ValueError(f"context parallelism runs attention a model computes in its own code head parallel "
                         f"(tpflow.hf.own_attention.OwnAttentionHeads, which tpf.hf_plan(model, context_parallel=...) "
                         f"writes), and the plan gives {missed[:3]} none: each rank would attend over its part of the "
                         f"sequence alone. Plan the model with tpf.hf_plan")
