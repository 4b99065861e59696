"""The Triton side of ``tpflow.kernels.matmul``: two kernels with one epilogue, and their launchers.

``tiled``: one program per output tile, operands read through pointers with any strides.

    for each output tile (pid_m, pid_n), in grouped order:      # GROUP_M row-tiles share B tiles in L2
        acc = zeros(BLOCK_M, BLOCK_N, fp32)
        for k in range(0, K, BLOCK_K):
            acc += A[rows, k:k+BK] @ B[k:k+BK, cols]            # masked edges: any M, N, K
        acc = act(acc + bias[cols]) + ACC[rows, cols]           # epilogue while acc is in registers
        C[rows, cols] = acc.to(C.dtype)

``persistent``: one program per SM, each walking the tiles ``pid, pid + programs, ...`` in the
same grouped order. A, B and C move by TMA (tensor descriptors, Hopper and later): the descriptors
zero-fill loads past an edge and clip stores, so no masks are computed, and the tile loop is
flattened so that the compiler can overlap one tile's epilogue with the next tile's loads. It needs
16-byte aligned bases and row strides, one unit stride per operand (row-major, or transposed such
as ``w.mT``), and fp16 / bf16 operands (``tma_layouts``); anything else runs ``tiled``.
It is the default on a GPU: on an H100 it ran at 0.90-1.05x cuBLAS where ``tiled`` ran at 0.72-0.84x
(``benchmarks/results/kernels_NVIDIA-H100-80GB-HBM3_2026-11-23_*``). ``TPFLOW_MATMUL=tiled`` forces the
tiled kernel. Under the interpreter, which emulates TMA slowly, the default is ``tiled``.

Both compute only the rows ``[row_start, row_end)``, whose tiles start at a rotated
``tile_offset`` (the ring collectives' chunks), and write C, ACC and PRE as just those rows.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

import torch

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # CPU installs without triton run torch's matmul
    triton = None

__all__ = ["INTERPRET", "KERNELS", "kernel_choice", "launch", "tma_layouts"]

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
KERNELS = ("tiled", "persistent")
_TMA_DTYPES = (torch.float16, torch.bfloat16)
_TMA_ARCHS = (9, 10)  # Hopper and datacenter Blackwell: ~227 KB of shared memory a block, which the configs need
_INTERPRETER_PROGRAMS = 3  # fewer programs than tiles, so the interpreter checks the persistent tile walk


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _tma_layout(t: torch.Tensor) -> bool | None:
    """False if ``t`` (2-D) reads row-major by TMA, True if its transpose does, None if neither."""
    esize = t.element_size()
    if t.data_ptr() % 16 or min(t.shape) == 0:
        return None
    for transposed, (outer, inner), width in ((False, t.stride(), t.shape[1]), (True, t.stride()[::-1], t.shape[0])):
        if inner == 1 and outer >= width and (outer * esize) % 16 == 0:  # rows apart, not expanded (stride 0)
            return transposed
    return None


def tma_layouts(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor,
                pre: torch.Tensor | None) -> tuple[bool, bool] | None:
    """(a transposed, b transposed) where the persistent kernel can read a, b and write out / pre by
    TMA (see the module docstring); None where it cannot."""
    if a.dtype not in _TMA_DTYPES:
        return None
    if not INTERPRET and torch.cuda.get_device_capability(a.device)[0] not in _TMA_ARCHS:
        return None
    a_t, b_t = _tma_layout(a), _tma_layout(b)
    if a_t is None or b_t is None or any(t is not None and _tma_layout(t) is not False for t in (out, pre)):
        return None
    return a_t, b_t


def _persistent_layouts(a, b, out, pre) -> tuple[bool, bool] | None:
    """The operands' layouts if this product runs the persistent kernel, None if it runs the tiled one."""
    wanted = os.environ.get("TPFLOW_MATMUL", "tiled" if INTERPRET else "persistent")
    if wanted not in KERNELS:
        raise ValueError(f"TPFLOW_MATMUL must be one of {KERNELS}, got {wanted!r}")
    return tma_layouts(a, b, out, pre) if wanted == "persistent" else None


