"""Global tensors: creation, boxing (``to_global``), ``to_local`` and matmul with SBP inference.

A global tensor is a ``DTensor``; tpflow adds OneFlow's vocabulary on top of it:

- creation that reproduces single-device values: every rank draws the full tensor from its
  generator (so all ranks' RNG stay in step, members or not) and keeps its block;
- boxing within a placement through ``DTensor.redistribute``, plus the conversions to
  ``partial_sum`` that DTensor keeps internal (done locally: no communication);
- boxing between placements with different ranks, over point-to-point transfers;
- autograd through every conversion, the gradient's layout chosen by ``grad_sbp``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tpflow import comm, gradients, kernels
from tpflow.placement import Placement, placement_of_mesh
from tpflow.sbp import (
    Broadcast,
    PartialSum,
    Sbp,
    Split,
    broadcast,
    dual,
    from_dtensor,
    infer_matmul,
    local_region,
    matmul_out_sbp,
    normalize,
    to_dtensor,
)

__all__ = [
    "randn",
    "rand",
    "zeros",
    "ones",
    "full",
    "tensor",
    "from_local",
    "to_global",
    "to_local",
    "get_sbp",
    "get_placement",
    "matmul",
]

log = logging.getLogger("tpflow")


# ---------------------------------------------------------------------------------------------
# layout helpers on local blocks


def _block(t: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(offsets, lengths)):
        t = t.narrow(dim, o, n)
    return t


def _is_zero_partial(pl: Placement, sbps: Sequence[Sbp], coord: Sequence[int]) -> bool:
    """Whether a partial-sum block at ``coord`` is all zeros when made from a whole value."""
    return any(isinstance(s, PartialSum) and c != 0 for s, c in zip(sbps, coord))


def _wrap(local: torch.Tensor | None, pl: Placement, sbps: Sequence[Sbp], shape: Sequence[int],
          dtype: torch.dtype) -> DTensor:
    """A DTensor from this rank's block (None on ranks outside ``pl``: an empty block)."""
    if local is None:
        local = torch.empty(0, dtype=dtype, device=pl.device)
    stride = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        stride[d] = stride[d + 1] * max(shape[d + 1], 1)
    return DTensor.from_local(local, pl.mesh, to_dtensor(sbps), run_check=False,
                              shape=torch.Size(shape), stride=tuple(stride))


def _local_of_full(full: torch.Tensor, pl: Placement, sbps: Sequence[Sbp]) -> torch.Tensor | None:
    """This rank's block of a whole value (zeros for partial-sum blocks off coordinate 0)."""
    coord = pl.coordinate()
    if coord is None:
        return None
    offsets, lengths = local_region(full.shape, sbps, pl.hierarchy, coord)
    if _is_zero_partial(pl, sbps, coord):
        return full.new_zeros(lengths)
    return _block(full, offsets, lengths).clone()


def _distribute(full: torch.Tensor, pl: Placement, sbps: tuple[Sbp, ...], requires_grad: bool) -> DTensor:
    out = _wrap(_local_of_full(full, pl, sbps), pl, sbps, full.shape, full.dtype)
    return out.requires_grad_(requires_grad)


def _check_placement(placement: object) -> Placement:
    if not isinstance(placement, Placement):
        raise TypeError(f"placement must be a tpf.placement(type, ranks), got {placement!r}")
    return placement


# ---------------------------------------------------------------------------------------------
# creation


def _shape(size: tuple) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in size):
        raise TypeError(f"size must be non-negative ints, e.g. randn(4, 5, ...) or randn((4, 5), ...), got {size}")
    return tuple(size)


def _random(fn, size, placement, sbp, dtype, generator, requires_grad) -> DTensor:
    shape, pl = _shape(size), _check_placement(placement)
    sbps = normalize(sbp, pl.ndim, len(shape))
    full = fn(shape, dtype=dtype, device=pl.device, generator=generator)
    return _distribute(full, pl, sbps, requires_grad)


