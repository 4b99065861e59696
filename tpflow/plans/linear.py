"""Column and row entries: an ``nn.Linear`` swapped for a ``ColumnParallelLinear`` (W split(1)) or a
``RowParallelLinear`` (W split(0)) holding its values, each rank its block.

A style touches only its own module: what an attention's heads need of its projections (heads split over the ranks,
a key/value head kept whole) is the attention's own entry's (the Hugging Face wing's ``SplitHeads``). Column entries
with ``fuse=True`` under one parent run as one product (``tpflow.plans.fusion``).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from tpflow.layers import ColumnParallelLinear, ParallelLinear, RowParallelLinear
from tpflow.placement import Placement
from tpflow.plans.fusion import fused_groups, join_group
from tpflow.plans.style import Plan, Style

__all__ = ["LINEAR_FORMS", "ColumnParallel", "RowParallel", "plain_linear"]

# nn.Linear subclasses whose forward is F.linear written out, by class name, which a column or row layer may replace
# (a wing adds its models': Falcon's FalconLinear)
LINEAR_FORMS: set[str] = set()


def plain_linear(module: nn.Module) -> bool:
    """Whether ``module`` computes ``F.linear`` of its weight and bias: an ``nn.Linear``, or a subclass named in
    ``LINEAR_FORMS``, which a column or row layer may replace.

    Args:
        module: any module.

    Returns:
        True or False.

    Example::

        >>> plain_linear(nn.Linear(2, 3)), plain_linear(nn.Conv1d(2, 3, 1))
        (True, False)
    """
    return type(module) is nn.Linear or (isinstance(module, nn.Linear) and type(module).__name__ in LINEAR_FORMS)


class _LinearEntry(Style):
    """What column and row entries share: the ``nn.Linear`` they take and the layer they build from it (the entry's
    fields are its ``from_linear`` options, less those only the plan reads)."""

    layer: type[ParallelLinear]
    _plan_only: tuple[str, ...] = ()  # fields the plan reads, not the layer

    def build(self, module: nn.Linear, placement: Placement) -> ParallelLinear:
        """The parallel layer holding ``module``'s values, with this entry's options.

        Args:
            module: the ``nn.Linear``.
            placement: the ranks; the last axis is tensor parallel.

        Returns:
            A ``ColumnParallelLinear`` or a ``RowParallelLinear``.

        Example::

            >>> P = tpf.placement("cpu", ranks=[0, 1])
            >>> fc2 = tpf.RowParallel(sequence_parallel=True).build(nn.Linear(2048, 512), P)
            >>> type(fc2).__name__, fc2.sequence_parallel
            ('RowParallelLinear', True)
        """
        return self.layer.from_linear(module, placement=placement, **self.options())

    def options(self) -> dict[str, object]:
        """The options the layer is built with: the entry's fields, less those only the plan reads (what layers
        fused into one product must share)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in self._plan_only}

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        if not plain_linear(module):
            raise ValueError(f"plan pattern {plan.pattern(name)!r} matches {name!r}, a {type(module).__name__}, not an "
                             f"nn.Linear")
        self.layer.check_options(**self.options())

    def apply(self, name: str, module: nn.Module, plan: Plan) -> nn.Module | None:
        layer = self.build(module, plan.placement)
        layer.label = f"{type(layer).__name__} {name!r}"
        return layer

    @property
    def splits_sequence(self) -> bool:
        return self.sequence_parallel


