"""cost_models.expert_cost: expert parallelism's all-to-all bytes, expert state and expert products,
checked exactly against the formulas of its module docstring on closed-form MoE tables."""

from __future__ import annotations

import dataclasses

import pytest

from cost_models.comm_cost import collective_time, group_placement
from cost_models.expert_cost import (
    expert_load,
    expert_placements,
    local_expert_gemms,
    valid_expert_degrees,
)
from cost_models.hardware import load_hardware
from cost_models.memory import model_state_bytes
from cost_models.strategy import Candidate, NumericTable, candidate_costs, evaluate
from runtime.contract.overlap import OVERLAP_NONE
from runtime.contract.rank_layout import expert_ranks
from tests.cost_models.moe_tables import expert_forward_flops, moe_table

H100 = load_hardware("h100-sxm", 8)
CPU = load_hardware("cpu", 8)
HIDDEN, FFN, EXPERTS, TOP_K = 256, 512, 8, 2


def _costs(cand, table=None, hw=H100, seq=128, dtype="bf16"):
    table = table if table is not None else moe_table(layers=2, hidden=HIDDEN, ffn=FFN, experts=EXPERTS, top_k=TOP_K)
    return candidate_costs(NumericTable(table), hw, dtype, seq, cand, hw.gpus_per_node, hw.memory_bytes * 0.9)


def _cand(dp=8, tp=1, pp=1, zero=0, b=2, m=2, ep=1, **kw):
    return Candidate(dp, tp, pp, zero, b, m, expert_parallel=ep, overlap=OVERLAP_NONE, **kw)


def test_load_is_the_imbalance_at_ep_above_one_capped_by_the_capacity():
    assert expert_load(1, 1.5) == 1.0  # a rank holding every expert gets exactly the mean
    assert expert_load(4, 1.5) == 1.5
    assert expert_load(4, 1.5, 1.25) == 1.25  # capacity drops the rest
    assert expert_load(4, 1.0, 0.5) == 0.5
    assert expert_load(1, 1.0, 0.5) == 0.5
    with pytest.raises(ValueError, match=">= 1.0"):
        expert_load(2, 0.9)
    with pytest.raises(ValueError, match="positive"):
        expert_load(2, 1.0, 0.0)
    assert valid_expert_degrees(8, 8) == [1, 2, 4, 8]
    assert valid_expert_degrees(12, 8) == [1, 2, 4]
    assert valid_expert_degrees(64, 0) == [1]


def test_all_to_all_bytes_are_exact():
    """Each rank sends ``tokens x top_k x hidden x 2 bytes x (ep - 1) / ep`` per dispatch and per
    combine, forward and backward (x the load); a recomputed forward sends them again; the plan's
    per-device bytes hold ``m`` micro-batches of them."""
    b, s, ep = 2, 128, 4
    dispatch = b * s * TOP_K * HIDDEN * 2
    per_call = dispatch * (ep - 1) / ep
    for imbalance, capacity, load in ((1.0, None, 1.0), (1.2, None, 1.2), (1.5, 1.25, 1.25)):
        cand = _cand(ep=ep, b=b, m=3, moe_imbalance=imbalance, moe_capacity_factor=capacity)
        block = _costs(cand, seq=s).layers[1]
        assert block.ep_sent_b == 4 * per_call * load  # dispatch + combine, forward + backward
        assert block.ep_rec_sent_b == 2 * per_call * load
        placement = expert_placements(8, 1, 1, ep, 8)[0]
        one = float(collective_time("all_to_all", dispatch * load, placement, H100)) + H100.sync_overhead_s
        assert block.ep_s == pytest.approx(4 * one, rel=1e-12)
        assert block.ep_rec_s == pytest.approx(2 * one, rel=1e-12)
    # the plan's bytes: m micro-batches of every block's all-to-alls, recomputed ones twice
    costs = _costs(_cand(ep=ep, b=b, m=3), seq=s)
    quiet = dataclasses.replace(costs.layers[1], ep_sent_b=0.0, ep_rec_sent_b=0.0)
    stages = [(0, 3)]
    for checkpoint, forwards in (((), 4), ((1, 2), 6)):
        with_a2a = evaluate(costs, stages, checkpoint).comm_bytes_per_device
        costs_quiet = _costs(_cand(ep=ep, b=b, m=3), seq=s)
        costs_quiet.layers[1] = costs_quiet.layers[2] = quiet
        without = evaluate(costs_quiet, stages, checkpoint).comm_bytes_per_device
        assert with_a2a - without == pytest.approx(3 * 2 * forwards * per_call, rel=1e-12)


