"""``plan="auto"``: a Hugging Face model's own tensor-parallel plan, as tpflow entries, plus what tpflow adds.

transformers keeps the plan on the config (``base_model_tp_plan``, keys under the base model's prefix,
``model.``) and on the model class (``_tp_plan``: ``{"lm_head": "colwise_gather_output"}``); a model's
``tp_plan`` property merges them. ``hf_plan`` reads it and adds:

- ``fuse=True`` for the column layers of one parent (q / k / v, gate / up): their shared input crosses the
  ranks once;
- with ``sequence_parallel=True``, batch-first sequence parallelism: the first decoder layer cuts its input
  to this rank's tokens; norms run on them; the MLP's column layers gather them into their product (dim 1)
  and the row layers reduce-scatter back to them; attention modules, whose code reshapes by their input's
  shape, gather every token on entry; the head gathers them back;
- the vocabulary split over the ranks (``vocab_parallel=True``): the input embedding becomes a
  ``VocabParallelEmbedding`` and the output head a column layer whose logits come back as a global tensor split
  over the vocabulary, which the model's own ``labels=`` loss takes without gathering (``tpflow.plans.logits``);
  a tied pair stays one parameter. With ``vocab_parallel=False`` the head gathers whole logits (HF's
  ``colwise_gather_output``) and the embedding stays whole; a tied head then stays whole with it.

A model transformers ships no plan for gets tpflow's, read off its module tree (``tpflow.hf.planner``: separate or
head-by-head fused q / k / v as column layers with their heads split, fused blocks and multi-query projections by
their layouts, the output projection and the MLP's down projections as row layers, state spaces and recurrences
whole, said in the plan), or a sentence naming what cannot be split. ``python -m tpflow.models`` checks every
registered causal LM against one device and writes what each gets (``docs/models.md``). What a model's own plan
leaves out of its decoder layers (HunYuan-dense's, DiffLlama's and Emu3's name the head alone) tpflow plans alike, or
names in a ``Replicated`` entry saying why it stays whole (``tpflow.hf.left_out``).

Every other module with parameters (the norms) is replicated by ``parallelize``, with its
gradients found from the autograd graph, so entries such as ``replicated_with_grad_allreduce`` are kept but
not needed for the numbers to be right.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import inspect
import re

from torch import nn

from tpflow.hf.adapters import wrapped_model
from tpflow.hf.context import refuse_unsplit
from tpflow.hf.context_style import ContextParallel
from tpflow.hf.head_columns import with_heads
from tpflow.hf.heads import attention_heads
from tpflow.hf.in_place import BlocksParallel, Conv1DParallel
from tpflow.hf.left_out import with_left_out
from tpflow.hf.mixer_split import MixerStyle
from tpflow.hf.mixer_styles import mixer_style, mixers_within, with_mixers
from tpflow.hf.mixers import is_attention, unsplit_mixers
from tpflow.hf.multi_query import MultiQueryColumns
from tpflow.hf.own_attention import with_own_attention
from tpflow.hf.planner import planned
from tpflow.hf.state_passing import StatePassing
from tpflow.hf.styles import hf_style
from tpflow.hf.summed import SummedParameters
from tpflow.plans.experts import ExpertParallel, ExpertTensorParallel
from tpflow.plans.linear import ColumnParallel, RowParallel
from tpflow.plans.replicated import Replicated
from tpflow.plans.sequence import GatherSequence, SequenceParallel
from tpflow.plans.style import Stacked, Style
from tpflow.plans.vocab import VocabParallel

__all__ = ["hf_plan"]

_MIXERS = ("head_parallel", "state_passing", "state_passing_serial")  # hf_plan's modes for mixers under context


# Base-model plans for models whose own leaves their layers whole: gpt-oss ships none (its attention sinks, one per
# head, are split with the heads by parallelize)
_TPFLOW_PLANS = {
    "gpt_oss": {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
                "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
                "layers.*.mlp.experts": "moe_tp_experts"},
}


def _model_plan(model: nn.Module) -> dict[str, object]:
    """The model's own plan with full module names: transformers' merged ``tp_plan``, or the config's and the
    class's put together as transformers does; tpflow's own for a model that ships none for its layers."""
    config = getattr(model, "config", None)
    own = _TPFLOW_PLANS.get(getattr(config, "model_type", None))
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, dict) and plan and own is None:
        return dict(plan)
    base = own or getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    nested = prefix and isinstance(getattr(model, prefix, None), nn.Module)
    plan = {(f"{prefix}.{k}" if nested else k): v for k, v in base.items()}
    plan.update(getattr(type(model), "_tp_plan", None) or {})
    return plan


def _decoder_layers(model: nn.Module) -> str | None:
    """The name of the first decoder layer: the ``ModuleList`` the model's pipeline plan calls ``layers``."""
    for name, module in model.named_modules():
        if name.rpartition(".")[2] == "layers" and isinstance(module, nn.ModuleList) and len(module):
            return f"{name}.0"
    return None


