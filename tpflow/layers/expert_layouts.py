"""How a Hugging Face experts module lays out its fused 3-D parameters, read off its attributes or its shapes: what
``split_experts`` splits by the intermediate dim.

    gate_up_proj  [E, 2I, H] (or [E, H, 2I] transposed): gate and up, as concatenated halves or interleaved columns
    up_proj       [E, I, H] (or transposed): an ungated MLP's (Nemotron-H's)
    down_proj     [E, H, I] (or [E, I, H] transposed)

Most modules say they are transposed (``is_transposed``); Llama 4's says nothing and stores ``[E, H, 2I]`` and
``[E, I, H]``, which its shapes tell. Most take ``experts(hidden_states, top_k_index, top_k_weights)``; Llama 4's takes
every expert's rows sorted by expert (``experts(hidden_states)``).
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["Layout", "layout", "takes_sorted_rows"]


@dataclasses.dataclass(frozen=True)
class Layout:
    """An experts module's layout.

    Args:
        up: the name of its up projection: ``"gate_up_proj"`` (gated) or ``"up_proj"``.
        features: the dim of the up projection holding its features (``factor`` x I).
        inner: the dim of ``down_proj`` holding I.
        halves: gate and up as concatenated halves (each split over the ranks), not interleaved columns.
        factor: 2 for gate and up together, 1 for an up projection alone.

    Example::

        >>> experts = nn.Module()
        >>> experts.gate_up_proj = nn.Parameter(torch.zeros(4, 12, 8))
        >>> experts.down_proj = nn.Parameter(torch.zeros(4, 8, 6))
        >>> layout(experts).split("gate_up_proj")
        (1, True, _StridedShard(dim=1, sf=2))
    """

    up: str
    features: int
    inner: int
    halves: bool
    factor: int

    def split(self, name: str) -> tuple[int | None, bool, object]:
        """How the parameter ``name`` splits by the intermediate dim: (its dim, whether as gate and up halves, the
        DTensor placement); ``down_proj_bias`` stays whole (dim None), added by one rank.

        Args:
            name: a parameter of the module.

        Returns:
            ``(dim, halves, placement)``.
        """
        if name in (self.up, f"{self.up}_bias"):
            dim = self.features if name == self.up else 1
            return dim, self.halves, _StridedShard(dim, split_factor=2) if self.halves else Shard(dim)
        if name == "down_proj":
            return self.inner, False, Shard(self.inner)
        return None, False, Replicate()


def layout(module: nn.Module) -> Layout:
    """The layout of ``module``'s experts (see the module docstring).

    Args:
        module: an experts module with 3-D ``gate_up_proj`` (or ``up_proj``) and ``down_proj``.

    Returns:
        Its ``Layout``.

    Example::

        >>> experts = nn.Module()                       # Llama 4's: [E, H, 2I] and [E, I, H], no is_transposed
        >>> experts.gate_up_proj = nn.Parameter(torch.zeros(4, 8, 12))
        >>> experts.down_proj = nn.Parameter(torch.zeros(4, 6, 8))
        >>> layout(experts).features, layout(experts).inner
        (2, 1)
    """
    gated = isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
    up_name, factor = ("gate_up_proj", 2) if gated else ("up_proj", 1)
    up, down = getattr(module, up_name, None), getattr(module, "down_proj", None)
    transposed = getattr(module, "is_transposed", None)
    if transposed is None:  # read off the shapes: [E, H, fI] and [E, I, H]
        transposed = isinstance(up, torch.Tensor) and isinstance(down, torch.Tensor) and up.ndim == down.ndim == 3 \
            and up.shape[1] == down.shape[2] and up.shape[2] == factor * down.shape[1] \
            and up.shape[1] != factor * down.shape[2]
    halves = gated and bool(getattr(module, "is_concatenated", True))
    return Layout(up_name, 2, 1, halves, factor) if transposed else Layout(up_name, 1, 2, halves, factor)


def takes_sorted_rows(module: nn.Module) -> bool:
    """Whether ``module`` takes every expert's rows sorted by expert (``experts(hidden_states)``, Llama 4's) rather
    than routed ids and weights.

    Args:
        module: an experts module.

    Returns:
        True or False.

    Example::

        >>> takes_sorted_rows(nn.Identity())
        True
    """
    return len(inspect.signature(module.forward).parameters) == 1
