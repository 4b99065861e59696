"""A small Llama-style decoder written as a Hugging Face user would, knowing nothing of tpflow: the
benchmark's decoder layers (RMSNorm, rotary attention with grouped key/value heads whose reshapes infer
the head count (-1), SwiGLU feed-forward) under an embedding and an untied LM head."""

from __future__ import annotations

from torch import nn

from tpflow.bench.workloads import LLAMA_PLAN, DecoderLayer, RMSNorm

__all__ = ["LLAMA_PLAN", "DecoderLayer", "TinyLlama"]


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
