"""``planner plan --tokens/--price-per-gpu-hour`` (predicted.cost) and ``--gpus A,B,C`` (a sweep)."""

import json

import pytest

from planner.cli import main
from planner.plan import COST_KEYS, TIME_KEYS, load_plan
from tests.helpers import SMALL_GPT_FLAGS, plan_args

SWEEP = [
    "plan",
    *SMALL_GPT_FLAGS,
    "--hardware",
    "cpu",
    "--gpus-per-node",
    "8",
    "--global-batch",
    "8",
    "--seq-len",
    "16",
    "--dtype",
    "fp32",
]


def test_plan_with_tokens_carries_a_consistent_cost(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(plan_args(out, "--tokens", "2M", "--price-per-gpu-hour", "3")) == 0
    report = capsys.readouterr().out
    assert "Cost of the run (2 M tokens)" in report and "run cost" in report
    plan = load_plan(str(out))
    cost, p = plan.predicted.cost, plan.predicted
    assert set(COST_KEYS) <= set(cost) and set(cost["by_part"]) == set(p.time) >= set(TIME_KEYS)
    steps = -(-2_000_000 // (8 * 16))
    assert cost["steps"] == steps and cost["tokens"] == 2e6
    assert cost["gpu_hours"] == pytest.approx(steps * p.step_time_s / 3600 * 2)
    assert cost["money"] == pytest.approx(cost["gpu_hours"] * 3)
    for k, v in p.time.items():
        assert cost["by_part"][k] == pytest.approx(cost["money"] * v / p.step_time_s)


def test_plan_without_tokens_has_no_cost(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(plan_args(out, "--json")) == 0
    assert "cost" not in json.loads(out.read_text())["predicted"]


def test_sweep_json_is_one_plan_per_size(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main([*SWEEP, "--gpus", "4,1,2", "--tp", "2", "--tokens", "1e6", "--json", "--out", str(out)]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert [p.get("gpus") or p["hardware"]["gpus"] for p in plans] == [1, 2, 4]
    assert "does not divide --gpus 1" in plans[0]["error"]
    for p in plans[1:]:
        n = p["hardware"]["gpus"]
        assert p["tp"] == 2 and p["dp"] * p["tp"] * p["pp"] == n
        assert p["predicted"]["cost"]["money"] is None
        written = load_plan(str(tmp_path / f"plan-{n}gpus.json"))
        assert written.to_dict() == p
    assert not (tmp_path / "plan-1gpus.json").exists()


def test_sweep_table_and_plot(tmp_path, capsys):
    png = tmp_path / "sweep.png"
    assert main([*SWEEP, "--gpus", "1,2", "--out", str(tmp_path / "p.json"), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "Cluster sizes for gpt" in text and "per billion tokens" in text and "fastest:" in text
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--gpus", "2,x"], "comma-separated list"),
        (["--gpus", "2,2"], "lists a device count twice"),
        (["--gpus", "2", "--tokens", "many"], "token count"),
        (["--gpus", "2", "--price-per-gpu-hour", "2"], "add --tokens N"),
        (["--gpus", "2,4", "--dp", "3"], "no cluster size of the sweep can be planned"),
    ],
)
def test_bad_cost_and_sweep_input_is_one_clear_message(extra, message, capsys):
    try:
        rc = main([*SWEEP, *extra])
    except SystemExit as e:  # argparse's own usage errors
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_sweep_degrees_name_every_axis_of_the_mesh():
    """A row's degrees multiply to its GPU count: cp and ep are named when above 1."""
    from types import SimpleNamespace

    from planner.commands.sweep import _degrees

    plan = SimpleNamespace(dp=8, tp=4, pp=2, expert_parallel=1, context_parallel={"degree": 2, "method": "ring"})
    assert _degrees(plan) == "dp8 cp2 tp4 pp2"
    moe = SimpleNamespace(dp=32, tp=1, pp=2, expert_parallel=8, context_parallel={"degree": 1, "method": "ring"})
    assert _degrees(moe) == "dp32 tp1 pp2 ep8"
