"""What a model needs around a head whose logits are split over the vocabulary, so that its own code runs.

- Its loss: after the head runs inside the model's forward, ``F.cross_entropy`` is routed to the
  vocabulary-parallel loss (``tpf.vocab_parallel_loss()``) until the forward returns, so a Hugging Face model's
  ``labels=`` loss never gathers the logits. Only that stretch runs under the mode: the layers before the head
  pay nothing for it. A traced forward (``torch.compile``) runs no such hooks, so a Hugging Face model's
  ``loss_function`` is wrapped too: it runs eagerly (one graph break) under the mode, the rest of the forward
  compiled.
- Its ``generate``: decoding picks tokens from whole logits (argmax, sampling, processors written for plain
  tensors), so while the model's own ``generate`` runs, the heads gather their logits (``[batch, 1, V]`` a step).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from tpflow.global_tensor import vocab_parallel_loss
from tpflow.layers import ColumnParallelLinear

__all__ = ["route_loss"]

_STATE = "_tpflow_logits"


class _Logits:
    """The hooks of one model: the loss's mode entered after a head, left when the model's forward ends."""

    def __init__(self, model: nn.Module, heads: Sequence[ColumnParallelLinear]) -> None:
        self.heads, self.depth, self.mode = list(heads), 0, None
        model.register_forward_pre_hook(self.enter)
        model.register_forward_hook(self.leave, always_call=True)
        for head in self.heads:
            head.register_forward_hook(self.after_head)

    def enter(self, module: nn.Module, args: tuple) -> None:
        self.depth += 1

    def after_head(self, module: nn.Module, args: tuple, output: object) -> None:
        if self.depth and self.mode is None and not torch.compiler.is_compiling():
            self.mode = vocab_parallel_loss()
            self.mode.__enter__()

    def leave(self, module: nn.Module, args: tuple, output: object) -> None:
        self.depth = max(self.depth - 1, 0)  # a forward that failed before its pre-hooks ran still ends here
        if not self.depth and self.mode is not None:
            mode, self.mode = self.mode, None
            mode.__exit__(None, None, None)
            logits = getattr(output, "logits", output)
            if type(logits) is DTensor and not torch.compiler.is_compiling():
                logits.__class__ = _SplitLogits  # the user's code on them: a mistake says what to do


_MIXED = "got mixed torch.Tensor and DTensor"


class _SplitLogits(DTensor):
    """A model's logits split over the vocabulary, as it returns them, and what is computed from them: an operation
    that mixes them with a plain tensor (the user's ``F.cross_entropy``, ``argmax(-1) == labels``) fails with what to
    do, where torch says only that it "got mixed torch.Tensor and DTensor"."""

    __slots__ = ()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        try:
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **(kwargs or {}))
        except RuntimeError as e:
            if _MIXED not in str(e):
                raise
            name = getattr(func, "__name__", str(func))
            raise RuntimeError(
                f"{name} mixed the model's logits, split over the vocabulary (each rank holds its share of the "
                f"classes), with a plain tensor. For the loss, pass labels= to the model, or call tpf.cross_entropy, "
                f"or F.cross_entropy under `with tpf.vocab_parallel_loss():` (none gathers them); for metrics such as "
                f"argmax, take logits.full_tensor() (the whole logits on every rank); or parallelize with "
                f"plan=tpf.hf_plan(model, vocab_parallel=False), whose head gathers them itself") from e
        for leaf in tree_leaves(out):  # in place: the output itself comes back (a torch.Size stays one)
            if type(leaf) is DTensor:
                leaf.__class__ = _SplitLogits
        return out


@functools.cache
def _eager(fn):
    """``fn`` that dynamo does not trace: disabled at first use, not as a decorator, so importing tpflow spares
    importing dynamo (half a second, and as much again when the process exits)."""
    return torch.compiler.disable(fn)


class _Loss:
    """A Hugging Face model's ``loss_function`` under the loss's mode: what routes ``labels=`` when the forward is
    compiled (the hooks above do not run there). It runs eagerly, a graph break: dynamo does not trace a
    ``TorchFunctionMode`` entered inside the graph, nor the loss's collectives."""

    def __init__(self, model: nn.Module, loss_function) -> None:
        self.model, self.loss_function = model, loss_function

    def __call__(self, *args, **kwargs):
        return _eager(_Loss.run)(self, *args, **kwargs)

    def run(self, *args, **kwargs):
        if getattr(self.model, _STATE).mode is not None:  # eager: the hooks entered it already
            return self.loss_function(*args, **kwargs)
        with vocab_parallel_loss():
            return self.loss_function(*args, **kwargs)


class _Generate:
    """The model's own ``generate``, its heads gathering whole logits meanwhile (an object, not a bound method:
    a copy or a pickle of the model takes it along, bound to the copy)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, *args, **kwargs):
        heads = getattr(self.model, _STATE).heads
        before = [head.gather_output for head in heads]
        for head in heads:
            head.gather_output = True
        try:
            return type(self.model).generate(self.model, *args, **kwargs)
        finally:
            for head, gather in zip(heads, before):
                head.gather_output = gather


def route_loss(model: nn.Module, heads: Sequence[ColumnParallelLinear]) -> None:
    """Hook ``model`` so that its own loss code runs vocabulary-parallel on ``heads``' logits, and its own
    ``generate`` (if it has one) decodes from whole logits.

    Args:
        model: the model whose forward calls the heads and computes the loss (changed in place; once).
        heads: its ``ColumnParallelLinear(global_output=True)`` heads.

    Example::

        >>> import torch.nn.functional as F
        >>> P = tpf.placement("cpu", ranks=[0, 1])
        >>> class LM(nn.Module):                 # a model whose own code computes the loss from its head's logits
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lm_head = tpf.ColumnParallelLinear(8, 10, placement=P, global_output=True)
        ...     def forward(self, h, labels):
        ...         return F.cross_entropy(self.lm_head(h), labels)
        >>> _ = torch.manual_seed(0)
        >>> model = LM()
        >>> route_loss(model, [model.lm_head])  # what parallelize does for a "vocab" head
        >>> h, labels = torch.randn(4, 8), torch.randint(0, 10, (4,))
        >>> loss = model(h, labels)             # without it: "got mixed torch.Tensor and DTensor"
        >>> torch.allclose(loss, F.cross_entropy(model.lm_head(h).full_tensor(), labels))
        True
    """
    if hasattr(model, _STATE):  # another head of the same model (parallelize routes each vocab head as it builds it)
        state = getattr(model, _STATE)
        for head in (h for h in heads if h not in state.heads):
            state.heads.append(head)
            head.register_forward_hook(state.after_head)
        return
    setattr(model, _STATE, _Logits(model, heads))
    if callable(getattr(type(model), "generate", None)):
        model.generate = _Generate(model)  # the instance's: the class's generate runs inside
    if isinstance(getattr(type(model), "loss_function", None), property):  # a Hugging Face model's own loss
        model.loss_function = _Loss(model, model.loss_function)
