"""The ring collectives against one device in fp64: matmul + reduce-scatter (a row layer's K shard)
and all-gather + matmul (a sequence-parallel column layer), forward and backward, W = 1..4 with
uneven rows; exact bytes and messages per rank; random link delays; real gloo ranks; the Triton
kernels through the interpreter."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist

import tpflow as tpf
from tests import harness
from tests.checks import Counting, ints
from tpflow.comm import FakeWorld, as_transport
from tpflow.kernels import matmul_ref, use_triton
from tpflow.ops import all_gather_matmul, all_gather_matmul_ref, matmul_reduce_scatter, matmul_reduce_scatter_ref
from tpflow.sbp import chunk_bounds

F64 = torch.float64


def _rand(*shape, seed, dtype=F64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(dtype)


def _problem(m, k, n, bias, seed=0, dtype=F64, inner=()):
    """x [m, *inner, k], w [k, n], bias [n], dy [m, *inner, n]."""
    return (_rand(m, *inner, k, seed=seed, dtype=dtype), _rand(k, n, seed=seed + 1, dtype=dtype),
            _rand(n, seed=seed + 2, dtype=dtype) if bias else None, _rand(m, *inner, n, seed=seed + 3, dtype=dtype))


def _leaf(t):
    return None if t is None else t.detach().clone().requires_grad_()


def _traffic(group):
    t = as_transport(group)
    return t.stats.bytes_sent, t.stats.messages_sent


def _reset(group):
    as_transport(group).stats.reset()


# What one rank does. ``group`` is a FakeTransport (threads) or None (this process's gloo world).

def _rs_rank(group, X, Wt, bias, dY, splits, algo):
    """A row layer: K split over ranks, the output's rows reduce-scattered."""
    t = as_transport(group)
    k = slice(*chunk_bounds(X.shape[-1], t.world_size)[t.rank])
    x, w, b = _leaf(X[..., k]), _leaf(Wt[k]), _leaf(bias)
    _reset(group)
    y = matmul_reduce_scatter(x, w, group, bias=b, splits=splits, algo=algo)
    traffic = _traffic(group)
    y.backward(dY[slice(*chunk_bounds(X.shape[0], t.world_size)[t.rank])])
    return y.detach(), x.grad, w.grad, None if b is None else b.grad, traffic


def _ag_rank(group, X, Wt, bias, dY, activation, algo, keep_gathered=True):
    """A sequence-parallel column layer: rows of x split over ranks, output features split too. Returns the
    output, the gradients, the forward's traffic, the gathered input, and the shapes of the tensors autograd
    saved and the backward's traffic."""
    t = as_transport(group)
    rows, n = chunk_bounds(X.shape[0], t.world_size)[t.rank], slice(*chunk_bounds(Wt.shape[1], t.world_size)[t.rank])
    x, w, b = _leaf(X[slice(*rows)]), _leaf(Wt[:, n]), None if bias is None else _leaf(bias[n])
    _reset(group)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda s: saved.append(tuple(s.shape)) or s, lambda s: s):
        y, gathered = all_gather_matmul(x, w, group, rows=X.shape[0], bias=b, activation=activation, algo=algo,
                                        return_gathered=True, keep_gathered=keep_gathered)
    traffic = _traffic(group)
    _reset(group)
    y.backward(dY[..., n])
    return y.detach(), x.grad, w.grad, None if b is None else b.grad, traffic, gathered, saved, _traffic(group)


def _reference(X, Wt, bias, dY, activation=None):
    x, w, b = _leaf(X), _leaf(Wt), _leaf(bias)
    y = matmul_ref(x, w, bias=b, activation=activation)
    y.backward(dY)
    return y.detach(), x.grad, w.grad, None if b is None else b.grad


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=lambda m: f"{what}: {m}")


