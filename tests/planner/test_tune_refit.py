"""``planner tune``'s pure parts: the least-squares fit, the scaled profile, the profile refit
against a toy cost model, and what a trial's outcome is called."""

from __future__ import annotations

import dataclasses

import pytest

from cost_models.hardware import load_hardware
from planner.commands.tune import Refit, fit_bounded, refit_profile, scaled_profile, trial_status

CPU = load_hardware("cpu")

#: Three strategies of a toy model: FLOPs, operator calls, all-reduce calls and bytes per step.
STRATEGIES = [
    dict(flops=4e9, ops=900, calls=0, nbytes=0.0),
    dict(flops=3e9, ops=2400, calls=40, nbytes=8e6),
    dict(flops=5e9, ops=1300, calls=12, nbytes=2e7),
    dict(flops=2e9, ops=1800, calls=90, nbytes=1e6),
]


def toy_price(hw):
    """A cost model of the same form as ``cost_models.strategy`` on a CPU: FLOP time plus a cost
    per operator call; all-reduces by latency, bandwidth and the sync cost."""
    out = []
    for s in STRATEGIES:
        compute = s["flops"] / hw.achievable_flops("fp32") + s["ops"] * hw.op_overhead_s
        comm = s["calls"] * (hw.intra_node_latency + hw.sync_overhead_s) + s["nbytes"] / hw.intra_node_bandwidth
        out.append(
            {"compute": compute, "recompute": 0.0, "tp_comm": comm, "pp_bubble": 0.0, "dp_comm": 0.0, "optimizer": 1e-3}
        )
    return out


def measured_on(hw, breakdown=True):
    return [{"step_time_s": sum(p.values()), "time": p if breakdown else None} for p in toy_price(hw)]


def test_fit_bounded_recovers_two_unknowns_and_respects_bounds():
    rows = [(3 + 2 * a + 5 * b, 3.0, (a, b)) for a, b in ((1, 0.1), (2, 0.5), (0.5, 2.0))]
    assert fit_bounded(rows, lower=(0, 0), keep=(1, 1)) == pytest.approx([2, 5])
    # Columns the rows cannot tell apart: the second unknown keeps its value, the first is fit.
    same = [(1 + 2 * a + 3 * a, 1.0, (a, a)) for a in (1.0, 2.0, 4.0)]
    assert fit_bounded(same, lower=(0, 0), keep=(1, 3)) == pytest.approx([2, 3])
    # Two rows determine two unknowns exactly, noise and all: only the first is fit, the second kept.
    first = fit_bounded([(y, c + 0.5 * a[1], (a[0],)) for y, c, a in rows[:2]], lower=(0,), keep=(1,))[0]
    assert fit_bounded(rows[:2], lower=(0, 0), keep=(1, 0.5)) == pytest.approx([first, 0.5])
    # A joint solution outside the bounds: the second keeps its value, the first is fit.
    neg = [(1 + 2 * a - 1 * b, 1.0, (a, b)) for a, b in ((1, 0.2), (2, 1.5), (0.5, 3.0))]
    x = fit_bounded(neg, lower=(0, 0), keep=(1, 0))
    assert x[1] == 0 and x[0] > 0
    assert fit_bounded([(4.0, 0.0, (2.0,))], lower=(0,), keep=(1,)) == pytest.approx([2])
    assert fit_bounded([(4.0, 0.0, (-2.0,))], lower=(0.5,), keep=(1,)) == [0.5]


def test_scaled_profile():
    slow = scaled_profile(CPU, flops=2.0, op_overhead_s=3e-5, links=4.0, sync_overhead_s=1e-4)
    assert slow.compute_efficiency == pytest.approx(CPU.compute_efficiency / 2)
    assert slow.op_overhead_s == 3e-5 and slow.sync_overhead_s == 1e-4
    assert slow.intra_node_bandwidth == pytest.approx(CPU.intra_node_bandwidth / 4)
    assert slow.intra_node_latency == pytest.approx(CPU.intra_node_latency * 4)
    assert slow.peak_flops == CPU.peak_flops
    # Faster than the datasheet allows: efficiency 1 and every peak raised, the rate as fit.
    fast = scaled_profile(CPU, flops=0.5)
    assert fast.compute_efficiency == 1.0
    assert fast.achievable_flops("fp32") == pytest.approx(CPU.achievable_flops("fp32") * 2)
    assert scaled_profile(CPU) is CPU


def test_refit_recovers_the_machine_from_the_time_breakdown():
    truth = scaled_profile(CPU, flops=3.0, op_overhead_s=4e-5, links=5.0, sync_overhead_s=3e-4)
    fit = refit_profile(CPU, measured_on(truth), toy_price)
    assert fit.flops_scale == pytest.approx(3.0, rel=1e-6)
    assert fit.op_overhead_s == pytest.approx(4e-5, rel=1e-6)
    assert fit.link_scale == pytest.approx(5.0, rel=1e-6)
    assert fit.sync_overhead_s == pytest.approx(3e-4, rel=1e-6)
    assert fit.profile.compute_efficiency == pytest.approx(truth.compute_efficiency)
    assert fit.error_after == pytest.approx(0, abs=1e-9) and fit.error_before > 0.5
    assert fit.after == pytest.approx(fit.measured)


def test_refit_from_step_times_alone_fits_compute():
    truth = scaled_profile(CPU, flops=2.0, op_overhead_s=2e-5)
    fit = refit_profile(CPU, measured_on(truth, breakdown=False), toy_price)
    assert fit.link_scale is None and fit.notes
    assert fit.flops_scale == pytest.approx(2.0, rel=1e-6)
    assert fit.op_overhead_s == pytest.approx(2e-5, rel=1e-6)
    assert fit.error_after < 1e-9 < fit.error_before


