"""Multi-head latent attention's shared projection (DeepSeek-V2's ``kv_a_proj_with_mqa``): transformers'
``"mla_kv_a_proj"`` style.

The projection stays whole on every rank. Its output is the latent (``kv_lora_rank``), which the column-parallel
``kv_b_proj`` expands into this rank's heads (its backward sums the latent's gradient over the ranks), and one rotary
key (``qk_rope_head_dim``) that every head shares and that goes to attention directly: each rank's attention reads it
for its own heads, so its gradient is this rank's share. The entry sums that part's gradient over the tensor-parallel
ranks (identity forward), so that the projection's whole output, and so its weight, gets one device's gradient.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tpflow import comm
from tpflow.layers.regions import WHOLE, tag
from tpflow.plans.style import Plan, Style

__all__ = ["LatentKeyValue"]


@dataclasses.dataclass(frozen=True)
class LatentKeyValue(Style):
    """Plan style for MLA's shared key / value projection (``kv_a_proj_with_mqa``), kept whole on every rank: the
    gradient of the rotary key its output ends with is summed over the tensor-parallel ranks, whose heads each read it.

    Example::

        >>> import tpflow as tpf
        >>> from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
        >>> model = DeepseekV2ForCausalLM(DeepseekV2Config(
        ...     vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=1,
        ...     num_attention_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        ...     v_head_dim=8, head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1))
        >>> tpf.hf_plan(model)["model.layers.*.self_attn.kv_a_proj_with_mqa"]
        LatentKeyValue()
    """

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        rope = _rope_dim(plan.model)
        if not isinstance(module, nn.Linear) or rope is None or not 0 < rope < module.out_features:
            raise ValueError(f"{name!r}: LatentKeyValue takes MLA's nn.Linear kv_a_proj_with_mqa, whose output ends "
                             f"with the config's qk_rope_head_dim features; got a {type(module).__name__} and "
                             f"qk_rope_head_dim={rope}")
        heads = getattr(_text_config(plan.model), "num_attention_heads", None)
        if isinstance(heads, int) and heads % plan.world:  # (its q_b_proj / kv_b_proj split the heads)
            fits = [d for d in range(1, heads + 1) if heads % d == 0]
            raise ValueError(f"{name!r}: MLA's {heads} attention heads do not split over {plan.world} tensor-parallel "
                             f"ranks: use {', '.join(map(str, fits[:-1]))} or {fits[-1]} ranks")

    def apply(self, name: str, module: nn.Module, plan: Plan) -> None:
        pl = plan.placement
        group = pl.mesh.get_group(pl.ndim - 1) if pl.hierarchy[-1] > 1 and pl.coordinate() is not None else None
        rope = _rope_dim(plan.model)

        def rotary_key_summed(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            latent, key = out.split([out.shape[-1] - rope, rope], dim=-1)
            # whole, and its gradient one device's: the norms before it see whole data (a walk back stops here)
            return tag(torch.cat([latent, comm.copy_to_ranks(key, group)], dim=-1), WHOLE)

        if group is not None:
            module.register_forward_hook(rotary_key_summed)
        plan.replicate_as(name, "whole")  # its whole output's gradient is one device's now


def _text_config(model: nn.Module) -> object:
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _rope_dim(model: nn.Module) -> int | None:
    return getattr(_text_config(model), "qk_rope_head_dim", None)