def _check_rs(results, X, Wt, bias, dY):
    y, dx, dw, db = _reference(X, Wt, bias, dY)
    _close(torch.cat([r[0] for r in results]), y, "output")
    _close(torch.cat([r[1] for r in results], -1), dx, "dx")
    _close(torch.cat([r[2] for r in results]), dw, "dw")
    if bias is not None:  # the whole bias gradient on every rank, from the gathered output gradient
        for r in results:
            _close(r[3], db, "dbias")


def _check_ag(results, X, Wt, bias, dY, activation):
    y, dx, dw, db = _reference(X, Wt, bias, dY, activation)
    _close(torch.cat([r[0] for r in results], -1), y, "output")
    _close(torch.cat([r[1] for r in results]), dx, "dx")
    _close(torch.cat([r[2] for r in results], 1), dw, "dw")
    if bias is not None:
        _close(torch.cat([r[3] for r in results]), db, "dbias")
    for r in results:
        assert torch.equal(r[5], X), "return_gathered is not the gathered input"


def _pieces(rows, splits):
    return len(torch.arange(rows).chunk(splits)) if rows else 0


SHAPES = [(9, 7, 5), (13, 8, 6), (2, 5, 3), (16, 12, 8)]  # M < W for W = 3, 4; even; uneven


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("m, k, n", SHAPES)
@pytest.mark.parametrize("splits, algo, bias", [(2, "ring", True), (1, "ring", False), (3, "ring", True),
                                                (2, "naive", True)])
@pytest.mark.parametrize("add_late", [True, False], ids=["late add", "add in the epilogue"])
def test_matmul_reduce_scatter(world, m, k, n, splits, algo, bias, add_late):
    X, Wt, b, dY = _problem(m, k, n, bias)
    with tpf.config.override(ring_add_late=add_late):
        results = FakeWorld(world).run(_rs_rank, X, Wt, b, dY, splits, algo)
    _check_rs(results, X, Wt, b, dY)
    if algo != "ring":
        return
    bounds = chunk_bounds(m, world)
    for rank, r in enumerate(results):  # every chunk but its own, once, in pieces; fp64 partials
        own = bounds[rank][1] - bounds[rank][0]
        messages = sum(_pieces(e - s, splits) for c, (s, e) in enumerate(bounds) if c != rank)
        assert r[4] == ((m - own) * n * 8, messages), f"rank {rank}"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("m, k, n", SHAPES)
@pytest.mark.parametrize("activation, algo, bias", [(None, "ring", True), ("gelu", "ring", False),
                                                    ("relu", "ring", True), ("silu", "naive", True)])
def test_all_gather_matmul(world, m, k, n, activation, algo, bias):
    X, Wt, b, dY = _problem(m, k, n, bias)
    results = FakeWorld(world).run(_ag_rank, X, Wt, b, dY, activation, algo)
    _check_ag(results, X, Wt, b, dY, activation)
    if algo != "ring":
        return
    bounds = chunk_bounds(m, world)
    for rank, r in enumerate(results):  # every chunk but the right neighbour's, forwarded once each
        right = (rank + 1) % world
        sent = [e - s for c, (s, e) in enumerate(bounds) if c != right and e > s]
        assert r[4] == (sum(sent) * k * 8, len(sent)), f"rank {rank}"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("algo", ["ring", "naive"])
def test_gathering_again_in_backward_saves_the_shard_and_sends_it_once_more(world, algo):
    """``keep_gathered=False``: the same gradients; the node keeps this rank's rows of x, not all M of them;
    the backward sends x's rows around once more, (W-1)/W of gather(x) per rank."""
    m, k, n = 13, 8, 6
    X, Wt, b, dY = _problem(m, k, n, True)
    kept = FakeWorld(world).run(_ag_rank, X, Wt, b, dY, "gelu", algo, True)
    again = FakeWorld(world).run(_ag_rank, X, Wt, b, dY, "gelu", algo, False)
    _check_ag(again, X, Wt, b, dY, "gelu")
    bounds = chunk_bounds(m, world)
    for rank, (keep, regather) in enumerate(zip(kept, again)):
        own = bounds[rank][1] - bounds[rank][0]
        assert (m, k) in keep[6] and (own, k) in regather[6], (keep[6], regather[6])
        assert own == m or (m, k) not in regather[6], regather[6]
        if world > 1 and algo == "ring":  # the gather's ring: every chunk but the right neighbour's
            right = (rank + 1) % world
            extra = sum(e - s for c, (s, e) in enumerate(bounds) if c != right) * k * 8
            assert regather[7][0] - keep[7][0] == extra, f"rank {rank}"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("algo", ["ring", "naive"])