def kernel_choice(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, pre: torch.Tensor | None = None) -> str:
    """Which kernel computes ``out`` (some or all rows of ``a @ b``): ``TPFLOW_MATMUL`` (default
    ``persistent`` compiled, ``tiled`` under the interpreter) where the operands allow it, else ``tiled``."""
    return "tiled" if _persistent_layouts(a, b, out, pre) is None else "persistent"


if triton is not None:

    @triton.jit
    def _tile(tile, rows, N, tile_offset, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """(pid_m, pid_n) of a linear tile index: GROUP_M row-tiles sweep the columns together, and
        the row tiles are rotated by tile_offset."""
        num_pid_m = tl.cdiv(rows, BLOCK_M)
        group = GROUP_M * tl.cdiv(N, BLOCK_N)
        first_m = (tile // group) * GROUP_M
        group_m = min(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % group) % group_m
        pid_n = (tile % group) // group_m
        return (pid_m + tile_offset) % num_pid_m, pid_n

    @triton.jit
    def _halves(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """A tile's left and right halves of columns, for an epilogue with half the registers live."""
        return tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))

    @triton.jit
    def _epilogue(acc, offs_m, offs_n, rows, N, bias_ptr, acc_ptr, stride_accm, stride_accn,
                  ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ACC: tl.constexpr):
        """(z, y) of one fp32 tile whose rows are ``offs_m`` of the range: z = acc + bias (the
        pre-activation), y = act(z) + ACC."""
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        y = acc
        if ACTIVATION == 1:
            y = tl.maximum(y, 0.0)
        elif ACTIVATION == 2:  # 0.5 (1 + tanh(u)) == sigmoid(2 u), u = sqrt(2 / pi) (x + 0.044715 x^3)
            y = y * tl.sigmoid(1.5957691216057308 * (y + 0.044715 * y * y * y))
        elif ACTIVATION == 3:
            y = y * tl.sigmoid(y)
        if HAS_ACC:
            mask = (offs_m[:, None] < rows) & (offs_n[None, :] < N)
            y += tl.load(acc_ptr + offs_m[:, None] * stride_accm + offs_n[None, :] * stride_accn, mask=mask,
                         other=0.0).to(tl.float32)
        return acc, y

    # tile_offset varies from chunk to chunk of a ring: not specialised on (a value of 1 would otherwise
    # compile a kernel of its own mid-training). The row range is: whether row_start and row_end are
    # multiples of 16 decides if a transposed A's rows load as vectors (cp.async) or element by element.
    @triton.jit(do_not_specialize=["tile_offset"])
    def _tiled_kernel(
        a_ptr, b_ptr, c_ptr, bias_ptr, acc_ptr, pre_ptr,
        # sizes: C rows [row_start, row_end) of A's rows, N columns, contraction K
        N, K, row_start, row_end, tile_offset,
        stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_accm, stride_accn,
        # autotune keys: sizes rounded to powers of two, so a few rows more do not re-tune
        M_KEY, N_KEY, K_KEY,
        ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ACC: tl.constexpr, STORE_PRE: tl.constexpr,
        INPUT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        rows = row_end - row_start
        pid_m, pid_n = _tile(tl.program_id(0), rows, N, tile_offset, BLOCK_M, BLOCK_N, GROUP_M)
        out_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # C, ACC and PRE hold only the rows of the range
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + (row_start + out_m)[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
        row_mask = out_m[:, None] < rows
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

        # the epilogue in two halves of columns: half the registers live at once, so a fused GELU or an
        # fp32 partial does not spill
        left, right = _halves(acc, BLOCK_M, BLOCK_N)
        half_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 2)
        _store_half(left, out_m, half_n, rows, N, c_ptr, pre_ptr, stride_cm, stride_cn, bias_ptr, acc_ptr,
                    stride_accm, stride_accn, ACTIVATION, HAS_BIAS, HAS_ACC, STORE_PRE)
        _store_half(right, out_m, half_n + BLOCK_N // 2, rows, N, c_ptr, pre_ptr, stride_cm, stride_cn, bias_ptr,
                    acc_ptr, stride_accm, stride_accn, ACTIVATION, HAS_BIAS, HAS_ACC, STORE_PRE)

    @triton.jit
    def _store_half(acc, offs_m, offs_n, rows, N, c_ptr, pre_ptr, stride_cm, stride_cn, bias_ptr, acc_ptr,
                    stride_accm, stride_accn, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
                    HAS_ACC: tl.constexpr, STORE_PRE: tl.constexpr):
        """The epilogue of part of a tile, stored through pointers (masked at the edges)."""
        z, y = _epilogue(acc, offs_m, offs_n, rows, N, bias_ptr, acc_ptr, stride_accm, stride_accn,
                         ACTIVATION, HAS_BIAS, HAS_ACC)
        mask = (offs_m[:, None] < rows) & (offs_n[None, :] < N)
        if STORE_PRE:  # the pre-activation, for the backward of gelu / silu (same layout as C)
            tl.store(pre_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
                     z.to(pre_ptr.dtype.element_ty), mask=mask)
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn, y.to(c_ptr.dtype.element_ty),
                 mask=mask)

    @triton.jit
    def _store_tma(acc, m0, n0, offs_m, offs_n, rows, N, c_desc, pre_desc, bias_ptr, acc_ptr, stride_accm,
                   stride_accn, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ACC: tl.constexpr,
                   STORE_PRE: tl.constexpr):
        """The epilogue of one (sub)tile, stored by TMA at (m0, n0)."""
        z, y = _epilogue(acc, offs_m, offs_n, rows, N, bias_ptr, acc_ptr, stride_accm, stride_accn,
                         ACTIVATION, HAS_BIAS, HAS_ACC)
        if STORE_PRE:
            pre_desc.store([m0, n0], z.to(pre_desc.dtype))
        c_desc.store([m0, n0], y.to(c_desc.dtype))

    @triton.jit(do_not_specialize=["row_start", "tile_offset"])  # TMA coordinates: alignment is no matter
    def _persistent_kernel(
        a_desc, b_desc, c_desc, pre_desc, bias_ptr, acc_ptr,
        # sizes: C rows [row_start, row_start + rows) of A's rows, N, K; c_desc holds just those rows
        row_start, rows, N, K, tile_offset, stride_accm, stride_accn,
        M_KEY, N_KEY, K_KEY,
        ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ACC: tl.constexpr, STORE_PRE: tl.constexpr,
        A_T: tl.constexpr, B_T: tl.constexpr,  # the descriptor holds the operand's transpose
        PROGRAMS: tl.constexpr, SUBTILE: tl.constexpr,  # SUBTILE: store C in two halves (less epilogue smem)
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        tiles = tl.cdiv(rows, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        k_tiles = tl.cdiv(K, BLOCK_K)
        for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=True):
            pid_m, pid_n = _tile(tile, rows, N, tile_offset, BLOCK_M, BLOCK_N, GROUP_M)
            m0 = pid_m * BLOCK_M
            n0 = pid_n * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(k_tiles):
                k0 = ki * BLOCK_K
                a = a_desc.load([k0, row_start + m0]).T if A_T else a_desc.load([row_start + m0, k0])
                b = b_desc.load([n0, k0]).T if B_T else b_desc.load([k0, n0])
                acc = tl.dot(a, b, acc)
            offs_m = m0 + tl.arange(0, BLOCK_M)
            if SUBTILE:
                left, right = _halves(acc, BLOCK_M, BLOCK_N)
                offs_n = n0 + tl.arange(0, BLOCK_N // 2)
                _store_tma(left, m0, n0, offs_m, offs_n, rows, N, c_desc, pre_desc, bias_ptr, acc_ptr,
                           stride_accm, stride_accn, ACTIVATION, HAS_BIAS, HAS_ACC, STORE_PRE)
                _store_tma(right, m0, n0 + BLOCK_N // 2, offs_m, offs_n + BLOCK_N // 2, rows, N, c_desc,
                           pre_desc, bias_ptr, acc_ptr, stride_accm, stride_accn, ACTIVATION, HAS_BIAS, HAS_ACC,
                           STORE_PRE)
            else:
                _store_tma(acc, m0, n0, offs_m, n0 + tl.arange(0, BLOCK_N), rows, N, c_desc, pre_desc,
                           bias_ptr, acc_ptr, stride_accm, stride_accn, ACTIVATION, HAS_BIAS, HAS_ACC, STORE_PRE)

    def _tiled_configs() -> list:
        """CUDA tiles from Triton's tutorial 03 list (Hopper-friendly 128x256 / 128x128 first);
        one pinned config under the interpreter, where autotuning is meaningless."""
        if INTERPRET:
            return [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8})]
        if os.environ.get("TPFLOW_AUTOTUNE") == "0":  # tests: compile one variant, not a sweep per shape
            return [triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4,
                                  num_warps=4)]
        shapes = [(128, 256, 64, 3, 8), (128, 256, 64, 4, 8), (256, 128, 64, 3, 8), (128, 128, 64, 4, 4),
                  (128, 128, 32, 4, 4), (64, 256, 32, 4, 4), (128, 64, 32, 4, 4), (64, 128, 32, 4, 4),
                  (64, 64, 32, 5, 2), (32, 64, 32, 5, 2)]
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_stages=s, num_warps=w)
                for m, n, k, s, w in shapes]

    def _set_blocks(args: dict) -> None:
        """Give the descriptors the block shapes of the config about to run (autotune's pre_hook)."""
        bm, bn, bk = args["BLOCK_M"], args["BLOCK_N"], args["BLOCK_K"]
        args["a_desc"].block_shape = [bk, bm] if args["A_T"] else [bm, bk]
        args["b_desc"].block_shape = [bn, bk] if args["B_T"] else [bk, bn]
        for name in ("c_desc", "pre_desc"):
            args[name].block_shape = [bm, bn // 2 if args["SUBTILE"] else bn]

    def _persistent_configs() -> list:
        """Hopper tiles: those that won somewhere in a sweep of one config at a time on an H100
        (``benchmarks/kernels_configs.py``: 128 x 256 with 8 warps, 3-4 stages, C whole or in halves, 4, 8
        or 16 row tiles a group), and 128 x 128 with 4 warps for products too small to fill the SMs with
        128 x 256 tiles (the sweep's shapes are all large). 128 x 128 with 8 warps, 256 x 128 and
        BLOCK_K = 128 lost on every shape; 4 stages of 128 x 256 with C whole do not fit in shared memory.
        One pinned config under the interpreter and for the tests."""
        if INTERPRET:
            shapes = [(32, 32, 16, 1, 4, True, 8)]
        elif os.environ.get("TPFLOW_AUTOTUNE") == "0":
            shapes = [(128, 128, 64, 3, 8, True, 8)]
        else:
            shapes = [(128, 256, 64, 3, 8, True, 8), (128, 256, 64, 3, 8, True, 16), (128, 256, 64, 3, 8, True, 4),
                      (128, 256, 64, 4, 8, True, 8), (128, 256, 64, 3, 8, False, 8), (128, 128, 64, 4, 4, False, 8)]
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": g, "SUBTILE": sub},
                              num_stages=s, num_warps=w, pre_hook=_set_blocks) for m, n, k, s, w, sub, g in shapes]

    class _KeepAcc:
        """Autotuning times every config on the caller's tensors, several runs each. Where ACC is C itself
        (``matmul(a, b, acc=s, out=s)`` accumulates in place, as the rings' weight gradients do), each run
        would add into it again: ACC is saved before a run and put back after. Nothing is copied otherwise."""

        def __init__(self) -> None:
            self.saved = None

        def pre_hook(self, args: dict, reset_only: bool = False) -> None:
            out = args["c_ptr"] if "c_ptr" in args else args["c_desc"].base
            acc = args["acc_ptr"]
            if not reset_only and args["HAS_ACC"] and \
                    acc.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
                self.saved = acc.clone()

        def post_hook(self, args: dict, exception: BaseException | None) -> None:
            if self.saved is not None:
                args["acc_ptr"].copy_(self.saved)
                self.saved = None

    def _autotune(configs: list, key: list):
        keep = _KeepAcc()
        return triton.autotune(configs=configs, key=key, pre_hook=keep.pre_hook, post_hook=keep.post_hook)

    class _Tuned:
        """An autotuned kernel that remembers the config chosen for each key it has launched with, and
        launches a known key with it directly. Triton's ``Autotuner.run`` rebuilds its key from every
        argument, merges dicts and runs the config's pre-hook on every launch: 35-48 us of host time a
        launch with a no-op kernel on a 2-core EPYC VM (timeit), against 8 us for the direct call. On an
        H100 machine's CPU the direct launch saved 6-49 us of 108-220 in five of six alternating rounds
        (``benchmarks/results/host_launch_NVIDIA-H100-80GB-HBM3_2026-11-23.md``). Under the interpreter
        the autotuner holds the one pinned config, so the CPU tests run both paths."""

        def __init__(self, configs: list, key: list, kernel) -> None:
            self.autotuner = _autotune(configs, key)(kernel)
            self.chosen: dict[tuple, triton.Config] = {}

        def launch(self, grid, key: tuple, args: tuple, kwargs: dict, set_blocks=None) -> None:
            """``kernel[grid](*args, **kwargs)`` under the config chosen for ``key``: tuned on the key's first
            launch, and through the autotuner while torch.compile traces. ``set_blocks(meta)`` gives the
            TMA descriptors the config's block shapes (what its pre-hook does)."""
            compiling = torch.compiler.is_compiling()
            config = None if compiling else self.chosen.get(key)
            if config is None:
                self.autotuner[grid](*args, **kwargs)
                if not compiling:
                    self.chosen[key] = self.autotuner.best_config
                return
            if set_blocks is not None:
                set_blocks(config.kwargs)
            self.autotuner.fn[grid](*args, **kwargs, **config.all_kwargs())

    _KEY = ["M_KEY", "N_KEY", "K_KEY", "ACTIVATION", "HAS_BIAS", "HAS_ACC", "STORE_PRE"]
    _tiled_kernel = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})(_tiled_kernel)

    def _persistent_tuned(configs: list) -> _Tuned:
        """The persistent kernel autotuned over ``configs`` (a sweep or a test pins its own)."""
        return _Tuned(configs, _KEY + ["A_T", "B_T"], _persistent_kernel)

    _tiled = _Tuned(_tiled_configs(), _KEY, _tiled_kernel)
    _persistent = _persistent_tuned(_persistent_configs())

