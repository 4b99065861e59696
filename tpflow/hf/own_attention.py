"""Context parallelism through attention a model computes in its own code (GPT-J's ``_attn``, BLOOM's ``baddbmm``
with ALiBi, BERT's self-attention, CodeGen's, MPT's, GPT-1's), where no ring can be put inside: the attention runs
head parallel, as tpflow runs a state space under context parallelism. Its input is gathered over the context ranks
(every token, in sequence order), its heads split over every rank of the ``(context, tensor)`` grid (rank
``(c, t)`` holds head block ``c * T + t``), its own code runs unchanged on every token of its heads, and its output
projection's partial sums are summed, each context rank keeping its own tokens (``tpflow.hf.mixer_split``).

What the model passes the attention beside its input is made for the whole sequence (``WholeArguments``): rotary
tables and positions gathered, BLOOM's ALiBi made again for every key, and the masks the model makes with
transformers' ``create_causal_mask`` (and its kin) made for the whole sequence by the model's own function, from
the batch's whole ``attention_mask`` and ``position_ids`` (``whole_masks``): a rank holding part of the sequence
would otherwise make a mask of its part alone.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import inspect
import sys
import weakref

import torch
from torch import nn

from tpflow.hf.context_attention import Batch
from tpflow.hf.in_place import BlocksParallel, Conv1DParallel
from tpflow.hf.mixer_split import MixerStyle, SplitMixer, refuse_undivided
from tpflow.hf.mixers import head_parallel_attentions, own_attention, projection
from tpflow.hf.multi_query import MultiQueryColumns
from tpflow.hf.split_heads import OnRankHeads, RankBias, SplitHeads, head_counts, share_heads
from tpflow.plans.linear import ColumnParallel, RowParallel
from tpflow.plans.style import Plan, Stacked, Style

__all__ = ["OwnAttentionHeads", "WholeArguments", "whole_masks", "with_own_attention"]

_MASKS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_bidirectional_mask",
          "create_chunked_causal_mask")  # transformers' mask functions, as a model's module imports them
_LOCAL = ("residual",)  # passed as it is: BLOOM's residual (this rank's tokens, added after the output projection)
_WHOLE_POSITIONS = ("position_embeddings", "sinusoidal_pos")  # per token, along dim -2
_CROSS = ("key_value_states", "encoder_hidden_states", "kv")  # another sequence's keys: cross-attention


def _kind(style: Style) -> tuple[str, int]:
    """A projection entry's ``(kind, parts)``: ``"column"`` (its output features split) or ``"row"``."""
    if isinstance(style, (BlocksParallel, Conv1DParallel)):
        return style.kind, style.parts
    if isinstance(style, MultiQueryColumns):
        raise ValueError("a multi-query projection (Falcon's query_key_value: one key/value head for every query "
                         "head) has no key/value heads to split with its queries: context parallelism cannot run "
                         "its attention head parallel; train it with tensor or data parallelism")
    if isinstance(style, ColumnParallel) and not style.gather_output:
        return "column", 1
    if isinstance(style, RowParallel):
        return "row", 1
    raise ValueError(f"{style!r} is not a projection entry an attention runs head parallel with (a column or row "
                     f"split: ColumnParallel, RowParallel, BlocksParallel, Conv1DParallel)")


def _out_dim(layer: nn.Module) -> int:
    """The dim of a projection's weight that its output features run along: GPT-2's ``Conv1D`` stores it
    transposed."""
    return 0 if isinstance(layer, nn.Linear) else 1