def randn(*size: int, placement: Placement, sbp: object, dtype: torch.dtype | None = None,
          generator: torch.Generator | None = None, requires_grad: bool = False) -> DTensor:
    """Global ``torch.randn``: the logical value equals one device's after the same seed."""
    return _random(torch.randn, size, placement, sbp, dtype, generator, requires_grad)


def rand(*size: int, placement: Placement, sbp: object, dtype: torch.dtype | None = None,
         generator: torch.Generator | None = None, requires_grad: bool = False) -> DTensor:
    """Global ``torch.rand``: the logical value equals one device's after the same seed."""
    return _random(torch.rand, size, placement, sbp, dtype, generator, requires_grad)


def full(size: Sequence[int], fill_value: float, *, placement: Placement, sbp: object,
         dtype: torch.dtype | None = None, requires_grad: bool = False) -> DTensor:
    """Global ``torch.full``, built block by block (no rank materialises the whole tensor)."""
    shape, pl = _shape((size,)), _check_placement(placement)
    sbps = normalize(sbp, pl.ndim, len(shape))
    dtype = dtype or torch.tensor(fill_value).dtype
    coord, local = pl.coordinate(), None
    if coord is not None:
        lengths = local_region(shape, sbps, pl.hierarchy, coord)[1]
        value = 0 if _is_zero_partial(pl, sbps, coord) else fill_value
        local = torch.full(lengths, value, dtype=dtype, device=pl.device)
    return _wrap(local, pl, sbps, shape, dtype).requires_grad_(requires_grad)


def zeros(*size: int, placement: Placement, sbp: object, dtype: torch.dtype | None = None,
          requires_grad: bool = False) -> DTensor:
    return full(_shape(size), 0.0, placement=placement, sbp=sbp, dtype=dtype, requires_grad=requires_grad)


def ones(*size: int, placement: Placement, sbp: object, dtype: torch.dtype | None = None,
         requires_grad: bool = False) -> DTensor:
    return full(_shape(size), 1.0, placement=placement, sbp=sbp, dtype=dtype, requires_grad=requires_grad)


def tensor(data: object, *, placement: Placement, sbp: object, dtype: torch.dtype | None = None,
           requires_grad: bool = False) -> DTensor:
    """A global tensor whose logical value is ``data`` (the same on every rank)."""
    pl = _check_placement(placement)
    value = torch.as_tensor(data, dtype=dtype, device=pl.device)
    return _distribute(value, pl, normalize(sbp, pl.ndim, value.ndim), requires_grad)


# ---------------------------------------------------------------------------------------------
# boxing: global -> global, no autograd (called inside the autograd functions below)


def _box(x: DTensor, src_pl: Placement, src: tuple[Sbp, ...], dst_pl: Placement, dst: tuple[Sbp, ...]) -> DTensor:
    """A new DTensor of x's value in the new layout (never x itself: autograd may steal it as a grad)."""
    if (src_pl, src) == (dst_pl, dst):
        return _wrap(x.to_local() if src_pl.coordinate() is not None else None, dst_pl, dst, x.shape, x.dtype)
    if src_pl == dst_pl:
        return _box_within(x, src_pl, src, dst)
    if src_pl.type != dst_pl.type:
        raise ValueError(
            f"to_global from {src_pl} to {dst_pl} changes the device type: keep the type and move the ranks, "
            "or convert the local tensors with .to(device) first"
        )
    return _box_across(x, src_pl, src, dst_pl, dst)


