"""Cutting a model into pipeline stages, so that no stage class is written by hand.

    nn.Sequential   cut before the children named in ``at``, or into runs of children of equal length
    Hugging Face    a causal LM cut between its decoder layers; each stage is the model's own class holding
                    only its layers (the embedding on the first, the final norm and the head on the last), so
                    the model's own forward and attention run unchanged; the model's pipeline plan
                    (``pp_plan``: which part takes ``input_ids``, which are the layers, which gives
                    ``logits``) says what flows between the parts

With ``plan`` each stage is ``parallelize``d on its own placement first (pipeline x tensor): ``"auto"`` takes a
Hugging Face model's own plan, the embedding split over the vocabulary and the head gathering its logits (the
pipeline's loss takes them whole).
"""

from __future__ import annotations

import copy
import fnmatch
import itertools
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tpflow.checkpoint.load import tensor_names
from tpflow.hf import hf_plan, parallelize
from tpflow.pipeline.stage import Stage
from tpflow.placement import Placement
from tpflow.plans import VocabParallel
from tpflow.plans.names import style_of

__all__ = ["CausalLMStage", "balanced_runs", "causal_lm_loss", "cut"]


def balanced_runs(n: int, parts: int) -> list[tuple[int, int]]:
    """``[start, end)`` of ``parts`` runs of ``n`` blocks, the first ``n % parts`` one longer: ``cut``'s stages when
    ``at`` is not given (stages of equal work, as OneFlow balances them; ``torch.chunk`` would give 3, 3, 3, 1).

    Args:
        n: the blocks (children, decoder layers).
        parts: the stages.

    Returns:
        The runs, in order.

    Example::

        >>> from tpflow.pipeline.cut import balanced_runs
        >>> balanced_runs(10, 4)
        [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
    size, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        out.append((start, end))
        start = end
    return out


def _runs(names: list[str], parts: int, at: Sequence[str] | None, what: str) -> list[tuple[int, int]]:
    """The runs of ``names`` (blocks in order) that make ``parts`` stages: cut before each name of ``at``."""
    if at is None:
        if len(names) < parts:
            raise ValueError(f"{len(names)} {what} cannot make {parts} stages: give fewer placements")
        return balanced_runs(len(names), parts)
    at = list(at)
    if len(at) != parts - 1:
        raise ValueError(f"at names where stages 1..{parts - 1} begin: {parts - 1} names for {parts} placements, "
                         f"got {len(at)}")
    unknown = [a for a in at if a not in names]
    if unknown:
        raise ValueError(f"at={unknown}: not among the {what}, which are {names}")
    starts = [names.index(a) for a in at]
    if starts != sorted(set(starts)) or starts[0] == 0:
        raise ValueError(f"at must name {what} in their order, after the first, each once: got {at}")
    bounds = [0, *starts, len(names)]
    return list(itertools.pairwise(bounds))


def _sequential_stages(model: nn.Sequential, placements: Sequence[Placement], at: Sequence[str] | None,
                       plan: object, sbp: object) -> list[Stage]:
    names, whole = list(model._modules), tensor_names(model)
    stages = []
    for k, ((a, b), pl) in enumerate(zip(_runs(names, len(placements), at, "children"), placements)):
        part = model[a:b]  # keeps the children's names, so plan patterns read as on the whole model
        if plan is not None:
            part = parallelize(part, placement=pl, plan=_matching(part, plan))
        stages.append(Stage(part, k, pl, sbp))
        stages[-1].part_of = ("module.", whole)  # the whole model's checkpoint loads into it
    return stages


def _matching(model: nn.Module, plan: dict) -> dict:
    """The entries of ``plan`` that match a module of this stage (the others live on other stages)."""
    layers = (nn.Linear, nn.Embedding)

    def fits(pattern: str, entry: object) -> bool:  # an entry that remakes a layer fits the layers alone
        return any(fnmatch.fnmatchcase(n, pattern) and (isinstance(m, layers) or not (
            isinstance(entry, str) or style_of(pattern, entry, m).layout(m) is not None))
            for n, m in model.named_modules())
    return {pattern: entry for pattern, entry in plan.items() if fits(pattern, entry)}


class CausalLMStage(nn.Module):
    """A Hugging Face causal LM holding some of its decoder layers, run by its own forward: the first stage takes
    token ids, the others the hidden states before their first layer; the last returns ``.logits``, the others
    the hidden states after their last layer.

    ``cut`` builds these; the model's own code (masks, rotary positions, attention, norms, head) runs unchanged.
    A stage after the first calls the model with ``inputs_embeds`` of the incoming shape and hands its first
    layer the incoming hidden states themselves (a forward pre-hook), and a stage before the last returns what
    its last layer gives (a forward hook): what the model's forward does between its embedding and its first
    layer (Gemma's scaling by the square root of the width) and after its last layer (the final norm, the head,
    Gemma's soft cap) happens once, on the stages that hold those parts.

    Args:
        model: the stage's copy of the model (its ``layers`` cut down, its config saying so).
        layers: the stage's decoder layers, in order (``layers`` then lists them: the blocks to ``fully_shard``).
        first, last: whether the stage is the pipeline's first (takes token ids) and last (gives logits).

    Example::

        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> lm = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
        ...                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
        >>> P0, P1 = tpf.placement("cpu", [0]), tpf.placement("cpu", [1])
        >>> stages = tpf.pipeline.cut(lm, placements=[P0, P1])
        >>> stages[0].module.extra_repr(), stages[1].module.extra_repr()
        ('first=True, last=False, layers=2', 'first=False, last=True, layers=2')
    """

    def __init__(self, model: nn.Module, layers: Sequence[nn.Module], first: bool, last: bool) -> None:
        super().__init__()
        self.model, self.first, self.last = model, first, last
        self.layers = list(layers)  # a list, not a ModuleList: their names stay the model's own
        self._given: torch.Tensor | None = None  # the incoming hidden states, during a call
        self._made: torch.Tensor | None = None  # the last layer's output, during a call
        if not first:
            layers[0].register_forward_pre_hook(self._hand_in, with_kwargs=True)
        if not last:
            layers[-1].register_forward_hook(self._take_out)

    def _hand_in(self, layer: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self._given is None:  # called outside the stage (the model on its own): left as it is
            return args, kwargs
        if args:
            return (self._given, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self._given}

    def _take_out(self, layer: nn.Module, args: tuple, output: object) -> None:
        self._made = output[0] if isinstance(output, tuple) else output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        checkpointing = getattr(self.model, "is_activation_checkpointing", None)  # transformers 5 renamed it
        if checkpointing is None:
            checkpointing = getattr(self.model, "is_gradient_checkpointing", False)
        if checkpointing and torch.is_grad_enabled():
            raise ValueError("a cut causal LM hands its first layer the incoming hidden states by a hook, which a "
                             "checkpointed layer's recompute in the backward would not see: call "
                             "model.gradient_checkpointing_disable() before tpf.pipeline.cut")
        given = {"input_ids": x} if self.first else {"inputs_embeds": x}
        self._given = None if self.first else x
        try:
            logits = self.model(**given, use_cache=False).logits
            return logits if self.last else self._made
        finally:
            self._given = self._made = None

    def extra_repr(self) -> str:
        return f"first={self.first}, last={self.last}, layers={self.model.config.num_hidden_layers}"


class _Layers(nn.ModuleList):
    """A run of a model's decoder layers under their own indices: ``layers.4`` stays ``layers.4`` in the stage's
    state dict, so a checkpoint of the whole model loads into each stage by its names."""

    def __init__(self, layers: dict[str, nn.Module]) -> None:
        nn.Module.__init__(self)
        for name, layer in layers.items():
            self.add_module(name, layer)

    def __getitem__(self, idx: int | slice) -> nn.Module:
        layers = list(self._modules.values())
        return nn.ModuleList(layers[idx]) if isinstance(idx, slice) else layers[idx]


def _shell(module: nn.Module, children: dict[str, nn.Module | None]) -> nn.Module:
    """A copy of ``module`` sharing its parameters and other children, with ``children`` in their places."""
    shell = copy.copy(module)
    shell._modules = {**module._modules, **children}
    return shell


def _pp_parts(model: nn.Module) -> tuple[str, str, list[str], str]:
    """From the model's pipeline plan: the embedding, the decoder layers (a ModuleList), the parts after them
    (the final norm), and the head, as module names."""
    plan = dict(getattr(model, "pp_plan", None) or getattr(model, "_pp_plan", None) or {})
    if not plan:
        raise ValueError(f"{type(model).__name__} has no pipeline plan (pp_plan): cut it with at= on an "
                         "nn.Sequential, or write its stages with tpf.stage")
    embedding = next((n for n, (ins, _) in plan.items() if list(ins) == ["input_ids"]), None)
    layers = next((n for n in plan if isinstance(model.get_submodule(n), nn.ModuleList)), None)
    head = next((n for n, (_, outs) in plan.items() if list(outs) == ["logits"]), None)
    if None in (embedding, layers, head) or embedding.rpartition(".")[0] != layers.rpartition(".")[0]:
        raise ValueError(f"{type(model).__name__}'s pipeline plan {plan} does not name an embedding taking "
                         "input_ids, a list of layers beside it and a head giving logits")
    names = list(plan)
    after = [n for n in names[names.index(layers) + 1:] if n != head]
    return embedding, layers, after, head


def _causal_lm_stages(model: nn.Module, placements: Sequence[Placement], at: Sequence[str] | None,
                      plan: object, sbp: object) -> list[Stage]:
    embedding, layers_name, after, head = _pp_parts(model)
    layers = model.get_submodule(layers_name)
    base_name = layers_name.rpartition(".")[0]
    base = model.get_submodule(base_name)
    head_weight = getattr(model.get_submodule(head), "weight", None)
    tied = head_weight is not None and head_weight is getattr(model.get_submodule(embedding), "weight", None)
    if tied and len(placements) > 1:
        raise ValueError(f"{type(model).__name__} ties its head to its input embedding, which would live on two "
                         "stages: untie them first (model.config.tie_word_embeddings = False and "
                         f"model.{head}.weight = nn.Parameter(model.{head}.weight.detach().clone()))")
    names = [f"{layers_name}.{i}" for i in range(len(layers))]
    whole = tensor_names(model)
    stages = []
    runs = _runs(names, len(placements), at, "decoder layers")
    for k, ((a, b), pl) in enumerate(zip(runs, placements)):
        first, last = k == 0, k == len(placements) - 1
        config = copy.copy(model.config)
        config.num_hidden_layers = b - a
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = config.layer_types[a:b]  # the model indexes them by its own layers' positions
        own = _Layers({str(i): layers[i] for i in range(a, b)})
        children: dict[str, nn.Module | None] = {layers_name.rpartition(".")[2]: own}
        children[embedding.rpartition(".")[2]] = model.get_submodule(embedding) if first else None
        for name in after:
            children[name.rpartition(".")[2]] = model.get_submodule(name) if last else nn.Identity()
        for name, child in base.named_children():  # shared helpers (rotary positions): a copy each
            if f"{base_name}.{name}" not in (embedding, layers_name, *after):
                children[name] = copy.deepcopy(child)
        stage_base = _shell(base, children)
        stage_base.config = config
        top = _shell(model, {base_name: stage_base, head: model.get_submodule(head) if last else nn.Identity()})
        top.config = config
        if plan is not None:
            entries = hf_plan(top, vocab_parallel=False) if plan == "auto" else plan
            if plan == "auto" and first and not tied:  # its rows split over the vocabulary, its output summed whole
                entries = {**entries, embedding: VocabParallel()}
            top = parallelize(top, placement=pl, plan=_matching(top, entries))
        stages.append(Stage(CausalLMStage(top, list(own), first, last), k, pl, sbp))
        stages[-1].part_of = ("module.model.", whole)  # the whole model's checkpoint loads into it
    return stages


def cut(model: nn.Module, placements: Sequence[Placement], *, at: Sequence[str] | None = None,
        plan: object = None, sbp: object = None) -> list[Stage]:
    """``model`` cut into pipeline stages, stage k on ``placements[k]``, ready for ``tpf.Pipeline``.

    An ``nn.Sequential`` is cut between its children; a Hugging Face causal LM (a model with a pipeline plan,
    ``pp_plan``) between its decoder layers, each stage the model's own class holding its layers only. Give a
    placement per stage; for an interleaved pipeline repeat them in turn (``[P0, P1, P0, P1]``). The model's
    modules move into the stages (it is used up). Each stage keeps the whole model's names (``stage.part_of``), so
    ``tpf.load_safetensors(stage, path)`` fills it from a checkpoint of the whole model.

    Args:
        model: an ``nn.Sequential``, or a transformers causal LM (Llama, Qwen, Mistral, Gemma, ...) whose head is
            not tied to its embedding.
        placements: one ``tpf.placement`` per stage, in stage order.
        at: where stages 1, 2, ... begin: child names of the ``nn.Sequential`` (``"3"``), or decoder layer names
            of the causal LM (``"model.layers.4"``). Default: runs of equal length (the first ones one longer).
        plan: ``parallelize`` each stage on its placement: a plan dict (each stage takes the entries that match
            its modules) or, for a causal LM, ``"auto"`` (its own plan; the embedding split over the vocabulary, the
            head gathering the logits). Default None: stages as they are (one rank each, or data parallel with
            ``sbp``).
        sbp: every stage's input layout (``tpf.stage``'s ``sbp``), e.g. ``tpf.sbp.split(0)`` for data-parallel
            stages.

    Returns:
        The stages, in order.

    Example::

        >>> import torch.nn.functional as F
        >>> from torch import nn
        >>> import tpflow as tpf
        >>> model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
        >>> stages = tpf.pipeline.cut(model, [tpf.placement("cpu", [0]), tpf.placement("cpu", [1])], at=["2"])
        >>> pipe = tpf.Pipeline(stages, micro_batches=4, loss_fn=F.mse_loss)
    """
    placements = list(placements)
    if not placements or not all(isinstance(p, Placement) for p in placements):
        raise TypeError(f"placements must be a list of tpf.placement(...), one per stage, got {placements!r}")
    if isinstance(model, nn.Sequential):
        return _sequential_stages(model, placements, at, plan, sbp)
    if getattr(model, "pp_plan", None) or getattr(model, "_pp_plan", None):
        return _causal_lm_stages(model, placements, at, plan, sbp)
    raise TypeError(f"cut takes an nn.Sequential or a Hugging Face causal LM with a pipeline plan, got "
                    f"{type(model).__name__}: write its stages with tpf.stage")


def causal_lm_loss(model: nn.Module, *, ignore_index: int = -100) -> Callable[..., torch.Tensor]:
    """The causal LM's own loss (``model.loss_function``, as its ``labels=`` argument computes it) as a pipeline's
    ``loss_fn``: on the last stage's whole logits and the micro-batch's labels, over the whole batch's labelled
    tokens.

    A pipeline hands it the count of the whole batch's labelled tokens, counted after the causal shift (position t
    predicts the label at t + 1, so a row's first label is never one), before any micro-batch's loss is taken (Hugging
    Face's ``num_items_in_batch``): each micro-batch's loss is its tokens' sum over that count, and the step's loss
    and gradients are one device's ``labels=`` mean, whatever the labels mask (prompts of different lengths, rows or
    whole micro-batches without a labelled token).

    Args:
        model: the transformers model (before or after ``cut``).
        ignore_index: the label that is not predicted (``-100``, as transformers masks prompts and padding).

    Returns:
        ``loss_fn(logits, labels, num_items_in_batch=None)`` for ``tpf.Pipeline``, whose ``num_items(labels)`` counts
        the labelled tokens after the shift; called without ``num_items_in_batch``, its mean is over the given
        labels' tokens only.

    Example::

        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> _ = torch.manual_seed(0)
        >>> lm = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        ...                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
        >>> ids = torch.randint(0, 64, (4, 8))
        >>> labels = ids.clone()
        >>> labels[0, :5] = labels[1, :2] = -100           # prompts of different lengths, not trained on
        >>> lm(ids, labels=labels).loss                    # one device's
        tensor(4.1647, grad_fn=<NllLossBackward0>)
        >>> loss_fn = tpf.pipeline.causal_lm_loss(lm)
        >>> loss_fn.num_items(labels)                      # 4 rows of 7 predicted tokens, 4 + 1 of them masked
        tensor(23)
        >>> stages = tpf.pipeline.cut(lm, [tpf.placement("cpu", [0]), tpf.placement("cpu", [1])])
        >>> pipe = tpf.Pipeline(stages, micro_batches=2, loss_fn=loss_fn)
        >>> loss = pipe.step(ids, labels)
        >>> loss                                           # on rank 1, the last stage's
        tensor(4.1647)
    """
    vocab = model.config.vocab_size
    own = model.loss_function

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor,
                num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        local = [t.to_local() if isinstance(t, DTensor) else t for t in (logits, labels)]
        return own(*local, vocab_size=vocab, num_items_in_batch=num_items_in_batch, ignore_index=ignore_index)

    def num_items(labels: torch.Tensor) -> torch.Tensor:
        labels = labels.to_local() if isinstance(labels, DTensor) else labels
        return (labels[..., 1:] != ignore_index).sum()

    loss_fn.num_items = num_items
    return loss_fn