# One launch at a time: an autotuner keeps the arguments of the call it is tuning on itself (and the hooks
# above their saved ACC), and FakeWorld's ranks launch from threads. Only the host side is serialised; under
# torch.compile the launch is traced, not run, and a lock there would break the graph.
_LAUNCH = threading.Lock()


_THREAD = threading.local()


def _current_context(device: torch.device) -> None:
    """Make ``device``'s CUDA context current on this thread. Triton encodes TMA descriptors
    (cuTensorMapEncodeTiled) before its launcher makes a context current, so a thread's first persistent
    launch failed with "invalid device context" where nothing had run on it yet (FakeWorld's ranks, any
    user thread; triton#3729's class). A runtime call that needs the context makes it current, once per
    thread and device."""
    seen = _THREAD.__dict__.setdefault("devices", set())
    if INTERPRET or device.type != "cuda" or device.index in seen:  # (compile-only runs pass CPU tensors)
        return
    torch.cuda.mem_get_info(device)
    seen.add(device.index)


@functools.cache
def _programs(device: torch.device) -> int:
    """Programs of the persistent kernel: one per SM."""
    return _INTERPRETER_PROGRAMS if INTERPRET else torch.cuda.get_device_properties(device).multi_processor_count


def _launch_tiled(a, b, bias, acc, out, pre, row_start, row_end, tile_offset, flags) -> None:
    K, N = b.shape
    acc_arg = acc if acc is not None else out
    fp32 = a.dtype == torch.float32 and not (a.is_cuda and torch.backends.cuda.matmul.allow_tf32)
    tensors = (a, b, out, bias if bias is not None else out, acc_arg, pre if pre is not None else out)
    sizes = (_pow2(row_end - row_start), _pow2(N), _pow2(K))
    kwargs = dict(INPUT_PRECISION="ieee" if fp32 else "tf32", **flags)

    def grid(META):
        return (triton.cdiv(row_end - row_start, META["BLOCK_M"]) * triton.cdiv(N, META["BLOCK_N"]),)

    _tiled.launch(grid, (*sizes, *kwargs.values(), *(t.dtype for t in tensors)), (
        *tensors, N, K, row_start, row_end, tile_offset,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        acc_arg.stride(0), acc_arg.stride(1), *sizes), kwargs)


