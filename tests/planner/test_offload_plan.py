"""plan.json ``offload`` end to end on the planner side: the schema (round trip, old plans, rules),
the report, the DeepSpeed sections, the CLI pins and ``validate``'s host-memory comparison."""

from __future__ import annotations

import copy
import dataclasses
import io
import json

import pytest
from rich.console import Console

from cost_models.hardware import load_hardware
from planner.cli import main
from planner.commands.validate import compare
from planner.plan import NO_OFFLOAD, TIME_KEYS, Plan, PlanError, load_plan, save_plan
from planner.report.deepspeed import to_deepspeed
from planner.report.render import render_plan
from planner.search.request import PlanRequest
from planner.search.solve import solve
from tests.helpers import gpt_table, make_plan, plan_args

TABLE = gpt_table(layers=3, hidden=128, heads=2, vocab=4096)


def _offloaded_solution(optimizer="nvme", params="cpu"):
    req = PlanRequest(
        spec="gpt",
        gpus=2,
        gpus_per_node=2,
        hardware="cpu",
        global_batch=4,
        seq_len=64,
        compile="off",
        offload_optimizer=optimizer,
        offload_params=params,
    )
    hw = load_hardware("cpu", 2)
    return solve(req, TABLE, hw), hw


def test_plan_round_trips_offload_and_host_bytes(tmp_path):
    sol, _ = _offloaded_solution()
    plan = sol.plan
    assert plan.offload == {"optimizer": "nvme", "params": "cpu"}
    path = tmp_path / "plan.json"
    save_plan(plan, str(path))
    data = json.loads(path.read_text())
    assert data["offload"] == plan.offload and list(data).index("offload") == list(data).index("compile") + 1
    assert data["predicted"]["memory"]["host"] > 0 and data["predicted"]["memory"]["nvme"] > 0
    assert data["predicted"]["memory"]["total"] == data["predicted"]["peak_memory_bytes"]
    assert list(data["predicted"]["time"]) == list(TIME_KEYS)
    assert load_plan(str(path)) == plan


def test_a_plan_written_before_offload_loads_as_none(tmp_path):
    d = make_plan(dp=2, zero=1).to_dict()
    del d["offload"]
    for k in ("host", "nvme"):
        del d["predicted"]["memory"][k]
    del d["predicted"]["time"]["offload"]
    plan = Plan.from_dict(d)
    assert plan.offload == NO_OFFLOAD
    assert plan.predicted.memory["host"] == 0 and plan.predicted.time["offload"] == 0.0
    # and it is written back with the keys
    assert plan.to_dict()["offload"] == NO_OFFLOAD


@pytest.mark.parametrize(
    "zero, offload, message",
    [
        (
            2,
            {"optimizer": "cpu", "params": "cpu"},
            "offload.params is 'cpu', but offloading parameters needs zero_stage 3",
        ),
        (0, {"optimizer": "nvme", "params": "none"}, "offloading the optimizer needs zero_stage 1, 2 or 3"),
        (1, {"optimizer": "disk", "params": "none"}, "offload.optimizer must be one of none, cpu, nvme"),
        (1, {"optimizer": "cpu"}, 'offload must be an object with exactly "optimizer" and "params"'),
    ],
)
def test_invalid_offload_is_a_clear_plan_error(zero, offload, message):
    d = make_plan(dp=2, zero=zero).to_dict()
    d["offload"] = offload
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Plan.from_dict(copy.deepcopy(d))


def test_report_shows_where_each_state_lives():
    sol, hw = _offloaded_solution()
    buf = io.StringIO()
    render_plan(sol.plan, hw, Console(file=buf, width=200), sol)
    out = buf.getvalue()
    assert "optimizer state on NVMe (AdamW on the host's cores); parameters in host memory" in out
    assert "Where the state lives (2 devices share each node's host)" in out
    assert "total in host memory" in out and "total in NVMe" in out and "parameter shards" in out
    # the optimizer state is on NVMe: the host row holds only the gradient accumulator
    assert "gradient accumulator (fp32)" in out and "optimizer (fp32 master, m, v)" in out
    assert "m, v; gradient accumulator" not in out
    assert "offload transfers (host / NVMe)" in out and "offload opt/params" in out


def test_deepspeed_sections_match_the_plan():
    sol, _ = _offloaded_solution()
    zero = to_deepspeed(sol.plan)["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "nvme", "pin_memory": True, "nvme_path": "/local_nvme"}
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    cfg = to_deepspeed(sol.plan, nvme_path="/mnt/nvme0")
    assert cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] == "/mnt/nvme0"
    assert not any("nvme_path" in w for w in cfg["planner"]["warnings"])
    assert any("nvme_path" in w for w in to_deepspeed(sol.plan)["planner"]["warnings"])
    plain = to_deepspeed(make_plan(dp=2, zero=1))["zero_optimization"]
    assert "offload_optimizer" not in plain and "offload_param" not in plain


def test_cli_pins_and_contradictions(tmp_path, capsys):
    out = tmp_path / "plan.json"
    base = plan_args(out, "--json")  # the CLI tests' model: its layer table is cached once per session
    assert main(base + ["--offload-optimizer", "cpu", "--offload-params", "nvme"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["offload"] == {"optimizer": "cpu", "params": "nvme"} and plan["zero_stage"] == 3
    assert main(base + ["--offload-params", "cpu", "--zero-stage", "1"]) == 2
    err = capsys.readouterr().err
    assert "--offload-params cpu needs ZeRO stage 3" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as e:
        main(base + ["--offload-optimizer", "tape"])
    assert e.value.code == 2 and "invalid choice: 'tape'" in capsys.readouterr().err


def test_validate_compares_host_memory():
    sol, _ = _offloaded_solution(optimizer="cpu", params="none")
    plan = sol.plan
    lines = [
        {
            "step": i,
            "step_time_s": 0.1,
            "peak_memory_bytes": 10,
            "comm_bytes": 0,
            "host_memory_bytes": 1000 + i,
            "time": {k: 0.0 for k in TIME_KEYS},
        }
        for i in range(4)
    ]
    res = compare(plan, lines)
    assert res["measured"]["host_memory_bytes"] == 1003
    assert res["predicted"]["host_memory_bytes"] == plan.predicted.memory["host"] // 2  # per rank, 2 per node
    no_host = compare(
        dataclasses.replace(plan), [{k: v for k, v in ln.items() if k != "host_memory_bytes"} for ln in lines]
    )
    assert "host_memory_bytes" not in no_host["measured"]
