"""The boxing matrix: every SBP pair within a placement (1-D for world sizes 1-4, every tuple
pair on 2 x 2) and across placements, values and gradients compared exactly."""

from __future__ import annotations

import pytest
import torch

import tpflow as tpf
from tests import harness
from tests.checks import S0, S1, B, P, backward_logical, ints, logical, sbp_tuples, source

SHAPES = [(5, 7), (4, 8), (1, 3)]


def _convert_and_check(ref, src_pl, src, dst_pl, dst, grad_sbp=None):
    """Box ``ref`` from (src_pl, src) to (dst_pl, dst); return a failure description or None."""
    x = source(ref, src_pl, src, requires_grad=True)
    out = tpf.to_global(x, placement=dst_pl, sbp=dst, grad_sbp=grad_sbp)
    case = f"{src} on {src_pl.ranks} -> {dst} on {dst_pl.ranks}, shape {tuple(ref.shape)}"
    if tpf.get_sbp(out) != tuple(dst) or tpf.get_placement(out) != dst_pl:
        return f"{case}: got layout {tpf.get_sbp(out)} on {tpf.get_placement(out)}"
    value = logical(out)
    if value is None or not torch.equal(value, ref):
        return f"{case}: wrong value {value}"
    g = ints(ref.shape, seed=99)
    backward_logical(out, g)
    want = tpf.sbp.dual(src) if grad_sbp is None else tuple(grad_sbp)
    if tpf.get_sbp(x.grad) != want:
        return f"{case}: gradient layout {tpf.get_sbp(x.grad)}, wanted {want}"
    grad = logical(x.grad)
    if grad is None or not torch.equal(grad, g):
        return f"{case}: wrong gradient {grad}"
    return None


def _within_matrix(ranks, shapes):
    return _cross_matrix([(ranks, ranks)], shapes)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_sbp_pair_1d(world_size):
    for failures in harness.run(world_size, _within_matrix, list(range(world_size)), SHAPES):
        assert not failures, "\n".join(failures)


def test_every_sbp_tuple_pair_2x2():
    for failures in harness.run(4, _within_matrix, [[0, 1], [2, 3]], [(5, 7), (4, 4)], timeout=600):
        assert not failures, "\n".join(failures[:20])


def test_every_sbp_tuple_pair_3x1_uneven_submesh():
    for failures in harness.run(4, _within_matrix, [[1], [2], [3]], [(5, 2)]):
        assert not failures, "\n".join(failures[:20])


CROSS = [
    ([0, 1], [2, 3]),  # disjoint (the pipeline hand-off)
    ([0, 1, 2], [1, 2, 3]),  # overlapping
    ([0], [0, 1]),  # superset
    ([0, 1, 2, 3], [1]),  # subset
    ([0], [1, 2, 3]),  # different sizes
    ([[0, 1], [2, 3]], [1, 2]),  # 2-D -> 1-D
    ([0, 2], [[0, 1], [2, 3]]),  # 1-D -> 2-D
]


def _cross_matrix(cases, shapes):
    failures = []
    for src_ranks, dst_ranks in cases:
        src_pl, dst_pl = tpf.placement("cpu", src_ranks), tpf.placement("cpu", dst_ranks)
        for shape in shapes:
            ref = ints(shape, seed=sum(shape))
            for src in sbp_tuples(src_pl.ndim):
                for dst in sbp_tuples(dst_pl.ndim):
                    failures.append(_convert_and_check(ref, src_pl, src, dst_pl, dst))
    return [f for f in failures if f]


def test_across_placements():
    for failures in harness.run(4, _cross_matrix, CROSS, [(5, 7)], timeout=600):
        assert not failures, "\n".join(failures[:20])


def _grad_sbp_cases():
    pl = tpf.placement("cpu", [0, 1, 2])
    other = tpf.placement("cpu", [3])
    ref = ints((7, 4), seed=3)
    cases = [
        (pl, (S0,), pl, (B,), (P,)),  # gradient left as partial sums: no reduction in backward
        (pl, (B,), pl, (S1,), (P,)),
        (pl, (S1,), pl, (S0,), (B,)),  # gradient gathered
        (pl, (P,), other, (B,), (S0,)),
        (other, (B,), pl, (S0,), (P,)),
    ]
    return [f for f in (_convert_and_check(ref, *case) for case in cases) if f]


