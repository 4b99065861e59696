"""Pipeline stages: a module on a placement (OneFlow's ``set_stage``).

A stage's parameters live only on its placement's ranks (elsewhere their blocks are empty), and its
input is moved onto the placement with ``to_global`` on entry, so inside it any SBP works: data
parallel (broadcast parameters, split(0) input), tensor parallel (column / row layers), or both on
a 2-D placement. Called eagerly, every rank runs every stage in order, as one SPMD script, and
only the stage's own ranks compute: elsewhere global tensors carry shapes and empty blocks. A
``tpf.Pipeline`` runs the same stages over micro-batches, each rank only its own stage.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tpflow.global_tensor import get_placement, get_sbp, tensor, to_global
from tpflow.placement import Placement
from tpflow.sbp import Sbp, broadcast, normalize

__all__ = ["Stage", "stage"]


class Stage(nn.Module):
    """``module`` as stage ``stage_id`` of a pipeline, on ``placement``; ``sbp`` is its input's layout there
    (None: the incoming SBP where the placements have the same shape, else broadcast)."""

    def __init__(self, module: nn.Module, stage_id: int, placement: Placement, sbp: object = None) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"tpf.stage takes an nn.Module, got {type(module).__name__}")
        if not isinstance(placement, Placement):
            raise TypeError(f"placement must be a tpf.placement(type, ranks), got {placement!r}")
        if not isinstance(stage_id, int) or isinstance(stage_id, bool) or stage_id < 0:
            raise ValueError(f"stage_id must be an int >= 0, got {stage_id!r}")
        self.stage_id, self.placement, self.sbp = stage_id, placement, sbp
        if sbp is not None:
            normalize(sbp, placement.ndim, 1)  # a malformed SBP fails here, not at the first call
        self.module = to_global(module, placement=placement)

    def input_sbp(self, src: Placement, src_sbps: tuple[Sbp, ...], ndim: int) -> tuple[Sbp, ...]:
        """The layout this stage computes on, for an input of ``ndim`` dims laid out as ``src_sbps`` on ``src``."""
        if self.sbp is not None:
            return normalize(self.sbp, self.placement.ndim, ndim)
        if src.hierarchy == self.placement.hierarchy:
            return src_sbps
        return (broadcast,) * self.placement.ndim

    def enter(self, x: torch.Tensor) -> DTensor:
        """``x`` on this stage's placement: a global tensor is boxed there; a plain one is read as the whole
        value (the same on every rank, as a single-device script has it) and is data, with no gradient."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"stage {self.stage_id} takes a tensor, got {type(x).__name__}")
        if not isinstance(x, DTensor):
            sbps = self.input_sbp(self.placement, (broadcast,) * self.placement.ndim, x.ndim)
            return tensor(x.detach().to(self.placement.device), placement=self.placement, sbp=sbps)
        sbps = self.input_sbp(get_placement(x), get_sbp(x), x.ndim)
        return to_global(x, placement=self.placement, sbp=sbps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(self.enter(x))

    def extra_repr(self) -> str:
        sbp = "" if self.sbp is None else f", sbp={self.sbp}"
        return f"stage_id={self.stage_id}, placement={self.placement.type}:{self.placement.ranks}{sbp}"


def stage(module: nn.Module, *, stage_id: int, placement: Placement, sbp: object = None) -> Stage:
    """``module`` as pipeline stage ``stage_id`` on ``placement`` (OneFlow's ``set_stage``): plain parameters
    and buffers are broadcast there, global ones keep their SBP; ``sbp`` is the input's layout on entry."""
    return Stage(module, stage_id, placement, sbp)
