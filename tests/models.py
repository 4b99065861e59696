"""Models the tests build, written as a user would, knowing nothing of tpflow: a small Llama-style decoder (the
benchmark's decoder layers: RMSNorm, rotary attention with grouped key/value heads whose reshapes infer the head
count (-1), SwiGLU feed-forward) under an embedding and an untied LM head; MLP blocks and q / k / v-like
projections with small-integer weights, so that sums over ranks are exact."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tests.checks import ints
from tpflow.bench.workloads import LLAMA_PLAN, DecoderLayer, RMSNorm

__all__ = ["LLAMA_PLAN", "MLP", "MOE_KINDS", "WIDTHS", "DecoderLayer", "Stack", "TinyLlama", "TitanLlama", "Trio",
           "int_linear"]


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


def int_linear(fin, fout, bias, seed):
    """``nn.Linear`` with small-integer weights (seeded), so sums over ranks are exact."""
    lin = nn.Linear(fin, fout, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(ints((fout, fin), seed))
        if bias:
            lin.bias.copy_(ints((fout,), seed + 1))
    return lin


class MLP(nn.Module):
    def __init__(self, dim, hidden, seed, act=torch.relu):
        super().__init__()
        self.fc1, self.fc2 = int_linear(dim, hidden, True, seed), int_linear(hidden, dim, True, seed + 2)
        self.act = act

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Stack(nn.Module):
    def __init__(self, dim, hidden, depth, act=torch.relu):
        super().__init__()
        self.blocks = nn.ModuleList(MLP(dim, hidden, seed=10 * i, act=act) for i in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


WIDTHS = (5, 7, 3)  # uneven over 2-4 ranks; 3 leaves rank 3 of 4 without a block


class Trio(nn.Module):
    """Three projections of one input, as q / k / v are."""

    def __init__(self, fin: int = 6, bias: bool = True) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(fin, w, bias=bias) for w in WIDTHS)
        with torch.no_grad():
            for seed, layer in enumerate((self.a, self.b, self.c)):
                layer.weight.copy_(ints(layer.weight.shape, seed))
                if bias:
                    layer.bias.copy_(ints(layer.bias.shape, seed + 10))

    def forward(self, x):
        return self.a(x), self.b(x), self.c(x)


class BackwardFails(torch.autograd.Function):
    """The identity whose backward raises: a stage that fails in its backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise FloatingPointError("a backward that fails")


VOCAB = 101  # uneven blocks of a head over 2 and 4 ranks


def tiny_lm(kind: str, kv_heads: int = 2, layers: int = 2, heads: int = 4, **extra) -> nn.Module:
    """A Hugging Face causal LM of ``kind`` (random weights, fp64: AdamW magnifies fp32 rounding) with ``heads``
    query heads, ``kv_heads`` key/value heads and uneven MLP blocks."""
    import transformers

    config = transformers.AutoConfig.for_model(
        kind, vocab_size=VOCAB, hidden_size=64, intermediate_size=90, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16, max_position_embeddings=64, **extra)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).double()