def test_sequence_dims_fold_into_rows(world, algo):
    """x [S, B, K] split on S (sequence parallelism's layout), S = 5 uneven over the ranks."""
    X, Wt, b, dY = _problem(5, 8, 6, True, inner=(3,))
    _check_rs(FakeWorld(world).run(_rs_rank, X, Wt, b, dY, 2, algo), X, Wt, b, dY)
    _check_ag(FakeWorld(world).run(_ag_rank, X, Wt, b, dY, "gelu", algo), X, Wt, b, dY, "gelu")


@pytest.mark.parametrize("threshold, ring", [(24, True), (25, False)])
def test_auto_decides_alike_on_every_rank(threshold, ring):
    """K = 9 over 2 ranks gives shards of 5 and 4 columns; the choice must not depend on them."""
    X, Wt, b, dY = _problem(8, 9, 6, True)
    with tpf.config.override(ring_min_elements=threshold):  # a message is 4 rows x 6 = 24 elements
        results = FakeWorld(2).run(_rs_rank, X, Wt, b, dY, 2, "auto")
    _check_rs(results, X, Wt, b, dY)
    assert [r[4][1] for r in results] == [2 if ring else 1] * 2


def test_uneven_rows_without_rows_are_an_error_on_every_rank():
    """Without rows=, uneven rows (7 over 4 ranks) cannot be seen locally: the ranks compare counts first."""
    X, w = _rand(7, 5, seed=0), _rand(5, 3, seed=1)

    def uneven(t):
        return all_gather_matmul(X[slice(*chunk_bounds(7, 4)[t.rank])], w, t)

    with pytest.raises(ValueError, match=r"the ranks hold \[2, 2, 2, 1\] rows: pass rows="):
        FakeWorld(4).run(uneven)


@pytest.mark.parametrize("add_late", [True, False])
def test_late_add_computes_each_piece_before_its_accumulator_is_waited_for(add_late):
    """With ``add_late`` every piece's product is computed before its accumulator is waited for, then the
    accumulator is added; without, the wait comes first and the accumulator goes into the compute. The sums
    are the same either way."""
    world, bounds = 3, chunk_bounds(10, 3)
    partials = [torch.arange(30.0).reshape(10, 3) * (r + 1) for r in range(world)]

    def rank(t):
        events, own = [], []
        post = t.post

        def logged_post(sends=(), recvs=(), tag=0):
            sent, got = post(sends, recvs, tag)
            wait = got.wait
            got.wait = lambda: events.append("wait") or wait()
            return sent, got

        def compute(start, end, acc, last):
            events.append("compute" if acc is None else "compute + acc")
            part = partials[t.rank][start:end].clone()
            own.append(part if acc is None else part + acc)
            return own[-1]

        t.post = logged_post
        t.ring_reduce_scatter(bounds, compute, width=3, dtype=torch.float32, device=torch.device("cpu"), splits=2,
                              add_late=add_late)
        return events, own[-2:]

    late = ["compute", "compute"] + ["compute", "wait"] * 4  # step 0 has no accumulator to wait for
    fused = ["compute", "compute"] + ["wait", "compute + acc"] * 4
    for r, (events, own) in enumerate(FakeWorld(world).run(rank)):
        assert events == (late if add_late else fused), events
        torch.testing.assert_close(torch.cat(own), sum(partials)[slice(*bounds[r])], rtol=0, atol=0)


