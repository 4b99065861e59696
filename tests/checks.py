"""Rank-side helpers for multi-rank tests: exact sources, an independent reassembly, and the checks more than one
test file runs (the torch path's and the Triton kernels').

Values are small integers stored as floats, so sums of partials are exact and every
comparison can be ``torch.equal``. ``logical`` reassembles a global tensor from the raw
per-rank blocks with ``all_gather_object``, not through tpflow, so a boxing bug cannot hide
behind the same bug in the checker. Test files import helpers from here, from ``tests.harness`` and from
``tests.models``, never from each other.
"""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tpflow as tpf
from tpflow.sbp import Broadcast, PartialSum, chunk_bounds, local_region

S0, S1, B, P = tpf.sbp.split(0), tpf.sbp.split(1), tpf.sbp.broadcast, tpf.sbp.partial_sum
SBPS_2D = (S0, S1, B, P)


@contextlib.contextmanager
def within(seconds: float = 30):
    """A case that must end (a failure case: fail, as it should, on every rank) within ``seconds``: a rank still in it
    then prints every thread's stack and exits, which the harness reports as that rank dying (a timeout, not a
    timing assertion)."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def ints(shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, tuple(shape), generator=g).float()


def block(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(offsets, lengths)):
        t = t.narrow(d, o, n)
    return t


def source(ref: torch.Tensor, pl, sbps, seed: int = 7, requires_grad: bool = False):
    """A global tensor of value ``ref`` whose partial-sum axes hold random addends (not zeros)."""
    coord = pl.coordinate()
    local = torch.empty(0)
    if coord is not None:
        offsets, lengths = local_region(ref.shape, sbps, pl.hierarchy, coord)
        on_first = all(c == 0 for s, c in zip(sbps, coord) if isinstance(s, PartialSum))
        local = block(ref, offsets, lengths).clone() if on_first else torch.zeros(lengths)
        for axis, s in enumerate(sbps):
            if isinstance(s, PartialSum):
                k = pl.hierarchy[axis]
                # the same addends on broadcast replicas: key on the other non-broadcast axes only
                others = tuple(c for a, (t, c) in enumerate(zip(sbps, coord))
                               if a != axis and not isinstance(t, Broadcast))
                key = hash((seed, axis, others)) % 2**31
                noise = [ints(lengths, key + c) for c in range(1, k)]
                local += -sum(noise) if coord[axis] == 0 else noise[coord[axis] - 1]
    x = tpf.from_local(local, pl, sbps, shape=ref.shape, sync_data=False)
    return x.detach().requires_grad_(requires_grad)


def logical(t) -> torch.Tensor | None:
    """The value of global tensor ``t`` reassembled from every rank's block (None if inconsistent)."""
    pl, sbps = tpf.get_placement(t), tpf.get_sbp(t)
    blocks: list = [None] * dist.get_world_size()
    dist.all_gather_object(blocks, t.to_local().detach().clone())
    out = torch.zeros(t.shape, dtype=t.dtype)
    seen: dict = {}
    for rank in pl.flat_ranks:
        coord = pl.coordinate(rank)
        offsets, lengths = local_region(t.shape, sbps, pl.hierarchy, coord)
        if tuple(blocks[rank].shape) != tuple(lengths):
            return None
        # broadcast replicas must be identical, not merely sum right
        key = tuple(c for s, c in zip(sbps, coord) if not isinstance(s, Broadcast))
        if key in seen and not torch.equal(seen[key], blocks[rank]):
            return None
        if key not in seen:
            seen[key] = blocks[rank]
            block(out, offsets, lengths).add_(blocks[rank])
    return out


def grad_block(g: torch.Tensor, t) -> torch.Tensor:
    """This rank's block of gradient ``g`` for output ``t`` (a partial sum's gradient is broadcast)."""
    pl, sbps = tpf.get_placement(t), tpf.sbp.dual(tpf.get_sbp(t))
    coord = pl.coordinate()
    if coord is None:
        return torch.empty(0)
    return block(g, *local_region(g.shape, sbps, pl.hierarchy, coord)).clone()


