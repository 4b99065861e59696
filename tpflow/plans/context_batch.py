"""What a batch tells context parallelism about its documents: the padding of a 2-D ``attention_mask``, packed
documents from ``position_ids`` that restart or from flash-attention's ``cu_seq_lens_*``, and each query's first
visible key (its document's start) that the ring and Ulysses' bounded attention run on. Every check here raises
before any collective, on every rank alike (the ranks were fed the same batch)."""

from __future__ import annotations

import inspect
import re

import torch
from torch import nn

__all__ = ["first_keys", "masks_documents", "read_documents"]

IGNORE = -100  # transformers' ignore_index of the labels


def read_documents(named: dict, batch: int, seq: int, packing: bool) -> tuple[torch.Tensor | None,
                                                                               torch.Tensor | None, torch.Tensor]:
    """The padding, documents and positions of a batch, taking ``attention_mask`` and the ``cu_seq_lens_*`` /
    ``max_length_*`` keywords out of ``named`` (the model's keyword arguments).

    Padding on the right needs nothing (causal attention keeps every real token from the padding after it);
    padding elsewhere is a document of its own, which the real tokens do not see. Packed documents come from
    ``position_ids`` that restart (where the model's own masks read them: ``packing``) or from ``cu_seq_lens_q`` /
    ``cu_seq_lens_k`` (one row, as ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` packs it).

    Args:
        named: the model's keyword arguments (changed: the mask and the flash keywords taken out).
        batch, seq: the tokens' shape.
        packing: whether restarting ``position_ids`` are documents (``masks_documents`` of the model).

    Returns:
        ``(pads, documents, positions)``: the padded positions ``[batch, seq]`` (or None), each token's document
        ``[batch, seq]`` (or None: one document a row, right padding included), and the ``position_ids`` (made where
        none were given).

    Example::

        >>> named = {"position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])}
        >>> pads, documents, positions = read_documents(named, 1, 8, packing=True)
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
    elif packing and not bool((positions.diff(dim=1) == 1).all()):
        documents = _restarting(positions, pads)
    if lengths is not None:
        if pads is not None:
            raise ValueError("cu_seq_lens beside a padding mask: pack without padding")
        if documents is not None and not torch.equal(documents, lengths.to(documents.device)):
            raise ValueError("position_ids restart where cu_seq_lens_q does not start a document: pass the two "
                             "from one collator (DataCollatorWithFlattening), or either alone")
        documents = lengths
    return pads, documents, positions


def _restarting(positions: torch.Tensor, pads: torch.Tensor | None) -> torch.Tensor:
    """Packed documents' ids from ``position_ids`` that restart (a new document wherever they do not count up by
    one, as transformers' own masks read them), numbered from 0."""
    if pads is not None:
        raise ValueError("packed documents (position_ids that restart) beside a padding mask: one device reads "
                         "them as one document; pack without padding, or pad without restarting positions")
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


def masks_documents(model: nn.Module) -> bool:
    """Whether the model's own attention keeps packed documents apart: under the flash kernels transformers finds
    them from ``position_ids`` itself; under the others, where the decoder hands ``position_ids`` to the mask
    builders (Llama's, Qwen3's do; gpt-oss's does not, so one device attends across documents there, and so does the
    split).

    Args:
        model: a Hugging Face causal LM, under its own attention implementation.

    Returns:
        True or False (True where its source cannot be read).

    Example::

        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> masks_documents(LlamaForCausalLM(LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        ...                                              intermediate_size=32, vocab_size=32)))
        True
    """
    if str(getattr(getattr(model, "config", None), "_attn_implementation", "")).startswith("flash"):
        return True
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    try:
        source = inspect.getsource(type(decoder).forward)
    except (OSError, TypeError):
        return True
    builds = re.findall(r"mask_kwargs\s*=\s*\{[^}]*\}|create_\w*mask\([^)]*\)", source)
    return not builds or any("position_ids" in b for b in builds)
