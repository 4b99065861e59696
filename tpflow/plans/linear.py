"""Column and row entries: an ``nn.Linear`` swapped for a ``ColumnParallelLinear`` (W split(1)) or a
``RowParallelLinear`` (W split(0)) holding its values, each rank its block.

A column entry on an attention module's q / k / v projection also applies the attention heads' rules
(``tpflow.plans.heads``): the heads must split over the ranks; with fewer key/value heads than ranks the k / v
projections stay whole and each rank keeps its head; per-head parameters (gpt-oss's sinks) split with the heads.
Column entries with ``fuse=True`` under one parent run as one product (``tpflow.plans.fusion``).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from tpflow.layers import ColumnParallelLinear, ParallelLinear, RowParallelLinear
from tpflow.placement import Placement
from tpflow.plans import heads
from tpflow.plans.fusion import fused_groups, join_group
from tpflow.plans.mixers import is_attention
from tpflow.plans.style import Plan, Style

__all__ = ["ColumnParallel", "RowParallel"]

_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


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
        return self.layer.from_linear(module, placement=placement, **self._options())

    def _options(self) -> dict[str, object]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in self._plan_only}

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        if not heads.plain_linear(module):
            raise ValueError(f"plan pattern {plan.pattern(name)!r} matches {name!r}, a {type(module).__name__}, not an "
                             f"nn.Linear")
        self.layer.check_options(**self._options())

    def apply(self, name: str, module: nn.Module, plan: Plan) -> nn.Module | None:
        layer = self.build(module, plan.placement)
        layer.label = f"{type(layer).__name__} {name!r}"
        return layer

    @property
    def splits_sequence(self) -> bool:
        return self.sequence_parallel


@dataclasses.dataclass(frozen=True)
class ColumnParallel(_LinearEntry):
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
        sequence_dim: the dim sequence parallelism splits: 0 (default, ``[seq, batch, hidden]``) or 1
            (``[batch, seq, hidden]``, Hugging Face's models).
        fuse: True: the fuse=True column layers of one parent module (q / k / v, gate / up) run as one
            product, so their shared input crosses the ranks once (``tpflow.layers.fused``); they need the same
            options and in_features (same bias or none and dtype too, and no ``gather_output``). A lone one
            under its parent stays alone. Default False.

    Example::

        >>> import tpflow as tpf
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
    gather_output: bool = False
    sequence_parallel: bool = False
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

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        super().check(name, module, plan)
        attention = _attention(name, plan)
        if attention is not None and name.endswith("q_proj") and not heads.check(*attention, plan.world):
            for proj in ("k_proj", "v_proj"):
                entry = plan.entry(f"{attention[0]}.{proj}")
                if not isinstance(entry, ColumnParallel) or entry.sequence_parallel or entry.gather_output:
                    raise ValueError(f"{attention[0]!r} has {attention[1][1]} key/value heads for {plan.world} ranks, "
                                     f"so its {proj} stays whole on every rank and each keeps its head, which needs a "
                                     f"plain column entry (no sequence parallelism, no gather_output): use "
                                     f"{attention[1][1]} ranks or fewer, or plan it as tpf.ColumnParallel()")
        parent, _, child = name.rpartition(".")
        if child in _QUERIES and not self.gather_output and is_attention(plan.modules.get(parent)):
            _per_head_left_whole(parent, plan)
        if self.fuse:
            _fused(plan)

    def keeps_whole(self, name: str, plan: Plan) -> bool:
        """Whether the layer ``name`` stays whole, each rank computing its key/value head's columns (a k / v
        projection with fewer key/value heads than ranks), rather than split.

        Args:
            name: a module the entry matched.
            plan: the matched plan.

        Returns:
            True for a k / v projection kept whole.

        Example::

            >>> from transformers import LlamaConfig, LlamaForCausalLM
            >>> from tpflow.plans.matching import match
            >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
            ...                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1))
            >>> plan = match(model, tpf.placement("cpu", ranks=[0, 1]), "auto")
            >>> name = "model.layers.0.self_attn.k_proj"
            >>> plan.entry(name).keeps_whole(name, plan)                    # 1 key/value head, 2 ranks
            True
        """
        return _whole_head(name, plan)

    def apply(self, name: str, module: nn.Module, plan: Plan) -> nn.Module | None:
        parent, _, child = name.rpartition(".")
        attention = _attention(name, plan)
        if attention is not None and _whole_head(name, plan):
            heads.keep_head(module, plan.modules[parent], attention[1], plan.placement)
            plan.replicate_as(name, "partial")
            return None
        layer = super().apply(name, module, plan)
        if child in _QUERIES and not self.gather_output and is_attention(plan.modules.get(parent)):
            heads.split_per_head(plan.modules[parent], plan.placement)  # its queries' heads split: its own per head
            heads.reuse_kept_head(plan.modules[parent], plan.world)
        group = next((names for names in _fused(plan).values() if name in names), None)
        if group is not None:
            join_group(plan, parent, group)
        return layer


@dataclasses.dataclass(frozen=True)
class RowParallel(_LinearEntry):
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
        sequence_dim: the dim sequence parallelism splits: 0 (default, ``[seq, batch, hidden]``) or 1
            (``[batch, seq, hidden]``, Hugging Face's models).

    Example::

        >>> import tpflow as tpf
        >>> from torch import nn
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)                                            # the same model on every rank
        >>> model = nn.Sequential()
        >>> model.mlp = nn.Sequential()
        >>> model.mlp.fc1, model.mlp.act, model.mlp.fc2 = nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)
        >>> model = tpf.parallelize(model, placement=P, plan={
        ...     "*.fc1": tpf.ColumnParallel(sequence_parallel=True, keep_gathered=False),
        ...     "*.fc2": tpf.RowParallel(sequence_parallel=True, algo="ring"),
        ... })
        >>> model(torch.randn(4, 2, 16)).shape      # [seq, batch, hidden]: this rank's 4 of the 8 tokens in and out
        torch.Size([4, 2, 16])
    """

    layer = RowParallelLinear
    input_is_parallel: bool = True
    sequence_parallel: bool = False
    algo: str = "auto"  # the sequence-parallel collectives: "ring" (fused, overlapped), "naive", "auto"
    sequence_dim: int = 0  # 1 for batch-first activations ([batch, seq, hidden], Hugging Face's)

    def layout(self, module: nn.Module) -> dict[str, int | None]:
        return {"weight": 1, "bias": None}

    def reads_whole(self, module: nn.Module) -> bool:
        return not self.input_is_parallel


