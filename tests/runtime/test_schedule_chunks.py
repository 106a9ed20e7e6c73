"""Interleaved 1F1B and zero-bubble schedules as data: chunks, W actions, bounds and bubbles."""

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
    TimingProgram,
    W,
    analyze,
    format_schedule,
    interleaved_one_f_one_b,
    interleaved_zero_bubble,
    one_f_one_b,
    peak_inflight,
    peak_weight_pending,
    simulate,
    validate_rank,
    validate_schedule,
    with_communication,
    zero_bubble_h1,
)


def sizes(v_min: int = 1):
    """(p, m, v) with m a multiple of p (what interleaving needs)."""
    return st.tuples(st.integers(2, 6), st.integers(1, 4), st.integers(v_min, 4)).map(
        lambda t: (t[0], t[0] * t[1], t[2])
    )


def test_chunk_actions_print_parse_and_peers():
    a = Action(1, W, 3, 2)
    assert str(a) == "W3@s1c2" and Action.parse("W3@s1c2") == a
    assert str(Action(1, F, 3)) == "F3@s1" and Action.parse("F3@s1") == Action(1, F, 3, 0)
    for bad in ("F3@s1c", "F3@sc1", "W@s1c1"):
        with pytest.raises(ValueError):
            Action.parse(bad)
    # p = 2: chunk 1 (rank 1, local 0) sends to chunk 2 (rank 0, local 1); gradients go back.
    assert Action(1, SEND_ACT, 0).peer_of(2) == (0, 1)
    assert Action(0, SEND_GRAD, 0, 1).peer_of(2) == (1, 0)
    assert Action(0, RECV_ACT, 0, 1).peer_of(2) == (1, 0)


@settings(max_examples=40, deadline=None)
@given(pmv=sizes(), data=st.data())
def test_every_action_parses_back(pmv, data):
    p, m, v = pmv
    gen = data.draw(st.sampled_from([interleaved_one_f_one_b, interleaved_zero_bubble]))
    for acts in gen(p, m, v):
        assert [Action.parse(str(a)) for a in acts] == acts


@settings(max_examples=60, deadline=None)
@given(pmv=sizes(v_min=2))
def test_interleaved_valid_bounded_and_bubble_is_closed_form(pmv):
    p, m, v = pmv
    sched = interleaved_one_f_one_b(p, m, v)
    validate_schedule(sched, p, m, v)  # every (chunk, micro-batch) F then B once, FIFO per pair
    assert all(a.kind != W for acts in sched for a in acts)
    assert sum(a.kind == F for acts in sched for a in acts) == p * v * m
    # Equal stages of forward 1 and backward 2, each chunk 1/v of that: bubble (p-1)/(v m).
    res = simulate(sched, forward_time=1 / v, backward_time=2 / v)
    assert res.bubble_ratio == pytest.approx((p - 1) / (v * m))
    assert res.makespan == pytest.approx(3 * m + 3 * (p - 1) / v)
    # Rank 0 holds at most (1 + (p-1)/(p v)) times 1F1B's p micro-batches, in whole-stage units.
    peaks = peak_inflight(sched)
    assert peaks[0] / v <= p * (1 + (p - 1) / (p * v)) + 1e-9
    assert max(peaks) == peaks[0] == min(m * v, (v - 1) * p + 2 * p - 1)


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 7), k=st.integers(1, 4), extra=st.integers(0, 3), times=st.tuples(*[st.floats(0.2, 3)] * 3))
def test_zero_bubble_h1_valid_bounded_and_fills_the_bubble(p, k, extra, times):
    m = p * k + extra  # ZB-H1 (v = 1) takes any m >= p
    sched = zero_bubble_h1(p, m)
    validate_schedule(sched, p, m)
    assert sum(a.kind == W for acts in sched for a in acts) == p * m
    assert peak_inflight(sched) == [min(p - s, m) for s in range(p)]  # 1F1B's full activations
    assert max(peak_weight_pending(sched)) <= p
    res = simulate(sched, forward_time=1.0, backward_time=1.0, weight_time=1.0)
    assert res.bubble_ratio == pytest.approx((p - 1) / (3 * m))
    # Any F/B/W times: never slower than 1F1B with the same work, and it never deadlocks.
    f, b, w = times
    zb = simulate(sched, forward_time=f, backward_time=b, weight_time=w).makespan
    assert zb <= simulate(one_f_one_b(p, m), forward_time=f, backward_time=b + w).makespan + 1e-9


