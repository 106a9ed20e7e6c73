"""Constants and buffers ``torch.export`` lifts (a tensor made in ``forward``, non-persistent and
persistent buffers) are carried into the compiled stages: at pp 1 and pp 2 the chained stages
reproduce the eager model's loss and gradients."""

from __future__ import annotations

import os

import pytest
import torch

from codegen.codegen_errors import LoweringError
from codegen.lower import _constant_ctor
from planner.commands.compile import compile_plan
from planner.commands.train import original_state
from planner.frontend.zoo import ModelSizes, build_model
from runtime.stages.compiled_stages import load_stage_module, load_weights, read_manifest
from tests.helpers import TESTS, manual_plan

SPEC = os.path.join(TESTS, "fixtures", "const_models.py") + ":const_model"


@pytest.mark.parametrize("pp", [1, 2])
def test_lifted_constants_reach_the_compiled_stages(tmp_path, pp):
    plan = manual_plan(SPEC, {"layers": 2}, pp=pp, mbs=2, m=pp, seq_len=8)
    compile_plan(plan, str(tmp_path))
    man = read_manifest(str(tmp_path))
    state = original_state(SPEC, {"layers": 2}, 8, 0)
    eager = build_model(SPEC, ModelSizes(layers=2), seed=0).model
    ids, labels = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    ref = eager(ids, labels)
    ref.backward()
    values: tuple = ()
    mods = []
    for st in man["stages"]:
        assert not any("lifted_tensor" in e["fqn"] for e in st["params"].values())  # no state holds them
        mod = load_stage_module(str(tmp_path), st)
        load_weights(mod, st, state)
        data = {"ids": ids, "labels": labels}
        values = mod(*values, *(data[d] for d in st["data_inputs"]))
        mods.append((mod, st))
    torch.testing.assert_close(values, ref, rtol=1e-6, atol=1e-6)
    values.backward()
    want = dict(eager.named_parameters())
    for mod, st in mods:
        for attr, p in mod.named_parameters():
            torch.testing.assert_close(p.grad, want[st["params"][attr]["fqn"]].grad, rtol=1e-5, atol=1e-6)


def test_constants_without_values_are_refused():
    with pytest.raises(LoweringError, match="meta device"):
        _constant_ctor("c", torch.empty(3, device="meta"))
    src = _constant_ctor("c", torch.tensor([[1.0, float("inf")], [float("nan"), -0.5]]))
    t = eval(src, {"torch": torch, "device": torch.device("cpu")})
    torch.testing.assert_close(t, torch.tensor([[1.0, float("inf")], [float("nan"), -0.5]]), equal_nan=True)
