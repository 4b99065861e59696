"""Named placements: a named DeviceMesh, sub-placements by name that are slices of the root mesh (as FSDP2 needs),
3-D placements (replicate x shard x tensor), and clear errors for names that cannot work."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor

import tpflow as tpf
from tests import harness

S0, S1, B = tpf.sbp.split(0), tpf.sbp.split(1), tpf.sbp.broadcast


def _named():
    rank = dist.get_rank()
    M = tpf.placement("cpu", [[0, 1], [2, 3]], names=("dp", "tp"))
    assert M.names == ("dp", "tp") and M.mesh.mesh_dim_names == ("dp", "tp") and M.axis("tp") == 1
    assert repr(M) == 'placement(type="cpu", ranks=[[0, 1], [2, 3]], names=("dp", "tp"))'
    row, column = [rank // 2 * 2, rank // 2 * 2 + 1], [rank % 2, rank % 2 + 2]
    tp, dp = M["tp"], M["dp"]
    assert (tp.ranks, tp.names, dp.ranks, dp.names) == (row, ("tp",), column, ("dp",))
    assert tp.mesh == M.mesh["tp"] and dp.mesh == M.mesh["dp"]  # slices of the root, as torch cuts them
    assert M["tp"] is tp and M["dp", "tp"] is M and tp["tp"] is tp
    assert repr(tp) == f'placement(type="cpu", ranks={row}, names=("tp",)) of {M!r}'
    again, unnamed = tpf.placement("cpu", [[0, 1], [2, 3]], names=("dp", "tp")), tpf.placement("cpu", [[0, 1], [2, 3]])
    assert again == M and again.mesh is M.mesh  # made again: the same mesh
    assert unnamed != M  # another mesh, as torch's meshes compare
    # global tensors on a slice, and a DTensor torch made on the slice of the mesh: the same placement
    torch.manual_seed(0)
    x = tpf.randn(4, 6, placement=tp, sbp=S1)
    torch.manual_seed(0)
    ref = torch.randn(4, 6)
    assert tpf.get_placement(x) == tp and torch.equal(tpf.to_local(x), ref[:, 3 * (rank % 2):3 * (rank % 2) + 3])
    torch_made = distribute_tensor(ref, M.mesh["dp"], [Shard(0)])
    assert tpf.get_placement(torch_made) == dp and tpf.get_sbp(torch_made) == (S0,)
    y = tpf.matmul(x, tpf.tensor(ref.T, placement=tp, sbp=S0))  # split(1) x split(0): partial sums
    torch.testing.assert_close(tpf.to_local(tpf.to_global(y, sbp=B)), ref @ ref.T)
    # 3-D: replicate x shard x tensor, sliced two axes at a time
    H = tpf.placement("cpu", [[[0, 1]], [[2, 3]]], names=("rep", "shard", "tp"))
    assert H.hierarchy == (2, 1, 2) and H.coordinate(3) == (1, 0, 1)
    assert H["rep", "shard"].ranks == [[rank % 2], [rank % 2 + 2]] and H["rep", "shard"].names == ("rep", "shard")
    assert H["tp"].ranks == row
    torch.manual_seed(0)
    z = tpf.randn(4, 6, placement=H, sbp=(B, S0, S1))
    assert torch.equal(tpf.to_local(tpf.to_global(z, sbp=(B, B, B))), ref)
    # the names that cannot work
    for names, words in ((("a", "a"), r"repeat \['a'\]: each axis needs its own name"),
                         (("a",), "2 axis\\(es\\) but 1 names"), (("a", ""), "non-empty strings")):
        with pytest.raises((ValueError, TypeError), match=words):
            tpf.placement("cpu", [[0, 1], [2, 3]], names=names)
    with pytest.raises(ValueError, match=r"has the axes \('dp', 'tp'\): no axis called 'pp'"):
        M["pp"]
    with pytest.raises(ValueError, match="has no names \\(give names= to tpf.placement\\)"):
        tpf.placement("cpu", [0, 1, 2, 3])["tp"]
    with pytest.raises(ValueError, match="name each axis once"):
        M["tp", "tp"]
    pair = tpf.placement("cpu", [0, 1], names=("tp",))
    if rank >= 2:
        with pytest.raises(ValueError, match=f"rank {rank} is outside .*only the placement's ranks can take one"):
            pair["tp"]
    with pytest.raises(ValueError, match="mix ints and lists"):
        tpf.placement("cpu", [[0, 1], 2])


def test_named_placements_slice_as_torch_meshes_do():
    harness.run(4, _named)
