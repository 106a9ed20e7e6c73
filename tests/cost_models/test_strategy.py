"""cost_models.strategy: the cost of one strategy, checked formula by formula, and its bounds.

The layer tables are closed-form GPTs (``tests.helpers.gpt_table``), so these tests exercise the
cost model and the search, not the tracer.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cost_models.comm_cost import axis_placement, collective_time, zero_dp_collectives
from cost_models.compute import compute_time, optimizer_step_time
from cost_models.hardware import load_hardware
from cost_models.memory import model_state_bytes, shard_elements
from cost_models.strategy import (
    Candidate,
    NumericTable,
    candidate_costs,
    draft_costs,
    evaluate,
    free_work_floor,
    memory_bound,
    state_floor,
    work_floor,
)
from passes.compiled_table import CompiledTable
from planner.errors import UserError
from planner.search.candidates import (
    check_pins,
    enumerate_candidates,
    heuristic_strategy,
    memory_lower_bound,
    time_lower_bound,
    uniform_time_bound,
    work_lower_bound,
)
from planner.search.request import PlanRequest
from planner.search.schedule_search import schedule_free_bound
from runtime.contract.collective_bytes import ring_bytes
from runtime.contract.overlap import OVERLAP_NONE
from tests.cost_models.moe_tables import moe_table
from tests.helpers import gpt_table

HW = load_hardware("a100-80gb", 8)


def _cc(table, cand, seq=128, dtype="bf16", cap=None, hw=HW):
    return candidate_costs(
        NumericTable(table), hw, dtype, seq, cand, hw.gpus_per_node, cap if cap is not None else hw.memory_bytes * 0.9
    )


@pytest.mark.parametrize("ops_async", [False, True])
def test_operator_overhead_adds_on_cpus_and_overlaps_on_gpus(ops_async):
    """A CPU rank issues and runs each operator itself (the costs add); a GPU runs operators
    while the host issues the next, so a layer costs the slower of the two."""
    t = gpt_table(layers=2, hidden=512, heads=8)
    for lay in t.layers:
        lay.num_ops = 30
    cand = Candidate(dp=1, tp=1, pp=1, zero_stage=0, micro_batch_size=2, num_micro_batches=1)
    bare = _cc(t, cand, hw=dataclasses.replace(HW, op_overhead_s=0.0)).layers[1]
    for overhead in (1e-7, 1e-2):  # far below, far above the device time
        hw = dataclasses.replace(HW, op_overhead_s=overhead, ops_async=ops_async)
        blk = _cc(t, cand, hw=hw).layers[1]
        host = 30 * overhead
        if ops_async:
            assert blk.fwd_s == pytest.approx(max(bare.fwd_s, host))
            assert blk.compute_s == pytest.approx(max(bare.fwd_s, host) + max(bare.compute_s - bare.fwd_s, 2 * host))
        else:
            assert blk.fwd_s == pytest.approx(bare.fwd_s + host)
            assert blk.compute_s == pytest.approx(bare.compute_s + 3 * host)


def test_layer_costs_follow_the_cost_models():
    t = gpt_table(layers=2, hidden=512, heads=8)
    # the synchronous sums (the overlapped ones: tests/cost_models/test_overlap_cost.py)
    cand = Candidate(dp=2, tp=2, pp=2, zero_stage=1, micro_batch_size=2, num_micro_batches=4, overlap=OVERLAP_NONE)
    cc = _cc(t, cand, seq=256)
    blk = cc.layers[1]
    b, s, h = 2, 256, 512
    mm = 24 * b * s * h * h + 4 * b * s * s * h
    fwd = 20 * b * s * h + mm / 2
    assert blk.fwd_s == pytest.approx(compute_time(fwd, 0, HW, "bf16"))
    # backward: twice the forward, plus accumulating the weight gradients (read 2, write 1, bf16)
    accumulate = compute_time(0, 3 * blk.num_params * 2, HW, "bf16")
    assert blk.compute_s == pytest.approx(3 * blk.fwd_s + accumulate)
    tp_pl = axis_placement("tp", 2, 2, 2, 8)

    # each all-reduce also copies its bytes once (read + write at the memory bandwidth)
    def ar(nbytes):
        return collective_time("all_reduce", nbytes, tp_pl, HW) + 2 * nbytes / HW.memory_bandwidth

    assert blk.tp_s == pytest.approx(2 * ar(2 * 2 * b * s * h))
    # recompute skips the block's last, boundary-sized all-reduce (torch's checkpoint stops early)
    assert blk.rec_s == pytest.approx(HW.recompute_ratio * blk.fwd_s + ar(2 * b * s * h))
    P = math.ceil((12 * h * h + 7 * h) / 2) + 6 * h
    assert blk.num_params == P
    st_ = model_state_bytes(P, "bf16", 1, 2)
    assert (blk.params_b, blk.grads_b, blk.optimizer_b) == (st_["params"], st_["grads"], st_["optimizer"])
    dp_pl = axis_placement("dp", 2, 2, 2, 8)
    want = sum(collective_time(k, n, dp_pl, HW) for k, n in zero_dp_collectives(P, "bf16", 1, 2))
    assert blk.dp_step_s == pytest.approx(want) and blk.zero_mb_s == 0
    assert blk.opt_s == pytest.approx(optimizer_step_time(shard_elements(P, 2), HW, "bf16"))
    assert blk.saved_b == pytest.approx(10 * b * s * h + (24 * b * s * h + 5 * 8 * b * s * s) / 2)


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_2_and_3_pay_per_micro_batch(zero):
    t = gpt_table(layers=2)
    cc = _cc(t, Candidate(4, 1, 1, zero, 1, 8, overlap=OVERLAP_NONE))
    blk = cc.layers[1]
    P = blk.num_params
    colls = zero_dp_collectives(P, "bf16", zero, 4)
    pl = axis_placement("dp", 4, 1, 1, 8)
    if zero == 2:
        assert blk.zero_mb_s == pytest.approx(collective_time("reduce_scatter", colls[0][1], pl, HW))
        assert blk.dp_step_s == pytest.approx(collective_time("all_gather", colls[1][1], pl, HW))
    else:
        assert blk.zero_mb_s == pytest.approx(sum(collective_time(k, n, pl, HW) for k, n in colls))
        assert blk.dp_step_s == 0
    ev = evaluate(cc, [(0, 3)], [])
    sent = sum(ring_bytes(k, n, 4) for k, n in zero_dp_collectives(P, "bf16", zero, 4))
    assert ev.comm_bytes_per_device >= 8 * (sent if zero == 3 else ring_bytes("reduce_scatter", colls[0][1], 4))


def test_evaluate_step_time_and_memory_by_hand():
    t = gpt_table(layers=4)
    cand = Candidate(dp=1, tp=1, pp=2, zero_stage=0, micro_batch_size=1, num_micro_batches=4)
    cc = _cc(t, cand)
    L = cc.layers
    stages, ck = [(0, 2), (3, 5)], [1]
    ev = evaluate(cc, stages, ck)
    send0 = cc.send_s(2, 0)
    w0 = sum(l.work_s for l in L[0:3]) + L[1].rec_s + send0
    w1 = sum(l.work_s for l in L[3:6]) + send0
    T = max(w0, w1)
    D = max(sum(l.opt_s for l in L[0:3]), sum(l.opt_s for l in L[3:6]))
    # the first micro-batch crosses both stages, the other three follow at the slower one's pace
    assert ev.step_time_s == pytest.approx(3 * T + w0 + w1 + D)
    assert sum(ev.time.values()) == pytest.approx(ev.step_time_s)
    # stage 0 holds min(2, 4) = 2 micro-batches; layer 1 keeps its input and re-materializes once
    acts0 = 2 * (L[0].saved_b + L[1].input_b + L[2].saved_b) + L[1].saved_b
    state0 = sum(l.state_b for l in L[0:3])
    # the last stage also holds the loss backward's 2 x logits (fp32) for a moment (nothing
    # recomputes there); the largest transient of the stage's layers
    assert cc.loss_transient_b == L[5].bt_b == 2 * 4 * 1 * 128 * 8192 > L[3].bt_b
    acts1 = 1 * sum(l.saved_b for l in L[3:6]) + cc.loss_transient_b
    state1 = sum(l.state_b for l in L[3:6])
    assert ev.stages[0].memory["total"] == pytest.approx(state0 + math.ceil(acts0), abs=1)
    assert ev.memory["total"] == max(ev.stages[0].memory["total"], ev.stages[1].memory["total"])
    assert (
        ev.stages[1].memory["activations"] == math.ceil(acts1)
        and ev.stages[1].memory["params"] + ev.stages[1].memory["grads"] + ev.stages[1].memory["optimizer"] == state1
    )
    assert ev.bubble_fraction == pytest.approx(min(w0, w1) / (4 * T + min(w0, w1)))


@pytest.mark.parametrize(("dp", "sequence_parallel", "split"), [(1, False, False), (2, False, True), (2, True, False)])
def test_a_stage_sends_slices_between_nodes(dp, sequence_parallel, split):
    """tp 4, pp 2 on 8-GPU nodes: with dp 1 both stages share a node and send whole; with dp 2
    each stage fills a node, and without sequence parallelism each tp rank sends a quarter of the
    (replicated) activation over the network and the receivers all-gather it over NVLink (the
    runtime's split messages); under sequence parallelism the activation is already split."""
    t = gpt_table(layers=4)
    cand = Candidate(dp, 4, 2, 0, 1, 4, sequence_parallel=sequence_parallel)
    cc = _cc(t, cand, seq=8192)  # 4 MiB a micro-batch: the bandwidth, not the latency, matters
    nbytes = cc.layers[2].boundary_b
    placement = cc.placements[0]
    assert placement.intra_node == (dp == 1)
    if split:
        tp_group = axis_placement("tp", dp, 4, 2, 8)
        expected = collective_time("send", nbytes / 4, placement, HW) + collective_time(
            "all_gather", nbytes, tp_group, HW
        )
        assert expected < collective_time("send", nbytes, placement, HW) / 2
    else:
        expected = collective_time("send", nbytes, placement, HW)
    assert cc.send_s(2, 0) == pytest.approx(expected + HW.sync_overhead_s)


def test_one_stage_peak_follows_the_backward_order():
    """One stage: layer j's backward meets only what layers 0..j saved (the later layers' were
    released by their own backward), so a transient early in the stage (context parallelism's
    score tiles) is not added to every activation; a pipeline stage keeps that conservative sum."""
    t = gpt_table(layers=4)
    for pp, stages in ((1, [(0, 5)]), (2, [(0, 2), (3, 5)])):
        cc = _cc(t, Candidate(dp=1, tp=1, pp=pp, zero_stage=0, micro_batch_size=1, num_micro_batches=1))
        big = 4 * max(layer.bt_b for layer in cc.layers)
        cc.layers[1] = cc.layers[1].but(bt_b=big)
        ev = evaluate(cc, stages, [])
        first = cc.layers[stages[0][0] : stages[0][1] + 1]
        every = sum(layer.saved_b for layer in first)
        if pp == 1:
            expect = max(sum(layer.saved_b for layer in first[: j + 1]) + layer.bt_b for j, layer in enumerate(first))
            assert expect == pytest.approx(first[0].saved_b + first[1].saved_b + big)
            assert expect < every + big
        else:
            expect = every + big
        assert ev.stages[0].memory["activations"] == math.ceil(expect)
        assert memory_bound(ev) >= ev.memory["total"]


def test_evaluate_rejects_malformed_strategies():
    cc = _cc(gpt_table(layers=2), Candidate(1, 1, 2, 0, 1, 2))
    for bad in ([(0, 1), (3, 3)], [(0, 1)], [(0, 3), (3, 3)], [(1, 2), (3, 3)]):
        with pytest.raises(ValueError):
            evaluate(cc, bad)
    with pytest.raises(ValueError):
        evaluate(cc, [(0, 1), (2, 3)], [7])


def test_numeric_table_caches_identical_blocks():
    nt = NumericTable(gpt_table(layers=48))
    rows = nt.rows(2, 64)
    assert len(rows) == 50 and rows[1] == rows[48]
    reps, index = nt.groups(2, 64)
    assert len(reps) == 3 and index == [0] + [1] * 48 + [2]  # identical blocks are priced once
    assert nt.flops_per_sequence(64) == pytest.approx(sum(r["fwd_flops"] + r["bwd_flops"] for r in nt.rows(1, 64)))


def _groups_by_value(rows: list[dict]) -> tuple[list[dict], list[int]]:
    """Every row's numbers compared: the grouping ``NumericTable.groups`` must equal."""
    distinct: list[dict] = []
    index = []
    for row in rows:
        if row not in distinct:
            distinct.append(row)
        index.append(distinct.index(row))
    return distinct, index


@settings(max_examples=15, deadline=None)
@given(
    b=st.integers(1, 6),
    s=st.sampled_from([1, 8, 64, 96]),
    tail=st.sampled_from([None, 0.5]),
    compiled=st.booleans(),
)
def test_groups_evaluate_one_row_per_shape_and_match_comparing_every_row(b, s, tail, compiled):
    """``groups`` evaluates one layer of each shape only; its rows and index are those of
    comparing every layer's numbers, for the symbolic table and its compiled form alike."""
    symbolic = gpt_table(layers=5, hidden=64, heads=4, vocab=256, tail_boundary=tail)
    table = CompiledTable(CompiledTable.record(symbolic), lambda: symbolic) if compiled else symbolic
    assert len(set(table.shapes())) == (3 if tail is None else 4)  # pre, block (, last block), post
    reps, index = NumericTable(table).groups(b, s)
    want_reps, want_index = _groups_by_value(NumericTable(symbolic).rows(b, s))
    assert index == want_index and reps == want_reps


@settings(max_examples=40, deadline=None)
@given(
    pp=st.integers(1, 3),
    zero=st.integers(0, 3),
    tp=st.sampled_from([1, 2]),
    mbs=st.sampled_from([1, 2]),
    tail=st.sampled_from([None, 0.5, 2.0]),
    cap=st.floats(0.05, 1.0),
    data=st.data(),
)
def test_lower_bounds_are_sound(pp, zero, tp, mbs, tail, cap, data):
    """No partition or recompute set beats the time or memory lower bounds; no feasible one beats
    the memory-aware bound of repeated-block tables."""
    t = gpt_table(
        layers=3, hidden=128, heads=4, vocab=1024, tail_boundary=tail, attention_core=data.draw(st.booleans())
    )
    cc = _cc(t, Candidate(2, tp, pp, zero, mbs, 4), cap=cap * 2**28)
    n = 5
    cuts = data.draw(st.sampled_from(list(itertools.combinations(range(1, n), pp - 1))))
    bounds = [0, *cuts, n]
    stages = [(bounds[i], bounds[i + 1] - 1) for i in range(pp)]
    ck = data.draw(st.sets(st.integers(0, n - 1)))
    cores = [i for i in range(n) if cc.layers[i].sel_saved_b > 0 and i not in ck]
    sel = data.draw(st.sets(st.sampled_from(cores))) if cores else set()
    ev = evaluate(cc, stages, sorted(ck), sorted(sel))
    assert time_lower_bound(cc) <= ev.step_time_s * (1 + 1e-12)
    assert memory_lower_bound(cc) <= memory_bound(ev) + 1
    if ev.feasible:
        assert uniform_time_bound(cc, [l.kind for l in t.layers]) <= ev.step_time_s * (1 + 1e-9)
    h = heuristic_strategy(cc, [l.kind for l in t.layers])
    assert h is None or h.feasible


@settings(max_examples=60, deadline=None)
@given(
    dp=st.sampled_from([1, 2, 4]),
    tp=st.sampled_from([1, 2]),
    pp=st.integers(1, 3),
    zero=st.integers(0, 3),
    mbs=st.sampled_from([1, 2]),
    compiled=st.booleans(),
    overlap=st.booleans(),
    variant=st.sampled_from(["plain", "offload", "onebit"]),
    cpu_like=st.booleans(),
)
def test_work_floor_is_below_the_priced_lower_bound(dp, tp, pp, zero, mbs, compiled, overlap, variant, cpu_like):
    """The floor a search orders candidates by (priced from the rows' work alone) never exceeds
    the candidate's time lower bound once priced, whatever its ZeRO stage, offload, compression,
    compile mode and overlap; with one stage and no data parallelism it is the bound's work part
    exactly (nothing but work to add)."""
    zero = zero if dp > 1 else 0
    extra: dict = {}
    if variant == "offload" and zero >= 1:
        extra["offload_optimizer"] = "cpu"
    if variant == "onebit" and dp > 1 and zero <= 1:
        extra["dp_compression"] = "onebit-adam"
    if not overlap:
        extra["overlap"] = OVERLAP_NONE
    hw = dataclasses.replace(HW, op_overhead_s=1e-5, ops_async=False) if cpu_like else HW
    cand = Candidate(dp, tp, pp, zero, mbs, 4, compile=compiled, **extra)
    table = NumericTable(gpt_table(layers=3, hidden=128, heads=4, vocab=1024))
    costs = candidate_costs(table, hw, "bf16", 128, cand, hw.gpus_per_node, hw.memory_bytes)
    floor = work_floor(table, hw, "bf16", 128, cand, hw.gpus_per_node)
    assert 0 < floor <= work_lower_bound(costs) * (1 + 1e-12) <= time_lower_bound(costs) * (1 + 1e-12)
    if dp == 1 and pp == 1:
        assert floor == pytest.approx(work_lower_bound(costs), rel=1e-12)
    assert work_floor(table, hw, "bf16", 128, cand, hw.gpus_per_node) == floor  # memoized: the same figure


@settings(max_examples=40, deadline=None)
@given(
    dp=st.sampled_from([1, 2, 4, 8]),
    tp=st.sampled_from([1, 2]),
    pp=st.integers(1, 3),
    zero=st.integers(0, 3),
    mbs=st.sampled_from([1, 2]),
    variant=st.sampled_from(["plain", "offload", "offload-params", "onebit", "moe"]),
)
def test_unpriced_floors_are_below_the_priced_bounds(dp, tp, pp, zero, mbs, variant):
    """What a search reads of a candidate before pricing it never claims more than the priced
    candidate: its model state floor is at most ``memory_lower_bound`` (so a candidate it rules
    out could not fit), its schedule-free work floor at most ``schedule_free_bound``; whatever
    the ZeRO stage, offload, 1-bit Adam or expert parallelism; and the draft costs' bounds (the
    schedule walk's second step) lie between the two, with memory tight enough to force recompute
    too."""
    zero = zero if dp > 1 else 0
    extra: dict = {}
    if variant.startswith("offload") and zero >= 1:
        extra["offload_optimizer"] = "cpu"
        if variant == "offload-params" and zero == 3:
            extra["offload_params"] = "cpu"
    if variant == "onebit" and dp > 1 and zero <= 1:
        extra["dp_compression"] = "onebit-adam"
    if variant == "moe":
        table = NumericTable(moe_table(layers=3, hidden=128, ffn=256, experts=4, top_k=2))
        extra["expert_parallel"] = 2 if dp % 2 == 0 else 1
    else:
        table = NumericTable(gpt_table(layers=3, hidden=128, heads=4, vocab=1024))
    cand = Candidate(dp, tp, pp, zero, mbs, 4, **extra)
    costs = candidate_costs(table, HW, "bf16", 128, cand, HW.gpus_per_node, HW.memory_bytes)
    assert 0 <= state_floor(table, HW, "bf16", 128, cand, HW.gpus_per_node) <= memory_lower_bound(costs)
    free = free_work_floor(table, HW, "bf16", 128, cand, HW.gpus_per_node)
    assert 0 < free <= schedule_free_bound(costs) * (1 + 1e-12)
    assert free <= work_floor(table, HW, "bf16", 128, cand, HW.gpus_per_node) * (1 + 1e-12)
    # the draft (no data-parallel traffic, nothing overlapped) bounds the priced candidate from below
    draft = draft_costs(table, HW, "bf16", 128, cand, HW.gpus_per_node, HW.memory_bytes)
    kinds = [layer.kind for layer in table.layers]
    assert memory_lower_bound(draft) <= memory_lower_bound(costs)
    assert free <= schedule_free_bound(draft, kinds) * (1 + 1e-12)
    assert schedule_free_bound(draft, kinds) <= _best_by_enumeration(costs) * (1 + 1e-12)
    # memory tight enough to force recompute: the draft's bound (inf when nothing fits) is at
    # most every feasible 1F1B strategy of the priced candidate, enumerated
    tight = dataclasses.replace(HW, memory_bytes=int(memory_lower_bound(costs) * 1.3))
    draft = draft_costs(table, tight, "bf16", 128, cand, HW.gpus_per_node, tight.memory_bytes)
    priced = candidate_costs(table, tight, "bf16", 128, cand, HW.gpus_per_node, tight.memory_bytes)
    assert schedule_free_bound(draft, kinds) <= _best_by_enumeration(priced) * (1 + 1e-12)


@settings(max_examples=30, deadline=None)
@given(
    dp=st.sampled_from([1, 2, 4]),
    tp=st.sampled_from([1, 2]),
    pp=st.integers(1, 3),
    zero=st.integers(0, 3),
    sizes=st.lists(st.sampled_from([1, 2, 4]), min_size=2, max_size=2, unique=True),
    variant=st.sampled_from(["plain", "offload", "moe", "context"]),
)
def test_the_state_floor_is_the_same_at_every_micro_batch(dp, tp, pp, zero, sizes, variant):
    """``state_floor`` is memoized across micro-batch sizes (a row's state reads its integer
    fields only): two tables, each asked at its own size first, give the same figure, which the
    memo then gives at the other size too."""
    zero = zero if dp > 1 else 0
    extra: dict = {}
    if variant == "offload" and zero >= 1:
        extra["offload_optimizer"] = "cpu"
    if variant == "context":
        extra["context_parallel"] = 2
    if variant == "moe":
        tables = [NumericTable(moe_table(layers=3, hidden=128, ffn=256, experts=4, top_k=2)) for _ in sizes]
        extra["expert_parallel"] = 2 if dp % 2 == 0 else 1
    else:
        tables = [NumericTable(gpt_table(layers=3, hidden=128, heads=4, vocab=1024)) for _ in sizes]
    cands = [Candidate(dp, tp, pp, zero, size, 4, **extra) for size in sizes]
    first, second = (state_floor(table, HW, "bf16", 128, cand, HW.gpus_per_node) for table, cand in zip(tables, cands))
    assert first == second > 0
    assert state_floor(tables[0], HW, "bf16", 128, cands[1], HW.gpus_per_node) == first


def _best_by_enumeration(costs) -> float:
    """The fastest feasible 1F1B strategy of ``costs`` over every partition and recompute set
    (``inf`` when none fits)."""
    n, pp = costs.num_layers, costs.cand.pp
    best = math.inf
    for cuts in itertools.combinations(range(1, n), pp - 1):
        bounds = [0, *cuts, n]
        stages = [(bounds[i], bounds[i + 1] - 1) for i in range(pp)]
        for size in range(n + 1):
            for recomputed in itertools.combinations(range(n), size):
                evaluation = evaluate(costs, stages, list(recomputed), [])
                if evaluation.feasible:
                    best = min(best, evaluation.step_time_s)
    return best


def _req(**kw):
    base = dict(spec="gpt", gpus=8, gpus_per_node=8, hardware="a100-80gb", global_batch=16, seq_len=128)
    base.update(kw)
    return PlanRequest(**base)


def test_enumeration_respects_model_node_and_batch():
    nt = NumericTable(gpt_table(layers=4, heads=6, kv_heads=2))
    cands = enumerate_candidates(_req(), nt, 8)
    assert {c.tp for c in cands} == {1, 2}  # 2 divides 6 heads and 2 kv heads; 4 and 8 do not
    for c in cands:
        assert c.dp * c.tp * c.pp == 8 and c.dp * c.micro_batch_size * c.num_micro_batches == 16
        assert c.pp == 1 or c.num_micro_batches >= c.pp
        assert c.pp <= 6 and (c.zero_stage == 0 or c.dp > 1)
    pinned = enumerate_candidates(_req(pp=2, zero_stage=1), nt, 8)
    assert pinned and all(c.pp == 2 and c.zero_stage == 1 for c in pinned)


def test_bad_pins_are_clear_errors():
    nt = NumericTable(gpt_table(layers=4, heads=6))
    with pytest.raises(
        UserError,
        match=r"--tp 4 does not divide the model's 6 attention heads.*"
        r"Valid --tp values here: 1, 2",
    ):
        check_pins(_req(tp=4), nt, 8)
    with pytest.raises(UserError, match="across nodes"):
        check_pins(_req(gpus=16, tp=16), NumericTable(gpt_table(heads=16)), 8)
    with pytest.raises(UserError, match=r"--pp 7 is more stages than the layer table has rows \(6"):
        check_pins(_req(gpus=7, pp=7, global_batch=14), nt, 8)
    with pytest.raises(UserError, match="fewer than --pp 4"):
        check_pins(_req(dp=2, pp=4, tp=1, micro_batch=4), nt, 8)
    with pytest.raises(UserError, match="must multiply to the number of devices"):
        _req(dp=2, tp=2, pp=1)
