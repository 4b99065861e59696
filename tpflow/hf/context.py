"""Context parallelism for a Hugging Face causal LM: the sequence split over the ranks of the context axis through
every layer, attention included, the model's own code unchanged.

- At the model's entry (a forward pre-hook), the whole ``input_ids`` (or ``inputs_embeds``) every rank was given is
  cut to this rank's part of the sequence, with its global ``position_ids`` (rotary positions stay right); the
  labels are shifted over the whole sequence first (``shift_labels``, so the label of a part's last token is the
  next part's first), and ``num_items_in_batch`` is their count over the whole sequence, so each rank's share of
  the model's own ``labels=`` loss is its tokens' sum over every rank's count. The batch's padding and packed
  documents (``tpflow.hf.context_batch``) give each query its first visible key, and the ring a cut balanced by
  their work.
- Attention: the model's attention implementation becomes ``"tpflow_context"`` (registered with transformers'
  ``AttentionInterface``); on each attention module it runs ``ring_attention`` (the rank's two head-tail parts,
  key / value blocks around the ring, with the module's scaling and softcap; ``bounded_ring_attention`` where
  queries see keys from a first one on) or ``ulysses_attention`` around the model's original implementation (sdpa
  or eager; ``bounded_attention`` for documents, windows and chunks), on whole sequences of the rank's heads
  (``tpflow.hf.context_attention``). Attention a model computes in its own code runs head parallel instead, its masks
  made for the whole sequence (``tpflow.hf.own_attention``).
- ``inputs_embeds`` made by plain trainable tensors before the model (a soft prompt, a projector) gets its whole
  gradient on every rank (summed over the context ranks in the backward), as one device computes it.
- Before the head, a ring's parts (head-tail, or balanced) are exchanged into contiguous ones (an all-to-all of the
  hidden states, much smaller than the logits), so that ``.logits`` comes back as a global tensor split over the
  sequence (``full_tensor()`` gives it whole) and the shifted labels are cut alike.
- At the exit (a forward hook) the loss is summed over the context ranks (all-reduce forward, identity backward):
  every rank holds one device's loss, and each rank's backward gives its tokens' share of every gradient, which
  the weights' partial-sum gradients add up over the context axis.

``generate`` decodes one token at a time, which a sequence split cannot divide: it raises, naming the plan to
decode with.
"""

from __future__ import annotations

import copy
import functools
import inspect
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from tpflow import comm
from tpflow.global_tensor import from_local
from tpflow.hf.context_attention import (
    IMPLEMENTATION,
    Batch,
    context_group,
    register,
)
from tpflow.hf.context_batch import IGNORE, PackedDocuments, first_keys, read_documents
from tpflow.hf.mixer_styles import mixer_style, mixers_within
from tpflow.hf.mixers import (
    UNKNOWN,
    head_parallel_attentions,
    interface_attention,
    is_attention,
    own_loss,
    own_positions,
    runs_head_parallel,
    unsplit_mixers,
)
from tpflow.hf.own_attention import whole_masks
from tpflow.ops.context_attention import balanced, contiguous, head_tail, regroup
from tpflow.placement import Placement
from tpflow.plans.inputs import InputCheck
from tpflow.sbp import broadcast, split

__all__ = ["context_parallel", "output_head", "refuse_unsplit"]


def refuse_unsplit(model: nn.Module) -> None:
    """Raise, naming them, where ``model``'s layers mix tokens other than by attention context parallelism splits
    (or hold no attention it can split at all); an attention computed in the model's own code (``own_attention``)
    runs head parallel, but not beside attention run through transformers' ``AttentionInterface``.

    Args:
        model: a Hugging Face model.

    Example::

        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> refuse_unsplit(LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
        ...                                              num_hidden_layers=1, num_attention_heads=4)))
    """
    own = head_parallel_attentions(model)
    unsplit = [m for m in unsplit_mixers(model) if not mixers_within(model.get_submodule(m.partition(" ")[0]))
               and not (m.endswith(UNKNOWN) and runs_head_parallel(model.get_submodule(m.partition(" ")[0])))]
    if unsplit:  # (a mixer tpflow splits by heads runs head parallel: every token gathered, heads split over the ranks)
        raise ValueError(f"context parallelism splits the sequence over the ranks, and {type(model).__name__}'s "
                         f"layers mix tokens other than by attention it can split, which each rank would run on its "
                         f"part of the sequence without the earlier tokens: {'; '.join(unsplit[:3])}. Train it with "
                         f"tensor or data parallelism")
    interface = [n for n, m in model.named_modules() if interface_attention(m)]
    if own and interface:
        raise ValueError(f"{type(model).__name__} computes attention in its own code ({own[0]}), which context "
                         f"parallelism runs head parallel, and through transformers' AttentionInterface "
                         f"({interface[0]}), which it runs by a ring or Ulysses, with masks of another length: it "
                         f"runs one kind or the other. Train it with tensor or data parallelism")
    if not own and not any(is_attention(m) or mixer_style(m) is not None for m in model.modules()):
        raise ValueError(f"context parallelism splits attention run through transformers' AttentionInterface, and "
                         f"{type(model).__name__} has none: train it with tensor or data parallelism")


