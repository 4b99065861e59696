"""Plan entries: how a matched module is parallelized, by name (``"column"``) or with options.

    "column"                              ColumnParallel(): W split(1)
    "row"                                 RowParallel(): W split(0)
    ColumnParallel(sequence_parallel=True, fuse=True)
    Replicated(grads="partial")           whole on every rank, gradients summed over the ranks
    SequenceParallel(split_input=True)    runs on this rank's tokens
    GatherSequence()                      runs on every token, gathered from the ranks' own
    "vocab"                               VocabParallel(): an embedding or an output head split over the vocabulary
    "moe_tp_experts"                      ExpertTensorParallel(): every expert split over the ranks
    "ep_dispatch_experts"                 ExpertParallel(): the experts shared out over the ranks, whole
    ContextParallel("ring")               an attention module over a sequence split across the ranks

Hugging Face's style names (``config.base_model_tp_plan``) name the same entries: ``STYLES``.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from tpflow.layers import ColumnParallelLinear, ParallelLinear, RowParallelLinear, ShardedModule, VocabParallelEmbedding
from tpflow.placement import Placement

__all__ = ["STYLES", "ColumnParallel", "ContextParallel", "ExpertParallel", "ExpertTensorParallel", "GatherSequence",
           "Replicated", "RowParallel", "SequenceParallel", "Style", "VocabParallel", "style_of"]


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


@dataclasses.dataclass(frozen=True)
class Replicated:
    """Plan entry for a module left whole on every rank, whose own parameters become global tensors broadcast
    over the placement (``tpflow.layers.replicated``); its forward is unchanged.

    ``parallelize`` does this to every module with parameters that no entry replaces; the entry says how its
    gradient is found. HF's ``"replicated_with_grad_allreduce"`` is ``Replicated(grads="partial")``.

    Args:
        grads: ``"partial"``: the module sees this rank's part of the data (Qwen3's per-head ``q_norm``), so its
            gradients are summed over the tensor-parallel ranks; ``"whole"``: it sees the same data on every rank;
            ``"auto"`` (the default): found from the autograd graph on its first call with gradients.

    Example::

        >>> import tpflow as tpf
        >>> from transformers import Qwen3Config, Qwen3ForCausalLM
        >>> from tpflow.layers.replicated import replicated_grads
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> model = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, head_dim=4,
        ...                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        >>> model = tpf.parallelize(model, placement=P, plan={"*.q_norm": tpf.Replicated(grads="partial"),
        ...                                                   "*.[qkv]_proj": "column", "*.o_proj": "row"})
        >>> attn = model.model.layers[0].self_attn
        >>> replicated_grads(attn.q_norm), replicated_grads(attn.k_norm)    # k_norm: found on its first call
        ('partial', 'auto')
    """

    grads: str = "auto"


@dataclasses.dataclass(frozen=True)
class SequenceParallel:
    """Plan entry for a module that runs on this rank's tokens (HF's ``"sequence_parallel"``): a norm between
    a sequence-parallel row layer and the next sequence-parallel column layer, or the first module of such a
    region, which cuts its whole input to this rank's tokens.

    Its parameters stay whole on every rank and their gradients are summed over the tensor-parallel ranks.

    Args:
        split_input: the module's first input (or ``hidden_states``) arrives whole and is cut to this rank's
            chunk of ``sequence_dim`` (the backward all-gathers its gradient): the entry of a sequence-parallel
            region (default False: it arrives cut, from a sequence-parallel row layer).
        sequence_dim: the sequence dim: 1 (default, ``[batch, seq, hidden]``) or 0.

    Example::

        >>> import tpflow as tpf
        >>> from torch import nn
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)                                            # the same model on every rank
        >>> model = nn.Sequential()
        >>> model.norm, model.fc1, model.act = nn.LayerNorm(16), nn.Linear(16, 64), nn.GELU()
        >>> model.fc2, model.out_norm = nn.Linear(64, 16), nn.LayerNorm(16)
        >>> model = tpf.parallelize(model, placement=P, plan={
        ...     "norm": tpf.SequenceParallel(split_input=True),                   # cuts the whole input to its tokens
        ...     "fc1": tpf.ColumnParallel(sequence_parallel=True, sequence_dim=1),
        ...     "fc2": tpf.RowParallel(sequence_parallel=True, sequence_dim=1),
        ...     "out_norm": "sequence_parallel",                                  # on this rank's tokens, from fc2
        ... })
        >>> model(torch.randn(2, 8, 16)).shape     # [batch, seq, hidden]: all 8 tokens in, this rank's 4 out
        torch.Size([2, 4, 16])
    """

    split_input: bool = False
    sequence_dim: int = 1


@dataclasses.dataclass(frozen=True)
class GatherSequence:
    """Plan entry for a module whose first input (or ``hidden_states``) arrives as this rank's tokens and is
    all-gathered whole before it runs (the backward keeps this rank's chunk of the gradient): an attention
    module in a sequence-parallel model, whose own code reshapes the projections' outputs by its input's shape.

    Args:
        sequence_dim: the sequence dim: 1 (default, ``[batch, seq, hidden]``) or 0.
        split_output: cut the module's output (whole on every rank) back to this rank's tokens (the backward
            all-gathers its gradient): a mixture of experts' block, whose router and experts run on every token
            and whose output goes on to the next sequence-parallel norm (default False: a sequence-parallel row
            layer inside the module cuts it).

    Example::

        >>> import tpflow as tpf
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)                                            # the same model on every rank
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
        ...                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        >>> ids = torch.randint(0, 64, (2, 8))
        >>> model(ids, labels=ids).loss                                         # one device's
        tensor(4.1710, grad_fn=<NllLossBackward0>)
        >>> plan = tpf.hf_plan(model, sequence_parallel=True)
        >>> plan["model.layers.*.self_attn"]
        GatherSequence(sequence_dim=1, split_output=False)
        >>> model = tpf.parallelize(model, placement=P, plan=plan)
        >>> model(ids, labels=ids).loss
        tensor(4.1710, grad_fn=<_VocabParallelCEBackward>)
    """

    sequence_dim: int = 1
    split_output: bool = False


@dataclasses.dataclass(frozen=True)
class VocabParallel:
    """Plan entry for a language model's embedding or output head, split over the vocabulary (``"vocab"``; Hugging
    Face's ``"embedding_rowwise"``).

    An ``nn.Embedding`` becomes a ``VocabParallelEmbedding`` (its rows split over the ranks, the lookups summed);
    an ``nn.Linear`` head becomes a ``ColumnParallelLinear`` whose logits come back as a global tensor split over
    the vocabulary (``global_output=True``), which ``tpf.cross_entropy`` takes without gathering them, and which
    a model's own ``F.cross_entropy`` takes too (``parallelize`` enters ``tpf.vocab_parallel_loss()`` after the
    head runs). A head tied to its embedding holds the same rows of the same matrix: the pair stays one parameter.

    Args:
        sequence_parallel: the embedding reduce-scatters its output into this rank's chunk of ``sequence_dim``;
            the head takes such a chunk and gathers it into its product (default False).
        sequence_dim: the sequence dim: 0 (default, ``[seq, batch, hidden]``) or 1 (``[batch, seq, hidden]``).

    Example::

        >>> import tpflow as tpf
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)                                            # the same model on every rank
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
        ...                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        >>> plan = {"model.embed_tokens": "vocab", "lm_head": "vocab", "*.[qkv]_proj": "column", "*.o_proj": "row"}
        >>> model = tpf.parallelize(model, placement=P, plan=plan)
        >>> ids = torch.randint(0, 64, (2, 8))
        >>> out = model(ids, labels=ids)                          # the loss without gathering the logits
        >>> tpf.get_sbp(out.logits), out.logits.shape
        ((sbp.split(dim=2),), torch.Size([2, 8, 64]))
    """

    sequence_parallel: bool = False
    sequence_dim: int = 0

    def build(self, module: nn.Module, placement: Placement) -> ShardedModule:
        """The parallel layer for ``module``: an embedding's or a head's (see the class).

        Args:
            module: an ``nn.Embedding`` (or a subclass) or an ``nn.Linear``.
            placement: the ranks the vocabulary is split over.

        Returns:
            A ``VocabParallelEmbedding`` or a ``ColumnParallelLinear`` with ``global_output=True``.

        Example::

            >>> P = tpf.placement("cpu", ranks=[0, 1])
            >>> head = tpf.VocabParallel().build(nn.Linear(64, 101, bias=False), P)
            >>> logits = head(torch.randn(2, 64))
            >>> type(head).__name__, tpf.get_sbp(logits), logits.shape
            ('ColumnParallelLinear', (sbp.split(dim=1),), torch.Size([2, 101]))
        """
        if isinstance(module, nn.Embedding):
            return VocabParallelEmbedding.from_embedding(module, placement=placement, **dataclasses.asdict(self))
        return ColumnParallelLinear.from_linear(module, placement=placement, global_output=True,
                                                **dataclasses.asdict(self))


@dataclasses.dataclass(frozen=True)
class ExpertTensorParallel:
    """Plan entry for a mixture of experts' experts module (Hugging Face's ``"moe_tp_experts"``): every expert split
    over the tensor-parallel ranks along its intermediate dim, each rank running its slice of every expert on every
    routed token, the output summed once (``tpflow.layers.experts``). The router stays whole on every rank, with one
    device's gradient.

    Example::

        >>> import tpflow as tpf
        >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)                                            # the same model on every rank
        >>> model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=16, moe_intermediate_size=8,
        ...     num_experts=4, num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4,
        ...     num_key_value_heads=2, head_dim=4))
        >>> tpf.hf_plan(model)["model.layers.*.mlp.experts"]
        ExpertTensorParallel()
        >>> model = tpf.parallelize(model, placement=P, plan="auto")
        >>> model.model.layers[0].mlp.experts.down_proj.to_local().shape      # [experts, hidden, this rank's 4 of 8]
        torch.Size([4, 16, 4])
    """


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """Plan entry for a mixture of experts' experts module split by whole experts (``tpf.hf_plan(model,
    expert_parallel=True)``; Hugging Face's ``"ep_dispatch_experts"``): each of the W ranks holds E / W experts and
    runs them on the tokens routed to them (``tpflow.layers.experts``). The router stays whole on every rank, with
    one device's gradient.

    Args:
        axis: None: over the tensor-parallel ranks, which hold every token (one sum combines the outputs). The
            name of the data axis of a named placement of two axes (``"dp"``, beside FSDP2): over its ranks, which
            hold different tokens, sent to their experts' ranks and back by all-to-all; each expert also split over
            the tensor-parallel axis where it has more than one rank (EP x TP). FSDP2 leaves those experts alone:
            ``fully_shard(..., ignored_params=tpf.fsdp_ignored_params(model))``.

    Example::

        >>> import tpflow as tpf
        >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)                                            # the same model on every rank
        >>> model = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=16, moe_intermediate_size=8,
        ...     num_experts=4, num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4,
        ...     num_key_value_heads=2, head_dim=4))
        >>> model = tpf.parallelize(model, placement=P, plan=tpf.hf_plan(model, expert_parallel=True))
        >>> model.model.layers[0].mlp.experts.down_proj.to_local().shape      # 2 of the 4 experts, whole
        torch.Size([2, 16, 8])
    """

    axis: str | None = None


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """Plan entry for a Hugging Face attention module under context parallelism (``tpf.hf_plan(model,
    context_parallel="ring")``): the sequence is split over the context axis (a 1-D placement's ranks, or the first
    axis of a 2-D one, the second being tensor parallel), every layer runs on this rank's part of it, and the
    attention module's own code runs with its attention computed over the whole sequence (``tpflow.plans.context``).
    Every attention module of the model takes the same entry.

    Args:
        kind: ``"ring"``: the key / value blocks go around the ranks (``tpflow.ops.ring_attention``), each rank
            holding two parts of the sequence (head-tail) so causal work is balanced; ``"ulysses"``: an all-to-all
            turns the sequence split into a split of the heads around the model's own attention
            (``tpflow.ops.ulysses_attention``), the heads (per tensor-parallel rank) a multiple of the ranks.

    Example::

        >>> import tpflow as tpf
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)                                            # the same model on every rank
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
        ...                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        >>> ids = torch.randint(0, 64, (2, 8))
        >>> model(ids, labels=ids).loss                                         # one device's
        tensor(4.1710, grad_fn=<NllLossBackward0>)
        >>> plan = tpf.hf_plan(model, context_parallel="ring")
        >>> plan["model.layers.*.self_attn"]
        ContextParallel(kind='ring')
        >>> model = tpf.parallelize(model, placement=P, plan=plan)
        >>> out = model(ids, labels=ids)                                        # whole ids in, 4 tokens a rank
        >>> out.loss, tpf.get_sbp(out.logits)
        (tensor(4.1710, grad_fn=<_AllReduceIdentityBackward>), (sbp.split(dim=1),))
    """

    kind: str = "ring"

    def __post_init__(self) -> None:
        if self.kind not in ("ring", "ulysses"):
            raise ValueError(f"ContextParallel(kind={self.kind!r}): use 'ring' or 'ulysses'")


Entry = ColumnParallel | RowParallel | Replicated | SequenceParallel | GatherSequence | VocabParallel | \
    ExpertTensorParallel | ExpertParallel | ContextParallel

# Hugging Face's style names (transformers' ALL_PARALLEL_STYLES) and tpflow's own, as entries
STYLES: dict[str, Entry] = {
    "column": ColumnParallel(),
    "row": RowParallel(),
    "colwise": ColumnParallel(),
    "rowwise": RowParallel(),
    "rowwise_rep": RowParallel(),
    "colwise_gather_output": ColumnParallel(gather_output=True),
    "colwise_rep": ColumnParallel(gather_output=True),
    "rowwise_split_input": RowParallel(input_is_parallel=False),
    "replicated_with_grad_allreduce": Replicated(grads="partial"),
    "replicate": Replicated(),
    "sequence_parallel": SequenceParallel(),
    "vocab": VocabParallel(),
    "embedding_rowwise": VocabParallel(),
    "moe_tp_experts": ExpertTensorParallel(),
    "ep_dispatch_experts": ExpertParallel(),
}


def style_of(pattern: str, style: object) -> Entry:
    """The plan entry ``style``: a name from ``STYLES`` (tpflow's ``"column"`` / ``"row"`` or Hugging Face's
    ``"colwise"``, ``"rowwise"``, ...) or an entry itself; anything else is a ValueError naming ``pattern`` and
    the supported names.

    Args:
        pattern: the plan's key for the entry, named in the error.
        style: the plan's value: a name or an entry (``tpf.ColumnParallel(...)``, ``tpf.RowParallel(...)``,
            ``tpf.Replicated(...)``, ``tpf.SequenceParallel(...)``).

    Returns:
        ``style`` itself if it is an entry already, else the one its name stands for.

    Example::

        >>> import tpflow as tpf
        >>> from tpflow.plans.styles import style_of
        >>> style_of("*.fc1", "column") == tpf.ColumnParallel()
        True
        >>> style_of("lm_head", "colwise_gather_output").gather_output
        True
        >>> style_of("*.fc2", tpf.RowParallel(sequence_parallel=True))
        RowParallel(input_is_parallel=True, sequence_parallel=True, algo='auto', sequence_dim=0)
    """
    if isinstance(style, (ColumnParallel, RowParallel, Replicated, SequenceParallel, GatherSequence, VocabParallel,
                          ExpertTensorParallel, ExpertParallel, ContextParallel)):
        return style
    if isinstance(style, str) and style in STYLES:
        return STYLES[style]
    names = ", ".join(repr(n) for n in STYLES)
    raise ValueError(f"plan[{pattern!r}] = {style!r} is not a style tpflow knows: use one of {names}, or "
                     f"tpf.ColumnParallel(...), tpf.RowParallel(...), tpf.Replicated(...), tpf.SequenceParallel(...), "
                     f"tpf.VocabParallel(...), tpf.ExpertTensorParallel(), tpf.ExpertParallel(), "
                     f"tpf.ContextParallel(...)")
