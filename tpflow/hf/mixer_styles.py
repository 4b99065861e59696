"""The plan style for each token mixer other than attention that tpflow splits over the tensor-parallel ranks, found
by what the module is (its projections and per-head parameters, as transformers writes them), not by its model's
name: the planner asks ``mixer_style`` for each mixer of a decoder layer, and keeps whole, said in the plan, what
it gets no style for."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from tpflow.hf.state_space import StateSpaceHeads, state_space_counts
from tpflow.plans.style import Style

__all__ = ["mixer_style"]

# (does the module take the style, the style): the first that takes it
_KNOWN: list[tuple[Callable[[nn.Module], object], Callable[[], Style]]] = [
    (state_space_counts, StateSpaceHeads),  # Mamba-2
]


def mixer_style(module: nn.Module) -> Style | None:
    """The plan style that splits ``module``, a token mixer, over the ranks; None where tpflow splits no such module.

    Args:
        module: a decoder layer's token mixer (or a module inside one).

    Returns:
        A style, or None.

    Example::

        >>> from transformers import Mamba2Config, Mamba2ForCausalLM
        >>> model = Mamba2ForCausalLM(Mamba2Config(vocab_size=64, hidden_size=16, num_heads=4, head_dim=8,
        ...                                        state_size=4, n_groups=2, num_hidden_layers=1))
        >>> mixer_style(model.backbone.layers[0].mixer), mixer_style(model.backbone.layers[0].norm)
        (StateSpaceHeads(), None)
    """
    return next((style() for takes, style in _KNOWN if takes(module)), None)
