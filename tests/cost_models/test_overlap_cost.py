"""Overlapped communication is priced by its windows (``cost_models.overlap_cost``).

The unit rules by hand, a brute-force check that the per-row windows add up, and the strategy
level: overlap on against off of the same strategy, exactly ``(1 - overlap_contention) x hidden``
apart, with every part and the hidden seconds accounted for."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_models.hardware import load_hardware
from cost_models.overlap_cost import (
    COLUMN_WGRAD_SHARE,
    DpTraffic,
    Hidden,
    dp_exposure,
    grad_buckets,
    hide,
    tp_exposure,
)
from cost_models.strategy import (
    Candidate,
    NumericTable,
    _exposed_layer,
    _overlap_dp,
    candidate_costs,
    evaluate,
    hidden_breakdown,
)
from runtime.contract.limits import FIRST_BUCKET_BYTES, GRAD_BUCKET_BYTES
from runtime.contract.overlap import OVERLAP_ALL, OVERLAP_NONE, Overlap
from tests.helpers import gpt_table

HW = load_hardware("a100-80gb", 8)

seconds = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)


def test_hide_charges_what_the_window_cannot_hide():
    assert hide(3.0, 1.0) == Hidden(2.0, 1.0)
    assert hide(1.0, 3.0) == Hidden(0.0, 1.0)
    assert hide(1.0, 0.0) == Hidden(1.0, 0.0)
    # a window stretched by the slowdown, the collective slowed to its rate: gain rho (1 + kappa)
    assert hide(3.0, 1.0, gain=0.5) == Hidden(2.5, 0.5)


def test_the_window_gain_and_contention_follow_the_two_rates():
    """Over ``t`` seconds side by side the compute does ``t / (1 + kappa)`` of its work and the
    collective ``rho t`` of its: a window of ``w`` lasts ``(1 + kappa) w`` and hides
    ``rho (1 + kappa) w``, losing ``kappa w`` of compute, ``kappa / (rho (1 + kappa))`` per hidden second."""
    hw = dataclasses.replace(HW, overlap_slowdown=0.6, overlap_comm_rate=0.5)
    assert hw.overlap_window_gain == pytest.approx(0.8)
    window = 2.0
    hidden = hw.overlap_window_gain * window
    assert hw.overlap_contention * hidden == pytest.approx(0.6 * window)
    free = dataclasses.replace(HW, overlap_slowdown=0.0, overlap_comm_rate=1.0)
    assert (free.overlap_window_gain, free.overlap_contention) == (1.0, 0.0)
    with pytest.raises(Exception, match="overlap_comm_rate"):
        dataclasses.replace(HW, overlap_comm_rate=0.0)


def test_tp_without_sequence_parallelism_hides_the_backward_all_reduce_under_weight_gradients():
    seen = tp_exposure(0.4, 0.5, 0.2, (1.0, 2.0, 0.6), tp=4, sequence_parallel=False)
    assert seen.fwd == Hidden(0.4, 0.0)  # in line: the next operator needs it
    window = COLUMN_WGRAD_SHARE * 0.6
    assert seen.bwd.hidden_s == pytest.approx(window) and seen.bwd.exposed_s == pytest.approx(0.5 - window)
    assert seen.rec == Hidden(0.2, 0.0)


def test_tp_with_sequence_parallelism_exposes_about_one_chunk():
    seen = tp_exposure(0.4, 0.8, 0.2, (1.0, 2.0, 0.6), tp=4, sequence_parallel=True)
    assert seen.fwd.exposed_s == pytest.approx(0.1) and seen.fwd.hidden_s == pytest.approx(0.3)
    assert seen.bwd.exposed_s == pytest.approx(0.2)
    assert seen.rec.exposed_s == pytest.approx(0.05)  # the forward's proportion
    short = tp_exposure(0.4, 0.0, 0.0, (0.1, 0.0, 0.0), tp=4, sequence_parallel=True)
    assert short.fwd.exposed_s == pytest.approx(0.3)  # a short window hides only itself


def test_sequence_parallel_regather_hides_under_the_input_gradient_products():
    """The backward's re-gather of the saved positions hides under the column-parallel input
    gradients (``COLUMN_WGRAD_SHARE`` of backward less weight gradients); what it hides is taken
    from the chunked collectives' window, so the two never hide under the same compute."""
    passes = (1.0, 2.0, 0.6)
    window = COLUMN_WGRAD_SHARE * (2.0 - 0.6)
    alone = tp_exposure(0.4, 0.0, 0.0, passes, tp=4, sequence_parallel=True, regather_s=0.5)
    assert alone.bwd.exposed_s == pytest.approx(0.0) and alone.bwd.hidden_s == pytest.approx(0.5)
    long = tp_exposure(0.4, 0.0, 0.0, passes, tp=4, sequence_parallel=True, regather_s=1.0)
    assert long.bwd.exposed_s == pytest.approx(1.0 - window) and long.bwd.hidden_s == pytest.approx(window)
    both = tp_exposure(0.4, 1.6, 0.0, passes, tp=4, sequence_parallel=True, regather_s=1.0)
    # the chunked reduce-scatters keep 2.0 - window of backward: 1.6 - (2.0 - window) exposed
    assert both.bwd.exposed_s == pytest.approx((1.0 - window) + (1.6 - (2.0 - window)))
    assert both.bwd.hidden_s == pytest.approx(2.0)  # all the backward's compute, never more
    base = tp_exposure(0.4, 0.8, 0.2, passes, tp=4, sequence_parallel=True)
    assert base == tp_exposure(0.4, 0.8, 0.2, passes, tp=4, sequence_parallel=True, regather_s=0.0)


