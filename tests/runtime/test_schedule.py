"""Pipeline schedules as data: generators, validator, deadlock simulator (no processes)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.contract.schedule_ir import (
    RECV_ACT,
    RECV_GRAD,
    SEND_ACT,
    SEND_GRAD,
    Action,
    B,
    DeadlockError,
    F,
    ScheduleError,
    format_schedule,
    gpipe,
    one_f_one_b,
    one_f_one_b_bubble,
    peak_inflight,
    simulate,
    validate_schedule,
)

stages = st.integers(1, 8)
mbs = st.integers(1, 16)


def acts(text: str) -> list[Action]:
    return [Action.parse(t) for t in text.split()]


def test_action_printing_and_parsing():
    a = Action(1, F, 3)
    assert str(a) == "F3@s1"
    assert Action.parse("RECV_GRAD12@s7") == Action(7, RECV_GRAD, 12)
    for bad in ("F@s1", "X3@s1", "F3s1"):
        with pytest.raises(ValueError):
            Action.parse(bad)
    assert Action(2, SEND_ACT, 0).peer == 3 and Action(2, SEND_GRAD, 0).peer == 1 and a.peer is None


def test_one_f_one_b_two_stages_exact_order():
    s = one_f_one_b(2, 3)
    assert format_schedule(s).splitlines() == [
        "rank 0: F0@s0 SEND_ACT0@s0 F1@s0 SEND_ACT1@s0 RECV_GRAD0@s0 B0@s0 F2@s0 SEND_ACT2@s0 "
        "RECV_GRAD1@s0 B1@s0 RECV_GRAD2@s0 B2@s0",
        "rank 1: RECV_ACT0@s1 F0@s1 B0@s1 SEND_GRAD0@s1 RECV_ACT1@s1 F1@s1 B1@s1 SEND_GRAD1@s1 "
        "RECV_ACT2@s1 F2@s1 B2@s1 SEND_GRAD2@s1",
    ]


@settings(max_examples=60, deadline=None)
@given(p=stages, m=mbs)
def test_one_f_one_b_valid_deadlock_free_and_bounded(p, m):
    if m < p:
        with pytest.raises(ValueError, match="at least as many micro-batches as stages"):
            one_f_one_b(p, m)
    sched = one_f_one_b(p, m, strict=False)
    validate_schedule(sched, p, m)
    res = simulate(sched, forward_time=1.0, backward_time=2.0)
    assert peak_inflight(sched) == [min(p - s, m) for s in range(p)]
    # Every stage computes m forwards and m backwards.
    assert res.compute_time == [3.0 * m] * p
    assert res.makespan == pytest.approx(3.0 * (m + p - 1))
    assert res.bubble_fraction == pytest.approx(one_f_one_b_bubble(p, m))
    assert res.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@settings(max_examples=40, deadline=None)
@given(p=stages, m=mbs)
def test_gpipe_valid_deadlock_free_holds_everything(p, m):
    sched = gpipe(p, m)
    validate_schedule(sched, p, m)
    res = simulate(sched, forward_time=1.0, backward_time=1.0)
    assert peak_inflight(sched) == [m] * p
    assert res.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@settings(max_examples=30, deadline=None)
@given(p=st.integers(2, 6), m=st.integers(1, 12), f=st.floats(0.1, 3), b=st.floats(0.1, 3), c=st.floats(0, 1))
def test_simulated_times_respect_dependencies(p, m, f, b, c):
    """Start/end times are consistent: F after the activations arrive, B after the gradient."""
    sched = one_f_one_b(p, max(m, p))
    res = simulate(sched, forward_time=f, backward_time=b, p2p_time=c)
    for s, rows in enumerate(res.timeline):
        assert [a for a, _, _ in rows] == sched[s]
        for (_, _, e0), (_, s1, _) in zip(rows, rows[1:]):
            assert s1 == pytest.approx(e0)  # a rank never idles between actions except inside receives
        for a, t0, t1 in rows:
            if a.kind == RECV_ACT:
                assert t1 >= res.end[Action(s - 1, SEND_ACT, a.microbatch)] + c - 1e-9
            if a.kind == RECV_GRAD:
                assert t1 >= res.end[Action(s + 1, SEND_GRAD, a.microbatch)] + c - 1e-9
    # Communication can only lengthen the step; it never shortens it below compute.
    assert res.makespan >= (m if m >= p else p) * (f + b) - 1e-9


def test_unequal_stage_times_bottleneck():
    """With one slow stage, the steady state runs at the slow stage's pace."""
    p, m = 3, 8
    res = simulate(one_f_one_b(p, m), forward_time=[1, 3, 1], backward_time=[2, 6, 2])
    # The slow stage 1 never waits once started: it starts after stage 0's first forward (1) and
    # stage 0's last backward (2) follows it; stage 2's work hides under stage 1's.
    assert res.makespan == pytest.approx(1 + m * 9 + 2)
    assert res.compute_time == [24.0, 72.0, 24.0]


