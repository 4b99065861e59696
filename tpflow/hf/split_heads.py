"""The ``SplitHeads`` entry: an attention module given its rank's share of the heads.

Column entries split an attention's q / k / v projections by heads; the module's own code then views their outputs
by its head counts (``num_heads``, ``embed_dim``, ...), which must become its rank's. Biases the model makes for
every head outside the attention and passes in (ALiBi's ``alibi=``, MPT's ``position_bias``) are cut to the rank's
heads on the way in.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
from torch import nn

from tpflow.hf.heads import attention_heads, reuse_kept_head, split_per_head
from tpflow.hf.heads import check as check_heads
from tpflow.hf.mixers import HEAD_COUNTS, is_attention
from tpflow.plans.style import Plan, Style

__all__ = ["BIASES", "QKV", "OnRankHeads", "RankBias", "SplitHeads", "head_counts", "share_heads"]

# separate q / k / v projections, by the names models give them
QKV = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("query_proj", "key_proj", "value_proj"),
       ("Wq", "Wk", "Wv"), ("project_q", "project_k", "project_v"), ("q_lin", "k_lin", "v_lin"))
BIASES = ("alibi", "position_bias")  # a bias for every head, made outside the attention and passed in
_KVHEAD_COUNTS = ("num_key_value_heads", "num_kv_heads", "kv_heads")
_WIDTHS = ("embed_dim", "all_head_size", "inner_dim", "split_size", "hidden_size")  # heads x head_dim
_HEAD_DIMS = ("head_dim", "head_size", "attention_head_size")
_QUERIES = ("q_proj", "q_b_proj")  # the projection that splits an attention's heads (MLA's from its latent)


@dataclasses.dataclass(frozen=True)
class SplitHeads(Style):
    """Plan style for an attention module whose q / k / v are column layers: its heads must split over the
    tensor-parallel ranks, and its head counts (``num_heads``, ``num_key_value_heads``, ``embed_dim``, ...) become
    its rank's, so that code viewing its projections by them reads this rank's heads.

    Args:
        groups: the blocks its heads are laid out in, each split over the ranks (CodeGen's four model-parallel
            blocks: 4), so that each block's heads must split.

    Example::

        >>> from transformers import OPTConfig, OPTForCausalLM
        >>> model = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=16, ffn_dim=32, num_hidden_layers=1,
        ...                                  num_attention_heads=4, word_embed_proj_dim=16))
        >>> model = tpf.parallelize(model, placement=tpf.placement("cpu", ranks=[0, 1]), plan="auto")
        >>> model.model.decoder.layers[0].self_attn.num_heads                  # this rank's 2 of 4
        2
    """

    groups: int = 1

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        heads, kv, _ = head_counts(module)
        if heads is None:
            raise ValueError(f"{name!r}: SplitHeads needs the module's head count (one of {HEAD_COUNTS})")
        counts = attention_heads(module)
        if counts is not None:  # q / k / v projections: the degrees that divide their heads named
            check_heads(name, counts, plan.world)
        kept = _keeps_heads(module, plan.world) or any(  # (a multi-query projection keeps its one key/value head)
            getattr(plan.entry(f"{name}.{child}"), "keeps_key_value", False) for child, _ in module.named_children())
        for count, what in ((heads, "attention heads"), (kv, "key/value heads")):
            if count % plan.world and not (count == kv and kept):
                raise ValueError(f"{name!r} has {count} {what}, which do not split over {plan.world} tensor-parallel "
                                 f"ranks: use a degree that divides them")
        if heads % self.groups or (heads // self.groups) % plan.world:
            raise ValueError(f"{name!r} lays its {heads} heads out in {self.groups} blocks, whose heads do not split "
                             f"over {plan.world} tensor-parallel ranks: use a degree that divides "
                             f"{heads // self.groups}")
        _per_head_left_whole(name, module, plan, {heads, kv})

    def apply(self, name: str, module: nn.Module, plan: Plan) -> None:
        world = plan.world
        heads = share_heads(module, world)
        if is_attention(module) and any(hasattr(module, q) for q in _QUERIES):  # transformers' own kind
            split_per_head(module, heads, plan.placement)  # its own per-head parameters (gpt-oss's sinks)
        reuse_kept_head(module, world)
        module.forward = OnRankHeads(module, name)
        coord = plan.placement.coordinate()
        bias = RankBias.of(module, heads, world, None if coord is None else coord[-1])
        if bias is not None:
            module.register_forward_pre_hook(bias, with_kwargs=True)


def share_heads(module: nn.Module, world: int) -> int:
    """Make an attention module's head counts (``num_heads``, ``num_key_value_heads``, ``embed_dim``, ...) its share of
    ``world`` ranks' (a key/value head fewer than the ranks kept whole), so that its code viewing its projections by
    them reads a rank's heads; returns its whole head count.

    Args:
        module: the attention module, changed in place.
        world: the ranks its heads split over.

    Returns:
        Its query heads before the split.

    Example::

        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> attention = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=4)).transformer.h[0].attn
        >>> share_heads(attention, 2), attention.num_heads, attention.embed_dim
        (4, 2, 8)
    """
    heads, kv, width = head_counts(module)
    for attr in HEAD_COUNTS:
        if getattr(module, attr, None) == heads:
            setattr(module, attr, heads // world)
    for attr in _KVHEAD_COUNTS:  # (fewer than the ranks: each rank keeps its one key/value head whole)
        if getattr(module, attr, None) == kv:
            setattr(module, attr, max(kv // world, 1))
    for attr in _WIDTHS:
        if width is not None and getattr(module, attr, None) == width:
            setattr(module, attr, width // world)
    if getattr(module, "num_key_value_groups", None) == heads // kv:  # query heads per key/value head
        module.num_key_value_groups = heads // world // max(kv // world, 1)
    return heads


@dataclasses.dataclass(frozen=True)
class RankBias:
    """A forward pre-hook: this rank's heads' part of a bias the model made for every head and passes to the attention
    (by keyword or at ``index``): ALiBi's ``[batch x heads, 1, keys]`` (BLOOM's, Falcon's), MPT's
    ``[heads, 1, keys]``, or ``[batch, heads, queries, keys]``.

    Args:
        name: the keyword (``BIASES``).
        index: its position among the forward's arguments (after ``self``).
        heads: the module's whole head count.
        world: the ranks its heads split over.
        rank: this rank's index among them.

    Example::

        >>> bias = RankBias("alibi", 2, heads=4, world=2, rank=1)
        >>> alibi = torch.arange(8.).view(8, 1, 1)                      # [batch 2 x heads 4, 1, keys 1]
        >>> bias(nn.Identity(), (), {"alibi": alibi})[1]["alibi"].flatten().tolist()
        [2.0, 3.0, 6.0, 7.0]
    """

    name: str
    index: int
    heads: int
    world: int
    rank: int

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        keyword = self.name in kwargs
        bias = kwargs.get(self.name) if keyword else (args[self.index] if self.index < len(args) else None)
        if not isinstance(bias, torch.Tensor):
            return None
        share = self.heads // self.world
        mine = slice(self.rank * share, (self.rank + 1) * share)
        if self.name == "alibi":
            bias = bias.unflatten(0, (-1, self.heads))[:, mine].flatten(0, 1)
        elif bias.ndim == 3 and bias.shape[0] == self.heads:
            bias = bias[mine]
        elif bias.ndim == 4 and bias.shape[1] == self.heads:
            bias = bias[:, mine]
        elif not (bias.ndim == 4 and bias.shape[1] == 1):  # (one for every head: broadcast, nothing to cut)
            raise ValueError(f"{type(module).__name__} takes {self.name} of shape {list(bias.shape)}, made for its "
                             f"{self.heads} heads, which tpflow cannot cut to its rank's: leave its q / k / v / output "
                             f"projections out of the plan")
        if keyword:
            return args, {**kwargs, self.name: bias}
        return (*args[:self.index], bias, *args[self.index + 1:]), kwargs

    @classmethod
    def of(cls, module: nn.Module, heads: int, world: int, rank: int | None) -> RankBias | None:
        """The hook for the bias ``module``'s forward takes (``BIASES``), or None where it takes none (or this rank,
        ``rank`` None, holds no heads)."""
        parameters = list(inspect.signature(type(module).forward).parameters)
        given = [b for b in BIASES if b in parameters]
        if not given or rank is None:
            return None
        return cls(given[0], parameters.index(given[0]) - 1, heads, world, rank)  # (after self)


def _per_head_left_whole(name: str, module: nn.Module, plan: Plan, counts: set[int | None]) -> None:
    """Refuse an attention module whose heads split beside a linear child that makes a value per head and is not
    split by them (Doge's ``dt_proj``, a row layer): it would give every rank every head's values."""
    for child, linear in module.named_children():
        entry = plan.entry(f"{name}.{child}")
        if isinstance(linear, nn.Linear) and linear.out_features in counts and not (entry and entry.splits_features):
            raise ValueError(f"{name!r}: its heads split over the ranks, and its {child!r} (an nn.Linear "
                             f"{'out of the plan' if entry is None else 'not split by heads'})"
                             f" makes a value per head, for every head: tpflow cannot give each rank its heads' "
                             f"share of it. Leave the attention whole (take its q / k / v / o entries out of the "
                             f"plan) or parallelize the model otherwise")


def _keeps_heads(module: nn.Module, world: int) -> bool:
    """Whether each rank keeps a whole key/value head of a q_proj / k_proj / v_proj attention with fewer of them than
    ranks (``HeadColumns`` keeps its k / v whole), or of an earlier layer whose keys and values it reuses (Gemma 3n's
    shared layers: ``is_kv_shared_layer``, no k / v of its own)."""
    counts = attention_heads(module)
    if counts is not None:
        return world % counts[1] == 0
    kv = head_counts(module)[1]
    return bool(getattr(module, "is_kv_shared_layer", False)) and isinstance(kv, int) and world % kv == 0


class OnRankHeads:
    """An attention module's forward on this rank's heads: a shape error there (code that reshapes by its input's
    whole width, which no head count says) becomes a sentence naming the module and the way out.

    Args:
        module: the attention module (its class's forward is called).
        name: its name, for the error.

    Example::

        >>> attention = nn.Linear(4, 4)
        >>> attention.forward = OnRankHeads(attention, "attn")
        >>> attention(torch.ones(2, 3))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: 'attn' (Linear) failed on this rank's heads (mat1 and mat2 shapes cannot be multiplied ...
    """

    def __init__(self, module: nn.Module, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args, **kwargs):
        try:
            return type(self.module).forward(self.module, *args, **kwargs)
        except RuntimeError as e:
            raise ValueError(f"{self.name!r} ({type(self.module).__name__}) failed on this rank's heads ({e}): its "
                             f"code computes with a width tpflow cannot give it its rank's share of (its input's). "
                             f"Leave its q / k / v / output projections out of the plan, or parallelize the model "
                             f"otherwise") from e


def head_counts(module: nn.Module) -> tuple[int | None, int | None, int | None]:
    """An attention module's ``(heads, key/value heads, heads x head_dim)``, from its own attributes (or its
    ``config``'s); None for a count it does not say.

    Args:
        module: an attention module.

    Returns:
        The three counts.

    Example::

        >>> from transformers import GPT2Config, GPT2LMHeadModel
        >>> model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=4))
        >>> head_counts(model.transformer.h[0].attn)
        (4, 4, 16)
    """
    config = getattr(module, "config", None)  # a module that keeps no count of its own reads its config's
    heads = next((getattr(m, a) for m in (module, config) for a in HEAD_COUNTS if isinstance(getattr(m, a, None), int)),
                 None)
    kv = next((getattr(m, a) for m in (module, config) for a in _KVHEAD_COUNTS if isinstance(getattr(m, a, None), int)),
              heads)
    head_dim = next((getattr(module, a) for a in _HEAD_DIMS if isinstance(getattr(module, a, None), int)), None)
    triple = next((t for t in QKV if all(isinstance(getattr(module, n, None), nn.Linear) for n in t)), None)
    width = getattr(module, triple[0]).out_features if triple else None
    if width is None and heads is not None and head_dim is not None:
        width = heads * head_dim
    fused = getattr(module, "c_attn", None)
    if width is None and type(fused).__name__ == "Conv1D":  # GPT-2's q | k | v blocks (GPT-1 says no head_dim)
        width = fused.weight.shape[1] // 3
    return heads, kv, width