def test_expert_state_divides_by_ep_over_the_expert_data_group():
    """Routed experts' parameters, gradients and optimizer state divide by ep; ZeRO shards them
    over the dp / ep ranks holding the same experts, the rest over dp: exactly."""
    dense = 12 * HIDDEN * HIDDEN + 13 * HIDDEN
    experts = EXPERTS * 3 * HIDDEN * FFN
    for zero in (0, 1, 2, 3):
        for ep in (1, 2, 8):
            block = _costs(_cand(zero=zero, ep=ep)).layers[1]
            if ep == 1:
                want = model_state_bytes(dense + experts, "bf16", zero, 8)
            else:
                rest, mine = (
                    model_state_bytes(dense, "bf16", zero, 8),
                    model_state_bytes(experts // ep, "bf16", zero, 8 // ep),
                )
                want = {key: rest[key] + mine[key] for key in rest}
            assert (block.params_b, block.grads_b, block.optimizer_b) == (
                want["params"],
                want["grads"],
                want["optimizer"],
            ), (zero, ep)
            assert block.num_params == dense + experts // ep
            assert block.expert_params == (experts // ep if ep > 1 else experts)


def test_expert_gradients_reduce_over_the_expert_data_group():
    """ZeRO 0: the dense gradients all-reduce over dp = 8, the experts' (1/ep of them) over dp / ep."""
    from runtime.contract.collective_bytes import ring_bytes

    dense = 12 * HIDDEN * HIDDEN + 13 * HIDDEN
    experts = EXPERTS * 3 * HIDDEN * FFN
    block = _costs(_cand(zero=0, ep=4)).layers[1]
    want = ring_bytes("all_reduce", 2 * dense, 8) + ring_bytes("all_reduce", 2 * experts // 4, 2)
    assert block.dp_step_sent_b == pytest.approx(want, rel=1e-12)


def test_ep_one_prices_the_experts_as_traced_and_dense_rows_do_not_change():
    """At ep 1 and load 1 the expert fields change nothing: the row costs what the same row without
    them costs (the products at the even share, as ``passes.autograd_costs`` listed them)."""
    table = moe_table(layers=2, hidden=HIDDEN, ffn=FFN, experts=EXPERTS, top_k=TOP_K)
    bare = moe_table(layers=2, hidden=HIDDEN, ffn=FFN, experts=EXPERTS, top_k=TOP_K)
    for row in bare.layers:
        row.expert_fwd_gemms, row.expert_bwd_gemms = [], []
        row.expert_param_count = row.experts = row.top_k = row.moe_layers = 0
        row.expert_dispatch_bytes = row.expert_tokens = 0
    for hw in (H100, CPU):
        cand = _cand(zero=1)
        moe = [dataclasses.replace(layer, expert_params=0) for layer in _costs(cand, table, hw).layers]
        assert moe == _costs(cand, bare, hw).layers


def test_expert_products_run_at_the_rows_each_local_expert_gets():
    """Under ep a rank's experts / ep local experts get tokens x top_k x ep / experts rows each: the
    same FLOPs, priced at a larger m (closer to the peak on a GPU); the load scales them."""
    tokens = 2 * 128 * TOP_K / EXPERTS
    fwd = moe_table(layers=1, hidden=HIDDEN, ffn=FFN, experts=EXPERTS, top_k=TOP_K).layers[1].expert_fwd_gemms
    numeric = [(tokens, g.n, g.k, EXPERTS, 1, None) for g in fwd]
    local = local_expert_gemms(numeric, tokens, 4, 1.5)
    assert [(g[0], g[3]) for g in local] == [(tokens * 4 * 1.5, EXPERTS / 4)] * 2
    flops = sum(2 * m * n * k * batch * count for m, n, k, batch, count, _ in local)
    assert flops == pytest.approx(1.5 * expert_forward_flops(2, 128, HIDDEN, FFN, TOP_K))
    wgrad = (HIDDEN, 2 * FFN, tokens, EXPERTS, 1, None)  # the contraction over the rows is k
    assert local_expert_gemms([wgrad], tokens, 2, 1.0)[0][:4] == (HIDDEN, 2 * FFN, 2 * tokens, EXPERTS / 2)
    unknown = (tokens * 3, 2 * FFN, HIDDEN, EXPERTS, 1, None)  # no dim of the even share: FLOPs x load only
    assert local_expert_gemms([unknown], tokens, 4, 1.5)[0][:4] == (tokens * 3, 2 * FFN, HIDDEN, EXPERTS * 1.5)
    ep1, ep8 = (_costs(_cand(ep=ep)).layers[1] for ep in (1, 8))
    assert ep8.compute_s < ep1.compute_s  # bigger products run faster on an H100
    loaded = _costs(_cand(ep=8, moe_imbalance=1.2)).layers[1]
    assert loaded.compute_s > ep8.compute_s
    # on a CPU (flat rate) only the load changes the time, by exactly its share of the FLOPs
    cpu1, cpu8 = (_costs(_cand(ep=ep), hw=CPU).layers[1] for ep in (1, 8))
    assert cpu8.fwd_s == pytest.approx(cpu1.fwd_s, rel=1e-12)


def test_imbalance_raises_the_expert_products_smoothly():
    """A busiest expert's ``X`` times the mean rows is rarely whole: priced rounded up to 16 rows,
    the products cost more as ``X`` grows, and never more than ``X`` times their even cost plus the
    rounding (a fractional mean read as a misaligned size cost Mixtral 4.5x at X = 1.1)."""
    assert H100.gemm_misaligned_efficiency < 1.0  # the rule the rounding must not trip
    tokens = 2 * 128 * TOP_K / EXPERTS
    fwd = (tokens, 2 * FFN, HIDDEN, EXPERTS, 1, None)
    assert local_expert_gemms([fwd], tokens, 4, 1.1)[0][0] == 16 * 18  # 281.6 rows -> 288
    even = _costs(_cand(ep=8)).layers[1].compute_s
    times = [_costs(_cand(ep=8, moe_imbalance=x)).layers[1].compute_s for x in (1.05, 1.1, 1.2, 1.25, 1.5, 2.0)]
    assert all(a <= b for a, b in zip([even] + times, times))
    for x, seconds in zip((1.05, 1.1, 1.2, 1.25, 1.5, 2.0), times):
        assert seconds <= even * (x + 16 / (tokens * 8)), x


def test_expert_groups_inside_a_node_unless_tp_times_ep_exceeds_it():
    """The expert group is ep consecutive dp ranks, tp apart: on one node while tp x ep fits."""
    inside, data = expert_placements(16, 1, 1, 8, 8)
    assert (inside.size, inside.nodes) == (8, 1)
    assert (data.size, data.nodes) == (2, 2)
    across, _ = expert_placements(8, 2, 1, 8, 8)
    assert (across.size, across.nodes) == (8, 2)
    groups, _ = expert_ranks(8, 2, 1, 8)
    assert group_placement(groups[0], 8) == across
    slow = _costs(_cand(dp=8, tp=2, ep=8)).layers[1]
    fast = _costs(_cand(dp=16, tp=1, ep=8)).layers[1]
    assert slow.ep_s > fast.ep_s


def test_step_time_parts_sum_and_ep_comm_is_the_bottleneck_stages_all_to_alls():
    costs = _costs(_cand(dp=8, pp=2, ep=4, b=2, m=4))
    for checkpoint in ((), (1,)):
        evaluation = evaluate(costs, [(0, 1), (2, 3)], checkpoint)
        assert sum(evaluation.time.values()) == pytest.approx(evaluation.step_time_s, rel=1e-9)
        stage = evaluation.stages[evaluation.bottleneck_stage]
        layers = costs.layers[stage.first : stage.last + 1]
        want = sum(layer.ep_s for layer in layers) + sum(
            costs.layers[i].ep_rec_s for i in checkpoint if stage.first <= i <= stage.last
        )
        assert evaluation.time["ep_comm"] == pytest.approx(4 * want, rel=1e-12)
        assert evaluation.time["ep_comm"] > 0


def test_candidate_refuses_what_is_not_priced():
    with pytest.raises(ValueError, match="must divide dp"):
        _cand(dp=6, ep=4)
    with pytest.raises(ValueError, match="offload"):
        _cand(zero=1, ep=2, offload_optimizer="cpu")


def test_compiled_layers_break_at_each_dispatch_and_combine():
    """Compiled, a MoE layer's all-to-alls are graph breaks: two more regions per MoE layer at ep > 1."""
    from cost_models.layer_work import compiled_regions

    row = NumericTable(moe_table(layers=1)).layer_rows(2, 128)[0][1]
    assert (compiled_regions(row, 1), compiled_regions(row, 1, ep=4)) == (1, 3)
    eager = _costs(_cand(ep=4, compile=False)).layers[1]
    compiled = _costs(_cand(ep=4, compile=True)).layers[1]
    assert compiled.ep_s == eager.ep_s  # the same all-to-alls either way
