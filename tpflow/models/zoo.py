"""Every causal LM transformers registers, built tiny (random weights, nothing downloaded): the zoo the support
matrix (``python -m tpflow.models``) sweeps.

A registered config's defaults are a full-size model. ``tiny_config`` shrinks every size it knows by name (widths,
heads, layers, experts, the vocabulary), in the config and in its sub-configs, and keeps one layer of each kind
a hybrid stacks (attention, state space, linear attention, dense or sparse MLP, a layer reusing another's keys and
values, a layer with overrides of its own) so that every mixer is checked.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["VOCAB", "causal_lm_types", "ratio_types", "tiny_config", "tiny_model"]

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
    "kv_n_heads": 2, "moe_top_k": 2, "num_experts_per_token": 2, "num_expert_group": 1, "linear_num_heads": 4,
    "mamba_d_ssm": 128, "hc_lowrank": 16, "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
    "indexer_budget": 8, "indexer_compress_ratio": 4, "attention_head_size": 16, "feed_forward_size": 96,
    "hidden_size_global": 64, "encoder_hash_byte_group_vocab": 211, "local_attention_window_len": 4,
    "shared_experts_intermediate_size": 80, "adapter_in_dim": 64, "adapter_out_dim": 64, "adapter_input_size": 64,
}
# sizes a config may leave None that the tiny model sets (derived from others, or an indexer the layers need)
_DERIVED = ("head_dim", "num_key_value_heads", "num_experts_per_tok", "n_routed_experts", "moe_intermediate_size",
            "indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
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
    # training takes the sequence (16) as the axial shape's product and a multiple of every chunk; LSH chunked
    # only past 16 tokens (its cached decoding fails on a chunked LSH layer)
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [32, 32], "axial_pos_shape": [4, 4],
                 "local_attn_chunk_length": 4, "lsh_attn_chunk_length": 16},
    # its default config makes every layer attention (full_attn_idxs all 32): a convolution layer, an attention one
    "lfm2": {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "dbrx": {"attn_config": {"clip_qkv": 8.0, "rope_theta": 500000.0}},  # its checkpoints' values: its code reads them
    "dots1": {"n_shared_experts": 1, "first_k_dense_replace": 1},  # as its checkpoints (unset, 0 by default)
    "dots3_note_text": {"head_dim": 16},  # its sliding layers' heads: qk_nope_head_dim + qk_rope_head_dim wide
    "dots3_note": {"text_config": {"head_dim": 16}},
    # its hybrid layers share one attention block, tied from the first to the others: two of them; its Mamba heads
    # split over 4 ranks
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"],
              "n_mamba_heads": 4},
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "git": {"num_image_with_embedding": 0},  # text only: no image tokens for its loss to skip
    "xmod": {"default_language": "en_XX"},
    "xlstm": {"hidden_size": 128, "embedding_dim": 128},  # its cache rounds half the width up to 64s, its layers not
    "blt": {"use_cache": False},  # its cache is sized by the top config, which has no layers
    "big_bird": {"attention_type": "original_full"},  # a decoder's, as BigBirdForCausalLM asks
    # its attention computes in four model-parallel blocks (mp_num, fixed), each a quarter of the heads: 16 heads
    # as CodeGen-350M's, so that each block's split over 4 ranks
    "codegen": {"n_head": 16, "rotary_dim": 4},
}
# modules a model keeps in fp32 whatever its dtype, as its forward casts their inputs to fp32 (Inkling 2's router)
_FP32 = {"inkling2_text": "mlp.gate"}
# what transformers cannot run tiny here on tokens alone, said rather than tried
_DRAFTER = "a drafter: it runs on its target model's keys and values, not on tokens alone"
_CODEBOOKS = "a decoder of audio codebooks: its ids and labels are laid out per codebook"
_UNBUILT = {"gemma4_assistant": _DRAFTER, "gemma4_unified_assistant": _DRAFTER, "musicgen": _CODEBOOKS,
            "musicgen_melody": _CODEBOOKS,
            "xglm": "its attention clamps fp64 scores with an fp32 scalar of fp64's least value: an overflow"}
_TOP_K = ("num_experts_per_tok", "moe_topk", "moe_k", "top_k", "moe_top_k", "num_experts_per_token")
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
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


def _layer_kinds(lists: list, count: int) -> list[int]:
    """The layers to keep of ``count``: the first of each distinct kind (over every per-layer list), at least 2."""
    kinds = {}
    for i in range(count):
        kinds.setdefault(tuple(str(v[i]) for v in lists), i)
    keep = sorted(kinds.values())
    return keep if len(keep) >= 2 else list(range(min(2, count)))


def _shrunk(values: dict) -> dict:
    """``values`` (a config's ``to_dict()``) with its sizes shrunk and one layer of each kind kept."""
    out = {k: _SIZES[k] for k, v in values.items() if (k in _SIZES and isinstance(v, int) and v > 0)
           or (k in _DERIVED and v is None)}
    out |= {k: [_SIZES[k]] * len(v) for k, v in values.items()  # a size per layer (Gemma 3n's MLP widths)
            if k in _SIZES and isinstance(v, list) and v and all(isinstance(x, int) and x > 0 for x in v)}
    overrides = {int(i): {k: v for k, v in layer.items() if k not in _SIZES}  # sizes: one a name
                 for i, layer in (values.get("per_layer_config") or {}).items()}
    shared = values.get("num_kv_shared_layers") or 0  # the last layers reuse earlier layers' keys and values
    for key in _LAYER_COUNTS:
        count = values.get(key)
        if isinstance(count, int) and count > 0:
            lists = {k: v for k, v in values.items() if isinstance(v, (list, tuple)) and len(v) == count and count > 2}
            keep = _layer_kinds([*lists.values(), [i >= count - shared for i in range(count)],
                                 [overrides.get(i) for i in range(count)]], count)
            out[key] = len(keep)
            for name, v in lists.items():
                out[name] = type(v)(out.get(name, v)[i] for i in keep)
            if shared:
                out["num_kv_shared_layers"] = sum(i >= count - shared for i in keep)
            if isinstance(values.get("per_layer_config"), dict):  # a kept layer's overrides at its new index
                out["per_layer_config"] = {new: overrides[i] for new, i in enumerate(keep) if overrides.get(i)}
    for name, v in values.items():  # dropout off: the numbers compared must not draw random masks
        if isinstance(v, float) and ("dropout" in name or "pdrop" in name or "jitter" in name or name == "layerdrop"):
            out[name] = 0.0
    for name in ("text_config", "decoder", "language_config", "vision_config", "audio_config", "attn_config",
                 "ffn_config", "encoder_config", "decoder_config", "global_config", "patcher_config"):
        if isinstance(values.get(name), dict):
            out[name] = {**values[name], **_shrunk(values[name])}
    if out.get("qk_rope_head_dim"):  # MLA: the rotary part is a head's width, a key / value head per query head
        out["head_dim"] = out["qk_rope_head_dim"]
        out["num_key_value_heads"] = out.get("num_attention_heads", 4)
    for token in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        if isinstance(values.get(token), int) and values[token] >= VOCAB:
            out[token] = VOCAB - 1 - ("eos" in token)
    return out


def _real_ratios(values: dict, shrunk: dict) -> dict:
    """The sizes that keep a family's real ratios where the tiny ones hide them: latent attention's nope and value
    head dims beside its rotary one (DeepSeek-V3's 128 / 128 / 64: keys wider than values), the experts each token
    picks (capped at 8, the experts at least twice as many), and the query heads per key/value head (of the tiny
    model's 4 query heads: 1 key/value head for Llama 3's 32 / 8, fewer than 2 ranks)."""
    out = {}
    rope, nope, value = (values.get(k) for k in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"))
    if all(isinstance(x, int) and x > 0 for x in (rope, nope, value)):
        scale = rope / _SIZES["qk_rope_head_dim"]
        out |= {"qk_nope_head_dim": max(1, round(nope / scale)), "v_head_dim": max(1, round(value / scale))}
        if isinstance(values.get("head_dim"), int) and values["head_dim"] != rope:  # dots3's sliding layers'
            out["head_dim"] = out["qk_nope_head_dim"] + _SIZES["qk_rope_head_dim"]
        if "qk_head_dim" in values:  # LongCat-Flash's: nope + rope
            out["qk_head_dim"] = out["qk_nope_head_dim"] + _SIZES["qk_rope_head_dim"]
    picks = [n for n in _TOP_K if n in shrunk and isinstance(values.get(n), int) and values[n] > 0]
    if picks:
        k = min(values[picks[0]], 8)
        out |= {n: k for n in picks} | {n: max(shrunk[n], 2 * k) for n in _EXPERTS if n in shrunk}
    heads, kv = values.get("num_attention_heads"), values.get("num_key_value_heads")
    if "num_key_value_heads" in shrunk and not rope and isinstance(heads, int) and isinstance(kv, int) and \
            0 < kv < heads:
        out["num_key_value_heads"] = max(1, shrunk.get("num_attention_heads", heads) * kv // heads)
    return out


def ratio_types() -> list[str]:
    """The model types whose real ratios (``tiny_config(kind, ratios=True)``) differ from the tiny config's.

    Returns:
        Model types, sorted.

    Example::

        >>> "deepseek_v3" in ratio_types() and "gpt2" not in ratio_types()
        True
    """
    import transformers

    kinds = []
    for kind in causal_lm_types():
        if kind in _UNBUILT:
            continue
        values = transformers.AutoConfig.for_model(kind).to_dict()
        shrunk = _shrunk(values)
        if any(shrunk.get(k) != v for k, v in _real_ratios(values, shrunk).items()):
            kinds.append(kind)
    return kinds


def tiny_config(kind: str, ratios: bool = False):
    """The config of ``kind`` shrunk to a tiny model of 2 or more layers (one of each kind a hybrid stacks).

    Args:
        kind: a model type, one of ``causal_lm_types()``.
        ratios: keep the family's real ratios of head dims, experts per token and key/value heads
            (``_real_ratios``), which the tiny sizes make alike.

    Returns:
        A ``transformers.PretrainedConfig``.

    Example::

        >>> tiny_config("llama").hidden_size, tiny_config("llama").num_hidden_layers
        (64, 2)
    """
    import transformers

    values = transformers.AutoConfig.for_model(kind).to_dict()
    shrunk = _shrunk(values)
    family = {k: {**shrunk[k], **v} if isinstance(v, dict) and isinstance(shrunk.get(k), dict) else v
              for k, v in _FAMILY.get(kind, {}).items()}  # a sub-config's entries over its shrunk ones
    return transformers.AutoConfig.for_model(kind, **{**shrunk, **family,
                                                      **(_real_ratios(values, shrunk) if ratios else {})})


def tiny_model(kind: str, seed: int = 0, dtype: torch.dtype = torch.float64, ratios: bool = False) -> nn.Module:
    """A tiny ``AutoModelForCausalLM`` of ``kind`` with random weights (the same on every rank for one ``seed``),
    eager experts (a loop, exact in fp64).

    Args:
        kind: a model type.
        seed: the weights' seed.
        dtype: the parameters' dtype (fp64: a checked number compares to 1e-9, not to fp32's rounding).
        ratios: built from ``tiny_config(kind, ratios=True)``.

    Returns:
        The model, in train mode.

    Example::

        >>> type(tiny_model("llama")).__name__
        'LlamaForCausalLM'
    """
    import transformers

    if kind in _UNBUILT:
        raise ValueError(f"{kind}: {_UNBUILT[kind]}")
    config = tiny_config(kind, ratios)
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
    model = model.to(dtype).train()
    for name, module in model.named_modules():
        if kind in _FP32 and name.endswith(_FP32[kind]):
            module.float()
    return model