@settings(max_examples=30, deadline=None)
@given(pmv=sizes(v_min=2), times=st.tuples(*[st.floats(0.2, 3)] * 3), c=st.floats(0, 1))
def test_interleaved_zero_bubble_any_times_no_deadlock(pmv, times, c):
    p, m, v = pmv
    sched = interleaved_zero_bubble(p, m, v)
    validate_schedule(sched, p, m, v)
    f, b, w = times
    stats = analyze(sched, forward_time=f, backward_time=b, weight_time=w, p2p_time=c)
    assert stats.messages == 2 * (p * v - 1) * m
    assert stats.peak_activations[0] <= peak_inflight(interleaved_one_f_one_b(p, m, v))[0]
    eq = simulate(sched, forward_time=1 / v, backward_time=1 / v, weight_time=1 / v)
    assert eq.bubble_ratio == pytest.approx((p - 1) / (3 * v * m))


def test_interleaved_exact_order_p2_v2():
    s = interleaved_one_f_one_b(2, 2, 2)
    assert format_schedule(s).splitlines() == [
        "rank 0: F0@s0 SEND_ACT0@s0 F1@s0 SEND_ACT1@s0 RECV_ACT0@s0c1 F0@s0c1 SEND_ACT0@s0c1 RECV_ACT1@s0c1 "
        "F1@s0c1 SEND_ACT1@s0c1 RECV_GRAD0@s0c1 B0@s0c1 SEND_GRAD0@s0c1 RECV_GRAD1@s0c1 B1@s0c1 SEND_GRAD1@s0c1 "
        "RECV_GRAD0@s0 B0@s0 RECV_GRAD1@s0 B1@s0",
        "rank 1: RECV_ACT0@s1 F0@s1 SEND_ACT0@s1 RECV_ACT1@s1 F1@s1 SEND_ACT1@s1 RECV_ACT0@s1c1 F0@s1c1 "
        "B0@s1c1 SEND_GRAD0@s1c1 RECV_ACT1@s1c1 F1@s1c1 B1@s1c1 SEND_GRAD1@s1c1 RECV_GRAD0@s1 B0@s1 "
        "SEND_GRAD0@s1 RECV_GRAD1@s1 B1@s1 SEND_GRAD1@s1",
    ]


def test_v1_and_communication_placement_agree_with_one_f_one_b():
    assert interleaved_one_f_one_b(3, 5, 1) == one_f_one_b(3, 5)
    compute = [[a for a in acts if a.kind in (F, B)] for acts in one_f_one_b(4, 6)]
    assert with_communication(compute, 4) == one_f_one_b(4, 6)


@pytest.mark.parametrize(
    "p, m, v, match",
    [
        (4, 6, 2, "6 micro-batches is not a multiple of 4.*use 4 or 8"),
        (4, 2, 2, "at least as many micro-batches as pipeline ranks: got 2 for 4"),
        (1, 4, 2, "interleaving needs at least 2 pipeline ranks"),
    ],
)
def test_interleaved_refuses_sizes_the_order_cannot_run(p, m, v, match):
    with pytest.raises(ScheduleError, match=match):
        interleaved_one_f_one_b(p, m, v)


