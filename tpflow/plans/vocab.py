"""The vocabulary style: a language model's embedding or output head split over the vocabulary (``"vocab"``, Hugging
Face's ``"embedding_rowwise"``); a head's logits come back split, and the model's own loss takes them so."""

from __future__ import annotations

import dataclasses

from torch import nn

from tpflow.layers import ColumnParallelLinear, ShardedModule, VocabParallelEmbedding
from tpflow.layers.layouts import Layouts, Side, sequence_splits
from tpflow.layers.vocab import ranks_without_rows
from tpflow.placement import Placement
from tpflow.plans.logits import route_loss
from tpflow.plans.style import Plan, Style
from tpflow.sbp import broadcast

__all__ = ["VocabParallel"]

_HIDDEN = Layouts(hidden_sbp=Side(  # the hidden states': the embedding's output, the head's input
    {broadcast: {"sequence_parallel": False}, **sequence_splits(sequence_parallel=True)},
    "sbp.broadcast (whole on every rank) or, for sequence parallelism, sbp.split(0) / sbp.split(1) (this rank's "
    "chunk of the sequence dim)"))


@_HIDDEN.said_in_sbp  # hidden_sbp=, stored as the flags it stands for
@dataclasses.dataclass(frozen=True)
class VocabParallel(Style):
    """Plan style for a language model's embedding or output head, split over the vocabulary (``"vocab"``; Hugging
    Face's ``"embedding_rowwise"``).

    An ``nn.Embedding`` becomes a ``VocabParallelEmbedding`` (its rows split over the ranks, the lookups summed);
    an ``nn.Linear`` head becomes a ``ColumnParallelLinear`` whose logits come back as a global tensor split over
    the vocabulary (``global_output=True``), which ``tpf.cross_entropy`` takes without gathering them, and which
    a model's own ``F.cross_entropy`` takes too (``parallelize`` enters ``tpf.vocab_parallel_loss()`` after the
    head runs). A head tied to its embedding holds the same rows of the same matrix: the pair stays one parameter.

    Args:
        hidden_sbp: the layout of the hidden states on the model's side, the embedding's output and the head's
            input (the ids are whole, the logits split over the vocabulary): ``sbp.broadcast`` (the default: whole
            on every rank) or, for sequence parallelism, ``sbp.split(0)`` / ``sbp.split(1)``: the embedding
            reduce-scatters its output into this rank's chunk of that dim (the sequence of ``[seq, batch, hidden]``
            / ``[batch, seq, hidden]``), and the head takes such a chunk and gathers it into its product.
        sequence_parallel, sequence_dim: aliases of ``hidden_sbp``: ``sequence_parallel=True, sequence_dim=d`` is
            ``sbp.split(d)``; False (default) is ``sbp.broadcast``.

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

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        if type(module) is not nn.Linear and (not isinstance(module, nn.Embedding)
                                              or isinstance(module, VocabParallelEmbedding)):
            raise ValueError(f"plan pattern {plan.pattern(name)!r} gives {name!r}, a {type(module).__name__}, a "
                             f"vocabulary entry, which takes an nn.Embedding (an embedding) or an nn.Linear (a head)")
        if isinstance(module, nn.Embedding) and (empty := ranks_without_rows(module.num_embeddings, plan.world)):
            raise ValueError(f"plan pattern {plan.pattern(name)!r}: {name!r} has {module.num_embeddings} rows, which "
                             f"leave ranks {empty} of {plan.world} none (torch.chunk's blocks): use fewer "
                             f"tensor-parallel ranks, or leave it out of the plan")
        if isinstance(module, nn.Embedding):
            VocabParallelEmbedding.check_embedding(module, **dataclasses.asdict(self))
        else:
            ColumnParallelLinear.check_options(global_output=True, **dataclasses.asdict(self))

    def apply(self, name: str, module: nn.Module, plan: Plan) -> nn.Module:
        layer = self.build(module, plan.placement)
        layer.label = f"{type(layer).__name__} {name!r}"
        if isinstance(layer, ColumnParallelLinear):  # a head: the model's own loss on its split logits
            route_loss(plan.model, [layer])
        return layer

    def layout(self, module: nn.Module) -> dict[str, int | None]:
        return {"weight": 0, "bias": 0}  # an embedding's [vocab, dim] rows, a head's [vocab, in] and its bias

    def reads_whole(self, module: nn.Module) -> bool:
        return isinstance(module, nn.Embedding) or not self.sequence_parallel  # an embedding reads every id

    @property
    def splits_sequence(self) -> bool:
        return self.sequence_parallel