def _box_within(x: DTensor, pl: Placement, src: tuple[Sbp, ...], dst: tuple[Sbp, ...]) -> DTensor:
    """DTensor redistributes to every SBP but partial sum; axes that become partial sums are
    made locally: a split block is placed in zeros, a broadcast one kept on coordinate 0."""
    if src == dst:
        return x
    if pl.coordinate() is None:  # nothing to do off the placement; DTensor would build a malformed spec here
        return _wrap(None, pl, dst, x.shape, x.dtype)
    mid = tuple(s if isinstance(d, PartialSum) else d for s, d in zip(src, dst))
    # a split block placed in zeros only covers its own rows when no other axis splits that dim
    nested = [s.dim for s in mid + dst if isinstance(s, Split)]
    mid = tuple(broadcast if isinstance(m, Split) and isinstance(d, PartialSum) and nested.count(m.dim) > 1 else m
                for m, d in zip(mid, dst))
    y = x if mid == src else x.redistribute(pl.mesh, to_dtensor(mid))
    log.debug("boxing %s -> %s on %s: redistribute to %s%s", src, dst, pl, mid,
              "" if mid == dst else ", then local partial-sum blocks")
    if mid == dst:
        return y
    coord = pl.coordinate()
    local = y.to_local()
    dst_off, dst_len = local_region(x.shape, dst, pl.hierarchy, coord)
    zero = any(isinstance(m, Broadcast) and isinstance(d, PartialSum) and c != 0 for m, d, c in zip(mid, dst, coord))
    if zero:
        local = local.new_zeros(dst_len)
    elif any(isinstance(m, Split) and isinstance(d, PartialSum) for m, d in zip(mid, dst)):
        mid_off, mid_len = local_region(x.shape, mid, pl.hierarchy, coord)
        embedded = local.new_zeros(dst_len)
        _block(embedded, [m - d for m, d in zip(mid_off, dst_off)], mid_len).copy_(local)
        local = embedded
    return _wrap(local, pl, dst, x.shape, x.dtype)


@functools.lru_cache(maxsize=4096)
def _across_plan(src_pl: Placement, src: tuple[Sbp, ...], dst_pl: Placement, dst: tuple[Sbp, ...],
                 shape: tuple[int, ...]) -> tuple[bool, tuple[tuple[int, int, tuple, tuple], ...]]:
    """(direct, transfers): every (sender, receiver, offsets, lengths) block of the conversion.

    Direct when both sides have the same mesh shape and SBP: coordinate i sends its block to
    coordinate i. Otherwise the source is gathered to broadcast and each destination block is
    cut from it by one sender, receivers that are also sources cutting their own; partial-sum
    blocks off coordinate 0 are zeros and travel nowhere.
    """
    src_ranks = src_pl.flat_ranks
    direct = src_pl.hierarchy == dst_pl.hierarchy and src == dst
    transfers, remote = [], 0
    for j, receiver in enumerate(dst_pl.flat_ranks):
        coord = dst_pl.coordinate(receiver)
        offsets, lengths = local_region(shape, dst, dst_pl.hierarchy, coord)
        if direct:
            transfers.append((src_ranks[j], receiver, offsets, lengths))
        elif not _is_zero_partial(dst_pl, dst, coord):
            if receiver in src_ranks:
                sender = receiver
            else:
                sender, remote = src_ranks[remote % len(src_ranks)], remote + 1
            transfers.append((sender, receiver, offsets, lengths))
    return direct, tuple(transfers)