def _launch_persistent(a, b, bias, acc, out, pre, row_start, row_end, tile_offset, flags, layouts) -> None:
    a_t, b_t = layouts
    rows, N, K = out.shape[0], out.shape[1], a.shape[1]
    acc_arg = acc if acc is not None else out
    placeholder = [16, 16]  # every launch sets the config's blocks (_set_blocks) first

    def desc(t):
        return TensorDescriptor.from_tensor(t, placeholder)

    _current_context(a.device)
    c_desc = desc(out)
    descs = dict(a_desc=desc(a.mT if a_t else a), b_desc=desc(b.mT if b_t else b), c_desc=c_desc,
                 pre_desc=c_desc if pre is None else desc(pre))
    programs = _programs(a.device)
    bias_arg = bias if bias is not None else out
    sizes = (_pow2(rows), _pow2(N), _pow2(K))
    kwargs = dict(A_T=a_t, B_T=b_t, PROGRAMS=programs, **flags)

    def grid(META):
        return (min(programs, triton.cdiv(rows, META["BLOCK_M"]) * triton.cdiv(N, META["BLOCK_N"])),)

    _persistent.launch(
        grid, (*sizes, *kwargs.values(), a.dtype, b.dtype, out.dtype, descs["pre_desc"].base.dtype, bias_arg.dtype,
               acc_arg.dtype),
        (*descs.values(), bias_arg, acc_arg, row_start, rows, N, K, tile_offset, acc_arg.stride(0), acc_arg.stride(1),
         *sizes), kwargs,
        set_blocks=lambda meta: _set_blocks({**descs, **meta, "A_T": a_t, "B_T": b_t}))


def launch(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, activation: int, acc: torch.Tensor | None,
           out: torch.Tensor, pre: torch.Tensor | None, row_start: int, row_end: int, tile_offset: int) -> None:
    """Run the product on the kernel ``kernel_choice`` picks (``activation`` is its code in ``ACTIVATIONS``)."""
    layouts = _persistent_layouts(a, b, out, pre)
    flags = dict(ACTIVATION=activation, HAS_BIAS=bias is not None, HAS_ACC=acc is not None, STORE_PRE=pre is not None)
    with contextlib.nullcontext() if torch.compiler.is_compiling() else _LAUNCH:
        if layouts is None:
            _launch_tiled(a, b, bias, acc, out, pre, row_start, row_end, tile_offset, flags)
        else:
            _launch_persistent(a, b, bias, acc, out, pre, row_start, row_end, tile_offset, flags, layouts)
