"""tpflow's own plan for a causal LM transformers ships none for (GPT-J, OPT, Falcon, MPT, Mamba, the BERT and BART
families' decoders, ...): read off its module tree, so that ``plan="auto"`` splits it or names what it cannot split.

Each decoder layer (an item of the model's ``nn.ModuleList`` of layers) is read by roles:

- attention: a module with separate ``nn.Linear`` q / k / v projections (``q_proj`` / ``k_proj`` / ``v_proj``,
  ``query`` / ``key`` / ``value``, ...): column entries, which split its heads; its output projection (``o_proj``,
  ``out_proj``, ``dense``, or BERT's ``output.dense`` beside it): a row entry; the module itself a ``SplitHeads``
  entry, which checks that the heads split over the ranks and gives the module its rank's head counts (a module
  that views its projections by ``self.num_heads`` then reads its own);
- the MLP: ``nn.Linear`` layers named as up projections (``fc1``, ``fc_in``, ``c_fc``, ``up_proj`` / ``gate_proj``,
  ``dense_h_to_4h``, BERT's ``intermediate.dense``): column entries; as down projections (``fc2``, ``fc_out``,
  ``c_proj``, ``down_proj``, ``dense_4h_to_h``, BERT's ``output.dense``): row entries;
- a token mixer tpflow splits (``tpflow.hf.mixer_styles``: Mamba-2's, by heads): its style; any other state space
  or recurrence (RWKV's time mixing, RecurrentGemma's recurrent block): whole on every rank, a ``Replicated`` entry
  saying why.

A q / k / v projection fused in one layer is split by its layout:

- by whole heads where the module views it head by head (Persimmon, GPT-NeoX-Japanese, BLOOM, Falcon's
  ``new_decoder_architecture``: ``_BY_HEAD``): a column entry;
- as blocks each split over the ranks (``BlocksParallel`` / ``Conv1DParallel``) where the module chunks it: GPT-2's
  ``c_attn`` (as wide as three of its ``c_proj``'s inputs), MPT's ``Wqkv``, CodeGen's ``qkv_proj`` (four
  model-parallel blocks of q | v | k, its ``out_proj`` reading the heads in that order);
- multi-query (GPT-BigCode, Falcon: one key/value head): ``MultiQueryColumns``.

What it cannot split it refuses by name: another fused projection (a layout the plan cannot tell); attention it
cannot read, or a token mixer it does not know; a layer with neither attention nor an MLP.
"""

from __future__ import annotations

import fnmatch
import re

from torch import nn

from tpflow.hf.in_place import BlocksParallel, Conv1DParallel
from tpflow.hf.mixer_styles import mixers_within
from tpflow.hf.mixers import UNKNOWN, is_attention, layer_mixers
from tpflow.hf.multi_query import MultiQueryColumns
from tpflow.hf.split_heads import QKV, SplitHeads, head_counts
from tpflow.plans.replicated import Replicated

__all__ = ["planned"]

_OUT = ("o_proj", "out_proj", "dense", "Wo", "attention_out", "out_lin")
_UP = ("fc1", "fc_in", "c_fc", "up_proj", "gate_proj", "dense_h_to_4h", "intermediate.dense", "lin1", "w1", "w3",
       "proj_up_gate", "proj_up")  # (LFM2's w1 / w3 / w2, xLSTM's proj_up_gate / proj_up / proj_down)
_DOWN = ("fc2", "fc_out", "c_proj", "down_proj", "dense_4h_to_h", "output.dense", "lin2", "w2", "proj_down")
_FUSED = ("query_key_value", "c_attn", "qkv_proj", "Wqkv")
# gate and up fused in one layer, chunked in halves, and the down projection reading their product (Granite-4.0-H's
# shared MLP, ModernBERT's, Zamba2's)
_GLU = {"input_linear": "output_linear", "Wi": "Wo", "gate_up_proj": "down_proj"}
# fused q / k / v projections whose output the module views head by head ([heads, 3, head_dim], or Falcon's new
# architecture's [key/value heads, queries per key/value head + 2, head_dim]): a split by whole heads is a column split
_BY_HEAD = {"PersimmonAttention": "query_key_value", "GPTNeoXJapaneseAttention": "query_key_value",
            "FalconAttention": "query_key_value", "BloomAttention": "query_key_value", "GPTBigCodeAttention": "c_attn"}
