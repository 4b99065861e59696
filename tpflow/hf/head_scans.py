"""Zamba's Mamba mixer (Mamba-1 in independent heads, each with its own x / dt projections and selective scan)
split by heads: each rank runs the model's own mixer code on its heads, the output summed.

    in_proj          each feature's x and gate rows side by side (``[x_0, z_0, x_1, z_1, ...]``), so a head's
                     features are one run of rows: split by heads
    conv1d           depthwise over the features: split by heads
    x_proj_weight,   one block per head (``[heads, ...]``): split by heads
    dt_proj_*, A_log, D
    out_proj         a row split: its input features are the heads'; the output summed over the ranks, its bias once

The mixer views its activations by ``n_mamba_heads``, which becomes the rank's; its caches' states (sized by the
tensors they first store) hold its heads alone.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tpflow.hf.mixer_split import MixerStyle, SplitMixer, refuse_undivided
from tpflow.plans.style import Plan

__all__ = ["HeadScans", "head_scan_counts"]

_PER_HEAD = ("x_proj_weight", "dt_proj_weight", "dt_proj_bias", "A_log", "D")


def head_scan_counts(module: nn.Module) -> tuple[int, int] | None:
    """``(heads, head width)`` of a Mamba mixer in independent heads as transformers writes Zamba's (``in_proj`` of
    each feature's x and gate rows, a depthwise ``conv1d``, per-head ``x_proj_weight`` / ``dt_proj_weight`` /
    ``dt_proj_bias`` / ``A_log`` / ``D``, ``out_proj``), or None for any other module.

    Args:
        module: any module.

    Returns:
        The counts, or None.

    Example::

        >>> from transformers import AutoModelForCausalLM
        >>> from tpflow.models.zoo import tiny_config
        >>> model = AutoModelForCausalLM.from_config(tiny_config("zamba"))
        >>> head_scan_counts(model.model.layers[0].mamba), head_scan_counts(model.model.layers[0])
        ((4, 32), None)
    """
    heads, width = getattr(module, "n_mamba_heads", None), getattr(module, "mamba_head_dim", None)
    if not isinstance(heads, int) or not isinstance(width, int):
        return None
    in_proj, conv, out = (getattr(module, n, None) for n in ("in_proj", "conv1d", "out_proj"))
    if not (isinstance(in_proj, nn.Linear) and isinstance(conv, nn.Conv1d) and isinstance(out, nn.Linear)):
        return None
    inner = heads * width
    if in_proj.out_features != 2 * inner or conv.out_channels != inner or conv.groups != inner \
            or out.in_features != inner:
        return None
    if not all(isinstance(getattr(module, n, None), torch.Tensor) and getattr(module, n).shape[:2] == (heads, width)
               for n in _PER_HEAD if n != "x_proj_weight") or getattr(module.x_proj_weight, "shape", (0,))[0] != heads:
        return None
    return heads, width


@dataclasses.dataclass(frozen=True)
class HeadScans(MixerStyle):
    """Plan style for a Mamba mixer in independent heads (``head_scan_counts``; Zamba's), split by heads (see the
    module docstring).

    Args:
        sequence_parallel: its input this rank's tokens, gathered on entry, its output reduce-scattered back to them
            (``hf_plan(sequence_parallel=True)`` sets it).
        context: head parallel under context parallelism (``hf_plan(context_parallel=...)`` sets it).

    Example::

        >>> from transformers import AutoModelForCausalLM
        >>> from tpflow.models.zoo import tiny_config
        >>> _ = torch.manual_seed(0)
        >>> model = AutoModelForCausalLM.from_config(tiny_config("zamba")).double()
        >>> ids = torch.randint(0, 64, (1, 6))
        >>> want = model(ids).logits
        >>> model = tpf.parallelize(model, placement=tpf.placement("cpu", ranks=[0, 1]),
        ...                         plan={"model.layers.0.mamba": HeadScans()})
        >>> model.model.layers[0].mamba.n_mamba_heads                      # 2 of its 4 heads a rank
        2
        >>> torch.testing.assert_close(model(ids).logits, want)
    """

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        counts = head_scan_counts(module)
        if counts is None:
            raise ValueError(f"{name!r} is a {type(module).__name__}; HeadScans takes a Mamba mixer in independent "
                             f"heads (Zamba's: in_proj, conv1d, per-head x / dt projections, A_log and D, out_proj)")
        refuse_undivided(name, "Mamba heads", counts[0], self.world(plan), self.said)

    def apply(self, name: str, module: nn.Module, plan: Plan) -> None:
        ranks, pl = self.head_ranks(plan), plan.placement
        heads, width = head_scan_counts(module)
        ranks.split_outputs(module.in_proj, module.conv1d)
        for param in _PER_HEAD:
            ranks.split(module, param, 0)
        out_bias = ranks.split_inputs(module.out_proj)
        module.n_mamba_heads, module.intermediate_size = heads // ranks.world, heads // ranks.world * width
        if pl.coordinate() is not None:
            SplitMixer(module, (module, module.in_proj, module.conv1d, module.out_proj), ranks, out_bias=out_bias,
                       sequence_dim=self.sequence_dim)
