"""The host side of the Triton kernels: which kernel runs a product, and its launch.

``kernel_choice`` picks the persistent TMA kernel where the ``matmul`` switch asks for it (its default on a
GPU: 0.90-1.01x cuBLAS on an H100 where the tiled kernel ran 0.75-0.84x, ``benchmarks/README.md``) and
TMA can read the operands (``tma_layouts``), else the tiled one; under the interpreter, which emulates
TMA slowly, the default is tiled. ``launch`` builds the arguments (TMA descriptors, sizes rounded to
powers of two as autotune keys) and launches through ``tuning.tuned(kernel)``.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from tpflow import config
from tpflow.kernels import tuning
from tpflow.kernels.tiles import INTERPRET

__all__ = ["INTERPRET", "KERNELS", "input_precision", "kernel_choice", "launch", "one_at_a_time", "programs",
           "tma_layouts"]

KERNELS = tuning.KERNELS
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
    """Whether the persistent kernel can read ``a``, ``b`` and write ``out`` / ``pre`` by TMA.

    TMA needs fp16 / bf16 operands on a Hopper or datacenter Blackwell GPU, 16-byte aligned bases and row
    strides, and one unit stride per operand; C and PRE are stored row-major.

    Args:
        a, b, out, pre: the product's tensors (``pre`` may be None).

    Returns:
        ``(a transposed, b transposed)`` where it can, None where it cannot.

    Example::

        >>> x, w = torch.randn(4, 32, dtype=torch.float16), torch.randn(16, 32, dtype=torch.float16)
        >>> y = torch.empty(4, 16, dtype=torch.float16)
        >>> tma_layouts(x, w.mT, y, None)                                # x @ w.T: w is read transposed
        (False, True)
        >>> tma_layouts(x.float(), w.mT.float(), y.float(), None) is None   # fp32: no TMA
        True
    """
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
    wanted = config.get("matmul")
    if wanted == "auto":
        wanted = "tiled" if INTERPRET else "persistent"
    return tma_layouts(a, b, out, pre) if wanted == "persistent" else None


def kernel_choice(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, pre: torch.Tensor | None = None) -> str:
    """Which kernel computes ``out`` (some or all rows of ``a @ b``).

    Args:
        a, b: the operands, 2-D.
        out: the result (the rows of the range), ``pre`` the pre-activation's if stored.

    Returns:
        The ``matmul`` switch's kernel (``auto``: persistent compiled, tiled under the interpreter) where the
        operands allow it, else ``"tiled"``.

    Example::

        >>> a, b = torch.randn(4, 32, dtype=torch.float16), torch.randn(32, 16, dtype=torch.float16)
        >>> out = torch.empty(4, 16, dtype=torch.float16)
        >>> kernel_choice(a, b, out)           # under Triton's interpreter; 'persistent' compiled on an H100
        'tiled'
        >>> with tpf.config.override(matmul="persistent"):
        ...     kernel_choice(a, b, out)
        'persistent'
    """
    return "tiled" if _persistent_layouts(a, b, out, pre) is None else "persistent"


# One launch at a time: an autotuner keeps the arguments of the call it is tuning on itself (and its hooks their
# saved ACC), and FakeWorld's ranks launch from threads. Only the host side is serialised; under torch.compile the
# launch is traced, not run, and a lock there would break the graph.
_LAUNCH = threading.Lock()
_THREAD = threading.local()


def one_at_a_time() -> contextlib.AbstractContextManager:
    """Holds the launch lock around a launch (nothing under torch.compile, which traces the launch).

    Returns:
        A context manager: the lock, or a null context while compiling.

    Example::

        >>> with one_at_a_time():
        ...     pass
    """
    return contextlib.nullcontext() if torch.compiler.is_compiling() else _LAUNCH


def input_precision(t: torch.Tensor) -> str:
    """How a kernel's ``tl.dot`` multiplies ``t``'s dtype: fp32 in full precision (``"ieee"``) unless torch allows
    tf32 on this GPU, as torch.matmul does.

    Args:
        t: an operand.

    Returns:
        ``"ieee"`` or ``"tf32"`` (which fp16 / bf16 operands ignore).

    Example::

        >>> input_precision(torch.ones(1))
        'ieee'
    """
    fp32 = t.dtype == torch.float32 and not (t.is_cuda and torch.backends.cuda.matmul.allow_tf32)
    return "ieee" if fp32 else "tf32"


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
def programs(device: torch.device) -> int:
    """Programs of the persistent kernel on ``device``: one per SM (3 under the interpreter, fewer than the
    tiles of a test's product, so that the tile walk is checked).

    Args:
        device: a CUDA device.

    Returns:
        The number of programs a launch starts.

    Example::

        >>> programs(torch.device("cpu"))      # under Triton's interpreter; one per SM on a GPU (132 on an H100)
        3
    """
    return _INTERPRETER_PROGRAMS if INTERPRET else torch.cuda.get_device_properties(device).multi_processor_count


def _launch_tiled(a, b, bias, acc, out, pre, row_start, row_end, tile_offset, flags) -> None:
    K, N = b.shape
    acc_arg = acc if acc is not None else out
    tensors = (a, b, out, bias if bias is not None else out, acc_arg, pre if pre is not None else out)
    sizes = (_pow2(row_end - row_start), _pow2(N), _pow2(K))
    kwargs = dict(INPUT_PRECISION=input_precision(a), **flags)

    def grid(META):
        return (triton.cdiv(row_end - row_start, META["BLOCK_M"]) * triton.cdiv(N, META["BLOCK_N"]),)

    tuning.tuned("tiled").launch(grid, (*sizes, *kwargs.values(), *(t.dtype for t in tensors)), (
        *tensors, N, K, row_start, row_end, tile_offset,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        acc_arg.stride(0), acc_arg.stride(1), *sizes), kwargs)


def _launch_persistent(a, b, bias, acc, out, pre, row_start, row_end, tile_offset, flags, layouts) -> None:
    a_t, b_t = layouts
    rows, N, K = out.shape[0], out.shape[1], a.shape[1]
    acc_arg = acc if acc is not None else out
    placeholder = [16, 16]  # every launch sets the config's blocks (tuning.set_blocks) first

    def desc(t):
        return TensorDescriptor.from_tensor(t, placeholder)

    _current_context(a.device)
    c_desc = desc(out)
    descs = dict(a_desc=desc(a.mT if a_t else a), b_desc=desc(b.mT if b_t else b), c_desc=c_desc,
                 pre_desc=c_desc if pre is None else desc(pre))
    sms = programs(a.device)
    bias_arg = bias if bias is not None else out
    sizes = (_pow2(rows), _pow2(N), _pow2(K))
    kwargs = dict(A_T=a_t, B_T=b_t, PROGRAMS=sms, **flags)

    def grid(META):
        return (min(sms, triton.cdiv(rows, META["BLOCK_M"]) * triton.cdiv(N, META["BLOCK_N"])),)

    tuning.tuned("persistent").launch(
        grid, (*sizes, *kwargs.values(), a.dtype, b.dtype, out.dtype, descs["pre_desc"].base.dtype, bias_arg.dtype,
               acc_arg.dtype),
        (*descs.values(), bias_arg, acc_arg, row_start, rows, N, K, tile_offset, acc_arg.stride(0), acc_arg.stride(1),
         *sizes), kwargs,
        set_blocks=lambda meta: tuning.set_blocks({**descs, **meta, "A_T": a_t, "B_T": b_t}))


def launch(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, activation: int, acc: torch.Tensor | None,
           out: torch.Tensor, pre: torch.Tensor | None, row_start: int, row_end: int, tile_offset: int) -> None:
    """Run ``act(a @ b + bias) + acc`` for the rows ``[row_start, row_end)`` on the kernel ``kernel_choice``
    picks, into ``out`` (and the pre-activation into ``pre``). ``tpflow.kernels.matmul`` checks the
    arguments and calls this.

    Args:
        a, b: 2-D operands of one dtype, any strides.
        bias: ``[N]`` with unit stride, or None.
        activation: the activation's code in ``ACTIVATIONS``.
        acc: ``[rows, N]`` added after the activation, or None.
        out, pre: ``[rows, N]`` results (``pre`` may be None).
        row_start, row_end: the rows of ``a`` computed.
        tile_offset: how many row tiles the tile order is rotated by.

    Example::

        >>> a, b, out = torch.randn(4, 8), torch.randn(8, 6), torch.empty(4, 6)
        >>> launch(a, b, None, 0, None, out, None, 0, a.shape[0], 0)   # every row; no bias, activation or acc
        >>> torch.allclose(out, a @ b, atol=1e-5)
        True
    """
    layouts = _persistent_layouts(a, b, out, pre)
    flags = dict(ACTIVATION=activation, HAS_BIAS=bias is not None, HAS_ACC=acc is not None, STORE_PRE=pre is not None)
    with one_at_a_time():
        if layouts is None:
            _launch_tiled(a, b, bias, acc, out, pre, row_start, row_end, tile_offset, flags)
        else:
            _launch_persistent(a, b, bias, acc, out, pre, row_start, row_end, tile_offset, flags, layouts)