def post_across(x: DTensor | None, src_pl: Placement, src: tuple[Sbp, ...], dst_pl: Placement, dst: tuple[Sbp, ...],
                shape: tuple[int, ...], dtype: torch.dtype, tag: int = 0,
                pending: comm.Pending | None = None) -> tuple[comm.Pending, torch.Tensor | None]:
    """Post this rank's part of boxing ``x`` from ``src_pl`` to ``dst_pl`` without waiting: its sends (``x`` is
    needed on the source ranks only) and receives. Returns the transfers and this rank's destination block
    (None off ``dst_pl``), complete once they are waited on."""
    rank = dist.get_rank()
    direct, transfers = _across_plan(src_pl, src, dst_pl, dst, shape)
    source = None
    if rank in src_pl:
        source = x.to_local() if direct else _box_within(x, src_pl, src, (broadcast,) * src_pl.ndim).to_local()
    sends, recvs, local = [], [], None
    for sender, receiver, offsets, lengths in transfers:
        piece = None
        if sender == rank:
            piece = source if direct else _block(source, offsets, lengths)
            if receiver != rank:
                sends.append((receiver, piece))
        if receiver == rank:
            if sender == rank:
                local = piece.clone()
            else:
                local = torch.empty(lengths, dtype=dtype, device=dst_pl.device)
                recvs.append((sender, local))
    before = comm.stats.bytes_sent
    pending = comm.post(sends, recvs, tag, pending)
    coord = dst_pl.coordinate()
    if coord is not None and local is None:  # a partial-sum block off coordinate 0
        local = torch.zeros(local_region(shape, dst, dst_pl.hierarchy, coord)[1], dtype=dtype, device=dst_pl.device)
    log.debug("boxing %s on %s -> %s on %s: %s, %d message(s) and %d byte(s) sent by this rank", src, src_pl, dst,
              dst_pl, "direct send/recv" if direct else "gather on source, send blocks, slice on destination",
              len(sends), comm.stats.bytes_sent - before)
    return pending, local


def _box_across(x: DTensor, src_pl: Placement, src: tuple[Sbp, ...], dst_pl: Placement,
                dst: tuple[Sbp, ...]) -> DTensor:
    pending, local = post_across(x, src_pl, src, dst_pl, dst, tuple(x.shape), x.dtype)
    pending.wait()
    return _wrap(local, dst_pl, dst, x.shape, x.dtype)


# ---------------------------------------------------------------------------------------------
# autograd functions


class _GlobalToGlobal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src_pl, src, dst_pl, dst, grad_sbps):
        ctx.src_pl, ctx.dst_pl, ctx.grad_sbps = src_pl, dst_pl, grad_sbps
        return _box(x, src_pl, src, dst_pl, dst)

    @staticmethod
    def backward(ctx, grad):
        grad = _box(grad, ctx.dst_pl, from_dtensor(grad.placements), ctx.src_pl, ctx.grad_sbps)
        return grad, None, None, None, None, None


class _LocalToGlobal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, pl, sbps, shape, grad_sbps, sync_data):
        ctx.pl, ctx.grad_sbps, ctx.local_shape = pl, grad_sbps, local.shape
        coord = pl.coordinate()
        if coord is None:
            return _wrap(None, pl, sbps, shape, local.dtype)
        if sync_data and any(isinstance(s, Broadcast) for s in sbps):
            local = local.detach().clone()
            for axis, s in enumerate(sbps):
                if isinstance(s, Broadcast) and pl.hierarchy[axis] > 1:
                    root = pl.rank_at(coord[:axis] + (0,) + coord[axis + 1:])
                    dist.broadcast(local, src=root, group=pl.mesh.get_group(axis))
        return _wrap(local.detach(), pl, sbps, shape, local.dtype)

    @staticmethod
    def backward(ctx, grad):
        grad = _box(grad, ctx.pl, from_dtensor(grad.placements), ctx.pl, ctx.grad_sbps)
        local = grad.to_local() if ctx.pl.coordinate() is not None else grad.to_local().new_zeros(ctx.local_shape)
        return local, None, None, None, None, None


class _OffPlacement(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pl, sbps, shape, dtype):
        ctx.x = x.detach()
        return _wrap(None, pl, sbps, shape, dtype)

    @staticmethod
    def backward(ctx, grad):
        return torch.zeros_like(ctx.x), None, None, None, None


def off_placement(x: torch.Tensor, pl: Placement, sbps: tuple[Sbp, ...], shape: Sequence[int], dtype: torch.dtype,
                  requires_grad: bool) -> DTensor:
    """What a rank outside ``pl`` holds of an output computed there from ``x``: an empty block with the output's
    shape and SBP. It requires grad where the computed output does, and stays in the graph of ``x``, so that in
    backward this rank still takes part in the boxings after it and in the one that brought ``x`` to ``pl``."""
    if x.requires_grad:
        return _OffPlacement.apply(x, pl, sbps, tuple(shape), dtype)
    return _wrap(None, pl, sbps, shape, dtype).requires_grad_(requires_grad)


