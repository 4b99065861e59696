"""A small Llama-style decoder written as a Hugging Face user would, knowing nothing of tpflow:
RMSNorm, rotary attention with grouped key/value heads whose reshapes infer the head count (-1),
SwiGLU feed-forward, tied-free LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rotary(x, positions, base: float = 10000.0):
    """Rotate pairs of features of x [b, h, s, d] by position-dependent angles."""
    d = x.shape[-1]
    freqs = base ** (-torch.arange(0, d, 2, dtype=x.dtype, device=x.device) / d)
    angles = torch.outer(positions.to(x.dtype), freqs)  # [s, d/2]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return rearrange(torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1), "... d two -> ... (d two)")


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.head_dim, self.groups = dim // heads, heads // kv_heads
        self.q_proj = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x):
        positions = torch.arange(x.shape[1], device=x.device)
        # the head count comes from the tensor (-1), so a column-split projection gives fewer heads
        q = rearrange(self.q_proj(x), "b s (h d) -> b h s d", d=self.head_dim)
        k = rearrange(self.k_proj(x), "b s (h d) -> b h s d", d=self.head_dim)
        v = rearrange(self.v_proj(x), "b s (h d) -> b h s d", d=self.head_dim)
        q, k = rotary(q, positions), rotary(k, positions)
        k, v = (repeat(t, "b h s d -> b (h g) s d", g=self.groups) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(rearrange(out, "b h s d -> b s (h d)"))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.input_layernorm, self.self_attn = RMSNorm(dim), Attention(dim, heads, kv_heads)
        self.post_attention_layernorm, self.mlp = RMSNorm(dim), FeedForward(dim, hidden)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLlama(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 32, heads: int = 8, kv_heads: int = 4, hidden: int = 44,
                 layers: int = 2) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(DecoderLayer(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm, self.lm_head = RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


LLAMA_PLAN = {
    "*.q_proj": "column", "*.k_proj": "column", "*.v_proj": "column", "*.o_proj": "row",
    "*.gate_proj": "column", "*.up_proj": "column", "*.down_proj": "row",
}