def _serial_bounds(traffic, fwd, bwd):
    """The backward-window exposure of ZeRO 0/1 reductions on one serial channel, brute force:
    row ``l``'s reduction starts when its backward ends (rows run n-1 .. 0) and waits for the
    channel; returns the time after backward ends until the channel is idle."""
    n = len(traffic)
    clock, channel = 0.0, 0.0
    for row in reversed(range(n)):
        clock += bwd[row]
        channel = max(channel, clock) + traffic[row].grad_step_s
    return max(channel - clock, 0.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(seconds, seconds, seconds), min_size=2, max_size=8))
def test_dp_windows_conserve_the_traffic_and_bound_the_serial_channel(rows):
    traffic = [DpTraffic(grad_step_s=c, grad_bytes=GRAD_BUCKET_BYTES) for c, _, _ in rows]
    fwd = [f for _, f, _ in rows]
    bwd = [b for _, _, b in rows]
    seen = dp_exposure(traffic, fwd, bwd, uniform_blocks=False)
    exposed = sum(row.step.exposed_s for row in seen)
    hidden = sum(row.step.hidden_s for row in seen)
    assert exposed + hidden == pytest.approx(sum(t.grad_step_s for t in traffic))
    assert exposed >= traffic[0].grad_step_s - 1e-12  # row 0's reduction has no window
    # each reduction only uses its own window: never less than one serial channel exposes
    assert exposed >= _serial_bounds(traffic, fwd, bwd) - 1e-9


@settings(max_examples=40, deadline=None)
@given(
    st.tuples(seconds, seconds, seconds, seconds, seconds),
    st.tuples(seconds, seconds),
    st.integers(min_value=5, max_value=9),
)
def test_uniform_blocks_keep_one_cost_and_the_same_total(block, ends, n):
    def traffic_of(t):
        return DpTraffic(*t, grad_bytes=GRAD_BUCKET_BYTES)

    rows = [traffic_of((ends[0],) * 5)] + [traffic_of(block)] * (n - 2) + [traffic_of((ends[1],) * 5)]
    fwd = [0.1] + [0.3] * (n - 2) + [0.5]
    bwd = [0.2] + [0.6] * (n - 2) + [1.0]
    exact = dp_exposure(rows, fwd, bwd, uniform_blocks=False)
    even = dp_exposure(rows, fwd, bwd, uniform_blocks=True)
    assert len({even[j] for j in range(1, n - 2)}) == 1
    for part in ("step", "micro_batch"):
        for kind in ("exposed_s", "hidden_s"):
            total = sum(getattr(getattr(row, part), kind) for row in exact)
            assert sum(getattr(getattr(row, part), kind) for row in even) == pytest.approx(total)


