"""MiniMax's lightning attention (linear attention with a per-head decay, computed block by block) split by heads:
each rank runs the model's own code on its heads, the output summed.

    qkv_proj       [q | k | v] rows of each head, head after head: a column split by heads
    output_gate    a sigmoid gate per feature of every head: a column split by heads
    norm           an RMSNorm over every head's features at once: its weight split with them, its mean of squares
                   summed over the ranks (exact)
    out_proj       a row split: its input features are the heads'; the output summed over the ranks
    slope_rate,    per-head decay constants (buffers the model derives from the head count and keeps in its state
    *_decay        dict): whole in the module, this rank's heads' slices in place around each call

The module views its activations by ``num_attention_heads``, which becomes the rank's.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tpflow import comm
from tpflow.hf.mixer_split import MixerStyle, SplitMixer, refuse_undivided
from tpflow.plans.style import Plan

__all__ = ["LightningHeads", "lightning_counts"]

_DECAYS = {"slope_rate": 0, "query_decay": 0, "key_decay": 0, "diagonal_decay": 1}  # buffer: its heads' dim


def lightning_counts(module: nn.Module) -> tuple[int, int] | None:
    """``(heads, head_dim)`` of a lightning-attention module as transformers writes MiniMax's (``qkv_proj`` of each
    head's ``[q | k | v]``, an ``output_gate``, an RMSNorm over every head's features, ``out_proj``, and per-head
    decay buffers), or None for any other module.

    Args:
        module: any module.

    Returns:
        The counts, or None.

    Example::

        >>> from transformers import MiniMaxConfig, MiniMaxForCausalLM
        >>> model = MiniMaxForCausalLM(MiniMaxConfig(
        ...     vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
        ...     head_dim=4, num_hidden_layers=2, num_local_experts=2, block_size=4,
        ...     layer_types=["linear_attention", "full_attention"]))
        >>> lightning_counts(model.model.layers[0].self_attn), lightning_counts(model.model.layers[1].self_attn)
        ((4, 4), None)
    """
    heads, dim = getattr(module, "num_attention_heads", None), getattr(module, "head_dim", None)
    if not isinstance(heads, int) or not isinstance(dim, int) or not isinstance(getattr(module, "block_size", None),
                                                                                  int):
        return None
    qkv, gate, out, norm = (getattr(module, n, None) for n in ("qkv_proj", "output_gate", "out_proj", "norm"))
    if not all(isinstance(m, nn.Linear) for m in (qkv, gate, out)) or not _plain_rms(norm, heads * dim):
        return None
    if qkv.out_features != 3 * heads * dim or gate.out_features != heads * dim or out.in_features != heads * dim:
        return None
    buffers = dict(module.named_buffers(recurse=False))
    if not all(isinstance(buffers.get(n), torch.Tensor) and buffers[n].ndim > d and buffers[n].shape[d] == heads
               for n, d in _DECAYS.items()):
        return None
    return heads, dim


def _plain_rms(norm: nn.Module | None, width: int) -> bool:
    """Whether ``norm`` computes ``weight * x / rms(x)`` over ``width`` features (in fp32, back to the input's
    dtype), as ``_SpanningRMSNorm`` does over split features: checked on a sample."""
    weight, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if not isinstance(weight, torch.Tensor) or weight.shape != (width,) or not isinstance(eps, float):
        return False
    if weight.is_meta:  # (nothing to compute with yet: by its name)
        return type(norm).__name__.endswith("RMSNorm")
    x = torch.randn(2, width, generator=torch.Generator().manual_seed(0), dtype=weight.dtype).to(weight.device)
    with torch.no_grad():
        want = weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return bool(torch.allclose(norm(x), want))


class _SpanningRMSNorm:
    """An RMSNorm over every head's features, each rank holding its heads' share: the mean of squares summed over
    the heads' ranks (forward and backward), then the model's formula."""

    def __init__(self, norm: nn.Module, group: object, ranks: int) -> None:
        self.norm, self.group, self.ranks = norm, group, ranks

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype, h = hidden_states.dtype, hidden_states.to(torch.float32)
        squares = comm.copy_to_ranks(h.pow(2).sum(-1, keepdim=True), self.group).clone()  # summed in place next
        squares = comm.reduce_from_ranks(squares, self.group)  # every rank reads the sum: gradients summed too
        h = h * torch.rsqrt(squares / (h.shape[-1] * self.ranks) + self.norm.variance_epsilon)
        return self.norm.weight * h.to(dtype)


class _RankDecays:
    """The decay buffers around each call: this rank's heads' slices in place, whole again after (the state dict,
    ``.to()`` and checkpoints see them whole)."""

    def __init__(self, module: nn.Module, index: int, heads: int) -> None:
        self.index, self.heads, self.whole = index, heads, {}
        module.register_forward_pre_hook(self.enter)
        module.register_forward_hook(self.leave, always_call=True)

    def enter(self, module: nn.Module, args: tuple) -> None:
        for name, dim in _DECAYS.items():
            self.whole[name] = module._buffers[name]
            module._buffers[name] = self.whole[name].narrow(dim, self.index * self.heads, self.heads)

    def leave(self, module: nn.Module, args: tuple, output: object) -> None:
        module._buffers.update(self.whole)


@dataclasses.dataclass(frozen=True)
class LightningHeads(MixerStyle):
    """Plan style for MiniMax's lightning attention (``lightning_counts``), split by heads (see the module
    docstring).

    Args:
        sequence_parallel: its input this rank's tokens, gathered on entry, its output reduce-scattered back to them
            (``hf_plan(sequence_parallel=True)`` sets it).
        context: head parallel under context parallelism (``hf_plan(context_parallel=...)`` sets it).

    Example::

        >>> from transformers import MiniMaxConfig, MiniMaxForCausalLM
        >>> config = MiniMaxConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=4,
        ...                        num_key_value_heads=2, head_dim=4, num_hidden_layers=2, num_local_experts=2,
        ...                        block_size=4, layer_types=["linear_attention", "full_attention"])
        >>> _ = torch.manual_seed(0)
        >>> model = MiniMaxForCausalLM(config)
        >>> ids = torch.randint(0, 64, (1, 10))
        >>> want = model(ids).logits
        >>> model = tpf.parallelize(model, placement=tpf.placement("cpu", ranks=[0, 1]),
        ...                         plan={"model.layers.0.self_attn": LightningHeads()})
        >>> model.model.layers[0].self_attn.qkv_proj.weight.to_local().shape     # 2 of 4 heads' q, k, v
        torch.Size([24, 16])
        >>> torch.testing.assert_close(model(ids).logits, want)
    """

    def check(self, name: str, module: nn.Module, plan: Plan) -> None:
        counts = lightning_counts(module)
        if counts is None:
            raise ValueError(f"{name!r} is a {type(module).__name__}; LightningHeads takes MiniMax's lightning "
                             f"attention (qkv_proj of each head's q / k / v, output_gate, an RMSNorm over every "
                             f"head, out_proj, per-head decay buffers)")
        refuse_undivided(name, "lightning-attention heads", counts[0], self.world(plan), self.said)

    def apply(self, name: str, module: nn.Module, plan: Plan) -> None:
        ranks, pl = self.head_ranks(plan), plan.placement
        heads, _ = lightning_counts(module)
        ranks.split_outputs(module.qkv_proj, module.output_gate, module.norm)
        out_bias = ranks.split_inputs(module.out_proj)
        module.num_attention_heads = heads // ranks.world
        if pl.coordinate() is not None:
            module.norm.forward = _SpanningRMSNorm(module.norm, ranks.group, ranks.world)
            _RankDecays(module, ranks.index, heads // ranks.world)
            SplitMixer(module, (module.qkv_proj, module.output_gate, module.norm, module.out_proj), ranks,
                       out_bias=out_bias, sequence_dim=self.sequence_dim)