@ColumnParallelLinear.layouts.said_in_sbp  # input_sbp= / output_sbp=, stored as the flags they stand for
@dataclasses.dataclass(frozen=True)
class ColumnParallel(_LinearEntry):
    """Plan style for a ``ColumnParallelLinear`` (``"column"`` is ``ColumnParallel()``).

    ``parallelize`` replaces each ``nn.Linear`` the entry's pattern matches with a ``ColumnParallelLinear``
    (W split(1)) holding its values, built with these options. The entry stores the layouts as the older flags
    (its ``repr``, ``dataclasses.replace`` and ``asdict`` show them), and reads ``input_sbp`` / ``output_sbp`` back.

    Args:
        input_sbp: the layer's input over the ranks: ``sbp.broadcast`` (the default: whole) or, for sequence
            parallelism, ``sbp.split(0)`` / ``sbp.split(1)`` (this rank's chunk of the sequence dim of ``[seq,
            batch, hidden]`` / Hugging Face's ``[batch, seq, hidden]``, all-gathered into the matmul around a
            ring).
        output_sbp: the layer's output: ``sbp.split(-1)`` (the default: this rank's block of the features, for a
            row layer after it) or ``sbp.broadcast`` (the features all-gathered: the whole y on every rank).
        algo: the sequence-parallel collectives: "ring" (fused, overlapped), "naive", "auto" (the default:
            the ring from the ``ring_min_elements`` switch's count per message); anything but "auto" needs
            sequence parallelism.
        keep_gathered: False: gather the sequence-parallel input again in backward (less memory); default
            True: keep it from the forward. False needs sequence parallelism.
        fuse: True: the fuse=True column layers of one parent module (q / k / v, gate / up) run as one
            product, so their shared input crosses the ranks once (``tpflow.layers.fused``); they need the same
            options and in_features (same bias or none and dtype too, and no whole output). A lone one
            under its parent stays alone. Default False.
        gather_output: alias of ``output_sbp``: True is ``sbp.broadcast``, False (default) ``sbp.split(-1)``.
        sequence_parallel, sequence_dim: aliases of ``input_sbp``: ``sequence_parallel=True, sequence_dim=d`` is
            ``sbp.split(d)``; False (default) is ``sbp.broadcast``.

    Example::

        >>> import tpflow as tpf
        >>> tpf.ColumnParallel(output_sbp=tpf.sbp.broadcast)                    # stored as the older flags
        ColumnParallel(gather_output=True, sequence_parallel=False, algo='auto', keep_gathered=True, \
sequence_dim=0, fuse=False)
        >>> tpf.ColumnParallel(sequence_parallel=True, sequence_dim=1).input_sbp
        sbp.split(dim=1)
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)                                            # the same model on every rank
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
        ...                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        >>> model = tpf.parallelize(model, placement=P, plan={
        ...     "*.[qkv]_proj": tpf.ColumnParallel(fuse=True),                    # q, k, v as one product
        ...     "*.o_proj": "row",
        ...     "*.mlp.[gu]*_proj": tpf.ColumnParallel(fuse=True),                # gate, up as one product
        ...     "*.down_proj": "row",
        ... })
        >>> attn = model.model.layers[0].self_attn
        >>> attn.q_proj.fused_group is attn.v_proj.fused_group
        True
        >>> model(torch.randint(0, 64, (2, 8))).logits.shape
        torch.Size([2, 8, 64])
    """

    layer = ColumnParallelLinear
    gather_output: bool = False  # output_sbp=sbp.broadcast (True) or sbp.split(-1)
    sequence_parallel: bool = False  # with sequence_dim: input_sbp=sbp.split(sequence_dim) (True) or sbp.broadcast
    algo: str = "auto"  # the sequence-parallel collectives: "ring" (fused, overlapped), "naive", "auto"
    keep_gathered: bool = True  # False: gather the sequence-parallel input again in backward (less memory)
    sequence_dim: int = 0  # 1 for batch-first activations ([batch, seq, hidden], Hugging Face's)
    # True: the fuse=True column layers of one parent module (q / k / v, gate / up) run as one product, so their
    # shared input crosses the ranks once (tpflow.layers.fused); they need the same options and in_features
    fuse: bool = False
    _plan_only = ("fuse",)

    def layout(self, module: nn.Module) -> dict[str, int | None]:
        return {"weight": 0, "bias": 0}

    def reads_whole(self, module: nn.Module) -> bool:
        return not self.sequence_parallel

    @property
    def splits_features(self) -> bool:
        return not self.gather_output

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        super().check(name, module, plan)
        if self.fuse:
            _fused(plan)

    def apply(self, name: str, module: nn.Module, plan: Plan) -> nn.Module | None:
        layer = super().apply(name, module, plan)
        group = next((names for names in _fused(plan).values() if name in names), None)
        if group is not None:
            join_group(plan, name.rpartition(".")[0], group)
        return layer