def _is_attention(model: nn.Module, pattern: str) -> bool:
    """Whether a module ``pattern`` names is attention (MLA's latent projections included)."""
    return any(is_attention(m) for n, m in model.named_modules() if fnmatch.fnmatchcase(n, pattern))


def _attention_only(model: nn.Module, pattern: str, names: list[str]) -> list[str]:
    """``pattern`` where every module it names is attention; else the names of those that are (RecurrentGemma's
    ``temporal_block`` is attention in some layers, a recurrence split by heads in the others)."""
    hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
    attention = [n for n in hits if is_attention(model.get_submodule(n))]
    return [pattern] if len(attention) == len(hits) else attention


def _on_every_token(model: nn.Module, own: dict[str, object], experts: list[str]) -> list[str]:
    """Under sequence parallelism, the modules that run on every token, gathered on entry, their output cut back to
    this rank's tokens: a mixture of experts' block (router, experts, shared experts); an attention whose q / k / v
    gather their outputs (OLMoE's, normed over every head: its o_proj splits a whole input, which a
    sequence-parallel row layer cannot take); an attention the plan leaves whole (DiffLlama's), whose positions
    are every token's."""
    found = [pattern.rpartition(".")[0] for pattern in experts]
    found += [pattern.rpartition(".")[0] for pattern, style in own.items()
              if style == "rowwise_split_input" and _is_attention(model, pattern.rpartition(".")[0])]
    for name, module in model.named_modules():
        if attention_heads(module) is None and name.rpartition(".")[2] != "self_attn":  # MLA's has no q / k / v
            continue
        if mixer_style(module) is not None:  # a mixer split by heads (Kimi's delta attention): it gathers its own
            continue
        pattern = re.sub(r"\.\d+(?=\.|$)", ".*", name)
        planned = any(fnmatch.fnmatchcase(f"{name}.{child}", p) for child, _ in module.named_modules() if child
                      for p in own)
        if not planned and pattern not in found:
            found.append(pattern)
    return found


def _name_of(model: nn.Module, getter: str) -> str | None:
    """The module name of a transformers model's ``get_input_embeddings()`` / ``get_output_embeddings()``."""
    found = getattr(model, getter, lambda: None)()
    return next((name for name, m in model.named_modules() if m is found and name), None)


def _shared_experts(model: nn.Module, plan: dict[str, object]) -> dict[str, str]:
    """Column / row entries for a mixture's shared experts (an MLP beside the routed experts, run on every token)
    that the model's own plan leaves whole: Qwen2-MoE's ``shared_expert``."""
    found: dict[str, str] = {}
    for name, module in model.named_modules():
        if name.rpartition(".")[2] not in ("shared_expert", "shared_experts"):
            continue
        pairs = (("gate_proj", "colwise"), ("up_proj", "colwise"), ("down_proj", "rowwise"))
        if not all(isinstance(getattr(module, child, None), nn.Linear) for child, _ in pairs):
            continue  # not a gate / up / down MLP: left whole
        pattern = re.sub(r"\.\d+\.", ".*.", name)  # every layer's
        for child, style in pairs:
            if not any(fnmatch.fnmatchcase(f"{name}.{child}", p) for p in plan):
                found[f"{pattern}.{child}"] = style
    return found