def _pair(cand: Candidate, hw=HW, layers=6):
    table = NumericTable(gpt_table(layers=layers, hidden=1024, heads=16))
    out = []
    for overlap in (OVERLAP_ALL, OVERLAP_NONE):
        costs = candidate_costs(table, hw, "bf16", 512, dataclasses.replace(cand, overlap=overlap), 8, 1e15)
        stages = [(0, 3), (4, layers + 1)] if cand.pp == 2 else [(0, layers + 1)]
        out.append(evaluate(costs, stages, [2]))
    return out


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("slowdown", [0.0, 0.15])
def test_overlap_takes_exactly_the_hidden_seconds_less_their_contention(zero, tp, sp, slowdown):
    hw = dataclasses.replace(HW, overlap_slowdown=slowdown)
    contention = hw.overlap_contention
    cand = Candidate(4 if tp == 1 else 2, tp, 1, zero, 2, 4, sequence_parallel=sp)
    on, off = _pair(cand, hw)
    hidden = hidden_breakdown(on)
    assert hidden_breakdown(off) == {"tp_comm": 0.0, "recompute": 0.0, "dp_comm": 0.0, "cp_comm": 0.0}
    assert (hidden["recompute"] > 0) == sp  # only chunked forwards hide any of their traffic
    assert hidden["dp_comm"] > 0 and (hidden["tp_comm"] > 0) == (tp > 1)
    assert on.step_time_s == pytest.approx(off.step_time_s - (1 - contention) * sum(hidden.values()), rel=1e-9)
    assert sum(on.time.values()) == pytest.approx(on.step_time_s, rel=1e-9)
    # exposed + hidden: the synchronous traffic; a recomputed forward's TP collectives are
    # tp_comm where exposed (the runtime times them there), "recompute" where hidden
    assert on.time["dp_comm"] + hidden["dp_comm"] == pytest.approx(off.time["dp_comm"], rel=1e-9)
    tp_traffic = on.time["tp_comm"] + hidden["tp_comm"] + hidden["recompute"]
    assert tp_traffic == pytest.approx(off.time["tp_comm"], rel=1e-9)
    # the compute parts differ by the contention of what is hidden, and nothing else
    busy_on, busy_off = (run.time["compute"] + run.time["recompute"] for run in (on, off))
    assert busy_on == pytest.approx(busy_off + contention * sum(hidden.values()), rel=1e-9)
    assert on.memory == off.memory and on.comm_bytes_per_device == off.comm_bytes_per_device


def test_each_kind_of_traffic_overlaps_on_its_own_switch():
    cand = Candidate(2, 2, 1, 1, 2, 4)
    table = NumericTable(gpt_table(layers=4, hidden=1024, heads=16))
    hidden = {}
    for overlap in (Overlap(dp=True, tp=False, pp=False), Overlap(dp=False, tp=True, pp=False)):
        costs = candidate_costs(table, HW, "bf16", 512, dataclasses.replace(cand, overlap=overlap), 8, 1e15)
        hidden[overlap.dp] = hidden_breakdown(evaluate(costs, [(0, 5)], []))
    assert hidden[True]["tp_comm"] == 0 and hidden[True]["dp_comm"] > 0
    assert hidden[False]["dp_comm"] == 0 and hidden[False]["tp_comm"] > 0


