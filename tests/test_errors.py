"""Bad input fails at once on every rank with a message that says what to change; never a hang."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import tpflow as tpf
from tests import harness
from tests.checks import S0, B


def _bad_input():
    rank = tpf.get_rank()
    p01 = tpf.placement("cpu", [0, 1])
    with pytest.raises(ValueError, match=r"include \[5\], outside this world of 4"):
        tpf.placement("cpu", [0, 5])
    with pytest.raises(ValueError, match="list a rank twice"):
        tpf.placement("cpu", [0, 1, 1])
    with pytest.raises(ValueError, match="must increase along every axis"):
        tpf.placement("cpu", [1, 0])
    with pytest.raises(ValueError, match="type must be one of"):
        tpf.placement("gpu", [0])
    with pytest.raises(TypeError, match="list of ints"):
        tpf.placement("cpu", "0,1")
    with pytest.raises(ValueError, match="rectangular"):
        tpf.placement("cpu", [[0, 1], [2]])
    with pytest.raises(ValueError, match=r"split\(dim=2\) is out of range for a 2-D tensor"):
        tpf.randn(4, 5, placement=p01, sbp=tpf.sbp.split(2))
    p2d = tpf.placement("cpu", [[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="for a 2-D placement: give a tuple of 2"):
        tpf.randn(4, 5, placement=p2d, sbp=S0)
    with pytest.raises(ValueError, match="2 SBP"):
        tpf.randn(4, 5, placement=p01, sbp=(S0, B))
    with pytest.raises(ValueError, match="2 SBP"):
        tpf.to_global(tpf.randn(4, 5, placement=p01, sbp=S0), sbp=(S0, B))
    with pytest.raises(ValueError, match="cannot keep the SBP .*: give sbp=, one per axis"):
        tpf.to_global(tpf.randn(4, 5, placement=p01, sbp=S0), placement=p2d)
    with pytest.raises(TypeError, match="placement must be a tpf.placement"):
        tpf.zeros(2, placement=[0, 1], sbp=B)

    x = tpf.randn(4, 5, placement=p01, sbp=S0)
    w = tpf.randn(5, 8, placement=tpf.placement("cpu", [2, 3]), sbp=B)
    with pytest.raises(ValueError, match="different placements.*to_global"):
        tpf.matmul(x, w)
    with pytest.raises(ValueError, match=r"inner sizes differ.*\(5 != 6\)"):
        tpf.matmul(x, tpf.randn(6, 8, placement=p01, sbp=B))
    with pytest.raises(TypeError, match="plain torch.Tensor: make it global"):
        tpf.matmul(x, torch.randn(5, 8))
    with pytest.raises(ValueError, match="multiplies a"):
        tpf.matmul(x, tpf.randn(5, placement=p01, sbp=B))
    with pytest.raises(TypeError, match="get_sbp takes a global tensor"):
        tpf.get_sbp(torch.ones(2))
    with pytest.raises(TypeError, match="needs both placement= and sbp="):
        tpf.to_global(torch.ones(2))

    # blocks that do not fit together: every rank raises the same error after one exchange
    with pytest.raises(ValueError,
                       match=r"ranks hold \{1: \(2, 6\)\}, but global shape \(4, 5\) needs \{1: \(2, 5\)\}"):
        tpf.to_global(torch.ones(2, 5 + rank % 2), placement=p01, sbp=S0)
    with pytest.raises(ValueError, match="torch.chunk sizes"):
        tpf.from_local(torch.ones(1 + 2 * (rank % 2), 5), placement=p01, sbp=S0)  # 1 + 3 rows: chunk gives 2 + 2
    with pytest.raises(ValueError, match="different dtypes"):
        tpf.from_local(torch.ones(2, dtype=torch.float64 if rank == 1 else torch.float32), placement=p01, sbp=B)
    if rank in p01:  # with shape= given there is no exchange: each member checks its own block
        with pytest.raises(ValueError, match=r"holds a block of shape \(3, 5\), but global shape \(4, 5\)"):
            tpf.from_local(torch.ones(3, 5), placement=p01, sbp=S0, shape=(4, 5))
    with pytest.raises(ValueError, match="gradient of a local tensor must have its shape"):
        tpf.from_local(torch.ones(2, 5), placement=p01, sbp=S0, grad_sbp=B)
    # the world still works after all of that
    return float(tpf.to_local(tpf.to_global(tpf.ones(4, placement=p01, sbp=S0), sbp=B)).sum())


def test_bad_input_raises_everywhere():
    results = harness.run(4, _bad_input)
    assert results[:2] == [4.0, 4.0]


def test_half_configured_environment_names_the_launcher():
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2"}
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    proc = subprocess.run([sys.executable, "-c", "import tpflow; tpflow.get_rank()"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert "python -m tpflow.launch" in proc.stderr
