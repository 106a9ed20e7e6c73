"""planner.search.ilp: the ILP's optimum equals brute force under the same cost model; search and errors."""

from __future__ import annotations

import dataclasses
import itertools
import math
import warnings
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cost_models.hardware import load_hardware
from cost_models.strategy import Candidate, NumericTable, candidate_costs, evaluate, memory_bound
from planner.errors import UserError
from planner.plan import Plan
from planner.search.candidates import enumerate_candidates, heuristic_strategy
from planner.search.entries import Entry
from planner.search.ilp import search, solve_candidate
from planner.search.ilp_form import build_problem, highs_available
from planner.search.request import PlanRequest
from planner.search.search_errors import NoFeasiblePlan
from planner.search.solve import _compiled_twins, candidate_entries, least_memory, solve
from tests.helpers import gpt_table

HW = load_hardware("a100-80gb", 8)
# A slow network makes stage transfers and DP traffic matter in small instances.
SLOW = dataclasses.replace(HW, inter_node_bandwidth=2e8, intra_node_bandwidth=2e9, memory_bytes=2**30)
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _all_strategies(n: int, p: int, blocks: list[int], mode: str, cores: list[int]):
    """Every contiguous partition into p stages x every (full, selective) recompute the mode
    allows: each layer none, whole, or (with attention cores) its cores only."""
    for cuts in itertools.combinations(range(1, n), p - 1):
        b = [0, *cuts, n]
        stages = [(b[i], b[i + 1] - 1) for i in range(p)]
        if mode == "none":
            sets = [((), ())]
        elif mode == "all":
            sets = [(tuple(blocks), ())]
        elif mode == "selective":
            sets = [((), tuple(i for i in blocks if i in cores))]
        else:
            sets = [
                (tuple(i for i, c in enumerate(ch) if c == 1), tuple(i for i, c in enumerate(ch) if c == 2))
                for ch in itertools.product(*[(0, 1, 2) if i in cores else (0, 1) for i in range(n)])
            ]
        for ck, sel in sets:
            yield stages, ck, sel


def _brute(cc, kinds, mode):
    cores = [i for i, l in enumerate(cc.layers) if l.sel_saved_b > 0]
    evs = [
        evaluate(cc, s, c, sel)
        for s, c, sel in _all_strategies(
            cc.num_layers, cc.cand.pp, [i for i, k in enumerate(kinds) if k == "block"], mode, cores
        )
    ]
    feas = [e for e in evs if e.feasible]
    return (min(e.step_time_s for e in feas) if feas else None), min(memory_bound(e) for e in evs), evs


@st.composite
def instances(draw):
    layers = draw(st.integers(1, 4))
    shape = draw(st.sampled_from(["uniform", "tail", "mixed"]))
    scale = [draw(st.sampled_from([1, 2, 3])) for _ in range(layers)] if shape == "mixed" else None
    tail = draw(st.sampled_from([0.5, 3.0])) if shape == "tail" else None
    table = gpt_table(
        layers=layers,
        hidden=draw(st.sampled_from([64, 128, 256])),
        heads=4,
        vocab=draw(st.sampled_from([256, 4096])),
        block_scale=scale,
        tail_boundary=tail,
        attention_core=draw(st.booleans()),
    )
    pp = draw(st.integers(1, min(3, layers + 2)))
    dp = draw(st.sampled_from([1, 2]))
    tp = draw(st.sampled_from([1, 2]))
    m = draw(st.integers(pp, pp + 3))
    cand = Candidate(dp, tp, pp, draw(st.integers(0, 3)) if dp > 1 else 0, draw(st.sampled_from([1, 4])), m)
    hw = dataclasses.replace(SLOW, gpus_per_node=draw(st.sampled_from([1, 2, 8])))
    seq = draw(st.sampled_from([64, 512]))
    cc = candidate_costs(
        NumericTable(table), hw, draw(st.sampled_from(["bf16", "fp32"])), seq, cand, hw.gpus_per_node, 1.0
    )
    kinds = [l.kind for l in table.layers]
    mode = draw(st.sampled_from(["auto", "auto", "none", "all", "selective"]))
    return cc, kinds, mode, draw(st.floats(0.0, 1.0)), draw(st.sampled_from(["auto", "general"]))


