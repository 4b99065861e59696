"""``tpf.rl.logprobs`` and ``tpf.rl.kl``: what GRPO, DPO and on-policy distillation compute of a model's logits,
each sampled token's log-probability under the sampler's temperature (and the distribution's entropy), and the KL
divergence from a teacher's or a reference's distribution, on each rank's block of a vocabulary-parallel head's
logits (``tpflow.ops.log_probs``): ``log_softmax(logits).gather(ids)`` on such logits would gather ``[tokens,
vocabulary]`` on every rank, the memory the split was meant to save."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tpflow.global_tensor.cross_entropy import vocab_layout
from tpflow.kernels.autocast import autocast_operands
from tpflow.layers.column import ColumnParallelLinear
from tpflow.layers.vocab import head_blocks
from tpflow.ops.linear_log_probs import linear_log_probs
from tpflow.ops.log_probs import vocab_parallel_kl, vocab_parallel_log_probs

__all__ = ["kl", "linear_logprobs", "logprobs"]


def logprobs(logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0, entropy: bool = False,
             ignore_index: int = -100, chunk: int = 256) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Each token's log-probability, ``log_softmax(logits / temperature, -1).gather(-1, labels)``, and with
    ``entropy`` the entropy of ``softmax(logits / temperature)`` at each position, differentiable, without the whole
    vocabulary on any rank.

    The logits are a model's output as it returns them: a global tensor split over the vocabulary (a
    vocabulary-parallel head's, ``tpf.hf_plan(model, vocab_parallel=True)``), whole on every rank, or a plain tensor
    (one device). Each rank reduces its block to four numbers per token, and one all-gather gives every rank every
    token's log-probability; the backward writes only the block's gradient. Blocks of at most ``chunk`` tokens are
    computed at once: beside the logits (read where they lie, a slice of them too), a rank holds ``[chunk,
    vocabulary / W]`` at a time.

    Args:
        logits: ``[..., vocabulary]``, aligned with ``labels`` (for a causal LM's own tokens, the logits at
            positions ``0 .. n - 2`` and the ids at ``1 .. n - 1``).
        labels: ``[...]``: the token each position scores (a plain tensor, or a global one whose block is that), or
            ``ignore_index``.
        temperature: the logits are divided by it, as the sampler divided them; > 0.
        entropy: also return each position's entropy.
        ignore_index: a label whose log-probability is 0, with no gradient (a prompt's or padding's position).
        chunk: positions computed at once.

    Returns:
        ``[...]`` log-probabilities (and ``[...]`` entropies), plain tensors, the same on every rank splitting the
        vocabulary; fp32 (fp64 for fp64 logits).

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)
        >>> whole, ids = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
        >>> logits = tpf.tensor(whole, placement=P, sbp=tpf.sbp.split(2))     # 6 and 5 tokens of 11 per rank
        >>> logp, entropy = tpf.rl.logprobs(logits, ids, temperature=0.8, entropy=True)
        >>> want = torch.log_softmax(whole / 0.8, -1)
        >>> torch.testing.assert_close(logp, want.gather(-1, ids[..., None])[..., 0])
        >>> torch.testing.assert_close(entropy, -(want.exp() * want).sum(-1))
    """
    start, group = vocab_layout(logits) if isinstance(logits, DTensor) else (0, None)
    vocabulary = logits.shape[-1]
    local = logits.to_local() if isinstance(logits, DTensor) else logits
    labels = labels.to_local() if isinstance(labels, DTensor) else labels
    if labels.shape != local.shape[:-1]:
        raise ValueError(f"logprobs: labels {tuple(labels.shape)} must have the shape of the logits' positions on "
                         f"this rank {tuple(local.shape[:-1])} (the vocabulary is the last dim; align them first: "
                         f"logits[:, :-1] score ids[:, 1:])")
    logp, h = vocab_parallel_log_probs(local, labels.reshape(-1), start=start, classes=vocabulary, group=group,
                                       temperature=temperature, ignore_index=ignore_index, chunk=chunk)
    logp = logp.reshape(labels.shape)
    return (logp, h.reshape(labels.shape)) if entropy else logp



