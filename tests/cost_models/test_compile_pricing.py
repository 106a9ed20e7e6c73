"""Compiled stages in the cost model and the search: what compiling saves per step, what it costs
once, and when the planner picks it (``cost_models.strategy``, ``planner.search.solve``)."""

from __future__ import annotations

import dataclasses
import json

import pytest

import planner.search.solve as solve_module
from cost_models.hardware import load_hardware
from cost_models.strategy import (
    COMPILE_S_PER_CLASS,
    COMPILED_BYTES_FRACTION,
    COMPILED_REGION_OPS,
    Candidate,
    NumericTable,
    candidate_costs,
    evaluate,
)
from passes.common import B, S
from planner.cli import main
from planner.plan import Plan, PlanError
from planner.search.request import DEFAULT_HORIZON_STEPS, PlanRequest
from planner.search.solve import solve
from tests.helpers import gpt_table, make_plan, plan_args

GPU = load_hardware("a100-80gb", 8)
CPU_RANK = dataclasses.replace(GPU, op_overhead_s=1e-5, ops_async=False)
"""A synthetic CPU-like device: 10 us per operator call, issued and run on the same core."""
SEQ = 128


def _table(ops=30, fwd_bytes=4000, bwd_bytes=8000, tp_calls=0):
    t = gpt_table(layers=2, hidden=256, heads=4)
    for lay in t.layers:
        lay.num_ops = ops
        lay.fwd_bytes = fwd_bytes * B * S
        lay.bwd_bytes = bwd_bytes * B * S
        lay.tp_allreduce_calls = lay.tp_allreduce_bwd_calls = tp_calls
    return t


def _cc(table, cand, hw=CPU_RANK):
    return candidate_costs(NumericTable(table), hw, "bf16", SEQ, cand, hw.gpus_per_node, hw.memory_bytes * 0.9)


def test_compiled_layer_pays_one_region_call_and_moves_fused_bytes():
    t, o, bw = _table(), CPU_RANK.op_overhead_s, CPU_RANK.memory_bandwidth
    cand = Candidate(dp=1, tp=1, pp=1, zero_stage=0, micro_batch_size=2, num_micro_batches=1)
    eager = _cc(t, cand).layers[1]
    comp = _cc(t, dataclasses.replace(cand, compile=True)).layers[1]
    fwd_b, bwd_b = 4000 * 2 * SEQ, 8000 * 2 * SEQ
    # forward: 30 operator calls -> one region worth 10; a quarter of the bytes fused away
    saved_f = (30 - COMPILED_REGION_OPS) * o + (1 - COMPILED_BYTES_FRACTION) * fwd_b / bw
    assert eager.fwd_s - comp.fwd_s == pytest.approx(saved_f, rel=1e-9)
    # backward: twice the calls, its own bytes
    saved_b = 2 * (30 - COMPILED_REGION_OPS) * o + (1 - COMPILED_BYTES_FRACTION) * bwd_b / bw
    assert (eager.compute_s - eager.fwd_s) - (comp.compute_s - comp.fwd_s) == pytest.approx(saved_b, rel=1e-9)
    # a recomputed layer reruns the compiled forward
    assert eager.rec_s - comp.rec_s == pytest.approx(CPU_RANK.recompute_ratio * saved_f, rel=1e-9)
    # nothing else changes: memory, traffic, optimizer
    same = ("params_b", "grads_b", "optimizer_b", "saved_b", "tp_s", "zero_mb_s", "dp_step_s", "opt_s")
    assert all(getattr(eager, f) == getattr(comp, f) for f in same)


def test_graph_breaks_at_tensor_parallel_collectives_cost_regions():
    """At tp = 2 a block with 2 + 2 all-reduces compiles into 5 regions: 50 calls' worth of host
    time against 30 eager operators, so without bytes to fuse the compiled block is slower."""
    t = _table(fwd_bytes=0, bwd_bytes=0, tp_calls=2)
    cand = Candidate(dp=1, tp=2, pp=1, zero_stage=0, micro_batch_size=2, num_micro_batches=1)
    eager, comp = _cc(t, cand).layers[1], _cc(t, dataclasses.replace(cand, compile=True)).layers[1]
    assert comp.fwd_s - eager.fwd_s == pytest.approx((5 * COMPILED_REGION_OPS - 30) * CPU_RANK.op_overhead_s)


@pytest.mark.parametrize("hw, per_class", [(CPU_RANK, COMPILE_S_PER_CLASS["cpu"]), (GPU, COMPILE_S_PER_CLASS["gpu"])])
def test_compile_time_counts_the_distinct_layer_classes_of_the_busiest_stage(hw, per_class):
    t = _table()
    one = Candidate(1, 1, 1, 0, 2, 1, compile=True)
    assert evaluate(_cc(t, one, hw), [(0, 3)]).extra["compile_s"] == 3 * per_class  # embed, block, head
    two = Candidate(1, 1, 2, 0, 2, 2, compile=True)
    assert evaluate(_cc(t, two, hw), [(0, 1), (2, 3)]).extra["compile_s"] == 2 * per_class
    assert "compile_s" not in evaluate(_cc(t, dataclasses.replace(two, compile=False), hw), [(0, 1), (2, 3)]).extra


def _request(**kw):
    return PlanRequest(
        spec="gpt",
        gpus=1,
        gpus_per_node=1,
        hardware="synthetic",
        global_batch=8,
        seq_len=SEQ,
        sizes={"layers": 2},
        **kw,
    )


