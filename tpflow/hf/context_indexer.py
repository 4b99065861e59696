"""Context parallelism through sparse attention with an indexer (DeepSeek-V3.2's DSA; GLM-MoE-DSA, AXK2, dots.3 and
HY-V4 alike; Qwen4-Exp's, over keys pooled in blocks): the indexer, the model's own code, scores this rank's queries
against the keys of the whole sequence and picks each query's top-k among them, as one device picks; the attention
module then passes the picked keys (global positions) to its attention (``indices=``, or Qwen4-Exp's mask over the
whole sequence), which ``tpflow.hf.context_attention`` runs over them.

The indexer reads its keys through its key cache (``past_key_values.update_indexer``): under context parallelism it
is handed ``IndexerKeys``, which gathers every context rank's keys in sequence order (without a gradient: the
indexer runs under ``no_grad``), and, for the model's mask of this rank's tokens, what each of its queries sees of
the whole sequence (causality, packed documents, the layer's window). An indexer that pools its keys in blocks
rotates each pooled key at its block's first position after the gather: it is handed the rotary tables of the whole
sequence, with its queries' last (as one device's model hands them, the keys' positions then the queries').
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.distributed as dist
from torch import nn

from tpflow import comm
from tpflow.hf.context_attention import Batch, context_group, picks_by_mask, visible
from tpflow.placement import Placement
from tpflow.sbp import chunk_bounds

__all__ = ["IndexerKeys", "attach_indexer", "is_split_indexer"]


def is_split_indexer(module: nn.Module) -> bool:
    """Whether ``module`` is a sparse-attention indexer context parallelism splits: one that takes the attention's
    mask and reads its keys through the key cache (DeepSeek-V3.2's shape, and Qwen4-Exp's over keys pooled in
    blocks; DeepSeek-V4's, which pools its keys before any cache or mask, is not).

    Args:
        module: any module.

    Returns:
        True or False.

    Example::

        >>> is_split_indexer(nn.Linear(2, 2))
        False
    """
    if "Indexer" not in type(module).__name__:
        return False
    names = inspect.signature(module.forward).parameters
    pooled = _pooled(module)
    return "attention_mask" in names and "past_key_values" in names and (not pooled or "position_embeddings" in names)


def _pooled(indexer: nn.Module) -> bool:
    """Whether an indexer pools its keys in blocks (Qwen4-Exp's ``compress_ratio``), rotating them after its cache."""
    return hasattr(indexer, "compress_ratio")


class IndexerKeys:
    """The key cache an indexer is handed under context parallelism: its ``update_indexer`` returns every context
    rank's keys (``[B, S, D]`` of this rank's ``[B, s, D]``) in sequence order.

    Args:
        group: the context group (None: one rank).
        order: where each position of the sequence sits among the ranks' tokens gathered rank after rank.

    Example::

        >>> keys = torch.randn(2, 4, 3)
        >>> IndexerKeys(None, torch.tensor([0, 3, 1, 2])).update_indexer(keys, 0).equal(keys[:, [0, 3, 1, 2]])
        True
    """

    def __init__(self, group: dist.ProcessGroup | None, order: torch.Tensor) -> None:
        self.group, self.order = group, order

    def update_indexer(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        if self.group is not None:
            keys = comm.all_gather(keys.contiguous(), 1, chunk_bounds(len(self.order), dist.get_world_size(
                self.group)), self.group)
        return keys.index_select(1, self.order)


class _Indexer:
    """One indexer's pre-hook: the whole sequence's keys and each query's view of them in place of its rank's."""

    def __init__(self, name: str, attention: nn.Module, placement: Placement, batch: Batch) -> None:
        self.name, self.attention, self.placement, self.batch = name, attention, placement, batch
        self.signature = None

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self.signature = self.signature or inspect.signature(module.forward)
        named = dict(self.signature.bind(*args, **kwargs).arguments)
        if named.get("past_key_values") is not None:
            raise ValueError(f"{self.name!r}: context parallelism trains on whole sequences; it keeps no key cache")
        hidden = named["hidden_states"]
        group, world = context_group(self.placement), self.placement.hierarchy[0]
        order, at = self.batch.order(hidden.device)
        rank, mine = (dist.get_rank(group) if world > 1 else 0), hidden.shape[1]
        window = getattr(self.attention, "sliding_window", None)
        named["attention_mask"] = visible(at[rank * mine:(rank + 1) * mine], torch.arange(len(at), device=at.device),
                                          getattr(self.attention, "is_causal", True),
                                          window if window is not None and window < len(at) else None, None,
                                          self.batch.documents)
        named["past_key_values"] = keys = IndexerKeys(group if world > 1 else None, order)
        if _pooled(module):  # (its mask [B, 1, q, S], as the model's; the rotary tables of the whole sequence,
            # then its queries')
            named["attention_mask"] = named["attention_mask"][:, None].expand(hidden.shape[0], -1, -1, -1)
            named["position_embeddings"] = tuple(torch.cat((keys.update_indexer(t.contiguous(), 0), t), 1)
                                                 for t in named["position_embeddings"])
        return (), named


def attach_indexer(attention: nn.Module, name: str, placement: Placement, batch: Batch) -> None:
    """Give the split indexers inside ``attention`` (``is_split_indexer``) the whole sequence's keys under context
    parallelism.

    Args:
        attention: an attention module.
        name: its name in the model, for errors.
        placement: the ``(context, tensor)`` placement.
        batch: what the model's entry finds in each batch (its cut, its packed documents).

    Example::

        >>> attach_indexer(nn.Linear(2, 2), "layers.0.self_attn", tpf.placement("cpu", [[0], [1]]), Batch())
    """
    indexers = [(child, m) for child, m in attention.named_modules() if is_split_indexer(m)]
    for child, module in indexers:
        module.register_forward_pre_hook(_Indexer(f"{name}.{child}", attention, placement, batch), with_kwargs=True)
        if _pooled(module):  # (its picks reach the attention as a mask over the whole sequence)
            picks_by_mask(attention)
    if indexers:
        forward = functools.partial(type(attention).forward, attention)  # (its class's: a wrapper may stand for it)
        attention.register_forward_pre_hook(_NoMask(inspect.signature(forward)), with_kwargs=True)


class _NoMask:
    """An attention module's pre-hook: transformers makes no mask for an attention implementation of its own (the
    split one, which hides keys by their global positions), and the module slices the mask it hands its indexer:
    a ``[1, 1, 1, 1]`` mask that hides nothing stands for it."""

    def __init__(self, signature: inspect.Signature) -> None:
        self.signature = signature
        self.var_keyword = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        named = dict(self.signature.bind(*args, **kwargs).arguments)
        named.update(named.pop(self.var_keyword, None) or {})
        if named.get("attention_mask") is None:
            device = next(a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
            named["attention_mask"] = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
        return (), named
