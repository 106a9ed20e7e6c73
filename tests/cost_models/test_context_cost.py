"""cost_models.context_cost: context parallelism's per-rank work, exchange bytes and state, checked
against the formulas of its module docstring on a traced Llama (grouped-query attention)."""

from __future__ import annotations

import dataclasses

import pytest

from cost_models.context_cost import ContextSetting, core_count, tile_transient_bytes, ulysses_obstacle
from cost_models.hardware import load_hardware
from cost_models.strategy import Candidate, NumericTable, candidate_costs, context_rows, evaluate, hidden_breakdown
from planner.frontend.model_analysis import build_layer_table
from planner.search.request import PlanRequest
from planner.search.search_errors import SearchError
from planner.search.solve import solve
from runtime.contract.choices import ContextMethod
from runtime.contract.limits import ATTENTION_TILE_TENSORS
from runtime.contract.overlap import OVERLAP_NONE

H100 = load_hardware("h100-sxm", 8)
HEADS, KV_HEADS, HIDDEN = 8, 2, 256
HEAD_DIM = HIDDEN // HEADS
SIZES = dict(layers=2, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, ffn=512, vocab=1000)


@pytest.fixture(scope="module")
def table():
    return NumericTable(build_layer_table("hf:llama", **SIZES))


def _costs(table, cand, seq=4096, hw=H100):
    return candidate_costs(table, hw, "bf16", seq, cand, hw.gpus_per_node, hw.memory_bytes * 0.9)


def _cand(dp=1, tp=1, pp=1, zero=0, b=2, m=1, cp=1, method="ring", **kw):
    return Candidate(dp, tp, pp, zero, b, m, overlap=OVERLAP_NONE, context_parallel=cp, cp_method=method, **kw)


