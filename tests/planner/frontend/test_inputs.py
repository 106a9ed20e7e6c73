"""Inputs of any model at the CLI: roles recorded in plan.json, pins, and the error for an input
whose meaning cannot be inferred."""

from __future__ import annotations

import json

import pytest

from planner.cli import main
from planner.frontend.frontend_errors import ModelError
from planner.frontend.input_pins import parse_input_pins, resolve_inputs
from tests.helpers import USER_MODELS

PLAN = ["--gpus", "1", "--hardware", "cpu", "--global-batch", "2", "--seq-len", "8", "--dtype", "fp32"]


def _plan(tmp_path, factory, *extra):
    out = tmp_path / "plan.json"
    rc = main(["plan", "--model", f"{USER_MODELS}:{factory}", *PLAN, "--out", str(out), "--json", *extra])
    return rc, (json.loads(out.read_text()) if rc == 0 else None)


def test_plan_records_each_inputs_role(tmp_path, capsys):
    rc, plan = _plan(tmp_path, "masked")
    assert rc == 0
    roles = {x["name"]: (x["role"], x["vocab"]) for x in plan["model"]["inputs"]}
    assert roles == {
        "input_ids": ("tokens", 40),
        "attention_mask": ("ones", 0),
        "position_ids": ("positions", 0),
        "labels": ("labels", 30),
    }
    assert [x["shape"] for x in plan["model"]["inputs"]] == [["b", "s"]] * 4


def test_unexplained_input_is_one_clear_error(tmp_path, capsys):
    rc, _ = _plan(tmp_path, "mystery_input")
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "'temperature'" in err and "float32" in err and "--input temperature=ROLE" in err
    assert not (tmp_path / "plan.json").exists()


def test_a_pin_settles_it(tmp_path, capsys):
    rc, plan = _plan(tmp_path, "mystery_input", "--input", "temperature=ones")
    assert rc == 0
    assert plan["model"]["inputs"][2] == {
        "name": "temperature",
        "role": "ones",
        "dtype": "float32",
        "shape": ["b", "s", 1],
        "vocab": 0,
    }


@pytest.mark.parametrize(
    "items, msg",
    [
        (["temperature"], "expected NAME=ROLE"),
        (["temperature=hot"], "unknown role 'hot'"),
    ],
)
def test_bad_pins(items, msg):
    with pytest.raises(ModelError, match=msg):
        parse_input_pins(items)


def test_pin_of_an_input_the_model_lacks():
    facts = [{"name": "ids", "role": "tokens", "dtype": "int64", "shape": ["b", "s"], "vocab": 9, "why": ""}]
    with pytest.raises(ModelError, match="'mask', but the model 'm' takes 'ids'"):
        resolve_inputs(facts, {"mask": "ones"}, "m")


def test_a_model_without_token_inputs_is_refused():
    facts = [{"name": "x", "role": "ones", "dtype": "float32", "shape": ["b", 4], "vocab": 0, "why": ""}]
    with pytest.raises(ModelError, match="no token input"):
        resolve_inputs(facts, {}, "m")
