"""What Triton makes of tpflow's kernels for a GPU that is not here: each kernel variant the layers
and rings launch, compiled for Hopper (sm_90) through the same launch code as on a GPU, under each
autotune config.

    python benchmarks/kernels_compiled.py [--arch 90] [--pinned] [--out FILE.md]

Run it without ``TRITON_INTERPRET``; no GPU is needed (Triton's wheel carries ptxas). Per variant and
config it reports:

- shared memory per block, whether it ``fits`` the SM (a config that does not is one the autotuner
  drops on the GPU), and whether it is ``staged``: there is room for the A and B tiles of every stage
  in flight, as when loads go by cp.async / TMA and not element by element through registers (a
  necessary sign, not proof: the epilogue's buffers count in the same total);
- registers and spilled bytes (``ptxas -v``);
- the instructions that matter on Hopper: ``wgmma`` (tensor-core MMA reading shared memory), TMA
  copies (``cp.async.bulk.tensor``, loads and stores) and ``cp.async`` copies (the tiled kernel's
  pipeline).

``--pinned`` compiles only the config the tests pin (the ``autotune`` switch off). Speed is still to be
measured on a GPU (``benchmarks/kernels_gpu.py``); this shows whether the kernels lower as intended.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import pathlib
import re
import subprocess
import tempfile
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget

from tpflow import config
from tpflow.bench.report import markdown_table
from tpflow.kernels import launcher, tiles, tuning

MAX_SHARED = {80: 166912, 86: 101376, 89: 101376, 90: 232448}  # bytes of shared memory one block may use
PTXAS = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@dataclass
class Compiled:
    variant: str
    kernel: str
    config: str
    shared: int
    fits: bool
    staged: bool  # shared memory holds A and B tiles for every pipeline stage: loads go by cp.async / TMA
    registers: int
    spilled: int
    wgmma: int
    tma_copies: int
    cp_async: int


class _OfflineDriver:
    """Stands in for the CUDA driver: Triton asks it only for the target while compiling."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


