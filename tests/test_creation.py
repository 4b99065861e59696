"""Creation: after the same seed, the logical value is exactly one device's, for every world
size and SBP, and every rank's generator stays in step with a single-device run."""

from __future__ import annotations

import pytest
import torch

import tpflow as tpf
from tests import harness
from tests.checks import P, logical, sbp_tuples


def _creation_matches_one_device(ranks):
    pl = tpf.placement("cpu", ranks)
    failures = []
    for sbps in sbp_tuples(pl.ndim):
        torch.manual_seed(1)
        made = {
            "randn": tpf.randn(5, 7, placement=pl, sbp=sbps),
            "rand": tpf.rand((5, 7), placement=pl, sbp=sbps, dtype=torch.float64),
            "zeros": tpf.zeros(5, 7, placement=pl, sbp=sbps),
            "ones": tpf.ones(5, 7, placement=pl, sbp=sbps, dtype=torch.float16),
            "full": tpf.full((5, 7), 3, placement=pl, sbp=sbps),
            "tensor": tpf.tensor([[1.0, 2.0, 3.0]] * 5, placement=pl, sbp=sbps, requires_grad=True),
        }
        after = torch.randn(3)  # the generator must have advanced exactly as on one device
        torch.manual_seed(1)
        want = {
            "randn": torch.randn(5, 7),
            "rand": torch.rand(5, 7, dtype=torch.float64),
            "zeros": torch.zeros(5, 7),
            "ones": torch.ones(5, 7, dtype=torch.float16),
            "full": torch.full((5, 7), 3),
            "tensor": torch.tensor([[1.0, 2.0, 3.0]] * 5),
        }
        if not torch.equal(after, torch.randn(3)):
            failures.append(f"{sbps}: generator out of step after creation")
        for name, t in made.items():
            if tpf.get_sbp(t) != sbps or t.dtype != want[name].dtype:
                failures.append(f"{name} {sbps}: layout {tpf.get_sbp(t)} dtype {t.dtype}")
            value = logical(t.detach()) if t.dtype != torch.float16 else logical(t.float()).half()
            if value is None or not torch.equal(value.to(want[name].dtype), want[name]):
                failures.append(f"{name} {sbps}: wrong value")
        if not made["tensor"].requires_grad or not made["tensor"].is_leaf:
            failures.append("tensor(requires_grad=True) is not a leaf that requires grad")
    return failures


@pytest.mark.parametrize("ranks", [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [1, 3], [[0, 1], [2, 3]]],
                         ids=["1", "2", "3", "4", "sub", "2x2"])
def test_creation_matches_one_device(ranks):
    for failures in harness.run(4 if ranks not in ([0], [0, 1]) else len(ranks), _creation_matches_one_device, ranks):
        assert not failures, "\n".join(failures)


def _partial_sum_blocks():
    pl = tpf.placement("cpu", [0, 1, 2])
    ones = tpf.ones(2, 2, placement=pl, sbp=P)
    want = torch.ones(2, 2) if tpf.get_rank() == 0 else torch.zeros(2, 2)  # the value on the first rank
    assert torch.equal(ones.to_local(), want)


def test_partial_sum_creation_puts_value_on_first_rank():
    harness.run(3, _partial_sum_blocks)