def tiny_tokenizer():
    """A word-level tokenizer of ``VOCAB`` ids made in memory (nothing downloaded): ``[PAD]`` 0, ``[EOS]`` 1,
    ``[UNK]`` 2, then the words ``w0``, ``w1``, ..."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[PAD]": 0, "[EOS]": 1, "[UNK]": 2, **{f"w{i}": i + 3 for i in range(VOCAB - 3)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="[PAD]", eos_token="[EOS]",
                                                unk_token="[UNK]")


MOE_KINDS = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "deepseek_v3", "gpt_oss")
_MOE_EXTRA = {  # what each family needs besides the shared sizes (OLMoE plans k / v gathered: a head per rank)
    "olmoe": {"num_key_value_heads": 4},
    "qwen2_moe": {"shared_expert_intermediate_size": 80},
    "gpt_oss": {"intermediate_size": 48},  # its experts' (it has no dense MLP)
    # DeepSeek-V3's ratios (nope 128 + rope 64 keys, values 128): keys wider than values; a key/value head per query
    # head (latent attention has no fewer)
    "deepseek_v3": {"q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                    "v_head_dim": 16, "head_dim": 8, "num_key_value_heads": 4, "n_routed_experts": 4,
                    "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1},
}


def tiny_moe(kind: str, experts: str = "eager", dtype: torch.dtype = torch.float64, layers: int = 2,
             **extra) -> nn.Module:
    """A Hugging Face mixture-of-experts causal LM of ``kind`` (random weights; ``layers`` layers, 4 experts, top-2,
    the router's auxiliary loss in ``labels=``): ``experts`` is its experts implementation (``"eager"``: a loop, which
    runs in fp64; ``"grouped_mm"``: ``torch._grouped_mm``, fp32 and lower; ``"tpflow"``: tpflow's grouped GEMM);
    ``extra``: more config (it wins)."""
    import transformers

    sizes = {"num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, **_MOE_EXTRA.get(kind, {}),
             "output_router_logits": True, "router_aux_loss_coef": 0.1, **extra}
    config = transformers.AutoConfig.for_model(
        kind, vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=48, num_experts=4,
        num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=layers, num_attention_heads=4,
        max_position_embeddings=64, **sizes)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, experts_implementation=experts).to(dtype)


class ShardAdamW:
    """torch's AdamW with clipping by the whole gradients' norm, stepped on each parameter's local shard: the same
    arithmetic as on the DTensors, without DTensor's sharding propagation, which a new model's first steps pay per
    op and shape (on CPU most of a short test's time). The norm sums each shard's squares over the mesh dimensions
    its gradient is split on. The optimizer on the DTensors themselves, as users step it: tests/test_hf.py,
    test_fsdp.py, test_frameworks.py and the real scripts.

    Args:
        model: its parameters (DTensors or plain tensors), in the same order on every rank.
        adamw: ``torch.optim.AdamW``'s settings.
    """

    def __init__(self, model: nn.Module, **adamw) -> None:
        with torch.no_grad():
            self.params = list(model.parameters())
            self.local = [_local(p) for p in self.params]
        self.opt = torch.optim.AdamW(self.local, **adamw)

    def step(self, max_norm: float) -> float:
        """Clip to ``max_norm`` by the whole norm, step, and clear the gradients; returns the norm before clipping."""
        with torch.no_grad():
            grads = [(_local(p.grad), p.grad) for p in self.params if p.grad is not None]
            norm = _whole_norm([g for g, _ in grads], [whole for _, whole in grads])
            scale = min(max_norm / (norm + 1e-6), 1.0)
            for local, p in zip(self.local, self.params, strict=True):
                assert local.data_ptr() == _local(p).data_ptr(), "a parameter's storage was replaced"
                local.grad = None if p.grad is None else _local(p.grad).mul_(scale)
            self.opt.step()
            for local, p in zip(self.local, self.params, strict=True):
                local.grad = p.grad = None
        return norm


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t  # (under no_grad: the DTensor's own storage)


def _whole_norm(locals_: list[torch.Tensor], grads: list[torch.Tensor]) -> float:
    """The 2-norm of the whole gradients from their local shards, summed in fp64 (a partial gradient, which no
    backward leaves here, fails)."""
    sums: dict[tuple, torch.Tensor] = {}
    for local, grad in zip(locals_, grads, strict=True):
        placements = grad.placements if isinstance(grad, DTensor) else ()
        assert not any(p.is_partial() for p in placements), f"a partial gradient: {placements}"
        split = tuple(d for d, p in enumerate(placements) if not p.is_replicate())
        key = (grad.device_mesh, split) if placements else ()
        sums[key] = sums.get(key, 0) + local.double().pow(2).sum()
    total = 0.0
    for key, sq in sums.items():  # (the same keys in the same order on every rank: the parameters' order)
        for dim in key[1] if key else ():
            torch.distributed.all_reduce(sq, group=key[0].get_group(dim))
        total += float(sq)
    return total ** 0.5


def adamw_steps(models: Sequence[nn.Module], ids: torch.Tensor, kwargs: dict, steps: int = 2) -> None:
    """``steps`` AdamW steps of each causal LM's ``labels=`` loss (in ``kwargs``), called alike without a cache, with
    clipping that bites (max norm 0.5); eps as ``train_lm``'s (``ShardAdamW``)."""
    opts = [ShardAdamW(m, lr=1e-2, eps=1e-4) for m in models]
    for _ in range(steps):
        for m, opt in zip(models, opts):
            m(ids, **kwargs, use_cache=False).loss.backward()
            opt.step(0.5)


def train_lm(model: nn.Module, ids: torch.Tensor, steps: int = 2, on_dtensors: bool = False
             ) -> tuple[list[float], list[float]]:
    """AdamW steps of a causal LM's ``labels=`` loss with clipping that bites (max norm 0.5); each step's loss and
    norm before clipping. ``on_dtensors``: torch's optimizer and ``clip_grad_norm_`` on the parameters as they are
    (else ``ShardAdamW``, the same arithmetic on the local shards)."""
    # eps: a near-zero gradient's rounding (the norms compute in fp32) must not become a whole lr-sized step
    settings = {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-4}
    opt = torch.optim.AdamW(model.parameters(), **settings) if on_dtensors else ShardAdamW(model, **settings)
    losses, norms = [], []
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        loss.backward()
        if on_dtensors:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
            norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        else:
            norm = opt.step(0.5)
        losses.append(loss.item())
        norms.append(norm)
    return losses, norms


class TitanAttention(nn.Module):
    """torchtitan's Llama attention, shortened: wq / wk / wv / wo, heads inferred from the projections (-1), a
    positional table read for the input's length (torchtitan's ``freqs_cis``), causal SDPA."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q, k, v = (w(x).view(bs, seqlen, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = q * positions[:seqlen], k * positions[:seqlen]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class TitanFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False), \
            nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class TitanBlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention, self.feed_forward = TitanAttention(dim, heads), TitanFeedForward(dim, hidden)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), positions)
        return h + self.feed_forward(self.ffn_norm(h))


class TitanLlama(nn.Module):
    """torchtitan's Llama in miniature, with its module names (``tok_embeddings``, ``layers`` a ``ModuleDict``,
    ``attention.wq``, ``feed_forward.w1``, ``output``), so that its ``apply_tp`` plan applies as written."""

    def __init__(self, vocab: int = 50, dim: int = 16, heads: int = 4, hidden: int = 22, layers: int = 2,
                 max_seq: int = 32) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): TitanBlock(dim, heads, hidden) for i in range(layers)})
        self.norm, self.output = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)
        angles = torch.arange(max_seq, dtype=torch.float64)[:, None] / (1 + torch.arange(dim // heads))
        self.register_buffer("positions", 1 + 0.1 * torch.cos(angles), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.positions.to(h.dtype))
        return self.output(self.norm(h))
