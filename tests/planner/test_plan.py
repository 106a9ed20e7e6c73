"""plan.json: round trip, invariants and clear errors for every kind of malformed file."""

import copy
import json

import pytest

from planner.errors import UserError
from planner.plan import LATER_TIME_KEYS, Plan, load_plan, plan_hash, save_plan

MOE = {"layers": [1, 2, 3, 4], "experts": 8, "top_k": 2, "shared_experts": 0, "capacity_factor": None}


def test_round_trip(tmp_path, sample_plan_dict):
    plan = Plan.from_dict(sample_plan_dict)
    p = tmp_path / "plan.json"
    save_plan(plan, str(p))
    again = load_plan(str(p))
    assert again == plan
    assert json.loads(p.read_text()) == sample_plan_dict
    assert list(json.loads(p.read_text()))[:3] == ["schema_version", "model", "hardware"]
    assert plan_hash(again) == plan_hash(plan)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(dp="2"), "dp must be an integer"),
        (lambda d: d.update(dp=4), "dp*tp*pp"),
        (lambda d: d.update(num_micro_batches=3), "global_batch (8) must equal"),
        (lambda d: d.update(zero_stage=4), "zero_stage must be 0, 1, 2 or 3"),
        (lambda d: d.update(dtype="int8"), "dtype must be one of"),
        (lambda d: d.update(stages=[[0, 2], [4, 5]]), "stages[1]"),
        (lambda d: d.update(stages=[[0, 2], [3, 4]]), "layer table has rows 0..5"),
        (lambda d: d.update(stages=[[0, 5]]), "one [first, last] pair per pipeline stage"),
        (lambda d: d.update(checkpoint_layers=[9]), "outside the layer table"),
        (lambda d: d.update(schema_version=2), "this planner reads 1"),
        (lambda d: d["predicted"]["memory"].update(total=5), "must equal predicted.peak_memory_bytes"),
        (lambda d: d["predicted"]["time"].pop("dp_comm"), "predicted.time is missing ['dp_comm']"),
        (lambda d: d.pop("hardware"), "plan is missing the field 'hardware'"),
        (lambda d: d["model"].pop("params"), "model is missing the field(s) ['params']"),
        (lambda d: d.update(alternatives={}), "alternatives must be a list"),
        (lambda d: d.update(num_micro_batches=1, micro_batch_size=4), "must be >= pp"),
        (lambda d: d.update(overlap={"dp": True, "zero": True}), "overlap has unknown keys ['zero']"),
        (lambda d: d.update(overlap={"dp": "yes"}), "overlap.dp must be true or false"),
        (lambda d: d["predicted"].update(hidden={"network": 0.1}), "predicted.hidden has unknown part 'network'"),
        (lambda d: d["predicted"].update(hidden={"dp_comm": -1.0}), "predicted.hidden.dp_comm must be >= 0"),
        (lambda d: d.update(expert_parallel=2), "expert_parallel is 2 but the model has no routed experts"),
        (lambda d: d.update(expert_parallel=0), "expert_parallel must be >= 1"),
        (lambda d: d["model"].update(moe={"layers": [1], "experts": 4}), "model.moe is missing ['top_k'"),
        (lambda d: d["model"].update(moe=MOE | {"capacity_factor": 0}), "model.moe.capacity_factor must be positive"),
        (lambda d: d["model"].update(moe=MOE) or d.update(expert_parallel=4), "(4) must divide dp (2)"),
        (lambda d: d.update(context_parallel={"degree": 2, "method": "ring"}), "dp*cp*tp*pp = 2*2*1*2 = 8"),
        (lambda d: d.update(context_parallel={"degree": 2}), "context_parallel must be an object"),
        (
            lambda d: d.update(dp=1, num_micro_batches=4, context_parallel={"degree": 2, "method": "zigzag"}),
            "context_parallel.method must be one of ring, all-gather, ulysses",
        ),
        (
            lambda d: d.update(dp=1, num_micro_batches=4, seq_len=18, context_parallel={"degree": 2, "method": "ring"}),
            "needs seq_len (18) divisible by 2*cp = 4",
        ),
        (
            lambda d: d["model"].update(moe=MOE | {"experts": 3}) or d.update(expert_parallel=2),
            "must divide the routed experts (3)",
        ),
    ],
)
def test_invalid_plans_name_the_field(tmp_path, sample_plan_dict, mutate, message):
    d = copy.deepcopy(sample_plan_dict)
    mutate(d)
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(d))
    with pytest.raises(UserError) as e:
        load_plan(str(p))
    assert message in str(e.value)
    assert str(p) in str(e.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_plan(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"dp": 2,')
    with pytest.raises(UserError, match=r"not valid JSON \(line 1"):
        load_plan(str(bad))
    arr = tmp_path / "arr.json"
    arr.write_text("[1, 2]")
    with pytest.raises(UserError, match="must hold a JSON object"):
        load_plan(str(arr))


def test_save_is_atomic_and_keeps_old_file_on_error(tmp_path, sample_plan_dict, monkeypatch):
    p = tmp_path / "plan.json"
    plan = Plan.from_dict(sample_plan_dict)
    save_plan(plan, str(p))
    before = p.read_text()

    def boom(self):
        raise OSError("disk full")

    monkeypatch.setattr(Plan, "to_json", boom)
    with pytest.raises(OSError):
        save_plan(plan, str(p))
    assert p.read_text() == before


def test_plans_older_than_overlap_load_as_fully_overlapped(tmp_path, sample_plan_dict):
    d = copy.deepcopy(sample_plan_dict)
    assert d["overlap"] == {"dp": True, "tp": True, "pp": True}
    d["predicted"]["hidden"] = {"dp_comm": 0.5}
    assert Plan.from_dict(d).predicted.hidden == {"dp_comm": 0.5}
    del d["overlap"], d["predicted"]["hidden"]
    p = tmp_path / "old.json"
    p.write_text(json.dumps(d))
    plan = load_plan(str(p))
    assert plan.overlap == {"dp": True, "tp": True, "pp": True} and plan.predicted.hidden == {}
    partial = copy.deepcopy(d)
    partial["overlap"] = {"tp": False}  # the missing kinds keep their default
    p.write_text(json.dumps(partial))
    assert load_plan(str(p)).overlap == {"dp": True, "tp": False, "pp": True}


def test_expert_parallel_plans_load_and_older_plans_have_no_experts(tmp_path, sample_plan_dict):
    d = copy.deepcopy(sample_plan_dict)
    d["model"]["moe"], d["expert_parallel"] = MOE, 2
    assert Plan.from_dict(d).expert_parallel == 2
    for key in LATER_TIME_KEYS:
        del d["predicted"]["time"][key]
    del d["model"]["moe"], d["expert_parallel"]
    p = tmp_path / "old.json"
    p.write_text(json.dumps(d))
    plan = load_plan(str(p))
    assert plan.expert_parallel == 1 and plan.model.moe == {}
    assert {k: plan.predicted.time[k] for k in LATER_TIME_KEYS} == dict.fromkeys(LATER_TIME_KEYS, 0.0)


def test_context_parallel_plans_load_hash_and_older_plans_have_none(sample_plan_dict):
    """A cp plan counts cp in the device total and in the hash (its checkpoints are cut another
    way); a plan without the key loads as cp 1 with the hash it always had."""
    d = copy.deepcopy(sample_plan_dict)
    plain = Plan.from_dict(copy.deepcopy(d))
    assert plain.context_parallel == {"degree": 1, "method": "ring"} and plain.cp == 1
    d.update(dp=1, num_micro_batches=4, context_parallel={"degree": 2, "method": "all-gather"})
    plan = Plan.from_dict(d)
    assert plan.cp == 2 and plan.to_dict()["context_parallel"] == {"degree": 2, "method": "all-gather"}
    assert plan_hash(plan) != plan_hash(Plan.from_dict(d | {"context_parallel": {"degree": 2, "method": "ring"}}))
    older = copy.deepcopy(sample_plan_dict)
    older.pop("context_parallel", None)
    assert plan_hash(Plan.from_dict(older)) == plan_hash(plain)