def backward_logical(out, g: torch.Tensor) -> None:
    """Backpropagate the logical gradient ``g`` of global ``out`` from its local blocks."""
    dual = tpf.sbp.dual(tpf.get_sbp(out))
    grad = tpf.from_local(grad_block(g, out), tpf.get_placement(out), dual, shape=g.shape, sync_data=False)
    if out.is_leaf:  # an identity conversion returned its input; DTensor cannot clone grads off-mesh
        out.grad = grad.detach()
    else:
        torch.autograd.backward(out, grad.detach())


def sbp_tuples(ndim: int):
    return list(itertools.product(SBPS_2D, repeat=ndim))


def all_ranks(device: str = "cpu"):
    """The placement of every rank of the world, on ``device``'s type."""
    return tpf.placement(device, list(range(dist.get_world_size())))


def own(size):
    """This rank's chunk of ``size`` (``torch.chunk``'s rule), as a slice."""
    return slice(*chunk_bounds(size, dist.get_world_size())[dist.get_rank()])


class Counting:
    """Launches a kernel as ``inner`` does, counting the launches (for ``tuning.use``): a path that silently fell
    back to torch's matmul launches none."""

    def __init__(self, inner) -> None:
        self.inner, self.launches = inner, 0

    def launch(self, *args, **kwargs) -> None:
        self.launches += 1
        self.inner.launch(*args, **kwargs)


def sent_bytes(fn):
    """(forward, backward) bytes this rank sends in ``fn``, which returns the tensor to backpropagate and its
    gradient."""
    tpf.comm.stats.reset()
    y, g = fn()
    forward = tpf.comm.stats.bytes_sent
    y.backward(g)
    return forward, tpf.comm.stats.bytes_sent - forward


def _equal(a, b, msg):
    assert torch.equal(a, b), msg


def _close(a, b, msg):
    torch.testing.assert_close(a, b, msg=msg)


def mlp_matches_one_device(sequence_parallel, seq, hidden, gelu, dtype=torch.float64, algo="auto", device="cpu"):
    """Column -> activation -> row blocks through ``parallelize`` (sequence parallel or not): the output, the
    input's and every parameter's gradient, and every parameter after an SGD step equal one device's."""
    from tests.models import Stack

    ref = Stack(5, hidden, depth=2, act=F.gelu if gelu else torch.relu).to(device, dtype)
    plan = {"*.fc1": tpf.ColumnParallel(sequence_parallel=sequence_parallel, algo=algo),
            "*.fc2": tpf.RowParallel(sequence_parallel=sequence_parallel, algo=algo)}
    model = tpf.parallelize(copy.deepcopy(ref), placement=all_ranks(device), plan=plan)
    same = _close if gelu else _equal  # exact with relu (small integers); gelu: up to the order of sums over ranks
    x_ref = ints((seq, 2, 5), seed=7).to(device, dtype).requires_grad_()  # [S, B, H]: sequence parallelism splits S
    rows = own(seq) if sequence_parallel else slice(None)
    x = x_ref.detach()[rows].clone().requires_grad_()
    y, y_ref = model(x), ref(x_ref)
    same(y, y_ref[rows], msg="output")
    g = ints(y_ref.shape, seed=8).to(device, dtype)
    y.backward(g[rows])
    y_ref.backward(g)
    same(x.grad, x_ref.grad[rows], msg="input gradient")
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        full = p.grad.full_tensor() if isinstance(p.grad, torch.distributed.tensor.DTensor) else p.grad
        same(full, p_ref.grad, msg=f"gradient of {name}")
    for params in (model.parameters(), ref.parameters()):  # lr 1/4 keeps small integers exact
        torch.optim.SGD(params, lr=0.25, momentum=0.5).step()
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        same(p.full_tensor() if isinstance(p, torch.distributed.tensor.DTensor) else p, p_ref,
             msg=f"{name} after an optimizer step")
    return str(model)