def test_validator_chunks_and_w():
    sched = zero_bubble_h1(2, 2)
    no_w = [[a for a in acts if a != Action(1, W, 1)] for acts in sched]
    with pytest.raises(ScheduleError, match="rank 1's list has no W1@s1 .*every B needs its W"):
        validate_schedule(no_w, 2, 2)
    early = [list(acts) for acts in sched]
    early[1].remove(Action(1, W, 0))
    early[1].insert(0, Action(1, W, 0))
    with pytest.raises(ScheduleError, match="W0@s1 comes before B0@s1"):
        validate_schedule(early, 2, 2)
    il = interleaved_one_f_one_b(2, 2, 2)
    with pytest.raises(ScheduleError, match="names local chunk 1, but there are 1 model chunk per rank"):
        validate_schedule(il, 2, 2)
    bad = [list(acts) for acts in il]
    bad[1].append(Action(1, SEND_ACT, 0, 1))
    with pytest.raises(
        ScheduleError, match=r"SEND_ACT0@s1c1 cannot run on the last model chunk \(model chunk 3 of 4\)"
    ):
        validate_schedule(bad, 2, 2, 2)


def test_fifo_per_pair_mixes_kinds_and_deadlock_is_found():
    il = interleaved_one_f_one_b(2, 4, 2)
    # Rank 1 posts its first gradient receive before an activation receive that rank 0 sent
    # first: each is still before its use, but one pair's messages are matched in order.
    r1 = list(il[1])
    recvs = [k for k, a in enumerate(r1) if a.kind in (RECV_ACT, RECV_GRAD)]
    k = next(y for y in recvs if r1[y].kind == RECV_GRAD)
    i = max(x for x in recvs if x < k and r1[x].kind == RECV_ACT)
    r1.insert(i, r1.pop(k))
    validate_rank(r1, 1, 2, 4, 2)
    with pytest.raises(ScheduleError, match=f"message to stage 1 but stage 1's .* receive from stage 0 is {r1[i]}"):
        validate_schedule([il[0], r1], 2, 4, 2)
    # Rank 0 waits for its second chunk's gradient before running that chunk's forwards.
    r0 = [
        Action.parse(t)
        for t in (
            "F0@s0 SEND_ACT0@s0 F1@s0 SEND_ACT1@s0 RECV_ACT0@s0c1 RECV_ACT1@s0c1 RECV_GRAD0@s0c1 F0@s0c1 "
            "SEND_ACT0@s0c1 F1@s0c1 SEND_ACT1@s0c1 B0@s0c1 SEND_GRAD0@s0c1 RECV_GRAD1@s0c1 B1@s0c1 SEND_GRAD1@s0c1 "
            "RECV_GRAD0@s0 B0@s0 RECV_GRAD1@s0 B1@s0"
        ).split()
    ]
    small = interleaved_one_f_one_b(2, 2, 2)
    validate_schedule([r0, small[1]], 2, 2, 2)
    with pytest.raises(DeadlockError, match="rank 0 -> rank 1 -> rank 0") as ei:
        simulate([r0, small[1]])
    assert "RECV_GRAD0@s0c1 waits for SEND_GRAD0@s1c1; rank 1 is blocked at RECV_ACT0@s1c1" in str(ei.value)


def test_analyze_reports_the_issue_figures():
    """Bubble ratios of issue 16 (equal stages): interleaved (p-1)/(v m), ZB-H1 (p-1)/(3 m)."""
    for p, m, v in ((4, 8, 2), (8, 32, 4)):
        il = analyze(interleaved_one_f_one_b(p, m, v), forward_time=1 / v, backward_time=2 / v)
        zb = analyze(zero_bubble_h1(p, m), forward_time=1, backward_time=1, weight_time=1)
        assert il.bubble_ratio == pytest.approx((p - 1) / (v * m))
        assert zb.bubble_ratio == pytest.approx((p - 1) / (3 * m))
        assert il.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
        assert zb.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))
        assert zb.peak_activations == tuple(p - s for s in range(p))


