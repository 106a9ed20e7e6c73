"""``planner validate``: the predicted numbers against what the runtime measures.

One tiny plan (built-in GPT, 2 blocks x 64, vocab 512, sequence 32, global batch 4, fp32, dp 2,
ZeRO 0, micro-batch 2, no checkpointing) is planned in-process and validated with 2 gloo
processes for 3 steps. What must hold:

- the ``--json`` object has exactly the contract's keys, all numbers, all positive;
- the bytes one device sends per step are predicted *exactly*: gradient all-reduce plus the
  runtime's control collectives (``cost_models.comm.step_control_bytes``: the gradient-norm
  all-reduce of 16 bytes over dp);
- peak memory is predicted exactly (model state, saved activations and the loss backward's
  transient, the log-probability and logit gradients of ``2 x b x s x V x 4`` bytes), up to
  ``SCALAR_SLACK`` bytes of scalars (the loss and its gradient) the model does not count.

The pure helpers of ``benchmarks/bench_validate.py`` (ranks and Spearman's rho) are checked
against hand-computed values.
"""

from __future__ import annotations

import json
import math

import pytest

from cost_models.comm import ring_bytes_sent, step_control_bytes
from cost_models.memory import loss_backward_bytes

SIZES = dict(layers=2, hidden=64, heads=2, vocab=512)
SEQ, MICRO = 32, 2
#: Bytes of scalars (loss, its gradient) the live-tensor tracker sees beyond the model.
SCALAR_SLACK = 64


@pytest.fixture(scope="module")
def validated(tmp_path_factory):
    from planner.cli import main

    d = tmp_path_factory.mktemp("validate")
    plan = str(d / "tiny.json")
    argv = ["plan", "--model", "gpt", "--layers", "2", "--hidden", "64", "--heads", "2", "--vocab", "512",
            "--seq-len", str(SEQ), "--global-batch", "4", "--dtype", "fp32", "--gpus", "2", "--gpus-per-node",
            "2", "--hardware", "cpu", "--dp", "2", "--tp", "1", "--pp", "1", "--zero-stage", "0",
            "--micro-batch", str(MICRO), "--checkpoint", "none", "--out", plan, "--json"]
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
    assert set(res) == {"predicted", "measured", "step_times_s", "comm_wait_s"}
    assert len(res["step_times_s"]) == 1 and res["step_times_s"][0] == res["measured"]["step_time_s"]
    assert 0 < res["comm_wait_s"] < res["measured"]["step_time_s"]
    for side in ("predicted", "measured"):
        assert set(res[side]) == keys
        assert all(isinstance(v, (int, float)) and v > 0 for v in res[side].values()), res

    # Bytes: exact. ZeRO-0 all-reduces every fp32 gradient once per step over dp 2, plus the
    # 16-byte gradient-norm all-reduce.
    from planner.plan import load_plan

    plan = load_plan(validated)
    grads = plan.model.params * 4
    expect = ring_bytes_sent("all_reduce", grads, 2) + step_control_bytes(2, 1, 1)
    assert res["predicted"]["comm_bytes_per_device"] == pytest.approx(expect, abs=0.5)
    assert res["measured"]["comm_bytes_per_device"] == res["predicted"]["comm_bytes_per_device"]

    # Memory: exact up to scalars; the loss transient is part of the prediction.
    gap = res["measured"]["peak_memory_bytes"] - res["predicted"]["peak_memory_bytes"]
    assert 0 <= gap <= SCALAR_SLACK, (gap, res)
    transient = loss_backward_bytes(MICRO * SEQ * SIZES["vocab"] * 4)
    assert plan.predicted.memory["activations"] > transient


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
    rows = [Row(f"p{i}", dict(zip(keys, (t, 100, 10))), dict(zip(keys, (1.1 * t, 104, 10))), [t, 2 * t, 3 * t])
            for i, t in enumerate((1.0, 2.0, 3.0))]
    s = summarize(rows)
    assert s["spearman_time"] == pytest.approx(1.0) and s["median_time_error"] == pytest.approx(0.1 / 1.1)
    assert s["worst_memory_error"] == pytest.approx(4 / 104) and s["worst_comm_error"] == 0
    assert s["spearman_time_median"] == pytest.approx(1.0)
    assert s["median_time_error_median"] == pytest.approx(1.0 / 2.0)  # median of [t, 2t, 3t] is 2t
    assert s["median_step_spread"] == pytest.approx(1.0)  # (3t - t) / 2t
    assert s["targets_met"]


def test_validate_needs_a_step_after_the_warm_up(tmp_path, capsys):
    from planner.cli import main

    assert main(["validate", str(tmp_path / "any.json"), "--nproc", "2", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "--steps 2 measures nothing; use --steps 3 or more" in err and "Traceback" not in err
