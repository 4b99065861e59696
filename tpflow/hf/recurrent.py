"""RecurrentGemma's recurrent block (Griffin's) split by heads: each rank runs the model's own block (a gated
branch, a depthwise convolution, the RG-LRU) on its heads' channels, the output summed.

    linear_x, linear_y   column splits: each rank its heads' channels of the two branches
    conv_1d              a depthwise convolution over ``linear_x``'s channels: split by channels
    rg_lru               its gates are block-diagonal, one ``block_width`` square block per head
                         (``input_gate_weight`` / ``recurrent_gate_weight`` [heads, block, block], their biases
                         [heads, block]): split by heads; ``recurrent_param`` and the recurrence are per channel
    linear_out           a row split: its input features are the heads' channels; the output summed over the ranks

The block keeps its convolution and recurrent states on itself, sized by ``lru_width`` and ``hidden_size`` (its
conv state's channels), and views its activations by the RG-LRU's ``num_attention_heads``; ``conv_1d`` convolves
by its ``groups``: those become the rank's, so ``generate``'s states hold its heads' channels alone.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tpflow.hf.mixer_split import MixerStyle, SplitMixer, refuse_undivided
from tpflow.plans.style import Plan

__all__ = ["RecurrentHeads", "recurrent_block_counts"]

_GATES = ("input_gate_weight", "input_gate_bias", "recurrent_gate_weight", "recurrent_gate_bias")


def recurrent_block_counts(module: nn.Module) -> tuple[int, int] | None:
    """``(heads, width)`` of a recurrent block as transformers writes RecurrentGemma's (``linear_x`` /
    ``linear_y`` into ``lru_width`` channels, a depthwise ``conv_1d`` over them, an ``rg_lru`` with one gate block
    per head, ``linear_out`` back), or None for any other module.

    Args:
        module: any module.

    Returns:
        The counts, or None.

    Example::

        >>> from transformers import RecurrentGemmaConfig, RecurrentGemmaForCausalLM
        >>> model = RecurrentGemmaForCausalLM(RecurrentGemmaConfig(
        ...     vocab_size=64, hidden_size=16, lru_width=16, intermediate_size=32, num_attention_heads=4,
        ...     num_key_value_heads=1, num_hidden_layers=2, block_types=["recurrent", "attention"]))
        >>> recurrent_block_counts(model.model.layers[0].temporal_block)
        (4, 16)
    """
    width, lru = getattr(module, "lru_width", None), getattr(module, "rg_lru", None)
    if not isinstance(width, int) or not isinstance(getattr(module, "hidden_size", None), int):
        return None
    heads, block = getattr(lru, "num_attention_heads", None), getattr(lru, "block_width", None)
    if not isinstance(heads, int) or not isinstance(block, int) or heads * block != width:
        return None
    linears = [getattr(module, n, None) for n in ("linear_x", "linear_y", "linear_out")]
    conv = getattr(module, "conv_1d", None)
    if not all(isinstance(m, nn.Linear) for m in linears) or not isinstance(conv, nn.Conv1d):
        return None
    if (linears[0].out_features != width or linears[1].out_features != width or linears[2].in_features != width
            or conv.out_channels != width or conv.groups != width):
        return None
    shapes = {"recurrent_param": (width,), "input_gate_weight": (heads, block, block),
              "input_gate_bias": (heads, block), "recurrent_gate_weight": (heads, block, block),
              "recurrent_gate_bias": (heads, block)}
    if not all(isinstance(getattr(lru, n, None), torch.Tensor) and getattr(lru, n).shape == s
               for n, s in shapes.items()):
        return None
    return heads, width


@dataclasses.dataclass(frozen=True)
class RecurrentHeads(MixerStyle):
    """Plan style for RecurrentGemma's recurrent block (``recurrent_block_counts``), split by heads (see the module
    docstring).

    Args:
        sequence_parallel: its input this rank's tokens, gathered on entry, its output reduce-scattered back to them
            (``hf_plan(sequence_parallel=True)`` sets it).

    Example::

        >>> from transformers import RecurrentGemmaConfig, RecurrentGemmaForCausalLM
        >>> config = RecurrentGemmaConfig(vocab_size=64, hidden_size=16, lru_width=16, intermediate_size=32,
        ...                               num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=2,
        ...                               block_types=["recurrent", "attention"])
        >>> _ = torch.manual_seed(0)
        >>> model = RecurrentGemmaForCausalLM(config).double()
        >>> ids = torch.randint(0, 64, (1, 6))
        >>> want = model(ids).logits
        >>> model = tpf.parallelize(model, placement=tpf.placement("cpu", ranks=[0, 1]),
        ...                         plan={"model.layers.0.temporal_block": RecurrentHeads()})
        >>> block = model.model.layers[0].temporal_block
        >>> block.rg_lru.num_attention_heads, block.rg_lru.input_gate_weight.to_local().shape    # 2 of 4 heads
        (2, torch.Size([2, 4, 4]))
        >>> torch.testing.assert_close(model(ids).logits, want)
    """

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        counts = recurrent_block_counts(module)
        if counts is None:
            raise ValueError(f"{name!r} is a {type(module).__name__}; RecurrentHeads takes RecurrentGemma's recurrent "
                             f"block (linear_x / linear_y, a depthwise conv_1d, an rg_lru of gate blocks per head, "
                             f"linear_out)")
        heads, _ = counts
        refuse_undivided(name, "recurrent heads (RG-LRU gate blocks)", heads, self.world(plan), self.said)

    def apply(self, name: str, module: nn.Module, plan: Plan) -> None:
        ranks = self.head_ranks(plan)
        pl, world = plan.placement, ranks.world
        heads, width = recurrent_block_counts(module)
        ranks.split_outputs(module.linear_x, module.linear_y, module.conv_1d)
        for param in ("recurrent_param", *_GATES):
            ranks.split(module.rg_lru, param, 0)
        out_bias = ranks.split_inputs(module.linear_out)
        module.lru_width = module.hidden_size = width // world  # (it sizes its conv state by hidden_size)
        module.conv_1d.in_channels = module.conv_1d.out_channels = module.conv_1d.groups = width // world
        module.rg_lru.num_attention_heads = heads // world
        if pl.coordinate() is not None:
            SplitMixer(module, (module.linear_x, module.linear_y, module.conv_1d, module.rg_lru, module.linear_out),
                       ranks, out_bias=out_bias, sequence_dim=self.sequence_dim)
