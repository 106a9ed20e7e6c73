"""planner.search.block_counts: counting finds the ILP's optimum on uniform tables (and its
dynamic program and capped walk the brute-force optimum of their own problem)."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cost_models.hardware import load_hardware
from cost_models.strategy import Candidate, NumericTable, candidate_costs, memory_bound
from planner.search.block_counts import _least_sum, _partition, solve_counts
from planner.search.candidates import MAX_HEAD_ROWS, head_rows, is_repeated
from planner.search.ilp import solve_candidate
from planner.search.ilp_form import highs_available
from planner.search.schedule_refit import schedule_costs
from runtime.contract.choices import ScheduleName
from tests.helpers import gpt_table

HW = load_hardware("a100-80gb", 8)
# a slow network makes stage transfers and the per-step tail matter in small instances
SLOW = dataclasses.replace(HW, inter_node_bandwidth=2e8, intra_node_bandwidth=2e9, memory_bytes=2**30)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def uniform_instances(draw):
    """A uniform table (maybe with a distinct last block and attention cores), a candidate, a
    recompute mode, a capacity between "nothing fits" and roomy, and maybe a schedule's in-flight
    counts, offloaded state with a tight host, a cutoff."""
    layers = draw(st.integers(1, 24))
    table = gpt_table(
        layers=layers,
        hidden=draw(st.sampled_from([64, 256])),
        heads=4,
        vocab=draw(st.sampled_from([256, 8192])),
        tail_boundary=draw(st.sampled_from([None, 0.5, 3.0])),
        attention_core=draw(st.booleans()),
    )
    pp = draw(st.integers(1, min(6, layers + 2)))
    dp = draw(st.sampled_from([1, 2]))
    m = draw(st.integers(1, pp + 4))
    offload = draw(st.sampled_from(["none", "none", "cpu"])) if dp > 1 else "none"
    zero = draw(st.integers(1 if offload != "none" else 0, 3)) if dp > 1 else 0
    cand = Candidate(
        dp, draw(st.sampled_from([1, 2])), pp, zero, draw(st.sampled_from([1, 4])), m, offload_optimizer=offload
    )
    hw = dataclasses.replace(SLOW, gpus_per_node=draw(st.sampled_from([1, 8])))
    costs = candidate_costs(
        NumericTable(table), hw, "bf16", draw(st.sampled_from([64, 512])), cand, hw.gpus_per_node, 1.0
    )
    kinds = [row.kind for row in table.layers]
    schedule = draw(st.sampled_from(["1f1b", "1f1b", ScheduleName.INTERLEAVED, ScheduleName.ZERO_BUBBLE]))
    if schedule != "1f1b" and pp > 1 and m >= pp and (schedule != ScheduleName.INTERLEAVED or m % pp == 0):
        costs = schedule_costs(costs, schedule, 2 if schedule == ScheduleName.INTERLEAVED else 1, 1.0)
    every = sum(n * (row.state_b + row.saved_b * max(costs.inflight)) for row, n in costs.distinct)
    costs.capacity = every * draw(st.floats(0.02, 1.2)) + 1.0
    if offload != "none" and draw(st.booleans()):
        costs.host_room = sum(n * row.host_b for row, n in costs.distinct) * draw(st.floats(0.2, 1.5))
    return costs, kinds, draw(st.sampled_from(["auto", "auto", "none", "all", "selective"])), draw(st.booleans())


@SETTINGS
@given(uniform_instances())
def test_counting_finds_the_ilps_optimum(instance):
    costs, kinds, mode, with_cutoff = instance
    assume(is_repeated(costs, kinds))  # data-parallel overlap can price blocks apart (bucket edges)
    ilp = solve_candidate(costs, kinds, mode, formulation="uniform")
    cutoff = None
    if with_cutoff and ilp.evaluation is not None:  # under or over the optimum, clear of CBC's tolerances
        cutoff = ilp.evaluation.step_time_s * (0.99 if costs.cand.pp % 2 else 1.01)
        ilp = solve_candidate(costs, kinds, mode, formulation="uniform", cutoff=cutoff)
    counted = solve_candidate(costs, kinds, mode, formulation="counts", cutoff=cutoff)
    assert counted.uniform and counted.status in ("Optimal", "Infeasible")
    if ilp.evaluation is None:
        assert counted.evaluation is None, (
            f"counting found {counted.evaluation.step_time_s} where the ILP found nothing"
        )
        return
    assert counted.evaluation is not None, f"counting found nothing, the ILP {ilp.evaluation.step_time_s}"
    assert counted.evaluation.feasible
    if counted.evaluation.step_time_s < ilp.evaluation.step_time_s * (1 - 1e-6) and highs_available():
        # CBC can stop short of the optimum at its tolerances (a review found such cases near
        # the memory edge); the other solver settles it
        ilp = solve_candidate(costs, kinds, mode, solver="highs", formulation="uniform", cutoff=cutoff)
        assert ilp.evaluation is not None
    assert counted.evaluation.step_time_s == pytest.approx(ilp.evaluation.step_time_s, rel=1e-6)
    assert memory_bound(counted.evaluation) <= costs.capacity


@pytest.mark.parametrize("pp, m, capacity", [(8, 16, 0.30), (16, 32, 0.45), (4, 8, 0.9)])
def test_a_96_block_model_counts_as_the_ilp_solves(pp, m, capacity):
    """Deep tables, where the tables first stop at twice the even share (``solve_counts``)."""
    table = gpt_table(layers=96, hidden=1024, heads=16, vocab=51200, attention_core=True)
    cand = Candidate(1, 2, pp, 0, 1, m)  # no data parallelism: its overlap can price blocks apart
    costs = candidate_costs(NumericTable(table), SLOW, "bf16", 1024, cand, 8, 1.0)
    every = sum(n * (row.state_b + row.saved_b * max(costs.inflight)) for row, n in costs.distinct)
    costs.capacity = every / pp * capacity * 4
    kinds = [row.kind for row in table.layers]
    for mode in ("auto", "selective", "all"):
        ilp = solve_candidate(costs, kinds, mode, formulation="uniform")
        counted = solve_candidate(costs, kinds, mode, formulation="counts")
        assert (ilp.evaluation is None) == (counted.evaluation is None), mode
        if ilp.evaluation is not None:
            assert counted.evaluation.step_time_s == pytest.approx(ilp.evaluation.step_time_s, rel=1e-6), mode


@st.composite
def head_instances(draw):
    """A table whose first blocks differ from the repeated ones (DeepSeek-V3's dense blocks
    before its mixtures of experts), maybe with a distinct last block and attention cores; a
    candidate, a recompute mode and a capacity between "nothing fits" and roomy."""
    head = draw(st.integers(1, 3))
    repeated = draw(st.integers(1, 6))
    scales = draw(st.lists(st.sampled_from([0.5, 2.0, 3.0]), min_size=head, max_size=head))
    table = gpt_table(
        layers=head + repeated,
        hidden=draw(st.sampled_from([64, 256])),
        heads=4,
        vocab=draw(st.sampled_from([256, 8192])),
        block_scale=scales + [1.0] * repeated,
        tail_boundary=draw(st.sampled_from([None, 0.5])),
        attention_core=draw(st.booleans()),
    )
    pp = draw(st.integers(1, min(5, head + repeated + 2)))
    m = draw(st.integers(1, pp + 3))
    cand = Candidate(1, draw(st.sampled_from([1, 2])), pp, 0, draw(st.sampled_from([1, 4])), m)
    costs = candidate_costs(NumericTable(table), SLOW, "bf16", draw(st.sampled_from([64, 512])), cand, 8, 1.0)
    every = sum(n * (row.state_b + row.saved_b * max(costs.inflight)) for row, n in costs.distinct)
    costs.capacity = every * draw(st.floats(0.05, 1.2)) + 1.0
    return (
        costs,
        [row.kind for row in table.layers],
        draw(st.sampled_from(["auto", "auto", "none", "all", "selective"])),
    )


@SETTINGS
@given(head_instances())
def test_counting_finds_the_general_ilps_optimum_after_distinct_first_blocks(instance):
    """The head's cuts over the first stages are the general ILP's choices there: the same optimum."""
    costs, kinds, mode = instance
    head = head_rows(costs, kinds)
    assume(head is not None and head > 0)
    ilp = solve_candidate(costs, kinds, mode, formulation="general")
    counted = solve_candidate(costs, kinds, mode, formulation="counts")
    assert counted.status in ("Optimal", "Infeasible")
    if ilp.evaluation is None:
        assert counted.evaluation is None, (
            f"counting found {counted.evaluation.step_time_s} where the ILP found nothing"
        )
        return
    assert counted.evaluation is not None, f"counting found nothing, the ILP {ilp.evaluation.step_time_s}"
    if counted.evaluation.step_time_s < ilp.evaluation.step_time_s * (1 - 1e-6) and highs_available():
        ilp = solve_candidate(costs, kinds, mode, solver="highs", formulation="general")  # CBC's tolerances
        assert ilp.evaluation is not None
    assert counted.evaluation.step_time_s == pytest.approx(ilp.evaluation.step_time_s, rel=1e-6)
    assert memory_bound(counted.evaluation) <= costs.capacity


def test_which_tables_count_after_a_head():
    def kinds_and_costs(scales):
        table = gpt_table(layers=len(scales), block_scale=scales)
        costs = candidate_costs(NumericTable(table), SLOW, "bf16", 64, Candidate(1, 1, 2, 0, 1, 2), 8, 2**30)
        return costs, [row.kind for row in table.layers]

    assert head_rows(*kinds_and_costs([1, 1, 1, 1])) == 0
    assert head_rows(*kinds_and_costs([1, 1, 1, 2])) == 0  # a distinct last block is the uniform form's X
    assert head_rows(*kinds_and_costs([2, 3, 1, 1, 1])) == 2
    assert head_rows(*kinds_and_costs([2, 2, 2, 2, 1, 1])) == MAX_HEAD_ROWS
    assert head_rows(*kinds_and_costs([2, 2, 2, 2, 2, 1, 1])) is None  # more cuts than the walk takes
    assert head_rows(*kinds_and_costs([1, 1, 2, 1, 1, 2, 1, 1])) is None  # a distinct block deeper in


def test_the_formulations_say_what_they_need():
    table = gpt_table(layers=8, block_scale=[1, 1, 1, 1, 1, 2, 1, 1])
    costs = candidate_costs(NumericTable(table), SLOW, "bf16", 64, Candidate(1, 1, 2, 0, 1, 2), 8, 2**30)
    kinds = [row.kind for row in table.layers]
    with pytest.raises(ValueError, match="identical blocks"):
        solve_candidate(costs, kinds, "auto", formulation="counts")
    uniform = candidate_costs(
        NumericTable(gpt_table(layers=4)), SLOW, "bf16", 64, Candidate(1, 1, 2, 0, 1, 2), 8, 2**30
    )
    with pytest.raises(ValueError, match="checkpoint must be"):
        solve_candidate(uniform, kinds, "sometimes")
    assert solve_counts(uniform, "auto") is not None


# ---------------------------------------------------------------------------------- the parts
def _tables(draw, stages: int, width: int) -> list[np.ndarray]:
    rows = []
    for _ in range(stages):
        values = np.array(draw(st.lists(st.integers(0, 9), min_size=width, max_size=width)), dtype=float)
        holes = draw(st.lists(st.booleans(), min_size=width, max_size=width))
        rows.append(np.where(holes, math.inf, values))
    return rows


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_the_dynamic_program_and_the_capped_walk_equal_brute_force(data):
    """``_least_sum`` (least sum over allowed counts) and ``_partition`` (least ``w max F + sum H
    + max G``) against every count vector."""
    stages = data.draw(st.integers(1, 4))
    width = data.draw(st.integers(1, 5))
    total = data.draw(st.integers(0, stages * (width - 1)))
    weight = data.draw(st.sampled_from([0.0, 1.0, 3.0]))
    F, H, G = (np.vstack(_tables(data.draw, stages, width)) for _ in range(3))
    H = np.where(np.isfinite(F) & np.isfinite(G), H, math.inf)
    best_sum, best_value = math.inf, math.inf
    for counts in itertools.product(range(width), repeat=stages):
        if sum(counts) != total or not all(math.isfinite(H[k, n]) for k, n in enumerate(counts)):
            continue
        rows = list(enumerate(counts))
        best_sum = min(best_sum, sum(H[k, n] for k, n in rows))
        value = weight * max(F[k, n] for k, n in rows) + sum(H[k, n] for k, n in rows) + max(G[k, n] for k, n in rows)
        best_value = min(best_value, value)
    summed = _least_sum(H, np.isfinite(H), total)
    assert (summed is None) == math.isinf(best_sum)
    if summed is not None:
        assert summed[0] == best_sum and sum(summed[1]) == total
        assert sum(H[k, n] for k, n in enumerate(summed[1])) == best_sum
    found = _partition(F, H, G, total, weight, math.inf)
    assert (found is None) == math.isinf(best_value)
    if found is not None:
        assert found[0] == pytest.approx(best_value) and sum(found[1]) == total
        counts = list(enumerate(found[1]))
        value = (
            weight * max(F[k, n] for k, n in counts) + sum(H[k, n] for k, n in counts) + max(G[k, n] for k, n in counts)
        )
        assert value == pytest.approx(best_value)


def _head_costs(pp=3, m=6, capacity=0.5):
    table = gpt_table(
        layers=8, hidden=256, heads=4, vocab=8192, block_scale=[2.0, 0.5] + [1.0] * 6, attention_core=True
    )
    costs = candidate_costs(NumericTable(table), SLOW, "bf16", 512, Candidate(1, 1, pp, 0, 1, m), 8, 1.0)
    every = sum(n * (row.state_b + row.saved_b * max(costs.inflight)) for row, n in costs.distinct)
    costs.capacity = every / pp * capacity * 2
    return costs, [row.kind for row in table.layers]


def test_blocks_alike_but_for_their_hidden_traffic_are_partitioned_on_their_envelope():
    """Rows that differ only in what their data-parallel traffic exposes (their place in the
    model) are counted on the envelope and priced on the real rows: feasible, never better than
    the general ILP's optimum, and within the exposures' spread of it."""
    costs, kinds = _head_costs()
    layers = list(costs.layers)
    for i in range(4, 8):  # the later blocks expose a little more of their (made-up) traffic
        layers[i] = layers[i].but(zero_mb_s=layers[i].zero_mb_s + 0.01 * layers[i].work_s * (i - 3))
    costs.layers = layers
    costs.distinct = [(row, layers.count(row)) for row in dict.fromkeys(layers)]
    assert head_rows(costs, kinds) is None
    counted = solve_candidate(costs, kinds, "auto")
    assert counted.status == "Enveloped" and counted.evaluation.feasible
    ilp = solve_candidate(costs, kinds, "auto", formulation="general")
    assert ilp.evaluation.step_time_s * (1 - 1e-6) <= counted.evaluation.step_time_s
    assert counted.evaluation.step_time_s <= ilp.evaluation.step_time_s * 1.05


@pytest.mark.parametrize("pp", [2, 3])
def test_the_least_memory_of_a_head_table_is_the_general_ilps(pp):
    costs, kinds = _head_costs(pp=pp, capacity=0.3)
    counted = solve_candidate(costs, kinds, "auto", objective="memory")
    ilp = solve_candidate(costs, kinds, "auto", objective="memory", formulation="general")
    assert memory_bound(counted.evaluation) == pytest.approx(memory_bound(ilp.evaluation), rel=2e-3)
    # a caller that knows a strategy needing less learns in one probe that this one cannot beat it
    below = memory_bound(counted.evaluation) * 0.9
    assert solve_candidate(costs, kinds, "auto", objective="memory", cutoff=below).evaluation is None
