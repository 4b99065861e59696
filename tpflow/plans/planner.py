"""tpflow's own plan for a causal LM transformers ships none for (GPT-J, OPT, the BERT and BART families' decoders,
...): read off its module tree, so that ``plan="auto"`` splits it or names what it cannot split.

Each decoder layer (an item of the model's ``nn.ModuleList`` of layers) is read by roles:

- attention: a module with separate ``nn.Linear`` q / k / v projections (``q_proj`` / ``k_proj`` / ``v_proj``,
  ``query`` / ``key`` / ``value``, ...): column entries, which split its heads; its output projection (``o_proj``,
  ``out_proj``, ``dense``, or BERT's ``output.dense`` beside it): a row entry; the module itself a ``SplitHeads``
  entry, which checks that the heads split over the ranks and gives the module its rank's head counts (a module
  that views its projections by ``self.num_heads`` then reads its own);
- the MLP: ``nn.Linear`` layers named as up projections (``fc1``, ``fc_in``, ``c_fc``, ``up_proj`` / ``gate_proj``,
  ``dense_h_to_4h``, BERT's ``intermediate.dense``): column entries; as down projections (``fc2``, ``fc_out``,
  ``c_proj``, ``down_proj``, ``dense_4h_to_h``, BERT's ``output.dense``): row entries.

A q / k / v projection fused in one layer is split by whole heads where the module views it head by head (Persimmon,
GPT-NeoX-Japanese, Falcon: ``_BY_HEAD``), and as three blocks each split over the ranks where it is GPT-2's ``c_attn``
(as wide as three of its ``c_proj``'s inputs); GPT-2's transposed ``Conv1D`` layers take ``Conv1DParallel`` entries.
What it cannot split it refuses by name: other fused projections (GPT-BigCode's multi-query ``c_attn``, ``qkv_proj``,
``Wqkv``: a layout the plan cannot tell);
state-space and recurrent mixers (Mamba, RWKV, xLSTM); position biases made for every head outside the attention
(CPM-Ant's; ALiBi's ``alibi=`` is cut to the rank's heads); a layer with no attention it can read.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import inspect
import re

import torch
from torch import nn

from tpflow.plans.conv1d import Conv1DParallel
from tpflow.plans.heads import attention_heads
from tpflow.plans.style import Plan, Style

__all__ = ["SplitHeads", "planned"]

_QKV = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("query_proj", "key_proj", "value_proj"),
        ("Wq", "Wk", "Wv"), ("project_q", "project_k", "project_v"))
_OUT = ("o_proj", "out_proj", "dense", "Wo", "attention_out")
_UP = ("fc1", "fc_in", "c_fc", "up_proj", "gate_proj", "dense_h_to_4h", "intermediate.dense")
_DOWN = ("fc2", "fc_out", "c_proj", "down_proj", "dense_4h_to_h", "output.dense")
_FUSED = ("query_key_value", "c_attn", "qkv_proj", "Wqkv")
# fused q / k / v projections whose output the module views head by head ([heads, 3, head_dim], or Falcon's new
# architecture's [key/value heads, queries per key/value head + 2, head_dim]): a split by whole heads is a column split
_BY_HEAD = {"PersimmonAttention": "query_key_value", "GPTNeoXJapaneseAttention": "query_key_value",
            "FalconAttention": "query_key_value", "BloomAttention": "query_key_value"}
_HEADS = ("num_heads", "num_attention_heads", "n_heads", "n_head")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads")
_WIDTHS = ("embed_dim", "all_head_size", "inner_dim", "split_size", "hidden_size")  # heads x head_dim
_HEAD_DIMS = ("head_dim", "head_size", "attention_head_size")


def _layers(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The model's stacks of decoder layers: ``nn.ModuleList`` s of modules holding linear layers (or GPT-2's
    ``Conv1D``), not inside a vision or audio tower or another stack (a BERT-style model's ``encoder.layer`` is its
    decoder)."""
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or not len(module) or any(name.startswith(f + ".") for f, _ in found):
            continue
        if re.search(r"(^|\.)(vision|image|audio|visual)", name):
            continue
        if any(isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D" for m in module[0].modules()):
            found.append((name, module))
    return found


def _linear(module: object) -> bool:
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _width(module: nn.Module, side: str) -> int:
    """A linear layer's (or a transposed Conv1D's) ``"out"`` or ``"in"`` features."""
    if isinstance(module, nn.Linear):
        return module.out_features if side == "out" else module.in_features
    return module.weight.shape[1] if side == "out" else module.weight.shape[0]


def _column(module: nn.Module, parts: int = 1) -> object:
    return "colwise" if isinstance(module, nn.Linear) else Conv1DParallel("column", parts)


def _row(module: nn.Module) -> object:
    return "rowwise" if isinstance(module, nn.Linear) else Conv1DParallel("row")


def _attention(layer: nn.Module) -> list[tuple[str, dict[str, object], str | None]]:
    """Each attention module of a layer: its name in the layer, its q / k / v projections' entries by their names,
    and its output projection's name (relative to the layer), or None where it has none the plan can name."""
    found = []
    for name, module in layer.named_modules():
        triple = next((t for t in _QKV if all(isinstance(getattr(module, n, None), nn.Linear) for n in t)), None)
        columns = {n: "colwise" for n in triple} if triple else {}
        if not columns and _by_head(module) is not None:
            columns = {_by_head(module): "colwise"}
        fused, out = getattr(module, "c_attn", None), getattr(module, "c_proj", None)
        if not columns and _linear(fused) and _linear(out) and _width(fused, "out") == 3 * _width(out, "in"):
            columns = {"c_attn": _column(fused, 3)}  # GPT-2's q | k | v blocks, each split over the ranks
        if not columns:
            continue
        out = next((n for n in (*_OUT, "c_proj") if _linear(getattr(module, n, None))), None)
        prefix = f"{name}." if name else ""
        if out is not None:
            out = prefix + out
        else:  # BERT's: the attention's parent holds output.dense
            parent = name.rpartition(".")[0]
            holder = layer.get_submodule(parent) if parent else layer
            if isinstance(getattr(getattr(holder, "output", None), "dense", None), nn.Linear):
                out = f"{parent}.output.dense" if parent else "output.dense"
        found.append((name, columns, out))
    return found


def _mlp(layer: nn.Module, taken: set[str]) -> dict[str, object]:
    """The layer's MLP: its up projections (column) and down projections (row), where it has both."""
    linears = {n: m for n, m in layer.named_modules() if _linear(m) and n not in taken
               and not any(n.startswith(t + ".") for t in taken)}
    up = [n for n in linears if any(n == u or n.endswith("." + u) for u in _UP)]
    down = [n for n in linears if any(n == d or n.endswith("." + d) for d in _DOWN)]
    widths = {_width(linears[n], "out") for n in up}
    if not up or not down or widths != {_width(linears[n], "in") for n in down} or any(
            "Norm" in type(m).__name__ and getattr(m, "weight", None) is not None and m.weight.numel() in widths
            for m in layer.modules()):
        # no pair; a pair of other widths (a GLU fused in one up projection, then chunked); a norm over the whole
        # intermediate features (BitNet's): the MLP stays whole
        return {}
    return {**{n: _column(linears[n]) for n in up}, **{n: _row(linears[n]) for n in down}}


def _by_head(module: nn.Module) -> str | None:
    """The fused q / k / v projection of an attention module that views it head by head, or None."""
    fused = _BY_HEAD.get(type(module).__name__)
    if fused is None or not isinstance(getattr(module, fused, None), nn.Linear):
        return None
    config = getattr(module, "config", None)
    if getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False):
        return None  # Falcon's multi-query: [q heads | k | v], not by head
    return fused


