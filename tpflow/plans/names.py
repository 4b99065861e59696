"""Plan entries by name: tpflow's (``"column"``, ``"row"``, ``"vocab"``) and Hugging Face's style strings
(``config.base_model_tp_plan``: ``"colwise"``, ``"rowwise"``, ...), and what a plan's value becomes: an entry of
tpflow's or a user's own (``tpf.Style``), a name, or one of torch's own styles (``tpflow.plans.torch_styles``).

    "column"                              ColumnParallel(): W split(1)
    "row"                                 RowParallel(): W split(0)
    "vocab"                               VocabParallel(): an embedding or an output head split over the vocabulary
    "replicated_with_grad_allreduce"      Replicated(grads="partial"): whole, gradients summed over the ranks
    "sequence_parallel"                   SequenceParallel(): runs on this rank's tokens
    "moe_tp_experts"                      ExpertTensorParallel(): every expert split over the ranks
    "ep_dispatch_experts"                 ExpertParallel(): the experts shared out over the ranks, whole
    "mla_kv_a_proj"                       LatentKeyValue(): MLA's shared projection, its rotary key's gradient summed
    "all_reduce"                          SummedParameters(dims): its parameters split as their own entries say, its
                                          output summed (``hf_plan`` writes it; by name alone it says no dims)
    "local_params"                        Replicated(): a module whose split parameters it reads as local tensors,
                                          as every tpflow layer does (its own per-head ones split with the heads)
"""

from __future__ import annotations

from torch import nn

from tpflow.plans.experts import ExpertParallel, ExpertTensorParallel
from tpflow.plans.linear import ColumnParallel, RowParallel
from tpflow.plans.mla import LatentKeyValue
from tpflow.plans.replicated import Replicated
from tpflow.plans.sequence import SequenceParallel
from tpflow.plans.style import Style
from tpflow.plans.torch_styles import from_torch, is_torch_style
from tpflow.plans.vocab import VocabParallel

__all__ = ["STYLES", "style_of"]

# Hugging Face's style names (transformers' ALL_PARALLEL_STYLES) and tpflow's own, as entries
STYLES: dict[str, Style] = {
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
    "mla_kv_a_proj": LatentKeyValue(),
    "local_params": Replicated(),
}


def style_of(pattern: str, style: object, module: nn.Module | None = None, head: bool = False) -> Style:
    """The plan entry ``style`` stands for: an entry itself (``tpf.Style``: tpflow's or a user's own), a name from
    ``STYLES`` (tpflow's ``"column"`` / ``"row"`` or Hugging Face's ``"colwise"``, ``"rowwise"``, ...), or one of
    torch's own styles (``ColwiseParallel()``, ...) read as tpflow's; anything else is a ValueError naming
    ``pattern`` and what to write.

    Args:
        pattern: the plan's key for the entry, named in errors.
        style: the plan's value.
        module: the matched module, which torch's styles are read against (``RowwiseParallel`` splits an
            ``nn.Embedding`` by its vocabulary, an ``nn.Linear`` by its input features).
        head: whether ``module`` is the model's output head (torch's loss-parallel ``ColwiseParallel`` is read
            there alone).

    Returns:
        The entry.

    Example::

        >>> import tpflow as tpf
        >>> from tpflow.plans.names import style_of
        >>> style_of("*.fc1", "column") == tpf.ColumnParallel()
        True
        >>> style_of("lm_head", "colwise_gather_output").gather_output
        True
        >>> style_of("*.fc2", tpf.RowParallel(sequence_parallel=True))
        RowParallel(input_is_parallel=True, sequence_parallel=True, algo='auto', sequence_dim=0)
    """
    if isinstance(style, Style):
        return style
    if isinstance(style, str) and style in STYLES:
        return STYLES[style]
    if is_torch_style(style):
        if module is None:
            raise ValueError(f"plan[{pattern!r}]: torch's {type(style).__name__} is read against the module it "
                             f"matches: pass module=")
        return from_torch(pattern, style, module, head)
    if style == "all_reduce":
        raise ValueError(f"plan[{pattern!r}] = 'all_reduce' splits the module's own parameters, which the name does "
                         f"not say: write tpf.SummedParameters(((name, dim), ...)), or let tpf.hf_plan read it with "
                         f"its parameters' 'colwise' / 'rowwise' entries")
    names = ", ".join(repr(n) for n in STYLES)
    raise ValueError(f"plan[{pattern!r}] = {style!r} is not a style tpflow knows: use one of {names}, an entry "
                     f"(tpf.ColumnParallel(...), tpf.RowParallel(...), tpf.VocabParallel(...), tpf.Replicated(...), "
                     f"tpf.SequenceParallel(...), tpf.GatherSequence(...), tpf.ExpertTensorParallel(), "
                     f"tpf.ExpertParallel(), tpf.ContextParallel(...)), a tpf.Style of your own, or one of torch's "
                     f"ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput")
