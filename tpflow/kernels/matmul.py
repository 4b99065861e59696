"""``act(a @ b + bias) + acc`` with the epilogue fused, in Triton; the local product of every tpflow layer.

The kernels are in ``tpflow.kernels.tiles``: a tiled kernel reading any strides, and a persistent
TMA kernel for Hopper, the default where TMA can read the operands (``TPFLOW_MATMUL`` picks). Both
fuse the bias, the activation (relu, tanh-GELU, SiLU), the added accumulator (a ring's received
partial) and the output cast while the fp32 accumulator is in registers, and can compute only the
rows ``[row_start, row_end)`` starting at a rotated ``tile_offset``: the ring collectives compute one
chunk of rows per step this way, without slicing (no copies, one compiled variant per config). A
transposed operand (``w.mT``) is read in place.

Dispatch: CUDA tensors run the Triton kernels; CPU tensors run torch unless
``TPFLOW_KERNELS=triton``, which runs the same kernels through ``TRITON_INTERPRET=1`` (how the
tests check them without a GPU; the interpreter mishandles bfloat16, so CPU tests use fp32/fp16).
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from tpflow.kernels import tiles

__all__ = ["ACTIVATIONS", "accumulate_dtype", "activate", "activation_grad", "bias_grad", "matmul", "matmul_ref",
           "needs_pre", "saved_for_grad", "use_triton"]

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


def matmul_ref(a: torch.Tensor, b: torch.Tensor, *, bias: torch.Tensor | None = None, activation: str | None = None,
               acc: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
               upcast: bool = False) -> torch.Tensor:
    """torch reference of ``matmul``: ``act(a @ b + bias) + acc``; ``upcast`` computes in float64."""
    out_dtype = out_dtype or a.dtype
    if upcast:
        a, b = a.double(), b.double()
        bias = None if bias is None else bias.double()
        acc = None if acc is None else acc.double()
    y = torch.matmul(a, b)
    if bias is not None:
        y = y + bias
    y = activate(y, activation)
    if acc is not None:
        y = y + acc
    return y if upcast else y.to(out_dtype)


def use_triton(t: torch.Tensor) -> bool:
    """Whether the local product of ``t`` runs the Triton kernel (see the module docstring)."""
    if t.is_cuda:
        return tiles.triton is not None
    if os.environ.get("TPFLOW_KERNELS") != "triton":
        return False
    if tiles.triton is None or not tiles.INTERPRET:
        raise RuntimeError("TPFLOW_KERNELS=triton on CPU tensors needs triton installed and TRITON_INTERPRET=1 set "
                           "before tpflow is imported")
    return True


def _torch_matmul(a, b, bias, activation, acc, out_dtype, out) -> torch.Tensor:
    """The torch path. Like the kernel, it accumulates in the widest dtype involved (fp16 inputs
    with an fp32 output or accumulator are multiplied in fp32), and makes one BLAS call when the
    epilogue is only adds (the rings' accumulator)."""
    wide = torch.promote_types(a.dtype, out_dtype if acc is None else torch.promote_types(out_dtype, acc.dtype))
    if wide != a.dtype:
        a, b, bias = a.to(wide), b.to(wide), None if bias is None else bias.to(wide)
    if activation is None and out_dtype == wide:
        base = acc if bias is None else bias if acc is None else acc + bias
        if base is None:
            return torch.matmul(a, b, out=out)
        return out.addmm_(a, b) if out is base else torch.addmm(base.to(wide), a, b, out=out)
    y = matmul_ref(a, b, bias=bias, activation=activation, acc=acc, out_dtype=out_dtype)
    return y if out is None else out.copy_(y)


def matmul(a: torch.Tensor, b: torch.Tensor, *, bias: torch.Tensor | None = None, activation: str | None = None,
           acc: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
           pre: torch.Tensor | None = None, row_start: int = 0, row_end: int | None = None,
           tile_offset: int = 0) -> torch.Tensor:
    """``act(a @ b + bias) + acc`` cast to ``out_dtype``, for ``a [..., M, K]`` and ``b [K, N]``.

    ``pre`` (2-D, shaped like the result) receives ``a @ b + bias`` before the activation, for a
    backward that needs it.
    ``row_start`` / ``row_end`` (2-D ``a``) compute only those rows; ``acc`` and ``out`` (when
    given) then hold just the rows of the range, ``[row_end - row_start, N]``. Leading batch dims
    of ``a`` are folded into rows. A batched ``b`` runs torch's matmul.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"matmul inner sizes differ: a {tuple(a.shape)} @ b {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"matmul operands must share a dtype: a is {a.dtype}, b is {b.dtype}")
    if bias is not None and bias.shape != (b.shape[-1],):
        raise ValueError(f"bias must have shape ({b.shape[-1]},), got {tuple(bias.shape)}")
    if out is not None and out_dtype not in (None, out.dtype):
        raise ValueError(f"out is {out.dtype} but out_dtype is {out_dtype}: give one of them")
    out_dtype = out.dtype if out is not None else out_dtype or a.dtype
    if a.ndim > 2 and b.ndim == 2 and row_end is None and out is None and pre is None:
        y = matmul(a.flatten(0, -2), b, bias=bias, activation=activation,
                   acc=None if acc is None else acc.flatten(0, -2), out_dtype=out_dtype)
        return y.unflatten(0, a.shape[:-1])
    if a.ndim != 2 or b.ndim != 2:
        if row_end is not None or out is not None or pre is not None:
            raise ValueError("row ranges, out= and pre= take a 2-D a and b")
        return matmul_ref(a, b, bias=bias, activation=activation, acc=acc, out_dtype=out_dtype)
    M, N = a.shape[0], b.shape[1]
    row_end = M if row_end is None else row_end
    if not 0 <= row_start <= row_end <= M:
        raise ValueError(f"row range [{row_start}, {row_end}) is outside the {M} rows of a")
    if tile_offset < 0:
        raise ValueError(f"tile_offset counts row tiles forward: it must be >= 0, got {tile_offset}")
    shape = (row_end - row_start, N)
    for name, t in (("acc", acc), ("out", out), ("pre", pre)):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must hold the rows of the range: shape {shape}, got {tuple(t.shape)}")
    if not use_triton(a):
        rows = a[row_start:row_end]
        if pre is None:
            return _torch_matmul(rows, b, bias, activation, acc, out_dtype, out)
        z = _torch_matmul(rows, b, bias, None, None, accumulate_dtype(a.dtype), None)  # the product, once
        pre.copy_(z)
        y = activate(z, activation) if acc is None else activate(z, activation) + acc
        return y.to(out_dtype) if out is None else out.copy_(y)
    out = torch.empty(shape, dtype=out_dtype, device=a.device) if out is None else out
    if pre is not None and pre.stride() != out.stride():
        raise ValueError(f"pre must have out's strides {out.stride()}, got {pre.stride()}")
    if out.numel():  # the kernels read the bias with unit stride
        bias = None if bias is None else bias.contiguous()
        tiles.launch(a, b, bias, ACTIVATIONS[activation], acc, out, pre, row_start, row_end, tile_offset)
    return out
