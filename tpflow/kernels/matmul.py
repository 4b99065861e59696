"""``act(a @ b + bias) + acc`` with the epilogue fused, in Triton; the local product of every tpflow layer.

The kernels are in ``tiles`` (a tiled kernel reading any strides, and a persistent TMA kernel for
Hopper, the default where TMA can read the operands: the ``matmul`` switch picks), launched by
``launcher``. Both fuse the bias, the activation (relu, tanh-GELU, SiLU), the added accumulator (a
ring's received partial) and the output cast while the fp32 accumulator is in registers, and can
compute only the rows ``[row_start, row_end)`` starting at a rotated ``tile_offset``: the ring
collectives compute one chunk of rows per step this way, without slicing (no copies, one compiled
variant per config). A transposed operand (``w.mT``) is read in place.

Dispatch: CUDA tensors run the Triton kernels; CPU tensors run torch unless the ``kernels`` switch is
``"triton"``, which runs the same kernels through Triton's interpreter (``TRITON_INTERPRET=1``; how the
tests check them without a GPU; the interpreter mishandles bfloat16, so CPU tests use fp32/fp16).
"""

from __future__ import annotations

import importlib.util

import torch

from tpflow import config
from tpflow.kernels.epilogue import ACTIVATIONS, accumulate_dtype, activate

if importlib.util.find_spec("triton") is not None:
    from tpflow.kernels import launcher
else:  # CPU installs without triton run torch's matmul
    launcher = None

__all__ = ["matmul", "matmul_ref", "use_triton"]


def matmul_ref(a: torch.Tensor, b: torch.Tensor, *, bias: torch.Tensor | None = None, activation: str | None = None,
               acc: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
               upcast: bool = False) -> torch.Tensor:
    """The torch reference of ``matmul``: ``act(a @ b + bias) + acc``, used by tests and benchmarks.

    Args:
        a, b, bias, activation, acc, out_dtype: as in ``matmul``.
        upcast: compute in float64 and return float64 (the reference a tolerance is measured against).

    Returns:
        The product, in ``out_dtype`` (default: ``a``'s dtype).

    Example::

        >>> matmul_ref(torch.ones(2, 3), torch.ones(3, 4), activation="relu").shape
        torch.Size([2, 4])
    """
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


def use_triton(t: torch.Tensor, rows: int | None = None) -> bool:
    """Whether the local product of ``t`` runs the Triton kernels: on CUDA where triton is installed; on CPU when
    the ``kernels`` switch is ``"triton"`` (which needs triton and ``TRITON_INTERPRET=1``); and not for fewer
    ``rows`` than the ``triton_min_rows`` switch's (decode-sized products, whose launch costs more than they
    compute).

    Args:
        t: an operand of the product.
        rows: the product's rows, if known.

    Returns:
        True for the Triton kernels, False for torch's matmul.

    Example::

        >>> with tpf.config.override(kernels="torch"):
        ...     use_triton(torch.ones(2, 2))
        False
    """
    if rows is not None and rows < config.get("triton_min_rows", t.device):
        return False
    if t.is_cuda:
        return launcher is not None
    if config.get("kernels") != "triton":
        return False
    if launcher is None or not launcher.INTERPRET:
        raise RuntimeError("the kernels switch is 'triton' (TPFLOW_KERNELS=triton) on CPU tensors, which needs "
                           "triton installed and TRITON_INTERPRET=1 set before tpflow is imported")
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
    """``act(a @ b + bias) + acc`` cast to ``out_dtype``, for ``a [..., M, K]`` and ``b [K, N]``, in one kernel.

    Sums are kept in fp32 (fp64 for fp64 inputs) whatever the operands' dtype. Leading batch dims of ``a``
    are folded into rows; a batched ``b`` runs torch's matmul.

    Args:
        a, b: the operands, of one dtype; a transposed view (``w.mT``) is read in place.
        bias: ``[N]``, added to every row.
        activation: ``None``, ``"relu"``, ``"gelu"`` (tanh form) or ``"silu"``, applied after the bias.
        acc: added after the activation (a ring's received partial sum).
        out_dtype: the result's dtype (default: ``a``'s), e.g. fp32 partial sums of bf16 operands.
        out: a tensor to write the result into (then ``out_dtype`` is its dtype).
        pre: receives ``a @ b + bias`` before the activation (2-D, shaped like the result), for a backward.
        row_start, row_end: with a 2-D ``a``, compute only these rows; ``acc``, ``out`` and ``pre`` then hold
            just the rows of the range, ``[row_end - row_start, N]``.
        tile_offset: start the tile walk this many row tiles into the range (the rings' chunks).

    Returns:
        The result, ``[..., M, N]`` (or the rows of the range).

    Example::

        >>> a, b = torch.randn(8, 16), torch.randn(16, 4)
        >>> y = matmul(a, b, bias=torch.zeros(4), activation="gelu")
        >>> torch.testing.assert_close(y, matmul_ref(a, b, bias=torch.zeros(4), activation="gelu"))
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
    if not use_triton(a, row_end - row_start):
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
        launcher.launch(a, b, bias, ACTIVATIONS[activation], acc, out, pre, row_start, row_end, tile_offset)
    return out
