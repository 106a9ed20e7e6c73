"""cost_models.schedule_cost: chunking, the W split, the memory factors and the schedule's price
against hand-computed values (closed forms with equal stages)."""

from __future__ import annotations

import itertools

import pytest

from cost_models.compute import compute_time
from cost_models.hardware import load_hardware
from cost_models.schedule_cost import (
    ChunkTimes,
    SimulatedPipeline,
    chunk_times,
    evaluate_schedule,
    interleaved_inflight,
    split_chunks,
)
from cost_models.strategy import Candidate, NumericTable, candidate_costs, evaluate
from passes.core import B, S
from passes.layer_table import Gemm, LayerTable
from runtime.contract.schedule_ir import interleaved_one_f_one_b, peak_inflight, peak_weight_pending, zero_bubble_h1
from tests.helpers import gpt_table

CPU = load_hardware("cpu", 8)
A100 = load_hardware("a100-80gb", 8)


def _costs(layers=8, pp=2, m=4, hw=CPU, tp=1):
    nt = NumericTable(gpt_table(layers=layers, hidden=64, heads=4, vocab=512))
    cand = Candidate(dp=1, tp=tp, pp=pp, zero_stage=0, micro_batch_size=1, num_micro_batches=m)
    return candidate_costs(nt, hw, "fp32", 32, cand, 8, hw.memory_bytes)


@pytest.mark.parametrize("costs, k", [([1.0] * 8, 4), ([5, 1, 1, 1, 1, 1, 1, 5], 3), ([1, 2, 3, 4, 5, 6], 4)])
def test_split_chunks_is_the_min_max_contiguous_partition(costs, k):
    got = split_chunks(costs, k)
    n = len(costs)
    assert got[0][0] == 0 and got[-1][1] == n - 1 and all(b + 1 == c for (_, b), (c, _) in zip(got, got[1:]))
    best = min(
        max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, n)))
        for cuts in itertools.combinations(range(1, n), k - 1)
    )
    assert max(sum(costs[a : b + 1]) for a, b in got) == pytest.approx(best)
    with pytest.raises(ValueError, match="non-empty"):
        split_chunks(costs, n + 1)


@pytest.mark.parametrize("p, v", [(2, 2), (4, 2), (4, 3), (8, 4)])
def test_interleaved_inflight_closed_form_matches_the_schedule(p, v):
    m = 2 * p
    peaks = peak_inflight(interleaved_one_f_one_b(p, m, v))
    assert [interleaved_inflight(r, p, m, v) for r in range(p)] == [k / v for k in peaks]
    # rank 0 holds (1 + (p - 1) / (p v)) times 1F1B's p micro-batches
    assert interleaved_inflight(0, p, m, v) == pytest.approx(p * (1 + (p - 1) / (p * v)))


def test_zero_bubble_keeps_p_micro_batches_until_w_on_every_rank():
    p, m = 4, 8
    assert peak_inflight(zero_bubble_h1(p, m)) == [4, 3, 2, 1]  # 1F1B's min(p - r, m)
    assert peak_weight_pending(zero_bubble_h1(p, m)) == [4, 4, 4, 4]  # what the executor holds


def test_w_is_half_the_backward_matmuls_without_listed_products():
    """No products listed (the closed-form table): W's device time is half the backward's matmul
    FLOPs plus the gradient accumulation, and it takes that share of the backward's host overhead."""
    cc = _costs()
    blk = cc.layers[1]
    row = NumericTable(gpt_table(layers=8, hidden=64, heads=4, vocab=512)).rows(1, 32)[1]
    accumulate = compute_time(0.0, 3 * blk.num_params * 4, CPU, "fp32")
    dev_b = compute_time(row["bwd_flops"], row["bwd_bytes"], CPU, "fp32") + accumulate
    dev_w = compute_time(row["bwd_flops"] / 2, 0.0, CPU, "fp32") + accumulate
    t_b = blk.compute_s - blk.fwd_s
    assert blk.wgrad_s == pytest.approx(t_b * dev_w / dev_b)
    assert 0 < blk.wgrad_s < t_b


def _with_bwd_gemms(gemms) -> NumericTable:
    table = gpt_table(layers=2, hidden=64, heads=4, vocab=512)
    table.layers[1].bwd_gemms = gemms
    return NumericTable(LayerTable(layers=table.layers, dtype=table.dtype, model=table.model))