# ---------------------------------------------------------------------------------------------
# public conversions


def get_sbp(x: torch.Tensor) -> tuple[Sbp, ...]:
    """The SBP of a global tensor, one entry per placement axis."""
    if not isinstance(x, DTensor):
        raise TypeError("get_sbp takes a global tensor; this is a plain torch.Tensor (make it one with tpf.to_global)")
    return from_dtensor(x.placements)


def get_placement(x: torch.Tensor) -> Placement:
    """The placement of a global tensor."""
    if not isinstance(x, DTensor):
        raise TypeError(
            "get_placement takes a global tensor; this is a plain torch.Tensor (make it one with tpf.to_global)"
        )
    return placement_of_mesh(x.device_mesh)


def to_local(x: torch.Tensor) -> torch.Tensor:
    """This rank's block of a global tensor (empty on ranks outside its placement)."""
    if not isinstance(x, DTensor):
        raise TypeError("to_local takes a global tensor; this is already a plain (local) torch.Tensor")
    return x.to_local()


DTYPES = [  # the dtypes a metadata message can name, by index
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
_MAX_NDIM = 16


def _all_gather_meta(local: torch.Tensor, device: torch.device) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Every rank's (shape, dtype), in one fixed-size all-gather over the world."""
    if local.ndim > _MAX_NDIM:
        raise ValueError(f"tpflow handles tensors of up to {_MAX_NDIM} dims, got {local.ndim}")
    code = DTYPES.index(local.dtype) if local.dtype in DTYPES else len(DTYPES)
    meta = torch.tensor([local.ndim, code, *local.shape] + [0] * (_MAX_NDIM - local.ndim), device=device)
    metas = torch.empty(dist.get_world_size() * meta.numel(), dtype=meta.dtype, device=device)
    comm.all_gather_single(metas, meta)
    out = []
    for ndim, code, *shape in metas.view(-1, meta.numel()).tolist():
        out.append((tuple(shape[:ndim]), DTYPES[code] if code < len(DTYPES) else "unsupported"))
    return out


def _global_shape(local: torch.Tensor, pl: Placement, sbp: object,
                  shape: Sequence[int] | None) -> tuple[tuple[int, ...], tuple[Sbp, ...]]:
    """(global shape, SBPs) of per-rank blocks, checked on every rank so a mismatch fails everywhere."""
    if shape is not None:
        shape = tuple(shape)
        sbps = normalize(sbp, pl.ndim, len(shape))
        coord = pl.coordinate()
        if coord is not None and tuple(local.shape) != local_region(shape, sbps, pl.hierarchy, coord)[1]:
            raise ValueError(
                f"rank {dist.get_rank()} holds a block of shape {tuple(local.shape)}, but global shape {shape} "
                f"with sbp {sbps} on {pl} gives it {local_region(shape, sbps, pl.hierarchy, coord)[1]}"
            )
        return shape, sbps
    members = {r: meta for r, meta in enumerate(_all_gather_meta(local, pl.device)) if r in pl}
    if len({m[1] for m in members.values()}) > 1:
        raise ValueError(f"the ranks of {pl} hold blocks of different dtypes: {members}")
    if len({len(m[0]) for m in members.values()}) > 1:
        raise ValueError(f"the ranks of {pl} hold blocks of different ndim: { {r: m[0] for r, m in members.items()} }")
    first = members[pl.flat_ranks[0]][0]
    sbps = normalize(sbp, pl.ndim, len(first))
    shape = list(first)
    for dim in {s.dim for s in sbps if isinstance(s, Split)}:
        along = [axis for axis, s in enumerate(sbps) if s == Split(dim)]
        shape[dim] = sum(members[r][0][dim] for r in pl.flat_ranks
                         if all(c == 0 for axis, c in enumerate(pl.coordinate(r)) if axis not in along))
    wrong = {r: m[0] for r, m in members.items()
             if m[0] != local_region(shape, sbps, pl.hierarchy, pl.coordinate(r))[1]}
    if wrong:
        expected = {r: local_region(shape, sbps, pl.hierarchy, pl.coordinate(r))[1] for r in wrong}
        raise ValueError(
            f"local blocks do not make a global tensor with sbp {sbps} on {pl}: ranks hold {wrong}, but global "
            f"shape {tuple(shape)} needs {expected} (split blocks follow torch.chunk sizes; other dims must agree)"
        )
    return tuple(shape), sbps


def from_local(local: torch.Tensor, placement: Placement, sbp: object, *, shape: Sequence[int] | None = None,
               grad_sbp: object = None, sync_data: bool = True) -> DTensor:
    """A global tensor from each rank's block (OneFlow's local -> global ``to_global``).

    With ``split`` each rank's tensor is its shard, with ``partial_sum`` its addend, with
    ``broadcast`` the whole value (copied from the axis' first rank when ``sync_data``).
    Without ``shape`` the ranks exchange their block shapes: one small collective that also
    checks they fit together. The gradient of ``local`` is this rank's block of the global
    gradient in layout ``grad_sbp`` (default: ``sbp``, with partial sums read as broadcast).
    """
    if not isinstance(local, torch.Tensor) or isinstance(local, DTensor):
        raise TypeError(f"from_local takes a plain torch.Tensor, got {type(local).__name__}")
    pl = _check_placement(placement)
    global_shape, sbps = _global_shape(local, pl, sbp, shape)
    grad_sbps = dual(sbps) if grad_sbp is None else normalize(grad_sbp, pl.ndim, len(global_shape))
    for coord in map(pl.coordinate, pl.flat_ranks):
        if local_region(global_shape, grad_sbps, pl.hierarchy, coord)[1] != \
                local_region(global_shape, sbps, pl.hierarchy, coord)[1]:
            raise ValueError(
                f"grad_sbp {grad_sbps} gives blocks of another shape than sbp {sbps}: the gradient of a local "
                "tensor must have its shape, so use grad_sbp that differs only in broadcast / partial_sum"
            )
    return _LocalToGlobal.apply(local, pl, sbps, global_shape, grad_sbps, sync_data)


def _module_to_global(module: nn.Module, pl: Placement, sbp: object) -> nn.Module:
    """Every parameter and buffer, read as its whole (single-device) value, laid out as ``sbp`` on ``pl``.

    With ``sbp=None`` a global tensor keeps its SBP (moving to ``pl`` if it lives elsewhere) and a plain
    one is broadcast. Plain tensors are taken from the placement's first rank, so every rank starts from
    the same model whatever its own initialisation drew. Shared parameters stay shared; a tensor already
    in its layout is kept as it is (the same object).
    """
    entries = []  # validate every tensor before converting any, so an error leaves the module intact
    for mod_name, mod in module.named_modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(mod, kind).items():
                if t is not None:
                    want = get_sbp(t) if sbp is None and isinstance(t, DTensor) else \
                        (broadcast,) * pl.ndim if sbp is None else sbp
                    try:
                        entries.append((getattr(mod, kind), name, t, normalize(want, pl.ndim, t.ndim)))
                    except ValueError as e:
                        raise ValueError(f"{f'{mod_name}.{name}'.lstrip('.')}: {e}") from None
    converted: dict[int, torch.Tensor] = {}
    for table, name, t, sbps in entries:
        if isinstance(t, DTensor) and (get_placement(t), get_sbp(t)) == (pl, sbps):
            continue
        if id(t) not in converted:
            with torch.no_grad():
                if isinstance(t, DTensor):
                    new = _box(t, get_placement(t), get_sbp(t), pl, sbps)
                else:
                    whole = from_local(t.detach(), pl, (broadcast,) * pl.ndim, shape=t.shape)
                    new = _box_within(whole, pl, (broadcast,) * pl.ndim, sbps)
            converted[id(t)] = gradients.adopt(nn.Parameter(new, t.requires_grad)) if isinstance(t, nn.Parameter) \
                else new
        table[name] = converted[id(t)]
    return module


def to_global(x: torch.Tensor | nn.Module, placement: Placement | None = None, sbp: object = None, *,
              grad_sbp: object = None, shape: Sequence[int] | None = None, sync_data: bool = True):
    """Box a global tensor to a new placement and/or SBP (any pair, autograd both ways).

    A plain tensor is read as this rank's block (see ``from_local``); an ``nn.Module`` has every
    parameter and buffer converted (``sbp=None``: global ones keep their SBP, plain ones are broadcast).
    ``grad_sbp`` is the layout of the input's gradient
    (default: the input's own SBP, with partial sums read as broadcast).
    """
    if isinstance(x, nn.Module):
        if placement is None:
            raise TypeError("to_global(module, placement=..., sbp=...) needs a placement")
        return _module_to_global(x, _check_placement(placement), sbp)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"to_global takes a torch.Tensor or an nn.Module, got {type(x).__name__}")
    if not isinstance(x, DTensor):
        if placement is None or sbp is None:
            raise TypeError("to_global of a plain (local) tensor needs both placement= and sbp=")
        return from_local(x, placement, sbp, shape=shape, grad_sbp=grad_sbp, sync_data=sync_data)
    src_pl, src = get_placement(x), get_sbp(x)
    dst_pl = src_pl if placement is None else _check_placement(placement)
    dst = src if sbp is None else normalize(sbp, dst_pl.ndim, x.ndim)
    if src_pl == dst_pl and len(src) != len(dst):
        raise ValueError(f"{len(dst)} SBP(s) for the {dst_pl.ndim}-D placement {dst_pl}")
    grad_sbps = dual(src) if grad_sbp is None else normalize(grad_sbp, src_pl.ndim, x.ndim)
    if (src_pl, src) == (dst_pl, dst) and grad_sbps == dual(src):
        return x
    return _GlobalToGlobal.apply(x, src_pl, src, dst_pl, dst, grad_sbps)


