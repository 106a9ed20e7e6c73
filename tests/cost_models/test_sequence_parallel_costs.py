"""Sequence parallelism in the cost model: what it shards, what it sends, and how the search
offers it (``cost_models.strategy``, "sequence parallelism"; ``planner.search.candidates``)."""

from __future__ import annotations

import dataclasses

import pytest

from cost_models.hardware import load_hardware
from cost_models.strategy import Candidate, NumericTable, candidate_costs, evaluate
from planner.frontend.model_analysis import build_layer_table
from planner.search.candidates import enumerate_candidates, sequence_parallel_options
from planner.search.request import PlanRequest
from planner.search.search_errors import SearchError
from planner.search.solve import solve

HW = load_hardware("a100-80gb", 8)
SEQ = 128


@pytest.fixture(scope="module")
def nt():
    return NumericTable(build_layer_table("gpt", layers=2, hidden=128, heads=4, vocab=1024, seq_len=SEQ))


def _costs(nt, sp: bool, tp: int = 2):
    cand = Candidate(1, tp, 1, 0, 2, 4, sequence_parallel=sp)
    return candidate_costs(nt, HW, "bf16", SEQ, cand, 8, HW.memory_bytes)


def test_sp_divides_the_activations_between_the_regions_and_moves_the_same_bytes(nt):
    off, on = _costs(nt, False), _costs(nt, True)
    rows = nt.rows(2, SEQ)
    for row, a, b in zip(rows, off.layers, on.layers):
        assert b.saved_b == pytest.approx(a.saved_b - row["saved_bytes_sp"] / 2)
        assert b.boundary_b == pytest.approx(a.boundary_b - row["boundary_bytes_sp"] / 2)
        # a ring all-reduce is a reduce-scatter plus an all-gather of the same tensor: SP sends
        # what the all-reduces did, plus the norms' gradient all-reduces, a position gradient and
        # the backward's re-gather of each column-parallel input (only its positions are saved)
        extra = 2 * 0.5 * row["sp_grad_all_reduce_bytes"] + 0.5 * row["sp_split_bytes"]
        extra += 0.5 * row["sp_all_gather_bytes"]
        assert b.tp_sent_b + b.tp_bwd_sent_b == pytest.approx(a.tp_sent_b + a.tp_bwd_sent_b + extra)
        # backward holds one gathered column-parallel input whole beside its other transients
        regathered = row["sp_all_gather_bytes"] / row["sp_all_gather_calls"] if row["sp_all_gather_calls"] else 0
        assert b.bt_b == pytest.approx(a.bt_b + regathered)
    blocks = [i for i, k in enumerate(nt.kinds) if k == "block"]
    assert all(rows[i]["saved_bytes_sp"] > 0 and on.layers[i].saved_b < off.layers[i].saved_b for i in blocks)
    # twice the collectives, each with its wait: never faster than plain tp on the same bytes
    assert sum(l.tp_s for l in on.layers) > sum(l.tp_s for l in off.layers)
    ev_on, ev_off = evaluate(on, [(0, len(rows) - 1)]), evaluate(off, [(0, len(rows) - 1)])
    assert ev_on.memory["activations"] < ev_off.memory["activations"]


def test_search_offers_sp_only_where_it_applies(nt):
    req = PlanRequest(spec="gpt", gpus=4, gpus_per_node=4, hardware="a100-80gb", global_batch=8, seq_len=SEQ)
    cands = enumerate_candidates(req, nt, 4)
    assert {c.sequence_parallel for c in cands if c.tp > 1} == {False, True}
    assert not any(c.sequence_parallel for c in cands if c.tp == 1)
    assert sequence_parallel_options(dataclasses.replace(req, seq_len=SEQ + 1), nt, 2) == [
        False
    ]  # 2 does not divide it
    assert sequence_parallel_options(dataclasses.replace(req, sequence_parallel="off"), nt, 2) == [False]
    assert sequence_parallel_options(dataclasses.replace(req, sequence_parallel="on"), nt, 2) == [True]
    plan = solve(dataclasses.replace(req, tp=2, sequence_parallel="on"), nt.table, HW).plan
    assert plan.sequence_parallel and plan.tp == 2
    with pytest.raises(SearchError, match="--sequence-parallel on: tp=2 does not divide --seq-len 127"):
        enumerate_candidates(dataclasses.replace(req, seq_len=127, tp=2, sequence_parallel="on"), nt, 4)
    with pytest.raises(SearchError, match="needs tensor parallelism"):
        PlanRequest(
            spec="gpt",
            gpus=4,
            gpus_per_node=4,
            hardware="a100-80gb",
            global_batch=8,
            seq_len=SEQ,
            tp=1,
            sequence_parallel="on",
        )
