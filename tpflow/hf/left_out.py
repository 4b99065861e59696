"""What a model's own tensor-parallel plan leaves out of its decoder layers: HunYuan-dense, DiffLlama and Emu3 ship a
plan naming the head alone, GraniteMoE's names its experts and not its attention, DeepSeek-V3's its MLP and not its
latent attention, the hybrids' no mixer. ``plan="auto"`` plans those parts as it plans a model that ships no plan
(``tpflow.hf.planner``), and says in the plan what still stays whole, and why.

- tpflow's entry for a module is added where no entry of the model's own plan reaches it (the module itself, one
  inside it or one around it): what the model's plan splits stays as it splits it, and a complete plan is unchanged;
- an attention module is split by heads only where the split can follow everything in it: no linear layer beside the
  projections the plan splits (AFMoE's output gate, a sink projection), no norm over several heads' features
  (DiffLlama's, over each pair of heads it subtracts, half the heads apart);
- a multi-head latent attention (MLA: ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj`` and ``q_b_proj`` or
  ``q_proj``) gets the entries DeepSeek-V2's own plan gives it, which the planner does not read;
- every part of a decoder layer (a child of an item of the model's stacks of layers) that holds a linear layer and that
  no entry reaches then gets a ``Replicated`` entry naming why it stays whole: an attention the split cannot follow, a
  token mixer tpflow does not split, a part it finds nothing to split in, or a model whose layers tpflow's planner
  cannot read.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Iterator

from torch import nn

from tpflow.hf.mixers import is_attention, layer_mixers
from tpflow.hf.planner import planned
from tpflow.hf.split_heads import SplitHeads, head_counts
from tpflow.plans.replicated import Replicated

__all__ = ["with_left_out"]

# MLA's projections as DeepSeek-V2's plan splits them (its latent query projection q_a_proj stays whole)
_LATENT = {"kv_a_proj_with_mqa": "mla_kv_a_proj", "kv_b_proj": "colwise", "o_proj": "rowwise"}
_LATENT_QUERIES = ("q_b_proj", "q_proj")
_LATENT_WHOLE = ("q_a_proj",)


def _inside(name: str, names: set[str]) -> bool:
    """Whether ``name`` is one of ``names``, inside one or around one."""
    return any(m == name or m.startswith(name + ".") or name.startswith(m + ".") for m in names)


def with_left_out(model: nn.Module, own: dict[str, object]) -> dict[str, object]:
    """``own``, the model's own plan, with the parts of its decoder layers it leaves out planned by tpflow's planner,
    and what still stays whole said by ``Replicated`` entries (see the module docstring).

    Args:
        model: a transformers model.
        own: its own plan, module patterns to entries or Hugging Face style names (``hf_plan`` reads it).

    Returns:
        A new plan: ``own``'s entries, then the added ones.

    Example::

        >>> from transformers import HunYuanDenseV1Config, HunYuanDenseV1ForCausalLM
        >>> model = HunYuanDenseV1ForCausalLM(HunYuanDenseV1Config(
        ...     vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        ...     num_key_value_heads=2, head_dim=4))
        >>> plan = with_left_out(model, {"lm_head": "colwise_gather_output"})    # its own: the head alone
        >>> plan["model.layers.*.self_attn.o_proj"], plan["model.layers.*.mlp.down_proj"]
        ('rowwise', 'rowwise')
    """
    names = [n for n, _ in model.named_modules()]
    reached = {n for p in own for n in names if fnmatch.fnmatchcase(n, p)}
    try:
        found, unread = planned(model), False
    except ValueError:  # its layers hold what the planner cannot read: what they leave whole is named below
        found, unread = {}, True
    added = {n: entry for pattern, entry in found.items() for n in names
             if fnmatch.fnmatchcase(n, pattern) and not _inside(n, reached)}
    refused = {}
    for name, entry in list(added.items()):
        why = _unfollowed(name, model.get_submodule(name), added) if isinstance(entry, SplitHeads) else None
        if why is not None:
            refused[name] = why
            added = {n: e for n, e in added.items() if not _inside(n, {name})}
    parts = list(_parts(model))
    for where, part, _ in parts:
        if not _inside(where, reached | set(added)):
            added.update(_latent_attention(where, part))
    whole = {where: Replicated(why=_why(where, mixer, refused, unread, type(model).__name__))
             for where, part, mixer in parts if not _inside(where, reached | set(added))
             and any(isinstance(m, nn.Linear) for m in part.modules())}
    return {**own, **_patterns(added, names), **_patterns(whole, names)}


def _parts(model: nn.Module) -> Iterator[tuple[str, nn.Module, str | None]]:
    """Each part of each decoder layer (a child of an item of the model's outermost ``nn.ModuleList`` s of layers
    holding linear layers): its name, itself, and what it is where it mixes tokens other than by attention."""
    stacks: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or not len(module) or any(name.startswith(s + ".") for s in stacks):
            continue
        if not any(isinstance(m, nn.Linear) for m in module[0].modules()):
            continue
        stacks.append(name)
        for index, layer in enumerate(module):
            mixers = dict(layer_mixers(layer))
            for child, part in layer.named_children():
                yield f"{name}.{index}.{child}", part, mixers.get(child)


def _why(where: str, mixer: str | None, refused: dict[str, str], unread: bool, model: str) -> str:
    """Why a part of a decoder layer no entry reaches stays whole."""
    said = next((why for name, why in refused.items() if why and _inside(name, {where})), None)
    if said or mixer:
        return said or f"{mixer}, which tpflow does not split"
    if unread:
        return f"the model's own plan leaves it out, and tpflow cannot read {model}'s layers"
    return "the model's own plan leaves it out, and tpflow finds nothing in it to split"


def _unfollowed(name: str, attention: nn.Module, added: dict[str, object]) -> str | None:
    """Why a split by heads cannot follow everything in ``attention`` (the planner's ``SplitHeads`` on it), or None."""
    if not is_attention(attention):
        return ""  # (a mixer the planner reads as attention: named as the mixer it is)
    kind = type(attention).__name__
    beside = [n for n, m in attention.named_modules() if isinstance(m, nn.Linear) and f"{name}.{n}" not in added]
    if beside:
        return (f"{kind} computes with {', '.join(beside)} beside the q / k / v and output projections a split by "
                f"heads divides, which tpflow cannot place")
    heads, _, width = head_counts(attention)
    for norm, m in attention.named_modules():
        shape = getattr(m, "normalized_shape", None) or getattr(getattr(m, "weight", None), "shape", None)
        if heads and width and "Norm" in type(m).__name__ and shape and math.prod(shape) > width // heads:
            return (f"{kind} norms {math.prod(shape) * heads // width} heads' features together ({norm}), which "
                    f"a split by heads may not keep on one rank")
    return None


def _latent_attention(name: str, module: nn.Module) -> dict[str, object]:
    """DeepSeek-V2's entries for ``module`` where it is a multi-head latent attention holding no other linear layer;
    else none."""
    query = next((q for q in _LATENT_QUERIES if isinstance(getattr(module, q, None), nn.Linear)), None)
    if query is None or not is_attention(module) or not all(isinstance(getattr(module, n, None), nn.Linear)
                                                            for n in _LATENT):
        return {}
    if any(isinstance(m, nn.Linear) and n not in (query, *_LATENT, *_LATENT_WHOLE) for n, m in module.named_modules()):
        return {}
    return {f"{name}.{n}": style for n, style in {query: "colwise", **_LATENT}.items()}


def _patterns(entries: dict[str, object], names: list[str]) -> dict[str, object]:
    """``{module name: entry}`` as patterns over the layers (``model.layers.*.mlp``) where every module a pattern
    matches has the same entry; by name where they differ."""
    out: dict[str, object] = {}
    for name, entry in entries.items():
        pattern = re.sub(r"\.\d+(?=\.|$)", ".*", name)
        alike = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        out[pattern if all(entries.get(n) == entry for n in alike) else name] = entry
    return out