def _whole_statistics(model: nn.Module, plan: dict[str, object], names: list[str]) -> dict[str, object]:
    """``plan`` with the MLPs whose forward takes statistics over all their intermediate features kept whole, said by
    a ``Replicated`` entry (Gemma 3n's activation sparsity: a mean and a deviation over the gate's whole output, which
    a rank holding its block of the features would take over that block alone): the plan's patterns that match
    inside them are written out for the other layers."""
    whole = [n for n, m in model.named_modules() if (getattr(m, "activation_sparsity", 0) or 0) > 0]
    if not whole:
        return plan
    def inside(name: str) -> bool:
        return any(name == w or name.startswith(w + ".") for w in whole)

    out: dict[str, object] = {}
    for pattern, style in plan.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if any(inside(n) for n in hits):
            out.update({n: style for n in hits if not inside(n)})
        else:
            out[pattern] = style
    why = "its activation sparsity takes a mean and a deviation over all its intermediate features"
    return {**out, **{w: Replicated(why=why) for w in whole}}


def _reads_weight(model: nn.Module, embedding: str | None) -> str | None:
    """The class of a module in ``model`` whose forward computes with the input embedding's weight itself (not only
    its device or dtype), or None."""
    if embedding is None:
        return None
    attr = re.escape(embedding.rpartition(".")[2])
    owner = type(model.get_submodule(embedding))
    for kind in {type(m) for m in model.modules()} - {owner}:
        try:
            source = inspect.getsource(kind.forward)
        except (OSError, TypeError):
            continue
        if re.search(rf"\b{attr}\.weight\b(?!\s*=[^=]|\.(?:device|dtype|shape))", source):
            return kind.__name__
    return None


def _summed(pattern: str, plan: dict[str, object]) -> SummedParameters:
    """HF's ``"all_reduce"`` module: its own parameters split as their ``"colwise"`` / ``"rowwise"`` entries under
    it say (their output / input features), its output summed over the ranks."""
    dims = tuple((child.rpartition(".")[2], -2 if style == "colwise" else -1) for child, style in plan.items()
                 if child.rpartition(".")[0] == pattern and style in ("colwise", "rowwise"))
    if not dims:
        raise ValueError(f"plan[{pattern!r}] = 'all_reduce' sums the output of a module whose own parameters the plan "
                         f"splits ('colwise' / 'rowwise' entries under it), and it names none")
    return SummedParameters(dims)


def _refuse_sequence_split(model: nn.Module, plan: dict[str, object]) -> None:
    """Raise, naming them, where sequence parallelism would leave a module on this rank's tokens that needs every
    token: a mixer other than attention (a state space, a convolution over the sequence: it would start each rank's
    tokens from an empty state), or an entry with no sequence-parallel form (fused blocks split in place,
    multi-query projections, summed parameters)."""
    mixers = [m for m in unsplit_mixers(model) if not mixers_within(model.get_submodule(m.partition(" ")[0]))]
    if mixers:  # (the mixers split by heads gather every token, as attention does)
        raise ValueError(f"sequence_parallel=True runs the layers on each rank's tokens, and {type(model).__name__}'s "
                         f"layers mix tokens other than by attention: {'; '.join(mixers[:3])}. Use "
                         f"sequence_parallel=False")
    fixed = sorted(p for p, e in plan.items() if e == "all_reduce" or isinstance(
        e, (Conv1DParallel, BlocksParallel, MultiQueryColumns, SummedParameters)))
    if fixed:
        raise ValueError(f"sequence_parallel=True: {fixed[0]} ({plan[fixed[0]]!r}) has no sequence-parallel form (it "
                         f"reads and sums every token): use sequence_parallel=False")


def _tied(model: nn.Module, name: str) -> bool:
    weight = getattr(model.get_submodule(name), "weight", None)
    return weight is not None and any(p is weight for n, p in model.named_parameters(remove_duplicate=False)
                                      if not n.startswith(name + "."))


