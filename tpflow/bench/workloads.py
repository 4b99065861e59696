"""The harness's workloads, as a user would write them for one device (nothing here knows tpflow):

    mlp          ``depth`` residual blocks x + fc2(gelu(fc1(x))), on rows of tokens [tokens, dim]
    transformer  ``depth`` Llama-style decoder layers (RMSNorm, rotary attention with grouped key/value
                 heads, SwiGLU feed-forward) on [batch, seq, dim]
    hf           a Hugging Face Llama of the transformer's sizes on token ids, by its own labels= loss
    moe          a Hugging Face Qwen3-MoE of those sizes, 8 experts a layer, 2 per token (experts dominate)

The first two are an ``nn.Sequential`` of blocks, so a pipeline cuts them between blocks, and both are trained
on an MSE loss against a fixed random target. The column / row plans are Megatron's: the first
linear(s) of each sub-block column parallel, the last row parallel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import nn

from tpflow.hf.adapters import wrapped_model

__all__ = ["LLAMA_PLAN", "MLP_PLAN", "Attention", "CausalLMLoss", "DecoderLayer", "FeedForward", "MLPBlock",
           "RMSNorm", "Workload", "build", "model_loss", "rotary"]


class RMSNorm(nn.Module):
    """Root-mean-square normalisation over the last dimension, with a learned scale and no bias (Llama's norm).

    ``weight * x / sqrt(mean(x ** 2) + eps)``, the mean over the last dimension. Not in the plans: under
    tensor parallelism every rank holds the whole scale.

    Args:
        dim: the size of the last dimension, the scale's length; the scale starts at ones.
        eps: added to the mean square before the square root.

    Example::

        >>> norm = RMSNorm(32)
        >>> norm(torch.randn(4, 32)).shape
        torch.Size([4, 32])
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rotary(x, positions, base: float = 10000.0):
    """Rotate pairs of features of x [b, h, s, d] by position-dependent angles.

    Rotary position embedding: at position ``p``, features ``2i`` and ``2i + 1`` turn together by the angle
    ``p * base ** (-2i / d)``.

    Args:
        x: queries or keys, [batch, heads, seq, head dim], with an even head dim.
        positions: the sequence positions, [seq].
        base: the angles' base; larger turns the pairs more slowly.

    Returns:
        ``x`` rotated, of the same shape and dtype.

    Example::

        >>> q = torch.randn(2, 8, 16, 4)
        >>> rotary(q, torch.arange(16)).shape
        torch.Size([2, 8, 16, 4])
    """
    d = x.shape[-1]
    freqs = base ** (-torch.arange(0, d, 2, dtype=x.dtype, device=x.device) / d)
    angles = torch.outer(positions.to(x.dtype), freqs)  # [s, d/2]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return rearrange(torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1), "... d two -> ... (d two)")


class Attention(nn.Module):
    """Causal self-attention with rotary positions and grouped key/value heads, without biases (Llama's).

    ``q_proj``, ``k_proj`` and ``v_proj`` are column parallel in ``LLAMA_PLAN``, ``o_proj`` row parallel. The
    forward takes the head count from the projections' outputs, so under a column split each rank computes
    its own heads: ``heads / tp`` query heads and ``kv_heads / tp`` key/value heads.

    Args:
        dim: the model's width, the input's last dimension; each head has ``dim // heads`` features.
        heads: the query heads.
        kv_heads: the key/value heads, each shared by ``heads // kv_heads`` query heads.

    Example::

        >>> attn = Attention(dim=32, heads=8, kv_heads=4)
        >>> attn(torch.randn(2, 8, 32)).shape  # [batch, seq, dim]
        torch.Size([2, 8, 32])
    """

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
    """SwiGLU feed-forward without biases (Llama's): ``down_proj(silu(gate_proj(x)) * up_proj(x))``.

    ``gate_proj`` and ``up_proj`` are column parallel in ``LLAMA_PLAN``, ``down_proj`` row parallel.

    Args:
        dim: the model's width, of the input and output.
        hidden: the width between the projections.

    Example::

        >>> ff = FeedForward(dim=32, hidden=64)
        >>> ff(torch.randn(2, 8, 32)).shape
        torch.Size([2, 8, 32])
    """

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A Llama-style decoder layer: attention, then a SwiGLU feed-forward, each a pre-norm residual branch.

    ``x + self_attn(input_layernorm(x))``, then ``x + mlp(post_attention_layernorm(x))``; the submodules have
    Hugging Face Llama's names, which ``LLAMA_PLAN`` matches.

    Args:
        dim: the model's width.
        heads, kv_heads: the attention's query heads and key/value heads (see :class:`Attention`).
        hidden: the feed-forward's width.

    Example::

        >>> layer = DecoderLayer(dim=32, heads=8, kv_heads=4, hidden=64)
        >>> layer(torch.randn(2, 8, 32)).shape  # [batch, seq, dim]
        torch.Size([2, 8, 32])
    """

    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.input_layernorm, self.self_attn = RMSNorm(dim), Attention(dim, heads, kv_heads)
        self.post_attention_layernorm, self.mlp = RMSNorm(dim), FeedForward(dim, hidden)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class MLPBlock(nn.Module):
    """A residual MLP block with biases: ``x + fc2(gelu(fc1(x)))``.

    ``fc1`` is column parallel in ``MLP_PLAN``, ``fc2`` row parallel.

    Args:
        dim: the width of the input and output.
        hidden: ``fc1``'s output width.

    Example::

        >>> block = MLPBlock(dim=32, hidden=64)
        >>> block(torch.randn(64, 32)).shape  # [tokens, dim]
        torch.Size([64, 32])
    """

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


LLAMA_PLAN = {
    "*.q_proj": "column", "*.k_proj": "column", "*.v_proj": "column", "*.o_proj": "row",
    "*.gate_proj": "column", "*.up_proj": "column", "*.down_proj": "row",
}
MLP_PLAN = {"*.fc1": "column", "*.fc2": "row"}


class CausalLMLoss(nn.Module):
    """A Hugging Face causal LM as the harness trains it: token ids in, the model's own ``labels=`` loss out.

    ``tp_plan`` is the model's own plan under this module's prefix, and its embeddings are the model's, so
    ``parallelize(..., plan="auto")`` takes it as it takes the model.

    Args:
        lm: a transformers causal LM (``AutoModelForCausalLM``).

    Example::

        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> _ = torch.manual_seed(0)
        >>> lm = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        ...                                   num_attention_heads=4, num_key_value_heads=2))
        >>> ids = torch.randint(0, 64, (2, 8))
        >>> CausalLMLoss(lm)(ids)                     # lm(ids, labels=ids).loss
        tensor(4.1710, grad_fn=<NllLossBackward0>)
        >>> list(CausalLMLoss(lm).tp_plan)[:2]        # the model's own plan, under the prefix lm.
        ['lm.lm_head', 'lm.model.embed_tokens']
    """

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    @property
    def tp_plan(self) -> dict[str, str]:
        inner, prefix = wrapped_model(self.lm)  # a PEFT model (the lora workload): the model it wraps, by its names
        where = f"lm.{prefix}." if prefix else "lm."
        return {f"{where}{k}": v for k, v in inner.tp_plan.items()}

    def get_input_embeddings(self) -> nn.Module:
        return self.lm.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.lm.get_output_embeddings()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(ids, labels=ids).loss


def model_loss(loss: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss a model computed itself (``CausalLMLoss``), as a harness loss function of (output, target).

    Args:
        loss: the model's output, its loss.
        target: unused (the model had its labels).

    Returns:
        ``loss``.

    Example::

        >>> model_loss(torch.tensor(2.0), None)
        tensor(2.)
    """
    return loss


