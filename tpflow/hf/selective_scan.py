"""Mamba-1 mixers split by channels (Mamba, Falcon-Mamba, Jamba): each rank runs the model's own mixer code (its
torch path: convolution, selective scan, the one-token update when decoding) on its d_inner / W channels, the output
summed.

A Mamba-1 mixer works channel by channel between its projections, and transformers' layout is kept:

    in_proj   [x | z] rows (d_inner each): each segment split over the ranks, a rank its rows of each
              (``tpflow.global_tensor.segments``: every gather and checkpoint sees the stored order)
    conv1d    depthwise over the d_inner channels: split by channels
    x_proj    d_inner -> dt_rank + 2N: a row split; its outputs (the time step's low-rank part, and B and C, which
              every channel reads) summed over the ranks where the model calls it, one all-reduce of dt_rank + 2N
              values a token: every rank then holds them whole
    dt_proj   dt_rank -> d_inner: split by its output channels
    A_log, D  one row per channel: split
    out_proj  a row split: its input features are the channels; the output summed over the ranks, its bias once

Jamba's norms of dt / B / C (and Falcon-Mamba's weightless ones) act on x_proj's summed outputs: whole on every rank,
their gradients (each rank's channels' part) summed. Mamba and Falcon-Mamba train through a fused kernel where
mamba_ssm or the kernels hub is present (``mamba_inner_fn``, taken when ``training`` and no cache), which computes
x_proj inside itself, where no sum over the ranks can go: a split mixer is called with its ``training`` flag off,
which selects the model's unfused path alone (the same math; its convolution and scan kernels act channel by channel,
on the rank's channels). The conv and SSM states a cache keeps are the rank's channels, sized by the first call.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tpflow import comm
from tpflow.hf.mixer_split import HeadRanks, MixerStyle, SplitMixer, refuse_undivided
from tpflow.plans.style import Plan

__all__ = ["ScanChannels", "selective_scan_counts"]

_PROJECTIONS = ("in_proj", "conv1d", "x_proj", "dt_proj", "out_proj")
_ON_OUTPUTS = ("dt_layernorm", "b_layernorm", "c_layernorm")  # norms of x_proj's outputs (Jamba's, Falcon-Mamba's)


def selective_scan_counts(module: nn.Module) -> tuple[int, int, int] | None:
    """``(inner channels, state size, time step rank)`` of a Mamba-1 mixer as transformers writes it (``in_proj``
    of ``[x | z]``, a depthwise ``conv1d``, ``x_proj`` to ``[dt | B | C]`` without a bias, ``dt_proj``, per-channel
    ``A_log`` / ``D``, ``out_proj``, and no parameters but those and the norms of dt / B / C), or None for any
    other module.

    Args:
        module: any module.

    Returns:
        The counts, or None.

    Example::

        >>> from transformers import MambaConfig, MambaForCausalLM
        >>> model = MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=1))
        >>> selective_scan_counts(model.backbone.layers[0].mixer), selective_scan_counts(model.backbone.layers[0])
        ((32, 4, 1), None)
    """
    names = ("intermediate_size", "ssm_state_size", "time_step_rank")
    if not all(isinstance(getattr(module, n, None), int) for n in names):
        return None
    inner, state, rank = (getattr(module, n) for n in names)
    in_proj, conv, x_proj, dt_proj, out = (getattr(module, n, None) for n in _PROJECTIONS)
    if not (all(isinstance(m, nn.Linear) for m in (in_proj, x_proj, dt_proj, out)) and isinstance(conv, nn.Conv1d)):
        return None
    own = dict(module.named_parameters(recurse=False))
    if own.keys() != {"A_log", "D"} or own["A_log"].shape != (inner, state) or own["D"].shape != (inner,):
        return None
    holding = [n for n, m in module.named_children() if any(True for _ in m.parameters())]
    if any(n not in _PROJECTIONS + _ON_OUTPUTS for n in holding):
        return None
    if (in_proj.out_features != 2 * inner or conv.out_channels != inner or conv.groups != inner
            or x_proj.in_features != inner or x_proj.out_features != rank + 2 * state or x_proj.bias is not None
            or (dt_proj.in_features, dt_proj.out_features) != (rank, inner) or out.in_features != inner):
        return None
    return inner, state, rank


@dataclasses.dataclass(frozen=True)
class ScanChannels(MixerStyle):
    """Plan style for a Mamba-1 mixer (``selective_scan_counts``), split by channels (see the module docstring);
    with ``sequence_parallel``, its input this rank's tokens, gathered on entry, and its output reduce-scattered
    back to them.

    Args:
        sequence_parallel: its input this rank's tokens, gathered on entry, its output reduce-scattered back to them
            (``hf_plan(sequence_parallel=True)`` sets it).

    Example::

        >>> from transformers import MambaConfig, MambaForCausalLM
        >>> config = MambaConfig(vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=1)
        >>> _ = torch.manual_seed(0)
        >>> model = MambaForCausalLM(config).double()
        >>> ids = torch.randint(0, 64, (1, 6))
        >>> want = model(ids).logits
        >>> model = tpf.parallelize(model, placement=tpf.placement("cpu", ranks=[0, 1]),
        ...                         plan={"backbone.layers.*.mixer": ScanChannels()})
        >>> mixer = model.backbone.layers[0].mixer
        >>> mixer.intermediate_size, mixer.in_proj.weight.to_local().shape    # 16 of 32 channels: of x and of z
        (16, torch.Size([32, 16]))
        >>> torch.testing.assert_close(model(ids).logits, want)
    """

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        counts = selective_scan_counts(module)
        if counts is None:
            raise ValueError(f"{name!r} is a {type(module).__name__}; ScanChannels takes a Mamba-1 mixer (in_proj "
                             f"[x | z], a depthwise conv1d, x_proj to [dt | B | C] without a bias, dt_proj, A_log / "
                             f"D per channel, out_proj)")
        inner, world = counts[0], self.world(plan)
        refuse_undivided(name, "inner channels (d_inner)", inner, world, self.said)

    def apply(self, name: str, module: nn.Module, plan: Plan) -> None:
        ranks = self.head_ranks(plan)
        pl, world = plan.placement, ranks.world
        inner = selective_scan_counts(module)[0]
        for param in ("weight", "bias"):
            if getattr(module.in_proj, param) is not None:
                ranks.segment(module.in_proj, param, (inner, inner))
            for by_channel in (module.conv1d, module.dt_proj):
                if getattr(by_channel, param) is not None:
                    ranks.split(by_channel, param, 0)
        for param in ("A_log", "D"):
            ranks.split(module, param, 0)
        for row in (module.x_proj, module.out_proj):
            ranks.split(row, "weight", 1)
        if module.out_proj.bias is not None:
            ranks.broadcast(module.out_proj, "bias")
        norms = [getattr(module, n) for n in _ON_OUTPUTS if isinstance(getattr(module, n, None), nn.Module)]
        for norm in norms:  # on the summed dt / B / C, read by this rank's channels: their gradients summed
            for param, value in list(norm.named_parameters(recurse=False)):
                if value is not None:
                    ranks.broadcast(norm, param)
        module.intermediate_size = inner // world
        if pl.coordinate() is not None:
            SplitMixer(module, (module, *(getattr(module, n) for n in _PROJECTIONS), *norms), ranks,
                       out_bias=module.out_proj, sequence_dim=self.sequence_dim)
            _SummedScanInputs(module, ranks)


class _SummedScanInputs:
    """x_proj's outputs summed over the ranks, forward and backward (each rank's channels read them whole), and the
    mixer called with ``training`` off (its unfused path: no fused kernel computing x_proj inside itself)."""

    def __init__(self, module: nn.Module, ranks: HeadRanks) -> None:
        self.group = ranks.group
        self.training: list[bool] = []  # per call in progress: the mixer's own flag
        module.x_proj.register_forward_hook(self.summed)
        if self.group is not None:
            module.register_forward_pre_hook(self.before)
            module.register_forward_hook(self.after, always_call=True)

    def summed(self, x_proj: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return comm.copy_to_ranks(comm.reduce_from_ranks(output, self.group), self.group)

    def before(self, module: nn.Module, args: tuple) -> None:
        self.training.append(module.training)
        module.training = False

    def after(self, module: nn.Module, args: tuple, output: object) -> None:
        if self.training:
            module.training = self.training.pop()
