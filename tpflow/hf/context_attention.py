"""Context parallelism's attention inside a Hugging Face model: an implementation registered with transformers'
``AttentionInterface`` (``IMPLEMENTATION``) that runs, on each attention module ``parallelize`` attached it to, the
ring (``tpflow.ops.ring_attention``: the rank's head-tail parts, key / value blocks around the ring, with the
module's scaling and softcap) or Ulysses (``tpflow.ops.ulysses_attention``) around the model's original
implementation (sdpa or eager) on whole sequences of the rank's heads."""

from __future__ import annotations

import dataclasses
import functools
import sys

import torch
import torch.distributed as dist
from torch import nn

from tpflow import comm
from tpflow.ops.bounded_ring import RingExchange, bounded_attention, bounded_ring_attention, pieces, ring_exchange
from tpflow.ops.context_attention import Segments, ring_attention, ulysses_attention
from tpflow.placement import Placement
from tpflow.sbp import chunk_bounds

__all__ = ["IMPLEMENTATION", "ULYSSES_ORIGINALS", "Batch", "attach", "context_group", "picks_by_mask", "register",
           "visible"]

IMPLEMENTATION = "tpflow_context"  # the attention implementation's name in transformers' AttentionInterface
_STATE = "_tpflow_context"
ULYSSES_ORIGINALS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3")  # causal without a mask of ours
PIECE = 1024  # Ulysses' whole sequences over packed documents, windows, chunks: attention pair of pieces by pair
_UNSPLIT = {"position_bias": "a learned position bias over the whole scores",
            "cu_seq_lens_q": "packed documents by cu_seq_lens", "cu_seq_lens_k": "packed documents by cu_seq_lens"}


def context_group(placement: Placement):
    """The context axis' process group (axis 0; of one rank too, which the ring runs on alone), None outside the
    placement.

    Args:
        placement: the ``(context, tensor)`` placement.

    Returns:
        The group, or None.

    Example::

        >>> context_group(tpf.placement("cpu", [[0], [1]])) is not None
        True
    """
    return None if placement.coordinate() is None else placement.mesh.get_group(0)


