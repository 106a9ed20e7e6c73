"""`planner calibrate`: the alpha-beta fit and the profile built from raw measurements (no processes)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_models.comm_cost import ring_terms
from cost_models.hardware import load_hardware
from planner.commands.calibrate import (
    CalibrationError,
    CalibrationSpec,
    build_profile,
    fit_alpha_beta,
    run_calibration,
    sync_overhead,
)

SIZES = (4096, 65536, 1 << 20, 1 << 24)


@settings(max_examples=40, deadline=None)
@given(
    alpha=st.floats(1e-7, 1e-3),
    bw=st.floats(1e8, 1e12),
    n=st.integers(2, 16),
)
def test_fit_recovers_exact_alpha_beta(alpha, bw, n):
    samples = []
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "send"):
        m = 2 if kind == "send" else n
        for s in SIZES:
            steps, link = ring_terms(kind, s, m)
            samples.append((steps, link, steps * alpha + link / bw))
    a, b = fit_alpha_beta(samples)
    assert a == pytest.approx(alpha, rel=1e-6)
    assert b == pytest.approx(bw, rel=1e-6)


def test_fit_clamps_negative_latency_and_rejects_flat_times():
    # Times exactly proportional to bytes, minus a little: the free fit would give alpha < 0.
    samples = [(1, s, s / 1e9 - 1e-7) for s in (1e5, 1e6, 1e7)]
    a, b = fit_alpha_beta(samples)
    assert a == 0.0 and b == pytest.approx(1e9, rel=1e-2)
    with pytest.raises(CalibrationError, match="could not fit a bandwidth"):
        fit_alpha_beta([(1, 1e3, 1e-3), (1, 1e6, 1e-4)])
    with pytest.raises(CalibrationError, match="need at least 2 timed messages"):
        fit_alpha_beta([(1, 1e3, 1e-3)])


def test_sync_overhead_reads_the_least_waiting_rank_and_means_over_rounds():
    # Round 1: rank 1 waited 5 ms a call (it arrived first), rank 0 3 ms: the critical rank is 0.
    in_loop = [[3e-3, 5e-3], [4e-3, 2e-3]]
    alone = [[1e-3, 1e-3], [2e-3, 2e-3]]
    assert sync_overhead(in_loop, alone) == pytest.approx((3e-3 + 2e-3) / 2 - (1e-3 + 2e-3) / 2)
    # A sample of two modes (a call returns at once or a 4 ms scheduler tick later): the mean
    # follows the share of slow calls, where a median would jump from one mode to the other.
    fast, slow = 1e-3, 5e-3
    mostly_fast = [[fast, fast]] * 6 + [[slow, slow]] * 4
    mostly_slow = [[fast, fast]] * 4 + [[slow, slow]] * 6
    back_to_back = [[fast, fast]] * 10
    assert sync_overhead(mostly_fast, back_to_back) == pytest.approx(0.4 * (slow - fast))
    assert sync_overhead(mostly_slow, back_to_back) == pytest.approx(0.6 * (slow - fast))
    # Never below zero: a loop that waited less than the calls alone took costs nothing extra.
    assert sync_overhead([[1e-3, 1e-3]], [[2e-3, 2e-3]]) == 0.0


def _raw(alpha=5e-5, bw=2e9, bf16_ok=True):
    colls = []
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "send"):
        for s in SIZES:
            steps, link = ring_terms(kind, s, 2)
            colls.append({"kind": kind, "size_bytes": s, "n": 2, "seconds": steps * alpha + link / bw})
    nan = float("nan")
    return {
        "matmul": {
            "fp32": {"128": 4e10, "256": 5e10},
            "bf16": {"128": 8e10 if bf16_ok else nan, "256": 9e10 if bf16_ok else nan},
            "fp16": {"128": 3e10, "256": 2e10},
        },
        "memory_bandwidth": 7e9,
        "collectives": colls,
    }


def test_build_profile_from_raw_measurements(tmp_path):
    base = load_hardware("cpu")
    p = build_profile(_raw(), 2, base, CalibrationSpec.quick())
    assert p.peak_flops == {"fp32": 5e10, "bf16": 9e10, "fp16": 3e10}
    assert p.intra_node_latency == pytest.approx(5e-5) and p.intra_node_bandwidth == pytest.approx(2e9)
    assert (p.inter_node_latency, p.inter_node_bandwidth) == (p.intra_node_latency, p.intra_node_bandwidth)
    assert p.gpus_per_node == 2 and p.compute_efficiency == 1.0 and p.memory_bandwidth == 7e9
    # every kind's own fit lands in intra_node_collectives (here all kinds share one link)
    assert set(p.intra_node_collectives) == {"all_reduce", "all_gather", "reduce_scatter", "send"}
    for link in p.intra_node_collectives.values():
        assert link["latency"] == pytest.approx(5e-5) and link["bandwidth"] == pytest.approx(2e9)
    assert p.sync_overhead_s == 0.0
    # the recompute ratio: 1 when unmeasured, kept to (0.25, 1.5] when a timing went wild
    assert p.recompute_ratio == 1.0
    for raw, want in ((0.82, 0.82), (-0.3, 0.25), (7.0, 1.5), (float("nan"), 1.0)):
        assert (
            build_profile(dict(_raw(), recompute_ratio=raw), 2, base, CalibrationSpec.quick()).recompute_ratio == want
        )
    assert (
        build_profile(dict(_raw(), sync_overhead_s=1.5e-3), 2, base, CalibrationSpec.quick()).sync_overhead_s == 1.5e-3
    )
    # the contention factor: measured when the ranks measured it, else the base profile's
    assert p.overlap_slowdown == base.overlap_slowdown
    measured = dict(_raw(), overlap={"compute_alone_s": 0.1, "compute_beside_s": 0.13, "overlap_slowdown": 0.3})
    r = build_profile(measured, 2, base, CalibrationSpec.quick())
    assert r.overlap_slowdown == 0.3 and r.calibration["overlap"]["compute_beside_s"] == 0.13
    # A dtype that failed everywhere keeps the base profile's ratio to fp32; NaN is stored as null.
    q = build_profile(_raw(bf16_ok=False), 2, base, CalibrationSpec.quick())
    assert q.peak("bf16") == pytest.approx(5e10 * base.peak("bf16") / base.peak("fp32"))
    path = q.save(tmp_path / "q.json")
    assert json.loads(path.read_text())["calibration"]["matmul_flops"]["bf16"]["128"] is None


def test_nproc_must_be_at_least_two(tmp_path):
    with pytest.raises(CalibrationError, match=r"calibrate needs --nproc >= 2 .*\(got 1\)"):
        run_calibration(1, tmp_path / "p.json", progress=False)


def _with_gemm_table(raw: dict, efficiency: float) -> dict:
    """``raw`` with a 2 x 2 x 2 grid whose every fp32 product reached ``efficiency`` of the 5e10 peak."""
    axis = [64, 512]
    seconds = [[[2.0 * m * n * k / (5e10 * efficiency) for k in axis] for n in axis] for m in axis]
    return dict(raw, gemm={"sizes": {"m": axis, "n": axis, "k": axis}, "seconds": {"fp32": seconds}})


def test_gemm_table_is_scaled_so_the_steps_products_take_their_measured_time():
    from cost_models.gemm_cost import gemm_flops, layer_gemm_time

    base = load_hardware("cpu")
    # The grid says every product alone reaches 0.95 of the peak; the steps ran their FLOPs at 0.7.
    products = [[512.0, 512.0, 512.0, 1.0, 3.0], [64.0, 512.0, 512.0, 2.0, 1.0]]
    raw = dict(_with_gemm_table(_raw(), 0.95), train_step_flops=0.7 * 5e10, train_products=products)
    profile = build_profile(raw, 2, base, CalibrationSpec.quick())
    assert profile.compute_efficiency == pytest.approx(0.7)
    assert profile.calibration["gemm_in_step_scale"] == pytest.approx(0.7 / 0.95)
    # priced by the scaled table, the steps' products take their FLOPs at peak * compute_efficiency
    assert layer_gemm_time(products, profile, "fp32") == pytest.approx(gemm_flops(products) / (0.7 * 5e10))
    # the raw timings stay in the record; without products the measured table stands as it is
    assert profile.calibration["gemm"]["seconds"]["fp32"] == raw["gemm"]["seconds"]["fp32"]
    unscaled = build_profile(dict(raw, train_products=None), 2, base, CalibrationSpec.quick())
    assert unscaled.gemm_efficiency["fp32"]["efficiency"][0][0][0] == pytest.approx(0.95)


def test_gemm_table_scaling_keeps_the_shapes_relative_standing():
    base = load_hardware("cpu")
    raw = _with_gemm_table(_raw(), 1.0)
    raw["gemm"]["seconds"]["fp32"][0][0][0] *= 4  # the 64^3 product alone reached only 0.25
    products = [[512.0, 512.0, 512.0, 1.0, 1.0]]
    profile = build_profile(
        dict(raw, train_step_flops=0.5 * 5e10, train_products=products), 2, base, CalibrationSpec.quick()
    )
    table = profile.gemm_efficiency["fp32"]["efficiency"]
    assert table[1][1][1] == pytest.approx(0.5) and table[0][0][0] == pytest.approx(0.125)
