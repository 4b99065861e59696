"""The epilogue's math in torch: the activations the kernels fuse, their gradients, and where sums are kept.

The Triton kernels apply these in registers; the torch paths, the references and every backward use
these functions, so both sides compute the same thing (gelu is the tanh form).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["ACTIVATIONS", "accumulate_dtype", "activate", "activation_grad", "bias_grad", "needs_pre",
           "saved_for_grad"]

ACTIVATIONS = {None: 0, "relu": 1, "gelu": 2, "silu": 3}  # gelu is the tanh form
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    """The epilogue's activations in torch (gelu is the tanh form)."""
    if activation == "relu":
        return torch.relu(y)
    if activation == "gelu":
        return F.gelu(y, approximate="tanh")
    if activation == "silu":
        return F.silu(y)
    return y


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where sums of ``dtype`` values are kept: fp32 for fp16 / bf16 / fp32, fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


def bias_grad(dz: torch.Tensor) -> torch.Tensor:
    """The gradient of a bias added to every row of ``dz``'s 2-D rows, summed in ``accumulate_dtype``."""
    return dz.sum(0, dtype=accumulate_dtype(dz.dtype)).to(dz.dtype)


def activation_grad(dy: torch.Tensor, saved: torch.Tensor, activation: str | None) -> torch.Tensor:
    """dz from dy for ``y = act(z)``: ``saved`` is the output y for relu and the pre-activation z otherwise."""
    if activation is None:
        return dy
    if activation == "relu":
        return dy * (saved > 0)
    wide = accumulate_dtype(saved.dtype)
    z = saved.to(wide)
    if activation == "gelu":
        t = torch.tanh(_SQRT_2_OVER_PI * (z + 0.044715 * z**3))
        slope = 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * z * z)
    else:
        s = torch.sigmoid(z)
        slope = s * (1 + z * (1 - s))
    return (dy.to(wide) * slope).to(dy.dtype)


def saved_for_grad(y: torch.Tensor, pre: torch.Tensor | None, activation: str | None) -> torch.Tensor | None:
    """What ``activation_grad`` needs of a forward: the output for relu, the pre-activation for gelu / silu."""
    return y if activation == "relu" else pre


def needs_pre(activation: str | None) -> bool:
    """Whether a forward must store the pre-activation for its backward."""
    return activation in ("gelu", "silu")
