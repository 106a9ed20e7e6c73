"""``planner tune``: the best candidates run on 2 gloo processes, a failing one is recorded and
skipped, the fastest that ran becomes plan.json with its measurements, and the refit profile
predicts the trials more closely than the one they were planned with."""

from __future__ import annotations

import json
import os

import pytest

TINY = [
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
    "--gpus-per-node",
    "2",
    "--hardware",
    "cpu",
]


def _kill_a_rank_of_trial_2(trial: int):
    from tests.e2e.fault_hooks import KillAt

    return KillAt(rank=1, step=1) if trial == 2 else None


@pytest.mark.timeout(300)
def test_tune_survives_a_crashed_candidate_and_writes_the_fastest(tmp_path, capsys):
    from cost_models.hardware import load_hardware
    from planner.cli import build_parser, main
    from planner.commands.tune import run_tune
    from planner.plan import load_plan

    out, prof = str(tmp_path / "plan.json"), str(tmp_path / "tuned.json")
    args = build_parser().parse_args(
        ["tune", *TINY, "--candidates", "3", "--steps", "3", "--timeout", "120", "--out", out, "--profile-out", prof]
    )
    rc = run_tune(args, trial_hook=_kill_a_rank_of_trial_2)
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "crashed" in text and "chosen" in text and f"Wrote {out}" in text

    plan = load_plan(out)
    m = plan.measured
    trials = m["trials"]
    assert [t["candidate"] for t in trials] == [1, 2, 3]
    assert trials[1]["status"] == "crashed" and "rank 1" in trials[1]["error"], trials[1]
    assert trials[1]["step_time_s"] is None
    ok = [t for t in trials if t["status"] == "ok"]
    assert [t["candidate"] for t in ok] == [1, 3]
    assert all(t["step_time_s"] > 0 and t["peak_memory_bytes"] > 0 for t in ok)
    chosen = min(ok, key=lambda t: t["step_time_s"])
    assert [t["candidate"] for t in trials if t["chosen"]] == [chosen["candidate"]]
    assert (plan.dp, plan.tp, plan.pp, plan.zero_stage, plan.micro_batch_size) == (
        chosen["dp"],
        chosen["tp"],
        chosen["pp"],
        chosen["zero_stage"],
        chosen["micro_batch_size"],
    )
    assert m["step_time_s"] == chosen["step_time_s"] and m["peak_memory_bytes"] == chosen["peak_memory_bytes"]
    assert plan.predicted.step_time_s == chosen["predicted_step_time_s"]
    # Three different strategies were tried (the plan's choice and two runners-up).
    assert len({(t["dp"], t["tp"], t["pp"], t["zero_stage"], t["micro_batch_size"]) for t in trials}) == 3
    with open(out, encoding="utf-8") as f:
        assert json.load(f)["measured"]["trials"][1]["status"] == "crashed"

    # The refit profile: loadable, says where it comes from, and predicts the trials better.
    hw = load_hardware(prof)
    assert hw.name == "cpu-tuned" and "planner tune from 2 trials" in hw.source
    fit = hw.calibration["tune"]
    err = [
        sum(abs(p - x) / x for p, x in zip(fit[k], fit["measured_step_s"]))
        for k in ("predicted_step_s_before", "predicted_step_s_after")
    ]
    assert err[1] < err[0], fit
    # Re-planning the chosen strategy on the refit profile predicts its measured time more closely.
    replan = str(tmp_path / "replan.json")
    pins = [
        "--dp",
        str(plan.dp),
        "--tp",
        str(plan.tp),
        "--pp",
        str(plan.pp),
        "--zero-stage",
        str(plan.zero_stage),
        "--micro-batch",
        str(plan.micro_batch_size),
        "--checkpoint",
        "none",
    ]
    argv = ["plan", *[prof if a == "cpu" else a for a in TINY], *pins, "--out", replan, "--json"]
    assert main(argv) == 0
    capsys.readouterr()
    again = load_plan(replan).predicted.step_time_s
    assert abs(again - m["step_time_s"]) < abs(plan.predicted.step_time_s - m["step_time_s"])


def test_tune_when_every_candidate_fails_says_why_and_writes_nothing(tmp_path, capsys, monkeypatch):
    from planner.cli import main
    from planner.commands import tune

    def fail(trial, workdir, steps, timeout, capacity, hook):
        trial.status, trial.error = (
            ("crashed", "rank 0 failed: boom")
            if trial.index == 1
            else ("timeout", "did not finish within --timeout 5 s (stopped)")
        )

    monkeypatch.setattr(tune, "_run_trial", fail)
    out = str(tmp_path / "plan.json")
    rc = main(
        ["tune", *TINY, "--candidates", "2", "--steps", "3", "--out", out, "--profile-out", str(tmp_path / "p.json")]
    )
    cap = capsys.readouterr()
    assert rc == 1
    assert "Traceback" not in cap.err
    assert "trial 1" in cap.err and "crashed: rank 0 failed: boom" in cap.err
    assert "trial 2" in cap.err and "timeout: did not finish" in cap.err
    assert not os.path.exists(out) and not os.path.exists(tmp_path / "p.json")


def test_tune_needs_a_timed_step(tmp_path, capsys):
    from planner.cli import main

    assert main(["tune", *TINY, "--steps", "2", "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "--steps 2 measures nothing" in err and "Traceback" not in err


def test_tune_json_prints_only_the_plan_with_its_measurements(tmp_path, capsys, monkeypatch):
    from planner.cli import main
    from planner.commands import tune

    def measured(trial, workdir, steps, timeout, capacity, hook):  # no processes: made-up numbers
        trial.status, trial.step_time_s, trial.peak_memory_bytes = "ok", 0.05 / trial.index, 1000 * trial.index

    monkeypatch.setattr(tune, "_run_trial", measured)
    out = str(tmp_path / "plan.json")
    assert main(["tune", *TINY, "--steps", "3", "--out", out, "--json"]) == 0
    cap = capsys.readouterr()
    plan = json.loads(cap.out)
    assert plan["measured"]["step_time_s"] == pytest.approx(0.05 / 3)
    assert [t["chosen"] for t in plan["measured"]["trials"]] == [False, False, True]
    assert "Chose trial 3" in cap.err and "faster than the plan's own choice" in cap.err
    with open(out, encoding="utf-8") as f:
        assert json.load(f) == plan
