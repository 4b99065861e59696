"""tpf.stage and tpf.Pipeline against one device on the whole batch: GPipe, 1F1B, ZB-H1 and interleaved 1F1B, 1-4
rank sets, stages of one and of several ranks (data parallel, tensor parallel, the seed's global-tensor modules),
uneven micro-batches, means over targets that leave some out (ignore_index, a micro-batch with none); two optimizer
steps, so the loss and every gradient are checked before and after an update. Mistakes fail on every rank at once
(never a hang)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import tpflow as tpf
from tests import harness
from tests.checks import within
from tests.models import BackwardFails

B, S0, S1 = tpf.sbp.broadcast, tpf.sbp.split(0), tpf.sbp.split(1)


def _on(*ranks):
    return tpf.placement("cpu", list(ranks))


def _chain(dims, seed):
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in itertools.pairwise(dims)]


def _batch(rows, fin, fout, seed=1, classes=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, fin, generator=g)
    y = torch.randint(0, classes, (rows,), generator=g) if classes else torch.randn(rows, fout, generator=g)
    return x, y


def _masked(y, rows, value=-100):
    """Class targets with ``rows`` left out (``value``): micro-batches of different numbers of labelled rows, one
    of them without any, so that a mean weighted by rows would not be one device's."""
    y = y.clone()
    y[list(rows)] = value
    return y


def _train_and_compare(pipe, ref, x, y, loss_fn, steps=2):
    """``steps`` SGD steps of the pipeline and of the one-device model; loss and gradients compared each step, and
    every parameter after the last. Returns how many parameter gradients this rank checked and whether it saw the
    loss."""
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    checked, saw_loss = 0, False
    for _ in range(steps):
        opt.zero_grad()
        opt_ref.zero_grad()
        loss = pipe.step(x, y)
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        if loss is not None:
            torch.testing.assert_close(loss, ref_loss.detach(), msg="loss")
            saw_loss = True
        for (name, p), q in zip(pipe.named_parameters(), ref.parameters()):
            assert p.shape == q.shape, name
            if dist.get_rank() in tpf.get_placement(p):
                torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)
                checked += 1
        opt.step()
        opt_ref.step()
    for (name, p), q in zip(pipe.named_parameters(), ref.parameters()):  # and after the last optimizer step
        if dist.get_rank() in tpf.get_placement(p):
            torch.testing.assert_close(p.full_tensor(), q.detach(), msg=name)
    return checked, saw_loss


def _one_rank_stages(schedule, micro_batches, rows):
    p = dist.get_world_size()
    dims = [5, 7, 6, 4, 3][:p + 1]
    blocks = _chain(dims, seed=0)
    ref = nn.Sequential(*copy.deepcopy(blocks))
    stages = [tpf.stage(b, stage_id=i, placement=_on(i)) for i, b in enumerate(blocks)]
    pipe = tpf.Pipeline(stages, micro_batches=micro_batches, schedule=schedule, loss_fn=F.mse_loss)
    x, y = _batch(rows, dims[0], dims[-1])
    return _train_and_compare(pipe, ref, x, y, F.mse_loss)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("extra, rows", [(0, 8), (2, 11)], ids=["even", "uneven"])
def test_one_rank_stages_match_one_device(world, schedule, extra, rows):
    results = harness.run(world, _one_rank_stages, schedule, world + extra, rows)
    assert all(checked == 4 for checked, _ in results)  # every rank holds one stage: a weight and a bias, 2 steps
    assert [saw for _, saw in results] == [False] * (world - 1) + [True]


def _interleaved_stages(chunks, micro_batches, rows):
    """p rank sets of one rank, each holding ``chunks`` stages: rank r runs stages r, r + p, ..."""
    p = dist.get_world_size()
    dims = [5, 7, 6, 4, 3, 5, 6, 2, 4][:p * chunks + 1]
    blocks = _chain(dims, seed=0)
    ref = nn.Sequential(*copy.deepcopy(blocks))
    stages = [tpf.stage(b, stage_id=k, placement=_on(k % p)) for k, b in enumerate(blocks)]
    pipe = tpf.Pipeline(stages, micro_batches=micro_batches, schedule="interleaved", loss_fn=F.mse_loss)
    assert pipe.table == tpf.pipeline.schedule.build_interleaved(p, chunks, micro_batches)
    x, y = _batch(rows, dims[0], dims[-1])
    return _train_and_compare(pipe, ref, x, y, F.mse_loss)


@pytest.mark.parametrize("world, chunks, micro_batches, rows", [(2, 2, 4, 8), (2, 3, 2, 7), (4, 2, 8, 13),
                                                                 (3, 2, 6, 6)])
def test_interleaved_stages_match_one_device(world, chunks, micro_batches, rows):
    results = harness.run(world, _interleaved_stages, chunks, micro_batches, rows)
    assert all(checked == 4 * chunks for checked, _ in results)  # a weight and a bias per stage, 2 steps
    assert [saw for _, saw in results] == [False] * (world - 1) + [True]


def _hf_style_loss(out, t, num_items_in_batch):
    """Hugging Face's convention: the micro-batch's sum over the whole batch's items (targets other than -100)."""
    return F.cross_entropy(out, t, reduction="sum") / num_items_in_batch