@SETTINGS
@given(instances())
def test_ilp_optimum_equals_brute_force(inst):
    cc, kinds, mode, where, form = inst
    _, _, evs = _brute(cc, kinds, mode)
    lo = min(memory_bound(e) for e in evs)
    hi = max(memory_bound(e) for e in evs)
    cap = lo * 0.98 + where * (hi * 1.02 - lo * 0.98)  # from infeasible to roomy
    if any(abs(memory_bound(e) - cap) <= 1e-5 * cap for e in evs):
        cap *= 1 + 3e-5  # not on a strategy's exact memory: the ILP keeps a 1e-6 margin
    cc.capacity = cap
    best_time, least, _ = _brute(cc, kinds, mode)
    r = solve_candidate(cc, kinds, mode, formulation=form)
    if best_time is None:
        assert r.evaluation is None, f"ILP found {r.evaluation.step_time_s} where nothing fits"
    else:
        assert r.evaluation is not None, f"ILP says infeasible, brute force found {best_time}"
        assert r.evaluation.feasible
        assert r.evaluation.step_time_s == pytest.approx(best_time, rel=1e-6)
        h = heuristic_strategy(cc, kinds, mode)  # the search's cutoff: feasible, never better
        assert h is None or (h.feasible and h.step_time_s >= best_time * (1 - 1e-9))
    rm = solve_candidate(cc, kinds, mode, objective="memory", formulation=form)
    assert memory_bound(rm.evaluation) == pytest.approx(least, rel=1e-6, abs=8)
    assert rm.evaluation.memory["total"] <= memory_bound(rm.evaluation)  # the peak estimate is below the bound


@settings(max_examples=10, deadline=None)
@given(
    layers=st.integers(2, 6),
    pp=st.integers(1, 4),
    m=st.integers(4, 8),
    zero=st.integers(0, 3),
    tail=st.sampled_from([None, 0.5, 4.0]),
)
def test_uniform_and_general_formulations_agree(layers, pp, m, zero, tail):
    table = gpt_table(layers=layers, hidden=256, heads=4, vocab=4096, tail_boundary=tail)
    cc = candidate_costs(NumericTable(table), SLOW, "bf16", 512, Candidate(2, 1, pp, zero, 2, m), 1, 2**30 * 0.4)
    kinds = [l.kind for l in table.layers]
    u = solve_candidate(cc, kinds, "auto", formulation="uniform")
    g = solve_candidate(cc, kinds, "auto", formulation="general")
    assert u.uniform and not g.uniform
    assert (u.evaluation is None) == (g.evaluation is None)
    if u.evaluation is not None:
        assert u.evaluation.step_time_s == pytest.approx(g.evaluation.step_time_s, rel=1e-6)


def _names(prob) -> set[str]:
    with warnings.catch_warnings():  # dict-style access is deprecated in PuLP 3.3, still works
        warnings.simplefilter("ignore", DeprecationWarning)
        return set(prob.constraints)


def test_constraints_are_named_by_family_and_stage():
    table = gpt_table(layers=3, block_scale=[1, 2, 1])
    cc = candidate_costs(NumericTable(table), HW, "bf16", 128, Candidate(1, 1, 2, 0, 1, 2), 8, 1e9)
    prob, _ = build_problem(cc, [l.kind for l in table.layers])
    names = _names(prob)
    for fam in (
        "partition_assign_l0",
        "partition_order_l0",
        "boundary_end_l1_k0",
        "checkpoint_l1_k0",
        "time_microstep_k1",
        "time_tail_k0",
        "memory_k0",
        "memory_k1",
    ):
        assert fam in names, fam
    uprob, _ = build_problem(
        candidate_costs(NumericTable(gpt_table(layers=3)), HW, "bf16", 128, Candidate(1, 1, 3, 0, 1, 3), 8, 1e9),
        ["pre", "block", "block", "block", "post"],
    )
    assert {"partition_blocks", "partition_nonempty_k1", "memory_k2", "checkpoint_within_k0"} <= _names(uprob)


