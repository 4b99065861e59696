"""``y = act(x @ W^T + b)`` as an autograd function on the matmul kernels.

    x  [M, K]   (leading dims folded into M)     W  [N, K]  (nn.Linear's layout; the math reads W^T [K, N])
    forward   y  = act(x @ W^T + b)              one kernel, bias and activation fused
    dgrad     dx = dz @ W                        dz = dy * act'(z)
    wgrad     dW = dz^T @ x,  db = sum_rows(dz)  transposes are strides: no copies

Saved for backward: x and W always; for relu the output (its sign is the mask); for gelu and
silu the pre-activation z, written by the same kernel launch.

A backward run towards some inputs only (``torch.autograd.backward(inputs=...)``, a zero-bubble pipeline's
input-gradient and weight-gradient steps) computes only the gradients the engine will use, as torch's own
nodes do (``wanted``).

Where the products run in torch (CPU tensors, unless the ``kernels`` switch is ``"triton"``) and the backward
has nothing to add (no ``dgrad_hook``, no dtype change), ``linear`` is ``F.linear`` and the
activation, with autograd's own backward: the same products, without Python in the backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tpflow.kernels.autocast import autocast_operands
from tpflow.kernels.epilogue import ACTIVATIONS, activate, activation_grad, bias_grad, needs_pre, saved_for_grad
from tpflow.kernels.matmul import matmul, use_triton

__all__ = ["linear", "linear_ref", "wanted"]


def wanted(ctx, index: int) -> bool:
    """Whether a custom autograd function's backward must compute the gradient of its input ``index``: the input
    needs one and the engine will pass it on in this backward (not when ``backward(inputs=...)`` runs only towards
    the input, or only towards the weights).

    The function's tensor arguments must come first in ``forward``'s arguments: ``ctx.next_functions`` lists the
    tensor arguments only, by their position among the arguments before any non-tensor one.

    Args:
        ctx: the function's context in ``backward``.
        index: the input's position in ``forward``'s arguments (after ``ctx``), one of its leading tensors.

    Returns:
        True to compute it.

    Example::

        >>> class Scale(torch.autograd.Function):
        ...     @staticmethod
        ...     def forward(ctx, x, w):
        ...         ctx.save_for_backward(x, w)
        ...         return x * w
        ...     @staticmethod
        ...     def backward(ctx, dy):
        ...         x, w = ctx.saved_tensors
        ...         print(wanted(ctx, 0), wanted(ctx, 1))
        ...         return dy * w if wanted(ctx, 0) else None, (dy * x).sum() if wanted(ctx, 1) else None
        >>> x, w = torch.ones(3, requires_grad=True), torch.tensor(2.0, requires_grad=True)
        >>> Scale.apply(x, w).sum().backward()
        True True
        >>> Scale.apply(x, w).sum().backward(inputs=[w])             # only towards the weight
        False True
    """
    if not ctx.needs_input_grad[index] or torch.compiler.is_compiling():  # traced code has no engine to ask
        return ctx.needs_input_grad[index]
    node = ctx.next_functions[index][0]
    try:
        return node is None or torch._C._will_engine_execute_node(node)
    except RuntimeError:  # torch cannot say for a leaf that autograd.grad() captures: it is one the caller asked for
        return True


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               activation: str | None = None) -> torch.Tensor:
    """The torch reference of ``linear``, differentiable by autograd.

    Args:
        x, weight, bias, activation: as in ``linear``.

    Returns:
        ``act(x @ weight.T + bias)``.

    Example::

        >>> linear_ref(torch.ones(2, 3), torch.ones(4, 3), activation="silu").shape
        torch.Size([2, 4])
    """
    return activate(F.linear(x, weight, bias), activation)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, activation, dgrad_hook, out_dtype, dgrad_dtype):
        x2 = x.flatten(0, -2) if x.ndim > 1 else x.unsqueeze(0)
        pre = torch.empty(x2.shape[0], weight.shape[0], dtype=x.dtype, device=x.device) \
            if needs_pre(activation) else None
        # the output is allocated in its final shape (not a view), so a caller may reduce it in place
        y = torch.empty(*x.shape[:-1], weight.shape[0], dtype=out_dtype or x.dtype, device=x.device)
        y2 = matmul(x2, weight.mT, bias=bias, activation=activation, pre=pre,
                    out=y.view(x2.shape[0], weight.shape[0]))
        ctx.activation, ctx.has_bias, ctx.x_shape, ctx.dgrad_hook = activation, bias is not None, x.shape, dgrad_hook
        ctx.dgrad_dtype = dgrad_dtype
        ctx.save_for_backward(x2, weight, saved_for_grad(y2, pre, activation))
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, weight, saved = ctx.saved_tensors
        dz = activation_grad(dy.reshape(x2.shape[0], weight.shape[0]), saved, ctx.activation).to(weight.dtype)
        dx = dw = db = pending = None
        if wanted(ctx, 0):
            dx = matmul(dz, weight, out_dtype=ctx.dgrad_dtype).reshape(ctx.x_shape)
            if ctx.dgrad_hook is not None:  # e.g. an async all-reduce of dx, running during the wgrad below
                pending = ctx.dgrad_hook(dx)
        if wanted(ctx, 1):
            dw = matmul(dz.mT, x2, out_dtype=weight.dtype)
        if ctx.has_bias and wanted(ctx, 2):
            db = bias_grad(dz)
        if pending is not None:
            pending.wait()
        if dx is not None:
            dx = dx.to(x2.dtype)
        return dx, dw, db, None, None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str | None = None, *, out_dtype: torch.dtype | None = None,
           dgrad_hook: Callable[[torch.Tensor], object] | None = None,
           dgrad_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``act(x @ weight.T + bias)`` for ``x [..., K]`` and ``weight [N, K]`` (``nn.Linear``'s layout), differentiable.

    Forward is one kernel launch (bias and activation fused); backward two (dx and dW, transposes read as
    strides), with the bias gradient summed in fp32 (fp64 for fp64 inputs). Under ``torch.autocast`` the
    operands are cast first as ``F.linear``'s are (``autocast_operands``: float64 is left alone; the gradients flow
    back through the casts).

    Args:
        x: the input, of ``weight``'s dtype.
        weight: ``[N, K]``.
        bias: ``[N]`` or None.
        activation: ``None``, ``"relu"``, ``"gelu"`` (tanh form) or ``"silu"``.
        out_dtype: the output's dtype (e.g. fp32 partial sums of bf16 inputs, to be summed over ranks).
        dgrad_hook: called in backward as ``dgrad_hook(dx)`` as soon as the input gradient is computed (in
            ``dgrad_dtype``), to start work on it in place (an async all-reduce); what it returns is
            ``wait()``-ed after the weight gradient, so that work overlaps the weight-gradient matmul.
        dgrad_dtype: the dtype ``dgrad_hook`` sees dx in (default: x's); dx is then cast to x's dtype.

    Returns:
        ``[..., N]``.

    Example::

        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> lin = torch.nn.Linear(8, 3)
        >>> y = linear(x, lin.weight, lin.bias, "relu")
        >>> y.sum().backward()
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
    device = x.device.type
    if torch.is_autocast_enabled(device):  # autocast's casts for F.linear, done here: the kernels take one dtype
        x, weight, bias = autocast_operands(device, x, weight, bias)
        with torch.autocast(device, enabled=False):
            return linear(x, weight, bias, activation, out_dtype=out_dtype, dgrad_hook=dgrad_hook,
                          dgrad_dtype=dgrad_dtype)
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features but weight {tuple(weight.shape)} expects {weight.shape[1]}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype} but weight is {weight.dtype}: cast one of them")
    backward = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias))
    if (not backward or (dgrad_hook is None and dgrad_dtype in (None, x.dtype))) and out_dtype in (None, x.dtype) \
            and not use_triton(x, x.numel() // max(x.shape[-1], 1)):  # no backward: the hook has nothing to start
        return linear_ref(x, weight, None if bias is None else bias.to(x.dtype), activation)  # see the module doc
    return _Linear.apply(x, weight, bias, activation, dgrad_hook, out_dtype, dgrad_dtype)
