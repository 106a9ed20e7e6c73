"""``planner validate``: the predicted numbers against what the runtime measures on gloo processes."""

from __future__ import annotations

import json

import pytest

from cost_models.comm_cost import step_control_bytes
from cost_models.memory import loss_backward_bytes
from runtime.contract.collective_bytes import ring_bytes

SIZES = dict(layers=2, hidden=64, heads=2, vocab=512)
SEQ, MICRO = 32, 2
#: Bytes of scalars (loss, its gradient) the live-tensor tracker sees beyond the model.
SCALAR_SLACK = 64


@pytest.fixture(scope="module")
def validated(tmp_path_factory):
    from planner.cli import main

    d = tmp_path_factory.mktemp("validate")
    plan = str(d / "tiny.json")
    argv = [
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
        "512",
        "--seq-len",
        str(SEQ),
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
        "--dp",
        "2",
        "--tp",
        "1",
        "--pp",
        "1",
        "--zero-stage",
        "0",
        "--micro-batch",
        str(MICRO),
        "--checkpoint",
        "none",
        "--out",
        plan,
        "--json",
    ]
    assert main(argv) == 0
    return plan


def _validate(plan, capsys):
    from planner.cli import main

    capsys.readouterr()
    rc = main(["validate", plan, "--nproc", "2", "--steps", "3", "--json", "--timeout", "120"])
    out = capsys.readouterr().out
    assert rc == 0, out
    return json.loads(out)


@pytest.mark.timeout(120)
def test_validate_json_bytes_and_memory(validated, capsys):
    res = _validate(validated, capsys)
    keys = {"step_time_s", "peak_memory_bytes", "comm_bytes_per_device"}
    assert set(res) == {"predicted", "measured", "step_times_s", "step_parts", "comm_wait_s", "time", "overlap"}
    assert len(res["step_parts"]) == 1 and res["step_parts"][0] == res["time"]["measured"]  # one timed step
    on = {"dp": True, "tp": True, "pp": True}
    assert res["overlap"] == {"priced": on, "run": on}  # the run overlaps what the price assumed
    assert len(res["step_times_s"]) == 1 and res["step_times_s"][0] == res["measured"]["step_time_s"]
    assert 0 < res["comm_wait_s"] < res["measured"]["step_time_s"]
    for side in ("predicted", "measured"):
        assert set(res[side]) == keys
        assert all(isinstance(v, (int, float)) and v > 0 for v in res[side].values()), res

    # The time breakdown: every part predicted and measured; with one timed step the measured parts
    # are that step's, which sum to its time. A dp run waits for gradient reductions and steps.
    from planner.plan import TIME_KEYS

    predicted_t, measured_t = res["time"]["predicted"], res["time"]["measured"]
    assert list(predicted_t) == list(TIME_KEYS) and list(measured_t) == list(TIME_KEYS)
    assert all(v >= 0 for v in measured_t.values()), measured_t
    assert sum(measured_t.values()) == pytest.approx(res["measured"]["step_time_s"], rel=0.02), res
    assert measured_t["dp_comm"] > 0 and measured_t["optimizer"] > 0 and measured_t["compute"] > 0, measured_t
    assert measured_t["pp_bubble"] == measured_t["tp_comm"] == measured_t["recompute"] == 0, measured_t

    # Bytes: exact. ZeRO-0 all-reduces every fp32 gradient once per step over dp 2, plus the
    # 16-byte gradient-norm all-reduce.
    from planner.plan import load_plan

    plan = load_plan(validated)
    grads = plan.model.params * 4
    expect = ring_bytes("all_reduce", grads, 2) + step_control_bytes(2, 1, 1)
    assert res["predicted"]["comm_bytes_per_device"] == pytest.approx(expect, abs=0.5)
    assert res["measured"]["comm_bytes_per_device"] == res["predicted"]["comm_bytes_per_device"]

    # Memory: exact up to scalars; the loss transient is part of the prediction.
    gap = res["measured"]["peak_memory_bytes"] - res["predicted"]["peak_memory_bytes"]
    assert 0 <= gap <= SCALAR_SLACK, (gap, res)
    transient = loss_backward_bytes(MICRO * SEQ * SIZES["vocab"] * 4)
    assert plan.predicted.memory["activations"] > transient


def test_validate_needs_a_step_after_the_warm_up(tmp_path, capsys):
    from planner.cli import main

    assert main(["validate", str(tmp_path / "any.json"), "--nproc", "2", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "--steps 2 measures nothing; use --steps 3 or more" in err and "Traceback" not in err
