"""What a batch tells context parallelism about its documents: the padding of a 2-D ``attention_mask``, packed
documents from ``position_ids`` that restart or from flash-attention's ``cu_seq_lens_*``, and each query's first
visible key (its document's start) that the ring and Ulysses' bounded attention run on. Every check here raises
before any collective, on every rank alike (the ranks were fed the same batch)."""

from __future__ import annotations

import functools
import inspect
import re

import torch
from torch import nn

__all__ = ["PackedDocuments", "first_keys", "read_documents"]

IGNORE = -100  # transformers' ignore_index of the labels


def read_documents(named: dict, batch: int, seq: int, reading: str | None) -> tuple[torch.Tensor | None,
                                                                                   torch.Tensor | None, torch.Tensor]:
    """The padding, documents and positions of a batch, taking ``attention_mask`` and the ``cu_seq_lens_*`` /
    ``max_length_*`` keywords out of ``named`` (the model's keyword arguments).

    Padding on the right needs nothing (causal attention keeps every real token from the padding after it);
    padding elsewhere is a document of its own, which the real tokens do not see. Packed documents are kept apart
    where one device keeps them apart in this call (``reading``, from ``PackedDocuments.reading``): from
    ``position_ids`` that restart, or from ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (one row, as
    ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` packs it).

    Args:
        named: the model's keyword arguments (changed: the mask and the flash keywords taken out).
        batch, seq: the tokens' shape.
        reading: ``"positions"``, ``"lengths"``, ``"unknown"`` (restarting positions refused) or None (one device
            attends across packed documents in this call).

    Returns:
        ``(pads, documents, positions)``: the padded positions ``[batch, seq]`` (or None), each token's document
        ``[batch, seq]`` (or None: one document a row, right padding included), and the ``position_ids`` (made where
        none were given).

    Example::

        >>> named = {"position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])}
        >>> pads, documents, positions = read_documents(named, 1, 8, "positions")
        >>> pads, documents
        (None, tensor([[0, 0, 0, 1, 1, 2, 2, 2]]))
    """
    pads, hidden = _padding(named.pop("attention_mask", None), batch, seq)
    lengths = _cu_seq_lens(named, batch, seq)
    documents = pads.long() if hidden else None
    positions = named.get("position_ids")
    if positions is None:
        positions = torch.arange(seq).expand(batch, seq)
    elif positions.shape != (batch, seq):
        raise ValueError(f"context parallelism takes position_ids [batch, seq] = {[batch, seq]} (got "
                         f"{list(positions.shape)})")
    elif reading in ("positions", "lengths", "unknown") and not bool((positions.diff(dim=1) == 1).all()):
        if reading == "unknown":
            raise ValueError("position_ids restart, and the model's decoder cannot be read for whether one device "
                             "keeps such packed documents apart: pass cu_seq_lens_q / cu_seq_lens_k under a flash "
                             "attention implementation, or unpacked rows")
        documents = _restarting(positions)
    if lengths is not None and pads is not None:
        raise ValueError("cu_seq_lens beside a padding mask: pack without padding")
    if reading == "lengths":
        if documents is not None and not torch.equal(documents, lengths.to(documents.device)):
            raise ValueError("position_ids restart where cu_seq_lens_q does not start a document: pass the two "
                             "from one collator (DataCollatorWithFlattening), or either alone")
        documents = lengths
    return pads, documents, positions


def _restarting(positions: torch.Tensor) -> torch.Tensor:
    """Packed documents' ids from ``position_ids`` that restart (a new document wherever they do not count up by
    one, as transformers' own masks read them), numbered from 0."""
    starts = torch.diff(positions, prepend=positions[:, :1] - 1, dim=1) != 1
    back = starts & (positions != 0)
    if bool(back.any()):
        row, token = (int(i) for i in back.nonzero()[0])
        raise ValueError(f"position_ids go from {int(positions[row, token - 1])} to "
                         f"{int(positions[row, token])} at token {token} of row {row}: packed documents count up "
                         f"by one from 0 each (as DataCollatorWithFlattening gives them)")
    return starts.cumsum(1)


def _cu_seq_lens(named: dict, batch: int, seq: int) -> torch.Tensor | None:
    """Each token's document (``[1, seq]``, from 0) from ``cu_seq_lens_q`` / ``cu_seq_lens_k``, or None; the four
    flash keywords taken out of ``named``."""
    q, k = named.pop("cu_seq_lens_q", None), named.pop("cu_seq_lens_k", None)
    named.pop("max_length_q", None)
    named.pop("max_length_k", None)
    if q is None and k is None:
        return None
    if q is None or k is None or not torch.equal(q, k):
        raise ValueError("context parallelism takes cu_seq_lens_q and cu_seq_lens_k equal (self-attention over packed "
                         "documents)")
    if batch != 1 or q.ndim != 1 or q.numel() < 2 or int(q[0]) != 0 or int(q[-1]) != seq or \
            bool((q.diff() <= 0).any()):
        raise ValueError(f"cu_seq_lens_q {q.tolist()} must count up from 0 to the {seq} tokens of one row (the "
                         f"documents' cumulative lengths, batch 1 as DataCollatorWithFlattening packs it; got batch "
                         f"{batch})")
    return torch.bucketize(torch.arange(seq, device=q.device), q[1:-1].to(torch.long), right=True)[None]


