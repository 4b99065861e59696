"""Attention heads against the tensor-parallel degree: checked before the model changes, and key/value heads
replicated when there are fewer of them than ranks.

A column-parallel q / k / v projection gives each rank a block of heads, so the head counts must split over
the ranks: ``num_attention_heads`` must be a multiple of the degree W. With fewer key/value heads than ranks
(K < W, W a multiple of K) each rank needs one whole key/value head, shared with W/K - 1 other ranks: the
k / v projections then stay whole on every rank, each rank keeps the columns of its head, and their
gradients, each rank's share of the whole, are summed over the ranks. The attention module's
``num_key_value_groups`` (how many query heads share a key/value head, as Hugging Face's attention reads it)
becomes the rank's query heads per key/value head.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Shard

from tpflow import comm
from tpflow.global_tensor import from_local, gradients
from tpflow.global_tensor.local_blocks import LocalReads
from tpflow.layers.regions import SPLIT, tag
from tpflow.placement import Placement, nested_index
from tpflow.plans.linear import LINEAR_FORMS, plain_linear
from tpflow.sbp import broadcast, split

__all__ = ["attention_heads", "check", "keep_columns", "keep_head", "kept_columns", "reuse_kept_head",
           "split_parameter",
           "split_per_head"]

LINEAR_FORMS.add("FalconLinear")  # an nn.Linear subclass whose forward is F.linear written out


def attention_heads(module: nn.Module) -> tuple[int, int, int] | None:
    """``(query heads, key/value heads, head_dim)`` of a Hugging Face attention module, or None for any other.

    Args:
        module: any module; an attention module has ``q_proj`` / ``k_proj`` / ``v_proj``, a ``head_dim`` and a
            ``config`` with ``num_attention_heads``.

    Returns:
        The counts, or None.

    Example::

        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
        ...                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        >>> attention_heads(model.model.layers[0].self_attn), attention_heads(model.model.layers[0].mlp)
        ((4, 2, 4), None)
    """
    config = getattr(module, "config", None)
    if not all(hasattr(module, n) for n in ("q_proj", "k_proj", "v_proj", "head_dim")) or config is None:
        return None
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int):
        return None
    kv = getattr(config, "num_key_value_heads", None) or heads
    width = getattr(module.k_proj, "out_features", None)  # a layer's own count (MiMo's sliding layers double it)
    if isinstance(width, int) and isinstance(module.head_dim, int) and width % module.head_dim == 0:
        kv = width // module.head_dim
    return heads, kv, module.head_dim


def keep_columns(linear: nn.Linear, spans: Sequence[tuple[int, int]], placement: Placement) -> None:
    """Make ``linear`` return only its output features in ``spans`` (``[start, end)`` each, joined in order), tagged
    as split over the ranks; the gradient of its input is summed over the tensor-parallel ranks in the backward.
    A plain ``nn.Linear`` computes those features alone; a subclass with its own forward computes them all, then
    keeps those.

    Args:
        linear: the projection, whole on every rank.
        spans: the features this rank keeps.
        placement: the ranks; the last axis is the tensor-parallel one (of one rank: nothing to sum).

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)
        >>> k_proj = nn.Linear(8, 4)                          # whole, the same on every rank
        >>> start = 2 * tpf.get_rank()
        >>> keep_columns(k_proj, [(start, start + 2)], P)     # this rank's 2 of the 4 features
        >>> x = torch.ones(3, 8, requires_grad=True)
        >>> y = k_proj(x)
        >>> y.shape
        torch.Size([3, 2])
        >>> y.sum().backward()                                # x's gradient summed over the ranks: the whole one
        >>> torch.allclose(x.grad, k_proj.weight.sum(0).expand(3, 8))
        True
    """
    if placement.hierarchy[-1] > 1:
        linear.register_forward_pre_hook(_SummedInput(placement))
    kept = _KeptColumns(tuple(spans))
    if plain_linear(linear):
        linear.forward = _KeptRows(linear, kept)
    else:
        linear.register_forward_hook(kept)


def kept_columns(linear: nn.Module) -> tuple[tuple[int, int], ...] | None:
    """The output features' spans that ``keep_columns`` made ``linear`` return, or None.

    Args:
        linear: any module.

    Returns:
        The ``(start, end)`` spans, or None if ``keep_columns`` did not take it.

    Example::

        >>> k_proj = nn.Linear(8, 4)
        >>> keep_columns(k_proj, [(2, 4)], tpf.placement("cpu", ranks=[0, 1]))
        >>> kept_columns(k_proj), kept_columns(nn.Linear(8, 4))
        (((2, 4),), None)
    """
    rows = linear.__dict__.get("forward")
    kept = rows.kept if isinstance(rows, _KeptRows) else next(
        (h for h in linear._forward_hooks.values() if isinstance(h, _KeptColumns)), None)
    return None if kept is None else kept.spans


class _SummedInput:
    """The pre-hook: the input's gradient summed over the tensor-parallel ranks (an object holding the placement,
    not the process group, so that the model can be copied and pickled)."""

    def __init__(self, placement: Placement) -> None:
        self.placement = placement

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        group = self.placement.mesh.get_group(self.placement.ndim - 1)
        return (comm.copy_to_ranks(args[0], group), *args[1:])


class _KeptColumns:
    """The forward hook: this rank's output features, tagged split."""

    def __init__(self, spans: tuple[tuple[int, int], ...]) -> None:
        self.spans = spans

    def __call__(self, module: nn.Module, args: tuple, y: torch.Tensor) -> torch.Tensor:
        return tag(torch.cat([y[..., start:end] for start, end in self.spans], -1), SPLIT)


