"""A tensor's metadata as a fixed-size message: what ranks tell each other before blocks travel.

Ranks that do not compute something still need to know what it produced: a pipeline's next stage to
size its receive buffers, ranks outside a stage to hold a global tensor of the right shape, the ranks
of ``from_local`` to check that their blocks fit together. Every such message uses this one format:

    meta_ints   [ndim, dtype code, 16 dims]                       a shape and dtype as MAX_NDIM + 2 ints
    header      [status, meta, axes, 8 SBP codes, requires_grad]  HEADER_BYTES of uint8, then an error's text

A stage that failed sends its error's text in the header instead, so the others raise too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tpflow.sbp import Broadcast, PartialSum, Sbp, Split, broadcast

__all__ = ["DTYPES", "FAILED", "HEADER_BYTES", "MAX_AXES", "MAX_NDIM", "OK", "header", "meta_ints", "read_header",
           "read_meta_ints"]

DTYPES = [  # the dtypes a message can name, by index
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
MAX_NDIM, MAX_AXES = 16, 8
HEADER_BYTES = 1024
_HEADER_INTS = 32  # status, the meta ints, number of axes, 8 SBP codes, requires_grad; an error's text follows
OK, FAILED = 0, 1


def meta_ints(shape: Sequence[int], dtype: torch.dtype) -> list[int]:
    """A shape and dtype as ``MAX_NDIM + 2`` ints; a dtype outside ``DTYPES`` gets the code ``len(DTYPES)``.

    Args:
        shape: up to ``MAX_NDIM`` sizes.
        dtype: any torch dtype.

    Returns:
        ``[ndim, dtype code, *shape, 0, ...]``.

    Example::

        >>> meta_ints((4, 5), torch.float32)[:4]
        [2, 0, 4, 5]
    """
    if len(shape) > MAX_NDIM:
        raise ValueError(f"tpflow's metadata messages carry tensors of up to {MAX_NDIM} dims, got {len(shape)}")
    code = DTYPES.index(dtype) if dtype in DTYPES else len(DTYPES)
    return [len(shape), code, *shape, *[0] * (MAX_NDIM - len(shape))]


def read_meta_ints(ints: Sequence[int]) -> tuple[tuple[int, ...], torch.dtype | None]:
    """The shape and dtype of ``meta_ints`` (the dtype None where it was outside ``DTYPES``).

    Args:
        ints: at least the ``MAX_NDIM + 2`` ints of ``meta_ints``.

    Returns:
        ``(shape, dtype)``.

    Example::

        >>> read_meta_ints(meta_ints((4, 5), torch.float16))
        ((4, 5), torch.float16)
    """
    ndim, code, *shape = ints[:MAX_NDIM + 2]
    return tuple(shape[:ndim]), DTYPES[code] if code < len(DTYPES) else None


def _sbp_code(s: Sbp) -> int:
    return s.dim if isinstance(s, Split) else -1 if isinstance(s, Broadcast) else -2


def _sbp_of(code: int) -> Sbp:
    return Split(code) if code >= 0 else broadcast if code == -1 else PartialSum()


def header(status: int, shape: Sequence[int] = (), dtype: torch.dtype = torch.float32, sbps: Sequence[Sbp] = (),
           message: str = "", requires_grad: bool = False) -> torch.Tensor:
    """The header of a hand-off: a global tensor's metadata, or (``status=FAILED``) an error's text.

    Args:
        status: ``OK`` or ``FAILED``.
        shape, dtype, sbps, requires_grad: the tensor's.
        message: the error's text (cut to what fits).

    Returns:
        ``HEADER_BYTES`` uint8 on the CPU (gloo carries it whatever the data's device).

    Example::

        >>> from tpflow import sbp
        >>> read_header(header(OK, (4, 5), torch.float32, (sbp.split(0),)))[:4]
        (0, (4, 5), torch.float32, (sbp.split(dim=0),))
    """
    if len(sbps) > MAX_AXES:
        raise ValueError(f"tpflow hands off tensors on placements of up to {MAX_AXES} axes, got {len(sbps)}")
    if dtype not in DTYPES:
        raise TypeError(f"tpflow cannot hand off {dtype} tensors; use one of {DTYPES}")
    ints = [status, *meta_ints(shape, dtype), len(sbps), *map(_sbp_code, sbps), *[0] * (MAX_AXES - len(sbps)),
            int(requires_grad)]
    buf = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    buf[:len(ints) * 8] = torch.tensor(ints, dtype=torch.int64).view(torch.uint8)
    text = message.encode()[:HEADER_BYTES - _HEADER_INTS * 8]
    buf[_HEADER_INTS * 8:_HEADER_INTS * 8 + len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    return buf


def read_header(buf: torch.Tensor) -> tuple[int, tuple[int, ...], torch.dtype, tuple[Sbp, ...], str, bool]:
    """What a ``header`` carries.

    Args:
        buf: the ``HEADER_BYTES`` received.

    Returns:
        ``(status, shape, dtype, SBPs, error text, requires_grad)``.

    Example::

        >>> read_header(header(FAILED, message="stage 1 failed"))[4]
        'stage 1 failed'
    """
    ints = buf[:_HEADER_INTS * 8].view(torch.int64).tolist()
    status = ints[0]
    shape, dtype = read_meta_ints(ints[1:])
    axes_at = MAX_NDIM + 3
    axes = ints[axes_at]
    sbps = tuple(_sbp_of(c) for c in ints[axes_at + 1:axes_at + 1 + axes])
    message = "" if status == OK else bytes(buf[_HEADER_INTS * 8:].numpy()).rstrip(b"\0").decode(errors="replace")
    return status, shape, dtype, sbps, message, bool(ints[axes_at + 1 + MAX_AXES])
