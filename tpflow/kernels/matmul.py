"""Tiled matmul with a fused epilogue, in Triton; the local product of every tpflow layer.

    for each output tile (pid_m, pid_n), in grouped order:      # GROUP_M row-tiles share B tiles in L2
        acc = zeros(BLOCK_M, BLOCK_N, fp32)
        for k in range(0, K, BLOCK_K):
            acc += A[rows, k:k+BK] @ B[k:k+BK, cols]            # masked edges: any M, N, K
        acc = act(acc + bias[cols]) + ACC[rows, cols]           # epilogue while acc is in registers
        C[rows, cols] = acc.to(C.dtype)

Only the rows in ``[row_start, row_end)`` are computed: the ring collectives compute one chunk of
rows per step this way, without slicing (so no copies and one compiled variant per config). The
row tiles can start at a rotated ``tile_offset``, so that ranks sweeping the same operand at once
need not all begin on the same tiles. Any strides work, so a transposed
operand (``w.mT``) is read in place.

Dispatch: CUDA tensors run the Triton kernel; CPU tensors run torch unless
``TPFLOW_KERNELS=triton``, which runs the same kernel through ``TRITON_INTERPRET=1`` (how the
tests check it without a GPU; the interpreter mishandles bfloat16, so CPU tests use fp32/fp16).
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton run torch's matmul
    triton = None

__all__ = ["ACTIVATIONS", "accumulate_dtype", "activate", "activation_grad", "bias_grad", "matmul", "matmul_ref", "needs_pre", "saved_for_grad",
           "use_triton"]

ACTIVATIONS = {None: 0, "relu": 1, "gelu": 2, "silu": 3}  # gelu is the tanh form
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
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


if triton is not None:

    def _configs() -> list:
        """CUDA tiles from Triton's tutorial 03 list (Hopper-friendly 128x256 / 128x128 first);
        one pinned config under the interpreter, where autotuning is meaningless."""
        if _INTERPRET:
            return [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8})]
        if os.environ.get("TPFLOW_AUTOTUNE") == "0":  # tests: compile one variant, not a sweep per shape
            return [triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4,
                                  num_warps=4)]
        shapes = [(128, 256, 64, 3, 8), (128, 256, 64, 4, 8), (256, 128, 64, 3, 8), (128, 128, 64, 4, 4), (128, 128, 32, 4, 4), (64, 256, 32, 4, 4),
                  (128, 64, 32, 4, 4), (64, 128, 32, 4, 4), (64, 64, 32, 5, 2), (32, 64, 32, 5, 2)]
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_stages=s, num_warps=w)
                for m, n, k, s, w in shapes]

    @triton.jit
    def _matmul_kernel(
        # pointers
        a_ptr, b_ptr, c_ptr, bias_ptr, acc_ptr, pre_ptr,
        # sizes: C rows [row_start, row_end) of an (M, N) product with contraction K
        M, N, K, row_start, row_end, tile_offset,
        # strides
        stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_accm, stride_accn,
        # autotune keys: sizes rounded to powers of two, so a few rows more do not re-tune
        M_KEY, N_KEY, K_KEY,
        # meta
        ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ACC: tl.constexpr, STORE_PRE: tl.constexpr,
        INPUT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(row_end - row_start, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        group = GROUP_M * num_pid_n
        first_m = (pid // group) * GROUP_M
        group_m = min(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % group) % group_m
        pid_n = (pid % group) // group_m
        pid_m = (pid_m + tile_offset) % num_pid_m

        offs_m = row_start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
        row_mask = offs_m[:, None] < row_end
        col_mask = offs_n[None, :] < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:  # no K mask: the loads stay simple enough to pipeline well
                a = tl.load(a_ptrs, mask=row_mask, other=0.0)
                b = tl.load(b_ptrs, mask=col_mask, other=0.0)
            else:
                k_left = K - k * BLOCK_K
                a = tl.load(a_ptrs, mask=row_mask & (offs_k[None, :] < k_left), other=0.0)
                b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & col_mask, other=0.0)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk

        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        mask = row_mask & col_mask
        out_m = offs_m - row_start  # C, ACC and PRE hold only the rows of the range
        if STORE_PRE:  # the pre-activation, for the backward of gelu / silu (same layout as C)
            pre_ptrs = pre_ptr + out_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
            tl.store(pre_ptrs, acc.to(pre_ptr.dtype.element_ty), mask=mask)
        if ACTIVATION == 1:
            acc = tl.maximum(acc, 0.0)
        elif ACTIVATION == 2:  # 0.5 (1 + tanh(y)) == sigmoid(2 y), y = sqrt(2 / pi) (x + 0.044715 x^3)
            acc = acc * tl.sigmoid(1.5957691216057308 * (acc + 0.044715 * acc * acc * acc))
        elif ACTIVATION == 3:
            acc = acc * tl.sigmoid(acc)
        if HAS_ACC:
            acc_ptrs = acc_ptr + out_m[:, None] * stride_accm + offs_n[None, :] * stride_accn
            acc += tl.load(acc_ptrs, mask=mask, other=0.0).to(tl.float32)
        c_ptrs = c_ptr + out_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)

    def _even_k(args: dict) -> bool:
        return args["K"] % args["BLOCK_K"] == 0

    _matmul_kernel = triton.heuristics({"EVEN_K": _even_k})(_matmul_kernel)
    _matmul_tuned = _matmul_kernel if _INTERPRET else triton.autotune(
        configs=_configs(), key=["M_KEY", "N_KEY", "K_KEY", "ACTIVATION", "HAS_BIAS", "HAS_ACC", "STORE_PRE"],
    )(_matmul_kernel)


def use_triton(t: torch.Tensor) -> bool:
    """Whether the local product of ``t`` runs the Triton kernel (see the module docstring)."""
    if t.is_cuda:
        return triton is not None
    if os.environ.get("TPFLOW_KERNELS") != "triton":
        return False
    if triton is None or not _INTERPRET:
        raise RuntimeError("TPFLOW_KERNELS=triton on CPU tensors needs triton installed and TRITON_INTERPRET=1 set "
                           "before tpflow is imported")
    return True


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _triton_matmul(a, b, bias, activation, acc, out, pre, row_start, row_end, tile_offset) -> None:
    M, K = a.shape
    N = b.shape[1]
    acc_arg = acc if acc is not None else out
    fp32 = a.dtype == torch.float32 and not (a.is_cuda and torch.backends.cuda.matmul.allow_tf32)
    meta = _configs()[0].kwargs if _INTERPRET else {}  # the interpreter's kernel is not autotuned

    def grid(META):
        return (triton.cdiv(row_end - row_start, META["BLOCK_M"]) * triton.cdiv(N, META["BLOCK_N"]),)

    _matmul_tuned[grid](
        a, b, out, bias if bias is not None else out, acc_arg, pre if pre is not None else out,
        M, N, K, row_start, row_end, tile_offset,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        acc_arg.stride(0), acc_arg.stride(1),
        _pow2(row_end - row_start), _pow2(N), _pow2(K),
        ACTIVATION=ACTIVATIONS[activation], HAS_BIAS=bias is not None, HAS_ACC=acc is not None,
        STORE_PRE=pre is not None,
        INPUT_PRECISION="ieee" if fp32 else "tf32", **meta,
    )


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
    if out.numel():
        _triton_matmul(a, b, bias, activation, acc, out, pre, row_start, row_end, tile_offset)
    return out
