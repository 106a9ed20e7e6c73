"""``planner validate`` and its benchmark's statistics: control bytes, ranks, quartiles (no processes)."""

from __future__ import annotations

import math

import pytest

from cost_models.comm_cost import step_control_bytes


def test_step_control_bytes_by_hand():
    assert step_control_bytes(1, 1, 1) == 0
    assert step_control_bytes(2, 1, 1) == 16  # 2 (n-1)/n x 16 bytes over dp 2
    assert step_control_bytes(2, 2, 1) == 32
    # pp 2: norm 16 + pre-flight table 2 x 77 int64 all-reduced (2 x 1/2 x 1232) + loss broadcast 4
    assert step_control_bytes(1, 1, 2) == 16 + 1232 + 4
    assert step_control_bytes(1, 1, 4) == pytest.approx(2 * 3 / 4 * 16 + 2 * 3 / 4 * 8 * 77 * 4 + 3 / 4 * 8)


def test_spearman_and_ranks():
    from benchmarks.bench_validate import ranks, spearman

    assert ranks([3.0, 1.0, 2.0]) == [3.0, 1.0, 2.0]
    assert ranks([1.0, 2.0, 2.0, 5.0]) == [1.0, 2.5, 2.5, 4.0]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # one swapped pair among 4: rho = 1 - 6 * 2 / (4 * 15) = 0.8
    assert spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))


def test_quartile_and_summary_of_pooled_steps():
    from benchmarks.bench_validate import Row, quartile, summarize

    assert quartile([4.0, 1.0, 3.0, 2.0, 5.0]) == 2.0
    assert quartile([1.0, 2.0]) == 1.25
    keys = ("step_time_s", "peak_memory_bytes", "comm_bytes_per_device")
    rows = [
        Row(f"p{i}", dict(zip(keys, (t, 100, 10))), dict(zip(keys, (1.1 * t, 104, 10))), [t, 2 * t, 3 * t])
        for i, t in enumerate((1.0, 2.0, 3.0))
    ]
    s = summarize(rows)
    assert s["spearman_time"] == pytest.approx(1.0) and s["median_time_error"] == pytest.approx(0.1 / 1.1)
    assert s["worst_memory_error"] == pytest.approx(4 / 104) and s["worst_comm_error"] == 0
    assert s["spearman_time_median"] == pytest.approx(1.0)
    assert s["median_time_error_median"] == pytest.approx(1.0 / 2.0)  # median of [t, 2t, 3t] is 2t
    assert s["median_step_spread"] == pytest.approx(1.0)  # (3t - t) / 2t
    assert s["targets_met"]


def test_a_run_that_overlaps_otherwise_than_its_price_says_so_and_how_to_compare():
    """train/validate --overlap against plan.json ``overlap``: nothing when they agree, else what
    each overlapped and the plan flag that prices the run as launched."""
    from planner.commands.train import overlap_mismatch
    from runtime.contract.overlap import Overlap

    on = {"dp": True, "tp": True, "pp": True}
    assert overlap_mismatch(on, Overlap.from_toggle("on")) == ""
    note = overlap_mismatch(on, Overlap.from_toggle("off"))
    assert "assumed dp, tp, pp traffic overlapped" in note and "overlapped no traffic (--overlap off)" in note
    assert note.endswith("plan with --overlap off to compare like with like")
    partial = overlap_mismatch({"dp": True, "tp": False, "pp": False}, Overlap.from_toggle("on"))
    assert "assumed dp traffic" in partial and "plan with --overlap on" in partial


def test_a_communication_part_is_read_as_the_step_time_is():
    """The benchmark's measured part: the lower quartile of its per-step seconds pooled over the
    repeats (``validate --json``'s ``step_parts``), else the median of the runs' medians."""
    from benchmarks.bench_validate import _measured_part

    runs = [
        {"step_parts": [{"dp_comm": 0.010}, {"dp_comm": 0.040}], "time": {"measured": {"dp_comm": 0.025}}},
        {"step_parts": [{"dp_comm": 0.020}, {"dp_comm": 0.030}, {}], "time": {"measured": {"dp_comm": 0.020}}},
    ]
    # pooled: 0.0 (a step without the part), 0.010, 0.020, 0.030, 0.040 -> lower quartile 0.010
    assert _measured_part(runs, "dp_comm") == pytest.approx(0.010)
    older = [{"time": {"measured": {"dp_comm": seconds}}} for seconds in (0.3, 0.1, 0.2)]
    assert _measured_part(older, "dp_comm") == pytest.approx(0.2)


def test_validate_json_keeps_each_timed_steps_parts():
    from types import SimpleNamespace

    from planner.commands.validate import compare

    prediction = SimpleNamespace(step_time_s=1.0, peak_memory_bytes=10, comm_bytes_per_device=5, compression=None)
    plan = SimpleNamespace(
        predicted=prediction,
        time_of_run=lambda steps: {"dp_comm": 0.1},
        in_warmup=lambda steps: False,
        offload={"optimizer": "none", "params": "none"},
    )
    metrics = [
        {"step_time_s": 1.0 + i, "peak_memory_bytes": 9, "comm_bytes": 5, "time": {"dp_comm": 0.01 * i}}
        for i in range(5)
    ]
    got = compare(plan, metrics)
    assert got["step_parts"] == [{"dp_comm": 0.02}, {"dp_comm": 0.03}, {"dp_comm": 0.04}]
    assert got["time"]["measured"] == {"dp_comm": pytest.approx(0.03)}
