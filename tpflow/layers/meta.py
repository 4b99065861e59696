"""A global tensor's metadata (shape, dtype, SBP) and a status, as one fixed-size message.

Ranks that do not compute a stage still need to know what it produced: the next stage to size its
receive buffers, ranks outside the stage to hold a global tensor of the right shape. The stage's
ranks send this header; a stage that failed sends its error's text instead, so the others raise too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tpflow.global_tensor import DTYPES
from tpflow.sbp import Broadcast, PartialSum, Sbp, Split, broadcast

__all__ = ["FAILED", "HEADER_BYTES", "OK", "PipelineError", "header", "read_header"]

HEADER_BYTES = 1024
_META_INTS = 32  # status, ndim, dtype, 16 dims, number of axes, 8 SBP codes, requires_grad; an error's text follows
_MAX_NDIM, _MAX_AXES = 16, 8
OK, FAILED = 0, 1


class PipelineError(RuntimeError):
    """A stage failed: the ranks that did not run it raise this, with the failing stage's error."""


def _sbp_code(s: Sbp) -> int:
    return s.dim if isinstance(s, Split) else -1 if isinstance(s, Broadcast) else -2


def _sbp_of(code: int) -> Sbp:
    return Split(code) if code >= 0 else broadcast if code == -1 else PartialSum()


def header(status: int, shape: Sequence[int] = (), dtype: torch.dtype = torch.float32, sbps: Sequence[Sbp] = (),
           message: str = "", requires_grad: bool = False) -> torch.Tensor:
    """The message: ``HEADER_BYTES`` uint8 on the CPU (gloo carries it whatever the data's device)."""
    if len(shape) > _MAX_NDIM or len(sbps) > _MAX_AXES:
        raise ValueError(f"stages hand off tensors of up to {_MAX_NDIM} dims on placements of up to {_MAX_AXES} "
                         f"axes, got shape {tuple(shape)} on {len(sbps)} axes")
    if dtype not in DTYPES:
        raise TypeError(f"stages cannot hand off {dtype} tensors; use one of {DTYPES}")
    ints = [status, len(shape), DTYPES.index(dtype), *shape, *[0] * (_MAX_NDIM - len(shape)),
            len(sbps), *map(_sbp_code, sbps), *[0] * (_MAX_AXES - len(sbps)), int(requires_grad)]
    buf = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    buf[:len(ints) * 8] = torch.tensor(ints, dtype=torch.int64).view(torch.uint8)
    text = message.encode()[:HEADER_BYTES - _META_INTS * 8]
    buf[_META_INTS * 8:_META_INTS * 8 + len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    return buf


def read_header(buf: torch.Tensor) -> tuple[int, tuple[int, ...], torch.dtype, tuple[Sbp, ...], str, bool]:
    """(status, shape, dtype, SBPs, error text, requires_grad) of a ``header``."""
    ints = buf[:_META_INTS * 8].view(torch.int64).tolist()
    status, ndim, dtype = ints[0], ints[1], DTYPES[ints[2]]
    axes = ints[3 + _MAX_NDIM]
    shape = tuple(ints[3:3 + ndim])
    sbps = tuple(_sbp_of(c) for c in ints[4 + _MAX_NDIM:4 + _MAX_NDIM + axes])
    message = bytes(buf[_META_INTS * 8:].tolist()).rstrip(b"\0").decode(errors="replace")
    return status, shape, dtype, sbps, message, bool(ints[4 + _MAX_NDIM + _MAX_AXES])