# ---------------------------------------------------------------------------------------------
# matmul


def _transposed(sbps: Sequence[Sbp], ndim: int) -> tuple[Sbp, ...]:
    swap = {ndim - 1: ndim - 2, ndim - 2: ndim - 1}
    return tuple(Split(swap.get(s.dim, s.dim)) if isinstance(s, Split) else s for s in sbps)


def _as_rows(sbps: Sequence[Sbp], ndim: int) -> tuple[Sbp, ...]:
    """SBP of ``t.reshape(-1, t.shape[-1])``: every dim but the last folds into rows."""
    return tuple(Split(0 if s.dim < ndim - 1 else 1) if isinstance(s, Split) else s for s in sbps)


class _Matmul(torch.autograd.Function):
    """``a @ b`` on local blocks under a legal SBP signature; gradients in the inputs' layouts."""

    @staticmethod
    def forward(ctx, a, b, pl, out_sbps):
        a_sbps, b_sbps = get_sbp(a), get_sbp(b)
        a_local, b_local = a.to_local(), b.to_local()
        ctx.save_for_backward(a_local, b_local)
        ctx.meta = (pl, a_sbps, b_sbps, out_sbps, a.shape, b.shape)
        member = pl.coordinate() is not None
        local = kernels.matmul(a_local, b_local) if member else None
        return _wrap(local, pl, out_sbps, (*a.shape[:-1], b.shape[-1]), a.dtype)

    @staticmethod
    def backward(ctx, grad):
        a_local, b_local = ctx.saved_tensors
        pl, a_sbps, b_sbps, out_sbps, a_shape, b_shape = ctx.meta
        member = pl.coordinate() is not None
        g_sbps = dual(out_sbps)
        g = _box(grad, pl, from_dtensor(grad.placements), pl, g_sbps).to_local()
        a_nd, b_nd, g_nd = len(a_shape), len(b_shape), len(a_shape)
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:  # dA = dY @ B^T
            sbps = matmul_out_sbp(g_sbps, _transposed(b_sbps, b_nd), g_nd, b_nd)
            local = kernels.matmul(g, b_local.mT) if member else None
            grad_a = _box(_wrap(local, pl, sbps, a_shape, grad.dtype), pl, sbps, pl, dual(a_sbps))
        if ctx.needs_input_grad[1]:  # dB = A^T @ dY, batch dims folded into rows when B is 2-D
            if b_nd == 2 and a_nd > 2:
                a_sbps, g_sbps = _as_rows(a_sbps, a_nd), _as_rows(g_sbps, g_nd)
                if member:
                    a_local, g = a_local.flatten(0, -2), g.flatten(0, -2)
            sbps = matmul_out_sbp(_transposed(a_sbps, b_nd), g_sbps, b_nd, b_nd)
            local = kernels.matmul(a_local.mT, g) if member else None
            grad_b = _box(_wrap(local, pl, sbps, b_shape, grad.dtype), pl, sbps, pl, dual(b_sbps))
        return grad_a, grad_b, None, None