def _summed_loss_module():
    """A torch loss module's own reduction: a summed loss is not scaled down by the micro-batches. Then, over the same
    stages, a loss that takes num_items_in_batch: handed the count of the whole batch's targets other than -100.
    The reduction and ignore_index a Pipeline is given must agree with the loss's own."""
    dims = [5, 7, 3]
    blocks = _chain(dims, seed=0)
    ref = nn.Sequential(*copy.deepcopy(blocks))
    stages = [tpf.stage(b, stage_id=i, placement=_on(i)) for i, b in enumerate(blocks)]
    loss_fn = nn.MSELoss(reduction="sum")
    with pytest.raises(ValueError, match="loss_reduction='mean', but loss_fn MSELoss has reduction='sum'"):
        tpf.Pipeline(stages, micro_batches=4, loss_fn=loss_fn, loss_reduction="mean")
    with pytest.raises(ValueError, match=r"MSELoss\(reduction='none'\) must return a scalar"):
        tpf.Pipeline(stages, micro_batches=4, loss_fn=nn.MSELoss(reduction="none"))
    with pytest.raises(ValueError, match="loss_fn CrossEntropyLoss has ignore_index=-100: leave ignore_index out"):
        tpf.Pipeline(stages, micro_batches=4, loss_fn=nn.CrossEntropyLoss(), ignore_index=-1)
    with pytest.raises(ValueError, match=r"cross_entropy\(output, target\) leaves out -100"):
        tpf.Pipeline(stages, micro_batches=4, loss_fn=F.cross_entropy, ignore_index=0)
    with pytest.raises(ValueError, match="loss_fn takes num_items_in_batch"):
        tpf.Pipeline(stages, micro_batches=4, loss_fn=_hf_style_loss, loss_reduction="sum")
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        tpf.Pipeline(stages, micro_batches=4, loss_fn=_hf_style_loss, ignore_index=-1.0)

    def counting(out, t, num_items_in_batch):
        return _hf_style_loss(out, t, num_items_in_batch)
    counting.num_items = lambda t: (t != -100).sum()
    with pytest.raises(ValueError, match="loss_fn counts its own items"):
        tpf.Pipeline(stages, micro_batches=4, loss_fn=counting, ignore_index=-1)
    pipe = tpf.Pipeline(stages, micro_batches=4, loss_fn=loss_fn)
    assert pipe.loss_reduction == "sum" and pipe.ignore_index is None
    assert tpf.Pipeline(stages, micro_batches=4, loss_fn=F.cross_entropy).ignore_index == -100
    x, y = _batch(10, dims[0], dims[-1])
    checked, saw = _train_and_compare(pipe, ref, x, y, loss_fn)
    pipe = tpf.Pipeline(stages, micro_batches=4, loss_fn=_hf_style_loss)
    assert pipe.loss_reduction == "mean" and pipe.ignore_index == -100
    _, classes = _batch(10, dims[0], dims[-1], classes=3)
    classes = _masked(classes, [0, 3, 4, 5, 8])  # micro-batches of 3, 3, 2, 2 rows: 2, 0, 2, 1 labelled
    more, _ = _train_and_compare(pipe, ref, x, classes, F.cross_entropy)
    return checked + more, saw


def test_loss_module_gives_its_reduction():
    assert all(checked == 8 for checked, _ in harness.run(2, _summed_loss_module))


def _clipped(norm_type):
    """tpf.clip_grad_norm_ over stages on different ranks (one tensor-parallel): torch's norm and gradients."""
    torch.manual_seed(0)
    first, second = nn.Sequential(nn.Linear(6, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 10), nn.ReLU(),
                                                                              nn.Linear(10, 4))
    ref = nn.Sequential(copy.deepcopy(first), copy.deepcopy(second))
    second = tpf.parallelize(second, placement=_on(1, 2), plan={"0": "column", "2": "row"})
    stages = [tpf.stage(first, stage_id=0, placement=_on(0)), tpf.stage(second, stage_id=1, placement=_on(1, 2))]
    pipe = tpf.Pipeline(stages, micro_batches=3, loss_fn=F.cross_entropy)
    x, y = _batch(9, 6, 4, classes=4)
    pipe.step(x, y)
    F.cross_entropy(ref(x), y).backward()
    norm = tpf.clip_grad_norm_(pipe.parameters(), 0.05, norm_type=norm_type)
    norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type=norm_type)
    assert norm_ref > 0.05, "clipping should bite"
    torch.testing.assert_close(norm, norm_ref)
    for (name, p), q in zip(pipe.named_parameters(), ref.parameters()):
        if dist.get_rank() in tpf.get_placement(p):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_over_stages(norm_type):
    harness.run(3, _clipped, norm_type)