def _planned(model: nn.Module, context: ContextParallel | None) -> dict[str, object]:
    """tpflow's own plan for ``model`` (``planned``); under context parallelism, where it finds nothing to split by
    heads, none (the context entries alone: the weights whole, as on a 1-D placement; a tensor axis beside them is
    refused, ``ContextParallel.check``)."""
    try:
        return planned(model)
    except ValueError:
        if context is None:
            raise
        return {}


def _check_layers_found(model: nn.Module, own: dict[str, object], names: list[str], ends: set) -> None:
    """Refuse a model none of whose layers the plan's layer patterns (all but the embedding's and the head's) name:
    ``plan="auto"`` would split the embedding and the head, found by their getters, and run every layer whole on
    every rank without a word (a model inside a wrapper of the user's own, whose modules then carry its prefix; a
    model whose modules were renamed). Checked before tpflow fills in what the model's own plan leaves out, which
    would plan such a model's layers without the styles of its own plan."""
    layers = [p for p, style in own.items() if style != "embedding_rowwise"
              and not any(e and (e == p or e.endswith("." + p)) for e in ends)]
    # (a pattern's layers found where modules a layer may lack are not: Nemotron-H's names its experts alone)
    found = {p.partition("*")[0] + "*" if "*" in p else p for p in layers}
    if not layers or any(fnmatch.fnmatchcase(n, p) for p in found for n in names):
        return
    shown = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)][:3] or names[1:4]
    raise ValueError(f"plan='auto': {type(model).__name__}'s plan names its layers {layers[:3]}, and none of its "
                     f"modules is so named (they are {shown}, ...): its layers would run whole on every rank. "
                     f"Parallelize the transformers model itself (a PEFT model is read through its wrapper), or "
                     f"pass plan={{pattern: style}} with the names it has")


def _fuse_alike(model: nn.Module, plan: dict[str, Style], names: list[str]) -> None:
    """Fuse the column layers of one parent only where they read inputs of one width, with a bias or none alike: MLA's
    ``q_b_proj`` and ``kv_b_proj`` read two latents, never one input; Whisper's ``k_proj`` has no bias."""
    parents: dict[str, list[tuple[str, nn.Module]]] = {}  # by the modules' parents (patterns may name them apart)
    for pattern, entry in plan.items():
        if isinstance(entry, ColumnParallel) and entry.fuse:
            for n in names:
                if fnmatch.fnmatchcase(n, pattern):
                    parents.setdefault(n.rpartition(".")[0], []).append((pattern, model.get_submodule(n)))
    for members in parents.values():
        widths = {(getattr(m, "in_features", None), getattr(m, "bias", None) is None, getattr(m, "weight", m).dtype)
                  for _, m in members}
        if len(widths) > 1:
            for pattern, _ in members:
                plan[pattern] = dataclasses.replace(plan[pattern], fuse=False)