class _KeptRows:
    """A plain linear layer's forward computing only the kept features: its weight's (and bias's) rows of them."""

    def __init__(self, linear: nn.Linear, kept: _KeptColumns) -> None:
        self.linear, self.kept = linear, kept

    def __call__(self, input: torch.Tensor) -> torch.Tensor:  # (nn.Linear's name for it, for keyword calls)
        spans = self.kept.spans
        weight, bias = self.linear.weight, self.linear.bias
        if len(spans) == 1:
            rows = slice(*spans[0])
            return tag(F.linear(input, weight[rows], None if bias is None else bias[rows]), SPLIT)
        weight = torch.cat([weight[start:end] for start, end in spans])
        bias = None if bias is None else torch.cat([bias[start:end] for start, end in spans])
        return tag(F.linear(input, weight, bias), SPLIT)


def check(name: str, counts: tuple[int, int, int], world: int) -> bool:
    """Whether the heads of an attention module split over the ranks as they are, or its key/value heads must be
    replicated; a ValueError that says what to change if they cannot run at all.

    Args:
        name: the attention module's name, for the error.
        counts: its ``attention_heads``.
        world: the tensor-parallel degree.

    Returns:
        True: every head count splits; False: the key/value heads are fewer than the ranks and must be replicated.

    Example::

        >>> check("model.layers.0.self_attn", (8, 2, 16), 4)
        False
    """
    heads, kv, _ = counts
    if heads % world:
        degrees = [d for d in range(1, heads + 1) if heads % d == 0 and (kv % d == 0 or d % kv == 0)]
        raise ValueError(f"{name!r} has {heads} attention heads, which do not split over {world} tensor-parallel "
                         f"ranks: use a degree that divides them ({degrees}), or leave its q/k/v/o projections out "
                         f"of the plan")
    if kv % world and world % kv:
        raise ValueError(f"{name!r} has {kv} key/value heads: {world} tensor-parallel ranks must be a multiple or a "
                         f"divisor of them, so that each rank holds whole key/value heads")
    return kv % world == 0


def keep_head(projection: nn.Linear, attention: nn.Module, counts: tuple[int, int, int], placement: Placement) -> None:
    """Keep a k / v projection whole on every rank, each rank computing only its key/value head's columns (there are
    fewer key/value heads than ranks), and set the attention module's ``num_key_value_groups`` to the rank's query
    heads per key/value head.

    Args:
        projection: the k or v projection, whole on every rank.
        attention: its attention module.
        counts: the module's ``attention_heads``.
        placement: the ranks; the last axis is the tensor-parallel one, a multiple of the key/value heads.

    Example (4 ranks)::

        >>> from transformers import LlamaConfig
        >>> from transformers.models.llama.modeling_llama import LlamaAttention
        >>> attention = LlamaAttention(LlamaConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=2), 0)
        >>> keep_head(attention.k_proj, attention, (4, 2, 4), tpf.placement("cpu", ranks=[0, 1, 2, 3]))
        >>> attention.k_proj(torch.randn(3, 16)).shape, attention.num_key_value_groups
        (torch.Size([3, 4]), 1)
    """
    heads, kv, head_dim = counts
    world, coord = placement.hierarchy[-1], placement.coordinate()
    attention.num_key_value_groups = heads // world  # the rank's query heads share its one key/value head
    if coord is not None:
        head = coord[-1] // (world // kv)
        keep_columns(projection, [(head * head_dim, (head + 1) * head_dim)], placement)