def test_ring_moves_half_of_gloos_reduce_scatter_bytes():
    """Even rows, W = 4: the ring sends exactly (W-1)/W of the fp32 output in 2 (W-1) messages."""
    X, Wt, _, dY = _problem(16, 8, 6, False, dtype=torch.float32)
    for *_, (nbytes, messages) in FakeWorld(4).run(_rs_rank, X, Wt, None, dY, 2, "ring"):
        assert (nbytes, messages) == (3 * 16 * 6 * 4 // 4, 2 * 3)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_delays_change_nothing(seed):
    """Latency and jitter reorder when messages land; the results must not move by a bit."""
    X, Wt, b, dY = _problem(13, 8, 6, True, seed=seed)
    calm_rs = FakeWorld(3).run(_rs_rank, X, Wt, b, dY, 2, "ring")
    calm_ag = FakeWorld(4).run(_ag_rank, X, Wt, b, dY, "gelu", "ring")
    shaky_rs = FakeWorld(3, latency=1e-3, jitter=4e-3, seed=seed).run(_rs_rank, X, Wt, b, dY, 2, "ring")
    shaky_ag = FakeWorld(4, latency=1e-3, jitter=4e-3, seed=seed).run(_ag_rank, X, Wt, b, dY, "gelu", "ring")
    for calm, shaky in ((calm_rs, shaky_rs), (calm_ag, shaky_ag)):
        for a, b_ in zip(calm, shaky):
            for x, y in zip(a[:4], b_[:4]):
                assert (x is None and y is None) or torch.equal(x, y)


def test_slow_link_gives_the_same_numbers():
    """A slow, high-latency link: pieces arrive long after they were sent; the ring waits for them."""
    X, Wt, b, dY = _problem(32, 16, 8, True)
    results = FakeWorld(2, bandwidth=1e6, latency=2e-3).run(_rs_rank, X, Wt, b, dY, 2, "ring")
    _check_rs(results, X, Wt, b, dY)


def test_fake_world_reports_a_deadlock():
    def lonely(t):
        if t.rank == 0:
            buf = torch.empty(3)
            t.post(recvs=[(buf, 1)])[1].wait()

    with pytest.raises(RuntimeError, match="no message 0 from rank 1.*deadlocks"):
        FakeWorld(2, timeout=0.3).run(lonely)


def test_fake_world_raises_the_first_failure_not_its_echoes():
    def fails(t):
        if t.rank == 1:
            raise ValueError("rank 1 broke")
        buf = torch.empty(3)
        t.post(recvs=[(buf, 1)])[1].wait()

    with pytest.raises(ValueError, match="rank 1 broke"):
        FakeWorld(3, timeout=10).run(fails)


def test_fake_link_reads_the_send_buffer_on_arrival():
    """A schedule that overwrites a buffer before its send completes is caught, as on hardware."""
    def reuse(t):
        buf = torch.zeros(4)
        if t.rank == 0:
            data = torch.ones(4)
            sent, _ = t.post(sends=[(data, 1)])
            data.fill_(7)  # too early: the message is still on the wire
            sent.wait()
        else:
            t.post(recvs=[(buf, 0)])[1].wait()
        return buf

    assert torch.equal(FakeWorld(2, latency=0.2).run(reuse)[1], torch.full((4,), 7.0))


def test_fake_world_checks_message_sizes():
    def mismatch(t):
        if t.rank == 0:
            t.post(sends=[(torch.ones(3), 1)])[0].wait()
        else:
            t.post(recvs=[(torch.empty(2), 0)])[1].wait()

    with pytest.raises(RuntimeError, match=r"is \(3,\).*expects \(2,\)"):
        FakeWorld(2).run(mismatch)


def test_bad_input_is_named():
    world = FakeWorld(2)
    x, w = torch.randn(6, 4), torch.randn(4, 5)
    with pytest.raises(ValueError, match="inner sizes differ"):
        matmul_reduce_scatter(x, torch.randn(3, 5), world.transports[0])
    with pytest.raises(ValueError, match=r"x \[rows, ..., K\] and a 2-D w"):
        all_gather_matmul(x[0], w, world.transports[0])
    with pytest.raises(ValueError, match="algo must be one of"):
        matmul_reduce_scatter(x, w, world.transports[0], algo="fast")
    with pytest.raises(ValueError, match="splits must be >= 1"):
        matmul_reduce_scatter(x, w, world.transports[0], splits=0)
    with pytest.raises(ValueError, match="rank 1 holds 3 rows, but chunk 1 of 5 rows over 2 ranks has 2"):
        all_gather_matmul(torch.randn(3, 4), w, world.transports[1], rows=5)


# Real processes over gloo: the torch.distributed transport against the library's own collectives.

def _gloo_rank(world_size, m, inner, k, n, algo):
    X, Wt, b, dY = _problem(m, k, n, True, seed=world_size, inner=inner)
    rs = _rs_rank(None, X, Wt, b, dY, 2, algo)
    ag = _ag_rank(None, X, Wt, b, dY, "gelu", algo)
    t = as_transport(None)
    k_own = slice(*chunk_bounds(k, t.world_size)[t.rank])
    rs_ref = matmul_reduce_scatter_ref(X[..., k_own], Wt[k_own], bias=b)
    rows = slice(*chunk_bounds(m, t.world_size)[t.rank])
    ag_ref = all_gather_matmul_ref(X[rows], Wt, rows=m, bias=b, activation="gelu")
    return rs, ag, rs_ref, ag_ref


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("algo", ["ring", "naive"])
@pytest.mark.parametrize("m, inner", [(11, ()), (3, (2,))], ids=["11 rows", "3x2 rows"])  # 3 < W = 4: an empty chunk
def test_gloo(world, algo, m, inner):
    k, n = 9, 7
    results = harness.run(world, _gloo_rank, world, m, inner, k, n, algo)
    X, Wt, b, dY = _problem(m, k, n, True, seed=world, inner=inner)
    _check_rs([r[0] for r in results], X, Wt, b, dY)
    _check_ag([r[1] for r in results], X, Wt, b, dY, "gelu")
    y = matmul_ref(X, Wt, bias=b)
    y_act = matmul_ref(X, Wt, bias=b, activation="gelu")
    _close(torch.cat([r[2] for r in results]), y, "reduce-scatter reference")
    for r in results:
        _close(r[3], y_act, "all-gather reference")
    if algo == "ring":
        bounds = chunk_bounds(m, world)
        for rank, r in enumerate(results):  # counted in tpflow.comm.stats, with the rest of the rank's traffic
            assert r[0][4][0] == (m - (bounds[rank][1] - bounds[rank][0])) * math.prod(inner) * n * 8


# The Triton kernels (row ranges, the received partial added in the epilogue) through the interpreter.

def _triton_rank(dtype, bias, activation, kernel, shape, add_late):
    """The rings on the Triton kernels; with ``kernel="persistent"``, also how many products ran on it."""
    from tpflow.kernels import tuning

    persistent = Counting(tuning.tuned("persistent"))
    with tpf.config.override(kernels="triton", matmul=kernel, ring_add_late=add_late), \
            tuning.use("persistent", persistent):
        X, Wt, b, dY = _problem(*shape, bias, seed=3, dtype=dtype)
        assert use_triton(X), "the rings must run the Triton kernels here"
        return (_rs_rank(None, X, Wt, b, dY, 2, "ring")[:4],
                _ag_rank(None, X, Wt, b, dY, activation, "ring")[:4], persistent.launches)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype, bias, activation, kernel, shape, add_late", [
    (torch.float32, True, "gelu", "tiled", (37, 24, 20), False),
    (torch.float32, False, None, "tiled", (37, 24, 20), True),
    (torch.float16, False, "silu", "tiled", (37, 24, 20), True),
    (torch.float16, True, "gelu", "persistent", (48, 32, 24), True),
], ids=["fp32, partials added in the epilogue", "fp32, late add", "fp16", "fp16 persistent"])
def test_triton_kernels_in_the_rings(world, dtype, bias, activation, kernel, shape, add_late):
    """fp16 outputs get the partials added in the epilogue whatever ``ring_add_late`` says (fp32 partials)."""
    pytest.importorskip("triton")
    results = harness.run(world, _triton_rank, dtype, bias, activation, kernel, shape, add_late, timeout=300)
    if kernel == "persistent":  # the chunks' products, their accumulating epilogues and the backward's products
        assert all(r[2] >= 2 * world for r in results), [r[2] for r in results]
    X, Wt, b, dY = _problem(*shape, bias, seed=3, dtype=dtype)
    X64, Wt64, b64, dY64 = (None if t is None else t.double() for t in (X, Wt, b, dY))
    for got, ref64, ref in (
        (torch.cat([r[0][0] for r in results]), matmul_ref(X64, Wt64, bias=b64), matmul_ref(X, Wt, bias=b)),
        (torch.cat([r[1][0] for r in results], 1), matmul_ref(X64, Wt64, bias=b64, activation=activation),
         matmul_ref(X, Wt, bias=b, activation=activation)),
    ):
        # the rule: err(kernel, fp64) <= 2 * err(torch in the same dtype, fp64) + atol
        err, torch_err = (got.double() - ref64).abs().max(), (ref.double() - ref64).abs().max()
        atol = (1e-5 if dtype == torch.float32 else 1e-3) * ref64.abs().max()
        assert err <= 2 * torch_err + atol, f"error {err:.3g} > {2 * torch_err + atol:.3g}"
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    _, dx, dw, _ = _reference(X64, Wt64, b64, dY64)
    torch.testing.assert_close(torch.cat([r[0][1] for r in results], 1).double(), dx, **tol)
    torch.testing.assert_close(torch.cat([r[0][2] for r in results]).double(), dw, **tol)
    _, dx, dw, _ = _reference(X64, Wt64, b64, dY64, activation)
    torch.testing.assert_close(torch.cat([r[1][1] for r in results]).double(), dx, **tol)
    torch.testing.assert_close(torch.cat([r[1][2] for r in results], 1).double(), dw, **tol)