def _data_then_tensor_parallel(schedule):
    """Stage 0 data parallel on ranks 0-1 (input split(0)), stage 1 tensor parallel on ranks 2-3."""
    torch.manual_seed(0)
    first, second = nn.Sequential(nn.Linear(6, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 10), nn.ReLU(),
                                                                              nn.Linear(10, 4))
    ref = nn.Sequential(copy.deepcopy(first), copy.deepcopy(second))
    second = tpf.parallelize(second, placement=_on(2, 3), plan={"0": tpf.ColumnParallel(), "2": tpf.RowParallel()})
    stages = [tpf.stage(first, stage_id=0, placement=_on(0, 1), sbp=S0),
              tpf.stage(second, stage_id=1, placement=_on(2, 3), sbp=B)]
    pipe = tpf.Pipeline(stages, micro_batches=3, schedule=schedule, loss_fn=F.cross_entropy)
    x, y = _batch(11, 6, 4, classes=4)
    y = _masked(y, [0, 2, 4, 5, 6, 7, 9])  # F.cross_entropy leaves out -100: rows 4-7 (micro-batch 1) all of them
    return _train_and_compare(pipe, ref, x, y, F.cross_entropy)


class _SeesLocalRows(nn.Module):
    """A plain module in a stage runs on the rank's own rows, not on a global tensor."""

    def forward(self, x):
        assert not isinstance(x, DTensor) and x.shape[0] <= 1 + 9 // 4 // 3, type(x)
        return x


def _one_rank_then_data_parallel(schedule):
    """Stage 0 on rank 0, stage 1 data parallel over ranks 1-3 with uneven (and empty) blocks."""
    blocks = _chain([5, 6, 3], seed=2)
    ref = nn.Sequential(*copy.deepcopy(blocks))
    stages = [tpf.stage(blocks[0], stage_id=0, placement=_on(0)),
              tpf.stage(nn.Sequential(_SeesLocalRows(), *blocks[1]), stage_id=1, placement=_on(1, 2, 3), sbp=S0)]
    pipe = tpf.Pipeline(stages, micro_batches=4, schedule=schedule, loss_fn=F.mse_loss)
    x, y = _batch(9, 5, 3)  # micro-batches of 3, 2, 2 and 2 rows over 3 ranks
    return _train_and_compare(pipe, ref, x, y, F.mse_loss)


class StageModule(nn.Module):
    """The seed's stage: a weight created as a global tensor, applied with tpf.matmul."""

    def __init__(self, in_dims, out_dims, placement, sbp):
        super().__init__()
        self.w = nn.Parameter(tpf.randn(in_dims, out_dims, placement=placement, sbp=sbp))

    def forward(self, x):
        return tpf.matmul(x, self.w)