def fused_columns_match_one_device(sequence_parallel, keep_gathered, bias, device="cpu"):
    """q / k / v-like column layers run as one product (``fuse=True``): outputs and gradients equal one device's;
    returns the (forward, backward) bytes the group sent, and those one layer as wide as the three sends."""
    from tests.models import WIDTHS, Trio

    W, r = dist.get_world_size(), dist.get_rank()
    ref = Trio(bias=bias).to(device)
    style = tpf.ColumnParallel(fuse=True, sequence_parallel=sequence_parallel, keep_gathered=keep_gathered)
    model = tpf.parallelize(copy.deepcopy(ref), placement=all_ranks(device), plan={"[abc]": style})
    assert model.a.fused_group is model.b.fused_group is model.c.fused_group is not None
    x_full = ints((2 * W, 3, 6), seed=20).to(device)  # [sequence, batch, features]: sequence parallelism splits dim 0
    mine = slice(2 * r, 2 * r + 2) if sequence_parallel else slice(None)
    x = x_full[mine].clone().requires_grad_()
    x_ref = x_full.clone().requires_grad_()
    grads = [ints((2 * W, 3, w), seed=30 + i).to(device) for i, w in enumerate(WIDTHS)]  # of the whole outputs
    outs, refs = [], ref(x_ref)

    def step():
        outs.extend(model(x))
        return torch.cat([y.flatten() for y in outs]), torch.cat([g[..., own(w)].flatten()
                                                                  for g, w in zip(grads, WIDTHS)])
    fused_bytes = sent_bytes(step)
    sum(((y * g).sum() for y, g in zip(refs, grads))).backward()
    for y, y_ref, w, name in zip(outs, refs, WIDTHS, "abc"):
        assert torch.equal(y, y_ref[..., own(w)]), f"output of {name}"
    assert torch.equal(x.grad, x_ref.grad[mine]), "input gradient"
    for name in "abc":
        layer, layer_ref = getattr(model, name), getattr(ref, name)
        cols = own(layer_ref.out_features)
        assert torch.equal(layer.weight.grad.to_local(), layer_ref.weight.grad[cols]), f"weight gradient of {name}"
        if bias:
            assert torch.equal(layer.bias.grad.to_local(), layer_ref.bias.grad[cols]), f"bias gradient of {name}"

    # one column layer as wide as the three, on the same input: the communication the group must match
    one = tpf.ColumnParallelLinear(6, sum(WIDTHS), bias=bias, placement=all_ranks(device),
                                   sequence_parallel=sequence_parallel, keep_gathered=keep_gathered)
    x_one = x.detach().clone().requires_grad_()
    return fused_bytes, sent_bytes(lambda: (one(x_one).sum(), torch.ones((), device=device)))


def half_precision_rounds_once(dtype, device="cpu"):
    """fp16 / bf16 layers against nn.Linear in the same dtype, both measured against fp64: partial sums
    travel in fp32, so the parallel layers round once, as one device does (half-precision partials would
    round W + 1 times)."""
    torch.manual_seed(0)
    ref64 = nn.Linear(1024, 48).to(device, torch.float64)
    x64 = torch.randn(64, 1024, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).to(device)
    cols, rows = own(48), own(1024)
    ref = copy.deepcopy(ref64).to(dtype)
    col = tpf.ColumnParallelLinear.from_linear(ref, placement=all_ranks(device))
    row = tpf.RowParallelLinear.from_linear(ref, placement=all_ranks(device))
    x = x64.to(dtype)
    checks = [(col(x), ref(x)[..., cols], ref64(x64)[..., cols]),
              (row(x[..., rows]), ref(x), ref64(x64))]
    for got, torch_same_dtype, want in checks:
        err = (got.double() - want).abs().max()
        bound = 1.2 * (torch_same_dtype.double() - want).abs().max()  # one rounding, as on one device
        assert err <= bound, f"{dtype}: error {err:.3g} > {bound:.3g}"