@RowParallelLinear.layouts.said_in_sbp  # input_sbp= / output_sbp=, stored as the flags they stand for
@dataclasses.dataclass(frozen=True)
class RowParallel(_LinearEntry):
    """Plan style for a ``RowParallelLinear`` (``"row"`` is ``RowParallel()``).

    ``parallelize`` replaces each ``nn.Linear`` the entry's pattern matches with a ``RowParallelLinear``
    (W split(0)) holding its values, built with these options. The entry stores the layouts as the older flags
    (its ``repr``, ``dataclasses.replace`` and ``asdict`` show them), and reads ``input_sbp`` / ``output_sbp`` back.

    Args:
        input_sbp: the layer's input over the ranks: ``sbp.split(-1)`` (the default: this rank's block of its
            input features, as a column layer returns it) or ``sbp.broadcast`` (the whole input, the same on
            every rank).
        output_sbp: the layer's output: ``sbp.broadcast`` (the default: the whole y on every rank) or, for
            sequence parallelism, ``sbp.split(0)`` / ``sbp.split(1)`` (this rank's chunk of the sequence dim of
            ``[seq, batch, hidden]`` / Hugging Face's ``[batch, seq, hidden]``, reduce-scattered from the matmul
            around a ring); needs ``input_sbp=sbp.split(-1)``.
        algo: the sequence-parallel collectives: "ring" (fused, overlapped), "naive", "auto" (the default:
            the ring from the ``ring_min_elements`` switch's count per message); anything but "auto" needs
            sequence parallelism.
        input_is_parallel: alias of ``input_sbp``: True (default) is ``sbp.split(-1)``, False ``sbp.broadcast``.
        sequence_parallel, sequence_dim: aliases of ``output_sbp``: ``sequence_parallel=True, sequence_dim=d`` is
            ``sbp.split(d)``; False (default) is ``sbp.broadcast``.

    Example::

        >>> import tpflow as tpf
        >>> from torch import nn
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)                                            # the same model on every rank
        >>> model = nn.Sequential()
        >>> model.mlp = nn.Sequential()
        >>> model.mlp.fc1, model.mlp.act, model.mlp.fc2 = nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)
        >>> model = tpf.parallelize(model, placement=P, plan={
        ...     "*.fc1": tpf.ColumnParallel(input_sbp=tpf.sbp.split(0), keep_gathered=False),
        ...     "*.fc2": tpf.RowParallel(output_sbp=tpf.sbp.split(0), algo="ring"),
        ... })
        >>> model(torch.randn(4, 2, 16)).shape      # [seq, batch, hidden]: this rank's 4 of the 8 tokens in and out
        torch.Size([4, 2, 16])
    """

    layer = RowParallelLinear
    input_is_parallel: bool = True  # input_sbp=sbp.split(-1) (True) or sbp.broadcast
    sequence_parallel: bool = False  # with sequence_dim: output_sbp=sbp.split(sequence_dim) (True) or sbp.broadcast
    algo: str = "auto"  # the sequence-parallel collectives: "ring" (fused, overlapped), "naive", "auto"
    sequence_dim: int = 0  # 1 for batch-first activations ([batch, seq, hidden], Hugging Face's)

    def layout(self, module: nn.Module) -> dict[str, int | None]:
        return {"weight": 1, "bias": None}

    def reads_whole(self, module: nn.Module) -> bool:
        return not self.input_is_parallel


def _fused(plan: Plan) -> dict[str, list[str]]:
    """The plan's fused column groups: its column entries with fuse=True, but those that keep their module whole."""
    return plan.shared("fused", lambda: fused_groups(plan, {
        name: entry.splits_features for name, (_, entry) in plan.matches.items()
        if isinstance(entry, ColumnParallel) and entry.fuse and not entry.keeps_whole(name, plan)}))