def _req(**kw):
    base = dict(spec="gpt", gpus=4, gpus_per_node=2, hardware="a100-80gb", global_batch=8, seq_len=256)
    base.update(kw)
    return PlanRequest(**base)


@pytest.mark.parametrize("cores", [False, True])
def test_search_with_pruning_equals_exhaustive_brute_force(cores):
    """The pruned search returns the best over every candidate, partition and recompute set
    (with attention cores: selective recompute too, which the memory-aware bound must allow for)."""
    table = gpt_table(layers=2, hidden=128, heads=2, vocab=1024, attention_core=cores)
    hw = dataclasses.replace(SLOW, gpus_per_node=2, memory_bytes=int(6e7))
    req = _req(hardware="x.json")
    nt = NumericTable(table)
    entries = candidate_entries(req, nt, hw, 2, enumerate_candidates(req, nt, 2))
    kinds = nt.kinds
    res = search(entries, kinds)
    best = None
    for entry in entries:
        t, _, _ = _brute(entry.costs, kinds, "auto")
        if t is not None and (best is None or t < best):
            best = t
    assert best is not None and res.best.step_time_s == pytest.approx(best, rel=1e-6)
    assert res.solved < len(entries)  # bounds pruned some candidates
    assert res.pruned_time + res.pruned_memory + res.solved == len(entries)
    # exact least memory over everything, through the pruned least-memory search
    least = least_memory(entries, kinds)
    brute_least = min(_brute(entry.costs, kinds, "auto")[1] for entry in entries)
    assert least.memory["total"] == pytest.approx(brute_least, rel=1e-6, abs=8)


def test_the_search_prices_only_the_candidates_it_reaches():
    """Lazy entries (ordered by their work floor) give the search of fully priced ones, ranked
    strategies and counts alike, and most of a larger request's candidates are never priced."""
    table = NumericTable(gpt_table(layers=8, hidden=2048, heads=16, vocab=8192))
    req = _req(gpus=16, gpus_per_node=8, global_batch=64, seq_len=1024)
    candidates = enumerate_candidates(req, table, 8)
    lazy = candidate_entries(req, table, HW, 8, candidates)
    got = search(lazy, table.kinds)
    priced = sum(entry.priced for entry in lazy)
    assert 0 < priced < len(lazy) / 2
    assert all(entry.floor <= entry.time_lb * (1 + 1e-12) for entry in lazy)
    eager = search([Entry.of(entry.costs) for entry in lazy], table.kinds)
    assert [ev.strategy.candidate for ev in got.ranked] == [ev.strategy.candidate for ev in eager.ranked]
    assert [ev.step_time_s for ev in got.ranked] == pytest.approx([ev.step_time_s for ev in eager.ranked], rel=1e-12)
    assert got.pruned_time + got.pruned_memory + got.solved == len(lazy)