def test_grad_sbp_chooses_gradient_layout():
    for failures in harness.run(4, _grad_sbp_cases):
        assert not failures, "\n".join(failures)


def _plain_tensor_is_local_part(world):
    rank = tpf.get_rank()
    pl = tpf.placement("cpu", list(range(world)))
    rows = [3, 3, 3, 1][:world] if world == 4 else [2] * world
    local = torch.full((rows[rank], 2), float(rank), requires_grad=True)
    x = tpf.to_global(local, placement=pl, sbp=S0)  # per-rank batches -> one global batch
    assert x.shape == (sum(rows), 2) and tpf.get_sbp(x) == (S0,)
    want = torch.cat([torch.full((n, 2), float(r)) for r, n in enumerate(rows)])
    assert torch.equal(logical(x), want)
    # broadcast: every rank's tensor is the whole value, taken from the first rank
    b = tpf.to_global(torch.full((2,), float(rank)), placement=pl, sbp=B)
    assert torch.equal(b.to_local(), torch.zeros(2))
    # partial sum: every rank's tensor is an addend
    p = tpf.to_global(torch.full((2,), float(rank + 1)), placement=pl, sbp=P)
    assert torch.equal(logical(p), torch.full((2,), float(sum(range(1, world + 1)))))
    # gradient flows back to the local tensor: the block of the global gradient
    y = tpf.to_global(x, sbp=B)
    backward_logical(y, want * 10)
    assert torch.equal(local.grad, torch.full((rows[rank], 2), 10.0 * rank))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_plain_tensor_is_local_part(world_size):
    harness.run(world_size, _plain_tensor_is_local_part, world_size)


def _module_to_global():
    pl = tpf.placement("cpu", [0, 1])
    torch.manual_seed(tpf.get_rank())  # ranks draw different weights: the first rank's win
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 6))
    model[0].weight = model[2].weight  # a shared parameter stays shared
    model.register_buffer("scale", torch.full((3,), float(tpf.get_rank())))
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 6))
    reference[0].weight = reference[2].weight
    tpf.to_global(model, placement=pl, sbp=B)
    assert model[0].weight is model[2].weight
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert isinstance(p, torch.nn.Parameter) and p.requires_grad and p.is_leaf, name
        assert tpf.get_sbp(p) == (B,) and tpf.get_placement(p) == pl, name
        if tpf.get_rank() in pl:
            assert torch.equal(p.to_local(), q.detach()), name
    assert tpf.get_sbp(model.scale) == (B,)
    if tpf.get_rank() in pl:
        assert torch.equal(model.scale.to_local(), torch.zeros(3))
    tpf.to_global(model, placement=pl, sbp=S0)  # an already-global module is boxed
    assert all(tpf.get_sbp(p) == (S0,) for p in model.parameters())
    assert torch.equal(logical(model[2].weight), reference[2].weight.detach())
    with pytest.raises(ValueError, match=r"scale: sbp.split\(dim=1\) is out of range"):  # 1-D tensors have no dim 1
        tpf.to_global(model, placement=pl, sbp=S1)
    assert all(tpf.get_sbp(p) == (S0,) for p in model.parameters())  # left as it was


def test_module_to_global():
    harness.run(3, _module_to_global)


def _bytes_moved():
    """Direct hand-offs move exactly the blocks; the general route sends each block once."""
    p01, p23 = tpf.placement("cpu", [0, 1]), tpf.placement("cpu", [2, 3])
    x = tpf.randn(6, 6, placement=p01, sbp=S0)
    tpf.comm.stats.reset()
    tpf.to_global(x, placement=p23, sbp=S0)  # rank r sends its 3 x 6 block to rank r + 2
    direct = tpf.comm.stats.bytes_sent, tpf.comm.stats.messages_sent
    tpf.comm.stats.reset()
    tpf.to_global(x, placement=tpf.placement("cpu", [1, 2, 3]), sbp=S1)  # gather on [0, 1], one block each
    general = tpf.comm.stats.bytes_sent, tpf.comm.stats.messages_sent
    return direct, general


def test_bytes_moved_across_placements():
    results = harness.run(4, _bytes_moved)
    assert [r[0] for r in results] == [(72, 1), (72, 1), (0, 0), (0, 0)]
    # 6 x 2 blocks for ranks 2 and 3 (rank 1 cuts its own from the gathered value): senders 0 and 1
    assert [r[1] for r in results] == [(48, 1), (48, 1), (0, 0), (0, 0)]