def test_each_rank_does_its_share_of_the_full_row(table):
    """FLOPs, memory-bound bytes and activations are the full-length row's over cp (the cores'
    kept pairs too: not the local row's, which would count a quarter of a causal square at cp 2)."""
    b, s, cp = 2, 4096, 4
    full, _ = table.layer_rows(b, s)
    local_rows, _ = table.layer_rows(b, s // cp)
    mine, _ = context_rows(table, b, s, cp)
    block = 1
    assert core_count(mine[block]) == 1
    for name in ("fwd_flops", "bwd_flops", "fwd_bytes", "saved_bytes", "boundary_bytes"):
        assert getattr(mine[block], name).whole == pytest.approx(getattr(full[block], name).whole / cp)
    assert mine[block].core.fwd_flops.whole == pytest.approx(full[block].core.fwd_flops.whole / cp)
    assert mine[block].core.fwd_flops.whole > local_rows[block].core.fwd_flops.whole * 1.5
    assert mine[block].fwd_gemms == local_rows[block].fwd_gemms  # products at their local shapes
    assert mine[block].param_count == full[block].param_count
    assert context_rows(table, b, s, cp)[0] is mine  # cached: the rows' identities key shared work


@pytest.mark.parametrize("method", ["ring", "all-gather", "ulysses"])
def test_exchange_bytes_are_exact(table, method):
    """Per core and micro-batch, ``kv = 2 b (s / cp) kv_heads head_dim`` elements: the ring sends
    ``cp - 1`` blocks forward, as many plus ``cp`` fp32 gradient blocks backward; all-gather
    gathers and reduce-scatters keys and values whole; Ulysses all-to-alls q, k, v, out each way."""
    b, s, cp = 2, 4096, 4
    costs = _costs(table, _cand(dp=2, b=b, cp=cp, method=method))
    layer = costs.layers[1]
    kv = 2 * b * (s // cp) * KV_HEADS * HEAD_DIM
    q = b * (s // cp) * HEADS * HEAD_DIM
    if method == "ring":
        forward, backward = (cp - 1) * kv * 2, (cp - 1) * kv * 2 + cp * kv * 4
    elif method == "all-gather":
        forward = backward = 2 * (cp - 1) / cp * (kv * cp / 2) * 2
    else:
        forward = backward = (cp - 1) / cp * (2 * q + kv) * 2
    assert layer.cp_sent_b == pytest.approx(forward + backward)
    assert layer.cp_rec_sent_b == pytest.approx(forward)
    assert costs.layers[0].cp_sent_b == 0.0  # the embedding has no attention
    # all-gather: the gathered keys and values stay saved; Ulysses: the output, in both layouts
    extra = {"ring": 0.0, "all-gather": (cp - 1) * kv * 2, "ulysses": q * 2}[method]
    plain = _costs(table, _cand(dp=2, b=b, cp=cp, method="ring")).layers[1]
    assert layer.saved_b - plain.saved_b == pytest.approx(extra)


def test_state_is_sharded_over_dp_times_cp(table):
    """The cp ranks hold the same weights: ZeRO shards them over dp x cp, as a dp of dp x cp would."""
    for zero in (1, 2, 3):
        context = _costs(table, _cand(dp=2, cp=4, zero=zero))
        wide = _costs(table, _cand(dp=8, zero=zero))
        for mine, theirs in zip(context.layers, wide.layers):
            assert (mine.params_b, mine.grads_b, mine.optimizer_b) == (
                theirs.params_b,
                theirs.grads_b,
                theirs.optimizer_b,
            )
            assert mine.zero_mb_s == pytest.approx(theirs.zero_mb_s)


def test_step_time_parts_hold_the_exchange(table):
    """cp_comm is m x the bottleneck stage's exposed exchange, and the parts still sum to the step."""
    cand = _cand(dp=1, pp=2, b=1, m=4, cp=2, method="all-gather")
    costs = _costs(table, cand)
    evaluation = evaluate(costs, [(0, 1), (2, 3)], checkpoint=[1])
    stage = evaluation.stages[evaluation.bottleneck_stage]
    assert evaluation.time["cp_comm"] == pytest.approx(4 * stage.cp_s)
    assert evaluation.time["cp_comm"] > 0
    assert sum(evaluation.time.values()) == pytest.approx(evaluation.step_time_s)
    recomputed = costs.layers[1]
    assert stage.cp_s == pytest.approx(sum(layer.cp_s for layer in costs.layers[0:2]) + recomputed.cp_rec_s)


def test_ring_hides_its_sends_under_the_block_compute(table):
    """A ring step's send beside one key block's attention: at a long sequence on NVLink it hides
    (only the waits and the gradient pass stay exposed), and the hidden seconds are reported."""
    costs = _costs(table, _cand(dp=1, b=1, cp=2, method="ring"), seq=65536)
    layer = costs.layers[1]
    assert layer.cp_hidden_s > 0
    evaluation = evaluate(costs, [(0, 3)])
    assert hidden_breakdown(evaluation)["cp_comm"] == pytest.approx(sum(cost.cp_hidden_s for cost in costs.layers))


def test_the_score_tiles_are_a_backward_transient():
    """``ATTENTION_TILE_TENSORS`` float32 tiles of ``b x heads x t x t``, ``t`` the tile or the chunk."""
    wide = ContextSetting(cp=4, heads=8, kv_heads=2, micro_batch=2)
    assert (
        tile_transient_bytes(wide, 1, 2 * 8192 / 4) == ATTENTION_TILE_TENSORS * 4 * 2 * 8 * 512**2
    )  # chunks of 1024: tiles of 512
    assert tile_transient_bytes(wide, 2, 2 * 1024 / 4) == ATTENTION_TILE_TENSORS * 4 * 2 * 4 * 128**2  # chunks of 128
    # Ulysses attends over the whole sequence on a cp-th of the heads: 8 / 4 = 2 per rank
    ulysses = dataclasses.replace(wide, method=ContextMethod.ULYSSES)
    assert tile_transient_bytes(ulysses, 1, 2 * 8192 / 4) == ATTENTION_TILE_TENSORS * 4 * 2 * 2 * 512**2


def test_ulysses_needs_heads_that_divide():
    assert ulysses_obstacle(ContextSetting(cp=2, heads=8, kv_heads=2), tp=1) is None
    why = ulysses_obstacle(ContextSetting(cp=4, heads=8, kv_heads=2), tp=1)
    assert why is not None and "2 key/value heads" in why and "cp=4" in why


def _request(**kw):
    base = dict(
        spec="hf:llama", sizes=SIZES, gpus=8, gpus_per_node=8, hardware="h100-sxm", global_batch=8, seq_len=8192
    )
    return PlanRequest(**{**base, **kw})


def test_the_free_search_is_never_slower_than_a_pinned_context_split(table):
    """Under the planner's own model: every pinned (cp, method) plan is at least as slow as the free one."""
    free = solve(_request(), table, H100).plan
    assert free.context_parallel["degree"] >= 1
    for cp, method in ((2, "ring"), (2, "all-gather"), (2, "ulysses"), (4, "ring"), (1, None)):
        pinned = solve(_request(cp=cp, cp_method=method), table, H100).plan
        assert pinned.cp == cp and (method is None or pinned.context_parallel["method"] == method)
        assert free.predicted.step_time_s <= pinned.predicted.step_time_s * (1 + 1e-9)
        assert pinned.dp * pinned.cp * pinned.tp * pinned.pp == 8


def test_long_sequences_fit_only_when_split(table):
    """At 256K tokens one sequence's activations overflow a 2 GiB device whatever the tp, recompute
    or ZeRO stage; a context split makes it fit, and the free search finds it."""
    small = dataclasses.replace(H100, memory_bytes=2 * 2**30)
    request = _request(seq_len=262144, global_batch=8)
    with pytest.raises(SearchError):
        solve(dataclasses.replace(request, cp=1), table, small)
    plan = solve(request, table, small).plan
    assert plan.cp > 1 and plan.predicted.peak_memory_bytes <= small.memory_bytes


@pytest.mark.parametrize(
    "pins, message",
    [
        (dict(cp=3, gpus=6), "does not divide by 6"),
        (dict(cp=2, offload_optimizer="cpu"), "--offload-optimizer cpu"),
        (dict(cp=2, cp_method="ring-ish"), "--cp-method must be one of"),
        (dict(cp=0), "--cp must be a positive integer"),
    ],
)
def test_bad_context_pins_say_what_to_do(pins, message):
    with pytest.raises(SearchError, match=message):
        _request(**pins)


def test_costs_priced_through_the_shared_memo_are_those_priced_alone(table):
    """Candidates that differ in the context method or the groups' placement share a row's passes
    and tensor-parallel seconds through ``work_memo``; each one's costs are what a fresh table
    (nothing shared) prices for it alone."""
    cands = [
        _cand(dp=dp, tp=2, cp=2, method=method, b=1, m=2, sequence_parallel=True)
        for method in ("ring", "all-gather", "ulysses")
        for dp in (1, 8)  # dp 8: the data-parallel group spans nodes
    ]
    shared = [_costs(table, cand) for cand in cands]
    for cand, costs in zip(cands, shared):
        alone = _costs(NumericTable(table.table), cand)  # a fresh memo
        assert [dataclasses.asdict(cost) for cost in costs.layers] == [
            dataclasses.asdict(cost) for cost in alone.layers
        ]
