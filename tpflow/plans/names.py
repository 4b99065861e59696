"""Plan styles by name, and what a plan's value becomes: a style of tpflow's or a user's own (``tpf.Style``), one
of tpflow's names, or one of torch's own styles (``tpflow.plans.torch_styles``). Hugging Face's style strings
(``"colwise"``, ``"rowwise"``, ...) are the wing's (``tpflow.hf.styles``), read into entries before the engine sees
the plan.

    "column"                              ColumnParallel(): W split(1)
    "row"                                 RowParallel(): W split(0)
    "vocab"                               VocabParallel(): an embedding or an output head split over the vocabulary
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from tpflow.plans.linear import ColumnParallel, RowParallel
from tpflow.plans.style import Style
from tpflow.plans.torch_styles import from_torch, is_torch_style
from tpflow.plans.vocab import VocabParallel

__all__ = ["STYLES", "style_of"]

# tpflow's own names, as entries (a wing adds its vocabulary's: ``tpflow.hf.styles``)
STYLES: dict[str, Style] = {"column": ColumnParallel(), "row": RowParallel(), "vocab": VocabParallel()}


def style_of(pattern: str, style: object, module: nn.Module | None = None, head: bool = False,
             names: Mapping[str, Style] = STYLES) -> Style:
    """The plan entry ``style`` stands for: an entry itself (``tpf.Style``: tpflow's or a user's own), a name from
    ``names`` (tpflow's ``"column"`` / ``"row"`` / ``"vocab"``, or a wing's vocabulary), or one of torch's own styles
    (``ColwiseParallel()``, ...) read as tpflow's; anything else is a ValueError naming ``pattern`` and what to write.

    Args:
        pattern: the plan's key for the entry, named in errors.
        style: the plan's value.
        module: the matched module, which torch's styles are read against (``RowwiseParallel`` splits an
            ``nn.Embedding`` by its vocabulary, an ``nn.Linear`` by its input features).
        head: whether ``module`` is the model's output head (torch's loss-parallel ``ColwiseParallel`` is read
            there alone).
        names: the names a plan may use (default ``STYLES``).

    Returns:
        The entry.

    Example::

        >>> import tpflow as tpf
        >>> from tpflow.plans.names import style_of
        >>> style_of("*.fc1", "column") == tpf.ColumnParallel()
        True
        >>> style_of("lm_head", "colwise_gather_output", names={"colwise_gather_output": tpf.ColumnParallel(
        ...     gather_output=True)}).gather_output
        True
        >>> style_of("*.fc2", tpf.RowParallel(sequence_parallel=True))
        RowParallel(input_is_parallel=True, sequence_parallel=True, algo='auto', sequence_dim=0)
    """
    if isinstance(style, Style):
        return style
    if isinstance(style, str) and style in names:
        return names[style]
    if is_torch_style(style):
        if module is None:
            raise ValueError(f"plan[{pattern!r}]: torch's {type(style).__name__} is read against the module it "
                             f"matches: pass module=")
        return from_torch(pattern, style, module, head)
    known = ", ".join(repr(n) for n in names)
    raise ValueError(f"plan[{pattern!r}] = {style!r} is not a style tpflow knows: use one of {known}, an entry "
                     f"(tpf.ColumnParallel(...), tpf.RowParallel(...), tpf.VocabParallel(...), tpf.Replicated(...), "
                     f"tpf.SequenceParallel(...), tpf.GatherSequence(...), tpf.ExpertTensorParallel(), "
                     f"tpf.ExpertParallel(), tpf.ContextParallel(...)), a tpf.Style of your own, or one of torch's "
                     f"ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput")