class _Matmul(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = nn.Parameter(w)

    def forward(self, x):
        return x @ self.w


def _seed_module_model(schedule):
    """The seed's 4-rank ModuleModel as a two-stage pipeline: data parallel on 0-1, model parallel (w split(1))
    on 2-3, the stage-0 output gathered onto 2-3 on entry."""
    torch.manual_seed(0)
    m0 = StageModule(5, 8, _on(0, 1), B)
    m1 = StageModule(8, 3, _on(2, 3), S1)
    torch.manual_seed(0)
    ref = nn.Sequential(_Matmul(torch.randn(5, 8)), _Matmul(torch.randn(8, 3)))
    stages = [tpf.stage(m0, stage_id=0, placement=_on(0, 1), sbp=S0), tpf.stage(m1, stage_id=1, placement=_on(2, 3),
                                                                                sbp=B)]
    assert tpf.get_sbp(m1.w) == (S1,), "a global parameter keeps its SBP in a stage"
    pipe = tpf.Pipeline(stages, micro_batches=2, schedule=schedule, loss_fn=F.mse_loss)
    x, y = _batch(8, 5, 3)
    return _train_and_compare(pipe, ref, x, y, F.mse_loss)


def _two_by_two_stages(schedule):
    """Three stages: rank 0, then a 2-D data x tensor parallel stage on [[1, 2]] x ..., here ranks [[1], [2]]
    (data parallel over axis 0), then rank 3."""
    torch.manual_seed(3)
    blocks = [nn.Sequential(nn.Linear(4, 6), nn.Tanh()), nn.Sequential(nn.Linear(6, 6), nn.Tanh()), nn.Linear(6, 2)]
    ref = nn.Sequential(*copy.deepcopy(blocks))
    middle = tpf.placement("cpu", [[1], [2]])
    blocks[1] = tpf.parallelize(blocks[1], placement=middle, plan={"0": tpf.ColumnParallel()})
    stages = [tpf.stage(blocks[0], stage_id=0, placement=_on(0)),
              tpf.stage(blocks[1], stage_id=1, placement=middle, sbp=(S0, B)),
              tpf.stage(blocks[2], stage_id=2, placement=_on(3))]
    pipe = tpf.Pipeline(stages, micro_batches=3, schedule=schedule, loss_fn=F.mse_loss)
    x, y = _batch(7, 4, 2)
    return _train_and_compare(pipe, ref, x, y, F.mse_loss)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("case, grads", [(_data_then_tensor_parallel, [4, 4, 8, 8]),
                                         (_one_rank_then_data_parallel, [4, 4, 4, 4]),
                                         (_seed_module_model, [2, 2, 2, 2]),
                                         (_two_by_two_stages, [4, 4, 4, 4])],
                         ids=["dp-then-tp", "one-then-dp3", "seed-module-model", "2d-middle-stage"])
def test_multi_rank_stages_match_one_device(schedule, case, grads):
    results = harness.run(4, case, schedule)
    assert [checked for checked, _ in results] == grads
    assert results[-1][1]


def _interleaved_tensor_and_data_parallel():
    """Four stages on two rank sets taking turns: ranks 0-1 tensor parallel (column then row layers), ranks 2-3 data
    parallel (split(0) rows) with uneven blocks; a loss of one's own that leaves out -1, named by ignore_index: the
    mean over the whole batch's labelled rows on both ranks of the data-parallel last stage."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5)), nn.Sequential(nn.Linear(5, 7), nn.Tanh()),
              nn.Sequential(nn.Linear(7, 9), nn.GELU(), nn.Linear(9, 6)), nn.Linear(6, 4)]
    ref = nn.Sequential(*copy.deepcopy(blocks))
    tp, dp = _on(0, 1), _on(2, 3)
    for k in (0, 2):
        blocks[k] = tpf.parallelize(blocks[k], placement=tp, plan={"0": "column", "2": "row"})
    stages = [tpf.stage(b, stage_id=k, placement=tp if k % 2 == 0 else dp, sbp=B if k % 2 == 0 else S0)
              for k, b in enumerate(blocks)]
    def loss_fn(out, t):
        return F.cross_entropy(out, t, ignore_index=-1)
    pipe = tpf.Pipeline(stages, micro_batches=4, schedule="interleaved", loss_fn=loss_fn, ignore_index=-1)
    x, y = _batch(11, 6, 4, classes=4)
    y = _masked(y, [1, 3, 4, 5, 10], value=-1)  # micro-batches of 3, 3, 3, 2 rows: 2, 0, 3, 1 labelled
    return _train_and_compare(pipe, ref, x, y, loss_fn)


def test_interleaved_tensor_and_data_parallel_rank_sets():
    results = harness.run(4, _interleaved_tensor_and_data_parallel)
    assert [checked for checked, _ in results] == [16, 16, 8, 8] and results[-1][1]


def _frozen_first_stage(schedule):
    """A frozen first stage (a fixed feature extractor): no gradient flows back to it, the rest trains."""
    blocks = _chain([5, 6, 4, 3], seed=5)
    for p in blocks[0].parameters():
        p.requires_grad_(False)
    ref = nn.Sequential(*copy.deepcopy(blocks))
    pipe = tpf.Pipeline([tpf.stage(b, stage_id=i, placement=_on(i)) for i, b in enumerate(blocks)], micro_batches=3,
                        schedule=schedule, loss_fn=F.mse_loss)
    x, y = _batch(6, 5, 3)
    pipe.step(x, y)
    F.mse_loss(ref(x), y).backward()
    for p, q in zip(pipe.parameters(), ref.parameters()):
        if dist.get_rank() in tpf.get_placement(p):
            assert (p.grad is None) == (q.grad is None) == (not q.requires_grad)
            if q.grad is not None:
                torch.testing.assert_close(p.grad.full_tensor(), q.grad)
    return True


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_frozen_first_stage(schedule):
    assert all(harness.run(3, _frozen_first_stage, schedule))


def _batch_norm_on_split_rows(schedule):
    """BatchNorm in a data-parallel stage sees each micro-batch whole, as one device does (not each rank's rows)."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU()), nn.Linear(6, 3)]
    ref = nn.Sequential(*copy.deepcopy(blocks))
    pipe = tpf.Pipeline([tpf.stage(blocks[0], stage_id=0, placement=_on(0, 1), sbp=S0),
                         tpf.stage(blocks[1], stage_id=1, placement=_on(2))],
                        micro_batches=2, schedule=schedule, loss_fn=F.mse_loss)
    x, y = _batch(9, 4, 3)
    loss = pipe.step(x, y)
    ref_loss = sum(F.mse_loss(ref(a), b) * len(a) / len(x) for a, b in zip(x.tensor_split(2), y.tensor_split(2)))
    ref_loss.backward()
    if loss is not None:
        torch.testing.assert_close(loss, ref_loss.detach())
    for p, q in zip(pipe.parameters(), ref.parameters()):
        if dist.get_rank() in tpf.get_placement(p):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad)
    return True


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_batch_norm_in_a_data_parallel_stage(schedule):
    assert all(harness.run(3, _batch_norm_on_split_rows, schedule))


def _eager_stages():
    """Without a Pipeline every rank calls every stage in order; stages may then share ranks."""
    torch.manual_seed(0)
    blocks = _chain([5, 6, 3], seed=4)
    ref = nn.Sequential(*copy.deepcopy(blocks))
    world = dist.get_world_size()
    model = nn.Sequential(tpf.stage(blocks[0], stage_id=0, placement=_on(0)),
                          tpf.stage(blocks[1], stage_id=1, placement=_on(world - 1)))
    x, y = _batch(4, 5, 3)
    out = model(x)
    assert tpf.get_placement(out) == _on(world - 1) and out.shape == (4, 3)
    loss = F.mse_loss(out, tpf.tensor(y, placement=_on(world - 1), sbp=B))
    loss.backward()
    ref_loss = F.mse_loss(ref(x), y)
    ref_loss.backward()
    if dist.get_rank() == world - 1:
        torch.testing.assert_close(loss.full_tensor(), ref_loss.detach())
    for p, q in zip(model.parameters(), ref.parameters()):
        if dist.get_rank() in tpf.get_placement(p):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad)
        else:
            assert p.to_local().numel() == 0, "a stage's parameters live only on its ranks"
    return True