def test_candidates_whose_state_overflows_are_skipped_unpriced():
    """On devices too small for most layouts, the search rules out the candidates whose model
    state alone overflows without pricing them (``Entry.too_big``): it prices fewer candidates
    than without that check and finds the same strategies and counts; every candidate ruled out
    so is out of memory once priced."""
    table = NumericTable(gpt_table(layers=8, hidden=4096, heads=32, vocab=32000))
    small = dataclasses.replace(HW, memory_bytes=12 * 2**30)
    req = _req(gpus=16, gpus_per_node=8, global_batch=64, seq_len=1024)
    lazy = candidate_entries(req, table, small, 8, enumerate_candidates(req, table, 8))
    blind = [Entry(entry.cand, entry.floor, entry._price) for entry in lazy]  # no state floor
    got, without = search(lazy, table.kinds), search(blind, table.kinds)
    assert got.best is not None
    assert sum(entry.priced for entry in lazy) < sum(entry.priced for entry in blind)
    assert [ev.strategy.candidate for ev in got.ranked] == [ev.strategy.candidate for ev in without.ranked]
    # a candidate both too big and too slow counts where it was first ruled out
    assert got.pruned_memory + got.pruned_time == without.pruned_memory + without.pruned_time
    assert got.solved == without.solved and got.pruned_memory >= without.pruned_memory
    for entry in lazy:
        if entry.too_big:
            assert entry.memory_lb > entry.costs.capacity


def test_incumbents_change_what_a_search_prices_not_what_it_finds():
    """The compiled search starts from the eager winners repriced compiled (``incumbents``): it
    runs fewer greedy strategies and finds the same strategies, runners-up included, as a search
    that starts from nothing."""
    table = NumericTable(gpt_table(layers=8, hidden=2048, heads=16, vocab=32000))
    req = _req(gpus=16, gpus_per_node=8, global_batch=64, seq_len=1024)
    eager = search(candidate_entries(req, table, HW, 8, enumerate_candidates(req, table, 8)), table.kinds)
    compiled_candidates = [dataclasses.replace(c, compile=True) for c in enumerate_candidates(req, table, 8)]
    plain_entries = candidate_entries(req, table, HW, 8, compiled_candidates)
    seeded_entries = candidate_entries(req, table, HW, 8, compiled_candidates)
    twins = _compiled_twins(eager, seeded_entries)
    assert twins and all(twin.strategy.candidate.compile for twin in twins)
    greedy_runs = []

    def counted(costs, *args):
        greedy_runs.append(costs.cand)
        return heuristic_strategy(costs, *args)

    with mock.patch("planner.search.ilp.heuristic_strategy", counted):
        plain = search(plain_entries, table.kinds)
        plain_runs = len(greedy_runs)
        seeded = search(seeded_entries, table.kinds, incumbents=twins)

    def found(result):
        return [(ev.strategy, round(ev.step_time_s, 12)) for ev in result.ranked + result.extra]

    assert found(seeded) == found(plain)
    assert seeded.solved == plain.solved
    assert len(greedy_runs) - plain_runs < plain_runs


def test_solve_gives_a_valid_plan_with_alternatives():
    table = gpt_table(layers=8, hidden=1024, heads=16, vocab=32000)
    req = PlanRequest(
        spec="gpt", gpus=32, gpus_per_node=8, hardware="a100-80gb", global_batch=64, seq_len=1024, sizes={"layers": 8}
    )
    plan = solve(req, table, HW).plan
    again = Plan.from_dict(plan.to_dict())
    assert again == plan
    assert plan.dp * plan.tp * plan.pp == 32 and len(plan.stages) == plan.pp
    assert len(plan.alternatives) == 3
    assert all(a.step_time_s >= plan.predicted.step_time_s for a in plan.alternatives)
    assert all("slower" in a.reason or "ties" in a.reason for a in plan.alternatives)
    degs = {(a.dp, a.tp, a.pp) for a in plan.alternatives}
    assert len(degs) == 3 and (plan.dp, plan.tp, plan.pp) not in degs
    p = plan.predicted
    assert sum(p.time.values()) == pytest.approx(p.step_time_s)
    assert p.memory["total"] == p.peak_memory_bytes <= HW.memory_bytes * 0.9
    assert 0 < p.mfu < 1 and p.tflops_per_device == pytest.approx(p.mfu * HW.peak("bf16") / 1e12)
    assert plan.solver.name == "pulp-cbc" and plan.solver.candidates > 0
    assert plan.model.layer_names[0] == "embed" and plan.model.layers == 8