def _refusal(model: nn.Module, layer: nn.Module, where: str) -> str | None:
    """What the plan cannot split in ``layer``, as a sentence, or None."""
    for name, module in layer.named_modules():
        fused = next((n for n in _FUSED if isinstance(getattr(module, n, None), nn.Module)), None)
        if fused is not None and _by_head(module) is None and not _attention(module):
            return (f"{where}.{name}.{fused} projects q / k / v in one layer, whose layout (by head, or q | k | v) "
                    f"tpflow cannot tell")
    for name, module in layer.named_modules():
        given = set(inspect.signature(module.forward).parameters) & {"position_bias"}  # (ALiBi: cut to its heads)
        if given and (_attention_of(module) or _by_head(module) is not None):
            return (f"{where}.{name} takes a bias for every head made outside it ({', '.join(sorted(given))}), which "
                    f"the plan cannot cut to its rank's heads")
    return None


def _attention_of(module: nn.Module) -> bool:
    return any(all(isinstance(getattr(module, n, None), nn.Linear) for n in t) for t in _QKV)


def planned(model: nn.Module) -> dict[str, object]:
    """tpflow's own plan for ``model``, read off its module tree (module patterns mapped to entries or Hugging Face
    style names); a ValueError naming what it cannot split.

    Args:
        model: a causal LM transformers ships no tensor-parallel plan for.

    Returns:
        The plan (its attention and MLP layers; ``hf_plan`` adds the vocabulary's).

    Example::

        >>> from transformers import OPTConfig, OPTForCausalLM
        >>> model = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=16, ffn_dim=32, num_hidden_layers=1,
        ...                                  num_attention_heads=4, word_embed_proj_dim=16))
        >>> sorted(planned(model).items())[:3]
        [('model.decoder.layers.*.fc1', 'colwise'), ('model.decoder.layers.*.fc2', 'rowwise'), \
('model.decoder.layers.*.self_attn', SplitHeads())]
    """
    stacks = _layers(model)
    if not stacks:
        raise ValueError(f"{type(model).__name__} has no decoder layers tpflow can read (an nn.ModuleList of layers "
                         f"with linear layers)")
    plan: dict[str, object] = {}
    for name, layers in stacks:
        for index, layer in enumerate(layers):
            where = f"{name}.{index}"
            why = _refusal(model, layer, where)
            attention = _attention(layer)
            if why is None and not attention:
                why = (f"{where} ({type(layer).__name__}) has no attention with separate q / k / v linear layers "
                       f"(a state space, a recurrence, or projections tpflow cannot name)")
            if why is not None:
                raise ValueError(f"{type(model).__name__} carries no tensor-parallel plan, and tpflow cannot plan it "
                                 f"from its modules: {why}. Pass plan={{pattern: style}} to parallelize, or train it "
                                 f"with data parallelism")
            taken = set()  # (each layer's own names: BERT's output.dense is its MLP's, attention.output.dense not)
            for attn, columns, out in attention:
                taken.update(f"{attn}.{proj}" if attn else proj for proj in columns)
                if out is not None:
                    taken.add(out)
                module = layer.get_submodule(attn) if attn else layer
                if out is None or _whole_width(module, _width(layer.get_submodule(out), "in")):
                    continue  # a norm over every head's features (BitNet's): the attention stays whole
                prefix = f"{where}.{attn}" if attn else where
                plan[prefix] = SplitHeads()
                plan.update({f"{prefix}.{proj}": style for proj, style in columns.items()})
                plan[f"{where}.{out}"] = _row(layer.get_submodule(out))
            plan.update({f"{where}.{n}": style for n, style in _mlp(layer, taken).items()})
    if not plan:
        raise ValueError(f"{type(model).__name__} carries no tensor-parallel plan, and tpflow finds nothing in its "
                         f"layers it can split (attention normed over every head, no MLP it can name)")
    return _patterns(model, plan, [name for name, _ in stacks])