def matmul(a: DTensor, b: DTensor) -> DTensor:
    """``a [..., M, K] @ b [K, N]`` (or ``b [..., K, N]`` with a's batch dims) of global tensors.

    The output SBP follows from the inputs' (S0 x B -> S0, B x S1 -> S1, S1 x S0 -> P, B x B -> B,
    P x B -> P, B x P -> P, per placement axis). Inputs with no legal signature are first boxed
    to the one that moves the fewest bytes; ``TPFLOW_DEBUG=1`` logs that choice.
    """
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, DTensor):
            raise TypeError(
                f"tpf.matmul takes global tensors, and {name} is a plain torch.Tensor: make it global with "
                f"tpf.to_global({name}, placement=..., sbp=...), or use torch.matmul for local tensors"
            )
    pl, b_pl = get_placement(a), get_placement(b)
    if pl != b_pl:
        raise ValueError(
            f"tpf.matmul inputs live on different placements: a on {pl}, b on {b_pl}; move one first, "
            f"e.g. b = tpf.to_global(b, placement=tpf.get_placement(a))"
        )
    if a.ndim < 2 or b.ndim < 2 or (b.ndim > 2 and (b.ndim != a.ndim or a.shape[:-2] != b.shape[:-2])):
        raise ValueError(
            f"tpf.matmul multiplies a [..., M, K] by b [K, N] or by b [..., K, N] with a's batch dims; "
            f"got a {tuple(a.shape)} and b {tuple(b.shape)}"
        )
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"tpf.matmul inner sizes differ: a {tuple(a.shape)} @ b {tuple(b.shape)} ({a.shape[-1]} != "
                         f"{b.shape[-2]})")
    a_sbps, b_sbps = get_sbp(a), get_sbp(b)
    nbytes = [t.numel() * t.element_size() for t in (a, b)]
    a_to, b_to, out = infer_matmul(a_sbps, b_sbps, a.ndim, b.ndim, *nbytes, pl.hierarchy)
    if (a_to, b_to) != (a_sbps, b_sbps):
        log.debug("matmul %s x %s has no signature on %s: boxing to %s x %s -> %s (fewest bytes)",
                  a_sbps, b_sbps, pl, a_to, b_to, out)
        a, b = to_global(a, sbp=a_to), to_global(b, sbp=b_to)
    else:
        log.debug("matmul %s x %s -> %s on %s", a_sbps, b_sbps, out, pl)
    return _Matmul.apply(a, b, pl, out)