def reuse_kept_head(attention: nn.Module, world: int) -> None:
    """An attention module that reuses an earlier layer's keys and values (Gemma 3n's and Gemma 4's shared layers:
    ``is_kv_shared_layer``), where those keep one key/value head per rank (fewer of them than ranks): its
    ``num_key_value_groups`` becomes the rank's query heads per key/value head, as ``keep_head`` makes the earlier
    layer's.

    Args:
        attention: an attention module whose queries split by heads.
        world: the tensor-parallel degree.

    Example::

        >>> from transformers import LlamaConfig
        >>> from transformers.models.llama.modeling_llama import LlamaAttention
        >>> attention = LlamaAttention(LlamaConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=1), 0)
        >>> attention.is_kv_shared_layer = True                    # as a layer reusing another's keys and values
        >>> reuse_kept_head(attention, 2)
        >>> attention.num_key_value_groups                         # its 2 query heads share the rank's one
        2
    """
    groups = getattr(attention, "num_key_value_groups", None)
    heads = getattr(getattr(attention, "config", None), "num_attention_heads", None)
    if not getattr(attention, "is_kv_shared_layer", False) or not isinstance(groups, int) or not isinstance(heads, int):
        return
    kv = heads // groups  # the layer's own count, as its init made its groups
    if kv < world and world % kv == 0:
        attention.num_key_value_groups = heads // world


def split_parameter(module: nn.Module, name: str, dim: int, placement: Placement,
                    axes: Sequence[int] | None = None) -> None:
    """Make ``module``'s own parameter ``name`` a global parameter split along ``dim`` over the last axis of
    ``placement`` (or over ``axes``, nested: chunk ``c * T + t`` on ``(c, t)``), this rank's chunk (allocated, not
    filled, for a parameter on the meta device, which a checkpoint then fills); the module's forward must read it as
    its local block (``LocalReads``).

    Args:
        module: the module holding the parameter, whole on every rank.
        name: the parameter's name in it.
        dim: the dim split.
        placement: the ranks; the last axis is the tensor-parallel one.
        axes: the axes it is split over, in nesting order; default the last.

    Example::

        >>> layer = nn.Linear(4, 6)
        >>> split_parameter(layer, "weight", 0, tpf.placement("cpu", ranks=[0, 1]))
        >>> layer.weight.to_local().shape, layer.weight.shape
        (torch.Size([3, 4]), torch.Size([6, 4]))
    """
    pl, coord, full = placement, placement.coordinate(), module._parameters[name]
    axes = (pl.ndim - 1,) if axes is None else tuple(axes)
    if coord is None:
        local = torch.empty(0, dtype=full.dtype)
    else:
        world = math.prod(pl.hierarchy[a] for a in axes)
        local = full.detach().chunk(world, dim)[nested_index(coord, pl.hierarchy, axes)]
        local = torch.empty(local.shape, dtype=full.dtype) if full.is_meta else local.clone()
    sbp = tuple(split(dim) if a in axes else broadcast for a in range(pl.ndim))
    value = from_local(local.to(pl.device), pl, sbp, shape=full.shape, sync_data=False)
    setattr(module, name, gradients.adopt(nn.Parameter(value, requires_grad=full.requires_grad)))


# an attention module's own parameters known to hold one entry per query head (by name: a shape can match by
# coincidence, DiffLlama's lambdas are [head_dim], shared by every head)
def split_per_head(module: nn.Module, heads: int, placement: Placement) -> list[str]:
    """Split an attention module's own per-head parameters (its own, with a first dim of ``num_attention_heads``:
    gpt-oss's attention sinks, Beam's gate bias) with its heads over the last axis of ``placement``, each rank its
    heads' entries, read as local blocks around each call; returns their names. Its queries must come from a column
    layer, which splits the heads so.

    Args:
        module: a Hugging Face attention module.
        heads: its query heads, all of them.
        placement: the ranks; the last axis is the tensor-parallel one.

    Returns:
        The names of the parameters split.

    Example::

        >>> from transformers import GptOssConfig
        >>> from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention
        >>> attention = GptOssAttention(GptOssConfig(hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
        ...                                          head_dim=4), layer_idx=0)
        >>> split_per_head(attention, 4, tpf.placement("cpu", ranks=[0, 1])), attention.sinks.to_local().shape
        (['sinks'], torch.Size([2]))
    """
    names = [n for n, p in module.named_parameters(recurse=False)
             if p.ndim >= 1 and p.shape[0] == heads and not isinstance(p, DTensor)]
    if not names:
        return names
    pl, coord = placement, placement.coordinate()
    for name in names:
        split_parameter(module, name, 0, pl)
    if coord is not None:
        reads = LocalReads(names, lambda p: (Partial(),) * (pl.ndim - 1) + (Shard(0),))

        def enter(m: nn.Module, args: tuple) -> None:
            reads.enter(m)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(lambda m, args, output: reads.leave(m), always_call=True)
    return names
