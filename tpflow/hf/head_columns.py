"""An attention's heads in a plan: the entries that split a Hugging Face attention by heads, written where its queries
split.

A column layer gives each rank a block of an attention's query / key / value features, so the attention must read
them as its rank's heads (``SplitHeads`` on the attention module: its head counts, its per-head parameters), and a
projection with fewer heads than ranks must stay whole, each rank computing its own head (``HeadColumns`` on the
projection). Each entry touches only its own module; ``with_heads`` writes them into a plan, for ``hf_plan``'s and
for a plan of the user's own alike.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re

from torch import nn

from tpflow.hf.heads import attention_heads, keep_columns
from tpflow.hf.mixers import is_attention
from tpflow.hf.split_heads import SplitHeads
from tpflow.layers import ColumnParallelLinear
from tpflow.plans.linear import ColumnParallel
from tpflow.plans.names import style_of
from tpflow.plans.style import Plan, Stacked, Style
from tpflow.plans.torch_styles import is_torch_style

__all__ = ["HeadColumns", "with_heads"]

_QUERIES = ("q_proj", "q_b_proj")  # the projection that splits an attention's heads (MLA's from its latent)
_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


@ColumnParallelLinear.layouts.said_in_sbp
@dataclasses.dataclass(frozen=True)
class HeadColumns(ColumnParallel):
    """Plan style for an attention's q / k / v projection: a column layer over whole heads of ``head_dim`` features;
    a projection with fewer heads than ranks (a key/value projection, the degree a multiple of its heads) stays whole
    on every rank instead, each rank computing its own head's features, its gradients summed over the ranks.

    Args:
        head_dim: the features of one head.
        (the rest): ``tpf.ColumnParallel``'s options.

    Example::

        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
        ...                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1))
        >>> model = tpf.parallelize(model, placement=tpf.placement("cpu", ranks=[0, 1]), plan="auto")
        >>> attention = model.model.layers[0].self_attn
        >>> type(attention.q_proj).__name__, type(attention.k_proj).__name__    # 1 key/value head, 2 ranks
        ('ColumnParallelLinear', 'Linear')
    """

    head_dim: int = 0
    _plan_only = ("fuse", "head_dim")

    def __post_init__(self) -> None:
        if self.head_dim < 1:
            raise ValueError(f"HeadColumns needs head_dim, the features of one head, got {self.head_dim}")

    def _heads(self, module: nn.Module) -> int:
        return module.out_features // self.head_dim

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        super().check(name, module, plan)
        heads, world = self._heads(module), plan.world
        if heads % world and world % heads:
            degrees = [d for d in range(1, heads + 1) if heads % d == 0]
            raise ValueError(f"{name!r} makes {heads} heads, which do not split over {world} tensor-parallel ranks, "
                             f"nor does each rank keep whole ones: use a degree of {degrees} (or a multiple of "
                             f"{heads} for key/value heads), or leave the attention's q / k / v / o out of the plan")
        if heads % world and (self.sequence_parallel or self.gather_output):
            raise ValueError(f"{name!r} has {heads} key/value heads for {world} ranks, so it stays whole on every "
                             f"rank and each keeps its head, which needs a plain column entry (no sequence "
                             f"parallelism, no gather_output): use {heads} ranks or fewer, or plan it as "
                             f"tpf.ColumnParallel()")

    def keeps_whole(self, name: str, plan: Plan) -> bool:
        return self._heads(plan.modules[name]) % plan.world != 0

    def apply(self, name: str, module: nn.Module, plan: Plan) -> nn.Module | None:
        if not self.keeps_whole(name, plan):
            return super().apply(name, module, plan)
        world, coord = plan.world, plan.placement.coordinate()
        if coord is not None:
            head = coord[-1] // (world // self._heads(module))
            keep_columns(module, [(head * self.head_dim, (head + 1) * self.head_dim)], plan.placement)
        plan.replicate_as(name, "partial")
        return None


def with_heads(model: nn.Module, plan: dict[str, object]) -> dict[str, object]:
    """``plan`` with its attentions' heads said: every attention module whose query projection the plan splits by its
    output features gets ``SplitHeads`` (stacked with an entry it has: ``GatherSequence``, ``ContextParallel``), and
    the q / k / v projections of one with ``head_dim`` and separate projections get ``HeadColumns`` of their
    column entries. A pattern that also matches other modules is written out by name for the ones changed.

    Args:
        model: the model the plan is for.
        plan: patterns mapped to entries (names already read as entries; torch's styles are read here).

    Returns:
        The plan with the heads' entries, in the same order (the attentions it had none for first).

    Example::

        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
        ...                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        >>> plan = with_heads(model, {"model.layers.*.self_attn.[qkv]_proj": "column", "*.o_proj": "row"})
        >>> plan["model.layers.*.self_attn"], plan["model.layers.*.self_attn.[qkv]_proj"].head_dim
        (SplitHeads(groups=1), 4)
    """
    modules = dict(model.named_modules())
    plan = {p: (style_of(p, v) if isinstance(v, str) else v) for p, v in plan.items()}
    found = _Found(plan, modules)
    split = [name for name, module in modules.items() if is_attention(module)
             and any(found.splits(f"{name}.{q}") for q in _QUERIES if f"{name}.{q}" in modules)]
    columns: dict[str, Style] = {}
    for name in split:
        counts = attention_heads(modules[name])
        if counts is not None:
            for proj in _PROJECTIONS:
                entry = found.entry(f"{name}.{proj}")[1]
                if entry is not None and entry.splits_features and type(entry) is ColumnParallel:
                    columns[f"{name}.{proj}"] = HeadColumns(**dataclasses.asdict(entry), head_dim=counts[2])
    for name in split:
        _, own = found.entry(name)
        if own is None:
            columns[name] = SplitHeads()
        elif not any(type(p) is SplitHeads for p in own.styles):
            columns[name] = Stacked((SplitHeads(), *own.styles))
    return found.rewritten(columns)


class _Found:
    """Each module's pattern and entry in a plan, and the plan rewritten with new entries for some modules."""

    def __init__(self, plan: dict[str, object], modules: dict[str, nn.Module]) -> None:
        self.plan, self.modules = plan, modules
        self.names = {p: [n for n in modules if n and fnmatch.fnmatchcase(n, p)] for p in plan}

    def entry(self, name: str) -> tuple[str | None, Style | None]:
        pattern = next((p for p, names in self.names.items() if name in names), None)
        value = None if pattern is None else self.plan[pattern]
        if is_torch_style(value):
            value = style_of(pattern, value, self.modules[name])
        return pattern, value

    def splits(self, name: str) -> bool:
        entry = self.entry(name)[1]
        return entry is not None and entry.splits_features

    def rewritten(self, changed: dict[str, Style]) -> dict[str, object]:
        new: dict[str, object] = {}
        for name, entry in changed.items():  # modules the plan had no entry for, by their layers' pattern, first
            if self.entry(name)[0] is None:  # (an attention checked before its projections)
                pattern = re.sub(r"\.\d+(?=\.|$)", ".*", name)
                alike = [n for n in self.modules if n and fnmatch.fnmatchcase(n, pattern)]
                if all(changed.get(n) == entry and self.entry(n)[0] is None for n in alike):
                    new[pattern] = entry
                else:
                    new[name] = entry
        out: dict[str, object] = dict(new)
        for pattern, value in self.plan.items():
            names = self.names[pattern]
            kinds = {changed[n] for n in names if n in changed}
            if not kinds:
                out[pattern] = value
            elif len(kinds) == 1 and all(n in changed for n in names):
                out[pattern] = kinds.pop()  # every module the pattern matches changed alike
            else:
                out.update({n: changed.get(n, value) for n in names})
        return out
