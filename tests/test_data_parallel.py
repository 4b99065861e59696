"""Data parallelism by SBP (seed 002), its composition with DistributedDataParallel and DistributedSampler, and
data x tensor parallel training on a 2-D placement: several optimizer steps against one device on the
whole batch, parameters compared after every step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import tpflow as tpf
from tests import harness
from tpflow.sbp import chunk_bounds

B, S0 = tpf.sbp.broadcast, tpf.sbp.split(0)


def _mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 3))


def _data(rows, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 6, generator=g), torch.randint(0, 3, (rows,), generator=g)


def _assert_same_parameters(model, ref, step):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        whole = p.full_tensor() if isinstance(p, torch.distributed.tensor.DTensor) else p
        torch.testing.assert_close(whole, q, msg=f"{name} after step {step}")


def _step_and_compare(loss, opt, model, ref, opt_ref, x, y, step):
    """One optimizer step of the global model (its ``loss`` already computed) and of the one-device ``ref`` on
    the whole batch, then the loss and every parameter compared."""
    ref_loss = F.cross_entropy(ref(x), y)
    for optimizer, value in ((opt, loss), (opt_ref, ref_loss)):
        optimizer.zero_grad()
        value.backward()
        optimizer.step()
    torch.testing.assert_close(loss.full_tensor(), ref_loss.detach())
    _assert_same_parameters(model, ref, step)


def _sbp_data_parallel(rows, optimizer):
    """The seed's recipe: the model broadcast, each rank's rows its split(0) block of one global batch."""
    world, rank = dist.get_world_size(), dist.get_rank()
    P = tpf.placement("cpu", list(range(world)))
    ref = _mlp(0)
    model = tpf.to_global(copy.deepcopy(ref), placement=P, sbp=B)
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
            "adam": lambda ps: torch.optim.Adam(ps, lr=0.01)}[optimizer]
    opt, opt_ref = make(model.parameters()), make(ref.parameters())
    for step in range(3):
        x, y = _data(rows, seed=step)
        mine = slice(*chunk_bounds(rows, world)[rank])  # each rank reads only its own rows
        gx = tpf.to_global(x[mine], placement=P, sbp=S0)
        gy = tpf.to_global(y[mine], placement=P, sbp=S0)
        loss = F.cross_entropy(tpf.to_global(model(gx), sbp=B), tpf.to_global(gy, sbp=B))
        _step_and_compare(loss, opt, model, ref, opt_ref, x, y, step)
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("rows", [12, 7], ids=["even", "uneven"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_data_parallel_by_sbp_trains_like_one_device(world, rows, optimizer):
    assert all(harness.run(world, _sbp_data_parallel, rows, optimizer))


def _partial_gradients_in_one_all_reduce(rows, bucket_bytes):
    """After a data-parallel backward every gradient is a partial sum; the optimizer's pre-step hook sums them all
    with one all-reduce per bucket (2(W-1) ring messages each), and they equal one device's."""
    world, rank = dist.get_world_size(), dist.get_rank()
    P = tpf.placement("cpu", list(range(world)))
    ref = _mlp(0)
    model = tpf.to_global(copy.deepcopy(ref), placement=P, sbp=B)
    x, y = _data(rows)
    mine = slice(*chunk_bounds(rows, world)[rank])
    loss = F.cross_entropy(tpf.to_global(model(tpf.to_global(x[mine], placement=P, sbp=S0)), sbp=B),
                           tpf.to_global(y, placement=P, sbp=B))
    loss.backward()
    F.cross_entropy(ref(x), y).backward()
    assert all(tpf.get_sbp(p.grad) == (tpf.sbp.partial_sum,) for p in model.parameters())
    tpf.comm.stats.reset()
    tpf.gradients.reduce_partial_gradients(model.parameters(), bucket_bytes)
    buckets = 1 if bucket_bytes == tpf.config.get("grad_bucket_bytes") else len(list(model.parameters()))
    assert tpf.comm.stats.messages_sent == 2 * (world - 1) * buckets
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert tpf.get_sbp(p.grad) == (B,)
        torch.testing.assert_close(p.grad.to_local(), q.grad, msg=name)
    return True


