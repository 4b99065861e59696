"""Hugging Face's style strings (transformers' ``ALL_PARALLEL_STYLES``, as ``config.base_model_tp_plan`` writes them)
read as tpflow entries, before the engine (``tpflow.plans``) sees a plan.

    "colwise", "rowwise"                  ColumnParallel(), RowParallel()
    "colwise_gather_output", "colwise_rep"    ColumnParallel(gather_output=True)
    "rowwise_split_input"                 RowParallel(input_is_parallel=False)
    "replicated_with_grad_allreduce"      Replicated(grads="partial"): whole, gradients summed over the ranks
    "sequence_parallel"                   SequenceParallel(): runs on this rank's tokens
    "embedding_rowwise"                   VocabParallel(): the embedding split over the vocabulary
    "moe_tp_experts"                      ExpertTensorParallel(): every expert split over the ranks
    "ep_dispatch_experts"                 ExpertParallel(): the experts shared out over the ranks, whole
    "mla_kv_a_proj"                       LatentKeyValue(): MLA's shared projection, its rotary key's gradient summed
    "all_reduce"                          SummedParameters(dims): its parameters split as their own entries say, its
                                          output summed (``hf_plan`` writes it; by name alone it says no dims)
    "local_params"                        Replicated(): a module whose split parameters it reads as local tensors,
                                          as every tpflow layer does (its own per-head ones split with the heads)
"""

from __future__ import annotations

from collections.abc import Mapping

from tpflow.hf.mla import LatentKeyValue
from tpflow.plans.experts import ExpertParallel, ExpertTensorParallel
from tpflow.plans.linear import ColumnParallel, RowParallel
from tpflow.plans.names import STYLES, style_of
from tpflow.plans.replicated import Replicated
from tpflow.plans.sequence import SequenceParallel
from tpflow.plans.style import Style
from tpflow.plans.vocab import VocabParallel

__all__ = ["HF_STYLES", "NAMES", "entries", "hf_style"]

HF_STYLES: dict[str, Style] = {
    "colwise": ColumnParallel(),
    "rowwise": RowParallel(),
    "rowwise_rep": RowParallel(),
    "colwise_gather_output": ColumnParallel(gather_output=True),
    "colwise_rep": ColumnParallel(gather_output=True),
    "rowwise_split_input": RowParallel(input_is_parallel=False),
    "replicated_with_grad_allreduce": Replicated(grads="partial"),
    "replicate": Replicated(),
    "sequence_parallel": SequenceParallel(),
    "embedding_rowwise": VocabParallel(),
    "moe_tp_experts": ExpertTensorParallel(),
    "ep_dispatch_experts": ExpertParallel(),
    "mla_kv_a_proj": LatentKeyValue(),
    "local_params": Replicated(),
}
NAMES: dict[str, Style] = {**STYLES, **HF_STYLES}  # every name a plan given to tpf.parallelize may use


def hf_style(pattern: str, style: object) -> object:
    """The entry a plan value names: tpflow's names and Hugging Face's as entries (anything else a string is a
    ValueError listing the names); an entry or one of torch's own styles as given (the engine reads those against the
    module they match).

    Args:
        pattern: the plan's key, named in errors.
        style: the plan's value.

    Returns:
        The entry, or ``style`` itself.

    Example::

        >>> hf_style("lm_head", "colwise_gather_output")
        ColumnParallel(gather_output=True, sequence_parallel=False, algo='auto', keep_gathered=True, sequence_dim=0, \
fuse=False)
    """
    if style == "all_reduce":
        raise ValueError(f"plan[{pattern!r}] = 'all_reduce' splits the module's own parameters, which the name does "
                         f"not say: write tpf.SummedParameters(((name, dim), ...)), or let tpf.hf_plan read it with "
                         f"its parameters' 'colwise' / 'rowwise' entries")
    return style_of(pattern, style, names=NAMES) if isinstance(style, str) else style


def entries(plan: Mapping[str, object]) -> dict[str, object]:
    """``plan`` with its names read as entries (``hf_style``), in its order.

    Args:
        plan: ``fnmatch`` patterns mapped to entries, names or torch's styles.

    Returns:
        The same patterns mapped to entries (torch's styles as given).

    Example::

        >>> entries({"*.q_proj": "colwise", "*.o_proj": "row"})["*.q_proj"] == tpf.ColumnParallel()
        True
    """
    return {pattern: hf_style(pattern, style) for pattern, style in plan.items()}
