"""SBP arithmetic, without processes: chunk sizes, signatures, conversion costs, validation."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import tpflow as tpf
from tpflow.global_tensor.signatures import conversion_bytes, infer_matmul, matmul_out_sbp
from tpflow.sbp import chunk_bounds, local_region, normalize

S0, S1, B, P = tpf.sbp.split(0), tpf.sbp.split(1), tpf.sbp.broadcast, tpf.sbp.partial_sum


@pytest.mark.parametrize("size", range(13))
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 5])
def test_chunk_bounds_are_torch_chunk(size, parts):
    chunks = torch.arange(size).chunk(parts)
    for i, (start, end) in enumerate(chunk_bounds(size, parts)):
        want = chunks[i].tolist() if i < len(chunks) else []
        assert list(range(start, end)) == want


def test_nested_split_regions():
    # 5 rows split over axis 0 (3, 2), then again over axis 1: DTensor's nested order
    regions = [local_region((5, 7), (S0, S0), (2, 2), c) for c in [(0, 0), (0, 1), (1, 0), (1, 1)]]
    assert [r[1][0] for r in regions] == [2, 1, 1, 1]
    assert [r[0][0] for r in regions] == [0, 2, 3, 4]
    assert local_region((5, 7), (B, P), (2, 2), (1, 1)) == ((0, 0), (5, 7))


def test_reprs_and_dtensor_round_trip():
    assert repr(S0) == "sbp.split(dim=0)" and repr(B) == "sbp.broadcast" and repr(P) == "sbp.partial_sum"
    assert tpf.sbp.to_dtensor((S1, B, P)) == [Shard(1), Replicate(), Partial("sum")]
    assert tpf.sbp.from_dtensor([Shard(1), Replicate(), Partial("sum")]) == (S1, B, P)
    assert hash(tpf.sbp.split(0)) == hash(S0) and tpf.sbp.split(0) == S0


def test_normalize_errors_say_what_to_change():
    assert normalize(tpf.sbp.split(-1), 1, 3) == (tpf.sbp.split(2),)
    with pytest.raises(ValueError, match="out of range for a 2-D tensor"):
        normalize(tpf.sbp.split(2), 1, 2)
    with pytest.raises(ValueError, match="give a tuple of 2 SBPs"):
        normalize(S0, 2, 2)
    with pytest.raises(ValueError, match="give one SBP per placement axis"):
        normalize((S0, B), 1, 2)
    with pytest.raises(TypeError, match="tpf.sbp.split"):
        normalize("split(0)", 1, 2)
    with pytest.raises(TypeError, match="int dim"):
        tpf.sbp.split(1.5)


def test_matmul_signature_table():
    assert matmul_out_sbp((S0,), (B,), 2, 2) == (S0,)
    assert matmul_out_sbp((B,), (S1,), 2, 2) == (S1,)
    assert matmul_out_sbp((S1,), (S0,), 2, 2) == (P,)
    assert matmul_out_sbp((B,), (B,), 2, 2) == (B,)
    assert matmul_out_sbp((P,), (B,), 2, 2) == (P,)
    assert matmul_out_sbp((B,), (P,), 2, 2) == (P,)
    assert matmul_out_sbp((S0, B), (B, S1), 2, 2) == (S0, S1)  # per axis on 2-D placements
    assert matmul_out_sbp((S0,), (S0,), 2, 2) is None
    assert matmul_out_sbp((P,), (P,), 2, 2) is None
    assert matmul_out_sbp((tpf.sbp.split(2),), (S0,), 3, 2) == (P,)  # batched activations
    assert matmul_out_sbp((S0,), (S0,), 3, 3) == (S0,)  # batch dim split on both


def test_illegal_pairs_take_the_cheapest_signature():
    big, small = 1 << 20, 1 << 10
    # S0 x S0: gathering the small weight beats moving the big activations
    assert infer_matmul((S0,), (S0,), 2, 2, big, small, (4,)) == ((S0,), (B,), (S0,))
    # ... and when the weight is the big one, re-split the activations (all-to-all) instead
    assert infer_matmul((S0,), (S0,), 2, 2, small, big, (4,)) == ((S1,), (S0,), (P,))
    # P x P: reduce the smaller operand
    assert infer_matmul((P,), (P,), 2, 2, big, small, (4,)) == ((P,), (B,), (P,))
    # legal pairs are kept as they are
    assert infer_matmul((S1,), (S0,), 2, 2, big, big, (4,)) == ((S1,), (S0,), (P,))


def test_conversion_bytes():
    n = 1000
    assert conversion_bytes(S0, B, n, 4) == 750  # all-gather
    assert conversion_bytes(P, B, n, 4) == 1500  # all-reduce
    assert conversion_bytes(P, S0, n, 4) == 750  # reduce-scatter
    assert conversion_bytes(S0, S1, n, 4) == 750 / 4  # all-to-all
    assert conversion_bytes(B, S0, n, 4) == conversion_bytes(B, P, n, 4) == conversion_bytes(S0, P, n, 4) == 0
