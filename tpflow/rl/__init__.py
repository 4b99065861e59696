"""Reinforcement-learning post-training on parallelized models: per-token log-probabilities and entropies of
sampled tokens, and the KL divergence between two models' distributions, computed on the vocabulary-split logits a
parallelized model returns, without gathering them; its weights streamed to an inference engine; its device memory
lent to a colocated engine while it generates (``tpf.offload`` / ``tpf.reload``)."""

from __future__ import annotations

from tpflow.rl.logprobs import kl, linear_logprobs, logprobs
from tpflow.rl.offload import offload, reload
from tpflow.rl.reshard import Part, ReshardPlan, reshard_plan
from tpflow.rl.weights import WeightMeta, Weights, weights

__all__ = ["Part", "ReshardPlan", "WeightMeta", "Weights", "kl", "linear_logprobs", "logprobs", "offload", "reload",
           "reshard_plan", "weights"]