def test_refit_of_one_trial_keeps_what_it_cannot_separate():
    truth = scaled_profile(CPU, flops=2.0, op_overhead_s=3e-5, links=3.0, sync_overhead_s=1e-4)
    fit = refit_profile(CPU, measured_on(truth)[1:2], lambda hw: toy_price(hw)[1:2])
    # One trial, two unknowns per fit: the operator and sync costs keep the profile's (0), the
    # FLOP and link scales absorb them, and the one trial is predicted exactly.
    assert fit.op_overhead_s == 0 and fit.sync_overhead_s == 0
    assert fit.flops_scale > 2 and fit.link_scale > 3
    assert fit.after == pytest.approx(fit.measured)


def test_refit_with_no_measured_trial_is_none():
    assert refit_profile(CPU, [{"step_time_s": None}], toy_price) is None


def test_refit_error():
    assert Refit.error([1.0, 3.0], [2.0, 2.0]) == pytest.approx(0.5)


@pytest.mark.parametrize(
    "finished, error, timed_out, peak, status",
    [
        (True, None, False, 100, "ok"),
        (True, None, False, 1000, "out of memory"),
        (False, "rank 1 was lost: its process was killed by SIGKILL", False, None, "crashed"),
        (False, "did not finish within --timeout 5 s (stopped)", True, None, "timeout"),
        (False, "rank 0 failed: RuntimeError: Timed out waiting 5000ms for recv operation", False, None, "timeout"),
        (False, "rank 0 failed: OutOfMemoryError: CUDA out of memory. Tried to allocate", False, None, "out of memory"),
    ],
)
def test_trial_status(finished, error, timed_out, peak, status):
    assert trial_status(finished, error, timed_out, peak, capacity=500) == status


def test_candidate_plans_and_the_refits_price_are_the_plans_predictions():
    from planner.cli import build_parser
    from planner.commands.plan_command import layer_table_for, plan_from_request, request_from_args
    from planner.commands.tune import _pricer
    from planner.search.solve import candidate_plans

    args = build_parser().parse_args(
        [
            "plan",
            "--model",
            "gpt",
            "--layers",
            "2",
            "--hidden",
            "64",
            "--heads",
            "2",
            "--vocab",
            "256",
            "--seq-len",
            "32",
            "--global-batch",
            "4",
            "--dtype",
            "fp32",
            "--gpus",
            "2",
            "--hardware",
            "cpu",
        ]
    )
    req = request_from_args(args)
    table = layer_table_for(req)
    solution, hw = plan_from_request(req, table)
    plans = candidate_plans(req, table, hw, solution, 3)
    assert plans[0] is solution.plan and len(plans) == 3
    kept = [solution.search.best] + solution.search.alternatives(3)
    for p, ev in zip(plans, kept):
        c = ev.strategy.candidate
        assert (p.dp, p.tp, p.pp, p.zero_stage, p.micro_batch_size) == (
            c.dp,
            c.tp,
            c.pp,
            c.zero_stage,
            c.micro_batch_size,
        )
        assert p.predicted.step_time_s == pytest.approx(ev.step_time_s)
        assert all(a.step_time_s >= p.predicted.step_time_s for a in p.alternatives)
    priced = _pricer(req, table, hw, [ev.strategy for ev in kept[:3]])(hw)
    for p, parts in zip(plans, priced):
        assert parts == pytest.approx(p.predicted.time)
    assert len(candidate_plans(req, table, hw, solution, 1)) == 1


@pytest.mark.parametrize("overlap", [{"dp": True, "tp": True, "pp": True}, {"dp": False, "tp": False, "pp": False}])
def test_a_trial_runs_with_the_overlap_its_plan_was_priced_with(tmp_path, monkeypatch, sample_plan_dict, overlap):
    from planner.commands import tune
    from planner.plan import Plan

    plan = Plan.from_dict({**sample_plan_dict, "overlap": overlap})
    seen = {}

    def fake_train(plan, path, opts, **kwargs):
        seen["overlap"] = opts.overlap
        return 1  # failed: nothing else to measure

    monkeypatch.setattr(tune, "train_plan", fake_train)
    tune._run_trial(tune.Trial(1, plan), str(tmp_path), 3, 60.0, 1e12, None)
    assert seen["overlap"] == ("on" if overlap["dp"] else "off")


def test_scaled_profile_scales_a_measured_gemm_table_with_the_flop_rate():
    from cost_models.gemm_cost import layer_gemm_time

    axis = [64, 512]
    table = {"m": axis, "n": axis, "k": axis, "efficiency": [[[0.5, 0.9], [0.6, 1.0]], [[0.7, 0.8], [0.9, 1.0]]]}
    measured = dataclasses.replace(CPU, gemm_efficiency={"fp32": table})
    products = [(512.0, 512.0, 512.0, 1.0, 1), (64.0, 512.0, 64.0, 1.0, 2), (100.0, 300.0, 200.0, 1.0, 1)]
    before = layer_gemm_time(products, measured, "fp32")
    # every listed product takes f times as long, slower or faster (a cell of 1 then raises the peak)
    for f in (2.0, 0.5):
        assert layer_gemm_time(products, scaled_profile(measured, flops=f), "fp32") == pytest.approx(f * before)
    fast = scaled_profile(measured, flops=0.5)
    assert fast.achievable_flops("fp32") == pytest.approx(measured.achievable_flops("fp32") * 2)