def _hf_model(dim: int, hidden: int, depth: int, heads: int, kv_heads: int, vocab: int) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=vocab, hidden_size=dim, intermediate_size=hidden,
                                  num_hidden_layers=depth, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                  head_dim=dim // heads, tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(config)


LORA_RANK = 8  # the lora workload's adapters, on every attention and MLP projection
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _lora_model(dim: int, hidden: int, depth: int, heads: int, kv_heads: int, vocab: int) -> nn.Module:
    """The hf workload's Llama under PEFT's LoRA (rank ``LORA_RANK``): its adapters train, the rest is frozen."""
    import peft

    config = peft.LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules=list(LORA_TARGETS))
    return peft.get_peft_model(_hf_model(dim, hidden, depth, heads, kv_heads, vocab), config)


EXPERTS, ROUTED = 8, 2  # the moe workload's experts per layer, and the experts each token is routed to


def _moe_model(dim: int, hidden: int, depth: int, heads: int, kv_heads: int, vocab: int) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3_moe", vocab_size=vocab, hidden_size=dim, moe_intermediate_size=hidden,
                                  num_experts=EXPERTS, num_experts_per_tok=ROUTED, num_hidden_layers=depth,
                                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=dim // heads,
                                  tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(config)


@dataclass
class Workload:
    """A model to train, its batch and its tensor-parallel plan (module-name patterns -> "column" / "row").

    ``samples`` is the batch's first dimension, ``tokens`` the number of its rows of features (the product of
    every dimension but the last), ``describe()`` a line naming it for the results.

    Args:
        name: the workload's name, ``"mlp"``, ``"transformer"``, ``"hf"`` or ``"moe"``.
        model: the blocks, on one device; a pipeline cuts it between blocks (the hf workload: a
            ``CausalLMLoss``).
        inputs, targets: the batch and the MSE loss's targets, of one shape (hf: token ids, twice).
        plan: ``fnmatch`` patterns of module names, each mapped to ``"column"`` or ``"row"``.
        heads, kv_heads: the attention's heads and key/value heads, which the number of tensor-parallel ranks
            must divide; 0 for a model without attention.
        loss_fn: the loss of ``(model output, targets)``: MSE, or ``model_loss`` for a model that returns its own.

    Example::

        >>> w = build("mlp", dim=32, hidden=64, depth=4, tokens=64, seq=8, heads=8, kv_heads=4)
        >>> w.describe()
        'mlp: 4 blocks, input 64x32, 16,768 parameters'
        >>> w.samples, w.tokens
        (64, 64)
    """

    name: str
    model: nn.Sequential
    inputs: torch.Tensor
    targets: torch.Tensor
    plan: dict[str, str]
    heads: int = 0  # attention heads (and key/value heads) a tensor-parallel split must divide
    kv_heads: int = 0
    loss_fn: Callable = F.mse_loss  # of (output, target); the hf workload's model returns its own loss

    @property
    def samples(self) -> int:
        """Samples in a step: rows of tokens for the MLP, sequences for the transformer."""
        return self.inputs.shape[0]

    @property
    def tokens(self) -> int:
        """Rows of features in a step: every dim of the inputs but the features (all of token ids' dims)."""
        return self.inputs.numel() if not self.inputs.is_floating_point() else self.inputs.shape[:-1].numel()

    def describe(self) -> str:
        shape = "x".join(map(str, self.inputs.shape))
        params = sum(p.numel() for p in self.model.parameters())
        lm = wrapped_model(self.model.lm)[0] if isinstance(self.model, CausalLMLoss) else None
        blocks = len(self.model) if lm is None else len(lm.model.layers)
        return f"{self.name}: {blocks} blocks, input {shape}, {params:,} parameters"