@dataclasses.dataclass(frozen=True)
class OwnAttentionHeads(MixerStyle):
    """Plan style for an attention module that computes its attention in its own code (``own_attention``), under
    context parallelism: run head parallel over every rank of the ``(context, tensor)`` grid (see the module
    docstring). ``with_own_attention`` writes it in place of the module's tensor-parallel entries.

    Args:
        heads: the attention module's name under the planned module (``""``: the planned module itself; ``"self"``:
            BERT's ``attention.self``, whose output projection ``attention.output.dense`` sits beside it).
        layers: the projections, by their names under the planned module, each with its tensor-parallel entry (a
            column or row split; exactly one row: the output projection).
        groups: the blocks the heads are laid out in, each split over the ranks (CodeGen's 4).
        context: set (the style runs under context parallelism alone).

    Example::

        >>> from transformers import GPTJConfig, GPTJForCausalLM
        >>> model = GPTJForCausalLM(GPTJConfig(vocab_size=64, n_embd=16, n_layer=2, n_head=4, rotary_dim=4))
        >>> tpf.hf_plan(model, context_parallel="ring")["transformer.h.*.attn"].entries[0].layers[-1]
        ('out_proj', RowParallel(input_is_parallel=True, sequence_parallel=False, algo='auto', sequence_dim=0))
    """

    heads: str = ""
    layers: tuple[tuple[str, Style], ...] = ()
    groups: int = 1
    context: bool = True

    def attention(self, module: nn.Module) -> nn.Module:
        return module.get_submodule(self.heads) if self.heads else module

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        attention = self.attention(module)
        if not self.context or not own_attention(attention):
            raise ValueError(f"{name!r}: OwnAttentionHeads runs an attention computed in the model's own code head "
                             f"parallel under context parallelism; {type(attention).__name__} is not one, or the plan "
                             f"is not context parallel")
        kinds = [_kind(style)[0] for _, style in self.layers]
        if kinds.count("row") != 1:
            raise ValueError(f"{name!r}: an attention runs head parallel with its projections split and exactly one "
                             f"output projection (a row split); its entries are {self.layers}")
        planned = {id(module.get_submodule(rel)) for rel, _ in self.layers}
        left = [n for n, m in attention.named_modules() if projection(m) and id(m) not in planned]
        if left:
            raise ValueError(f"{name!r}: its projections {left} are not split with its heads: plan them with the "
                             f"others (a column or row split)")
        rows = [rel.rpartition(".")[2] for rel, style in self.layers if _kind(style)[0] == "row"]
        owners = {n: m for n, m in attention.named_modules()}
        own = [n for n, p in attention.named_parameters() if id(owners[n.rpartition(".")[0]]) not in planned
               and not (n == f"{rows[0]}_bias" and p.ndim == 1)]  # (but its output projection's bias kept apart,
        if own:  # added after it: GPT-NeoX-Japanese's)
            raise ValueError(f"{name!r}: {type(attention).__name__} holds parameters beside its projections "
                             f"({own}), which tpflow cannot give each rank its heads' share of: train it with tensor "
                             f"or data parallelism")
        heads, kv, _ = head_counts(attention)
        world = self.world(plan)
        refuse_undivided(name, "attention heads", heads, world, self.said)
        refuse_undivided(name, "key/value heads", kv, world, self.said)
        refuse_undivided(name, f"attention heads in each of its {self.groups} blocks", heads // self.groups, world,
                         self.said)
        for rel, style in self.layers:
            layer = module.get_submodule(rel)
            kind, parts = _kind(style)
            features = layer.weight.shape[_out_dim(layer) if kind == "column" else 1 - _out_dim(layer)]
            if features % parts or (features // parts) % world:
                raise ValueError(f"{name}.{rel}: its {features} features do not split into {parts} blocks of a "
                                 f"multiple of {world} ranks")

    def apply(self, name: str, module: nn.Module, plan: Plan) -> None:
        ranks, attention = self.head_ranks(plan), self.attention(module)
        layers, row, out_bias = [], None, None
        for rel, style in self.layers:
            layer = module.get_submodule(rel)
            kind, parts = _kind(style)
            out = _out_dim(layer)
            for param, dim in (("weight", out if kind == "column" else 1 - out), ("bias", 0)):
                if getattr(layer, param, None) is None:
                    continue
                if kind == "row" and param == "bias":  # whole: added once
                    ranks.broadcast(layer, param)
                    out_bias = layer
                elif parts == 1:
                    ranks.split(layer, param, dim)
                else:  # each block split over the ranks, a rank its chunk of every one
                    size = getattr(layer, param).shape[dim]
                    ranks.segment(layer, param, (size // parts,) * parts, dim=dim)
            if kind == "column" and hasattr(layer, "nf"):  # the width GPT-2's Conv1D shapes its output by
                layer.nf //= ranks.world
            row = layer if kind == "row" else row
            layers.append(layer)
        heads = share_heads(attention, ranks.world)
        if ranks.index is None:
            return
        attention.forward = OnRankHeads(attention, f"{name}.{self.heads}" if self.heads else name)
        split = SplitMixer(attention, (attention, *layers), ranks, out_bias=out_bias, exit=row, masked=True)
        whole = WholeArguments(attention, split, ranks.context, heads, ranks.coordinate()[0], name)
        attention.register_forward_pre_hook(whole, with_kwargs=True)
        bias = RankBias.of(attention, heads, ranks.world, ranks.index)
        if bias is not None:
            attention.register_forward_pre_hook(bias, with_kwargs=True)


class WholeArguments:
    """An attention's forward pre-hook (after ``SplitMixer``'s, which gathered its input): what the model passes
    it beside its input made for the whole sequence (see the module docstring); anything else that runs along this
    rank's part of the sequence is refused by name.

    Args:
        attention: the attention module.
        split: its ``SplitMixer`` (whose ``whole_sequence`` gathers over the context ranks in sequence order).
        batch: the context-parallel batch.
        heads: its whole head count (ALiBi is made for every head, ``RankBias`` then takes this rank's).
        rank: this rank's index on the context axis.
        name: its name, for errors.

    Example::

        >>> from transformers import GPTJConfig, GPTJForCausalLM
        >>> model = GPTJForCausalLM(GPTJConfig(vocab_size=64, n_embd=16, n_layer=1, n_head=4, rotary_dim=4))
        >>> model = tpf.parallelize(model, placement=tpf.placement("cpu", ranks=[0, 1]),
        ...                         plan=tpf.hf_plan(model, context_parallel="ring"))
        >>> [type(h).__name__ for h in model.transformer.h[0].attn._forward_pre_hooks.values()]
        ['method', 'WholeArguments']
    """

    def __init__(self, attention: nn.Module, split: SplitMixer, batch: Batch, heads: int, rank: int,
                 name: str) -> None:
        self.split, self.batch, self.heads, self.rank, self.name = split, batch, heads, rank, name
        self.signature = inspect.signature(type(attention).forward)
        self.namespace = sys.modules[type(attention).__module__]

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        bound = self.signature.bind(module, *args, **kwargs)
        named = bound.arguments
        hidden = named[list(named)[1]]  # (gathered: every token)
        whole = sum(n for parts in self.batch.segments for _, n in parts)
        local = sum(n for _, n in self.batch.segments[self.rank])
        if hidden.shape[1] != whole:
            raise ValueError(f"{self.name!r} computes its attention in its own code on {hidden.shape[1]} tokens, "
                             f"where the model was given {whole} (it adds tokens of its own: a prompt): context "
                             f"parallelism cannot cut them. Train it with tensor or data parallelism")
        cross = [k for k in _CROSS if named.get(k) is not None]
        if cross or named.get("output_attentions") is True:
            raise ValueError(f"{self.name!r} computes its attention in its own code, which context parallelism runs "
                             f"head parallel over the model's own sequence: "
                             f"{'cross-attention to ' + cross[0] if cross else 'output_attentions=True'} (every "
                             f"head's weights, or another sequence's keys) is not supported; train it with tensor or "
                             f"data parallelism")
        if (self.batch.pads is not None or self.batch.documents is not None) and not self.batch.masks_made:
            raise ValueError(f"{self.name!r} computes its attention in its own code, and the model made its mask "
                             f"without transformers' create_causal_mask (and its kin), which context parallelism "
                             f"makes for the whole sequence: the batch's padding or packed documents would be lost. "
                             f"Pass unpadded, unpacked rows, or train it with tensor or data parallelism")
        for key, value in list(named.items())[2:]:
            if self.signature.parameters[key].kind is inspect.Parameter.VAR_KEYWORD:  # passed on (the loss's labels)
                named[key] = {k: self.whole(k, v, whole, local, hidden, strict=False) for k, v in value.items()}
            else:
                named[key] = self.whole(key, value, whole, local, hidden)
        return bound.args[1:], bound.kwargs

    def whole(self, key: str, value: object, whole: int, local: int, hidden: torch.Tensor,
              strict: bool = True) -> object:
        """``value``, the argument ``key``, made for the whole sequence (``strict``: anything else along this rank's
        tokens refused)."""
        if key in _WHOLE_POSITIONS and isinstance(value, tuple):
            return tuple(self.gathered(t, -2, local, whole) for t in value)
        if not isinstance(value, torch.Tensor) or whole == local or key in _LOCAL:
            return value
        if key == "position_bias" and value.ndim == 3:  # MPT's [heads, 1, positions]: every position, cut to the keys
            return value
        if key in _WHOLE_POSITIONS:
            return self.gathered(value, -2, local, whole)
        if key == "position_ids":
            return self.gathered(value, -1, local, whole)
        if key == "cache_position":
            return torch.arange(whole, device=value.device)
        if key == "alibi":  # made again by the model's own function, for every key (and every head: RankBias cuts)
            build = getattr(self.namespace, "build_alibi_tensor", None)
            if build is None:
                raise ValueError(f"{self.name!r} takes ALiBi biases its model makes by a function tpflow does not "
                                 f"know (no build_alibi_tensor beside it), which context parallelism cannot make for "
                                 f"the whole sequence: train it with tensor or data parallelism")
            mask = self.batch.mask if self.batch.mask is not None else torch.ones(hidden.shape[0], whole)
            return build(mask.to(value.device), self.heads, value.dtype)
        if "mask" in key and value.ndim >= 2 and value.shape[-1] == whole:
            return value
        if strict and "mask" in key:
            raise ValueError(f"{self.name!r} computes its attention in its own code, and the model passes it {key} "
                             f"{list(value.shape)}, not made for the whole sequence of {whole} tokens: context "
                             f"parallelism, which runs its heads over every token, cannot make it. Train it with "
                             f"tensor or data parallelism")
        if strict and local in value.shape:
            raise ValueError(f"{self.name!r} computes its attention in its own code, and the model passes it {key} "
                             f"{list(value.shape)}, made for this rank's {local} tokens of {whole}: context "
                             f"parallelism, which runs its heads over every token, cannot make it for the whole "
                             f"sequence. Train it with tensor or data parallelism")
        return value

    def gathered(self, t: torch.Tensor, dim: int, local: int, whole: int) -> torch.Tensor:
        dim = dim % t.ndim
        return self.split.whole_sequence(t, dim) if t.shape[dim] == local and local != whole else t


class _WholeMask:
    """One of transformers' mask functions (``_MASKS``) in a model's module: for a model ``whole_masks`` registered
    (by its config), the mask of the whole sequence, from the batch's whole ``attention_mask`` and ``position_ids``;
    for any other, the function's own."""

    def __init__(self, original) -> None:
        self.original = original
        self.signature = inspect.signature(original)
        functools.update_wrapper(self, original)

    def __call__(self, *args, **kwargs):
        bound = self.signature.bind(*args, **kwargs)
        named = bound.arguments
        found = _BATCHES.get(id(named.get("config")))
        if found is None or found[0]() is not named.get("config"):
            return self.original(*args, **kwargs)
        batch = found[1]
        embeds = named["inputs_embeds"]
        whole = sum(n for parts in batch.segments for _, n in parts)
        rows = embeds.shape[0]
        named["inputs_embeds"] = embeds[:, :1].expand(rows, whole, *embeds.shape[2:])
        given = [k for k in ("encoder_hidden_states", "or_mask_function", "and_mask_function")
                 if named.get(k) is not None]
        if given:
            raise ValueError(f"the model makes its mask with {given[0]} (cross-attention, or a mask of its own "
                             f"beside the causal one), which context parallelism cannot make for the whole "
                             f"sequence: train it with tensor or data parallelism")
        named["attention_mask"] = None if batch.mask is None else batch.mask.to(embeds.device)
        if named.get("position_ids") is not None:  # (packed documents, read from them only where one device does)
            named["position_ids"] = batch.positions.to(embeds.device) if batch.documents is not None else None
        if isinstance(named.get("cache_position"), torch.Tensor):
            named["cache_position"] = torch.arange(whole, device=embeds.device)
        blocks = named.get("block_sequence_ids")
        if isinstance(blocks, torch.Tensor):  # (GIT's image / text groups: text alone, one group, is every token's)
            if not bool((blocks == blocks.flatten()[0]).all()):
                raise ValueError("the model groups its tokens for its mask (block_sequence_ids: an image's "
                                 "tokens), which context parallelism cannot make for the whole sequence: train it "
                                 "with tensor or data parallelism")
            named["block_sequence_ids"] = blocks.flatten()[0].expand(rows, whole)
        batch.masks_made = True
        return self.original(*bound.args, **bound.kwargs)


_BATCHES: dict[int, tuple[weakref.ref, Batch]] = {}  # a context-parallel model's configs (by id): its batch


def whole_masks(model: nn.Module, batch: Batch) -> None:
    """Make the masks ``model`` makes with transformers' mask functions (``create_causal_mask``, ...) masks of the
    whole sequence (see the module docstring): each function, as the model's modules imported it, wrapped once; the
    model's configs registered with ``batch``.

    Args:
        model: a context-parallel model with attention in its own code.
        batch: its context-parallel batch (the whole mask and positions of each call).

    Example::

        >>> import transformers.models.gptj.modeling_gptj as gptj
        >>> from transformers import GPTJConfig, GPTJForCausalLM
        >>> model = GPTJForCausalLM(GPTJConfig(vocab_size=64, n_embd=16, n_layer=1, n_head=4, rotary_dim=4))
        >>> whole_masks(model, Batch())
        >>> type(gptj.create_causal_mask).__name__
        '_WholeMask'
    """
    for config in {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values():
        for c in (config, config.get_text_config() if hasattr(config, "get_text_config") else config):
            _BATCHES[id(c)] = (weakref.ref(c), batch)
            weakref.finalize(c, _BATCHES.pop, id(c), None)
    for namespace in {sys.modules[type(m).__module__] for m in model.modules()}:
        for name in _MASKS:
            found = getattr(namespace, name, None)
            if found is not None and not isinstance(found, _WholeMask):
                setattr(namespace, name, _WholeMask(found))


def with_own_attention(model: nn.Module, plan: dict[str, Style], context: Style) -> dict[str, Style]:
    """``plan`` (``hf_plan``'s, under context parallelism) with each attention that computes its attention in its
    own code (``own_attention``) and whose heads the plan splits (``SplitHeads``) planned ``OwnAttentionHeads``
    (stacked with ``context``), in place of its entries and its projections': the planned module is the attention,
    or where its output projection sits beside it (BERT's ``attention.output.dense``), its parent.

    Args:
        model: the model.
        plan: patterns to entries.
        context: the plan's ``ContextParallel`` entry.

    Returns:
        The new plan, in the same order.

    Example::

        >>> from transformers import GPTJConfig, GPTJForCausalLM
        >>> model = GPTJForCausalLM(GPTJConfig(vocab_size=64, n_embd=16, n_layer=2, n_head=4, rotary_dim=4))
        >>> [p for p in tpf.hf_plan(model, context_parallel="ring") if "attn" in p]
        ['transformer.h.*.attn']
    """
    modules = dict(model.named_modules())
    names = list(modules)
    hits = {p: [n for n in names if fnmatch.fnmatchcase(n, p)] for p in plan}
    replaced: dict[str, tuple[str, Style]] = {}  # an attention's pattern: the pattern it becomes, its entry
    consumed: dict[str, set[str]] = {}  # a projection's pattern: the modules it matched that an entry took
    for pattern, entry in plan.items():
        found = next((s for s in entry.styles if isinstance(s, SplitHeads)), None)
        if found is None or not hits[pattern] or not all(own_attention(modules[n]) for n in hits[pattern]):
            continue
        enclosing, heads, layers = _projections(pattern, hits, plan)
        for p, within in layers.items():
            consumed.setdefault(p, set()).update(within)
        entries = tuple((rel, plan[p]) for p, rel in ((p, _relative(p, hits, enclosing, hits[pattern], heads))
                                                      for p in layers))
        own = OwnAttentionHeads(heads=heads, layers=entries, groups=found.groups)
        replaced[pattern] = (enclosing, Stacked((own, context)))
    for p, taken in consumed.items():
        if set(hits[p]) != taken:
            raise ValueError(f"plan pattern {p!r} matches projections of attentions run head parallel and others "
                             f"({sorted(set(hits[p]) - taken)[:3]}): plan them apart")
    covered = {n for p in replaced for n in hits[p]}
    for name in head_parallel_attentions(model):
        if name not in covered:
            raise ValueError(f"context parallelism runs attention computed in the model's own code head parallel, "
                             f"and the plan splits no heads of {name} ({type(modules[name]).__name__}): train "
                             f"{type(model).__name__} with tensor or data parallelism")
    out: dict[str, Style] = {}
    for pattern, entry in plan.items():
        if pattern in replaced:
            out[replaced[pattern][0]] = replaced[pattern][1]
        elif pattern not in consumed:
            out[pattern] = entry
    return out


def _projections(pattern: str, hits: dict[str, list[str]], plan: dict[str, Style]
                 ) -> tuple[str, str, dict[str, set[str]]]:
    """The projections of the attentions ``pattern`` matches: ``(the planned module's pattern, the attention's name
    under it, {projection pattern: the modules it matched there})``; the attention's parent where its output
    projection is not inside it."""
    for outer in (False, True):
        if outer and not _wrapped(pattern):
            break
        roots = [n.rpartition(".")[0] if outer else n for n in hits[pattern]]
        layers = {p: {n for n in hits[p] if any(n.startswith(r + ".") for r in roots)} for p in plan if p != pattern}
        layers = {p: within for p, within in layers.items() if within and all(_projection(s) for s in plan[p].styles)}
        if any(_kind(s)[0] == "row" for p in layers for s in plan[p].styles):
            return (pattern.rpartition(".")[0] if outer else pattern,
                    pattern.rpartition(".")[2] if outer else "", layers)
    raise ValueError(f"{pattern!r}: an attention in the model's own code whose output projection the plan does not "
                     f"split: context parallelism cannot run it head parallel")


def _wrapped(pattern: str) -> bool:
    """Whether the modules ``pattern`` matches sit in a wrapper of their own (BERT's ``attention``), not right in a
    layer (an item of a ``ModuleList``), whose other projections (the MLP's) are not the attention's."""
    parent = pattern.rpartition(".")[0].rpartition(".")[2]
    return bool(parent) and parent != "*" and not parent.isdigit()


def _projection(style: Style) -> bool:
    return isinstance(style, (ColumnParallel, RowParallel, BlocksParallel, Conv1DParallel, MultiQueryColumns))


def _relative(p: str, hits: dict[str, list[str]], enclosing: str, attentions: list[str], heads: str) -> str:
    """The name under the planned module of what projection pattern ``p`` matched (the same under each)."""
    roots = [a.rpartition(".")[0] if heads else a for a in attentions]
    found = {n[len(r) + 1:] for n in hits[p] for r in roots if n.startswith(r + ".")}
    if len(found) != 1:
        raise ValueError(f"plan pattern {p!r} matches {sorted(found)} under the attentions of {enclosing!r}: one "
                         f"projection a pattern")
    return found.pop()
