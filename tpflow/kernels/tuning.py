"""Which tile configs the Triton kernels run: the config lists, autotuning, and a launch that skips
Triton's autotuner once a shape is tuned.

Launches of a kernel go through ``tuned(kernel)``, built when first needed under the ``autotune``
switch in force (``tpflow.config``): a sweep of configs per shape, one pinned config (the tests), or
under the interpreter the interpreter's one. ``use(kernel, launcher)`` routes a kernel's launches
through another launcher for a block: a ``Tuned`` over configs a test or a sweep pins, or a stand-in
that compiles instead of running (``benchmarks/kernels_compiled.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import triton

from tpflow import config
from tpflow.kernels.tiles import INTERPRET, persistent_kernel, tiled_kernel

__all__ = ["KERNELS", "Tuned", "configs", "set_blocks", "tuned", "use"]

KERNELS = ("tiled", "persistent")
_KEY = ["M_KEY", "N_KEY", "K_KEY", "ACTIVATION", "HAS_BIAS", "HAS_ACC", "STORE_PRE"]


def set_blocks(args: dict) -> None:
    """Give the persistent kernel's TMA descriptors the block shapes of the config about to run (its
    configs' pre-hook).

    Args:
        args: the launch's arguments by name, the config's meta-parameters included.

    Example::

        >>> from triton.tools.tensor_descriptor import TensorDescriptor
        >>> a, b, c = (torch.empty(256, 256, dtype=torch.float16) for _ in range(3))
        >>> descs = {name: TensorDescriptor.from_tensor(t, [16, 16])
        ...          for name, t in (("a_desc", a), ("b_desc", b), ("c_desc", c), ("pre_desc", c))}
        >>> set_blocks({**descs, "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "SUBTILE": True,
        ...             "A_T": False, "B_T": True})
        >>> descs["a_desc"].block_shape, descs["b_desc"].block_shape, descs["c_desc"].block_shape
        ([128, 64], [256, 64], [128, 128])
    """
    bm, bn, bk = args["BLOCK_M"], args["BLOCK_N"], args["BLOCK_K"]
    args["a_desc"].block_shape = [bk, bm] if args["A_T"] else [bm, bk]
    args["b_desc"].block_shape = [bn, bk] if args["B_T"] else [bk, bn]
    for name in ("c_desc", "pre_desc"):
        args[name].block_shape = [bm, bn // 2 if args["SUBTILE"] else bn]


def _tiled_configs(autotune: bool) -> list[triton.Config]:
    """CUDA tiles from Triton's tutorial 03 list (Hopper-friendly 128x256 / 128x128 first); one pinned
    config under the interpreter, where autotuning is meaningless, and with autotuning off."""
    if INTERPRET:
        return [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8})]
    if not autotune:
        return [triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4,
                              num_warps=4)]
    shapes = [(128, 256, 64, 3, 8), (128, 256, 64, 4, 8), (256, 128, 64, 3, 8), (128, 128, 64, 4, 4),
              (128, 128, 32, 4, 4), (64, 256, 32, 4, 4), (128, 64, 32, 4, 4), (64, 128, 32, 4, 4),
              (64, 64, 32, 5, 2), (32, 64, 32, 5, 2)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_stages=s, num_warps=w)
            for m, n, k, s, w in shapes]


def _persistent_configs(autotune: bool) -> list[triton.Config]:
    """Hopper tiles: those that won somewhere in a sweep of one config at a time on an H100
    (``benchmarks/kernels_configs.py``: 128 x 256 with 8 warps, 3-4 stages, C whole or in halves, 4, 8 or
    16 row tiles a group), and 128 x 128 with 4 warps for products too small to fill the SMs with 128 x 256
    tiles (the sweep's shapes are all large). 128 x 128 with 8 warps, 256 x 128 and BLOCK_K = 128 lost on
    every shape; 4 stages of 128 x 256 with C whole do not fit in shared memory. One pinned config under
    the interpreter and with autotuning off."""
    if INTERPRET:
        shapes = [(32, 32, 16, 1, 4, True, 8)]
    elif not autotune:
        shapes = [(128, 128, 64, 3, 8, True, 8)]
    else:
        shapes = [(128, 256, 64, 3, 8, True, 8), (128, 256, 64, 3, 8, True, 16), (128, 256, 64, 3, 8, True, 4),
                  (128, 256, 64, 4, 8, True, 8), (128, 256, 64, 3, 8, False, 8), (128, 128, 64, 4, 4, False, 8)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": g, "SUBTILE": sub},
                          num_stages=s, num_warps=w, pre_hook=set_blocks) for m, n, k, s, w, sub, g in shapes]


def configs(kernel: str, autotune: bool | None = None) -> list[triton.Config]:
    """The tile configs ``kernel`` is tuned over.

    Args:
        kernel: ``"tiled"`` or ``"persistent"``.
        autotune: the sweep (True) or the pinned config (False); default: the ``autotune`` switch.

    Returns:
        Triton configs; one under the interpreter.

    Example::

        >>> len(configs("tiled", autotune=False))
        1
    """
    autotune = config.get("autotune") if autotune is None else autotune
    return {"tiled": _tiled_configs, "persistent": _persistent_configs}[kernel](autotune)


class _KeepAcc:
    """Autotuning times every config on the caller's tensors, several runs each. Where ACC is C itself
    (``matmul(a, b, acc=s, out=s)`` accumulates in place, as the rings' weight gradients do), each run
    would add into it again: ACC is saved before a run and put back after. Nothing is copied otherwise."""

    def __init__(self) -> None:
        self.saved = None

    def pre_hook(self, args: dict, reset_only: bool = False) -> None:
        out = args["c_ptr"] if "c_ptr" in args else args["c_desc"].base
        acc = args["acc_ptr"]
        if not reset_only and args["HAS_ACC"] and acc.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
            self.saved = acc.clone()

    def post_hook(self, args: dict, exception: BaseException | None) -> None:
        if self.saved is not None:
            args["acc_ptr"].copy_(self.saved)
            self.saved = None


class Tuned:
    """A kernel autotuned over ``configs`` that remembers the config chosen for each key it has launched
    with, and launches a known key with it directly.

    Triton's ``Autotuner.run`` rebuilds its key from every argument, merges dicts and runs the config's
    pre-hook on every launch: 35-48 us of host time a launch with a no-op kernel on a 2-core EPYC VM
    (timeit), against 8 us for the direct call. On an H100 machine's CPU the direct launch saved 6-49 us
    of 108-220 in five of six alternating rounds
    (``benchmarks/results/host_launch_NVIDIA-H100-80GB-HBM3_2026-11-23.md``). Under the interpreter the
    autotuner holds the one pinned config, so the CPU tests run both paths.

    Args:
        kernel: ``"tiled"`` or ``"persistent"``.
        configs: the Triton configs to tune over.

    Example::

        >>> pinned = Tuned("persistent", configs("persistent")[:1])
        >>> with use("persistent", pinned):
        ...     pass  # persistent launches of this block run the first config
    """

    def __init__(self, kernel: str, configs: list[triton.Config]) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        key = _KEY + (["A_T", "B_T"] if kernel == "persistent" else [])
        keep = _KeepAcc()
        self.autotuner = triton.autotune(configs=configs, key=key, pre_hook=keep.pre_hook,
                                         post_hook=keep.post_hook)(tiled_kernel if kernel == "tiled"
                                                                   else persistent_kernel)
        self.chosen: dict[tuple, triton.Config] = {}

    def launch(self, grid: Callable, key: tuple, args: tuple, kwargs: dict,
               set_blocks: Callable[[dict], None] | None = None) -> None:
        """``kernel[grid](*args, **kwargs)`` under the config chosen for ``key``: tuned on the key's first
        launch, and through the autotuner while torch.compile traces.

        Args:
            grid: the launch grid, a function of the config's meta-parameters.
            key: what the config is chosen by (sizes rounded, flags, dtypes).
            args, kwargs: the kernel's arguments.
            set_blocks: gives the TMA descriptors the config's block shapes (what its pre-hook does).
        """
        compiling = torch.compiler.is_compiling()
        chosen = None if compiling else self.chosen.get(key)
        if chosen is None:
            self.autotuner[grid](*args, **kwargs)
            if not compiling:
                self.chosen[key] = self.autotuner.best_config
            return
        if set_blocks is not None:
            set_blocks(chosen.kwargs)
        self.autotuner.fn[grid](*args, **kwargs, **chosen.all_kwargs())


_TUNED: dict[tuple[str, bool], Tuned] = {}
_IN_USE: dict[str, object] = {}


def tuned(kernel: str) -> Tuned:
    """What launches ``kernel`` now: the launcher ``use`` set, else its ``Tuned`` for the ``autotune`` switch in
    force (built on first use, then kept with its chosen configs).

    Args:
        kernel: ``"tiled"`` or ``"persistent"``.

    Returns:
        An object with ``Tuned``'s ``launch``.

    Example::

        >>> t = tuned("tiled")
        >>> type(t).__name__, tuned("tiled") is t          # built once, then kept
        ('Tuned', True)
        >>> pinned = Tuned("tiled", configs("tiled")[:1])
        >>> with use("tiled", pinned):
        ...     tuned("tiled") is pinned
        True
    """
    if kernel in _IN_USE:
        return _IN_USE[kernel]
    autotune = bool(config.get("autotune")) and not INTERPRET
    if (kernel, autotune) not in _TUNED:
        _TUNED[(kernel, autotune)] = Tuned(kernel, configs(kernel, autotune))
    return _TUNED[(kernel, autotune)]


@contextlib.contextmanager
def use(kernel: str, launcher: object) -> Iterator[None]:
    """Launch ``kernel`` through ``launcher`` (anything with ``Tuned``'s ``launch``) inside the block.

    Args:
        kernel: ``"tiled"`` or ``"persistent"``.
        launcher: a ``Tuned`` over pinned configs, or a stand-in.

    Returns:
        A context manager for the ``with`` statement (``as`` binds None); on leaving it, the launcher in use
        before (if any) is back.

    Example::

        >>> with use("tiled", Tuned("tiled", configs("tiled")[:1])):
        ...     pass
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    before = _IN_USE.get(kernel)
    _IN_USE[kernel] = launcher
    try:
        yield
    finally:
        if before is None:
            _IN_USE.pop(kernel, None)
        else:
            _IN_USE[kernel] = before