# what a model may pass its attention that the split cannot honour: the keyword, and why


def _cut(x: torch.Tensor, segments) -> torch.Tensor:
    """This rank's segments of dim 1, laid end to end (contiguous: the model's code may view it)."""
    return torch.cat([x[:, start:start + length] for start, length in segments], 1)


class _Context:
    """The root model's hooks: the inputs cut on entry, the loss summed and the logits made global on exit."""

    def __init__(self, model: nn.Module, kind: str, placement: Placement, logits_placement: Placement,
                 batch: Batch, packing: PackedDocuments) -> None:
        self.kind, self.placement, self.logits_placement, self.batch = kind, placement, logits_placement, batch
        self.signature = inspect.signature(model.forward)
        self.var_keyword = next((p.name for p in self.signature.parameters.values()
                                 if p.kind is inspect.Parameter.VAR_KEYWORD), None)
        self.same_inputs = InputCheck(type(model).__name__, placement, axis=0, kind="context-parallel")
        self.packing = packing
        self.own_positions, self.own_loss = own_positions(model), own_loss(model)
        self.reordered, self.own_labels = False, None
        model.register_forward_pre_hook(self.enter, with_kwargs=True)
        model.register_forward_hook(self.leave)

    @property
    def world(self) -> int:
        return self.placement.hierarchy[0]

    @property
    def rank(self) -> int:
        coord = self.placement.coordinate()
        return 0 if coord is None else coord[0]

    def cut(self, seq: int, first: torch.Tensor | None):
        """Every rank's segments through the layers: Ulysses' contiguous parts; the ring's head-tail ones, or over
        packed documents (``first``: each query's first key) a cut balanced by their attention work."""
        if self.kind == "ulysses":
            return contiguous(self.world, seq)
        return head_tail(self.world, seq) if first is None else balanced(self.world, first)

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        named = dict(self.signature.bind(*args, **kwargs).arguments)
        named.update(named.pop(self.var_keyword, None) or {})
        ids, embeds = named.get("input_ids"), named.get("inputs_embeds")
        tokens = ids if ids is not None else embeds
        if tokens is None:
            raise ValueError("context parallelism cuts input_ids (or inputs_embeds) by the sequence: pass one")
        labels, positions = named.get("labels"), named.get("position_ids")
        for x in (tokens, labels, positions, named.get("attention_mask"), named.get("cu_seq_lens_q")):
            # first, every call: ranks fed other shapes must not part ways
            self.same_inputs.check(x, always=True)
        if named.get("past_key_values") is not None or named.get("logits_to_keep") not in (None, 0):
            raise ValueError(_GENERATE)
        if named.get("return_dict") is False:
            raise ValueError("context parallelism returns .logits as a global tensor on a ModelOutput: call the model "
                             "with return_dict=True")
        batch, seq = tokens.shape[:2]
        parts = 2 * self.world if self.kind == "ring" else self.world
        if seq % parts:
            raise ValueError(f"context parallelism ({self.kind!r}) over {self.world} ranks cuts the sequence into "
                             f"{parts} equal parts: {seq} tokens is not a multiple of {parts}; pad it to "
                             f"{math.ceil(seq / parts) * parts} (right padding with labels = {IGNORE} leaves the loss "
                             f"and the other tokens' logits as they are)")
        counted = None  # positions the model counts its own way (RoBERTa's, past the padding), over the whole rows
        if named.get("position_ids") is None and self.own_positions is not None:
            counted = self.counted_positions(module, ids, embeds)
        mask = named.get("attention_mask")
        pads, documents, positions = read_documents(named, batch, seq, self.packing.reading(named, batch))
        positions = positions.to(tokens.device)
        self.batch.positions, self.batch.masks_made = positions, False
        self.batch.mask = mask if isinstance(mask, torch.Tensor) and mask.ndim == 2 else None
        self.batch.documents, self.batch.pads = documents, pads
        first = None if documents is None else first_keys(documents, self.kind)
        self.batch.first, self.batch.exchanges = first, {}
        self.batch.segments = tuple(self.cut(seq, first))
        for key in ("labels", "shift_labels"):
            if named.get(key) is not None and named[key].shape != (batch, seq):
                raise ValueError(f"{key} {list(named[key].shape)} must have the tokens' shape {[batch, seq]} (the "
                                 f"model shifts the labels itself)")
        layers = self.batch.segments[self.rank]
        if ids is None:
            tokens = self.whole_gradient(tokens)
        named["input_ids" if ids is not None else "inputs_embeds"] = _cut(tokens, layers)
        named["position_ids"] = _cut(positions if counted is None else counted.to(positions.device), layers)
        named["use_cache"] = False
        self.own_labels = None
        if labels is not None and self.own_loss:  # its own loss, of this rank's logits (contiguous) and labels
            if pads is not None and bool((labels[pads] != IGNORE).any()):
                raise ValueError(_PADS_LABELLED)
            self.own_labels, self.own_count = _cut(labels, contiguous(self.world, seq)[self.rank]), \
                (labels != IGNORE).sum()
            named["labels"] = self.own_labels
        elif labels is not None:
            shift = named.get("shift_labels")
            shift = F.pad(labels, (0, 1), value=IGNORE)[..., 1:] if shift is None else shift
            if pads is not None and bool((shift[pads] != IGNORE).any()):
                raise ValueError(_PADS_LABELLED)
            if named.get("num_items_in_batch") is None:
                named["num_items_in_batch"] = (shift != IGNORE).sum()
            named["shift_labels"] = _cut(shift, contiguous(self.world, seq)[self.rank])
        self.reordered = False
        return (), named

    def counted_positions(self, model: nn.Module, ids: torch.Tensor | None,
                          embeds: torch.Tensor | None) -> torch.Tensor:
        """The positions the model's embeddings count themselves when given none (from ``padding_idx + 1``, past the
        padding: RoBERTa's), by their own function, over the whole rows: each rank gets its tokens' share of them."""
        embeddings = model.get_submodule(self.own_positions.rpartition(".")[0])
        padding = model.get_submodule(self.own_positions).padding_idx
        count = getattr(embeddings, "create_position_ids_from_input_ids" if ids is not None else
                        "create_position_ids_from_inputs_embeds", None)
        if count is None:
            raise ValueError(f"{self.own_positions} counts positions its own way when none are given, by a function "
                             f"tpflow does not know: context parallelism, which gives every rank its tokens' global "
                             f"positions, needs them given: pass position_ids")
        return count(ids if ids is not None else embeds, padding)

    def whole_gradient(self, embeds: torch.Tensor) -> torch.Tensor:
        """``inputs_embeds`` made by plain trainable tensors (a soft prompt, a projector before the model) gets its
        whole gradient on every rank (each rank's backward covers its own tokens: summed over the context ranks), as
        one device computes it; made by tpflow's global parameters (the model's own embedding), it is left as it is:
        their gradients are summed over the context ranks already. Made by both, it is refused."""
        if not embeds.requires_grad or not torch.is_grad_enabled():
            return embeds
        plain, global_ = _leaves(embeds)
        if plain and global_:
            raise ValueError(f"inputs_embeds is computed from tpflow's global parameters and from {len(plain)} plain "
                             f"trainable tensors ({', '.join(plain[:3])}): under context parallelism the global ones "
                             f"sum their gradients over the context ranks, the plain ones would get this rank's "
                             f"tokens' alone. Compute it from plain modules only (a plain copy of the model's "
                             f"embedding), or parallelize those modules with the model")
        return comm.copy_to_ranks(embeds, context_group(self.placement)) if plain else embeds

    def to_contiguous(self, module: nn.Module, args: tuple) -> tuple:
        """A ring's hidden states before the head: this rank's parts (head-tail, or balanced) exchanged for
        contiguous ones."""
        self.reordered = True
        if self.world == 1:
            return args
        seq = args[0].shape[1] * self.world
        hidden = regroup(args[0], self.batch.segments, contiguous(self.world, seq), context_group(self.placement))
        return (hidden, *args[1:])

    def leave(self, module: nn.Module, args: tuple, output: object) -> object:
        if isinstance(output, tuple):
            raise ValueError("context parallelism needs the model's output as a ModelOutput: call it with "
                             "return_dict=True")
        if self.kind == "ring" and self.world > 1 and not self.reordered:
            raise RuntimeError("the ring's head-tail parts never reached the output head's forward (the model "
                               "computed its logits some other way): its loss and logits would be out of order")
        group = context_group(self.placement)
        if getattr(output, "loss", None) is not None and self.own_labels is not None:
            output.loss = self.own_share(module, output.loss, output.logits)
        if getattr(output, "loss", None) is not None:
            output.loss = comm.reduce_from_ranks(output.loss, group)
        logits = getattr(output, "logits", None)
        if isinstance(logits, torch.Tensor):
            output.logits = self._global(logits)
        return output

    def own_share(self, model: nn.Module, loss: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """This rank's share of a loss the model computes in its own code (on this rank's tokens alone), where every
        rank finds it the mean of its tokens' cross-entropy against their labels (``labels`` unshifted, as
        BART-family decoders and Whisper's score them): its tokens' sum over every rank's count."""
        if isinstance(logits, DTensor):
            raise ValueError(f"{type(model).__name__} computes its labels= loss in its own code, which a vocabulary "
                             f"split over the tensor ranks would give it in parts: compute the loss from .logits, or "
                             f"pass no labels")
        labels = self.own_labels
        summed = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).to(logits.device),
                                 ignore_index=IGNORE, reduction="sum")
        count = (labels != IGNORE).sum()
        tol = 1e-2 if logits.element_size() < 4 else 1e-5
        mean = bool(count == 0 or torch.allclose(summed.detach() / count, loss.detach().to(summed.dtype), rtol=tol))
        agreed = torch.tensor([float(mean)])
        group = context_group(self.placement)
        if self.world > 1:
            dist.all_reduce(agreed, dist.ReduceOp.MIN, group=group)  # every rank raises, or none
        if not agreed.item():
            raise ValueError(f"{type(model).__name__} computes its labels= loss in its own code, and it is not the "
                             f"mean of its tokens' cross-entropy against their labels (which context parallelism "
                             f"sums over the ranks): compute the loss from .logits (a global tensor split over the "
                             f"sequence), or pass no labels")
        return summed / self.own_count.to(summed.device)

    def _global(self, logits: torch.Tensor) -> DTensor:
        """This rank's contiguous part of the logits as a global tensor split over the sequence (and over the
        vocabulary where the head splits it)."""
        vocab_split = isinstance(logits, DTensor)
        local = logits.to_local() if vocab_split else logits
        shape = (local.shape[0], local.shape[1] * self.world, logits.shape[2])
        if self.logits_placement.ndim == 1:
            return from_local(local, self.logits_placement, split(1), shape=shape)
        return from_local(local, self.logits_placement, (split(1), split(2) if vocab_split else broadcast),
                          shape=shape, sync_data=False)


