"""Plan entries: how a matched module is parallelized, by name (``"column"``) or with options.

    "column"                              ColumnParallel(): W split(1)
    "row"                                 RowParallel(): W split(0)
    ColumnParallel(sequence_parallel=True, fuse=True)
"""

from __future__ import annotations

import dataclasses

from torch import nn

from tpflow.layers import ColumnParallelLinear, ParallelLinear, RowParallelLinear
from tpflow.placement import Placement

__all__ = ["ColumnParallel", "RowParallel", "Style", "style_of"]


class Style:
    """A plan entry: its fields are the options of its layer's ``from_linear``."""

    layer: type[ParallelLinear]
    _plan_only: tuple[str, ...] = ()  # fields that parallelize() reads, not the layer

    def build(self, module: nn.Linear, placement: Placement) -> ParallelLinear:
        options = {k: v for k, v in dataclasses.asdict(self).items() if k not in self._plan_only}
        return self.layer.from_linear(module, placement=placement, **options)


@dataclasses.dataclass(frozen=True)
class ColumnParallel(Style):
    """Plan entry for a ``ColumnParallelLinear`` (``"column"`` is ``ColumnParallel()``)."""

    layer = ColumnParallelLinear
    gather_output: bool = False
    sequence_parallel: bool = False
    algo: str = "auto"  # the sequence-parallel collectives: "ring" (fused, overlapped), "naive", "auto"
    keep_gathered: bool = True  # False: gather the sequence-parallel input again in backward (less memory)
    # True: the fuse=True column layers of one parent module (q / k / v, gate / up) run as one product, so their
    # shared input crosses the ranks once (tpflow.layers.fused); they need the same options and in_features
    fuse: bool = False
    _plan_only = ("fuse",)


@dataclasses.dataclass(frozen=True)
class RowParallel(Style):
    """Plan entry for a ``RowParallelLinear`` (``"row"`` is ``RowParallel()``)."""

    layer = RowParallelLinear
    input_is_parallel: bool = True
    sequence_parallel: bool = False
    algo: str = "auto"  # the sequence-parallel collectives: "ring" (fused, overlapped), "naive", "auto"


_NAMED = {"column": ColumnParallel(), "row": RowParallel()}


def style_of(pattern: str, style: object) -> ColumnParallel | RowParallel:
    if isinstance(style, (ColumnParallel, RowParallel)):
        return style
    if isinstance(style, str) and style in _NAMED:
        return _NAMED[style]
    raise ValueError(f"plan[{pattern!r}] must be 'column', 'row', tpf.ColumnParallel(...) or tpf.RowParallel(...), "
                     f"got {style!r}")
