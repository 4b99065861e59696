"""TRL's trainers on a parallelized model: their per-token log-probabilities from the head's blocks, and their
reference model split as the policy is.

TRL's GRPO, RLOO, DPO, KTO and SFT trainers give the model a fused head (``trl.trainer.utils.add_fused_lm_head``):
called with ``fused_lm_head=True``, its forward runs the backbone and scores the labels through the head in tiles,
gathering a DTensor head whole on every rank first (``full_tensor``): the ``[vocabulary, hidden]`` matrix, and its
gradient, on every rank. Under ``adopt``, TRL's forward runs as it is (its label shift, masks, loss and MoE
auxiliary loss) but sees this rank's block of the head, and its tile kernel (``ChunkedLogProbFunction``) is
``tpflow.ops.linear_log_probs`` on that block: one all-gather of a few numbers per token, logits never larger than
``[chunk, vocabulary / W]``. In TRL's dtypes: the product in autocast's (for every operand), the logits' statistics and
the gradients' sums in fp32 (for an fp64 model too), as TRL's kernel computes them.

A reference model TRL builds itself (``beta > 0``: from the policy's folder) is whole; ``adopt`` splits it with the
policy's placement and plan, so that it holds its share and scores through the same split head.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Iterator, Mapping
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from tpflow.layers.vocab import HeadBlocks, head_blocks
from tpflow.ops.linear_log_probs import EXTRAS, linear_log_probs
from tpflow.placement import Placement

__all__ = ["route_fused_heads", "split_reference"]

_ROUTED = "_tpflow_fused_head"  # on a model whose fused forward adopt routed
_BLOCK = contextvars.ContextVar("tpflow_fused_head", default=None)  # the head's block while a fused forward runs
CHUNK = 1024  # tokens whose logits are made at once (TRL's tiles: 32768 tokens, over the vocabulary in slices)


def _trl_forward(model: nn.Module) -> Any:
    """TRL's fused forward on ``model`` (``add_fused_lm_head``'s, bound as ``model.forward``), or None."""
    forward = model.__dict__.get("forward")
    code = getattr(getattr(forward, "__func__", None), "__code__", None)
    if code is None or "trl" not in code.co_filename:
        return None
    if code.co_name != "_fused_forward":  # a TRL this module does not know: its head would be gathered, unsaid
        raise ValueError(f"tpf.adopt: {type(model).__name__}'s forward is TRL's {code.co_name} "
                         f"({code.co_filename}), not the fused head tpflow routes (add_fused_lm_head's "
                         f"_fused_forward, TRL 1.16): use the TRL version pyproject.toml states")
    return forward


def route_fused_heads(*models: nn.Module | None) -> None:
    """Route each model's TRL fused head (where TRL gave it one) through this rank's block of the head.

    Args:
        models: the trainer's model (PEFT's base model for a PEFT one) and reference model; None and models without
            a fused head are skipped.

    Example::

        >>> route_fused_heads(torch.nn.Linear(2, 2), None)      # no TRL fused forward: nothing to route
    """
    for model in models:
        forward = None if model is None or getattr(model, _ROUTED, False) else _trl_forward(model)
        if forward is None:
            continue
        _install_kernel()
        routed = _routed(forward, model)
        model.forward = routed
        object.__setattr__(model, _ROUTED, True)


def _routed(forward: Any, model: nn.Module) -> Any:
    """TRL's fused ``forward`` of ``model``, its fused calls seeing the head's block."""

    @functools.wraps(forward)  # its signature: generate checks its keyword arguments against it
    def routed(*args: Any, fused_lm_head: bool = False, **kwargs: Any) -> Any:
        if not fused_lm_head:
            return forward(*args, **kwargs)
        with _head_block(model):
            return forward(*args, fused_lm_head=True, **kwargs)

    return routed


@contextlib.contextmanager
def _head_block(model: nn.Module) -> Iterator[None]:
    """While TRL's fused forward runs: ``model.get_output_embeddings()`` gives this rank's block of the head (no
    gather), which the kernel recognises."""
    head = model.get_output_embeddings()
    blocks = head_blocks(head, "TRL's fused head")
    shown = SimpleNamespace(weight=blocks.weight, bias=blocks.bias)
    token = _BLOCK.set(blocks)
    model.get_output_embeddings = lambda: shown
    try:
        yield
    finally:
        del model.get_output_embeddings
        _BLOCK.reset(token)


@functools.cache
def _install_kernel() -> None:
    """TRL's tile kernel, as its fused forward looks it up, with the head's block computed here."""
    import trl.trainer.utils as utils

    original = utils._ChunkedLogProbFunction
    utils._ChunkedLogProbFunction = SimpleNamespace(apply=functools.partial(_apply, original))


def _apply(original: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           targets: torch.Tensor, temperature: float, chunk_size: int, softcap: float | None = None,
           logit_scale: float = 1.0, outputs: tuple[str, ...] = ("entropy", *EXTRAS)) -> tuple:
    """``ChunkedLogProbFunction.apply``'s arguments and results: TRL's own for a head not routed here."""
    blocks: HeadBlocks | None = _BLOCK.get()
    if blocks is None or weight is not blocks.weight:
        return original.apply(hidden, weight, bias, targets, temperature, chunk_size, softcap, logit_scale, outputs)
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype  # TRL's
    wanted = [name for name in EXTRAS if name in outputs]
    with torch.autocast(device, enabled=False):
        logp, entropy, *extras = linear_log_probs(
            hidden, weight, bias, targets, start=blocks.start, classes=blocks.classes, group=blocks.group,
            temperature=temperature, chunk=CHUNK, logit_scale=logit_scale, softcap=softcap, extras=bool(wanted),
            dtype=dtype, stats=torch.float32)
    named = dict(zip(EXTRAS, extras))
    return logp, entropy if "entropy" in outputs else None, *(named[n] if n in wanted else None for n in EXTRAS)


def split_reference(reference: nn.Module, split_as: tuple[Placement, Mapping[str, object]] | None) -> None:
    """Split a reference model a TRL trainer built whole (``trainer.ref_model``) with the policy's placement and plan;
    on a named placement with data axes, FSDP2 shards its decoder layers and itself over them, as the policy's are.

    Args:
        reference: the whole reference model.
        split_as: ``parallelize``'s placement and plan for the policy (``adopt.split_as``).

    Example::

        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        ...                      num_attention_heads=4, num_key_value_heads=2)
        >>> policy, reference = LlamaForCausalLM(config), LlamaForCausalLM(config)
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> tpf.parallelize(policy, placement=P, plan="auto") and None
        >>> from tpflow.hf.frameworks.adopt import split_as
        >>> split_reference(reference, split_as(policy))
        >>> reference.model.layers[0].self_attn.q_proj.weight.to_local().shape    # half of its 4 heads' rows
        torch.Size([8, 16])
    """
    from tpflow.hf.parallelize import parallelize  # (it marks models through adopt, which imports this module)

    if split_as is None:
        raise ValueError(f"tpf.adopt: the trainer holds a whole reference model ({type(reference).__name__}) beside "
                         f"a policy parallelized without its plan on record: parallelize the reference yourself")
    placement, plan = split_as
    parallelize(reference, placement=placement, plan=dict(plan))
    if not placement.leaves_data_axes or math.prod(placement.hierarchy[:-1]) == 1:
        return
    from torch.distributed.fsdp import fully_shard

    data = placement.names[:-1]
    mesh = placement.mesh[data[0] if len(data) == 1 else data]
    for layers in reference.modules():
        if isinstance(layers, nn.ModuleList):
            for layer in layers:
                fully_shard(layer, mesh=mesh)
    fully_shard(reference, mesh=mesh)
