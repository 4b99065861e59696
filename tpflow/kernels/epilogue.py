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
    """The epilogue's activations in torch (gelu is the tanh form).

    Args:
        y: the pre-activation, ``a @ b + bias``.
        activation: ``None`` (the identity), ``"relu"``, ``"gelu"`` or ``"silu"``.

    Returns:
        ``act(y)``: a new tensor, or ``y`` itself for ``None``.

    Example::

        >>> tpf.kernels.epilogue.activate(torch.tensor([-1.0, 2.0]), "relu")
        tensor([0., 2.])
    """
    if activation == "relu":
        return torch.relu(y)
    if activation == "gelu":
        return F.gelu(y, approximate="tanh")
    if activation == "silu":
        return F.silu(y)
    return y


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where sums of ``dtype`` values are kept: fp32 for fp16 / bf16 / fp32, fp64 for fp64.

    Args:
        dtype: the dtype of the values summed.

    Returns:
        ``torch.promote_types(dtype, torch.float32)``.

    Example::

        >>> tpf.kernels.epilogue.accumulate_dtype(torch.bfloat16)
        torch.float32
    """
    return torch.promote_types(dtype, torch.float32)


def bias_grad(dz: torch.Tensor) -> torch.Tensor:
    """The gradient of a bias added to every row: the sum of ``dz``'s rows, kept in ``accumulate_dtype``.

    Args:
        dz: the gradient of the biased result, 2-D ``[rows, N]``.

    Returns:
        ``[N]``, in ``dz``'s dtype.

    Example::

        >>> tpf.kernels.epilogue.bias_grad(torch.ones(4, 3, dtype=torch.float16))
        tensor([4., 4., 4.], dtype=torch.float16)
    """
    return dz.sum(0, dtype=accumulate_dtype(dz.dtype)).to(dz.dtype)


def activation_grad(dy: torch.Tensor, saved: torch.Tensor, activation: str | None) -> torch.Tensor:
    """dz from dy for ``y = act(z)``: ``saved`` is the output y for relu and the pre-activation z otherwise.

    The gelu (tanh form) and silu slopes are computed in ``accumulate_dtype``.

    Args:
        dy: the gradient of the output y.
        saved: what ``saved_for_grad`` kept of the forward (unused for ``None``).
        activation: ``None``, ``"relu"``, ``"gelu"`` or ``"silu"``.

    Returns:
        dz, in ``dy``'s dtype (``dy`` itself for ``None``).

    Example::

        >>> ep = tpf.kernels.epilogue
        >>> z = torch.randn(5, requires_grad=True)
        >>> ep.activate(z, "gelu").sum().backward()
        >>> torch.testing.assert_close(ep.activation_grad(torch.ones(5), z.detach(), "gelu"), z.grad)
    """
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
    """What ``activation_grad`` needs of a forward: the output for relu, the pre-activation for gelu / silu.

    Args:
        y: the forward's output.
        pre: its pre-activation, or None where it was not stored (``needs_pre`` is False).
        activation: ``None``, ``"relu"``, ``"gelu"`` or ``"silu"``.

    Returns:
        ``y`` for relu, else ``pre``.

    Example::

        >>> y = torch.ones(2, 3)
        >>> tpf.kernels.epilogue.saved_for_grad(y, None, "relu") is y
        True
    """
    return y if activation == "relu" else pre


def needs_pre(activation: str | None) -> bool:
    """Whether a forward must store the pre-activation for its backward.

    Args:
        activation: ``None``, ``"relu"``, ``"gelu"`` or ``"silu"``.

    Returns:
        True for gelu and silu, False for relu (its backward uses the output) and ``None``.

    Example::

        >>> tpf.kernels.epilogue.needs_pre("gelu"), tpf.kernels.epilogue.needs_pre("relu")
        (True, False)
    """
    return activation in ("gelu", "silu")