def _accumulated_over_steps(schedule):
    """Gradients add up over steps as over backwards on one device: a stage reads its parameters as plain leaves
    for a step and hands their gradients over once at its end, through autograd, into the gradient a parameter
    already holds (a data-parallel stage's is partial over its rows), its hooks run. Two steps without zeroing,
    then the gradients zeroed in place, a third; a hook on a weight of each stage doubles its gradient."""
    blocks = _chain([5, 7, 3], seed=2)
    ref = nn.Sequential(*copy.deepcopy(blocks))
    stages = [tpf.stage(blocks[0], stage_id=0, placement=_on(0)),
              tpf.stage(blocks[1], stage_id=1, placement=_on(1, 2), sbp=tpf.sbp.split(0))]
    for block in [*blocks, *ref]:
        block[0].weight.register_hook(lambda g: 2 * g)
    pipe = tpf.Pipeline(stages, micro_batches=2, schedule=schedule, loss_fn=F.mse_loss)
    checked = 0
    for seed in (1, 2, 3):
        if seed == 3:
            for q in [*pipe.parameters(), *ref.parameters()]:
                if q.grad is not None:  # (none off the stage's ranks)
                    q.grad.zero_()
        x, y = _batch(6, 5, 3, seed=seed)
        pipe.step(x, y)
        F.mse_loss(ref(x), y).backward()
        for (name, p), q in zip(pipe.named_parameters(), ref.parameters()):
            if dist.get_rank() in tpf.get_placement(p):
                torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)
                checked += 1
    return checked


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_gradients_accumulate_over_steps(schedule):
    assert harness.run(3, _accumulated_over_steps, schedule) == [6, 6, 6]


def _entered_blocks():
    """A first stage cuts each plain micro-batch itself (``enter_block``): the block ``enter``'s global tensor has
    on this rank, for even and uneven rows, split or broadcast, on 1-D and 2-D placements."""
    cases = 0
    mesh = tpf.placement("cpu", torch.arange(4).reshape(2, 2))
    for pl, sbp in [(_on(0, 1, 2, 3), tpf.sbp.split(0)), (_on(0, 1, 2, 3), None), (_on(0, 1, 2, 3), tpf.sbp.split(-1)),
                    (mesh, [tpf.sbp.split(0), tpf.sbp.broadcast]), (mesh, [tpf.sbp.split(0), tpf.sbp.split(-1)])]:
        st = tpf.stage(nn.Identity(), stage_id=0, placement=pl, sbp=sbp)
        for rows in (8, 7, 5):
            x = torch.randn(rows, 6, generator=torch.Generator().manual_seed(rows))
            local, sbps, shape = st.enter_block(x)
            y = st.enter(x)
            assert (sbps, shape) == (tpf.get_sbp(y), tuple(y.shape))
            torch.testing.assert_close(local, y.to_local(), rtol=0, atol=0)
            local.add_(1)  # a copy: a module changing its input in place leaves the batch as it was
            assert torch.equal(x, torch.randn(rows, 6, generator=torch.Generator().manual_seed(rows)))
            cases += 1
    return cases


def test_a_first_stage_cuts_its_micro_batches_as_enter_does():
    assert harness.run(4, _entered_blocks) == [15] * 4


@pytest.mark.parametrize("world", [1, 2])
def test_stages_called_in_order_without_a_pipeline(world):
    assert all(harness.run(world, _eager_stages))


def _table(schedule):
    pipe = tpf.Pipeline([tpf.stage(nn.Linear(2, 2), stage_id=i, placement=_on(i)) for i in range(2)],
                        micro_batches=3, schedule=schedule, loss_fn=F.mse_loss)
    return pipe.schedule_table()


def test_schedule_table_is_printable():
    gpipe, one_f_one_b = (harness.run(2, _table, s)[0] for s in ("gpipe", "1f1b"))
    assert gpipe.splitlines()[2:] == ["stage 0  F0 F1 F2  .  . B0 B1 B2", "stage 1   . F0 F1 F2 B0 B1 B2  ."]
    assert "bubble (p - 1) / (m + p - 1) = 25.0%" in one_f_one_b


# ---------------------------------------------------------------------------------------------
# mistakes: a clear error at construction, or the same error on every rank at once