def test_swapped_order_deadlocks_with_cycle():
    sched = [
        acts("F0@s0 RECV_GRAD0@s0 SEND_ACT0@s0 B0@s0"),
        acts("RECV_ACT0@s1 F0@s1 B0@s1 SEND_GRAD0@s1"),
    ]
    validate_schedule(sched, 2, 1)  # locally well-ordered ...
    with pytest.raises(DeadlockError) as ei:  # ... but each rank waits for the other
        simulate(sched)
    msg = str(ei.value)
    assert "rank 0 -> rank 1 -> rank 0" in msg
    assert "RECV_GRAD0@s0 waits for SEND_GRAD0@s1; rank 1 is blocked at RECV_ACT0@s1" in msg
    assert ei.value.stuck == [Action(0, RECV_GRAD, 0), Action(1, RECV_ACT, 0)]


def test_deadlock_in_a_longer_1f1b_when_stage_skips_warmup():
    """Stage 0 of a 3-stage 1F1B without warm-up waits for a gradient stage 2 cannot produce yet."""
    good = one_f_one_b(3, 4)
    s0 = []
    for i in range(4):
        s0 += [Action(0, F, i), Action(0, SEND_ACT, i), Action(0, RECV_GRAD, i), Action(0, B, i)]
    sched = [s0, good[1], good[2]]
    validate_schedule(sched, 3, 4)
    with pytest.raises(DeadlockError, match="RECV_GRAD0@s0 waits for SEND_GRAD0@s1; rank 1 is blocked at RECV_ACT1@s1"):
        simulate(sched)


def test_missing_send_is_reported_as_never_sent():
    sched = [acts("F0@s0 B0@s0"), acts("RECV_ACT0@s1 F0@s1 B0@s1")]
    with pytest.raises(
        DeadlockError, match="RECV_ACT0@s1 waits for SEND_ACT0@s0, but rank 0 finished without sending it"
    ):
        simulate(sched)
    with pytest.raises(ScheduleError, match="rank 0's list has no SEND_ACT0@s0"):
        validate_schedule(sched, 2, 1)


@pytest.mark.parametrize(
    "rank0, rank1, message",
    [
        ("F0@s0 SEND_ACT0@s0 RECV_GRAD0@s0", "RECV_ACT0@s1 F0@s1 B0@s1 SEND_GRAD0@s1", "rank 0's list has no B0@s0"),
        (
            "F0@s0 F0@s0 SEND_ACT0@s0 RECV_GRAD0@s0 B0@s0",
            "RECV_ACT0@s1 F0@s1 B0@s1 SEND_GRAD0@s1",
            "F0@s0 appears more than once",
        ),
        (
            "B0@s0 F0@s0 SEND_ACT0@s0 RECV_GRAD0@s0",
            "RECV_ACT0@s1 F0@s1 B0@s1 SEND_GRAD0@s1",
            "B0@s0 comes before F0@s0",
        ),
        (
            "SEND_ACT0@s0 F0@s0 RECV_GRAD0@s0 B0@s0",
            "RECV_ACT0@s1 F0@s1 B0@s1 SEND_GRAD0@s1",
            "SEND_ACT0@s0 comes before F0@s0",
        ),
        (
            "RECV_ACT0@s0 F0@s0 SEND_ACT0@s0 RECV_GRAD0@s0 B0@s0",
            "RECV_ACT0@s1 F0@s1 B0@s1 SEND_GRAD0@s1",
            "RECV_ACT0@s0 cannot run on the first stage",
        ),
        (
            "F0@s0 SEND_ACT0@s0 RECV_GRAD0@s0 B0@s0",
            "RECV_ACT0@s1 F0@s1 SEND_ACT0@s1 B0@s1 SEND_GRAD0@s1",
            "SEND_ACT0@s1 cannot run on the last stage",
        ),
        (
            "F0@s0 SEND_ACT0@s0 RECV_GRAD0@s0 B0@s0",
            "RECV_ACT0@s0 F0@s1 B0@s1 SEND_GRAD0@s1",
            "RECV_ACT0@s0 is in rank 1's list but names stage 0",
        ),
        (
            "F1@s0 SEND_ACT1@s0 RECV_GRAD1@s0 B1@s0",
            "RECV_ACT1@s1 F1@s1 B1@s1 SEND_GRAD1@s1",
            "F1@s0 names micro-batch 1, but there are only 1",
        ),
    ],
)
def test_validator_messages(rank0, rank1, message):
    with pytest.raises(ScheduleError, match=message):
        validate_schedule([acts(rank0), acts(rank1)], 2, 1)