def test_a_request_may_set_each_kind_of_overlap():
    """``--overlap on|off`` sets the three kinds; a program may pin them one by one (an
    ``Overlap`` or plan.json's object), priced as given and written to plan.json as given."""
    from planner.search.request import PlanRequest
    from planner.search.search_errors import SearchError
    from planner.search.solve import solve

    base = dict(spec="gpt", gpus=4, gpus_per_node=4, hardware="a100-80gb", global_batch=8, seq_len=512)
    base.update(dtype="bf16", compile="off", tp=2, dp=2, pp=1, zero_stage=1)
    table = gpt_table(layers=4, hidden=1024, heads=16)
    only_tp = Overlap(dp=False, tp=True, pp=False)
    plans = {
        name: solve(PlanRequest(**base, overlap=setting), table, HW).plan
        for name, setting in (("object", only_tp), ("json", only_tp.to_json()), ("off", "off"))
    }
    assert plans["object"].overlap == plans["json"].overlap == only_tp.to_json()
    assert plans["object"].predicted.step_time_s == plans["json"].predicted.step_time_s
    assert plans["object"].predicted.hidden["dp_comm"] == 0 < plans["object"].predicted.hidden["tp_comm"]
    assert plans["object"].predicted.step_time_s < plans["off"].predicted.step_time_s
    with pytest.raises(SearchError, match="--overlap must be on or off"):
        PlanRequest(**base, overlap={"tp": "yes"})


def test_small_layers_share_a_bucket_launched_at_its_last_layer():
    """A 4-block model of 3 MiB layers and 8 MiB ends: the head alone (above the 1 MiB first cap),
    then the blocks and the embedding together (20.6 MiB < 25 MiB), launched only when the embedding's
    backward ends: all of it exposed, none hidden under the blocks it waited for."""
    mib = 2**20
    sizes = [8 * mib] + [3.1 * mib] * 4 + [8 * mib]
    traffic = [DpTraffic(grad_step_s=size / (1000 * mib), grad_bytes=size) for size in sizes]
    assert grad_buckets(traffic) == [[5], [4, 3, 2, 1, 0]]
    bwd = [0.03] * 6
    seen = dp_exposure(traffic, [0.01] * 6, bwd, uniform_blocks=True)
    total = sum(t.grad_step_s for t in traffic)
    head = traffic[5].grad_step_s
    assert seen[4].step.hidden_s == pytest.approx(head)  # under the last block, the row below the head
    assert seen[0].step.exposed_s == pytest.approx(total - head)  # the rest waits for row 0
    assert sum(row.step.exposed_s + row.step.hidden_s for row in seen) == pytest.approx(total)
    # each layer its own bucket (25 MiB or more): the per-row windows
    large = [t._replace(grad_bytes=GRAD_BUCKET_BYTES) for t in traffic]
    assert grad_buckets(large) == [[j] for j in reversed(range(6))]
    assert dp_exposure(large, [0.01] * 6, bwd, uniform_blocks=False)[0].step.exposed_s == traffic[0].grad_step_s


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(seconds, seconds, st.integers(min_value=0, max_value=2 * GRAD_BUCKET_BYTES)), min_size=2, max_size=10
    )
)
def test_buckets_follow_the_runtime_and_conserve_the_traffic(rows):
    traffic = [DpTraffic(grad_step_s=c, grad_bytes=size) for c, _, size in rows]
    bwd = [b for _, b, _ in rows]
    buckets = grad_buckets(traffic)
    flat = [row for bucket in buckets for row in bucket]
    assert flat == sorted(flat, reverse=True) and set(flat) == {
        j for j, t in enumerate(traffic) if t.grad_bytes or t.grad_step_s
    }
    for k, bucket in enumerate(buckets):
        cap = FIRST_BUCKET_BYTES if k == 0 else GRAD_BUCKET_BYTES
        assert len(bucket) == 1 or sum(traffic[j].grad_bytes for j in bucket) <= cap
    seen = dp_exposure(traffic, [0.0] * len(rows), bwd, uniform_blocks=False)
    assert sum(row.step.exposed_s + row.step.hidden_s for row in seen) == pytest.approx(sum(c for c, _, _ in rows))
    # a bucket hides at most the backward that runs between its launch and the next one's
    for k, bucket in enumerate(buckets):
        launch, stop = bucket[-1], (buckets[k + 1][-1] if k + 1 < len(buckets) else 0)
        if launch > 0:
            assert seen[launch - 1].step.hidden_s <= sum(bwd[stop:launch]) + 1e-12
    if buckets and buckets[-1][-1] == 0:  # the bucket launched by row 0 has no window
        assert seen[0].step.exposed_s >= sum(traffic[j].grad_step_s for j in buckets[-1]) - 1e-12