def _ptxas(ptx: str, arch: int) -> tuple[int, int]:
    """(registers, spilled bytes) of a kernel's PTX."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        info = subprocess.run([str(PTXAS), "-v", f"--gpu-name=sm_{arch}a" if arch >= 90 else f"--gpu-name=sm_{arch}",
                               f.name, "-o", os.devnull], capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", info).group(1))
    return registers, sum(map(int, re.findall(r"(\d+) bytes spill stores", info)))


class _CompileEachConfig:
    """Stands in for an autotuned kernel (``tuning.Tuned``): ``launch`` compiles the call under each config
    (after its pre_hook, as the autotuner would) instead of timing it."""

    def __init__(self, name: str, configs: list, arch: int, found: list[Compiled]):
        self.tuner = tuning.Tuned(name, configs).autotuner
        self.name, self.configs, self.arch, self.found = name, configs, arch, found
        self.variant = ""

    def launch(self, grid, key: tuple, args: tuple, kwargs: dict, set_blocks=None) -> None:
        for candidate in self.configs:
            nargs = {**dict(zip(self.tuner.arg_names, args)), **kwargs, **candidate.all_kwargs()}
            if candidate.pre_hook:
                candidate.pre_hook(nargs)
            compiled = self.tuner.fn.warmup(*args, grid=grid, **kwargs, **candidate.all_kwargs())
            ptx = compiled.asm["ptx"]
            registers, spilled = _ptxas(ptx, self.arch)
            shared, wgmma = compiled.metadata.shared, ptx.count("wgmma.mma_async")
            k = candidate.kwargs
            a = getattr(args[0], "base", args[0])  # the tiled kernel's A, or the persistent one's descriptor's
            tile_bytes = (k["BLOCK_M"] + k["BLOCK_N"]) * k["BLOCK_K"] * a.element_size()
            in_flight = candidate.num_stages - (0 if wgmma else 1)  # mma.sync pipelines keep one stage fewer
            self.found.append(Compiled(
                self.variant, self.name, _config_name(candidate), shared, shared <= MAX_SHARED[self.arch],
                shared >= in_flight * tile_bytes, registers, spilled, wgmma, ptx.count("cp.async.bulk.tensor"),
                len(re.findall(r"cp\.async\.c[ag]", ptx))))


def _config_name(config) -> str:
    k = config.kwargs
    name = f"{k['BLOCK_M']}x{k['BLOCK_N']}x{k['BLOCK_K']} s{config.num_stages} w{config.num_warps}"
    return name + (" C in halves" if k.get("SUBTILE") else "")


def variants(dtype: torch.dtype) -> dict:
    """The products the layers and rings launch, as (a, b, out, keyword arguments of ``launcher.launch``)."""
    m, n, k = 256, 128, 192  # multiples of 16, as in real models: the same specialisation as 8192 x 4096
    x, w, dz = (torch.empty(*s, dtype=dtype) for s in ((m, k), (n, k), (m, n)))
    flags = dict(bias=None, activation=0, acc=None, pre=None, row_start=0, tile_offset=0)
    gelu = dict(flags, bias=torch.empty(n, dtype=dtype), activation=2, pre=torch.empty(m, n, dtype=dtype))
    chunk = dict(flags, acc=torch.empty(m // 4, n), row_start=m // 4, tile_offset=3)
    odd = dict(flags, acc=torch.empty(86, n), row_start=85, tile_offset=1)  # 256 rows over 3 ranks: 85 | 86 | 85
    return {
        "forward x @ W^T": (x, w.mT, torch.empty(m, n, dtype=dtype), flags),
        "forward + bias + gelu, saving z": (x, w.mT, torch.empty(m, n, dtype=dtype), gelu),
        "dgrad dz @ W": (dz, w, torch.empty(m, k, dtype=dtype), flags),
        "wgrad dz^T @ x": (dz.mT, x, torch.empty(n, k, dtype=dtype), flags),
        "ring chunk, fp32 partial + acc": (x, w.mT, torch.empty(m // 4, n), chunk),
        "ring chunk of 86 rows from row 85": (x, w.mT, torch.empty(86, n), odd),
    }


@contextlib.contextmanager
def offline(arch: int, pinned: bool, found: list[Compiled]):
    """The kernels compile for ``arch`` instead of launching, and the operands count as on that GPU (132 SMs).
    Everything is put back after, including the kernels' caches (which would hold the fake target)."""
    driver = triton.runtime.driver
    saved = (launcher.programs, torch.cuda.get_device_capability)
    stand_ins = {kernel: _CompileEachConfig(kernel, tuning.configs(kernel, autotune=not pinned), arch, found)
                 for kernel in tuning.KERNELS}
    launcher.programs = lambda device: 132
    torch.cuda.get_device_capability = lambda device=None: divmod(arch, 10)
    driver.set_active(_OfflineDriver(arch))
    try:
        with tuning.use("tiled", stand_ins["tiled"]), tuning.use("persistent", stand_ins["persistent"]):
            yield stand_ins
    finally:
        launcher.programs, torch.cuda.get_device_capability = saved
        driver._active = None  # back to finding the real driver when next asked
        for jit in (tiles.tiled_kernel.fn, tiles.persistent_kernel):
            jit.device_caches.clear()


def compile_all(arch: int = 90, pinned: bool = False, dtype: torch.dtype = torch.bfloat16) -> list[Compiled]:
    """Every variant under every config (or the pinned one) of each kernel that takes it on ``arch``."""
    if tiles.INTERPRET:
        raise RuntimeError("compiling for a GPU needs TRITON_INTERPRET unset")
    found: list[Compiled] = []
    with offline(arch, pinned, found) as stand_ins:
        for variant, (a, b, out, kw) in variants(dtype).items():
            for kernel in tuning.KERNELS:
                with config.override(matmul=kernel):
                    if launcher.kernel_choice(a, b, out, kw["pre"]) != kernel:
                        continue  # the persistent kernel below Hopper: its rows would be the tiled one's again
                    stand_ins[kernel].variant = variant
                    launcher.launch(a, b, kw["bias"], kw["activation"], kw["acc"], out, kw["pre"], kw["row_start"],
                                    kw["row_start"] + out.shape[0], kw["tile_offset"])
    return found


def table(found: list[Compiled]) -> str:
    rows = [list(dataclasses.astuple(c)) for c in found]
    return "\n".join(markdown_table([f.name for f in dataclasses.fields(Compiled)], rows)) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, choices=sorted(MAX_SHARED))
    parser.add_argument("--pinned", action="store_true", help="only the config the tests pin")
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args()
    found = compile_all(args.arch, args.pinned)
    text = (f"# tpflow's kernels compiled for sm_{args.arch} (bf16, no GPU)\n\ntriton {triton.__version__}; "
            f"`python benchmarks/kernels_compiled.py --arch {args.arch}{' --pinned' if args.pinned else ''}`. "
            f"shared: bytes per block (the SM allows {MAX_SHARED[args.arch]}); spilled: bytes of spill stores.\n\n"
            + table(found))
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