@pytest.mark.parametrize("world, m", list(itertools.product([2, 4], [8, 10])))
def test_auto_picks_the_plain_collective_for_small_products(world, m):
    """Tiny products: ``auto`` must not pay a ring's per-step overhead; same numbers either way."""
    X, Wt, b, dY = _problem(m, 6, 5, True)
    ring = FakeWorld(world).run(_rs_rank, X, Wt, b, dY, 2, "ring")
    auto = FakeWorld(world).run(_rs_rank, X, Wt, b, dY, 2, "auto")
    for r, a in zip(ring, auto):
        _close(a[0], r[0], "auto vs ring")
        assert a[4][1] == world - 1  # the plain ring collective: one message per step


# The library collectives' all-to-all and the autograd pairs, against what one process computes from every rank's
# data.

def _counts(world: int, seed: int) -> torch.Tensor:
    """[W, W]: row s is what rank s sends each rank; uneven, with zeros (a rank that sends nothing at all too)."""
    counts = torch.randint(0, 4, (world, world), generator=torch.Generator().manual_seed(seed))
    counts[world - 1] = 0 if world > 1 else counts[world - 1]
    return counts


def _pairs_rank(world, seed):
    W, r, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    counts = _counts(W, seed)
    rows = [ints((int(counts[s].sum()), 3), seed + s) for s in range(W)]  # every rank's rows, known to all
    tpf.comm.stats.reset()
    got_counts = tpf.comm.exchange_counts(counts[r], group)
    assert (tpf.comm.stats.bytes_sent, tpf.comm.stats.messages_sent) == ((W - 1) * 8, W - 1)  # an int64 each
    assert got_counts.tolist() == counts[:, r].tolist()
    # all-to-all: rank r receives, in rank order, the rows each rank s sent it
    starts = [torch.cat([torch.zeros(1, dtype=torch.long), counts[s].cumsum(0)]) for s in range(W)]
    want = torch.cat([rows[s][starts[s][r]:starts[s][r + 1]] for s in range(W)])
    tpf.comm.stats.reset()
    x = rows[r].clone().requires_grad_()
    y = tpf.comm.all_to_all_mirror(x, counts[r].tolist(), counts[:, r].tolist(), group)
    assert torch.equal(y, want)
    sent = sum(int(c) for q, c in enumerate(counts[r]) if q != r) * 3 * 4
    assert tpf.comm.stats.bytes_sent == sent
    # not contiguous, in bf16: the same rows arrive
    columns = rows[r].T.contiguous().to(torch.bfloat16).T
    assert not columns.is_contiguous() or columns.shape[0] < 2  # a rank that sends no rows holds none
    got = tpf.comm.all_to_all(columns, counts[r].tolist(), counts[:, r].tolist(), group)
    assert got.dtype == torch.bfloat16 and torch.equal(got.float(), want)
    # backward: row i's gradient comes back to the rank it came from; the loss weighs rank r's received rows by r+1
    (y * (r + 1)).sum().backward()
    back = torch.cat([torch.full((int(counts[r][q]), 3), float(q + 1)) for q in range(W)])
    assert torch.equal(x.grad, back)
    # the pairs: forward and backward against the whole tensor
    full = ints((7, 5), seed)
    own = slice(*chunk_bounds(7, W)[r])
    g = ints((7, 5), seed + 100)
    part = full[own].clone().requires_grad_()
    gathered = tpf.comm.gather_from_ranks(part, 0, 7, group)
    assert torch.equal(gathered, full)
    (gathered * g).sum().backward()
    assert torch.equal(part.grad, g[own])
    whole = full.clone().requires_grad_()
    chunk = tpf.comm.scatter_to_ranks(whole, 0, group)
    assert torch.equal(chunk, full[own])
    (chunk * g[own]).sum().backward()
    assert torch.equal(whole.grad, g)  # every rank's chunk of the gradient, gathered
    partial = (full * (r + 1)).requires_grad_()
    summed = tpf.comm.reduce_scatter_to_ranks(partial, 1, group)
    assert torch.equal(summed, (full * sum(range(1, W + 1)))[:, slice(*chunk_bounds(5, W)[r])])
    (summed * g[:, slice(*chunk_bounds(5, W)[r])]).sum().backward()
    assert torch.equal(partial.grad, g)
    p = (full * (r + 1)).requires_grad_()
    total = tpf.comm.reduce_from_ranks(p * 1, group)
    assert torch.equal(total, full * sum(range(1, W + 1)))
    (total * g).sum().backward()
    assert torch.equal(p.grad, g)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_all_to_all_and_the_autograd_pairs(world):
    harness.run(world, _pairs_rank, world, 5 + world)


def _all_to_all_misuse_rank():
    with pytest.raises(ValueError, match="x has 3 rows but send_counts"):
        tpf.comm.all_to_all(torch.zeros(3, 2), [1, 1], [1, 1], dist.group.WORLD)
    with pytest.raises(ValueError, match="one count per rank"):
        tpf.comm.all_to_all(torch.zeros(2, 2), [2], [1, 1], dist.group.WORLD)
    with pytest.raises(ValueError, match="must not be negative"):
        tpf.comm.all_to_all(torch.zeros(2, 2), [3, -1], [1, 1], dist.group.WORLD)
    with pytest.raises(ValueError, match="one row per rank"):
        tpf.comm.exchange_counts(torch.zeros(3, dtype=torch.long), dist.group.WORLD)
    with pytest.raises(ValueError, match="x has 3 rows"):  # no parallelism: still checked
        tpf.comm.all_to_all_mirror(torch.zeros(3, 2), [2], [2], None)


def test_all_to_all_misuse_names_the_fix():
    harness.run(2, _all_to_all_misuse_rank)