_PADS_LABELLED = (f"the padding carries labels: give the padded positions labels = {IGNORE} (as "
                  f"DataCollatorForLanguageModeling does), which one device's masked attention and context "
                  f"parallelism's causal attention then score alike")

_GENERATE = ("a model parallelized with context_parallel splits whole sequences over its ranks, and decoding runs one "
             "token at a time (past_key_values, logits_to_keep): generate with a model parallelized by "
             "tpf.hf_plan(model) (tensor parallelism, without context_parallel), loading the same weights")


def _leaves(t: torch.Tensor) -> tuple[list[str], bool]:
    """The plain trainable leaves ``t``'s autograd graph reaches (their shapes), and whether it reaches global ones
    (tpflow's parameters, DTensors)."""
    plain, global_, seen, stack = [], False, set(), [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # an AccumulateGrad: a leaf that takes a gradient
        if leaf is not None:
            global_ |= isinstance(leaf, DTensor)
            if not isinstance(leaf, DTensor):
                plain.append(f"a {list(leaf.shape)} tensor")
            continue
        stack.extend(fn for fn, _ in node.next_functions)
    return plain, global_


class _CountedFromZero:
    """A position embedding's pre-hook: the positions a decoder counts itself from the sequence's length (BART's
    family: ``arange(seq)``, whatever ``position_ids`` it is given; MVP's and RoFormer's, given none, from their
    input's shape), which on a rank's part of the sequence would count from 0, become its tokens' global positions
    (one device's count)."""

    def __init__(self, context: _Context) -> None:
        self.context = context

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        given = kwargs.get("position_ids")
        shape = args[0].shape if args and isinstance(args[0], torch.Tensor) else args[0] if args and isinstance(
            args[0], torch.Size) else None  # (the ids, or RoFormer's input_ids_shape)
        local = sum(n for _, n in self.context.batch.segments[self.context.rank])
        if given is None and shape is not None and len(shape) >= 2 and shape[1] == local and _counts_from_zero(
                type(module)):
            given = torch.arange(local, device=self.context.batch.positions.device)
        if not isinstance(given, torch.Tensor) or given.ndim != 1 or not bool(
                (given == torch.arange(len(given), device=given.device)).all()):
            return args, kwargs
        at = self.context.batch.order(given.device)[1]
        return args, {**kwargs, "position_ids": at[self.context.rank * len(given):(self.context.rank + 1) * len(given)]}


@functools.cache
def _counts_from_zero(kind: type) -> bool:
    """Whether a position embedding's forward, given no positions, counts them itself (``torch.arange``), not from
    its input's padding (M2M100's, which context parallelism's positions would replace)."""
    try:
        return "arange" in inspect.getsource(kind.forward)
    except (OSError, TypeError):
        return False


class _NoGenerate:
    """``generate`` of a context-parallel model: a clear error (an object, so a copy of the model keeps it)."""

    def __call__(self, *args, **kwargs):
        raise ValueError(_GENERATE)


def output_head(model: nn.Module) -> nn.Module | None:
    """``model``'s output head (``get_output_embeddings()``), before which the ring's parts become contiguous; None
    where it has none.

    Args:
        model: a Hugging Face model.

    Returns:
        The head, or None.

    Example::

        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> output_head(LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
        ...                                           num_hidden_layers=1, num_attention_heads=4)))
        Linear(in_features=16, out_features=64, bias=False)
    """
    return model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None


def _own_config(model: nn.Module) -> None:
    """Give ``model`` (and each of its modules that reads it) a config of its own: switching the attention of a
    config another model shares (two models built from one config object) would switch that model's too."""
    from transformers import PretrainedConfig

    old = model.config
    new = copy.deepcopy(old)
    pairs, stack = {}, [(old, new)]
    while stack:  # the config and its sub-configs (a composite model's text / vision configs), at any depth
        a, b = stack.pop()
        pairs[id(a)] = b
        stack += [(v, getattr(b, k)) for k, v in vars(a).items() if isinstance(v, PretrainedConfig)]
    for module in model.modules():
        if id(getattr(module, "config", None)) in pairs:
            module.config = pairs[id(module.config)]


def context_parallel(model: nn.Module, kind: str, placement: Placement, logits_placement: Placement,
                     batch: Batch) -> None:
    """Make ``model`` (a transformers causal LM, its layers already parallelized over ``placement``'s second axis and
    each attention module given its ``tpf.ContextParallel`` entry) run context-parallel over ``placement``'s first
    axis: what the entries do once every one has applied itself.

    Args:
        model: the model, changed in place.
        kind: ``"ring"`` or ``"ulysses"``.
        placement: ``(context, tensor)`` ranks.
        logits_placement: the placement ``.logits`` is global over (the user's: 1-D for context alone).
        batch: what the entry finds in each batch, shared with the attention modules (``attach``).

    Example::

        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
        ...                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
        >>> model = tpf.parallelize(model, placement=P, plan=tpf.hf_plan(model, context_parallel="ulysses"))
        >>> model.config._attn_implementation
        'tpflow_context'
    """
    register()
    _own_config(model)
    packing = PackedDocuments(model)  # read under the model's own attention implementation
    interface = any(interface_attention(m) for m in model.modules())
    if interface:  # (a state space alone, or attention in the model's own code, has none: they run head parallel)
        model.set_attn_implementation(IMPLEMENTATION)
    if interface and model.config._attn_implementation != IMPLEMENTATION:
        raise ValueError(f"{type(model).__name__} does not take its attention from transformers' AttentionInterface, "
                         f"so context parallelism cannot run it")
    context = _Context(model, kind, placement, logits_placement, batch, packing)
    if head_parallel_attentions(model):  # (their masks made for the whole sequence: after its config is its own)
        whole_masks(model, batch)
    for name, module in model.named_modules():
        if name.rpartition(".")[2] == "embed_positions" and "position_ids" in inspect.signature(
                module.forward).parameters:
            module.register_forward_pre_hook(_CountedFromZero(context), with_kwargs=True)
    if kind == "ring":
        output_head(model).register_forward_pre_hook(context.to_contiguous)
    model.generate = _NoGenerate()