def test_a_compressed_plan_overlaps_its_warm_up_only():
    """1-bit Adam's compressed steps wait their exchange in the step; its full-precision warm-up
    runs the same overlapped reductions as the uncompressed plan."""
    from cost_models.strategy import warmup_time

    cand = Candidate(2, 1, 1, 0, 2, 4, dp_compression="onebit-adam")
    plain = dataclasses.replace(cand, dp_compression="none")
    on, off = _pair(cand)
    uncompressed, _ = _pair(plain)
    assert warmup_time(on)["dp_comm"] < warmup_time(off)["dp_comm"]
    assert warmup_time(on)["dp_comm"] == pytest.approx(uncompressed.time["dp_comm"], rel=1e-9)
    assert warmup_time(on)["compute"] == pytest.approx(uncompressed.time["compute"], rel=1e-9)


def test_offloaded_and_compressed_traffic_stays_exposed():
    for cand in (
        Candidate(2, 1, 1, 2, 2, 4, offload_optimizer="cpu"),
        Candidate(2, 1, 1, 0, 2, 4, dp_compression="onebit-adam"),
    ):
        on, off = _pair(cand)
        assert hidden_breakdown(on)["dp_comm"] == 0
        assert on.time["dp_comm"] == pytest.approx(off.time["dp_comm"])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(seconds, seconds, st.booleans()), min_size=1, max_size=10))
def test_one_row_buckets_take_the_short_path_to_the_same_shares(rows):
    """Layers of 25 MiB or more skip the bucket walk (the per-row rule), rows without a
    gradient (no parameters) in between included: the same shares as the walk."""
    from cost_models.overlap_cost import _many_row_reductions, _one_row_reduction

    traffic = [
        DpTraffic(grad_step_s=c, grad_bytes=GRAD_BUCKET_BYTES) if carries else DpTraffic() for c, _, carries in rows
    ]
    bwd = [b for _, b, _ in rows]
    walked = _many_row_reductions(traffic, bwd)
    for j in range(len(rows)):
        short = _one_row_reduction(j, traffic, bwd)
        assert short.exposed_s == pytest.approx(walked[j].exposed_s)
        assert short.hidden_s == pytest.approx(walked[j].hidden_s)


@pytest.mark.parametrize("zero", [0, 1])
def test_a_compressed_plans_warm_up_peak_is_the_uncompressed_plans(zero):
    """Before the first compressed step the runtime holds no error buffers and, at ZeRO-1, the
    optimizer state still sharded: the warm-up's peak is the uncompressed strategy's."""
    from cost_models.strategy import warmup_peak_bytes

    cand = Candidate(2, 1, 1, zero, 2, 4, dp_compression="onebit-adam")
    on, _ = _pair(cand)
    plain, _ = _pair(dataclasses.replace(cand, dp_compression="none"))
    assert on.memory["total"] > plain.memory["total"]
    assert warmup_peak_bytes(on) == pytest.approx(plain.memory["total"], rel=1e-4)


def test_zero_1_2_gathers_run_on_one_channel_from_the_optimizer_step_to_their_first_use():
    """``step()`` launches row ``j``'s gather after row ``j``'s update; the gathers share one
    channel in launch order; the next forward starts when the updates end and waits at each
    row's first use. By hand: updates of 0.5 s each end at 2 s; the gathers (4, 1, 2, 1 s) end
    at 4.5, 5.5, 7.5 and 8.5 s; row 0 waits 2.5 s, row 1 none (5.5 s: 2 + 2.5 + row 0's 1 s),
    row 2 one second (its gather ends at 7.5, the forward reaches it at 6.5), row 3 none."""
    traffic = [DpTraffic(gather_step_s=c) for c in (4.0, 1.0, 2.0, 1.0)]
    fwd, bwd, update = [1.0, 1.0, 1.0, 0.2], [0.0] * 4, [0.5, 0.5, 0.5, 0.5]
    seen = dp_exposure(traffic, fwd, bwd, uniform_blocks=False, update=update)
    assert [row.step for row in seen] == [Hidden(2.5, 1.5), Hidden(0.0, 1.0), Hidden(1.0, 1.0), Hidden(0.0, 1.0)]
    # without the updates (nothing known of the optimizer) only the forward hides them
    alone = dp_exposure(traffic, fwd, bwd, uniform_blocks=False)
    assert [row.step.exposed_s for row in alone] == [4.0, 0.0, 1.0, 0.0]