def hf_plan(model: nn.Module, *, sequence_parallel: bool = False, fuse: bool = True,
            vocab_parallel: bool | None = None, expert_parallel: bool | str = False,
            context_parallel: str | None = None, mixers: str = "head_parallel") -> dict[str, Style]:
    """The plan ``parallelize(model, plan="auto")`` applies: the Hugging Face model's own, as tpflow entries, or, for
    a model transformers ships no plan for, tpflow's, read off its layers (``tpflow.hf.planner``). What each model
    type of transformers' registry gets, tensor, context and expert parallel, is in ``docs/models.md``
    (``python -m tpflow.models``).

    Args:
        model: a transformers model (its ``config.base_model_tp_plan`` and class ``_tp_plan``, else its modules).
        sequence_parallel: split the activations between the layer pairs over the ranks by tokens (dim 1): the
            norms run on this rank's tokens, and the first decoder layer's input sequence must be a multiple of
            the ranks (training; generation needs ``False``).
        fuse: run the column layers of one parent as one product (default True).
        vocab_parallel: split the embedding and the head over the vocabulary: ``.logits`` is then a global tensor
            split over the vocabulary (``.full_tensor()`` gives it whole), the ``labels=`` loss is computed without
            gathering it, and ``generate`` decodes from whole logits. False: the head gathers the whole logits onto
            every rank, and the embedding (and a head tied to it) stays whole. None (the default): True, unless the
            model's own code reads the embedding's weight outside it (Gemma 4 takes its padding token's row), which
            a split would give as this rank's rows; True for such a model is refused, naming the module.
        expert_parallel: a mixture of experts' experts shared out over the ranks whole (``tpf.ExpertParallel()``)
            instead of each split over them (``tpf.ExpertTensorParallel()``, the model's own plan); the name of
            a named placement's data axis (``"dp"``): shared out over its ranks, tokens exchanged by all-to-all
            (``tpf.ExpertParallel(axis="dp")``).
        context_parallel: ``"ring"`` or ``"ulysses"``: the sequence split over the ranks through every layer,
            attention included (``tpf.ContextParallel``): over a 1-D placement's ranks (the weights whole on every
            rank), or over a 2-D placement's first axis, the second tensor parallel. Training and scoring only
            (``generate`` needs a plan without it); not with ``sequence_parallel``.
        mixers: under ``context_parallel``, how token mixers other than attention (state spaces, linear attention)
            run: ``"head_parallel"`` (the default; every mixer tpflow splits by heads): the sequence gathered around
            each, its heads split over every rank; ``"state_passing"`` (gated DeltaNets, KDA, Mamba-2, Mamba-1,
            MiniMax's lightning attention, short convolutions): each rank runs the mixer on its own tokens, its heads
            split over the tensor axis alone, the state the tokens before them leave handed over
            (``tpflow.hf.state_passing``);
            ``"state_passing_serial"``: the same, the state handed from rank to rank in sequence order (one
            device's arithmetic, each rank waiting for those before it).

    Returns:
        Module-name patterns mapped to entries (``tpf.ColumnParallel``, ``tpf.RowParallel``, ...), which
        ``parallelize`` takes as ``plan=`` and which can be changed first.

    Example::

        >>> import tpflow as tpf
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
        ...                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        >>> plan = tpf.hf_plan(model)
        >>> plan["model.layers.*.self_attn.o_proj"]
        RowParallel(input_is_parallel=True, sequence_parallel=False, algo='auto', sequence_dim=0)
    """
    inner, prefix = wrapped_model(model)
    if inner is not model:  # a PEFT model: the wrapped model's plan, under the wrapper's names
        return {f"{prefix}.{pattern}": entry for pattern, entry in hf_plan(
            inner, sequence_parallel=sequence_parallel, fuse=fuse, vocab_parallel=vocab_parallel,
            expert_parallel=expert_parallel, context_parallel=context_parallel, mixers=mixers).items()}
    own = _model_plan(model)
    if mixers not in _MIXERS or (mixers != "head_parallel" and context_parallel is None):
        raise ValueError(f"mixers={mixers!r}: use {', '.join(map(repr, _MIXERS))}, under context_parallel")
    if context_parallel is not None and sequence_parallel:
        raise ValueError("context_parallel splits the sequence through every layer already: drop sequence_parallel")
    context = None if context_parallel is None else ContextParallel(context_parallel)  # the kind checked first
    if context is not None:
        refuse_unsplit(model)  # before any plan: no model runs without its context split in silence
    names = [name for name, _ in model.named_modules()]
    embedding, head = _name_of(model, "get_input_embeddings"), _name_of(model, "get_output_embeddings")
    _check_layers_found(model, own, names, {embedding, head})  # (its own names, before tpflow fills in what they miss)
    # transformers ships none: tpflow's, read off the module tree (or a sentence naming why not); else what its own
    # leaves out of the layers: tpflow's entries, or Replicated ones saying why it stays whole
    own = with_mixers(model, with_left_out(model, own) if own else _planned(model, context))  # mixers split by heads
    if context is not None and not own:  # nothing to split by heads: context parallelism alone
        context = dataclasses.replace(context, layers_whole=True)
    if sequence_parallel:
        _refuse_sequence_split(model, own)
    plan: dict[str, Style] = {}
    reader = _reads_weight(model, embedding)
    if vocab_parallel and reader is not None:
        raise ValueError(f"vocab_parallel=True: {reader}'s forward reads {embedding}.weight itself, which a split "
                         f"over the vocabulary would give it as this rank's rows: pass vocab_parallel=False (or None)")
    vocab_parallel = reader is None if vocab_parallel is None else vocab_parallel
    own.update(_shared_experts(model, own))
    own = _whole_statistics(model, own, names)
    experts = [pattern for pattern, style in own.items() if style == "moe_tp_experts"]
    blocks = _on_every_token(model, own, experts) if sequence_parallel else []
    for pattern, style in own.items():
        if pattern == head or (style == "embedding_rowwise" and not vocab_parallel):
            continue  # the head is planned below; without vocab_parallel an embedding stays whole
        if pattern.rpartition(".")[0] in experts or not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            continue  # an experts module's parameters (the module's entry splits them); a dense MLP in an MoE model
        if style == "embedding_rowwise":  # HF's name for the vocabulary-parallel embedding, without options
            pattern = embedding or pattern
        entry = _summed(pattern, own) if style == "all_reduce" else hf_style(pattern, style)
        if expert_parallel and isinstance(entry, ExpertTensorParallel):
            entry = ExpertParallel(axis=expert_parallel if isinstance(expert_parallel, str) else None)
        if isinstance(entry, ColumnParallel):
            entry = dataclasses.replace(entry, fuse=fuse and not entry.gather_output)
        if isinstance(entry, MixerStyle):  # a token mixer split by heads: every token gathered on entry, or with
            passing = context is not None and mixers != "head_parallel"  # state passing this rank's tokens alone
            entry = dataclasses.replace(entry, sequence_parallel=sequence_parallel,
                                        context=context is not None and not passing)
            passed = StatePassing(serial=mixers == "state_passing_serial")
            entry = entry if context is None else Stacked((entry, passed, context) if passing else
                                                          (entry, context))  # (head parallel: over every rank)
        parent = pattern.rpartition(".")[0]
        if any(parent == block or parent.startswith(block + ".") for block in blocks):
            pass  # in a mixture of experts' block: it runs on every token under sequence parallelism
        elif sequence_parallel and isinstance(entry, (ColumnParallel, RowParallel)):
            if isinstance(entry, RowParallel) or not _is_attention(model, parent):
                entry = dataclasses.replace(entry, sequence_parallel=True, sequence_dim=1)
            else:  # attention reshapes q / k / v by its input's shape: it gets every token, gathered on entry
                plan.update(dict.fromkeys(_attention_only(model, parent, names), GatherSequence()))
        plan[pattern] = entry
    _fuse_alike(model, plan, names)
    for block in blocks:
        plan[block] = GatherSequence(split_output=True)
    if vocab_parallel and embedding is not None:
        plan[embedding] = VocabParallel()  # all-reduced: HF builds positions from the embedding's whole sequence
    tokens = {"sequence_parallel": sequence_parallel, "sequence_dim": 1 if sequence_parallel else 0}
    if head is not None and vocab_parallel:
        plan[head] = VocabParallel(**tokens)
    elif head is not None and not _tied(model, head):
        plan[head] = ColumnParallel(gather_output=True, **tokens)
    elif head is not None and sequence_parallel:
        raise ValueError(f"{type(model).__name__} ties its head to its embedding, which stay whole on every rank "
                         "with vocab_parallel=False: a whole head would see only this rank's tokens; use "
                         "sequence_parallel=False or vocab_parallel=True")
    if sequence_parallel:
        first = _decoder_layers(model)
        if first is None:
            raise ValueError(f"sequence_parallel=True needs the model's decoder layers (a ModuleList named "
                             f"'layers'); {type(model).__name__} has none")
        plan[first] = SequenceParallel(split_input=True)
    if context is not None:
        for name, module in model.named_modules():
            if is_attention(module):
                plan.update(dict.fromkeys(_attention_only(model, re.sub(r"\.\d+(?=\.|$)", ".*", name), names),
                                          context))
    plan = with_heads(model, plan)
    return plan if context is None else with_own_attention(model, plan, context)  # (its heads over every rank)
