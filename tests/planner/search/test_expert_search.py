"""Expert parallelism in the search: the ILP prices ep as ``evaluate`` does, the pruned search is
optimal over ep, pins and bad MoE settings are refused clearly, and the plan shows the gain."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cost_models.hardware import load_hardware
from cost_models.strategy import Candidate, NumericTable, candidate_costs, evaluate
from planner.plan import Plan
from planner.search.candidates import enumerate_candidates
from planner.search.ilp import search, solve_candidate
from planner.search.request import PlanRequest
from planner.search.search_errors import SearchError
from planner.search.solve import candidate_entries, solve
from tests.cost_models.moe_tables import moe_table
from tests.helpers import gpt_table

H100 = load_hardware("h100-sxm", 8)
SMALL = dataclasses.replace(H100, memory_bytes=2**31)


def _req(**kw) -> PlanRequest:
    base = dict(spec="gpt", gpus=8, gpus_per_node=4, hardware="h100-sxm", global_batch=16, seq_len=256, dtype="bf16")
    base.update(kw)
    return PlanRequest(**base)


def _brute(costs):
    """The fastest feasible strategy of one candidate: every partition x every recompute set (of
    any row, as the ILP may recompute the embedding and the head too)."""
    n, p = costs.num_layers, costs.cand.pp
    blocks = list(range(n))
    best = None
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = [0, *cuts, n]
        stages = [(bounds[i], bounds[i + 1] - 1) for i in range(p)]
        for mask in itertools.product((0, 1), repeat=len(blocks)):
            evaluation = evaluate(costs, stages, [i for i, on in zip(blocks, mask) if on])
            if evaluation.feasible and (best is None or evaluation.step_time_s < best):
                best = evaluation.step_time_s
    return best


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layers=st.integers(1, 3),
    pp=st.integers(1, 3),
    ep=st.sampled_from([2, 4]),
    zero=st.integers(0, 3),
    tp=st.sampled_from([1, 2]),
    imbalance=st.sampled_from([1.0, 1.3]),
    room=st.sampled_from([0.45, 0.7, 0.9, 1.05, 1.5]),
)
def test_ilp_optimum_equals_brute_force_with_expert_parallelism(layers, pp, ep, zero, tp, imbalance, room):
    """The ILP sums the same per-layer terms as ``evaluate`` (all-to-alls in the work, again in a
    recomputed forward; expert state divided by ep): its optimum is brute force's."""
    table = NumericTable(moe_table(layers=layers, hidden=128, ffn=256, experts=4, top_k=2, vocab=1024))
    cand = Candidate(4, tp, pp, zero, 2, pp + 1, expert_parallel=ep, moe_imbalance=imbalance)
    costs = candidate_costs(table, SMALL, "bf16", 256, cand, 4, 1.0)
    roomy = max(
        evaluate(costs, [(0, costs.num_layers - 1)] if pp == 1 else _even(costs.num_layers, pp)).extra["memory_bound"],
        1,
    )
    costs.capacity = roomy * room * (1 + 3e-5)  # off any strategy's exact bound (the ILP keeps a margin)
    want = _brute(costs) if pp <= costs.num_layers else None
    got = solve_candidate(costs, table.kinds, "auto").evaluation if pp <= costs.num_layers else None
    if want is None:
        assert got is None
    else:
        assert got is not None and got.step_time_s == pytest.approx(want, rel=1e-6)


def _even(n: int, p: int) -> list[tuple[int, int]]:
    cuts = [round(i * n / p) for i in range(p + 1)]
    return [(cuts[i], cuts[i + 1] - 1) for i in range(p)]


def test_pruned_search_is_optimal_over_every_expert_degree():
    """The search with pruning returns the best over every candidate (ep 1, 2, 4 included)."""
    table = NumericTable(moe_table(layers=2, hidden=128, ffn=512, experts=4, top_k=2, vocab=1024))
    hw = dataclasses.replace(SMALL, gpus_per_node=4)
    request = _req(hardware="x.json")
    candidates = enumerate_candidates(request, table, 4)
    assert {c.expert_parallel for c in candidates} == {1, 2, 4}
    entries = candidate_entries(request, table, hw, 4, candidates)
    result = search(entries, table.kinds)
    best = min(t for t in (_brute(entry.costs) for entry in entries) if t is not None)
    assert result.best.step_time_s == pytest.approx(best, rel=1e-6)


