"""transformers' experts on tpflow's grouped GEMM: ``experts_implementation="tpflow"``.

transformers' MoE models keep their experts in one module of 3-D weights and pick its forward by name from
``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS`` (``"grouped_mm"``: ``torch._grouped_mm``, ``"batched_mm"``,
...). ``register_experts_implementation`` adds ``"tpflow"``, which computes what ``"grouped_mm"`` computes with
``tpflow.kernels.grouped_mm``:

    sort the (token, expert) pairs by expert; offs = each expert's end row
    h   = act(x @ gate) * (x @ up)    one launch where the module's gate is transformers' default (act(gate) * up on
                                      [gate half ; up half]) with silu / gelu-tanh / relu and no bias; else the
                                      product, its bias, then the module's own _apply_gate (gpt-oss: interleaved)
    out = h @ down (+ bias, post-expert norm), scaled by the routing weights, summed per token

Expert parallelism's sentinel ids (``num_experts`` and above, another rank's tokens) sort past every expert: the
grouped GEMM writes zeros on those rows and their gradients, so they add nothing and cost no product.
transformers is imported when ``register_experts_implementation`` is called, not with tpflow.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpflow.kernels.grouped import grouped_mm

__all__ = ["experts_forward", "register_experts_implementation"]

NAME = "tpflow"


def _fused_activation(module: nn.Module) -> str | None:
    """The activation the kernels fuse for ``module``'s act_fn, or None where they do not compute it exactly."""
    from transformers import activations

    kinds = {activations.SiLUActivation: "silu", nn.SiLU: "silu", activations.GELUTanh: "gelu",
             activations.NewGELUActivation: "gelu", nn.ReLU: "relu"}
    return kinds.get(type(getattr(module, "act_fn", None)))


def _bias_rows(bias: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each sorted row's expert's bias (``bias [E, N]``); zeros on the sentinels' rows."""
    return F.pad(bias, (0, 0, 0, 1))[ids.clamp(max=bias.shape[0])]


def _up(module: nn.Module, x: torch.Tensor, ids: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The up projection and its gate (or activation) on the sorted rows."""
    from transformers.integrations.moe import _default_apply_gate

    w = module.gate_up_proj if module.has_gate else module.up_proj
    w = w if module.is_transposed else w.mT
    act = None if module.has_bias else _fused_activation(module)
    if module.has_gate and act is not None and type(module)._apply_gate is _default_apply_gate:
        return grouped_mm(x.to(w.dtype), w, offs, activation=act, gated=True)
    if not module.has_gate and act is not None:
        return grouped_mm(x.to(w.dtype), w, offs, activation=act)
    h = grouped_mm(x.to(w.dtype), w, offs)
    if module.has_bias:
        h = h + _bias_rows(module.gate_up_proj_bias if module.has_gate else module.up_proj_bias, ids)
    return module._apply_gate(h) if module.has_gate else module.act_fn(h)


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ``"tpflow"`` experts implementation: transformers' ``grouped_mm_experts_forward`` on
    ``tpflow.kernels.grouped_mm``, for an experts module decorated by ``use_experts_implementation``.

    Args:
        self: the experts module (its ``gate_up_proj`` / ``up_proj``, ``down_proj``, biases, ``act_fn`` and flags).
        hidden_states: ``[tokens, hidden]``.
        top_k_index: ``[tokens, k]`` expert ids; ids from ``num_experts`` up (expert parallelism's sentinels) add
            nothing.
        top_k_weights: ``[tokens, k]`` routing weights.

    Returns:
        ``[tokens, hidden]`` in hidden_states' dtype.

    Example::

        >>> from transformers import Qwen3MoeConfig
        >>> from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
        >>> cfg = Qwen3MoeConfig(hidden_size=8, moe_intermediate_size=4, num_experts=3)
        >>> experts = Qwen3MoeExperts(cfg)
        >>> for p in experts.parameters():
        ...     _ = torch.nn.init.normal_(p)
        >>> x, ids, weights = torch.randn(5, 8), torch.randint(0, 3, (5, 2)), torch.rand(5, 2)
        >>> experts_forward(experts, x, ids, weights).shape
        torch.Size([5, 8])
    """
    num_tokens, k = top_k_index.shape
    ids, perm = torch.sort(top_k_index.reshape(-1))
    x = hidden_states[perm // k]
    offs = torch.searchsorted(ids, torch.arange(1, self.num_experts + 1, device=ids.device), out_int32=True)
    h = _up(self, x, ids, offs)
    down = self.down_proj if self.is_transposed else self.down_proj.mT
    out = grouped_mm(h.to(down.dtype), down, offs)
    if self.has_bias:
        out = out + _bias_rows(self.down_proj_bias, ids)
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    weighted = out * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return weighted[inverse].view(num_tokens, k, -1).sum(1).to(hidden_states.dtype)


def register_experts_implementation() -> None:
    """Add ``"tpflow"`` to transformers' experts implementations (``ALL_EXPERTS_FUNCTIONS``); calling it again does
    nothing more. Then ``from_pretrained`` / ``from_config(..., experts_implementation="tpflow")`` and
    ``model.set_experts_implementation("tpflow")`` run the experts on ``tpflow.kernels.grouped_mm``.

    Example::

        >>> import transformers
        >>> register_experts_implementation()
        >>> cfg = transformers.Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=16,
        ...                                   moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
        ...                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        ...                                   head_dim=8)
        >>> model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="tpflow")
        >>> model.config._experts_implementation
        'tpflow'
        >>> model(torch.tensor([[1, 2, 3]])).logits.shape
        torch.Size([1, 3, 32])
    """
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(NAME, experts_forward)
