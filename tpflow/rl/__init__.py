"""Reinforcement-learning post-training on parallelized models: per-token log-probabilities and entropies of
sampled tokens computed on the vocabulary-split logits a parallelized model returns, without gathering them."""

from __future__ import annotations

from tpflow.rl.logprobs import logprobs

__all__ = ["logprobs"]