def _patterns(model: nn.Module, plan: dict[str, object], stacks: list[str]) -> dict[str, object]:
    """Each layer's names as one pattern over the layers (``layers.*.fc1``) where the pattern matches those names
    alone (BERT's ``layer.*.output.dense`` would match ``attention.output.dense`` too: those stay per layer)."""
    names = [n for n, _ in model.named_modules()]
    grouped: dict[str, list[str]] = {}
    for name in plan:
        stack = next(s for s in stacks if name.startswith(s + "."))
        grouped.setdefault(f"{stack}.*.{name[len(stack) + 1:].partition('.')[2]}".rstrip("."), []).append(name)
    out: dict[str, object] = {}
    for pattern, members in grouped.items():
        styles = {repr(plan[m]) for m in members}
        if len(styles) == 1 and {n for n in names if fnmatch.fnmatchcase(n, pattern)} == set(members):
            out[pattern] = plan[members[0]]
        else:
            out.update({m: plan[m] for m in members})
    return out


def _whole_width(attention: nn.Module, width: int) -> bool:
    """Whether a norm inside the attention works on every head's features at once (its weight as wide as the
    heads' output), which a rank holding its heads cannot compute."""
    return any("Norm" in type(m).__name__ and getattr(m, "weight", None) is not None and m.weight.numel() == width
               for m in attention.modules())


