"""The experts entries: a mixture of experts' experts module split over the ranks, each expert by its intermediate
dim (``"moe_tp_experts"``) or whole experts shared out (``"ep_dispatch_experts"``), by ``tpflow.layers.experts``."""

from __future__ import annotations

import dataclasses

from torch import nn

from tpflow.layers.experts import check_experts, experts_axis, split_experts
from tpflow.plans.style import Plan, Style

__all__ = ["ExpertParallel", "ExpertTensorParallel"]


@dataclasses.dataclass(frozen=True)
class ExpertTensorParallel(Style):
    """Plan style for a mixture of experts' experts module (Hugging Face's ``"moe_tp_experts"``): every expert split
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

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        check_experts(name, module, plan.world, "intermediate")

    def apply(self, name: str, module: nn.Module, plan: Plan) -> None:
        split_experts(module, plan.placement, "intermediate", None)


@dataclasses.dataclass(frozen=True)
class ExpertParallel(Style):
    """Plan style for a mixture of experts' experts module split by whole experts (``tpf.hf_plan(model,
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

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        if self.axis is None:
            check_experts(name, module, plan.world, "experts")
            return
        named = plan.named  # over a data axis of the named placement, and by the intermediate dim over its tensor axis
        check_experts(name, module, named.hierarchy[experts_axis(named, self.axis)], "experts")
        if named.hierarchy[-1] > 1:
            check_experts(name, module, named.hierarchy[-1])

    def apply(self, name: str, module: nn.Module, plan: Plan) -> None:
        split_experts(module, plan.placement if self.axis is None else plan.named, "experts", self.axis)
