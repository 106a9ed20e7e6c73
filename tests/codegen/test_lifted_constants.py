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


def test_a_constant_made_on_the_inputs_device_keeps_its_values(tmp_path):
    """An ``hf:`` model is traced on the meta device, so CPM-Ant's ``torch.tensor(list(range(n)),
    device=input.device)`` was a constant without values, and compile refused the model. The
    trace makes such data on the CPU and records the move: the compiled stage computes the eager
    model's loss and gradients."""
    transformers = pytest.importorskip("transformers")
    transformers.CpmAntConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, dim_head=16, dim_ff=64, vocab_size=64
    ).save_pretrained(str(tmp_path / "cpmant"))
    spec = f"hf:{tmp_path / 'cpmant'}"
    compile_plan(manual_plan(spec, {"layers": 2}, mbs=2, seq_len=8), str(tmp_path / "out"))
    stage = read_manifest(str(tmp_path / "out"))["stages"][0]
    module = load_stage_module(str(tmp_path / "out"), stage)
    load_weights(module, stage, original_state(spec, {"layers": 2}, 8, 0))
    eager = build_model(spec, ModelSizes(layers=2), seed=0).model
    ids, labels = torch.randint(0, 16, (2, 8)), torch.randint(0, 16, (2, 8))
    data = {"input_ids": ids, "labels": labels}
    loss = module(*(data[name] for name in stage["data_inputs"]))
    ref = eager(ids, labels)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    loss.backward()
    ref.backward()
    want = dict(eager.named_parameters())
    for attr, param in module.named_parameters():
        torch.testing.assert_close(param.grad, want[stage["params"][attr]["fqn"]].grad, rtol=1e-5, atol=1e-6)