_MULTI_QUERY = ("c_attn", "query_key_value")  # [queries | key | value], one key/value head (GPT-BigCode, Falcon)
# fused q / k / v projections the module chunks into blocks: the projection, and the groups of q | k | v blocks
# (CodeGen's mp_num = 4: its out_proj reads the heads in four blocks too)
_BLOCKS = {"MptAttention": ("Wqkv", 1), "CodeGenAttention": ("qkv_proj", 4)}


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


def _attention(layer: nn.Module) -> list[tuple[str, dict[str, object], str | None, int]]:
    """Each attention module of a layer: its name in the layer, its q / k / v projections' entries by their names,
    its output projection's name (relative to the layer), or None where it has none the plan can name, and the
    blocks its heads are laid out in (``_BLOCKS``; 1 for most)."""
    found = []
    for name, module in layer.named_modules():
        triple = next((t for t in QKV if all(isinstance(getattr(module, n, None), nn.Linear) for n in t)), None)
        columns = {n: "colwise" for n in triple} if triple else {}
        fused, groups = _BLOCKS.get(type(module).__name__, (None, 1))
        if not columns and isinstance(getattr(module, fused or "", None), nn.Linear):
            columns = {fused: BlocksParallel("column", 3 * groups)}  # q | k | v blocks the module chunks
        if not columns and _by_head(module) is not None:
            columns = {_by_head(module): "colwise"}
        if not columns and _multi_query(module) is not None:
            columns = {_multi_query(module): MultiQueryColumns(head_counts(module)[2] // head_counts(module)[0])}
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
        found.append((name, columns, out, groups))
    return found


def _mlp(layer: nn.Module, taken: set[str]) -> dict[str, object]:
    """The layer's MLP: its up projections (column) and down projections (row), where it has both; gate and up fused
    in one layer the module chunks in halves (``_GLU``), its two blocks each split over the ranks."""
    linears = {n: m for n, m in layer.named_modules() if _linear(m) and n not in taken
               and not any(n.startswith(t + ".") for t in taken)}
    fused = {}
    for n, m in linears.items():
        parent, _, leaf = n.rpartition(".")
        down = linears.get(f"{parent}.{_GLU[leaf]}" if parent else _GLU[leaf]) if leaf in _GLU else None
        if isinstance(m, nn.Linear) and isinstance(down, nn.Linear) and m.out_features == 2 * down.in_features:
            fused.update({n: BlocksParallel("column", 2), f"{parent}.{_GLU[leaf]}".lstrip("."): "rowwise"})
            # a layer beside it adding to its output (Zamba2's per-layer adapters), its blocks split alike
            fused.update({a: BlocksParallel("column", 2) for a, other in linears.items() if a != n
                          and a.startswith(f"{parent}.".lstrip(".")) and isinstance(other, nn.Linear)
                          and other.out_features == m.out_features})
    if fused:
        return fused
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
        return None  # multi-query: [q heads | k | v], not by head
    return fused


def _multi_query(module: nn.Module) -> str | None:
    """The fused ``[queries | key | value]`` projection of a multi-query attention module, or None."""
    heads, kv, width = head_counts(module)
    fused = next((n for n in _MULTI_QUERY if isinstance(getattr(module, n, None), nn.Linear)), None)
    if fused is None or kv != 1 or not heads or not width or width % heads:
        return None
    return fused if getattr(module, fused).out_features == width + 2 * (width // heads) else None


def _refusal(model: nn.Module, layer: nn.Module, where: str) -> str | None:
    """What the plan cannot split in ``layer``, as a sentence, or None."""
    for name, module in layer.named_modules():
        name = f"{where}.{name}".rstrip(".")
        fused = next((n for n in _FUSED if isinstance(getattr(module, n, None), nn.Module)), None)
        if fused is not None and _by_head(module) is None and not _attention(module):
            return (f"{name}.{fused} projects q / k / v in one layer, whose layout (by head, or q | k | v) "
                    f"tpflow cannot tell")
    for name, module in layer.named_modules():
        name = f"{where}.{name}".rstrip(".")
        if type(module).__name__ == "FalconAttention" and getattr(module.config, "alibi", False):
            return (f"{name} (FalconAttention) takes ALiBi biases its model folds into the attention mask for every "
                    f"head, which the plan cannot cut to its rank's heads")
        if getattr(module, "attention_type", None) == "block_sparse" and callable(
                getattr(module, "set_attention_type", None)):
            return (f"{name} ({type(module).__name__}) runs block-sparse attention, which it swaps for full "
                    f"attention on short inputs by building a new module from the config's head counts, not its "
                    f"rank's: build the model with attention_type='original_full' (a decoder's)")
    return None


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
('model.decoder.layers.*.self_attn', SplitHeads(groups=1))]
    """
    stacks = _layers(model)
    if not stacks:
        raise ValueError(f"{type(model).__name__} has no decoder layers tpflow can read (an nn.ModuleList of layers "
                         f"with linear layers)")
    plan: dict[str, object] = {}
    # a stack of MLPs alone is planned beside attention the plan reads (XLM's ffns beside its attentions), never in a
    # model with none: fc1 / fc2 of a module not a transformer say nothing of how they connect
    read = any(_attention(layer) for _, layers in stacks for layer in layers)
    for name, layers in stacks:
        for index, layer in enumerate(layers):
            where = f"{name}.{index}"
            why = _refusal(model, layer, where)
            attention = _attention(layer)
            mixers = {n: what for n, what in layer_mixers(layer)  # (not those holding the attention it splits)
                      if not any(a in ("", n) or a.startswith(n + ".") for a, *_ in attention)}
            unread = any(is_attention(m) for m in layer.modules())  # attention it cannot split must not stay whole
            if why is None and not attention and (unread or UNKNOWN in mixers.values() or not (mixers or (
                    read and _mlp(layer, set())))):
                why = (f"{where} ({type(layer).__name__}) has no attention with separate q / k / v linear layers "
                       f"(projections tpflow cannot name, or a token mixer it does not know)")
            if why is not None:
                raise ValueError(f"{type(model).__name__} carries no tensor-parallel plan, and tpflow cannot plan it "
                                 f"from its modules: {why}. Pass plan={{pattern: style}} to parallelize, or train it "
                                 f"with data parallelism")
            for n, what in mixers.items():  # Mamba-2 mixers split by heads; any other mixer whole, said in the plan
                split = mixers_within(layer.get_submodule(n))
                plan.update({f"{where}.{n}{inner}": style for inner, style in split.items()} if split
                            else {f"{where}.{n}": Replicated(why=f"{what}, which tpflow does not split")})
            taken = set(mixers)  # (per layer: BERT's output.dense is its MLP's, attention.output.dense not)
            for attn, columns, out, groups in attention:
                taken.update(f"{attn}.{proj}" if attn else proj for proj in columns)
                if out is not None:
                    taken.add(out)
                module = layer.get_submodule(attn) if attn else layer
                if out is None or _whole_width(module, _width(layer.get_submodule(out), "in")):
                    continue  # a norm over every head's features (BitNet's): the attention stays whole
                prefix = f"{where}.{attn}" if attn else where
                plan[prefix] = SplitHeads(groups)
                plan.update({f"{prefix}.{proj}": style for proj, style in columns.items()})
                plan[f"{where}.{out}"] = BlocksParallel("row", groups) if groups > 1 else _row(layer.get_submodule(out))
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
