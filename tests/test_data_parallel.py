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
    """With ``grad_sync="step"``, after a data-parallel backward every gradient is a partial sum; the optimizer's
    pre-step hook sums them all with one all-reduce per bucket (2(W-1) ring messages each), and they equal one
    device's."""
    with tpf.config.override(grad_sync="step"):
        return _summed_at_step(rows, bucket_bytes)


def _summed_at_step(rows, bucket_bytes):
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


def _sums_during_backward(rows, bucket_bytes, sync):
    """With ``grad_sync="backward"`` (CUDA's default) the backward all-reduces its partial gradients, a bucket at a
    time, the later layers' before autograd reaches the first layer (from the second backward, which has the buckets'
    layout); with ``"end"`` (CPU's) every bucket once it ends. Both leave them summed; the optimizer's pre-step hook
    sends nothing. Clipping in place, micro-batches with the
    first under ``deferred()``, and a zero_grad that keeps the gradients' storage all train like one device."""
    world, rank = dist.get_world_size(), dist.get_rank()
    P = tpf.placement("cpu", list(range(world)))
    ref = _mlp(0)
    model = tpf.to_global(copy.deepcopy(ref), placement=P, sbp=B)
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))
    sent_before_first_layer = []
    model[0].register_full_backward_pre_hook(lambda *_: sent_before_first_layer.append(tpf.comm.stats.messages_sent))
    x, y = _data(rows)
    halves = [slice(0, rows // 2), slice(rows // 2, rows)]

    def loss_of(rows_):
        xs, ys = x[rows_], y[rows_]
        part = slice(*chunk_bounds(len(ys), world)[rank])
        out = tpf.to_global(model(tpf.to_global(xs[part], placement=P, sbp=S0)), sbp=B)
        return F.cross_entropy(out, tpf.to_global(ys, placement=P, sbp=B), reduction="sum") / rows

    buckets = 1 if bucket_bytes > 1 << 20 else 6
    with tpf.config.override(grad_bucket_bytes=bucket_bytes, grad_sync=sync):
        for step in range(5):
            opt.zero_grad(set_to_none=step != 4)  # step 4: the summed gradients zeroed in place, then added to
            opt_ref.zero_grad()
            tpf.comm.stats.reset()
            sent_before_first_layer.clear()
            if step != 3:
                loss_of(slice(0, rows)).backward()
                if step < 2:
                    assert tpf.comm.stats.messages_sent == 2 * (world - 1) * buckets
                if step == 1 and bucket_bytes == 1:  # the output layer's bucket went before the first layer's backward
                    assert 0 < sent_before_first_layer[0] < tpf.comm.stats.messages_sent if sync == "backward" \
                        else sent_before_first_layer[0] == 0
            else:  # two micro-batches: the first one's backward leaves its partial sums to the last one's
                with tpf.gradients.deferred():
                    loss_of(halves[0]).backward()
                assert tpf.comm.stats.messages_sent == 0
                assert all(tpf.get_sbp(p.grad) == (tpf.sbp.partial_sum,) for p in model.parameters())
                loss_of(halves[1]).backward()
                assert tpf.comm.stats.messages_sent == 2 * (world - 1) * buckets
            assert all(tpf.get_sbp(p.grad) == (B,) for p in model.parameters())
            sent = tpf.comm.stats.messages_sent
            if step == 2:  # clipping that bites, in place on the summed gradients
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            tpf.gradients.reduce_partial_gradients(model.parameters())
            assert tpf.comm.stats.messages_sent == sent, "the pre-step hook found every sum made"
            opt.step()
            F.cross_entropy(ref(x), y).backward()
            if step == 2:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            opt_ref.step()
            _assert_same_parameters(model, ref, step)
    return True


@pytest.mark.parametrize("world, bucket_bytes, sync", [(2, 1, "backward"), (3, 4 << 20, "backward"), (2, 1, "end")],
                         ids=["2, a bucket each", "3, one bucket", "2, at the end"])
def test_partial_gradients_are_summed_by_the_backward(world, bucket_bytes, sync):
    assert all(harness.run(world, _sums_during_backward, 9, bucket_bytes, sync))


class _Reads(nn.Module):
    """Calls its layer three times, the first without gradients, and reads another layer's weight without calling it
    (as ``nn.MultiheadAttention`` its ``out_proj``)."""

    def __init__(self):
        super().__init__()
        self.layer, self.side = nn.Linear(6, 6), nn.Linear(6, 6, bias=False)

    def forward(self, x):
        with torch.no_grad():
            gate = torch.sigmoid(self.layer(x))
        return (self.layer(torch.tanh(self.layer(x))) + F.linear(x, self.side.weight)) * gate


def _plain_stage_reads_blocks_in_place(rows, sync):
    """A plain module in a data-parallel stage (split(0) rows, uneven over 2, 3 and 4 ranks) reads its parameters'
    blocks in their places: a weight tied across two layers once, a layer called with gradients after a call
    without, a weight read without its layer's call; summed in a bucket each, under ``grad_sync="backward"`` the
    later layers' (from the second step) before the backward reaches the first layer, under ``"end"`` all after it.
    3 SGD steps equal one device's, and the module holds its global parameters again after each call."""
    world = dist.get_world_size()
    P = tpf.placement("cpu", list(range(world)))
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), _Reads(), nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 6),
                        nn.Tanh(), nn.Linear(6, 6))
    ref[7].weight = ref[0].weight  # tied: read in two runs
    st = tpf.stage(copy.deepcopy(ref), stage_id=0, placement=P, sbp=S0)
    sent_before_first_layer = []
    st.module[0].register_full_backward_pre_hook(lambda *_: sent_before_first_layer.append(
        tpf.comm.stats.messages_sent))
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (st, ref))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(rows, 6, generator=g), torch.randn(rows, 6, generator=g)
    target = tpf.to_global(y, placement=P, sbp=B)
    with tpf.config.override(grad_bucket_bytes=1, grad_sync=sync):
        for step in range(3):
            out = st(x)
            assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in st.module.parameters())
            tpf.comm.stats.reset()
            sent_before_first_layer.clear()
            (tpf.to_global(out, sbp=B) - target).square().sum().backward()
            if step > 0 and world > 1:
                assert 0 < sent_before_first_layer[0] < tpf.comm.stats.messages_sent if sync == "backward" \
                    else sent_before_first_layer[0] == 0
            assert all(tpf.get_sbp(p.grad) == (B,) for p in st.parameters())
            (ref(x) - y).square().sum().backward()
            for o in (opt, opt_ref):
                o.step()
                o.zero_grad()
            _assert_same_parameters(st.module, ref, step)
    return True


