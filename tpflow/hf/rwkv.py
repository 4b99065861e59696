"""RWKV's time mixing and channel mixing split by channels: each rank runs the model's own code on its channels.

Both blocks first mix each token with the one before it (``time_mix_*``, one weight per hidden feature, on the whole
input: kept whole on every rank, each rank's gradient its share, summed over the ranks), then:

time mixing (``RwkvSelfAttention``)
    key, value, receptance   column splits: the rank's channels
    time_decay, time_first   one entry per channel: split alike; the WKV recurrence runs channel by channel, so a
                             rank computes its channels exactly
    output                   a row split: ``receptance * wkv`` of its channels in, the output summed over the ranks
    The cached state (five ``[batch, hidden, layers]`` tensors the model allocates whole) is handed to each rank's
    recurrence as its channels' views: the rank keeps its channels' numerator, denominator and maximum there.

channel mixing (``RwkvFeedForward``)
    key                      a column split: the rank's share of the intermediate features
    value                    a row split: those features in; its partial sums are summed and scattered over the
                             ranks by output channel (reduce-scatter), as the gate needs each channel's whole value
    receptance               a column split by output channel: the gate of the rank's channels
    The gated output, each rank's channels, is gathered: a reduce-scatter and an all-gather, one all-reduce's
    traffic, with every weight split (summing ``sigmoid(r) * v_i`` over the ranks instead would need ``r`` whole on
    every rank, and ``receptance`` with it). In a sequence-parallel model the mixers gather every token on entry;
    the channel mixing then keeps its rank's tokens of the gathered output.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tpflow import comm
from tpflow.hf.mixer_split import HeadRanks, MixerStyle, SplitMixer, refuse_undivided
from tpflow.layers.regions import WHOLE, tag
from tpflow.plans.style import Plan

__all__ = ["ChannelMixChannels", "TimeMixChannels", "channel_mixing_widths", "time_mixing_channels"]

_MIXES = ("time_mix_key", "time_mix_value", "time_mix_receptance")


def _mixes(module: nn.Module, names: tuple[str, ...], hidden: int) -> bool:
    return all(isinstance(getattr(module, n, None), torch.Tensor) and getattr(module, n).shape == (1, 1, hidden)
               for n in names)


def _linear(module: nn.Module, name: str, into: int, out: int) -> bool:
    layer = getattr(module, name, None)
    return isinstance(layer, nn.Linear) and (layer.in_features, layer.out_features) == (into, out)


def time_mixing_channels(module: nn.Module) -> int | None:
    """The channels of RWKV's time mixing as transformers writes it (``key`` / ``value`` / ``receptance`` into
    ``attention_hidden_size`` channels, ``time_decay`` / ``time_first`` per channel, ``output`` back), or None for
    any other module.

    Args:
        module: any module.

    Returns:
        The channels, or None.

    Example::

        >>> from transformers import RwkvConfig, RwkvForCausalLM
        >>> model = RwkvForCausalLM(RwkvConfig(vocab_size=64, hidden_size=16, intermediate_size=24,
        ...                                    num_hidden_layers=2))
        >>> time_mixing_channels(model.rwkv.blocks[0].attention), time_mixing_channels(model.rwkv.blocks[0])
        (16, None)
    """
    width, hidden = getattr(module, "attention_hidden_size", None), getattr(getattr(module, "key", None),
                                                                            "in_features", None)
    if not isinstance(width, int) or not isinstance(hidden, int) or not _mixes(module, _MIXES, hidden):
        return None
    if not all(_linear(module, n, hidden, width) for n in ("key", "value", "receptance")) or not _linear(
            module, "output", width, hidden):
        return None
    if not all(isinstance(getattr(module, n, None), torch.Tensor) and getattr(module, n).shape == (width,)
               for n in ("time_decay", "time_first")):
        return None
    return width


def channel_mixing_widths(module: nn.Module) -> tuple[int, int] | None:
    """``(hidden, intermediate)`` features of RWKV's channel mixing as transformers writes it (``key`` into the
    intermediate features, ``value`` back, ``receptance`` gating the hidden ones), or None for any other module.

    Args:
        module: any module.

    Returns:
        The widths, or None.

    Example::

        >>> from transformers import RwkvConfig, RwkvForCausalLM
        >>> model = RwkvForCausalLM(RwkvConfig(vocab_size=64, hidden_size=16, intermediate_size=24,
        ...                                    num_hidden_layers=2))
        >>> channel_mixing_widths(model.rwkv.blocks[0].feed_forward)
        (16, 24)
    """
    key = getattr(module, "key", None)
    if not isinstance(key, nn.Linear) or hasattr(module, "output") or not isinstance(
            getattr(module, "time_shift", None), nn.Module):
        return None
    hidden, inner = key.in_features, key.out_features
    if not (_mixes(module, _MIXES[::2], hidden) and _linear(module, "value", inner, hidden)
            and _linear(module, "receptance", hidden, hidden)):
        return None
    return hidden, inner


def _split_in_place(module: nn.Module, ranks: HeadRanks, by_output: tuple[str, ...], by_input: tuple[str, ...]) -> None:
    """Split ``module``'s linear layers ``by_output`` by their output features and ``by_input`` by their input
    features (a bias of those whole); make its token-shift mixes broadcast global tensors."""
    ranks.split_outputs(*(getattr(module, n) for n in by_output))
    for n in by_input:
        ranks.split_inputs(getattr(module, n))
    for n in _MIXES:
        if isinstance(getattr(module, n, None), nn.Parameter):
            ranks.broadcast(module, n)


@dataclasses.dataclass(frozen=True)
class TimeMixChannels(MixerStyle):
    """Plan style for RWKV's time mixing (``time_mixing_channels``), split by channels (see the module docstring).

    Args:
        sequence_parallel: its input this rank's tokens, gathered on entry, its output reduce-scattered back to them
            (``hf_plan(sequence_parallel=True)`` sets it).

    Example::

        >>> from transformers import RwkvConfig, RwkvForCausalLM
        >>> _ = torch.manual_seed(0)
        >>> model = RwkvForCausalLM(RwkvConfig(vocab_size=64, hidden_size=16, intermediate_size=24,
        ...                                    num_hidden_layers=2)).double()
        >>> ids = torch.randint(0, 64, (1, 6))
        >>> want = model(ids).logits
        >>> model = tpf.parallelize(model, placement=tpf.placement("cpu", ranks=[0, 1]),
        ...                         plan={"rwkv.blocks.*.attention": TimeMixChannels()})
        >>> model.rwkv.blocks[0].attention.time_decay.to_local().shape       # 8 of its 16 channels
        torch.Size([8])
        >>> torch.testing.assert_close(model(ids).logits, want)
    """

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        width = time_mixing_channels(module)
        if width is None:
            raise ValueError(f"{name!r} is a {type(module).__name__}; TimeMixChannels takes RWKV's time mixing (key / "
                             f"value / receptance, time_decay / time_first per channel, output)")
        refuse_undivided(name, "time-mixing channels", width, self.world(plan), self.said)

    def apply(self, name: str, module: nn.Module, plan: Plan) -> None:
        ranks, pl = self.head_ranks(plan), plan.placement
        _split_in_place(module, ranks, ("key", "value", "receptance"), ("output",))
        ranks.split(module, "time_decay", 0)
        ranks.split(module, "time_first", 0)
        if pl.coordinate() is not None:
            _TimeMixing(module, ranks, time_mixing_channels(module) // ranks.world, self.sequence_dim)


class _TimeMixing(SplitMixer):
    """``SplitMixer``'s hooks, and: the model's cached state (a list of five ``[batch, hidden, layers]`` tensors, the
    last three the recurrence's, per channel) handed in as views of this rank's channels, and the list itself handed
    back to the model after the call."""

    def __init__(self, module: nn.Module, ranks: HeadRanks, channels: int, sequence_dim: int | None) -> None:
        super().__init__(module, (module, module.key, module.value, module.receptance, module.output), ranks,
                         out_bias=module.output if module.output.bias is not None else None, sequence_dim=sequence_dim)
        self.channels = channels
        self.given: list[list | None] = []  # per call in progress: the model's own state list

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args, kwargs = super().before(module, args, kwargs)
        state = kwargs.get("state", args[1] if len(args) > 1 else None)
        self.given.append(state)
        if state is None:
            return args, kwargs
        own = [*state[:2], *(s.narrow(1, 0, self.channels) for s in state[2:])]  # views: written through
        return ((args[0], own, *args[2:]), kwargs) if len(args) > 1 else (args, {**kwargs, "state": own})

    def after(self, module: nn.Module, args: tuple, output: object) -> object:
        output, state = super().after(module, args, output), self.given.pop()
        if state is None or not isinstance(output, tuple):
            return output
        return (output[0], state, *output[2:])


@dataclasses.dataclass(frozen=True)
class ChannelMixChannels(MixerStyle):
    """Plan style for RWKV's channel mixing (``channel_mixing_widths``), split by channels (see the module
    docstring).

    Args:
        sequence_parallel: its input this rank's tokens, gathered on entry, its output reduce-scattered back to them
            (``hf_plan(sequence_parallel=True)`` sets it).

    Example::

        >>> from transformers import RwkvConfig, RwkvForCausalLM
        >>> _ = torch.manual_seed(0)
        >>> model = RwkvForCausalLM(RwkvConfig(vocab_size=64, hidden_size=16, intermediate_size=24,
        ...                                    num_hidden_layers=2)).double()
        >>> ids = torch.randint(0, 64, (1, 6))
        >>> want = model(ids).logits
        >>> model = tpf.parallelize(model, placement=tpf.placement("cpu", ranks=[0, 1]),
        ...                         plan={"rwkv.blocks.*.feed_forward": ChannelMixChannels()})
        >>> model.rwkv.blocks[0].feed_forward.receptance.weight.to_local().shape     # 8 of the 16 channels' gates
        torch.Size([8, 16])
        >>> torch.testing.assert_close(model(ids).logits, want)
    """

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        widths = channel_mixing_widths(module)
        if widths is None:
            raise ValueError(f"{name!r} is a {type(module).__name__}; ChannelMixChannels takes RWKV's channel mixing "
                             f"(key, value, receptance and the token-shift mixes)")
        world = self.world(plan)
        refuse_undivided(name, "channel-mixing hidden features (receptance's gates)", widths[0], world, self.said)
        refuse_undivided(name, "channel-mixing intermediate features", widths[1], world, self.said)

    def apply(self, name: str, module: nn.Module, plan: Plan) -> None:
        ranks, pl = self.head_ranks(plan), plan.placement
        _split_in_place(module, ranks, ("key", "receptance"), ("value",))
        if pl.coordinate() is not None:
            _ChannelMixing(module, ranks, self.sequence_dim)


class _ChannelMixing(SplitMixer):
    """``SplitMixer``'s hooks but for the output: ``value``'s partial sums summed and scattered by channel, the gated
    channels gathered (and, in a sequence-parallel model, this rank's tokens of them kept)."""

    def __init__(self, module: nn.Module, ranks: HeadRanks, sequence_dim: int | None) -> None:
        super().__init__(module, (module, module.key, module.receptance, module.value), ranks,
                         out_bias=module.value if module.value.bias is not None else None, sequence_dim=sequence_dim)
        self.hidden = module.value.out_features
        module.value.register_forward_hook(self.scattered)

    def scattered(self, value: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return comm.reduce_scatter_to_ranks(output.contiguous(), output.ndim - 1, self.group)

    def after(self, module: nn.Module, args: tuple, output: object) -> object:
        for m, reads in self.reads:
            reads.leave(m)
        if not isinstance(output, tuple) or not isinstance(output[0], torch.Tensor):
            return output
        gathered = comm.gather_from_ranks(output[0], output[0].ndim - 1, self.hidden, self.group)
        if self.context is not None:  # the context ranks' tokens back in their order, each rank its own
            tokens = gathered if self.context.in_order else gathered.index_select(
                1, self.context.order(gathered.device)[1])
            tokens = tokens.contiguous()
            return (comm.scatter_to_ranks(tokens, 1, self.tokens), *output[1:])
        if self.sequence_dim is not None:  # this rank's tokens of the whole output
            return (comm.scatter_to_ranks(gathered, self.sequence_dim, self.group), *output[1:])
        return (tag(gathered, WHOLE), *output[1:])