@dataclasses.dataclass
class Batch:
    """What the model's entry found in the batch that its attention modules need, shared by them.

    Args:
        documents: ``[batch, seq]``, each token's document (packed documents: ``position_ids`` that restart; hidden
            padding), or None for one document a row.
        pads: ``[batch, seq]``, the padded positions (on the right too, which causal attention needs no document
            for), or None.
        segments: every rank's segments of the sequence in this batch (the ring's: head-tail, or balanced by work
            over packed documents).
        first: ``[batch, seq]``, each query's first visible key (its document's start), or None where every query
            sees the keys from the row's start (or, under Ulysses, where the documents are not runs of tokens).
        exchanges: the ``RingExchange`` of this batch for each (sliding window, attention chunk, whole sequences on
            one rank) (None: none), made by the first layer that needs it.
        positions: ``[batch, seq]``, the whole sequence's ``position_ids`` (given or counted).
        mask: ``[batch, seq]``, the whole ``attention_mask`` given, or None.
        masks_made: whether the model made its masks for the whole sequence in this call
            (``tpflow.hf.own_attention.whole_masks``).

    Example::

        >>> Batch().documents is None
        True
    """

    documents: torch.Tensor | None = None
    pads: torch.Tensor | None = None
    segments: tuple[Segments, ...] = ()
    first: torch.Tensor | None = None
    exchanges: dict[tuple[int | None, int | None, bool], RingExchange] = dataclasses.field(default_factory=dict)
    positions: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    masks_made: bool = False

    def exchange(self, q: torch.Tensor, window: int | None, chunk: int | None, alone: bool = False) -> RingExchange:
        """The exchange for a sliding window of ``window`` tokens and attention chunks of ``chunk`` (Llama 4's;
        either None: none) over this batch's first keys: the ring's, or ``alone`` one rank's pieces of whole
        sequences (Ulysses')."""
        key = (window, chunk, alone)
        if key not in self.exchanges:
            seq = sum(n for parts in self.segments for _, n in parts)
            segments = (pieces(seq, PIECE),) if alone else self.segments
            at = torch.arange(seq, device=q.device)
            first = self.first if self.first is not None else torch.zeros(q.shape[0], seq, dtype=torch.long,
                                                                           device=q.device)
            start = first  # each token's document's
            if window is not None:
                first = torch.maximum(first, at - window + 1)
            if chunk is not None:  # chunks count from each document's start, as transformers' masks count them
                first = torch.maximum(first, start + (at - start) // chunk * chunk)
            self.exchanges[key] = ring_exchange(segments, first)
        return self.exchanges[key]

    @property
    def padded_before_tokens(self) -> bool:
        """Whether a row has padding before one of its tokens (on the left, or inside): where a state space or a
        linear attention, which zero the padding's states on one device, would carry it into theirs."""
        return self.pads is not None and bool((self.pads[:, :-1] & ~self.pads[:, 1:]).any())

    @property
    def in_order(self) -> bool:
        """Whether every rank's tokens, gathered rank after rank, are the sequence in order (Ulysses' contiguous
        parts): nothing to put in order."""
        at = 0
        for parts in self.segments:
            for start, length in parts:
                if start != at:
                    return False
                at += length
        return True

    def order(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each position of the sequence sits among the context ranks' tokens gathered rank after rank, and
        each of those tokens' position (what puts a gathered sequence in order, and back)."""
        return _sequence_order(self.segments, device)


@functools.lru_cache(maxsize=8)  # every layer of a batch reads its cut; a packed batch has its own
def _sequence_order(segments: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    at = torch.tensor([p for parts in segments for a, n in parts for p in range(a, a + n)], device=device)
    return torch.argsort(at), at


class _Attention:
    """One attention module's context-parallel attention (transformers calls it through ``IMPLEMENTATION``)."""

    def __init__(self, name: str, kind: str, placement: Placement, original: str, batch: Batch) -> None:
        self.name, self.kind, self.placement, self.original, self.batch = name, kind, placement, original, batch
        self.used = False
        self.picks_by_mask = False  # its mask: an indexer's picks over the whole sequence (``picks_by_mask``)

    def enter(self, module: nn.Module, args: tuple) -> None:
        self.used = False

    def leave(self, module: nn.Module, args: tuple, output: object) -> None:
        """An attention module that computed its attention itself, not through transformers' AttentionInterface,
        would have run it on this rank's tokens alone."""
        if not self.used:
            raise ValueError(f"{self.name!r} ({type(module).__name__}) computed its attention without transformers' "
                             f"AttentionInterface, on this rank's part of the sequence alone: context parallelism "
                             f"cannot split it. Train the model with tensor or data parallelism")

    def __call__(self, module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float,
                 scaling: float | None, sliding_window: int | None, softcap: float | None,
                 extra: dict) -> tuple[torch.Tensor, None]:
        group, world = context_group(self.placement), self.placement.hierarchy[0]
        seq = q.shape[2] * world
        if dropout:
            raise ValueError(f"{self.name!r}: attention dropout ({dropout}) under context parallelism is not "
                             f"supported: set config.attention_dropout = 0.0")
        for key in _UNSPLIT:
            if extra.get(key) is not None:
                raise ValueError(f"{self.name!r} passes {key!r} to its attention, which context parallelism does not "
                                 f"split ({_UNSPLIT[key]})")
        window = sliding_window if sliding_window is not None and sliding_window < seq else None
        chunk = _chunk(module, seq)
        # (a decoder's attention is causal by the mask its model makes, whatever the module says: BigBird-Pegasus')
        decoder = bool(getattr(getattr(module, "config", None), "is_decoder", False))
        causal = extra.get("is_causal", getattr(module, "is_causal", True) or decoder)
        documents = self.batch.documents
        if not causal and documents is None and self.batch.pads is not None:  # right padding: every query sees it
            documents = self.batch.pads.long()
        sinks = extra.get("s_aux")  # gpt-oss's: a logit per head in the softmax's denominator
        if extra.get("indices") is not None or extra.get("chosen") is not None:  # sparse attention: the keys an
            return self._sparse(module, q, k, v, extra.get("indices"), extra.get("chosen"), causal, scaling, window,
                                softcap, sinks, chunk, documents).transpose(1, 2), None  # indexer picked for each query
        if self.kind == "ring" and (window is not None or chunk is not None or self.batch.first is not None
                                    or documents is not None):
            if not causal:
                raise ValueError(f"{self.name!r} is not causal: the ring splits packed documents, hidden padding, "
                                 f"sliding windows and chunks of causal attention only; use "
                                 f"context_parallel='ulysses'")
            out = bounded_ring_attention(q, k, v, exchange=self.batch.exchange(q, window, chunk), group=group,
                                         scale=scaling, softcap=softcap, sinks=sinks)
        elif self.kind == "ring":
            out = ring_attention(q, k, v, segments=self.batch.segments, group=group, causal=causal, scale=scaling,
                                 softcap=softcap, sinks=sinks)
        elif causal and (window is not None or chunk is not None or self.batch.first is not None):
            out = ulysses_attention(q, k, v, lambda *qkv: bounded_attention(
                *qkv, exchange=self.batch.exchange(q, window, chunk, alone=True), scale=scaling, softcap=softcap,
                sinks=self._rank_heads(sinks, qkv[0])), group)
        else:
            out = ulysses_attention(q, k, v, lambda *qkv: self._whole(module, *qkv, causal, scaling, sliding_window,
                                                                      softcap, sinks, chunk, documents), group)
        return out.transpose(1, 2), None

    def _rank_heads(self, per_head: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
        """This rank's block of a per-head tensor under Ulysses (its all-to-all gives rank r the r-th block of
        ``q.shape[1]`` heads)."""
        if per_head is None:
            return None
        rank = dist.get_rank(context_group(self.placement))
        return per_head[rank * q.shape[1]:(rank + 1) * q.shape[1]]

    def _sparse(self, module, q, k, v, indices, chosen, causal, scaling, window, softcap, sinks, chunk,
                documents) -> torch.Tensor:
        """Attention over the keys an indexer picked for each of this rank's queries (``indices``: ``[B, q, top-k]``,
        global positions; or ``chosen``: ``[B, q, S]``, True at them), by the model's own attention under a mask:
        Ulysses' whole sequences of this rank's heads (every rank's picks gathered), or the ring's queries against
        every rank's keys and values gathered (which a pick of single keys leaves no block of the ring to skip);
        ``[B, h, q, D]`` out."""
        group, world = context_group(self.placement), self.placement.hierarchy[0]
        at = self.batch.order(q.device)[1]
        chosen = _chosen(indices, len(at)) if chosen is None else chosen
        if self.kind == "ulysses":
            picked = comm.all_gather(chosen.to(torch.uint8), 1, chunk_bounds(len(at), world), group).bool() \
                if world > 1 else chosen
            return ulysses_attention(q, k, v, lambda *qkv: self._whole(
                module, *qkv, causal, scaling, window, softcap, sinks, chunk, documents, chosen=picked), group)
        if self.original not in ("eager", "sdpa"):
            raise ValueError(f"{self.name!r}: the ring runs sparse attention through eager or sdpa attention (a mask "
                             f"of the picked keys), not {self.original!r}: load the model with one of them")
        rank = dist.get_rank(group) if world > 1 else 0
        mine = at[rank * q.shape[2]:(rank + 1) * q.shape[2]]
        k, v = (comm.gather_shared(t.contiguous(), 2, len(at), group) if world > 1 else t for t in (k, v))
        seen = visible(mine, at, causal, window, chunk, documents) & chosen[..., at]
        own = {"num_key_value_groups": q.shape[1] // k.shape[1]}
        extra = {} if sinks is None else {"s_aux": sinks}
        out = _original(module, self.original)(_RankHeads(module, own), q, k, v, _mask(seen[:, None], self.original,
                                                                                       q.dtype),
                                               dropout=0.0, scaling=scaling, softcap=softcap, is_causal=False,
                                               **extra)[0]
        return out.transpose(1, 2)

    def _whole(self, module, q, k, v, causal, scaling, sliding_window, softcap, sinks, chunk,
               documents, chosen: torch.Tensor | None = None) -> torch.Tensor:
        """The model's own attention on whole sequences of this rank's heads (``[B, h, S, D]`` in and out): sdpa and
        the flash kernels causal by the module, eager by a mask made for the whole sequence; what first keys cannot
        say (padding inside a row, attention that is not causal) by a mask that keeps each token in its document,
        window and chunk (eager and sdpa). The module is seen through ``_RankHeads``: this rank's key/value groups
        and sinks."""
        seq, mask = q.shape[2], None
        window = sliding_window is not None and sliding_window < seq
        if documents is not None or window or chunk is not None or chosen is not None:
            if self.original not in ("eager", "sdpa"):
                raise ValueError(f"{self.name!r}: Ulysses runs padding inside a row, masks of attention that is not "
                                 f"causal and sparse attention's picked keys through eager or sdpa attention (a mask "
                                 f"over the whole sequence), not {self.original!r}: load the model with one of them")
            at = torch.arange(seq, device=q.device)
            seen = visible(at, at, causal, sliding_window if window else None, chunk, documents)
            mask = _mask((seen if chosen is None else seen & chosen)[:, None], self.original, q.dtype)  # [B, 1, S, S]
        elif self.original == "eager" and causal:
            mask = torch.full((seq, seq), torch.finfo(q.dtype).min, dtype=q.dtype, device=q.device).triu(1)[None, None]
        own = {"num_key_value_groups": q.shape[1] // k.shape[1]}  # this rank's heads (kv heads maybe repeated)
        extra = {}
        if sinks is not None:
            own["sinks"] = extra["s_aux"] = self._rank_heads(sinks, q)
        out = _original(module, self.original)(_RankHeads(module, own), q, k, v, mask, dropout=0.0, scaling=scaling,
                                               sliding_window=sliding_window, softcap=softcap, is_causal=causal,
                                               **extra)[0]
        return out.transpose(1, 2)


def visible(queries: torch.Tensor, keys: torch.Tensor, causal: bool, window: int | None, chunk: int | None,
            documents: torch.Tensor | None) -> torch.Tensor:
    """Which keys each query sees, by their global positions: causality, the last ``window`` keys (the query's own
    included: transformers' rule), its ``chunk`` of the sequence, its document (``documents``: ``[B, S]``, each
    token's, or None).

    Args:
        queries: ``[q]``, the queries' positions.
        keys: ``[k]``, the keys' positions.
        causal: whether a query sees no later key.
        window: a sliding window, or None.
        chunk: an attention chunk (Llama 4's), or None.
        documents: each position's document, or None.

    Returns:
        ``[B, q, k]`` booleans (``B`` is 1 without documents).

    Example::

        >>> at = torch.arange(4)
        >>> visible(at[2:], at, True, 2, None, None).int()
        tensor([[[0, 1, 1, 0],
                 [0, 0, 1, 1]]], dtype=torch.int32)
    """
    q, k = queries[:, None], keys[None, :]
    seen = q >= k if causal else torch.ones(len(queries), len(keys), dtype=torch.bool, device=keys.device)
    if window is not None:
        seen = seen & (q - k < window)
    if chunk is not None:
        seen = seen & (q // chunk == k // chunk)
    if documents is None:
        return seen[None]
    return seen & (documents[:, queries, None] == documents[:, None, keys])


def _mask(seen: torch.Tensor, original: str, dtype: torch.dtype) -> torch.Tensor:
    """``seen`` as ``original``'s attention takes its mask: booleans (sdpa), or 0 and the dtype's lowest (eager)."""
    if original == "sdpa":
        return seen
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(~seen, torch.finfo(dtype).min)


def _chosen(indices: torch.Tensor, seq: int) -> torch.Tensor:
    """``[B, q, top-k]`` picked key positions as ``[B, q, seq]`` booleans."""
    return torch.zeros(*indices.shape[:-1], seq, dtype=torch.bool, device=indices.device).scatter_(
        -1, indices.long(), True)


class _RankHeads:
    """An attention module as its attention function sees it under Ulysses: its own attributes, but those of this
    rank's heads (``own``: key/value groups, sinks)."""

    def __init__(self, module: nn.Module, own: dict) -> None:
        self.__dict__.update(own)
        self._module = module

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def _chunk(module: nn.Module, seq: int) -> int | None:
    """The attention chunk of ``module`` (Llama 4's chunked layers: each query sees its chunk of
    ``config.attention_chunk_size`` tokens), or None (none, or one as long as the sequence)."""
    config, layer = getattr(module, "config", None), getattr(module, "layer_idx", None)
    size = getattr(config, "attention_chunk_size", None)
    types = getattr(config, "layer_types", None)
    if not size or size >= seq or types is None or layer is None or types[layer] != "chunked_attention":
        return None
    return size


def _original(module: nn.Module, name: str):
    """The attention function transformers would call for ``module`` under implementation ``name``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
               sliding_window: int | None = None, softcap: float | None = None, **kwargs) -> tuple:
    """The attention function registered as ``IMPLEMENTATION``: the module's context-parallel attention (the
    mask, made for this rank's tokens alone, is not read: causality comes from the global positions)."""
    state = getattr(module, _STATE, None)
    if state is None:
        raise RuntimeError(f"{type(module).__name__} runs tpflow's context-parallel attention, but parallelize gave it "
                           f"no tpf.ContextParallel entry: plan every attention module of the model")
    if state.picks_by_mask and attention_mask is not None and attention_mask.dtype == torch.bool:
        kwargs["chosen"] = attention_mask[:, 0].expand(query.shape[0], query.shape[2], -1)  # [B, q, S]
    elif attention_mask is not None and not _only_causal(attention_mask):
        raise ValueError(f"{state.name!r} ({type(module).__name__}) passes its attention a mask it builds itself, "
                         f"which says more than causality (a learned or data-dependent mask, a 4-D mask given to the "
                         f"model): context parallelism, which makes each query's mask from the global positions, "
                         f"cannot split it. Train the model with tensor or data parallelism")
    state.used = True
    out, weights = state(module, query, key, value, dropout, scaling, sliding_window, softcap, kwargs)
    return out.contiguous(), weights  # as transformers' own attention functions return it (a module may view it)


def _only_causal(mask: torch.Tensor) -> bool:
    """Whether an attention mask (boolean, or additive: 0 where seen) hides exactly the later keys, which the
    context-parallel attention hides by the global positions already (a mask made for this rank's tokens alone)."""
    lq, lk = mask.shape[-2:]
    causal = torch.ones(lq, lk, dtype=torch.bool, device=mask.device).tril(lk - lq)
    if mask.dtype == torch.bool:
        return bool((mask == causal).all())
    return bool(((mask == 0) == causal).all() and (mask[..., ~causal] <= torch.finfo(mask.dtype).min / 2).all())


def register() -> None:
    """Register ``IMPLEMENTATION`` with transformers' ``AttentionInterface`` (idempotent).

    Example::

        >>> from transformers import AttentionInterface
        >>> register()
        >>> IMPLEMENTATION in AttentionInterface()
        True
    """
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, _attention)



def picks_by_mask(module: nn.Module) -> None:
    """From now on the attention module ``module`` (given its context-parallel attention by ``attach``) hands its
    attention the keys its indexer picked as a boolean mask over the whole sequence, ``[B, 1, q, S]``
    (Qwen4-Exp's), which the attention runs as sparse attention over them.

    Args:
        module: the attention module.

    Example::

        >>> from transformers import LlamaConfig
        >>> from transformers.models.llama.modeling_llama import LlamaAttention
        >>> attention = LlamaAttention(LlamaConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=2), 0)
        >>> attach(attention, "layers.0.self_attn", "ring", tpf.placement("cpu", [[0], [1]]), "sdpa", Batch())
        >>> picks_by_mask(attention)
    """
    getattr(module, _STATE).picks_by_mask = True


def attach(module: nn.Module, name: str, kind: str, placement: Placement, original: str, batch: Batch) -> None:
    """Give the attention module ``module`` its context-parallel attention, which ``IMPLEMENTATION`` runs.

    Args:
        module: a Hugging Face attention module.
        name: its name in the model, for errors.
        kind: ``"ring"`` or ``"ulysses"``.
        placement: the ``(context, tensor)`` placement.
        original: the model's attention implementation before the switch (Ulysses runs it on whole sequences).
        batch: what the model's entry finds in each batch (its packed documents), shared by the model's attention
            modules.

    Example::

        >>> from transformers import LlamaConfig
        >>> from transformers.models.llama.modeling_llama import LlamaAttention
        >>> attention = LlamaAttention(LlamaConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=2), 0)
        >>> attach(attention, "layers.0.self_attn", "ring", tpf.placement("cpu", [[0], [1]]), "sdpa", Batch())
    """
    state = _Attention(name, kind, placement, original, batch)
    setattr(module, _STATE, state)
    module.register_forward_pre_hook(state.enter)
    module.register_forward_hook(state.leave)
