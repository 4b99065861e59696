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
    """A plan entry: its fields are the options of its layer's ``from_linear``.

    The base of ``ColumnParallel`` and ``RowParallel``: ``layer`` is the parallel layer it builds, and
    ``build`` makes one from an ``nn.Linear`` with the entry's fields as options (those only ``parallelize``
    reads, such as ``fuse``, left out).

    Example::

        >>> import tpflow as tpf
        >>> from torch import nn
        >>> from tpflow.plans.styles import Style
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> style = tpf.RowParallel(sequence_parallel=True)
        >>> isinstance(style, Style), style.layer is tpf.RowParallelLinear
        (True, True)
        >>> fc2 = style.build(nn.Linear(2048, 512), P)   # RowParallelLinear.from_linear(..., sequence_parallel=True)
    """

    layer: type[ParallelLinear]
    _plan_only: tuple[str, ...] = ()  # fields that parallelize() reads, not the layer

    def build(self, module: nn.Linear, placement: Placement) -> ParallelLinear:
        options = {k: v for k, v in dataclasses.asdict(self).items() if k not in self._plan_only}
        return self.layer.from_linear(module, placement=placement, **options)


@dataclasses.dataclass(frozen=True)
class ColumnParallel(Style):
    """Plan entry for a ``ColumnParallelLinear`` (``"column"`` is ``ColumnParallel()``).

    ``parallelize`` replaces each ``nn.Linear`` the entry's pattern matches with a ``ColumnParallelLinear``
    (W split(1)) holding its values, built with these options.

    Args:
        gather_output: all-gather the output's features, so every rank gets the whole y instead of its block
            (default False: the block, for a row layer after it).
        sequence_parallel: the layer's input is this rank's chunk of dim 0 (the sequence), all-gathered
            into the matmul around a ring (default False).
        algo: the sequence-parallel collectives: "ring" (fused, overlapped), "naive", "auto" (the default:
            the ring from the ``ring_min_elements`` switch's count per message); anything but "auto" needs
            ``sequence_parallel=True``.
        keep_gathered: False: gather the sequence-parallel input again in backward (less memory); default
            True: keep it from the forward. False needs ``sequence_parallel=True``.
        fuse: True: the fuse=True column layers of one parent module (q / k / v, gate / up) run as one
            product, so their shared input crosses the ranks once (``tpflow.layers.fused``); they need the same
            options and in_features (same bias or none and dtype too, and no ``gather_output``). A lone one
            under its parent stays alone. Default False.

    Example::

        >>> import tpflow as tpf
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> tpf.parallelize(model, placement=P, plan={                            # doctest: +SKIP
        ...     "*.[qkv]_proj": tpf.ColumnParallel(fuse=True),                    # q, k, v as one product
        ...     "*.o_proj": "row",
        ...     "*.fc1": tpf.ColumnParallel(sequence_parallel=True, keep_gathered=False),
        ...     "*.fc2": tpf.RowParallel(sequence_parallel=True),
        ... })
    """

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
    """Plan entry for a ``RowParallelLinear`` (``"row"`` is ``RowParallel()``).

    ``parallelize`` replaces each ``nn.Linear`` the entry's pattern matches with a ``RowParallelLinear``
    (W split(0)) holding its values, built with these options.

    Args:
        input_is_parallel: the layer's input is this rank's block of its input features, as a column layer
            returns it (default True); False: the whole input, the same on every rank.
        sequence_parallel: the output is this rank's chunk of dim 0 (the sequence), reduce-scattered from
            the matmul around a ring (default False: the whole y on every rank); needs
            ``input_is_parallel=True``.
        algo: the sequence-parallel collectives: "ring" (fused, overlapped), "naive", "auto" (the default:
            the ring from the ``ring_min_elements`` switch's count per message); anything but "auto" needs
            ``sequence_parallel=True``.

    Example::

        >>> import tpflow as tpf
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> tpf.parallelize(model, placement=P, plan={                            # doctest: +SKIP
        ...     "*.fc1": tpf.ColumnParallel(sequence_parallel=True),
        ...     "*.fc2": tpf.RowParallel(sequence_parallel=True, algo="ring"),
        ... })
    """

    layer = RowParallelLinear
    input_is_parallel: bool = True
    sequence_parallel: bool = False
    algo: str = "auto"  # the sequence-parallel collectives: "ring" (fused, overlapped), "naive", "auto"


_NAMED = {"column": ColumnParallel(), "row": RowParallel()}


def style_of(pattern: str, style: object) -> ColumnParallel | RowParallel:
    """The plan entry ``style`` as a ``ColumnParallel`` or ``RowParallel``: ``"column"`` and ``"row"`` name
    the default ones; anything else is a ValueError naming ``pattern``.

    Args:
        pattern: the plan's key for the entry, named in the error.
        style: the plan's value: ``"column"``, ``"row"``, a ``ColumnParallel`` or a ``RowParallel``.

    Returns:
        ``style`` itself if it is an entry already, else the one its name stands for.

    Example::

        >>> import tpflow as tpf
        >>> from tpflow.plans.styles import style_of
        >>> style_of("*.fc1", "column")
        ColumnParallel(gather_output=False, sequence_parallel=False, algo='auto', keep_gathered=True, fuse=False)
        >>> style_of("*.fc2", tpf.RowParallel(sequence_parallel=True))
        RowParallel(input_is_parallel=True, sequence_parallel=True, algo='auto')
    """
    if isinstance(style, (ColumnParallel, RowParallel)):
        return style
    if isinstance(style, str) and style in _NAMED:
        return _NAMED[style]
    raise ValueError(f"plan[{pattern!r}] must be 'column', 'row', tpf.ColumnParallel(...) or tpf.RowParallel(...), "
                     f"got {style!r}")
