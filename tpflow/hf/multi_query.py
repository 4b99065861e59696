"""The plan style for a multi-query attention's fused projection: query heads split, the one key/value head kept.

GPT-BigCode's ``c_attn`` and Falcon's ``query_key_value`` (``multi_query=True``) project ``[queries | key |
value]`` in one layer: every query head's features, then one key head's and one value head's. A column split of
that layer would cut the key and value over the ranks, and every rank's query heads need both whole. So the layer
stays whole on every rank and each rank computes only its own query heads' features and the key's and value's
(``tpflow.hf.heads.keep_columns``); its gradient, each rank's share, is summed over the ranks, as for a key/value
head kept whole beside separate projections.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from tpflow.hf.heads import keep_columns
from tpflow.hf.split_heads import SplitHeads
from tpflow.plans.style import Plan, Style

__all__ = ["MultiQueryColumns"]


@dataclasses.dataclass(frozen=True)
class MultiQueryColumns(Style):
    """Plan style for a fused ``[queries | key | value]`` projection with one key/value head: whole on every rank,
    each rank computing its query heads' features and the key's and value's; its attention module needs a
    ``tpf.SplitHeads`` entry (``plan="auto"`` writes both for GPT-BigCode and Falcon).

    Args:
        head_dim: the features of one head (the key's and the value's widths).

    Example::

        >>> from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM
        >>> model = GPTBigCodeForCausalLM(GPTBigCodeConfig(vocab_size=64, n_embd=16, n_layer=1, n_head=4))
        >>> plan = {"transformer.h.*.attn": tpf.SplitHeads(), "transformer.h.*.attn.c_attn": tpf.MultiQueryColumns(4),
        ...         "transformer.h.*.attn.c_proj": "row"}
        >>> model = tpf.parallelize(model, placement=tpf.placement("cpu", ranks=[0, 1]), plan=plan)
        >>> model.transformer.h[0].attn.c_attn(torch.randn(3, 16)).shape     # 2 query heads, the key, the value
        torch.Size([3, 16])
    """

    head_dim: int
    keeps_key_value = True  # (its attention's SplitHeads keeps the one key/value head whole)

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        parent = name.rpartition(".")[0]
        if plan.world > 1 and not any(isinstance(p, SplitHeads) for p in plan.styles_of(parent)):  # (one rank: all)
            raise ValueError(f"{name!r}: MultiQueryColumns gives each rank its query heads, which its attention module "
                             f"{parent!r} must then read as its rank's: plan it as tpf.SplitHeads()")
        queries = _queries(module, self.head_dim)
        if not isinstance(module, nn.Linear) or queries is None:
            raise ValueError(f"{name!r}: MultiQueryColumns({self.head_dim}) takes an nn.Linear projecting query "
                             f"heads, one key head and one value head of {self.head_dim} features each")
        if (queries // self.head_dim) % plan.world:
            raise ValueError(f"{name!r} projects {queries // self.head_dim} query heads, which do not split over "
                             f"{plan.world} tensor-parallel ranks: use a degree that divides them")

    def apply(self, name: str, module: nn.Module, plan: Plan) -> None:
        coordinate = plan.placement.coordinate()
        if coordinate is not None:
            share = _queries(module, self.head_dim) // plan.world
            start = coordinate[-1] * share
            keep_columns(module, [(start, start + share), (share * plan.world, module.out_features)], plan.placement)
        plan.replicate_as(name, "partial")


def _queries(module: nn.Module, head_dim: int) -> int | None:
    """The query features of a fused ``[queries | key | value]`` projection, or None if its width says otherwise."""
    queries = getattr(module, "out_features", 0) - 2 * head_dim
    return queries if queries > 0 and queries % head_dim == 0 else None
