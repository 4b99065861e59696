"""Short-convolution mixers split by channels (LFM2, LFM2-MoE, LFM3): each rank runs the model's own mixer code
(``B * x``, a depthwise causal convolution, ``C *``) on its channels, the output summed.

transformers stores the mixer as it computes it, and the split keeps that layout:

    in_proj   [B | C | x] rows (H each), chunked by the mixer: each segment split over the ranks, a rank its rows
              of each (``tpflow.global_tensor.segments``: every gather and checkpoint sees the stored order)
    conv      a depthwise convolution over the H channels of ``B * x``: split by channels
    out_proj  a row split: its input features are those channels; the output summed over the ranks

Every step but ``out_proj`` is channel by channel (a product, a convolution with its own kernel per channel), so a
rank holding ``H / W`` channels computes them exactly; its convolution state (the cache's, sized by the tensor it
first stores) holds its channels alone.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from tpflow.hf.mixer_split import MixerStyle, SplitMixer, refuse_undivided
from tpflow.plans.style import Plan

__all__ = ["ShortConvChannels", "short_conv_channels"]


def short_conv_channels(module: nn.Module) -> int | None:
    """The channels of a short-convolution mixer as transformers writes it (LFM2's ``*ShortConv``: an ``in_proj``
    of ``[B | C | x]``, a depthwise ``conv`` over ``x``'s channels, an ``out_proj`` back), or None for any other
    module.

    Args:
        module: any module.

    Returns:
        The channels, or None.

    Example::

        >>> from transformers import Lfm2Config, Lfm2ForCausalLM
        >>> model = Lfm2ForCausalLM(Lfm2Config(vocab_size=64, hidden_size=16, intermediate_size=32,
        ...                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        ...                                    layer_types=["conv", "full_attention"]))
        >>> short_conv_channels(model.model.layers[0].conv), short_conv_channels(model.model.layers[1].self_attn)
        (16, None)
    """
    if not type(module).__name__.endswith("ShortConv") or not isinstance(getattr(module, "conv_kernel_size", None),
                                                                          int):
        return None
    in_proj, conv, out = (getattr(module, n, None) for n in ("in_proj", "conv", "out_proj"))
    if not (isinstance(in_proj, nn.Linear) and isinstance(conv, nn.Conv1d) and isinstance(out, nn.Linear)):
        return None
    width = conv.out_channels
    if (conv.in_channels != width or conv.groups != width or in_proj.out_features != 3 * width
            or out.in_features != width):
        return None
    return width


@dataclasses.dataclass(frozen=True)
class ShortConvChannels(MixerStyle):
    """Plan style for a short-convolution mixer (``short_conv_channels``), split by channels (see the module
    docstring).

    Args:
        sequence_parallel: its input this rank's tokens, gathered on entry, its output reduce-scattered back to them
            (``hf_plan(sequence_parallel=True)`` sets it).

    Example::

        >>> from transformers import Lfm2Config, Lfm2ForCausalLM
        >>> config = Lfm2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        ...                     num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"])
        >>> _ = torch.manual_seed(0)
        >>> model = Lfm2ForCausalLM(config).double()
        >>> ids = torch.randint(0, 64, (1, 6))
        >>> want = model(ids).logits
        >>> model = tpf.parallelize(model, placement=tpf.placement("cpu", ranks=[0, 1]),
        ...                         plan={"model.layers.0.conv": ShortConvChannels()})
        >>> model.model.layers[0].conv.in_proj.weight.to_local().shape      # 8 of each segment's 16 rows
        torch.Size([24, 16])
        >>> torch.testing.assert_close(model(ids).logits, want)
    """

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        width = short_conv_channels(module)
        if width is None:
            raise ValueError(f"{name!r} is a {type(module).__name__}; ShortConvChannels takes a short-convolution "
                             f"mixer (in_proj [B | C | x], a depthwise conv over x's channels, out_proj)")
        refuse_undivided(name, "short-convolution channels", width, self.world(plan), self.said)

    def apply(self, name: str, module: nn.Module, plan: Plan) -> None:
        ranks, pl, width = self.head_ranks(plan), plan.placement, short_conv_channels(module)
        for param in ("weight", "bias"):
            if getattr(module.in_proj, param) is not None:
                ranks.segment(module.in_proj, param, (width, width, width))
            if getattr(module.conv, param) is not None:  # (read by the mixer itself: conv.weight.squeeze(1))
                ranks.split(module.conv, param, 0)
        out_bias = ranks.split_inputs(module.out_proj)
        if pl.coordinate() is not None:
            SplitMixer(module, (module, module.in_proj, module.conv, module.out_proj), ranks, out_bias=out_bias,
                       sequence_dim=self.sequence_dim)
