"""A weight tied across pipeline stages: its extra copy and gradient all-reduce are priced exactly,
and tied models plan with pipeline stages."""

from __future__ import annotations

import json

import pytest

from cost_models.comm_cost import collective_time, group_placement
from cost_models.hardware import load_hardware
from cost_models.memory import model_state_bytes
from cost_models.strategy import Candidate, NumericTable, candidate_costs, evaluate
from planner.cli import main
from planner.plan import load_plan
from planner.search.candidates import enumerate_candidates
from planner.search.request import PlanRequest
from planner.search.solve import solve
from tests.helpers import gpt_table

HW = load_hardware("a100-80gb", 8)
V, H = 8192, 256


def _tables(layers=4):
    plain = gpt_table(layers=layers, hidden=H, vocab=V)
    tied = gpt_table(layers=layers, hidden=H, vocab=V)
    tied.tied = [{"weight": "lm_head.weight", "layers": [0, layers + 1], "params": V * H, "params_tp": V * H}]
    return NumericTable(plain), NumericTable(tied)


def _costs(nt, cand, dtype):
    return candidate_costs(nt, HW, dtype, 128, cand, 8, HW.memory_bytes * 0.9)


@pytest.mark.parametrize("zero, dtype", [(0, "bf16"), (1, "fp32"), (2, "bf16"), (3, "bf16")])
def test_tied_copy_and_allreduce_are_priced_exactly(zero, dtype):
    plain, tied = _tables()
    dp, tp, pp = 2, 2, 2
    cand = Candidate(dp, tp, pp, zero, 1, 4)
    a, b = _costs(plain, cand, dtype), _costs(tied, cand, dtype)
    per_dev = V * H // tp  # vocab-parallel: each tp rank holds (and all-reduces) its shard
    shard = -(-per_dev // dp)
    size = shard * 4 if zero >= 2 else shard * dp * (2 if dtype == "bf16" else 4)  # fp32 shard / full grad
    state = model_state_bytes(per_dev, dtype, zero, dp)
    first, last = b.layers[0], b.layers[-1]
    assert first.dp_step_sent_b - a.layers[0].dp_step_sent_b == size  # ring all-reduce over 2 ranks
    assert last.dp_step_sent_b - a.layers[-1].dp_step_sent_b == size
    assert (
        last.params_b - a.layers[-1].params_b,
        last.grads_b - a.layers[-1].grads_b,
        last.optimizer_b - a.layers[-1].optimizer_b,
    ) == (state["params"], state["grads"], state["optimizer"])
    assert first.state_b == a.layers[0].state_b  # the first reader already counts the weight
    t = collective_time("all_reduce", size, group_placement([0, 4], 8), HW)
    assert last.dp_step_s - a.layers[-1].dp_step_s == pytest.approx(t)
    stages = [(0, 2), (3, 5)]
    ea, eb = evaluate(a, stages), evaluate(b, stages)
    assert eb.comm_bytes_per_device - ea.comm_bytes_per_device == size
    assert eb.stages[1].memory["params"] - ea.stages[1].memory["params"] == state["params"]
    assert eb.step_time_s > ea.step_time_s
    # One stage holds the weight: nothing extra.
    one = Candidate(8, 1, 1, zero, 1, 2)
    assert _costs(plain, one, dtype).layers == _costs(tied, one, dtype).layers


def test_tied_models_plan_with_pipeline_stages():
    _, nt = _tables()
    req = PlanRequest(spec="gpt", gpus=8, gpus_per_node=8, hardware="a100-80gb", global_batch=16, seq_len=128)
    assert any(c.pp > 1 for c in enumerate_candidates(req, nt, 8))
    sol = solve(PlanRequest(**{**req.__dict__, "pp": 2}), nt.table, HW)
    assert sol.plan.pp == 2 and sol.plan.stages[0][0] == 0 and sol.plan.stages[-1][1] == 5


def test_hf_gpt2_plans_and_compiles_with_pp2(tmp_path, capsys):
    """hf:gpt2 ties its embedding and LM head: ``--pp 2`` plans, each stage gets a marked copy."""
    out = tmp_path / "p.json"
    assert (
        main(
            [
                "plan",
                "--model",
                "hf:gpt2",
                "--layers",
                "2",
                "--hidden",
                "32",
                "--heads",
                "4",
                "--vocab",
                "64",
                "--gpus",
                "2",
                "--gpus-per-node",
                "2",
                "--hardware",
                "cpu",
                "--global-batch",
                "4",
                "--seq-len",
                "16",
                "--dtype",
                "fp32",
                "--pp",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "all-reduced over those stages" in capsys.readouterr().out
    assert load_plan(str(out)).pp == 2
    assert main(["compile", str(out), "--out", str(tmp_path / "c")]) == 0
    man = json.loads((tmp_path / "c" / "manifest.json").read_text())
    copies = [e for st in man["stages"] for e in st["params"].values() if e.get("tied")]
    assert [e["fqn"] for e in copies] == ["inner.lm_head.weight"] * 2 and all(e["tied"] == [0, 1] for e in copies)
