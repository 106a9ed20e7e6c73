"""Re-planning for another world: the plan's recorded request, pins that no longer fit, and a
plan that cannot be re-planned (planner.commands.elastic)."""

from __future__ import annotations

import json

import pytest

from planner.cli import main
from planner.commands.elastic import describe_change, plan_for_world, replanned_path, request_for_world
from planner.errors import UserError
from planner.plan import load_plan
from planner.search.request import PlanRequest
from planner.search.search_errors import SearchError
from tests.helpers import TINY_GPT, make_plan, write_plan

TINY_FLAGS = ["--layers", "2", "--hidden", "32", "--heads", "4", "--vocab", "64", "--seq-len", "16"]


def _request(**pins) -> PlanRequest:
    return PlanRequest(spec="gpt", gpus=8, gpus_per_node=8, hardware="cpu", global_batch=16, seq_len=16, **pins)


def test_a_dp_pin_is_dropped_and_tp_pp_pins_kept_while_they_divide_the_world():
    request, dropped = request_for_world(_request(dp=2, tp=2, pp=2), 4)
    assert (request.gpus, request.dp, request.tp, request.pp) == (4, None, 2, 2)
    assert dropped == ["--dp 2: data parallelism follows the world"]
    request, dropped = request_for_world(_request(tp=2, pp=2), 6)
    assert (request.tp, request.pp) == (2, None)
    assert dropped == ["--pp 2: 4 does not divide 6 rank(s)"]
    request, dropped = request_for_world(_request(tp=4, sequence_parallel="on"), 2)
    assert (request.tp, request.sequence_parallel) == (None, None)
    assert len(dropped) == 2 and dropped[0].startswith("--tp 4")
    assert request.global_batch == 16


def test_request_round_trips_and_a_malformed_one_is_a_clear_error():
    request = _request(tp=2, zero_stage=1, tokens=3e9)
    record = json.loads(json.dumps(request.to_record()))
    assert PlanRequest.from_record(record) == request
    assert PlanRequest.from_record({**record, "added_by_a_newer_planner": 1}) == request
    with pytest.raises(SearchError, match="missing global_batch"):
        PlanRequest.from_record({k: v for k, v in record.items() if k != "global_batch"})


def test_replanned_path():
    assert replanned_path("/a/plan.json", 4) == "/a/plan.world4.json"
    assert replanned_path("/a/plan.world4.json", 2) == "/a/plan.world2.json"


def test_planned_request_is_recorded_and_plans_again_for_another_world(tmp_path):
    path = str(tmp_path / "plan.json")
    argv = ["plan", "--model", "gpt", *TINY_FLAGS, "--global-batch", "8", "--gpus", "2", "--dp", "2"]
    assert main([*argv, "--hardware", "cpu", "--dtype", "fp32", "--out", path, "--json"]) == 0
    plan = load_plan(path)
    assert plan.request is not None and plan.request["dp"] == 2 and plan.request["gpus"] == 2
    replan = plan_for_world(plan, path, 1)
    assert (replan.plan.dp, replan.plan.tp, replan.plan.pp) == (1, 1, 1)
    assert replan.plan.global_batch == 8 and replan.plan.model == plan.model
    assert replan.plan.request["gpus"] == 1 and replan.plan.request["dp"] is None
    assert load_plan(replan.path).to_dict() == replan.plan.to_dict()
    message = replan.message(4)
    assert message.startswith(f"re-planned for 1 rank(s): {describe_change(plan, replan.plan)}, resumed at step 4")
    assert "dp2 -> dp1" in message and "--dp 2" in message and "dropout" in message
    assert replan.fields(4)["old"]["dp"] == 2 and replan.fields(4)["new_world"] == 1


def test_a_plan_without_request_cannot_be_replanned(tmp_path, capsys):
    plan = make_plan("gpt", dict(TINY_GPT), dp=2)
    path = write_plan(tmp_path / "plan.json", plan)
    with pytest.raises(UserError, match="has no `request`"):
        plan_for_world(plan, path, 1)
    # Through the command line: exit 2 and one clear line, before any process starts.
    assert main(["train", path, "--nproc", "1", "--elastic", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "has no `request`" in err and "cannot be re-planned for 1 rank(s)" in err and "Traceback" not in err
    # Without --elastic a world mismatch stays the error it was.
    assert main(["train", path, "--nproc", "1", "--steps", "2"]) == 2
    assert "needs dp*tp*pp = 2*1*1 = 2 processes, but --nproc is 1" in capsys.readouterr().err