def _construction_error(kind):
    linear = nn.Linear(2, 2)
    schedule = "interleaved" if kind in ("interleaved, one stage a rank set", "interleaved, out of turn",
                                         "interleaved micro-batches") else "1f1b"
    if kind in ("two stages on one rank set", "interleaved micro-batches"):
        stages = [tpf.stage(nn.Linear(2, 2), stage_id=k, placement=_on(k % 2)) for k in range(4)]
    elif kind == "interleaved, out of turn":
        stages = [tpf.stage(nn.Linear(2, 2), stage_id=k, placement=_on(k // 2)) for k in range(4)]
    elif kind == "rank in two stages":
        stages = [tpf.stage(linear, stage_id=0, placement=_on(0, 1)), tpf.stage(nn.Linear(2, 2), stage_id=1,
                                                                              placement=_on(1))]
    else:
        stages = [tpf.stage(linear, stage_id=0, placement=_on(0)),
                  tpf.stage(nn.Linear(2, 2), stage_id=2 if kind == "stage ids" else 1, placement=_on(1))]
    m = 1 if kind == "micro-batches" else 3 if kind == "interleaved micro-batches" else 2
    with pytest.raises(ValueError) as err:
        tpf.Pipeline(stages, micro_batches=m, loss_fn=F.mse_loss, schedule=schedule)
    return str(err.value)


@pytest.mark.parametrize("kind, words", [("rank in two stages", "rank 1 is in stage 0 and stage 1"),
                                         ("stage ids", "stage ids must be 0, 1"),
                                         ("micro-batches", "at least as many micro-batches as stages"),
                                         ("two stages on one rank set", "only under schedule='interleaved'"),
                                         ("interleaved, one stage a rank set", "2 rank sets holding at least 2"),
                                         ("interleaved, out of turn", "stage 1 belongs on"),
                                         ("interleaved micro-batches", "use a multiple of 2, got micro_batches=3")])
def test_construction_errors(kind, words):
    assert all(words in text for text in harness.run(2, _construction_error, kind))


class _FailsInBackward(nn.Module):
    def forward(self, x):
        return BackwardFails.apply(x)


def _failed_step(pipe, x, y):
    """One step: the pipeline's error on this rank (None if it ran), which must come within 30 s."""
    with within():
        try:
            pipe.step(x, y)
        except tpf.PipelineError as err:
            return str(err)
    return None


def _failing_step(kind, schedule):
    dims = [4, 6, 5, 3]
    blocks = _chain(dims, seed=0)
    if kind == "activation shapes":
        blocks[1] = nn.Linear(7, 5)  # stage 1 expects 7 features; stage 0 hands it 6
    if kind == "backward":  # stage 1 fails once stage 2 already holds (under GPipe) every activation
        blocks[1] = nn.Sequential(blocks[1], _FailsInBackward())
    stages = [tpf.stage(b, stage_id=i, placement=_on(i)) for i, b in enumerate(blocks)]
    loss_fn = F.mse_loss if kind != "loss" else (lambda y, t: F.mse_loss(y, t[:, :1]) + t.unknown)
    pipe = tpf.Pipeline(stages, micro_batches=4, schedule=schedule, loss_fn=loss_fn)
    x, y = _batch(3 if kind == "batch" else 8, 4, 3)
    text = _failed_step(pipe, x, y)
    if text is not None:
        with pytest.raises(tpf.PipelineError, match="an earlier step failed"):
            pipe.step(x, y)
    return text


SCHEDULES = ["gpipe", "1f1b", "zb-h1"]
FAILURES = {
    "activation shapes": "stage 1 (ranks [1]) failed on F0: RuntimeError",
    "batch": "failed: ValueError: a batch of 3 rows cannot make 4 micro-batches",
    "loss": "stage 2 (ranks [2]) failed on F0: AttributeError",
    "backward": "stage 1 (ranks [1]) failed on B0: FloatingPointError: a backward that fails",
}


def _every_failing_step():
    """Every kind of failure under every schedule, one pipeline after another in one world: each Pipeline takes
    fresh message tags, so what a failed step left in flight never reaches the next."""
    return {(kind, schedule): _failing_step(kind, schedule) for kind in FAILURES for schedule in SCHEDULES}


def test_a_failing_stage_stops_every_rank():
    try:
        results = harness.run(3, _every_failing_step, timeout=240)
    finally:
        harness.discard(3)  # the failed steps leave sends that no rank will take
    for rank, found in enumerate(results):  # under GPipe, "backward" fails once stage 2 has all it needs
        for (kind, schedule), text in found.items():
            assert FAILURES[kind] in (text or ""), (rank, kind, schedule, text)


class _FailsLater(nn.Module):
    """Fails on its ``fail_at``-th call: in its forward, or in the backward of that call's output."""

    def __init__(self, fail_at, backward):
        super().__init__()
        self.calls, self.fail_at, self.backward = 0, fail_at, backward

    def forward(self, x):
        self.calls += 1
        if self.calls == self.fail_at:
            if not self.backward:
                raise RuntimeError("a forward that fails in the second step")
            return BackwardFails.apply(x)
        return x


def _failing_third_step(kind, schedule):
    """Stage 1 fails on micro-batch 2 of the third step, where every hand-off is steady (its header inside its one
    message): the error takes the message's place, both ways. The messages each rank sends in the first step (a
    header and blocks a hand-off) and in the second (one a hand-off), the end of the step each way included."""
    blocks = _chain([4, 6, 5, 3], seed=0)
    blocks[1] = nn.Sequential(blocks[1], _FailsLater(fail_at=2 * 4 + 3, backward=kind == "backward"))
    pipe = tpf.Pipeline([tpf.stage(b, stage_id=i, placement=_on(i)) for i, b in enumerate(blocks)], micro_batches=4,
                        schedule=schedule, loss_fn=F.mse_loss)
    x, y = _batch(8, 4, 3)
    messages = []
    for _ in range(2):
        tpf.comm.stats.reset()
        pipe.step(x, y)
        messages.append(tpf.comm.stats.messages_sent)
    return _failed_step(pipe, x, y), messages


STEADY_FAILURES = {"forward": "stage 1 (ranks [1]) failed on F2: RuntimeError",
                   "backward": "stage 1 (ranks [1]) failed on B2: FloatingPointError"}


def _every_failing_third_step():
    return {(kind, schedule): _failing_third_step(kind, schedule) for kind in STEADY_FAILURES
            for schedule in SCHEDULES}


def test_a_failure_in_a_steady_step_stops_every_rank():
    try:
        results = harness.run(3, _every_failing_third_step, timeout=240)
    finally:
        harness.discard(3)
    # 4 micro-batches: rank 0 sends 4 activations and 1 end, rank 1 also 4 gradients and 1 end back, rank 2 4 + 1
    want = [[9, 5], [18, 10], [9, 5]]
    for rank, found in enumerate(results):
        for (kind, schedule), (text, messages) in found.items():
            assert messages == want[rank], (rank, kind, schedule, messages)
            assert STEADY_FAILURES[kind] in (text or ""), (rank, kind, schedule, text)


def _failing_interleaved_step(kind):
    """Two rank sets of two stages: stage 2 (rank 0's second) fails in its forward, or stage 1 (rank 1's first) in
    its backward."""
    blocks = _chain([4, 6, 5, 3, 3], seed=0)
    if kind == "forward":
        blocks[2] = nn.Linear(7, 3)  # stage 1 hands it 5 features
    else:
        blocks[1] = nn.Sequential(blocks[1], _FailsInBackward())
    stages = [tpf.stage(b, stage_id=k, placement=_on(k % 2)) for k, b in enumerate(blocks)]
    pipe = tpf.Pipeline(stages, micro_batches=4, schedule="interleaved", loss_fn=F.mse_loss)
    x, y = _batch(8, 4, 3)
    return _failed_step(pipe, x, y)


INTERLEAVED_FAILURES = {"forward": "stage 2 (ranks [0]) failed on F0.1: RuntimeError",
                        "backward": "stage 1 (ranks [1]) failed on B0: FloatingPointError"}


def _every_failing_interleaved_step():
    return {kind: _failing_interleaved_step(kind) for kind in INTERLEAVED_FAILURES}


def test_a_failing_interleaved_stage_stops_every_rank():
    try:
        results = harness.run(2, _every_failing_interleaved_step, timeout=120)
    finally:
        harness.discard(2)
    for rank, found in enumerate(results):
        for kind, text in found.items():
            assert INTERLEAVED_FAILURES[kind] in (text or ""), (rank, kind, text)


def _cut_sequential(plan):
    """tpf.pipeline.cut on an nn.Sequential: at named children, or evenly; with a plan, each stage tensor parallel
    on its own two ranks (pipeline x tensor), its entries taken from one plan over the whole model."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 6)) for _ in range(3)],
                          nn.Linear(6, 4))
    ref = copy.deepcopy(model)
    world = dist.get_world_size()
    if plan:
        placements = [_on(0, 1), _on(2, 3)]
        stages = tpf.pipeline.cut(model, placements, at=["2"], plan={"*.0": "column", "*.2": "row"})
        assert [list(st.module._modules) for st in stages] == [["0", "1"], ["2", "3"]]
    else:
        stages = tpf.pipeline.cut(model, [_on(r) for r in range(world)])
        assert [len(st.module) for st in stages] == [2, 2] if world == 2 else [1, 1, 1, 1]
    # a loss module's own ignore_index (-100) and class weights: the mean divides by the labelled rows' weights
    loss_fn = nn.CrossEntropyLoss(weight=torch.tensor([0.5, 2.0, 1.0, 3.0]))
    pipe = tpf.Pipeline(stages, micro_batches=4, schedule="zb-h1", loss_fn=loss_fn)
    x, y = _batch(9, 6, 4, classes=4)
    y = _masked(y, [0, 3, 4, 7])  # micro-batches of 3, 2, 2, 2 rows: 2, 0, 2, 1 labelled
    return _train_and_compare(pipe, ref, x, y, loss_fn)


@pytest.mark.parametrize("world, plan", [(2, False), (4, False), (4, True)], ids=["2 stages", "4 stages", "2x2"])
def test_cut_sequential_matches_one_device(world, plan):
    results = harness.run(world, _cut_sequential, plan)
    assert results[-1][1] and all(checked > 0 for checked, _ in results)


def test_cut_errors():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    pls = [tpf.Placement.__new__(tpf.Placement) for _ in range(2)]  # never used: the errors come first
    with pytest.raises(ValueError, match=r"at=\['9'\]: not among the children, which are \['0', '1', '2'\]"):
        tpf.pipeline.cut(model, pls, at=["9"])
    with pytest.raises(ValueError, match="1 names for 2 placements, got 2"):
        tpf.pipeline.cut(model, pls, at=["1", "2"])
    with pytest.raises(ValueError, match="in their order, after the first"):
        tpf.pipeline.cut(model, pls, at=["0"])
    with pytest.raises(ValueError, match="3 children cannot make 4 stages"):
        tpf.pipeline.cut(model, pls * 2)
    with pytest.raises(TypeError, match="cut takes an nn.Sequential or a Hugging Face causal LM"):
        tpf.pipeline.cut(nn.Linear(2, 2), pls)
    with pytest.raises(TypeError, match="one per stage"):
        tpf.pipeline.cut(model, ["cpu", "cpu"])


def _changing_batches(schedule, pairs):
    """Steps of different batch sizes (and so micro-batch shapes): a receive posted ahead with the step before's
    layout is filled and the blocks sent again; with pipeline_pairs, each send goes out in one group with the
    receive after it. Every step equals one device's."""
    with tpf.config.override(pipeline_pairs=pairs):
        p = dist.get_world_size()
        dims = [5, 7, 6, 4, 3][:p + 1]
        blocks = _chain(dims, seed=0)
        ref = nn.Sequential(*copy.deepcopy(blocks))
        stages = [tpf.stage(b, stage_id=i, placement=_on(i)) for i, b in enumerate(blocks)]
        pipe = tpf.Pipeline(stages, micro_batches=p, schedule=schedule, loss_fn=F.mse_loss)
        checked = 0
        for rows in (8, 11, 8, 6):
            x, y = _batch(rows, dims[0], dims[-1], seed=rows)
            checked += _train_and_compare(pipe, ref, x, y, F.mse_loss, steps=1)[0]
        return checked


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("schedule, pairs", [("1f1b", False), ("1f1b", True), ("zb-h1", True), ("gpipe", True)])
def test_batches_of_changing_shape_and_paired_sends(world, schedule, pairs):
    assert all(checked == 8 for checked in harness.run(world, _changing_batches, schedule, pairs))


def _interleaved_pairs():
    """Paired sends (NCCL's way) run interleaving where its table is safe on one stream a peer (m = p), and refuse
    it where it is not."""
    with tpf.config.override(pipeline_pairs=True):
        with pytest.raises(ValueError, match="can deadlock where a rank's transfers to one peer run in order"):
            _interleaved_stages(2, 4, 9)
        return _interleaved_stages(2, 2, 9)


def test_interleaved_with_paired_sends():
    assert all(checked == 8 for checked, _ in harness.run(2, _interleaved_pairs))


class _CountedWeightGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, owner):
        ctx.save_for_backward(x, w)
        ctx.owner = owner
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        dw = None
        if tpf.kernels.wanted(ctx, 1):
            ctx.owner.calls += 1
            if ctx.owner.calls == ctx.owner.fail_at:
                raise FloatingPointError("a late weight gradient that fails")
            dw = (grad * x).sum()
        return (grad * w if tpf.kernels.wanted(ctx, 0) else None), dw, None


class _LastWeightGradFails(nn.Module):
    """Its weight gradient fails on the ``fail_at``-th call: under ZB-H1, after the stage sent its last gradient."""

    def __init__(self, fail_at):
        super().__init__()
        self.w, self.calls, self.fail_at = nn.Parameter(torch.ones(())), 0, fail_at

    def forward(self, x):
        return _CountedWeightGrad.apply(x, self.w, self)


def _late_weight_gradient_fails():
    blocks = _chain([4, 6, 5, 3], seed=0)
    blocks[1] = nn.Sequential(blocks[1], _LastWeightGradFails(fail_at=4))
    pipe = tpf.Pipeline([tpf.stage(b, stage_id=i, placement=_on(i)) for i, b in enumerate(blocks)], micro_batches=4,
                        schedule="zb-h1", loss_fn=F.mse_loss)
    assert str(pipe.table[1][-1]) == "W3" and pipe.table[1][-2].kind == "W"  # after its last send_grad
    x, y = _batch(8, 4, 3)
    return _failed_step(pipe, x, y)


def _interleaved_last_backward_fails():
    blocks = _chain([4, 6, 5, 3, 4, 5, 3], seed=0)  # 6 stages, two a rank over 3 ranks
    blocks[0] = nn.Sequential(blocks[0], _LastWeightGradFails(fail_at=6))
    pipe = tpf.Pipeline([tpf.stage(b, stage_id=i, placement=_on(i % 3)) for i, b in enumerate(blocks)],
                        micro_batches=6, schedule="interleaved", loss_fn=F.mse_loss)
    assert str(pipe.table[0][-1]) == "B5" and pipe.table[0][-1].chunk == 0  # stage 0's last: nothing sent after
    x, y = _batch(12, 4, 3)
    return _failed_step(pipe, x, y)


@pytest.mark.parametrize("case, error", [
    (_late_weight_gradient_fails, "stage 1 (ranks [1]) failed on W3: FloatingPointError"),
    (_interleaved_last_backward_fails, "stage 0 (ranks [0]) failed on B5: FloatingPointError"),
], ids=["zb-h1, stage 1's last W", "interleaved, stage 0's last B"])
def test_a_failure_after_the_last_hand_off_reaches_every_rank(case, error):
    """A stage fails after it sent all it sends (ZB-H1's last weight gradient on stage 1; on the interleaved schedule
    stage 0's last backward, when ranks 1 and 2 have all they need): the end of the step, a wave each way over the
    rank sets, carries it to every rank (rank 2 through rank 1); nobody waits for ever."""
    try:
        results = harness.run(3, case, timeout=60)
    finally:
        harness.discard(3)
    for rank, text in enumerate(results):
        assert error in (text or ""), (rank, text)
