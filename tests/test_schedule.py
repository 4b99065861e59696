"""Pipeline schedules as data: each forward and backward once, transfers that pair up, the theory's
bubble, 1F1B's activation bound, and clear errors for tables that would hang."""

from __future__ import annotations

import pytest

from tpflow.pipeline.actions import Action
from tpflow.pipeline.replay import check_streams, peak_activations, render, simulate
from tpflow.pipeline.schedule import build, build_interleaved, build_zero_bubble


def _peak_in_flight(timeline_row):
    held = peak = 0
    for _, a in timeline_row:
        held += 1 if a.kind == "F" else -1
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("micro_batches", [1, 2, 3, 4, 7, 8])
def test_schedules(schedule, stages, micro_batches):
    table = build(schedule, stages, micro_batches)
    timeline = simulate(table)
    for s, row in enumerate(timeline):
        assert sorted(str(a) for _, a in row) == sorted(f"{k}{i}" for k in "FB" for i in range(micro_batches))
        recvs = [a for a in table[s] if a.kind.startswith("recv")]
        assert len(recvs) == micro_batches * ((s > 0) + (s < stages - 1))
        # each link carries the same micro-batches, in the same order, at both ends
        if s < stages - 1:
            for send, recv, src, dst in (("send_act", "recv_act", s, s + 1), ("send_grad", "recv_grad", s + 1, s)):
                sent = [a.micro_batch for a in table[src] if a.kind == send]
                assert sent == [a.micro_batch for a in table[dst] if a.kind == recv] and len(sent) == micro_batches
    steps = max(t + 1 for row in timeline for t, _ in row)
    bubble = 1 - sum(len(row) for row in timeline) / (steps * stages)
    assert bubble == pytest.approx((stages - 1) / (micro_batches + stages - 1))
    for s, row in enumerate(timeline):
        bound = micro_batches if schedule == "gpipe" else min(stages - s, micro_batches)
        assert _peak_in_flight(row) == bound == peak_activations(table)[s]


@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("chunks", [2, 3])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_interleaved_1f1b(ranks, chunks, groups):
    """Every chunk's forward and backward once (simulate checks it), the transfers paired, and the replay's bubble
    and peak activations as the formulas give them, a backward costing two forwards: the bubble is (p - 1) / (v m)
    of the compute, v times 1F1B's on the same model cut into p stages."""
    micro_batches = groups * ranks
    costs = {"F": 1, "B": 2}
    table = build_interleaved(ranks, chunks, micro_batches)
    timeline = simulate(table, costs)
    for row in timeline:
        assert len(row) == 2 * chunks * micro_batches
    steps = max(t + costs[a.kind] for row in timeline for t, a in row)
    compute = 3 * chunks * micro_batches  # per rank: a forward and a backward of each chunk and micro-batch
    assert (steps - compute) / compute == pytest.approx((ranks - 1) / (chunks * micro_batches))
    whole = {"F": chunks, "B": 2 * chunks}  # a stage of plain 1F1B: a rank's v chunks
    plain_steps = max(t + whole[a.kind] for row in simulate(build("1f1b", ranks, micro_batches), whole) for t, a in row)
    assert plain_steps - compute == chunks * (steps - compute)
    held = [chunks * micro_batches if micro_batches == ranks else
            min(2 * (ranks - r - 1) + (chunks - 1) * ranks + 1, chunks * micro_batches) for r in range(ranks)]
    assert peak_activations(table) == held
    for r in range(ranks):  # each link between consecutive virtual stages carries the micro-batches in one order
        for c in range(chunks):
            nxt, c_next = (r + 1) % ranks, c + (r + 1) // ranks
            if c_next < chunks:
                sent = [a.micro_batch for a in table[r] if a.kind == "send_act" and a.chunk == c]
                assert sent == [a.micro_batch for a in table[nxt] if a.kind == "recv_act" and a.chunk == c_next]


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("extra", [0, 1, 3, 8])
def test_zero_bubble_h1(stages, extra):
    """ZB-H1 against the formulas, F, B and W of one cost: the bubble (p - 1)(F + B - W), a third of 1F1B's with the
    same work in its backward (B + W), and every stage holding at most p micro-batches, as 1F1B's stage 0."""
    micro_batches = stages + extra
    table = build_zero_bubble(stages, micro_batches)
    timeline = simulate(table)
    steps = max(t + 1 for row in timeline for t, _ in row)
    assert steps - 3 * micro_batches == stages - 1
    one_f_one_b = simulate(build("1f1b", stages, micro_batches), {"B": 2})
    assert max(t + (2 if a.kind == "B" else 1) for row in one_f_one_b for t, a in row) - 3 * micro_batches == \
        3 * (stages - 1)
    assert peak_activations(table) == [stages] * stages
    for actions in table:  # W after its B, and stage s's W lagging by s micro-batches in steady state
        kinds = [str(a) for a in actions if a.kind in "BW"]
        assert all(kinds.index(f"W{i}") > kinds.index(f"B{i}") for i in range(micro_batches))


