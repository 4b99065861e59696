"""The support matrix: every causal LM transformers registers, built tiny and checked against one device under
tensor, context and expert parallelism (``python -m tpflow.models``; ``docs/models.md``), with the share of its
values each rank holds under tensor parallelism (``shares``)."""

from tpflow.models.check import MODES, Verdict, check
from tpflow.models.sweep import sweep
from tpflow.models.zoo import causal_lm_types, tiny_model

__all__ = ["MODES", "Verdict", "causal_lm_types", "check", "sweep", "tiny_model"]
