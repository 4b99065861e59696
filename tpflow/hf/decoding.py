"""Decoding alike on every rank: a parallelized model's ``generate`` runs, on every rank of a tensor-parallel group,
from the random state of the group's first rank, and refuses what would leave ranks waiting on each other.

The ranks of a tensor-parallel group compute one model on the same tokens, so the tokens they sample must be the
same: a rank that draws another token feeds the next step other inputs than its peers, and the group decodes a
mixture. Users seed ranks apart (the DDP habit, ``torch.manual_seed(1000 + rank)``), so ``generate`` cannot trust the
ranks' own streams: at each call the first rank's random state (CPU, and CUDA's on a CUDA placement) is sent to the
others, which take it as their own and decode from it. The first rank draws from its own stream, so its tokens are
one device's under the same seed, and every rank of the group ends where one device's stream ends: what the caller
draws next (TRL shuffles the batch it generated, ``torch.randperm``) is alike on every rank.

Experts shared out over a data axis exchange tokens at every decoding step, so every rank must step until the last
one is done: transformers' ``synced_gpus`` (on by default for a model FSDP2 shards). ``synced_gpus=False`` there is
refused: a rank that finished first would leave the others waiting in the next exchange until the timeout.
"""

from __future__ import annotations

from torch import nn

from tpflow.comm.random_state import share_random_state
from tpflow.layers.experts import over_data
from tpflow.placement import Placement

__all__ = ["decode_alike"]


class _DecodeAlike:
    """The model's ``generate`` (its own, or what tpflow put there before) from the group's first rank's random state
    (an object, not a bound method: a copy or a pickle of the model takes it along)."""

    def __init__(self, model: nn.Module, placement: Placement, inner) -> None:
        self.model, self.placement, self.inner = model, placement, inner

    def __call__(self, *args, **kwargs):
        if kwargs.get("synced_gpus") is False and any(over_data(p) for p in self.model.parameters()):
            raise ValueError("generate(synced_gpus=False): the experts shared out over the data axis exchange tokens "
                             "at every step, so a rank that finished first would leave the others waiting until the "
                             "timeout; leave synced_gpus out (on for this model) so that every rank steps until the "
                             "last is done")
        pl = self.placement
        inner = self.inner if self.inner is not None else type(self.model).generate.__get__(self.model)
        if pl.hierarchy[-1] == 1 or pl.coordinate() is None:
            return inner(*args, **kwargs)
        share_random_state(pl.mesh.get_group(pl.ndim - 1), cuda=pl.type == "cuda")
        return inner(*args, **kwargs)


def decode_alike(model: nn.Module, placement: Placement) -> None:
    """Make ``model.generate`` (a Hugging Face model's) sample the same tokens on every tensor-parallel rank of
    ``placement``, whatever each rank seeded (those of the group's first rank, whose random state every rank ends
    with), and refuse ``synced_gpus=False`` where experts shared out over a data axis need every rank to step
    together.

    Args:
        model: a model after ``parallelize`` (changed in place; models without ``generate`` are left alone).
        placement: its placement; the last axis is the tensor-parallel one.

    Example::

        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> _ = torch.manual_seed(0)
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
        ...                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
        >>> model = tpf.parallelize(model, placement=tpf.placement("cpu", ranks=[0, 1]), plan="auto")  # calls it
        >>> _ = torch.manual_seed(1000 + tpf.get_rank())                   # ranks seeded apart
        >>> out = model.generate(torch.tensor([[1, 2, 3]]), do_sample=True, max_new_tokens=4, pad_token_id=0)
        >>> every = [None, None]
        >>> torch.distributed.all_gather_object(every, out.tolist())
        >>> every[0] == every[1]
        True
        >>> states = [None, None]
        >>> torch.distributed.all_gather_object(states, torch.get_rng_state())   # where the first rank's stream ends
        >>> torch.equal(states[0], states[1])
        True
    """
    if callable(getattr(type(model), "generate", None)):
        model.generate = _DecodeAlike(model, placement, model.__dict__.get("generate"))