def test_pins_fix_decisions_and_checkpoint_modes():
    table = gpt_table(layers=6, hidden=512, heads=8, vocab=8192)
    req = PlanRequest(
        spec="gpt",
        gpus=8,
        gpus_per_node=8,
        hardware="a100-80gb",
        global_batch=32,
        seq_len=512,
        pp=2,
        zero_stage=1,
        micro_batch=2,
        checkpoint="all",
    )
    plan = solve(req, table, HW).plan
    assert (plan.pp, plan.zero_stage, plan.micro_batch_size) == (2, 1, 2)
    assert plan.checkpoint_layers == list(range(1, 7))
    plan = solve(dataclasses.replace(req, checkpoint="none"), table, HW).plan
    assert plan.checkpoint_layers == [] and plan.selective_layers == []
    cored = gpt_table(layers=6, hidden=512, heads=8, vocab=8192, attention_core=True)
    plan = solve(dataclasses.replace(req, checkpoint="selective"), cored, HW).plan
    assert plan.checkpoint_layers == [] and plan.selective_layers == list(range(1, 7))
    assert plan.predicted.time["recompute"] > 0


def test_selective_recompute_is_chosen_where_it_beats_full_recompute():
    """A long sequence's attention scores dominate a block's activations (5 a s^2 b bytes against
    34 s b h): dropping only them fits memory for a fraction of a full recompute's time."""
    table = gpt_table(layers=24, hidden=1024, heads=16, vocab=32000, attention_core=True)
    req = PlanRequest(
        spec="gpt",
        gpus=8,
        gpus_per_node=8,
        hardware="a100-80gb",
        global_batch=64,
        seq_len=8192,
        dp=8,
        tp=1,
        pp=1,
        zero_stage=1,
        micro_batch=1,
        schedule="1f1b",
    )
    auto = solve(req, table, HW).plan
    full = solve(dataclasses.replace(req, checkpoint="all"), table, HW).plan
    assert auto.selective_layers and not set(auto.selective_layers) & set(auto.checkpoint_layers)
    assert auto.predicted.time["recompute"] < full.predicted.time["recompute"]
    assert auto.predicted.step_time_s < full.predicted.step_time_s
    assert auto.predicted.peak_memory_bytes <= HW.memory_bytes * 0.9
    with pytest.raises(NoFeasiblePlan):  # memory is what forces the recompute
        solve(dataclasses.replace(req, checkpoint="none"), table, HW).plan


def test_only_pinned_triple_fills_alternatives_with_other_layouts():
    table = gpt_table(layers=4, hidden=256, heads=4)
    # 1F1B pinned: the exhaustive check below solves the 1F1B ILPs (other schedules are a post-pass)
    req = PlanRequest(
        spec="gpt",
        gpus=4,
        gpus_per_node=4,
        hardware="a100-80gb",
        global_batch=16,
        seq_len=128,
        dp=2,
        tp=1,
        pp=2,
        schedule="1f1b",
    )
    plan = solve(req, table, HW).plan
    assert len(plan.alternatives) == 3
    assert all((a.dp, a.tp, a.pp) == (2, 1, 2) for a in plan.alternatives)
    # one per other layout (here: ZeRO stage), never a re-batched copy of the winner's
    zeros = [a.zero_stage for a in plan.alternatives]
    assert len(set(zeros)) == 3 and plan.zero_stage not in zeros
    # each is the true best of its ZeRO stage: solve every candidate without pruning
    nt = NumericTable(table)
    entries = candidate_entries(req, nt, HW, 4, enumerate_candidates(req, nt, 4))
    best: dict[int, float] = {}
    for entry in entries:
        cc = entry.costs
        if (r := solve_candidate(cc, nt.kinds)).evaluation is not None:
            zero = cc.cand.zero_stage
            best[zero] = min(best.get(zero, math.inf), r.evaluation.step_time_s)
    assert min(best.values()) == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    others = sorted(t for zero, t in best.items() if zero != plan.zero_stage)
    assert [a.step_time_s for a in plan.alternatives] == pytest.approx(others[:3], rel=1e-9)