def test_interleaved_render_and_errors():
    assert render(build_interleaved(2, 2, 2), costs={"F": 1, "B": 2}).splitlines()[1].split() == [
        "stage", "0", "F0", "F1", "F0.1", "F1.1", ".", ".", ".", "B0.1", "-", "B1.1", "-", "B0", "-", "B1", "-"]
    with pytest.raises(ValueError, match="at least 2 ranks and 2 chunks per rank"):
        build_interleaved(2, 1, 4)
    with pytest.raises(ValueError, match="use a multiple of 3, got 4"):
        build_interleaved(3, 2, 4)
    with pytest.raises(ValueError, match="as many micro-batches as stages"):
        build_zero_bubble(4, 3)
    good = build_zero_bubble(2, 2)
    with pytest.raises(ValueError, match=r"the weight gradient \(W\) of micro-batch 0 before its input gradient"):
        simulate([[Action("W", 0), *[a for a in good[0] if a != Action("W", 0)]], good[1]])


def test_render_draws_the_replay():
    assert render(build("1f1b", 2, 3)).splitlines() == [
        "step      0  1  2  3  4  5  6  7",
        "stage 0  F0 F1  . B0 F2 B1  . B2",
        "stage 1   . F0 B0 F1 B1 F2 B2  .",
    ]


def test_bad_requests_are_clear_errors():
    with pytest.raises(ValueError, match="schedule must be one of"):
        build("looped-bfs", 2, 4)
    with pytest.raises(ValueError, match="at least 2 ranks and 2 chunks per rank"):
        build("interleaved", 2, 4)
    with pytest.raises(ValueError, match="runs one stage per rank, got 2 chunks per rank: use 'interleaved'"):
        build("zb-h1", 2, 4, chunks=2)
    with pytest.raises(ValueError, match="at least 1 stage and 1 micro-batch"):
        build("gpipe", 2, 0)


def test_tables_that_would_hang_or_lose_work_are_refused():
    good = build("gpipe", 2, 2)
    both_wait = [[Action("recv_grad", 0), *good[0]], good[1]]
    missing = [[a for a in good[0] if a != Action("send_act", 1)], good[1]]
    with pytest.raises(ValueError, match="exactly once"):
        simulate(both_wait)
    with pytest.raises(ValueError, match="exactly once"):
        simulate(missing)
    crossed = [[Action("recv_grad", 0), *[a for a in good[0] if a != Action("recv_grad", 0)]], good[1]]
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(crossed)
    early_backward = [[Action("B", 0), *[a for a in good[0] if a != Action("B", 0)]], good[1]]
    with pytest.raises(ValueError, match="before its forward"):
        simulate(early_backward)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("extra", [0, 1, 4])
def test_paired_sends_cannot_deadlock_on_one_stream_a_peer(schedule, stages, extra):
    """NCCL runs a rank's transfers to one peer in order on one stream, a send waiting for its receive: 1F1B's crossed
    send and receive would wait for ever, paired into one group they cannot (the executor's pipeline_pairs)."""
    table = build(schedule, stages, stages + extra)
    check_streams(table)
    if schedule == "1f1b" and stages > 1:
        with pytest.raises(ValueError, match="deadlock on their stream"):
            check_streams(table, paired=False)


def test_interleaved_on_one_stream_a_peer():
    """Interleaving with as many micro-batches as ranks is safe paired; with more, its crossed transfers are not
    (the executor refuses it with pipeline_pairs on, rather than hang)."""
    for ranks in (2, 3, 4):
        check_streams(build("interleaved", ranks, ranks, chunks=2))
        with pytest.raises(ValueError, match="deadlock on their stream"):
            check_streams(build("interleaved", ranks, 2 * ranks, chunks=2))