def test_validator_fifo_mismatch_names_both_actions():
    good = one_f_one_b(2, 2)
    # Stage 1 receives micro-batch 1's activations first: they would be taken for micro-batch 0's.
    r1 = acts("RECV_ACT1@s1 F1@s1 RECV_ACT0@s1 F0@s1 B0@s1 SEND_GRAD0@s1 B1@s1 SEND_GRAD1@s1")
    with pytest.raises(
        ScheduleError, match=r"SEND_ACT0@s0 is stage 0's 1st SEND_ACT but stage 1's 1st RECV_ACT is RECV_ACT1@s1"
    ):
        validate_schedule([good[0], r1], 2, 2)
    with pytest.raises(ScheduleError, match="RECV_ACT1@s1 would receive SEND_ACT0@s0's message"):
        simulate([good[0], r1])


def test_validator_rank_count_and_sizes():
    with pytest.raises(ScheduleError, match="2 rank lists but there are 3 stages"):
        validate_schedule(one_f_one_b(2, 4), 3, 4)
    with pytest.raises(ValueError, match="num_microbatches must be >= 1"):
        gpipe(2, 0)
    with pytest.raises(ValueError, match="2 micro-batches for 4 stages"):
        one_f_one_b(4, 2)


@pytest.mark.parametrize("p, m, c", [(2, 4, 0.5), (4, 8, 0.5), (3, 5, 2.0)])
def test_p2p_latency(p, m, c):
    f, b = 1.0, 1.0
    res_g = simulate(gpipe(p, m), forward_time=f, backward_time=b, p2p_time=c)
    # GPipe's critical path: p-1 forward hops (f + c) to fill, m forwards and m backwards on the
    # last stage, p-1 backward hops (b + c) to drain.
    assert res_g.makespan == pytest.approx(m * (f + b) + (p - 1) * (f + b + 2 * c))
    # 1F1B waits for each gradient's round trip in the steady state, so latency hurts it more.
    res = simulate(one_f_one_b(p, m), forward_time=f, backward_time=b, p2p_time=c)
    assert res.makespan >= res_g.makespan
    assert res.bubble_fraction > one_f_one_b_bubble(p, m)


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 6), extra=st.integers(0, 12), data=st.data())
def test_planner_pipeline_time_bounds_the_simulated_1f1b(p, extra, data):
    """The cost model's ``(m - 1) max T + sum T`` against the executor's schedule, simulated with
    unequal stages: an upper bound when every stage has the same backward/forward ratio, within a
    few percent of it when the ratios differ (backward 1.5-2.5 times forward; the gap is a
    stage that finishes its forward early and waits on a slower one's gradient), never above the
    textbook ``(m + p - 1) max T``, and exact when the stages are equal."""
    from cost_models.strategy import pipeline_time

    m = p + extra
    fwd = data.draw(st.lists(st.floats(0.1, 5.0), min_size=p, max_size=p))
    ratio = data.draw(st.floats(1.5, 2.5))
    bwd = [f * ratio for f in fwd]
    micro = [f + b for f, b in zip(fwd, bwd)]
    est = pipeline_time(micro, m)
    assert simulate(one_f_one_b(p, m), forward_time=fwd, backward_time=bwd).makespan <= est * (1 + 1e-9)
    assert est <= (m + p - 1) * max(micro) * (1 + 1e-9)

    ratios = data.draw(st.lists(st.floats(1.5, 2.5), min_size=p, max_size=p))
    bwd = [f * r for f, r in zip(fwd, ratios)]
    micro = [f + b for f, b in zip(fwd, bwd)]
    sim = simulate(one_f_one_b(p, m), forward_time=fwd, backward_time=bwd).makespan
    assert sim <= pipeline_time(micro, m) * 1.05

    same = simulate(one_f_one_b(p, m), forward_time=fwd[0], backward_time=bwd[0]).makespan
    assert pipeline_time([micro[0]] * p, m) == pytest.approx(same)