def test_bad_pins_raise_user_errors():
    table = gpt_table(layers=4, hidden=384, heads=6)
    with pytest.raises(UserError, match="does not divide the model's 6 attention heads"):
        solve(_req(tp=4), table, HW).plan
    with pytest.raises(UserError, match="must multiply to the number of devices"):
        solve(_req(dp=2, tp=2, pp=2), table, HW).plan
    with pytest.raises(UserError, match="fewer than --pp"):
        solve(_req(dp=1, tp=1, pp=4, micro_batch=4), table, HW).plan


def test_a_device_count_nothing_runs_on_names_the_nearest_that_do():
    """1,000 devices share no factor 5 with a power-of-two batch, 12 heads or 14 rows: the error
    lists the tensor-parallel degrees once, with their count, and the nearest whole-node counts
    that some strategy runs on; a pinned micro-batch that divides no rank's share says so."""
    table = NumericTable(gpt_table(layers=12, hidden=768, heads=12, vocab=50257))
    with pytest.raises(UserError) as refused:
        enumerate_candidates(_req(gpus=1000, gpus_per_node=8, global_batch=512), table, 8)
    message = str(refused.value)
    assert "--tp 5, 8, 10, 20, 25, 40, 50, 100, 125, 200, 250, 500 or 1000 does not divide the model's 12" in message
    assert message.count("does not divide the model's 12 attention heads") == 1
    assert "nearest device counts some strategy runs on: --gpus 896 and 1,024." in message
    for gpus in (896, 1024):
        assert enumerate_candidates(_req(gpus=gpus, gpus_per_node=8, global_batch=512), table, 8)
    with pytest.raises(UserError, match="--micro-batch 3 does not divide the global batch's share"):
        enumerate_candidates(_req(gpus=2, gpus_per_node=2, global_batch=8, micro_batch=3), table, 2)


def test_no_feasible_plan_explains_least_memory_and_fixes():
    table = gpt_table(layers=8, hidden=4096, heads=32, vocab=50000)  # ~1.8 B parameters
    small = dataclasses.replace(HW, memory_bytes=2 * 2**30)
    # no host to offload to (a few MiB of host memory): only more devices or a bigger one help
    no_host = dataclasses.replace(small, host_memory_bytes=2**20)
    req = _req(gpus=2, gpus_per_node=2, global_batch=4, seq_len=512)
    with pytest.raises(NoFeasiblePlan) as ei:
        solve(req, table, no_host).plan
    msg = str(ei.value)
    assert "No strategy fits in 1.80 GiB per device" in msg
    assert "The least any strategy needs is" in msg and "dominate" in msg and "To make it fit" in msg
    assert "more devices" in msg and "offload" not in msg
    # offload pinned off where it would fit: the message offers it, with its speed, not more devices
    with pytest.raises(NoFeasiblePlan) as ei:
        solve(dataclasses.replace(req, offload_optimizer="none", offload_params="none"), table, small).plan
    msg = str(ei.value)
    assert "offload (--offload-optimizer cpu" in msg and "fits on these 2 devices" in msg and "tokens/s" in msg
    assert "more devices" not in msg
    least = ei.value.least
    assert least.memory["total"] > small.memory_bytes * 0.9
    # pure data parallelism pinned at ZeRO 0 replicates everything: the pins are the problem
    with pytest.raises(NoFeasiblePlan) as ei:
        solve(
            _req(global_batch=8, seq_len=512, tp=1, pp=1, zero_stage=0),
            table,
            dataclasses.replace(HW, memory_bytes=12 * 2**30),
        ).plan
    msg = str(ei.value)
    assert "drop the pins (--tp 1 --pp 1 --zero-stage 0)" in msg and "--zero-stage 3" in msg