def test_compiles_only_when_the_run_repays_the_compile_time():
    t = _table(ops=400)  # many small operators: compiling saves a lot per step
    eager = solve(_request(compile="off"), t, CPU_RANK)
    assert eager.plan.compile is False and not eager.compile.on and eager.compile.mode == "off"
    saving, cost = eager.compile.saving_s, eager.compile.compile_s
    assert saving > 0 and cost == 3 * COMPILE_S_PER_CLASS["cpu"]
    need = cost / saving  # steps after which compiling has paid for itself
    tokens_per_step = 8 * SEQ
    short = solve(_request(tokens=0.8 * need * tokens_per_step), t, CPU_RANK)
    long = solve(_request(tokens=1.25 * need * tokens_per_step), t, CPU_RANK)
    assert short.plan.compile is False and "more than the run's" in short.compile.reason()
    assert long.plan.compile is True and "within the run's" in long.compile.reason()
    assert long.plan.predicted.step_time_s == pytest.approx(eager.plan.predicted.step_time_s - saving)
    # without --tokens: the default horizon
    default = solve(_request(), t, CPU_RANK)
    assert default.compile.steps == DEFAULT_HORIZON_STEPS
    assert default.plan.compile is (DEFAULT_HORIZON_STEPS * saving > cost)


def test_the_pin_wins_both_ways():
    t = _table(ops=400)
    assert solve(_request(compile="on"), t, CPU_RANK).plan.compile is True
    forced_off = solve(_request(compile="off", tokens=1e15), t, CPU_RANK)
    assert forced_off.plan.compile is False
    assert forced_off.compile.reason().startswith("off, pinned by --compile off")
    cheap = _table(ops=2, fwd_bytes=0, bwd_bytes=0)  # nothing to save: pinned on is slower
    on = solve(_request(compile="on"), cheap, CPU_RANK)
    assert on.plan.compile is True and on.compile.saving_s < 0 and "slower" in on.compile.reason()


def test_tiny_test_models_are_planned_uncompiled(tmp_path, capsys):
    """The models the suite trains, on the ``cpu`` profile (no operator overhead measured): the
    fused bytes save tens of microseconds per step, which would take some 650,000 steps to repay
    the compilation (the cost tests' 2 M tokens are 15,625 steps)."""
    for extra in ([], ["--tokens", "2M"], ["--tp", "2"], ["--pp", "2"]):
        assert main(plan_args(tmp_path / "p.json", "--json", *extra)) == 0
        plan = json.loads(capsys.readouterr().out)
        assert plan["compile"] is False, extra
    assert main(plan_args(tmp_path / "p.json", "--compile", "on")) == 0
    out = capsys.readouterr().out
    assert "compiled stages" in out and "on, pinned by --compile on" in out
    assert json.loads((tmp_path / "p.json").read_text())["compile"] is True


def test_compile_flag_rejects_other_values(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(plan_args(tmp_path / "p.json", "--compile", "maybe"))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --compile: invalid choice: 'maybe'" in err and "Traceback" not in err


def test_plans_without_the_key_load_uncompiled():
    d = make_plan().to_dict()
    assert d["compile"] is False
    del d["compile"]
    assert Plan.from_dict(d).compile is False
    with pytest.raises(PlanError, match="compile must be true or false"):
        Plan.from_dict({**d, "compile": "yes"})


def test_a_compiled_free_plan_is_never_slower_than_the_compile_pin(tmp_path, capsys):
    """When the run repays compilation the free search plans compiled, and its schedule walk visits
    the compiled candidates (it walked the eager ones, and missed GPT-3 175B's interleaved v=8
    plan: 17.20 s free against 16.78 s with --compile on)."""
    flags = ["--model", "gpt3-175b", "--gpus", "1024", "--gpus-per-node", "8", "--hardware", "a100-80gb"]
    flags += ["--global-batch", "1536", "--seq-len", "2048", "--tokens", "300e9", "--json"]
    steps = {}
    for name, extra in (("free", []), ("on", ["--compile", "on"])):
        assert main(["plan", *flags, *extra, "--out", str(tmp_path / f"{name}.json")]) == 0
        plan = json.loads((tmp_path / f"{name}.json").read_text())
        assert plan["compile"] is True
        steps[name] = plan["predicted"]["step_time_s"]
    capsys.readouterr()
    assert steps["free"] <= steps["on"] * (1 + 1e-9)


@pytest.mark.parametrize("repaid_times", [0.8, 3.0])
def test_searching_compiled_first_plans_what_searching_eager_first_does(monkeypatch, repaid_times):
    """``solve._compiled_first`` (the compiled search, then an eager probe) against the eager
    search first: the same plan and the same decision, whether compiling repays itself or not
    (then the probe finds the eager winner and the eager search runs after all)."""
    t = _table(ops=400)
    eager = solve(_request(compile="off"), t, CPU_RANK)
    need = eager.compile.compile_s / eager.compile.saving_s
    request = _request(tokens=repaid_times * need * 8 * SEQ)
    found = {}
    for first in (False, True):
        monkeypatch.setattr(solve_module, "_compiling_likely", lambda *args, first=first: first)
        solution = solve(request, t, CPU_RANK)
        plan = solution.plan.to_dict()
        plan.pop("solver")
        assert plan["compile"] is (repaid_times > 1)
        found[first] = (plan, solution.compile.on, solution.compile.compile_s)
    assert found[True] == found[False]
    # the guess itself, on the floors' gap: three times over is likely, 0.8 times is not
    monkeypatch.undo()
    table = NumericTable(t)
    entries = solve_module.candidate_entries(
        request, table, CPU_RANK, 1, solve_module.enumerate_candidates(request, table, 1)
    )
    guessed = solve_module._compiled_first(request, table, CPU_RANK, 1, entries, "cbc")
    assert (guessed is not None) is (repaid_times > 1)