@pytest.mark.parametrize("world, bucket_bytes", [(2, None), (3, None), (2, 1)], ids=["2", "3", "2, a bucket each"])
def test_partial_gradients_are_summed_in_one_all_reduce(world, bucket_bytes):
    bucket_bytes = bucket_bytes or tpf.config.get("grad_bucket_bytes")
    assert all(harness.run(world, _partial_gradients_in_one_all_reduce, 7, bucket_bytes))


def _ddp(rows, on_axis):
    """DistributedDataParallel and DistributedSampler in a tpflow job: over the world, or over axis 0 of a 2x2
    placement (the replicas that hold the same data-parallel coordinate's rows)."""
    rank = dist.get_rank()
    if on_axis:
        P = tpf.placement("cpu", [[0, 1], [2, 3]])
        group, replicas, replica = P.mesh.get_group(0), P.hierarchy[0], P.coordinate()[0]
    else:
        group, replicas, replica = None, dist.get_world_size(), rank
    ref = _mlp(0)
    model = DistributedDataParallel(copy.deepcopy(ref), process_group=group)
    x, y = _data(rows)
    sampler = DistributedSampler(TensorDataset(x, y), num_replicas=replicas, rank=replica, shuffle=True, seed=5)
    loader = DataLoader(TensorDataset(x, y), batch_size=rows // replicas, sampler=sampler)
    opt, opt_ref = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for step, (bx, by) in enumerate(loader):
            everyone = []  # the one-device batch: every replica's rows this step, as its sampler deals them
            for r in range(replicas):
                theirs = DistributedSampler(TensorDataset(x, y), num_replicas=replicas, rank=r, shuffle=True, seed=5)
                theirs.set_epoch(epoch)
                everyone.append(list(theirs)[step * (rows // replicas):(step + 1) * (rows // replicas)])
            assert torch.equal(bx, x[everyone[replica]])
            opt.zero_grad()
            F.cross_entropy(model(bx), by).backward()  # DDP averages the replicas' gradients
            opt.step()
            opt_ref.zero_grad()
            # one device: the mean of the replicas' mean losses (equal batches) is the whole batch's mean
            rows_seen = [i for rows in everyone for i in rows]
            F.cross_entropy(ref(x[rows_seen]), y[rows_seen]).backward()
            opt_ref.step()
            _assert_same_parameters(model.module, ref, (epoch, step))
    return True


@pytest.mark.parametrize("world, on_axis", [(2, False), (3, False), (4, True)],
                         ids=["world2", "world3", "axis0-of-2x2"])
def test_ddp_and_distributed_sampler_compose(world, on_axis):
    assert all(harness.run(world, _ddp, 12, on_axis))


def _hybrid_training(sequence_parallel):
    """One model, one optimizer: data parallel over axis 0 of [[0, 1], [2, 3]], tensor parallel over axis 1."""
    P2 = tpf.placement("cpu", [[0, 1], [2, 3]])
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6), nn.LayerNorm(6), nn.Linear(6, 3))
    model = tpf.parallelize(copy.deepcopy(ref), placement=P2, plan={
        "0": tpf.ColumnParallel(sequence_parallel=sequence_parallel),
        "2": tpf.RowParallel(sequence_parallel=sequence_parallel)})
    model = tpf.to_global(model, placement=P2)  # the rest (LayerNorm, the head) broadcast: data parallel only
    opt, opt_ref = torch.optim.Adam(model.parameters(), lr=0.01), torch.optim.Adam(ref.parameters(), lr=0.01)
    for step in range(3):
        x, y = _data(10, seed=step)
        gx = tpf.tensor(x, placement=P2, sbp=(S0, S0 if sequence_parallel else B))
        out = tpf.to_global(model(gx), sbp=(B, B))
        loss = F.cross_entropy(out, tpf.tensor(y, placement=P2, sbp=(B, B)))
        _step_and_compare(loss, opt, model, ref, opt_ref, x, y, step)
    return True


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_data_x_tensor_parallel_training_on_2d_placement(sequence_parallel):
    assert all(harness.run(4, _hybrid_training, sequence_parallel))