@settings(max_examples=40, deadline=None)
@given(st.tuples(seconds, seconds), st.tuples(seconds, seconds), st.integers(min_value=5, max_value=9))
def test_uniform_blocks_keep_one_gather_share_whatever_the_buckets(ends, block, n):
    """ZeRO 1/2 gathers of identical blocks keep one share per block (the block-count ILP needs
    identical rows), with the same total as row-by-row, also when small layers share buckets."""
    small = GRAD_BUCKET_BYTES / 8  # several rows per bucket (their reductions free: gathers alone)
    rows = (
        [DpTraffic(gather_step_s=ends[1], grad_bytes=small)]
        + [DpTraffic(gather_step_s=block[1], grad_bytes=small)] * (n - 2)
        + [DpTraffic(gather_step_s=ends[0], grad_bytes=small)]
    )
    fwd = [0.1] + [block[0]] * (n - 2) + [0.5]
    bwd = [0.2] + [0.6] * (n - 2) + [1.0]
    update = [0.3] + [0.05] * (n - 2) + [0.01]
    exact = dp_exposure(rows, fwd, bwd, uniform_blocks=False, update=update)
    even = dp_exposure(rows, fwd, bwd, uniform_blocks=True, update=update)
    assert len({row.step for row in even[1 : n - 2]}) == 1
    total = sum(row.step.exposed_s + row.step.hidden_s for row in exact)
    assert sum(row.step.exposed_s + row.step.hidden_s for row in even) == pytest.approx(total)


@settings(max_examples=30, deadline=None)
@given(
    st.integers(min_value=5, max_value=12),
    st.tuples(seconds, seconds, seconds, seconds, seconds),
    st.sampled_from(["identical", "equal", "one differs"]),
)
def test_repeated_blocks_are_priced_once_as_every_row_would_be(n, block_traffic, blocks):
    """``strategy._overlap_dp``'s shortcut for a steady block (rows ``1 .. n-3`` one object, and
    its traffic one row) against the definition row by row: each row's costs from
    ``dp_exposure`` of every row's windows."""
    table = NumericTable(gpt_table(layers=4, hidden=256, heads=4))
    template = candidate_costs(table, HW, "bf16", 128, Candidate(2, 1, 1, 1, 1, 4), 8, 1e15).layers[1]
    first, last, block = (template.but(fwd_s=f, compute_s=3 * f, opt_s=f / 2) for f in (0.01, 0.02, 0.03))
    layers = [first] + [block if blocks == "identical" else block.but() for _ in range(n - 3)] + [last, first]
    if blocks == "one differs":
        layers[2] = block.but(fwd_s=0.04)
    traffic = (
        [DpTraffic(0.01, 0.02, 0.0, 0.0, 0.0, GRAD_BUCKET_BYTES)]
        + [DpTraffic(*block_traffic, grad_bytes=GRAD_BUCKET_BYTES)] * (n - 3)
        + [DpTraffic(0.005, 0.001, 0.0, 0.0, 0.0, GRAD_BUCKET_BYTES)] * 2
    )
    gain = HW.overlap_window_gain
    seen = dp_exposure(
        traffic,
        [gain * layer.fwd_s for layer in layers],
        [gain * (layer.compute_s - layer.fwd_s) for layer in layers],
        blocks != "one differs",
        [gain * layer.opt_s for layer in layers],
    )
    expected = [_exposed_layer(*row, HW.overlap_contention) for row in zip(layers, traffic, seen)]
    got = _overlap_dp(layers, traffic, HW)
    assert got == expected
    if blocks != "one differs":
        assert all(row is got[1] for row in got[1 : n - 2])
