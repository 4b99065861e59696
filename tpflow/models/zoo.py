"""Every causal LM transformers registers, built tiny (random weights, nothing downloaded): the zoo the support
matrix (``python -m tpflow.models``) sweeps.

A registered config's defaults are a full-size model. ``tiny_config`` shrinks every size it knows by name (widths,
heads, layers, experts, the vocabulary), in the config and in its text sub-config, and keeps one layer of each kind
a hybrid stacks (attention, state space, linear attention, dense or sparse MLP) so that every mixer is checked.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["VOCAB", "causal_lm_types", "tiny_config", "tiny_model"]

VOCAB = 101  # uneven blocks of the vocabulary over 2 and 4 ranks

# sizes by the names configs give them; a config takes those it has
_SIZES = {
    "vocab_size": VOCAB, "hidden_size": 64, "d_model": 64, "n_embd": 64, "dim": 64, "embed_dim": 64,
    "intermediate_size": 96, "ffn_hidden_size": 96, "n_inner": 96, "ffn_dim": 96, "decoder_ffn_dim": 96,
    "encoder_ffn_dim": 96, "encoder_attention_heads": 4,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "decoder_attention_heads": 4, "n_heads": 4,
    "num_key_value_heads": 2, "num_kv_heads": 2, "n_kv_heads": 2, "multi_query_group_num": 2,
    "head_dim": 16, "kv_channels": 16,
    "max_position_embeddings": 64, "n_positions": 64, "n_ctx": 64, "seq_length": 64,
    "moe_intermediate_size": 48, "expert_intermediate_size": 48, "shared_expert_intermediate_size": 80,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "moe_k": 2, "top_k": 2,
    "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "qk_head_dim": 16,
    "sliding_window": 4, "attention_chunk_size": 4, "sliding_window_size": 4, "attention_window_size": 4,
    "rotary_dim": 8, "query_pre_attn_scalar": 16, "emb_dim": 64, "lru_width": 64, "swa_head_dim": 16,
    "mamba_n_heads": 8, "mamba_d_state": 16, "mamba_chunk_size": 4, "mamba_d_head": 16, "shared_intermediate_size": 80,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_head_dim": 16, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "expert_ffn_hidden_size": 48, "zero_expert_num": 2, "unpadded_vocab_size": VOCAB,
    "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8, "num_dense_layers": 1,
    "image_size": 32, "patch_size": 8, "num_channels": 3, "out_hidden_size": 64, "projection_dim": 64,
}
_DERIVED = ("head_dim", "num_key_value_heads", "num_experts_per_tok", "n_routed_experts", "moe_intermediate_size")
# what a family needs besides the sizes by name (its layer kinds derived from a period, a check of its own)
_FAMILY = {
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"]},
    "recurrent_gemma": {"num_hidden_layers": 3},
    "zaya": {"num_experts_per_tok": 1},
    "mamba2": {"num_heads": 8},
    "kimi_linear": {"num_hidden_layers": 3},
    "deepseek_v2": {"topk_group": 1, "n_group": 1},
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [32, 32], "axial_pos_shape": [8, 8]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
}
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers")
MAX_PARAMETERS = 20_000_000  # a config whose sizes are named otherwise stays big: refused, not built


def causal_lm_types() -> list[str]:
    """Every model type transformers' ``AutoModelForCausalLM`` builds, sorted.

    Returns:
        The model types (``"llama"``, ``"gpt2"``, ...).

    Example::

        >>> "llama" in causal_lm_types() and "gpt2" in causal_lm_types()
        True
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _layer_kinds(values: dict, count: int) -> list[int]:
    """The layers to keep of ``count``: the first of each distinct kind (over every per-layer list), at least 2."""
    lists = [v for v in values.values() if isinstance(v, (list, tuple)) and len(v) == count and count > 2]
    kinds = {}
    for i in range(count):
        kinds.setdefault(tuple(str(v[i]) for v in lists), i)
    keep = sorted(kinds.values())
    return keep if len(keep) >= 2 else list(range(min(2, count)))


def _shrunk(values: dict) -> dict:
    """``values`` (a config's ``to_dict()``) with its sizes shrunk and one layer of each kind kept."""
    out = {k: _SIZES[k] for k in values if (k in _SIZES and isinstance(values[k], int) and values[k] > 0)
           or (k in _DERIVED and values[k] is None)}
    for key in _LAYER_COUNTS:
        count = values.get(key)
        if isinstance(count, int) and count > 0:
            keep = _layer_kinds(values, count)
            out[key] = len(keep)
            for name, v in values.items():
                if isinstance(v, (list, tuple)) and len(v) == count and count > 2:
                    out[name] = type(v)(v[i] for i in keep)
    for name, v in values.items():  # dropout off: the numbers compared must not draw random masks
        if isinstance(v, float) and ("dropout" in name or "pdrop" in name or "jitter" in name or name == "layerdrop"):
            out[name] = 0.0
    for name in ("text_config", "decoder", "language_config", "vision_config", "audio_config", "attn_config",
                 "ffn_config"):
        if isinstance(values.get(name), dict):
            out[name] = {**values[name], **_shrunk(values[name])}
    for token in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        if isinstance(values.get(token), int) and values[token] >= VOCAB:
            out[token] = VOCAB - 1 - ("eos" in token)
    return out


def tiny_config(kind: str):
    """The config of ``kind`` shrunk to a tiny model of 2 or more layers (one of each kind a hybrid stacks).

    Args:
        kind: a model type, one of ``causal_lm_types()``.

    Returns:
        A ``transformers.PretrainedConfig``.

    Example::

        >>> tiny_config("llama").hidden_size, tiny_config("llama").num_hidden_layers
        (64, 2)
    """
    import transformers

    values = transformers.AutoConfig.for_model(kind).to_dict()
    shrunk = _shrunk(values)
    if shrunk.get("qk_rope_head_dim"):  # MLA: the rotary part is a head's width, a key / value head per query head
        shrunk["head_dim"] = shrunk["qk_rope_head_dim"]
        shrunk["num_key_value_heads"] = shrunk.get("num_attention_heads", 4)
    if isinstance(values.get("per_layer_config"), dict):  # per-layer overrides for layers the tiny model lacks
        shrunk["per_layer_config"] = {}
    return transformers.AutoConfig.for_model(kind, **{**shrunk, **_FAMILY.get(kind, {})})


def tiny_model(kind: str, seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Module:
    """A tiny ``AutoModelForCausalLM`` of ``kind`` with random weights (the same on every rank for one ``seed``),
    eager experts (a loop, exact in fp64).

    Args:
        kind: a model type.
        seed: the weights' seed.
        dtype: the parameters' dtype (fp64: a checked number compares to 1e-9, not to fp32's rounding).

    Returns:
        The model, in train mode.

    Example::

        >>> type(tiny_model("llama")).__name__
        'LlamaForCausalLM'
    """
    import transformers

    config = tiny_config(kind)
    with torch.device("meta"):
        count = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    if count > MAX_PARAMETERS:
        raise ValueError(f"{kind}: its config names its sizes otherwise: {count:,} parameters after shrinking")
    torch.manual_seed(seed)
    try:
        model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    except (TypeError, ValueError):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(dtype).train()
