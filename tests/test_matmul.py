"""tpf.matmul: SBP inference per placement axis, automatic boxing of illegal pairs, exact values
and gradients against torch on one device (small integers, so every sum is exact)."""

from __future__ import annotations

import itertools

import pytest
import torch

import tpflow as tpf
from tests import harness
from tests.checks import S0, S1, B, P, backward_logical, ints, logical, sbp_tuples, source

LEGAL = {(S0, B): S0, (B, S1): S1, (S1, S0): P, (B, B): B, (P, B): P, (B, P): P}


def _check_product(pl, a_ref, b_ref, a_sbps, b_sbps, want_out=None):
    case = f"{a_sbps} x {b_sbps} on {pl.ranks}, {tuple(a_ref.shape)} @ {tuple(b_ref.shape)}"
    a = source(a_ref, pl, a_sbps, seed=1, requires_grad=True)
    b = source(b_ref, pl, b_sbps, seed=2, requires_grad=True)
    out = tpf.matmul(a, b)
    if want_out is not None and tpf.get_sbp(out) != want_out:
        return f"{case}: output {tpf.get_sbp(out)}, wanted {want_out}"
    value = logical(out)
    if value is None or not torch.equal(value, a_ref @ b_ref):
        return f"{case}: wrong value"
    g = ints(value.shape, seed=5)
    backward_logical(out, g)
    a_leaf, b_leaf = a_ref.clone().requires_grad_(), b_ref.clone().requires_grad_()
    (a_leaf @ b_leaf).backward(g)
    for name, t, ref in (("a", a, a_leaf), ("b", b, b_leaf)):
        if tpf.get_sbp(t.grad) != tpf.sbp.dual(tpf.get_sbp(t)):
            return f"{case}: d{name} layout {tpf.get_sbp(t.grad)}"
        grad = logical(t.grad)
        if grad is None or not torch.equal(grad, ref.grad):
            return f"{case}: wrong d{name}"
    return None


def _every_pair_1d(world):
    pl = tpf.placement("cpu", list(range(world)))
    failures = []
    for (m, k, n) in [(5, 7, 3), (4, 6, 8)]:
        a_ref, b_ref = ints((m, k), 10), ints((k, n), 11)
        for a_sbp, b_sbp in itertools.product((S0, S1, B, P), repeat=2):
            want = (LEGAL[(a_sbp, b_sbp)],) if (a_sbp, b_sbp) in LEGAL else None
            failures.append(_check_product(pl, a_ref, b_ref, (a_sbp,), (b_sbp,), want))
    return [f for f in failures if f]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_sbp_pair_1d(world_size):
    for failures in harness.run(world_size, _every_pair_1d, world_size):
        assert not failures, "\n".join(failures)


def _batched(world):
    pl = tpf.placement("cpu", list(range(world)))
    a_ref, w_ref, b3_ref = ints((3, 5, 7), 1), ints((7, 4), 2), ints((3, 7, 4), 3)
    S2 = tpf.sbp.split(2)
    failures = [
        _check_product(pl, a_ref, w_ref, (S0,), (B,), (S0,)),  # batch split x whole weight
        _check_product(pl, a_ref, w_ref, (S1,), (B,), (S1,)),  # rows split
        _check_product(pl, a_ref, w_ref, (S2,), (S0,), (P,)),  # contraction split
        _check_product(pl, a_ref, w_ref, (B,), (S1,), (S2,)),  # columns split
        _check_product(pl, a_ref, b3_ref, (S0,), (S0,), (S0,)),  # batched x batched, batch split
        _check_product(pl, a_ref, b3_ref, (S2,), (S1,), (P,)),
        _check_product(pl, a_ref, b3_ref, (B,), (S2,), (S2,)),
        _check_product(pl, a_ref, b3_ref, (S0,), (B,), None),  # illegal: boxed first
    ]
    return [f for f in failures if f]


@pytest.mark.parametrize("world_size", [2, 3])
def test_batched(world_size):
    for failures in harness.run(world_size, _batched, world_size):
        assert not failures, "\n".join(failures)


def _every_pair_2x2():
    pl = tpf.placement("cpu", [[0, 1], [2, 3]])
    a_ref, b_ref = ints((5, 6), 1), ints((6, 3), 2)
    failures = []
    for a_sbps in sbp_tuples(2):
        for b_sbps in sbp_tuples(2):
            pairs = list(zip(a_sbps, b_sbps))
            want = tuple(LEGAL[p] for p in pairs) if all(p in LEGAL for p in pairs) else None
            failures.append(_check_product(pl, a_ref, b_ref, a_sbps, b_sbps, want))
    return [f for f in failures if f]


def test_every_sbp_tuple_pair_2x2():
    for failures in harness.run(4, _every_pair_2x2, timeout=600):
        assert not failures, "\n".join(failures[:20])


def _float_tolerance(world):
    """Real (non-integer) values: where sums cross ranks, agreement within fp32 rounding."""
    pl = tpf.placement("cpu", list(range(world)))
    torch.manual_seed(0)
    a = tpf.randn(9, 41, placement=pl, sbp=S1)
    b = tpf.randn(41, 13, placement=pl, sbp=S0)
    out = tpf.matmul(a, b)
    torch.manual_seed(0)
    want = torch.randn(9, 41) @ torch.randn(41, 13)
    assert tpf.get_sbp(out) == (P,)
    torch.testing.assert_close(tpf.to_local(tpf.to_global(out, sbp=B)), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world_size", [3, 4])
def test_partial_sums_within_fp32_rounding(world_size):
    harness.run(world_size, _float_tolerance, world_size)


def _debug_log():
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("tpflow")
    logger.addHandler(handler)
    try:
        with tpf.config.override(debug=True):  # the switch turns the lines on
            _box_and_multiply()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.WARNING)
    return [r.getMessage() for r in records]


def _box_and_multiply():
    pl = tpf.placement("cpu", [0, 1])
    a = tpf.randn(64, 8, placement=pl, sbp=S0)
    b = tpf.randn(8, 4, placement=pl, sbp=S0)
    tpf.matmul(a, b)
    tpf.to_global(a, placement=tpf.placement("cpu", [1]), sbp=B)


def test_debug_log_names_signature_choice_and_routes():
    messages = harness.run(2, _debug_log)[0]
    text = "\n".join(messages)
    assert "has no signature" in text and "boxing to (sbp.split(dim=0),) x (sbp.broadcast,)" in text, text
    assert "redistribute to (sbp.broadcast,)" in text, text
    assert "gather on source, send blocks, slice on destination" in text, text


def _through_triton_kernels(world):
    """tpf.matmul's local products and their backward run tpflow's Triton kernel when asked."""
    with tpf.config.override(kernels="triton"):
        pl = tpf.placement("cpu", list(range(world)))
        a_ref, b_ref = ints((9, 41), 1), ints((41, 13), 2)
        return [f for f in (_check_product(pl, a_ref, b_ref, (S1,), (S0,), (P,)),
                            _check_product(pl, a_ref, b_ref, (S0,), (B,), (S0,))) if f]


@pytest.mark.parametrize("world_size", [1, 3])
def test_global_matmul_on_triton_kernels(world_size):
    pytest.importorskip("triton")
    for failures in harness.run(world_size, _through_triton_kernels, world_size):
        assert not failures, "\n".join(failures)