_QUERIES = ("q_proj", "q_b_proj")  # the projection that splits an attention's heads (MLA's from its latent)


def _per_head_left_whole(parent: str, plan: Plan) -> None:
    """Refuse an attention module whose queries split by heads beside a linear child that makes a value per head and
    is not split by heads (Doge's ``dt_proj``, a row layer): it would give every rank every head's values."""
    module = plan.modules[parent]
    counts = {getattr(module.config, key, None) for key in ("num_attention_heads", "num_key_value_heads")}
    for child, linear in module.named_children():
        entry = plan.entry(f"{parent}.{child}")
        if isinstance(linear, nn.Linear) and linear.out_features in counts and not isinstance(entry, ColumnParallel):
            raise ValueError(f"{parent!r}: its heads split over the ranks, and its {child!r} (an nn.Linear "
                             f"{'out of the plan' if entry is None else 'not split by heads'})"
                             f" makes a value per head, for every head: tpflow cannot give each rank its heads' "
                             f"share of it. Leave the attention whole (take its q / k / v / o entries out of the "
                             f"plan) or parallelize the model otherwise")


def _attention(name: str, plan: Plan) -> tuple[str, tuple[int, int, int]] | None:
    """The attention module whose q / k / v projection ``name`` is, with its head counts, where its q_proj is a
    column entry that keeps its output split (so its heads split over the ranks); None otherwise."""
    parent, _, child = name.rpartition(".")
    module = plan.modules.get(parent) if child in _PROJECTIONS else None
    counts = None if module is None else heads.attention_heads(module)
    queries = plan.entry(f"{parent}.q_proj")
    if counts is None or not isinstance(queries, ColumnParallel) or queries.gather_output:
        return None  # (gathered queries: every rank runs every head, k / v gathered too)
    return parent, counts


def _whole_head(name: str, plan: Plan) -> bool:
    """Whether ``name`` is a k / v projection kept whole, each rank its key/value head (fewer of them than ranks)."""
    attention = _attention(name, plan)
    return attention is not None and not name.endswith("q_proj") and not heads.check(*attention, plan.world)


def _fused(plan: Plan) -> dict[str, list[str]]:
    """The plan's fused column groups (its fuse=True column layers but the k / v projections kept whole)."""
    return plan.shared("fused", lambda: fused_groups(plan, {
        name: not entry.gather_output for name, (_, entry) in plan.matches.items()
        if isinstance(entry, ColumnParallel) and entry.fuse and not _whole_head(name, plan)}))