@pytest.mark.parametrize("world, sync", [(1, "backward"), (2, "backward"), (3, "end"), (4, "backward")])
def test_a_plain_data_parallel_stage_reads_its_blocks_in_place(world, sync):
    assert all(harness.run(world, _plain_stage_reads_blocks_in_place, 7, sync))


def _models_in_turn():
    """Two models whose backwards take turns (a GAN's generator and critic) keep a buckets' layout each: only their
    first backwards lay them out (each a collective check), and both train like one device."""
    from tpflow.global_tensor import reducer

    world, rank = dist.get_world_size(), dist.get_rank()
    P = tpf.placement("cpu", list(range(world)))
    refs = [_mlp(0), _mlp(1)]
    models = [tpf.to_global(copy.deepcopy(ref), placement=P, sbp=B) for ref in refs]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in [*models, *refs]]
    x, y = _data(9)
    part = slice(*chunk_bounds(len(y), world)[rank])
    laid_out, own = [], reducer._agreed_order
    reducer._agreed_order = lambda *args: laid_out.append(1) or own(*args)
    try:
        for step in range(3):
            for model, ref, opt, opt_ref in zip(models, refs, opts[:2], opts[2:]):
                out = tpf.to_global(model(tpf.to_global(x[part], placement=P, sbp=S0)), sbp=B)
                (F.cross_entropy(out, tpf.to_global(y, placement=P, sbp=B), reduction="sum") / len(y)).backward()
                F.cross_entropy(ref(x), y).backward()
                for o in (opt, opt_ref):
                    o.step()
                    o.zero_grad()
                _assert_same_parameters(model, ref, step)
    finally:
        reducer._agreed_order = own
    return len(laid_out) == 2


def test_models_trained_in_turn_keep_their_buckets_layouts():
    assert all(harness.run(2, _models_in_turn))


def _different_parameters():
    world, rank = dist.get_world_size(), dist.get_rank()
    P = tpf.placement("cpu", list(range(world)))
    model = tpf.to_global(_mlp(0), placement=P, sbp=B)
    h = model[0](tpf.to_global(torch.ones(2, 6), placement=P, sbp=S0))
    out = model[2](h) if rank == 0 else h  # rank 1 leaves a layer out of its graph: partial gradients on rank 0
    with pytest.raises(ValueError, match="the ranks disagree on gradients summed in the backward"):
        out.sum().backward()
    return True


def test_ranks_that_compute_other_gradients_fail_together():
    assert all(harness.run(2, _different_parameters))


def _dropped_model_is_freed():
    import gc
    import weakref

    world, rank = dist.get_world_size(), dist.get_rank()
    P = tpf.placement("cpu", list(range(world)))
    model = tpf.to_global(_mlp(0), placement=P, sbp=B)
    x = tpf.to_global(torch.ones(3, 6) * (rank + 1), placement=P, sbp=S0)
    for _ in range(2):  # the second backward runs on the buckets' layout
        model(x).sum().backward()
    weight = weakref.ref(model[0].weight)
    del model
    gc.collect()
    return weight() is None


def test_the_buckets_layout_does_not_keep_a_dropped_model_alive():
    assert all(harness.run(2, _dropped_model_is_freed))
