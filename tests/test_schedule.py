"""Pipeline schedules as data: each forward and backward once, transfers that pair up, the theory's
bubble, 1F1B's activation bound, and clear errors for tables that would hang."""

from __future__ import annotations

import pytest

from tpflow.pipeline.schedule import Action, build, render, simulate


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
        assert _peak_in_flight(row) == bound


def test_render_draws_the_replay():
    assert render(build("1f1b", 2, 3)).splitlines() == [
        "step      0  1  2  3  4  5  6  7",
        "stage 0  F0 F1  . B0 F2 B1  . B2",
        "stage 1   . F0 B0 F1 B1 F2 B2  .",
    ]


def test_bad_requests_are_clear_errors():
    with pytest.raises(ValueError, match="schedule must be one of"):
        build("interleaved", 2, 4)
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
