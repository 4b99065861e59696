"""Gated DeltaNet mixers split by heads (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, OLMo-Hybrid): each rank runs the model's
own code (its convolution, its delta rule, its per-head gated norm) on its value heads and their key heads, the
output summed.

A DeltaNet has ``n_k`` key heads (q and k) and ``n_v`` value heads (v, z, b, a), ``n_v / n_k`` value heads reading
each key head. The split keeps transformers' stored layouts:

    Qwen3-Next  in_proj_qkvz  [q_g | k_g | v_g | z_g] for each key head g, interleaved; in_proj_ba [b_g | a_g] alike
    Qwen3.5     in_proj_qkv   [q | k | v] segments; in_proj_z, in_proj_b, in_proj_a by value heads
    OLMo-Hybrid q_proj, k_proj by key heads; v_proj, g_proj, a_proj, b_proj by value heads
    both        conv1d        [q | k | v] segments (a depthwise convolution); A_log, dt_bias per value head;
                out_proj      a row split; the gated norm's weight (one head's width, every head's) whole

With key heads a multiple of the ranks, a rank holds whole key heads with their value heads. With fewer key heads
than ranks (the ranks a multiple of them), the W / n_k ranks holding one key head's value heads each store a share
of its q / k rows (and their convolution's) and gather them whole around each call, their gradients summed, as
tpflow keeps key/value heads for attention.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist
from torch import nn

from tpflow.global_tensor.segments import keep_answering
from tpflow.hf.mixer_split import Gathered, HeadRanks, MixerStyle, SplitMixer, refuse_undivided
from tpflow.plans.style import Plan

__all__ = ["DeltaNetHeads", "delta_net_counts"]

_INTERLEAVED = ("in_proj_qkvz", "in_proj_ba")
_SEGMENTED = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
_SEPARATE = ("q_proj", "k_proj", "v_proj", "g_proj", "a_proj", "b_proj")  # OLMo-Hybrid's


def _out(module: nn.Module) -> nn.Module:
    """A DeltaNet's output projection (``out_proj``, OLMo-Hybrid's ``o_proj``)."""
    return getattr(module, "out_proj", None) or getattr(module, "o_proj", None)


def _norm(module: nn.Module) -> nn.Module:
    """A DeltaNet's gated norm (``norm``, OLMo-Hybrid's ``o_norm``)."""
    return getattr(module, "norm", None) or getattr(module, "o_norm", None)


def delta_net_counts(module: nn.Module) -> tuple[int, int, int, int, tuple[str, ...]] | None:
    """``(key heads, value heads, key head width, value head width, projections)`` of a gated DeltaNet as
    transformers writes it (Qwen3-Next's interleaved ``in_proj_qkvz`` / ``in_proj_ba``, or Qwen3.5's ``in_proj_qkv``
    / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``; a depthwise ``conv1d`` over ``[q | k | v]``; ``A_log`` and
    ``dt_bias`` per value head; an ``out_proj``), or None for any other module.

    Args:
        module: any module.

    Returns:
        The counts, or None.

    Example::

        >>> from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
        >>> model = Qwen3NextForCausalLM(Qwen3NextConfig(
        ...     vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        ...     head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        ...     linear_value_head_dim=8, intermediate_size=32, moe_intermediate_size=16, num_experts=2,
        ...     num_experts_per_tok=1, layer_types=["linear_attention", "full_attention"]))
        >>> delta_net_counts(model.model.layers[0].linear_attn)
        (2, 4, 8, 8, ('in_proj_qkvz', 'in_proj_ba'))
    """
    names = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")
    if not all(isinstance(getattr(module, n, None), int) for n in names):
        return None
    keys, values, k_dim, v_dim = (getattr(module, n) for n in names)
    projections = next((p for p in (_INTERLEAVED, _SEGMENTED, _SEPARATE)
                        if all(isinstance(getattr(module, n, None), nn.Linear) for n in p)), None)
    conv, out = getattr(module, "conv1d", None), _out(module)
    if (projections is None or not isinstance(conv, nn.Conv1d) or not isinstance(out, nn.Linear)
            or not isinstance(_norm(module), nn.Module)):
        return None
    if any(getattr(getattr(module, n, None), "shape", None) != (values,) for n in ("A_log", "dt_bias")):
        return None
    if values % keys or conv.out_channels != 2 * keys * k_dim + values * v_dim or out.in_features != values * v_dim:
        return None
    return keys, values, k_dim, v_dim, projections


@dataclasses.dataclass(frozen=True)
class DeltaNetHeads(MixerStyle):
    """Plan style for a gated DeltaNet (``delta_net_counts``), split by heads (see the module docstring).

    Args:
        sequence_parallel: its input this rank's tokens, gathered on entry, its output reduce-scattered back to them
            (``hf_plan(sequence_parallel=True)`` sets it).

    Example::

        >>> from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
        >>> _ = torch.manual_seed(0)
        >>> model = Qwen3NextForCausalLM(Qwen3NextConfig(
        ...     vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        ...     head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        ...     linear_value_head_dim=8, intermediate_size=32, moe_intermediate_size=16, num_experts=2,
        ...     num_experts_per_tok=1, layer_types=["linear_attention", "full_attention"]))
        >>> ids = torch.randint(0, 64, (1, 6))
        >>> want = model(ids).logits
        >>> model = tpf.parallelize(model, placement=tpf.placement("cpu", ranks=[0, 1]),
        ...                         plan={"model.layers.0.linear_attn": DeltaNetHeads()})
        >>> model.model.layers[0].linear_attn.num_v_heads                   # 2 of its 4 value heads a rank
        2
        >>> torch.testing.assert_close(model(ids).logits, want)
    """

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        counts = delta_net_counts(module)
        if counts is None:
            raise ValueError(f"{name!r} is a {type(module).__name__}; DeltaNetHeads takes a gated DeltaNet (q / k / v "
                             f"/ z / b / a projections, conv1d over [q | k | v], A_log / dt_bias per value head)")
        keys, values, k_dim, _, _ = counts
        world = self.world(plan)
        if values % world or (keys % world and world % keys) or (world > keys and k_dim % (world // keys)):
            degrees = [d for d in range(1, values + 1) if values % d == 0 and (
                keys % d == 0 or (d % keys == 0 and k_dim % (d // keys) == 0))]
            raise ValueError(f"{name!r} has {keys} key heads and {values} value heads, which do not split over "
                             f"{world} {self.said} (the value heads must divide, and the key heads divide, "
                             f"or be fewer with their {k_dim} rows each split over the ranks sharing one): use a "
                             f"degree among {degrees}")

    def apply(self, name: str, module: nn.Module, plan: Plan) -> None:
        ranks = self.head_ranks(plan)
        pl, world = plan.placement, ranks.world
        keep_answering(plan.model)  # (FSDP2 may put its own parameters in place of the segmented ones)
        keys, values, k_dim, v_dim, projections = delta_net_counts(module)
        share = max(world // keys, 1)  # the ranks holding one key head's value heads
        key_rows, value_rows = keys * k_dim, values * v_dim
        if projections == _INTERLEAVED and world > keys:  # each key head's [q | k | v | z], over its ranks
            per = values // keys
            spans = tuple((g * share, share) for g in range(keys) for _ in range(4))
            ranks.segment(module.in_proj_qkvz, "weight", (k_dim, k_dim, per * v_dim, per * v_dim) * keys, spans=spans)
            ranks.segment(module.in_proj_ba, "weight", (per, per) * keys, spans=spans[::2])  # 2 a head
        elif projections == _INTERLEAVED:  # whole key heads a rank: a plain split of the interleaved rows
            for projection in _INTERLEAVED:
                ranks.split(getattr(module, projection), "weight", 0)
        elif projections == _SEGMENTED:
            ranks.segment(module.in_proj_qkv, "weight", (key_rows, key_rows, value_rows))
            for projection in _SEGMENTED[1:]:
                ranks.split(getattr(module, projection), "weight", 0)
        else:  # each its own heads' rows (q / k: a shared key head's, split over its ranks)
            for projection in _SEPARATE:
                ranks.split(getattr(module, projection), "weight", 0)
        for param in ("weight", "bias"):
            if getattr(module.conv1d, param) is not None:
                ranks.segment(module.conv1d, param, (key_rows, key_rows, value_rows), read_by=module)
        for param in ("A_log", "dt_bias"):
            ranks.split(module, param, 0)
        for param, _ in _norm(module).named_parameters(recurse=False):
            ranks.broadcast(_norm(module), param)
        ranks.split_inputs(_out(module))
        shared = ranks.sharing(keys) if ranks.world > keys else None  # (every rank makes the group)
        if pl.coordinate() is not None:
            _split_hooks(module, (keys, values, k_dim, v_dim, projections), ranks, shared, self.sequence_dim)


def _split_hooks(module: nn.Module, counts: tuple, ranks: HeadRanks, shared: dist.ProcessGroup | None,
                 tokens: int | None) -> None:
    """The DeltaNet's attributes sized for this rank's heads, and its hooks: a shared key head's q / k rows
    gathered over ``shared``, the ranks holding its value heads."""
    keys, values, k_dim, v_dim, projections = counts
    world = ranks.world
    own = max(keys // world, 1)
    module.num_k_heads, module.num_v_heads = own, values // world
    module.key_dim, module.value_dim = own * k_dim, values // world * v_dim
    module.conv_dim = 2 * module.key_dim + module.value_dim
    gathered = []
    if world > keys:
        share = world // keys
        q = k_dim // share
        gathered = [Gathered(module.conv1d, (q, q, module.value_dim), (0, 1))]
        if projections == _INTERLEAVED:
            gathered.append(Gathered(module.in_proj_qkvz, (q, q, module.value_dim, module.value_dim), (0, 1)))
        elif projections == _SEGMENTED:
            gathered.append(Gathered(module.in_proj_qkv, (q, q, module.value_dim), (0, 1)))
        else:
            gathered += [Gathered(module.q_proj, (q,), (0,)), Gathered(module.k_proj, (q,), (0,))]
    modules = (module, *(getattr(module, p) for p in projections), module.conv1d, _norm(module), _out(module))
    SplitMixer(module, modules, ranks, shared=shared, gathered=gathered, out_bias=_out(module), sequence_dim=tokens)


def kimi_delta_counts(module: nn.Module) -> tuple[int, int] | None:
    """``(heads, head width)`` of a Kimi delta attention (KDA) as transformers writes it: q / k / v projections of
    ``heads * width`` features, a depthwise ``conv1d`` over ``[q | k | v]``, a forget gate of a projection to every
    head's features (low-rank: ``f_a_proj`` to one head's width, ``f_b_proj`` back, Kimi Linear's; or one
    ``f_proj``, Bailing-hybrid's) with ``dt_bias`` per feature and ``A_log`` per head, a ``b_proj`` per head, an output
    gate alike (``g_a_proj`` and ``g_b_proj``, or ``g_proj``), a per-head gated norm and an ``o_proj``; None for any
    other module.

    Args:
        module: any module.

    Returns:
        The counts, or None.

    Example::

        >>> from transformers import AutoModelForCausalLM
        >>> from tpflow.models.zoo import tiny_config
        >>> model = AutoModelForCausalLM.from_config(tiny_config("kimi_linear"))
        >>> kimi_delta_counts(model.model.layers[0].self_attn), kimi_delta_counts(model.model.layers[0].mlp)
        ((4, 16), None)
    """
    heads, width = getattr(module, "num_heads", None), getattr(module, "head_dim", None)
    gate = getattr(module, "forget_gate", None)
    if not (isinstance(heads, int) and isinstance(width, int) and isinstance(gate, nn.Module)
            and all(isinstance(getattr(module, n, None), nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "b_proj",
                                                                              "o_proj"))
            and isinstance(getattr(module, "conv1d", None), nn.Conv1d)
            and _gate_projections(gate, "f") is not None and _gate_projections(module, "g") is not None):
        return None
    features, a_log = heads * width, getattr(gate, "A_log", None)
    if (module.q_proj.out_features != features or module.b_proj.out_features != heads
            or module.conv1d.out_channels != 3 * features or getattr(a_log, "numel", lambda: 0)() != heads
            or getattr(gate.dt_bias, "shape", None) != (features,)
            or _gate_projections(gate, "f")[-1].out_features != features
            or _gate_projections(module, "g")[-1].out_features != features):
        return None
    return heads, width


def _gate_projections(module: nn.Module, prefix: str) -> tuple[nn.Linear, ...] | None:
    """A KDA gate's projections to every head's features: low-rank (``{prefix}_a_proj``, ``{prefix}_b_proj``) or one
    (``{prefix}_proj``); None where it has neither."""
    pair = tuple(getattr(module, f"{prefix}_{n}_proj", None) for n in ("a", "b"))
    if all(isinstance(m, nn.Linear) for m in pair):
        return pair
    one = getattr(module, f"{prefix}_proj", None)
    return (one,) if isinstance(one, nn.Linear) else None


@dataclasses.dataclass(frozen=True)
class KimiDeltaHeads(MixerStyle):
    """Plan style for a Kimi delta attention (``kimi_delta_counts``; Kimi Linear's KDA, Bailing-hybrid's), split by
    heads: q / k / v, ``b_proj``, the gates' projections to every head's features (``f_b_proj`` and ``g_b_proj``, or
    ``f_proj`` and ``g_proj``) and the per-feature ``dt_bias`` by their heads' features, ``A_log`` by heads, the
    convolution over ``[q | k | v]`` per segment, ``o_proj`` a row split; low-rank gates' first projections (to one
    head's width) and the norm's weight (one head's width) whole on every rank.

    Args:
        sequence_parallel: its input this rank's tokens, gathered on entry, its output reduce-scattered back to them
            (``hf_plan(sequence_parallel=True)`` sets it).

    Example::

        >>> from transformers import AutoModelForCausalLM
        >>> from tpflow.models.zoo import tiny_config
        >>> _ = torch.manual_seed(0)
        >>> model = AutoModelForCausalLM.from_config(tiny_config("kimi_linear"))
        >>> ids = torch.randint(0, 64, (1, 6))
        >>> want = model(ids).logits
        >>> model = tpf.parallelize(model, placement=tpf.placement("cpu", ranks=[0, 1]),
        ...                         plan={"model.layers.0.self_attn": KimiDeltaHeads()})
        >>> model.model.layers[0].self_attn.num_heads                       # 2 of its 4 heads a rank
        2
        >>> torch.testing.assert_close(model(ids).logits, want)
    """

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        counts = kimi_delta_counts(module)
        if counts is None:
            raise ValueError(f"{name!r} is a {type(module).__name__}; KimiDeltaHeads takes a Kimi delta attention "
                             f"(q / k / v / b projections per head, low-rank forget and output gates, conv1d)")
        refuse_undivided(name, "heads", counts[0], self.world(plan), self.said)

    def apply(self, name: str, module: nn.Module, plan: Plan) -> None:
        ranks = self.head_ranks(plan)
        pl, world = plan.placement, ranks.world
        keep_answering(plan.model)  # (FSDP2 may put its own parameters in place of the segmented ones)
        heads, width = kimi_delta_counts(module)
        gate = module.forget_gate
        forget, output = _gate_projections(gate, "f"), _gate_projections(module, "g")
        ranks.split_outputs(module.q_proj, module.k_proj, module.v_proj, module.b_proj, output[-1], forget[-1])
        for param in ("weight", "bias"):
            if getattr(module.conv1d, param) is not None:
                ranks.segment(module.conv1d, param, (heads * width,) * 3, read_by=module)
        ranks.split(gate, "dt_bias", 0)
        ranks.split(gate, "A_log", gate.A_log.shape.index(heads))
        for layer in (*output[:-1], *forget[:-1], module.o_norm):
            for param, _ in layer.named_parameters(recurse=False):
                ranks.broadcast(layer, param)
        out_bias = ranks.split_inputs(module.o_proj)
        if pl.coordinate() is None:
            return
        module.num_heads, module.qkv_dim = heads // world, heads // world * width
        module.conv_dim = 3 * module.qkv_dim
        gate.num_heads, gate.qkv_dim = module.num_heads, module.qkv_dim
        modules = (module.q_proj, module.k_proj, module.v_proj, module.b_proj, *output, module.conv1d, gate, *forget,
                   module.o_norm, module.o_proj)
        SplitMixer(module, modules, ranks, out_bias=out_bias, sequence_dim=self.sequence_dim)