def test_dense_models_enumerate_only_ep_one():
    table = NumericTable(gpt_table(layers=2, hidden=128, heads=2, vocab=1024))
    candidates = enumerate_candidates(_req(), table, 4)
    assert candidates and all(c.expert_parallel == 1 for c in candidates)


def test_ep_pins_and_bad_settings_are_refused_clearly():
    moe = moe_table(layers=2, hidden=128, ffn=256, experts=4, top_k=2, vocab=1024)
    with pytest.raises(SearchError, match="no routed experts"):
        solve(_req(ep=2), gpt_table(layers=2, hidden=128, heads=2, vocab=1024), H100)
    with pytest.raises(SearchError, match="does not divide the model's 4 routed experts"):
        solve(_req(ep=8), moe, H100)
    with pytest.raises(SearchError, match="--ep 4 does not divide --dp 2"):
        _req(ep=4, dp=2)
    with pytest.raises(SearchError, match="--ep 2 cannot run with --offload-optimizer cpu"):
        _req(ep=2, offload_optimizer="cpu")
    with pytest.raises(SearchError, match="--moe-imbalance must be a number >= 1.0"):
        _req(moe_imbalance=0.8)
    with pytest.raises(SearchError, match="--moe-capacity-factor must be a positive number"):
        _req(moe_capacity_factor=0.0)
    plan = solve(_req(ep=2), moe, H100).plan
    assert plan.expert_parallel == 2 and plan.dp % 2 == 0


def test_plan_records_experts_and_shows_the_best_plan_without_ep():
    """plan.json: ``expert_parallel``, ``model.moe`` (with the capacity factor), the request's MoE
    settings (a re-plan keeps them), and a runner-up at ep 1 when the winner shards its experts."""
    # 16 experts: enough expert state that the free plan shards them (8 replicated ones stay at ep 1)
    moe = moe_table(layers=8, hidden=1024, ffn=4096, experts=16, top_k=2, heads=8, vocab=4096)
    request = _req(gpus=16, gpus_per_node=8, global_batch=64, seq_len=1024, moe_capacity_factor=1.25, ep=8)
    plan = solve(request, moe, H100).plan
    assert plan.expert_parallel == 8
    assert plan.model.moe == {
        "layers": list(range(1, 9)),
        "experts": 16,
        "top_k": 2,
        "shared_experts": 0,
        "capacity_factor": 1.25,
    }
    assert plan.request["ep"] == 8 and plan.request["moe_capacity_factor"] == 1.25
    assert (
        PlanRequest.from_record(
            {k: v for k, v in plan.request.items() if k != "gpus_per_node"} | {"gpus_per_node": 8}
        ).ep
        == 8
    )
    free_request = dataclasses.replace(request, ep=None, moe_capacity_factor=None, seq_len=2048)
    free = solve(free_request, moe, H100).plan
    assert free.expert_parallel > 1
    # the runner-up without ep is the best plan without it: what --ep 1 plans
    plain = [alt for alt in free.alternatives if alt.expert_parallel == 1]
    replicated = solve(dataclasses.replace(free_request, ep=1), moe, H100).plan
    assert plain and plain[0].step_time_s == pytest.approx(replicated.predicted.step_time_s, rel=1e-9)
    assert plain[0].step_time_s > free.predicted.step_time_s
    data = free.to_dict()
    assert data["expert_parallel"] == free.expert_parallel
    assert all(("expert_parallel" in alt) == (alt.get("expert_parallel", 1) > 1) for alt in data["alternatives"])
    assert Plan.from_dict(data).to_dict() == data
    assert free.predicted.time["ep_comm"] >= 0.0