def test_a_searched_zero_stage_is_not_offered_as_a_fix():
    """A MoE whose experts are sharded over ep = dp ranks has no expert state for ZeRO 3 to shard:
    the least memory is at ZeRO 1, and ZeRO 3, searched already, is no fix to offer; pinned
    below 3 it is."""
    from tests.cost_models.moe_tables import moe_table

    table = NumericTable(moe_table(layers=2, hidden=1024, ffn=4096, experts=8, top_k=2))
    small = dataclasses.replace(HW, memory_bytes=2**30)
    req = _req(gpus=2, gpus_per_node=2, global_batch=8, seq_len=256, tp=1, pp=1)
    with pytest.raises(NoFeasiblePlan) as searched:
        solve(req, table, small)
    least = searched.value.least.strategy.candidate
    assert (least.zero_stage, least.dp, least.expert_parallel) == (1, 2, 2)
    assert "To make it fit" in str(searched.value) and "--zero-stage 3" not in str(searched.value)
    with pytest.raises(NoFeasiblePlan) as pinned:
        solve(dataclasses.replace(req, zero_stage=1), table, small)
    assert "--zero-stage 3 (shards parameters" in str(pinned.value)


def test_highs_agrees_with_cbc():
    if not highs_available():
        pytest.skip("highspy not installed")
    table = gpt_table(layers=5, hidden=512, heads=8, vocab=8192, block_scale=[1, 2, 1, 1, 3])
    for pp in (1, 2, 3):
        cc = candidate_costs(NumericTable(table), SLOW, "bf16", 256, Candidate(2, 2, pp, 2, 1, 4), 2, 2**30 * 0.5)
        kinds = [l.kind for l in table.layers]
        a = solve_candidate(cc, kinds, solver="cbc").evaluation
        b = solve_candidate(cc, kinds, solver="highs").evaluation
        assert (a is None) == (b is None)
        if a is not None:
            assert a.step_time_s == pytest.approx(b.step_time_s, rel=1e-6)


def test_solver_choice_from_environment(monkeypatch):
    from planner.search.ilp import default_solver

    monkeypatch.setenv("PLANNER_SOLVER", "highs")
    assert default_solver() == "highs"
    monkeypatch.delenv("PLANNER_SOLVER")
    assert default_solver() == "cbc"
    with pytest.raises(UserError, match="unknown solver"):
        solve(_req(), gpt_table(), HW, solver="gurobi").plan


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layers=st.integers(3, 10),
    pp=st.integers(1, 5),
    zero=st.integers(0, 3),
    micro_batch=st.sampled_from([1, 2, 4]),
    room=st.sampled_from([0.9, 1.0, 1.2, 1.5, 3.0]),
    core=st.booleans(),
)
def test_the_vectorized_least_micro_step_is_the_allocation_s(layers, pp, zero, micro_batch, room, core):
    """The relaxed stage model's least micro-step, every stage's costs computed at once, equals to
    the bit the block-by-block allocation's, in every recompute mode, exact and relaxed, with
    memory from too small to ample."""
    from planner.search.candidates import _UniformStages, memory_lower_bound

    pp = min(pp, layers)
    table = NumericTable(gpt_table(layers=layers, hidden=128, heads=4, vocab=1024, attention_core=core))
    cand = Candidate(2, 1, pp, zero, micro_batch, max(pp, 4))
    roomy = candidate_costs(table, HW, "bf16", 256, cand, 8, HW.memory_bytes)
    costs = candidate_costs(table, HW, "bf16", 256, cand, 8, memory_lower_bound(roomy) * room)
    for mode in ("auto", "none", "all", "selective"):
        for relaxed in (True, False):
            allocated = _UniformStages(costs, mode, relaxed=relaxed).allocate()
            least = _UniformStages(costs, mode, relaxed=relaxed).least_micro_step()
            assert (least is None) == (allocated is None)
            assert allocated is None or least == allocated[0]