def test_w_counts_only_products_that_contract_over_tokens():
    dx = Gemm(B * S, 64, 64, 1, 1, "k")  # input gradient: m = tokens
    dw = Gemm(64, 64, B * S, 1, 1, "m")  # weight gradient: k = tokens
    core = Gemm(S, 16, S, 4 * B, 2, "batch")  # attention core: batched, no weight
    cand = Candidate(dp=1, tp=1, pp=1, zero_stage=0, micro_batch_size=2, num_micro_batches=1)

    def wgrad(gemms):
        return candidate_costs(_with_bwd_gemms(gemms), A100, "bf16", 48, cand, 8, A100.memory_bytes).layers[1]

    with_dw, without_dw = wgrad([dx, dw, core]), wgrad([dx, core])
    assert with_dw.wgrad_s > without_dw.wgrad_s > 0  # without dW only the accumulation remains
    assert with_dw.wgrad_s < with_dw.compute_s - with_dw.fwd_s


def test_equal_chunks_price_the_closed_form_bubbles():
    """With equal stages and free sends the simulated schedules give the textbook bubbles: 1F1B
    (p - 1) / m idle per unit of compute, interleaved (p - 1) / (v m), ZB-H1 (p - 1) / (3 m)."""
    from planner.search.schedule_search import simulate_pipeline

    p, m, f = 4, 8, 1.0
    one = simulate_pipeline("1f1b", p, m, 1, ChunkTimes((f,) * p, (2 * f,) * p, None, 0.0)).makespan_s
    assert (one - m * 3 * f) / (m * 3 * f) == pytest.approx((p - 1) / m)
    for v in (2, 4):
        ch = ChunkTimes((f / v,) * (p * v), (2 * f / v,) * (p * v), None, 0.0)
        span = simulate_pipeline("interleaved", p, m, v, ch).makespan_s
        assert (span - m * 3 * f) / (m * 3 * f) == pytest.approx((p - 1) / (v * m))
    zb = simulate_pipeline("zero-bubble", p, m, 1, ChunkTimes((f,) * p, (f,) * p, (f,) * p, 0.0)).makespan_s
    assert (zb - m * 3 * f) / (m * 3 * f) == pytest.approx((p - 1) / (3 * m))


def test_schedule_evaluation_parts_sum_and_memory_factors():
    cc = _costs(layers=8, pp=2, m=4)
    base = evaluate(cc, [(0, 4), (5, 9)])
    p, m, v = 2, 4, 2
    chunks = split_chunks([l.work_s for l in cc.layers], p * v)
    times = chunk_times(cc, chunks, [], "interleaved")
    held = tuple(interleaved_inflight(r, p, m, v) for r in range(p))
    sim = SimulatedPipeline(makespan_s=10.0, held=held, messages=0)
    ev = evaluate_schedule(cc, chunks, [], "interleaved", v, sim, times)
    assert ev.strategy.schedule == "interleaved" and ev.strategy.virtual_stages == 2
    assert len(ev.strategy.stages) == 4 and len(ev.stages) == 2
    assert sum(ev.time.values()) == pytest.approx(ev.step_time_s)
    assert ev.step_time_s == pytest.approx(10.0 + ev.tail_s)
    # every chunk boundary sends both ways: each rank sends 3 (of 2 v - 1 = 3 boundaries' 6 messages)
    assert ev.stages[0].p2p_s == pytest.approx(3 * times.send_s)
    assert ev.comm_bytes_per_device > base.comm_bytes_per_device
    # activations: rank 0 holds (1 + (p-1)/(p v)) x 1F1B's p = 2.5 of its micro-batches
    per_mb = sum(cc.layers[i].saved_b for a, b in chunks[0::2] for i in range(a, b + 1))
    assert ev.stages[0].memory["activations"] >= 2.5 * per_mb - 1
    zb_times = chunk_times(cc, base.strategy.stages, [], "zero-bubble")
    assert all(w > 0 for w in zb_times.weight_s)
    full = chunk_times(cc, base.strategy.stages, [], "1f1b")
    assert [b + w for b, w in zip(zb_times.backward_s, zb_times.weight_s)] == pytest.approx(list(full.backward_s))
    zb = evaluate_schedule(
        cc, base.strategy.stages, [], "zero-bubble", 1, SimulatedPipeline(10.0, (2.0, 2.0), 0), zb_times
    )
    # the last stage holds 2 micro-batches instead of 1F1B's 1
    assert zb.stages[1].memory["activations"] > base.stages[1].memory["activations"]
    assert zb.stages[0].memory == base.stages[0].memory
