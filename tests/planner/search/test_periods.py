"""planner.search.periods: blocks repeating in a period of unlike blocks (Llama-4's dense and
expert blocks) are cut between whole periods by counting; what fits the grouped table fits the
real rows, and the grouped optimum is close to the general ILP's."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cost_models.hardware import load_hardware
from cost_models.strategy import Candidate, NumericTable, candidate_costs, evaluate, memory_bound
from planner.search.block_counts import solve_counts
from planner.search.candidates import head_rows
from planner.search.ilp import SearchResult, solve_candidate
from planner.search.periods import group_rows, periodic_groups
from tests.helpers import gpt_table

SLOW = dataclasses.replace(
    load_hardware("a100-80gb", 8), inter_node_bandwidth=2e8, intra_node_bandwidth=2e9, memory_bytes=2**30
)


def _costs(scales, pp=2, m=4, capacity=0.5, zero=0, dp=1):
    table = gpt_table(layers=len(scales), hidden=256, heads=4, vocab=8192, block_scale=scales, attention_core=True)
    cand = Candidate(dp, 1, pp, zero, 1, m)
    costs = candidate_costs(NumericTable(table), SLOW, "bf16", 512, cand, 8, 1.0)
    every = sum(n * (row.state_b + row.saved_b * max(costs.inflight)) for row, n in costs.distinct)
    costs.capacity = every / pp * capacity * 2
    return costs, [row.kind for row in table.layers]


@pytest.mark.parametrize(
    "scales, head, period, rows",
    [
        ([1, 3] * 6, 0, 2, [1] + [2] * 5 + [2, 1]),  # the last period is the distinct last row
        ([2] + [1, 3] * 5, 1, 2, [1, 1] + [2] * 4 + [2, 1]),
        ([1, 3] * 5 + [1], 0, 2, [1] + [2] * 5 + [1, 1]),  # a rest of one block
        ([1, 1, 3] * 4, 0, 3, [1] + [3] * 3 + [3, 1]),
    ],
)
def test_which_tables_are_grouped_by_their_period(scales, head, period, rows):
    costs, kinds = _costs(scales)
    assert head_rows(costs, kinds) is None
    grouped = periodic_groups(costs, kinds)
    assert (grouped.head, grouped.period) == (head, period)
    assert [len(group) for group in grouped.rows] == rows
    assert [row for group in grouped.rows for row in group] == list(range(costs.num_layers))


@pytest.mark.parametrize("scales", [[1] * 8, [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 3, 1, 3, 2, 2, 1, 3]])
def test_tables_without_a_period_are_not_grouped(scales):
    costs, kinds = _costs(scales)
    assert periodic_groups(costs, kinds) is None


def test_a_grouped_row_sums_what_adds_up_and_keeps_the_largest_buffer():
    costs, _ = _costs([1, 3] * 4)
    small, large = costs.layers[1], costs.layers[2]
    row = group_rows([small, large])
    assert row.saved_b == small.saved_b + large.saved_b
    assert row.compute_s == small.compute_s + large.compute_s
    assert row.input_b == small.input_b + large.input_b  # each layer keeps its input when recomputed
    assert row.bt_b == max(small.bt_b, large.bt_b)
    assert row.boundary_b == large.boundary_b


@st.composite
def periodic_instances(draw):
    period = draw(st.integers(2, 3))
    pattern = draw(st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=period, max_size=period))
    assume(len(set(pattern)) > 1)
    head = draw(st.lists(st.sampled_from([1.5, 4.0]), max_size=2))
    scales = head + pattern * draw(st.integers(2, 4)) + pattern[: draw(st.integers(0, period - 1))]
    pp = draw(st.integers(1, 4))
    costs, kinds = _costs(scales, pp=pp, m=draw(st.integers(1, 6)), capacity=draw(st.floats(0.1, 1.5)))
    return costs, kinds, draw(st.sampled_from(["auto", "none", "all", "selective"]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(periodic_instances())
def test_what_fits_the_grouped_table_fits_the_real_rows_and_is_priced_no_lower(instance):
    """The grouped table asks at least what the real rows need: its strategy, priced on both,
    is feasible on the real rows, with no more memory and no longer a step than grouped."""
    costs, kinds, mode = instance
    grouped = periodic_groups(costs, kinds)
    assume(grouped is not None and head_rows(costs, kinds) is None)  # a short head is counted as it is
    found = solve_counts(grouped.costs, mode, None, grouped.head)
    assume(found is not None)
    on_groups = evaluate(grouped.costs, found.stages, sorted(found.recomputed), sorted(found.selective))
    real = evaluate(costs, *grouped.expand(found))
    assert on_groups.feasible and real.feasible
    assert memory_bound(real) <= memory_bound(on_groups) * (1 + 1e-9)
    assert real.step_time_s <= on_groups.step_time_s * (1 + 1e-9)
    counted = solve_candidate(costs, kinds, mode)
    assert counted.status == "Periodic" and counted.evaluation.step_time_s == real.step_time_s


@pytest.mark.parametrize("pp, capacity", [(2, 0.6), (3, 0.4), (4, 1.0)])
def test_the_periodic_cut_is_near_the_general_ilps_optimum(pp, capacity):
    """Dense and expert blocks in turn (a Llama-4 pattern): counted between whole periods, the
    step is never better than the general ILP's and within 5% of it."""
    costs, kinds = _costs([1, 3] * 8, pp=pp, m=8, capacity=capacity)
    counted = solve_candidate(costs, kinds, "auto")
    ilp = solve_candidate(costs, kinds, "auto", formulation="general")
    assert counted.status == "Periodic" and counted.evaluation.feasible
    assert ilp.evaluation.step_time_s * (1 - 1e-6) <= counted.evaluation.step_time_s
    assert counted.evaluation.step_time_s <= ilp.evaluation.step_time_s * 1.05
    # stages are cut between whole periods: every stage after the first starts at an odd row
    assert all(first % 2 == 1 for first, _ in counted.evaluation.strategy.stages[1:])


def test_the_least_memory_of_a_periodic_table_is_found_by_counting():
    costs, kinds = _costs([1, 3] * 6, pp=3, m=6, capacity=0.2)
    counted = solve_candidate(costs, kinds, "auto", objective="memory")
    ilp = solve_candidate(costs, kinds, "auto", objective="memory", formulation="general")
    assert counted.evaluation is not None and not counted.uniform
    assert memory_bound(ilp.evaluation) * (1 - 1e-6) <= memory_bound(counted.evaluation)
    assert memory_bound(counted.evaluation) <= memory_bound(ilp.evaluation) * 1.25


def test_the_search_says_how_many_candidates_were_cut_between_periods():
    result = SearchResult(ranked=[], periodic=3)
    assert "3 candidates' blocks, repeating in a period of unlike blocks, were cut between whole periods" in (
        result.status
    )