def build(name: str, *, dim: int, hidden: int, depth: int, tokens: int, seq: int, heads: int,
          kv_heads: int) -> Workload:
    """The workload ``name`` ("mlp", "transformer", "hf" or "moe"), the same on every rank (fixed seeds).

    The model's values come from ``torch.manual_seed(0)`` (set here, for the process), the inputs and targets
    (standard normal) from a generator seeded with 1. The MLP is ``depth`` :class:`MLPBlock` on
    ``[tokens, dim]``; the transformer ``depth`` :class:`DecoderLayer` on ``[tokens // seq, seq, dim]``; "hf" a
    Hugging Face Llama of the transformer's sizes (vocabulary 8 x dim, untied head, random weights) on
    ``[tokens // seq, seq]`` token ids, trained by its own ``labels=`` loss (needs transformers); "moe" a Qwen3-MoE
    of those sizes whose every layer routes each token to 2 of 8 experts of width ``hidden`` (the experts hold most
    of its parameters).

    Args:
        name: ``"mlp"``, ``"transformer"``, ``"hf"`` or ``"moe"``.
        dim: the model's width.
        hidden: the feed-forward's width.
        depth: the number of blocks.
        tokens: the tokens in the batch.
        seq: the transformer's sequence length, which must divide ``tokens``; unused by the MLP.
        heads, kv_heads: the transformer's query heads and key/value heads; ``heads`` must divide ``dim``, and
            ``kv_heads`` must divide ``heads``. Unused by the MLP.

    Returns:
        The :class:`Workload`, its ``heads`` and ``kv_heads`` set for the transformer and 0 for the MLP.

    Raises:
        ValueError: an unknown name, or transformer sizes that do not divide as above.

    Example::

        >>> w = build("transformer", dim=32, hidden=64, depth=4, tokens=64, seq=8, heads=8, kv_heads=4)
        >>> w.describe()
        'transformer: 4 blocks, input 8x8x32, 37,120 parameters'
        >>> w.samples, w.tokens
        (8, 64)
    """
    torch.manual_seed(0)
    if name == "mlp":
        model = nn.Sequential(*(MLPBlock(dim, hidden) for _ in range(depth)))
        shape, plan = (tokens, dim), MLP_PLAN
    elif name in ("hf", "moe", "lora"):
        if tokens % seq or dim % heads or heads % kv_heads:
            raise ValueError(f"--tokens {tokens} must be a multiple of --seq {seq}, --dim {dim} must split into "
                             f"--heads {heads}, and they into --kv-heads {kv_heads}")
        vocab = 8 * dim
        lm = {"hf": _hf_model, "moe": _moe_model, "lora": _lora_model}[name]
        model = CausalLMLoss(lm(dim, hidden, depth, heads, kv_heads, vocab))
        ids = torch.randint(0, vocab, (tokens // seq, seq), generator=torch.Generator().manual_seed(1))
        return Workload(name, model, ids, ids, LLAMA_PLAN, heads, kv_heads, model_loss)
    elif name == "transformer":
        if tokens % seq:
            raise ValueError(f"--tokens {tokens} must be a multiple of --seq {seq} (the transformer's sequences)")
        if dim % heads or heads % kv_heads:
            raise ValueError(f"--dim {dim} must split into --heads {heads}, and they into --kv-heads {kv_heads}")
        model = nn.Sequential(*(DecoderLayer(dim, heads, kv_heads, hidden) for _ in range(depth)))
        shape, plan = (tokens // seq, seq, dim), LLAMA_PLAN
    else:
        raise ValueError(f"unknown workload {name!r}: use 'mlp', 'transformer', 'hf', 'moe' or 'lora'")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    return Workload(name, model, x, y, plan, heads if name == "transformer" else 0,
                    kv_heads if name == "transformer" else 0)