@dataclasses.dataclass(frozen=True)
class SplitHeads(Style):
    """Plan entry for an attention module whose q / k / v are column layers: its heads must split over the
    tensor-parallel ranks, and its head counts (``num_heads``, ``num_key_value_heads``, ``embed_dim``, ...) become
    its rank's, so that code viewing its projections by them reads this rank's heads.

    Example::

        >>> from transformers import OPTConfig, OPTForCausalLM
        >>> model = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=16, ffn_dim=32, num_hidden_layers=1,
        ...                                  num_attention_heads=4, word_embed_proj_dim=16))
        >>> model = tpf.parallelize(model, placement=tpf.placement("cpu", ranks=[0, 1]), plan="auto")
        >>> model.model.decoder.layers[0].self_attn.num_heads                  # this rank's 2 of 4
        2
    """

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        heads, kv, _ = _counts(module)
        if heads is None:
            raise ValueError(f"{name!r}: SplitHeads needs the module's head count (one of {_HEADS})")
        for count, what in ((heads, "attention heads"), (kv, "key/value heads")):
            if count % plan.world and not (count == kv and _keeps_heads(module, plan.world)):
                raise ValueError(f"{name!r} has {count} {what}, which do not split over {plan.world} tensor-parallel "
                                 f"ranks: use a degree that divides them")

    def apply(self, name: str, module: nn.Module, plan: Plan) -> None:
        heads, kv, width = _counts(module)
        world = plan.world
        for attr in _HEADS:
            if getattr(module, attr, None) == heads:
                setattr(module, attr, heads // world)
        for attr in _KV_HEADS:  # (fewer than the ranks: each rank keeps its one key/value head whole)
            if getattr(module, attr, None) == kv:
                setattr(module, attr, max(kv // world, 1))
        for attr in _WIDTHS:
            if width is not None and getattr(module, attr, None) == width:
                setattr(module, attr, width // world)
        module.forward = _OnRankHeads(module, name)
        if "alibi" in inspect.signature(type(module).forward).parameters and plan.placement.coordinate() is not None:
            module.register_forward_pre_hook(_RankAlibi(heads, world, plan.placement.coordinate()[-1]),
                                             with_kwargs=True)


@dataclasses.dataclass(frozen=True)
class _RankAlibi:
    """This rank's heads' rows of the ALiBi biases the model made for every head (transformers' ``[batch x heads,
    1, keys]``, BLOOM's and Falcon's), passed to the attention as ``alibi=``."""

    heads: int
    world: int
    rank: int

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        alibi = kwargs.get("alibi")
        if not isinstance(alibi, torch.Tensor):
            return None
        per_rank = self.heads // self.world
        by_head = alibi.unflatten(0, (-1, self.heads))[:, self.rank * per_rank:(self.rank + 1) * per_rank]
        return args, {**kwargs, "alibi": by_head.flatten(0, 1)}


def _keeps_heads(module: nn.Module, world: int) -> bool:
    """Whether the column entries of a q_proj / k_proj / v_proj attention keep its k / v whole with fewer key/value
    heads than ranks, each rank its head (``tpflow.plans.heads``)."""
    counts = attention_heads(module)
    return counts is not None and world % counts[1] == 0


class _OnRankHeads:
    """An attention module's forward on this rank's heads: a shape error there (code that reshapes by its input's
    whole width, which no head count says) becomes a sentence naming the module and the way out."""

    def __init__(self, module: nn.Module, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args, **kwargs):
        try:
            return type(self.module).forward(self.module, *args, **kwargs)
        except RuntimeError as e:
            raise ValueError(f"{self.name!r} ({type(self.module).__name__}) failed on this rank's heads ({e}): its "
                             f"code computes with a width tpflow cannot give it its rank's share of (its input's). "
                             f"Leave "
                             f"its q / k / v / output projections out of the plan, or parallelize the model "
                             f"otherwise") from e


def _counts(module: nn.Module) -> tuple[int | None, int | None, int | None]:
    """An attention module's ``(heads, key/value heads, heads x head_dim)``, from its own attributes."""
    config = getattr(module, "config", None)  # a module that keeps no count of its own reads its config's
    heads = next((getattr(m, a) for m in (module, config) for a in _HEADS if isinstance(getattr(m, a, None), int)),
                 None)
    kv = next((getattr(m, a) for m in (module, config) for a in _KV_HEADS if isinstance(getattr(m, a, None), int)),
              heads)
    head_dim = next((getattr(module, a) for a in _HEAD_DIMS if isinstance(getattr(module, a, None), int)), None)
    triple = next((t for t in _QKV if all(isinstance(getattr(module, n, None), nn.Linear) for n in t)), None)
    width = getattr(module, triple[0]).out_features if triple else None
    if width is None and heads is not None and head_dim is not None:
        width = heads * head_dim
    if width is None and _linear(getattr(module, "c_attn", None)):  # GPT-2's q | k | v blocks
        width = _width(module.c_attn, "out") // 3
    return heads, kv, width