def test_per_chunk_times_and_latency():
    """Times are per model chunk (model order): each rank computes the sum over its chunks."""
    p, m, v = 2, 4, 2
    f, b = [1.0, 2.0, 3.0, 4.0], [2.0, 4.0, 6.0, 8.0]
    sched = interleaved_one_f_one_b(p, m, v)
    res = simulate(sched, forward_time=f, backward_time=b)
    assert res.compute_time == [m * (f[0] + b[0] + f[2] + b[2]), m * (f[1] + b[1] + f[3] + b[3])]
    slow = simulate(sched, forward_time=f, backward_time=b, p2p_time=0.5)
    assert slow.makespan > res.makespan  # the first forward alone crosses 3 boundaries
    assert slow.start[Action(1, F, 0, 1)] >= f[0] + f[1] + f[2] + 3 * 0.5
    zb = zero_bubble_h1(p, m)
    split = simulate(zb, forward_time=[1.0, 1.0], backward_time=[2.0, 4.0])  # B and W halve it
    assert split.compute_time == [m * (1 + 2), m * (1 + 4)]


@settings(max_examples=60, deadline=None)
@given(pmv=sizes(), data=st.data())
def test_timing_program_replays_the_simulation_exactly(pmv, data):
    """A schedule's timing program gives :func:`simulate`'s makespan, to the float, under any
    per-chunk times, send and latency times, for every generator (``W`` halves included)."""
    p, m, v = pmv
    name, sched = data.draw(
        st.sampled_from(
            [
                ("1f1b", one_f_one_b(p, m)),
                ("interleaved", interleaved_one_f_one_b(p, m, v)),
                ("zb-h1", zero_bubble_h1(p, m)),
                ("interleaved zb", interleaved_zero_bubble(p, m, v)),
            ]
        ),
        label="schedule",
    )
    chunks = p * (v if name.startswith("interleaved") else 1)
    times = st.lists(st.floats(0.0, 5.0), min_size=chunks, max_size=chunks)
    forward, backward = data.draw(times), data.draw(times)
    weight = data.draw(st.none() | times)
    send, latency = data.draw(st.floats(0.0, 2.0)), data.draw(st.floats(0.0, 2.0))
    kwargs = dict(forward_time=forward, backward_time=backward, weight_time=weight, send_time=send, p2p_time=latency)
    program = TimingProgram.of(sched)
    assert program.makespan(**kwargs) == simulate(sched, **kwargs).makespan
    assert program.messages == sum(a.kind in (SEND_ACT, SEND_GRAD) for acts in sched for a in acts)


def test_timing_program_refuses_what_the_simulation_refuses():
    """A schedule that deadlocks or mismatches its messages raises the simulation's own error."""
    small = interleaved_one_f_one_b(2, 2, 2)
    early = "RECV_ACT0@s0c1 RECV_ACT1@s0c1 RECV_GRAD0@s0c1 F0@s0c1 SEND_ACT0@s0c1 F1@s0c1 SEND_ACT1@s0c1 B0@s0c1"
    late = "SEND_GRAD0@s0c1 RECV_GRAD1@s0c1 B1@s0c1 SEND_GRAD1@s0c1 RECV_GRAD0@s0 B0@s0 RECV_GRAD1@s0 B1@s0"
    r0 = [Action.parse(t) for t in f"F0@s0 SEND_ACT0@s0 F1@s0 SEND_ACT1@s0 {early} {late}".split()]
    stuck = [r0, small[1]]  # rank 0 waits for a gradient before the forwards that lead to it
    with pytest.raises(DeadlockError) as expected:
        simulate(stuck)
    with pytest.raises(DeadlockError) as got:
        TimingProgram.of(stuck)
    assert str(got.value) == str(expected.value)
    swapped = [list(small[0]), list(small[1])]
    first, second = (k for k, a in enumerate(swapped[1]) if a.kind == RECV_ACT and a.chunk == 0)
    swapped[1][first], swapped[1][second] = swapped[1][second], swapped[1][first]
    with pytest.raises(ScheduleError, match="matched in order"):
        TimingProgram.of(swapped)