def linear_logprobs(hidden: torch.Tensor, head: ColumnParallelLinear | nn.Linear, labels: torch.Tensor, *,
                    temperature: float = 1.0, entropy: bool = False, ignore_index: int = -100, chunk: int = 1024,
                    logit_scale: float = 1.0, softcap: float | None = None
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`logprobs` of ``head(hidden)`` without its logits: the head's product made ``chunk`` tokens at a time on
    each rank's block of the vocabulary and reduced at once, so no rank holds more than ``[chunk, vocabulary / W]``
    of logits (the forward keeps none; the backward makes each chunk's again).

    Args:
        hidden: ``[..., H]``, the head's input (a causal LM's last hidden states, ``model.model(...)``), a plain
            tensor, the same on every rank of the head's placement.
        head: the model's head (``model.get_output_embeddings()``): a ``ColumnParallelLinear`` split over the
            vocabulary, or an ``nn.Linear`` (one device's, or a head left whole).
        labels: ``[...]``: the token each position scores, or ``ignore_index``.
        temperature, entropy, ignore_index: as :func:`logprobs`'.
        chunk: tokens whose logits are made at once.
        logit_scale: the logits are multiplied by it first (a model's ``logit_scale``).
        softcap: a model's ``final_logit_softcapping`` (``softcap * tanh(logits / softcap)``), or None.

    Returns:
        ``[...]`` log-probabilities (and ``[...]`` entropies), plain tensors, the same on every rank of the head's
        placement; fp32 (fp64 for fp64 inputs). Under ``torch.autocast`` the product runs in autocast's dtype, as
        ``F.linear``'s does.

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)
        >>> head = tpf.ColumnParallelLinear(16, 101, bias=False, placement=P)   # a vocabulary-parallel lm_head
        >>> hidden, ids = torch.randn(2, 5, 16), torch.randint(0, 101, (2, 5))
        >>> logp = tpf.rl.linear_logprobs(hidden, head, ids, temperature=0.7)
        >>> want = torch.log_softmax(hidden @ head.weight.full_tensor().T / 0.7, -1)   # what it never makes
        >>> torch.testing.assert_close(logp, want.gather(-1, ids[..., None])[..., 0])
    """
    if isinstance(hidden, DTensor):
        raise TypeError("linear_logprobs takes the hidden states as a plain tensor, whole on every rank of the "
                        "head's placement (a model's last_hidden_state)")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"linear_logprobs: labels {tuple(labels.shape)} must have the hidden states' shape without "
                         f"their last dim {tuple(hidden.shape[:-1])} (align them first: hidden[:, :-1] scores "
                         f"ids[:, 1:])")
    blocks = head_blocks(head, "linear_logprobs")
    rows, (weight, bias) = hidden.reshape(-1, hidden.shape[-1]), blocks[:2]
    device = hidden.device.type
    rows, weight, bias = autocast_operands(device, rows, weight, bias)
    with torch.autocast(device, enabled=False):
        logp, h = linear_log_probs(rows, weight, bias, labels.reshape(-1), start=blocks.start,
                                   classes=blocks.classes, group=blocks.group, temperature=temperature,
                                   ignore_index=ignore_index, chunk=chunk, logit_scale=logit_scale, softcap=softcap)
    logp = logp.reshape(labels.shape)
    return (logp, h.reshape(labels.shape)) if entropy else logp

def kl(logits: torch.Tensor, reference: torch.Tensor, *, temperature: float = 1.0, chunk: int = 256) -> torch.Tensor:
    """Each position's ``KL(p || q)``, ``p = softmax(logits / temperature)`` (the policy's, a student's) and ``q =
    softmax(reference / temperature)`` (a reference model's, a teacher's), differentiable in both, without the whole
    vocabulary on any rank: on-policy distillation's loss, or a KL penalty over the whole distribution.

    Args:
        logits: ``[..., vocabulary]``: a global tensor split over the vocabulary (or whole), or a plain tensor.
        reference: the other model's, laid out alike (two models parallelized with the same plan and placement).
        temperature: both are divided by it; > 0.
        chunk: positions computed at once.

    Returns:
        ``[...]``, a plain tensor, the same on every rank splitting the vocabulary; fp32 (fp64 for fp64 logits).

    Example::

        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> _ = torch.manual_seed(0)
        >>> a, b = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
        >>> got = tpf.rl.kl(*(tpf.tensor(t, placement=P, sbp=tpf.sbp.split(2)) for t in (a, b)))
        >>> p, q = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
        >>> torch.testing.assert_close(got, (p.exp() * (p - q)).sum(-1))
    """
    layouts = [vocab_layout(t) if isinstance(t, DTensor) else (0, None) for t in (logits, reference)]
    if layouts[0] != layouts[1] or logits.shape != reference.shape:
        raise ValueError(f"kl: the logits {tuple(logits.shape)} and the reference {tuple(reference.shape)} must be "
                         f"laid out alike (the same vocabulary block on this rank: parallelize both models with the "
                         f"same plan and placement)")
    p, q = (t.to_local() if isinstance(t, DTensor) else t for t in (logits, reference))
    return vocab_parallel_kl(p, q, group=layouts[0][1], temperature=temperature, chunk=chunk).reshape(p.shape[:-1])
