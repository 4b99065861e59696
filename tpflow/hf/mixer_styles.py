"""The plan style for each token mixer other than attention that tpflow splits over the tensor-parallel ranks, found
by what the module is (its projections and per-head parameters, as transformers writes them), not by its model's
name: the planner asks ``mixer_style`` for each mixer of a decoder layer, and keeps whole, said in the plan, what
it gets no style for."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable

from torch import nn

from tpflow.hf.delta_net import DeltaNetHeads, KimiDeltaHeads, delta_net_counts, kimi_delta_counts
from tpflow.hf.head_scans import HeadScans, head_scan_counts
from tpflow.hf.lightning import LightningHeads, lightning_counts
from tpflow.hf.mixers import layer_mixers
from tpflow.hf.mlstm import MatrixMemoryHeads, mlstm_counts
from tpflow.hf.recurrent import RecurrentHeads, recurrent_block_counts
from tpflow.hf.rwkv import ChannelMixChannels, TimeMixChannels, channel_mixing_widths, time_mixing_channels
from tpflow.hf.selective_scan import ScanChannels, selective_scan_counts
from tpflow.hf.short_conv import ShortConvChannels, short_conv_channels
from tpflow.hf.state_space import StateSpaceHeads, state_space_counts
from tpflow.plans.style import Style

__all__ = ["mixer_style", "mixers_within", "with_mixers"]

# (does the module take the style, the style): the first that takes it
_KNOWN: list[tuple[Callable[[nn.Module], object], Callable[[], Style]]] = [
    (state_space_counts, StateSpaceHeads),  # Mamba-2
    (short_conv_channels, ShortConvChannels),  # LFM2's short convolutions
    (recurrent_block_counts, RecurrentHeads),  # RecurrentGemma's RG-LRU
    (time_mixing_channels, TimeMixChannels),  # RWKV's time mixing
    (channel_mixing_widths, ChannelMixChannels),  # RWKV's channel mixing
    (mlstm_counts, MatrixMemoryHeads),  # xLSTM's mLSTM
    (delta_net_counts, DeltaNetHeads),  # gated DeltaNet
    (kimi_delta_counts, KimiDeltaHeads),  # Kimi delta attention
    (selective_scan_counts, ScanChannels),  # Mamba-1
    (lightning_counts, LightningHeads),  # MiniMax's lightning attention
    (head_scan_counts, HeadScans),  # Zamba's Mamba in independent heads
]


def mixer_style(module: nn.Module) -> Style | None:
    """The plan style that splits ``module``, a token mixer, over the ranks; None where tpflow splits no such module.

    Args:
        module: a decoder layer's token mixer (or a module inside one).

    Returns:
        A style, or None.

    Example::

        >>> from transformers import Mamba2Config, Mamba2ForCausalLM
        >>> model = Mamba2ForCausalLM(Mamba2Config(vocab_size=64, hidden_size=16, num_heads=4, head_dim=8,
        ...                                        state_size=4, n_groups=2, num_hidden_layers=1))
        >>> mixer_style(model.backbone.layers[0].mixer), mixer_style(model.backbone.layers[0].norm)
        (StateSpaceHeads(sequence_parallel=False, context=False), None)
    """
    return next((style() for takes, style in _KNOWN if takes(module)), None)


def with_mixers(model: nn.Module, plan: dict[str, object]) -> dict[str, object]:
    """``plan`` with every token mixer of ``model`` that tpflow splits given its style (``mixer_style``), in place of
    the plan's entries for it or inside it: transformers' own plans for Qwen3-Next's and Qwen3.5's DeltaNets gather
    every head's projections onto every rank (``colwise_gather_output``), which runs the whole recurrence on each.

    Args:
        model: a transformers model.
        plan: module patterns to entries (a model's own plan, or tpflow's).

    Returns:
        A new plan.

    Example::

        >>> from transformers import Mamba2Config, Mamba2ForCausalLM
        >>> model = Mamba2ForCausalLM(Mamba2Config(vocab_size=64, hidden_size=16, num_heads=4, head_dim=8,
        ...                                        state_size=4, n_groups=2, num_hidden_layers=2))
        >>> with_mixers(model, {"backbone.layers.*.mixer.in_proj": "colwise_gather_output"})
        {'backbone.layers.*.mixer': StateSpaceHeads(sequence_parallel=False, context=False)}
    """
    found = {name: style for name, m in model.named_modules() if (style := mixer_style(m)) is not None}
    if not found:
        return plan
    names = [n for n, _ in model.named_modules()]

    def inside(name: str) -> bool:
        return any(name == m or name.startswith(m + ".") for m in found)

    out = {}
    for pattern, entry in plan.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not any(inside(n) for n in hits):
            out[pattern] = entry
        else:  # the pattern's other modules (a layer of another kind) keep their entry
            out.update({n: entry for n in hits if not inside(n)})
    patterns = {}
    for name, style in found.items():  # one pattern over the layers where it matches these mixers alone
        patterns.setdefault((re.sub(r"\.\d+(?=\.|$)", ".*", name), repr(style)), []).append((name, style))
    for (pattern, _), members in patterns.items():
        if {n for n in names if fnmatch.fnmatchcase(n, pattern)} == {n for n, _ in members}:
            out[pattern] = members[0][1]
        else:
            out.update(dict(members))
    return out


def mixers_within(mixer: nn.Module) -> dict[str, Style]:
    """The mixers tpflow splits (``mixer_style``) that a decoder layer's mixer is or holds, by the suffix of their
    names (``""``: itself; ``".mamba"`` inside Zamba2's hybrid layer's ``mamba_decoder``), with their styles, where
    they are its only mixers; empty otherwise.

    Args:
        mixer: a child of a decoder layer that mixes tokens (``tpflow.hf.mixers.layer_mixers``).

    Returns:
        Suffixes to styles.

    Example::

        >>> from transformers import Mamba2Config, Mamba2ForCausalLM
        >>> model = Mamba2ForCausalLM(Mamba2Config(vocab_size=64, hidden_size=16, num_heads=4, head_dim=8,
        ...                                        state_size=4, n_groups=2, num_hidden_layers=1))
        >>> mixers_within(model.backbone.layers[0])           # the layer: its mixer inside, by name
        {'.mixer': StateSpaceHeads(sequence_parallel=False, context=False)}
    """
    found = {f".{n}" if n else "": style for n, m in mixer.named_modules() if (style := mixer_style(m)) is not None}
    if not found or "" in found:
        return {"": found[""]} if found else {}
    inner = {f".{n}" for n, _ in layer_mixers(mixer)}
    return found if inner and inner <= set(found) else {}
