"""The replicated style: a module left whole on every rank, named in the plan to say how its gradient is found."""

from __future__ import annotations

import dataclasses

from torch import nn

from tpflow.layers.replicated import GRADS
from tpflow.plans.style import Plan, Style

__all__ = ["Replicated"]


@dataclasses.dataclass(frozen=True)
class Replicated(Style):
    """Plan style for a module left whole on every rank, whose own parameters become global tensors broadcast
    over the placement (``tpflow.layers.replicated``); its forward is unchanged.

    ``parallelize`` does this to every module with parameters that no entry replaces; the entry says how its
    gradient is found. HF's ``"replicated_with_grad_allreduce"`` is ``Replicated(grads="partial")``.

    Args:
        grads: ``"partial"``: the module sees this rank's part of the data (Qwen3's per-head ``q_norm``), so its
            gradients are summed over the tensor-parallel ranks; ``"whole"``: it sees the same data on every rank;
            ``"auto"`` (the default): found from the autograd graph on its first call with gradients.
        why: why the module stays whole, where a plan says so (``planned``'s state spaces and recurrences).

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
    why: str = ""

    def __post_init__(self) -> None:
        if self.grads not in GRADS:
            raise ValueError(f"Replicated(grads={self.grads!r}): use one of {GRADS}")

    def apply(self, name: str, module: nn.Module, plan: Plan) -> None:
        plan.replicate_as(name, self.grads)  # parallelize then replicates it, with the rest