def _padding(mask: torch.Tensor | None, batch: int, seq: int) -> tuple[torch.Tensor | None, bool]:
    """The padded positions of a 2-D ``attention_mask`` (None for none), and whether the attention must hide them
    (padding anywhere but on the right)."""
    if mask is None:
        return None, False
    if mask.ndim != 2 or tuple(mask.shape) != (batch, seq):
        raise ValueError(f"context parallelism takes a 2-D padding mask [batch, seq] = {[batch, seq]} (got "
                         f"{list(mask.shape)}): a 4-D mask (packed documents, a mask of your own) is not supported")
    real = mask.bool()
    if bool(real.all()):
        return None, False
    right = not bool((real[:, 1:] & ~real[:, :-1]).any())
    return ~real, not right


def first_keys(documents: torch.Tensor, kind: str) -> torch.Tensor | None:
    """Each token's first visible key: the start of its document's run of tokens. Each document must be one run
    (padding on the left or right of a row, packed documents) for a query's keys to be one span.

    Args:
        documents: ``[batch, seq]``, each token's document.
        kind: ``"ring"`` (documents that are not runs refused, naming Ulysses) or ``"ulysses"`` (None for them: its
            whole sequences take a mask instead).

    Returns:
        ``[batch, seq]`` positions, or None.

    Example::

        >>> first_keys(torch.tensor([[1, 1, 1, 0, 0, 0]]), "ring")          # left padding of 3
        tensor([[0, 0, 0, 3, 3, 3]])
        >>> first_keys(torch.tensor([[0, 1, 0, 0]]), "ulysses") is None     # padding inside the row
        True
    """
    at = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    if starts.sum(1).tolist() != [row.unique().numel() for row in documents]:
        if kind == "ulysses":
            return None
        raise ValueError("the ring takes padding on the left or the right of each row (one run of zeros in the "
                         "attention_mask): padding inside a row hides keys in the middle of a query's span; use "
                         "context_parallel='ulysses', which hides padding anywhere")
    return torch.where(starts, at, 0).cummax(1).values


class PackedDocuments:
    """Whether one device keeps a call's packed documents apart, which transformers decides call by call: the flash
    kernels take ``cu_seq_lens_*`` with ``max_length_*`` where given, else find documents in one row (batch 1) from
    ``position_ids`` that restart; the other implementations ignore ``cu_seq_lens_*`` and mask documents only where
    the decoder hands ``position_ids`` to its mask builder with no padding mask and no cache (transformers builds
    the document mask only when ``past_key_values is None``: a call with ``use_cache`` on, the config's default,
    makes a cache first and attends across the documents; Llama's and Qwen3's decoders read them, gpt-oss's never).

    Args:
        model: a Hugging Face causal LM, under its own attention implementation.

    Example::

        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> reader = PackedDocuments(LlamaForCausalLM(LlamaConfig(hidden_size=16, num_hidden_layers=1,
        ...     num_attention_heads=2, intermediate_size=32, vocab_size=32)))
        >>> reader.reading({"use_cache": False}, batch=2), reader.reading({}, batch=2)
        ('positions', None)
    """

    def __init__(self, model: nn.Module) -> None:
        self.flash = str(getattr(getattr(model, "config", None), "_attn_implementation", "")).startswith("flash")
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
        self.reads_positions, self.cache_first = _decoder_masks(type(self.decoder))

    def reading(self, named: dict, batch: int) -> str | None:
        """How one device reads packed documents when called with the keyword arguments ``named``.

        Args:
            named: the call's keyword arguments (``attention_mask``, ``use_cache``, ``cu_seq_lens_*`` read).
            batch: its rows.

        Returns:
            ``"lengths"`` (``cu_seq_lens_*``), ``"positions"`` (restarting ``position_ids``), ``"unknown"`` (the
            decoder's source cannot be read) or None (it attends across them).
        """
        mask = named.get("attention_mask")
        if self.flash:
            if all(named.get(k) is not None for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                                                       "max_length_k")):
                return "lengths"
            padded = mask is not None and not bool(mask.bool().all())
            return "positions" if batch == 1 and not padded else None
        if mask is not None or self.reads_positions is False:
            return None
        if self.reads_positions is None:
            return "unknown"
        return None if self.cache_first and self._uses_cache(named) else "positions"

    def _uses_cache(self, named: dict) -> bool:
        """Whether the decoder makes a cache in this call: ``use_cache`` given, else its config's, off under
        gradient checkpointing in training (transformers' ``merge_with_config_defaults``)."""
        use = named.get("use_cache")
        if use is None:
            use = getattr(getattr(self.decoder, "config", None), "use_cache", None)
        return bool(use) and not (getattr(self.decoder, "gradient_checkpointing", False) and self.decoder.training)


@functools.cache
def _decoder_masks(decoder: type) -> tuple[bool | None, bool]:
    """Whether a decoder class hands ``position_ids`` to its mask builders (None: its source cannot be read), and
    whether it makes a cache from ``use_cache`` that reaches them first."""
    try:
        source = inspect.getsource(decoder.forward)
    except (OSError, TypeError):
        return None, True
    builds = re.findall(r"mask_kwargs\s*=\s*\{[^}]*\}|create_\w*mask\([^)]*\)", source)
    reads = not builds or any("position_ids" in b for b in builds)
    cache = bool(re.search(r"past_key_values\s*=\s*\w*Cache\(", source)) and \
        (not builds or any("past_key_values" in b for b in builds))
    return reads, cache
