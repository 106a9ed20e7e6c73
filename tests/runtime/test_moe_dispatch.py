"""runtime.moe's dispatch and combine: a hand-written tiny MoE layer (router, top-k, rows sorted by
expert, dispatch -> the local experts' grouped products -> combine) on 4 gloo ranks in ONE launch,
as expert-parallel groups of 4 (dp4 ep4) and of 2 (dp4 ep2, dp2 tp2 ep2), against a direct
per-token computation with all experts in one process: outputs and gradients of the inputs, router
and expert weights, with uneven routing (an expert that never gets a token), capacity mode's drops
against a hand count, and bytes counted against the rows actually sent. The mesh's expert groups,
single-process behaviour and the per-step accumulator are plain tests."""

from __future__ import annotations

import json
import math
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

from runtime import timing
from runtime.contract.collective_bytes import all_to_all_bytes, ring_bytes
from runtime.contract.rank_layout import expert_ranks
from runtime.distributed import comm
from runtime.distributed.launch import launch_local
from runtime.distributed.mesh import Mesh, get_mesh, set_mesh, setup_mesh
from runtime.moe import LOAD, combine, dispatch, expert_load, expert_slice, reduce_over
from runtime.portable import grouped_mm
from tests.runtime import moe_engine_checks

E, H, FF, TOP_K, TOKENS = 8, 6, 5, 2, 12
WORLD = 4
RTOL = dict(rtol=1e-5, atol=1e-6)


def _weights(seed: int = 0, skew: bool = False) -> dict[str, torch.Tensor]:
    """Router and expert weights; expert E-1's router bias keeps it from ever being picked
    (``skew``: only experts 0 and 1 are ever picked, so the other ranks of a group receive nothing)."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.zeros(E)
    bias[2 if skew else E - 1 :] = -1e4
    return {
        "router": torch.randn(H, E, generator=g),
        "bias": bias,
        "w1": torch.randn(E, H, FF, generator=g) / 3,
        "w2": torch.randn(E, FF, H, generator=g) / 3,
    }


def _route(x: torch.Tensor, w: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(x @ w["router"] + w["bias"], dim=-1)
    return torch.topk(probs, TOP_K, dim=-1)


def moe_layer(x, w, w1_local, w2_local, capacity_factor=None):
    """The layer as compiled code runs it: rows sorted by expert, dispatch, grouped products, combine."""
    top_w, top_i = _route(x, w)
    sorted_ids, perm = torch.sort(top_i.reshape(-1), stable=True)
    rows = x[perm // TOP_K]
    counts = torch.histc(sorted_ids.float(), E, 0, E - 1)
    local_rows, offs, routing = dispatch(rows, counts, E, capacity_factor)
    act = F.silu(grouped_mm(local_rows, w1_local, offs))
    back = combine(grouped_mm(act, w2_local, offs), routing)
    weighted = back * top_w.reshape(-1)[perm].unsqueeze(-1)
    return x.new_zeros(x.shape[0] * TOP_K, x.shape[1]).index_copy(0, perm, weighted).view(-1, TOP_K, H).sum(1)


def reference_layer(x, w, w1, w2, capacity_factor=None):
    """Token by token with every expert; a (token, slot) past its expert's capacity (rows taken
    in (token, slot) order) contributes nothing. Also returns the dropped count."""
    top_w, top_i = _route(x, w)
    cap = math.ceil(capacity_factor * x.shape[0] * TOP_K / E) if capacity_factor else None
    seen = [0] * E
    out, dropped = [], 0
    for t in range(x.shape[0]):
        acc = torch.zeros(H, dtype=x.dtype)
        for j in range(TOP_K):
            e = int(top_i[t, j])
            seen[e] += 1
            if cap is not None and seen[e] > cap:
                dropped += 1
                continue
            acc = acc + top_w[t, j] * (F.silu(x[t] @ w1[e]) @ w2[e])
        out.append(acc)
    return torch.stack(out), dropped


def _leaves(w):
    return {k: v.detach().clone().requires_grad_(k != "bias") for k, v in w.items()}


def _gather(t: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's ``t`` (outside comm: the byte counter is untouched)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _check_layer(rank: int, capacity_factor: float | None, skew: bool = False) -> None:
    """The current mesh's ep group against the per-token reference; gradients of x, the router
    and this rank's expert slices (summed over the ep group's ranks in the reference)."""
    mesh = get_mesh()
    torch.manual_seed(100 + mesh.dp_index)  # tokens differ per dp rank, equal over tp
    x = torch.randn(TOKENS, H)
    dy = torch.randn(TOKENS, H)
    w = _leaves(_weights(skew=skew))
    own = expert_slice(E, mesh.ep, mesh.ep_index)
    w1_local = w["w1"].detach()[own].clone().requires_grad_(True)
    w2_local = w["w2"].detach()[own].clone().requires_grad_(True)
    xd = x.clone().requires_grad_(True)
    comm.STATS.reset()
    LOAD.reset()
    timing.TIMER.start()
    y = moe_layer(xd, w, w1_local, w2_local, capacity_factor)
    parts = timing.TIMER.stop().parts
    assert parts["ep_comm"] > 0 and parts["dp_comm"] == parts["tp_comm"] == 0  # the exchange's blocked time
    forward_bytes = comm.STATS.total
    (y * dy).sum().backward()
    backward_bytes = comm.STATS.total - forward_bytes

    wr, xr = _leaves(_weights(skew=skew)), x.clone().requires_grad_(True)
    y_ref, dropped = reference_layer(xr, wr, wr["w1"], wr["w2"], capacity_factor)
    (y_ref * dy).sum().backward()
    assert_close(y, y_ref, **RTOL)
    assert_close(xd.grad, xr.grad, **RTOL)
    assert_close(w["router"].grad, wr["router"].grad, **RTOL)
    for local, ref in ((w1_local, wr["w1"]), (w2_local, wr["w2"])):
        summed = torch.stack(_gather(ref.grad, mesh.ep_group)).sum(0)[own]
        assert_close(local.grad, summed, **RTOL)
    assert float(wr["w1"].grad[E - 1].abs().sum()) == 0.0  # the uneven case: expert E-1 got nothing
    assert LOAD.tokens_dropped == dropped
    if capacity_factor is not None:
        assert dropped > 0, "the capacity case must drop something to test it"
    _check_bytes(x, w, own, capacity_factor, forward_bytes, backward_bytes)


def _check_bytes(x, w, own, capacity_factor, forward_bytes, backward_bytes) -> None:
    """Rows this rank sends to experts of other ranks (after capacity), and rows it receives from
    other ranks for its own experts, by hand from the routing; x h x 4 bytes, plus the counts'
    all-to-all ((ep-1)/ep x E int64) in the forward."""
    mesh = get_mesh()
    _, top_i = _route(x, w)
    ids = torch.sort(top_i.reshape(-1), stable=True)[0].tolist()
    cap = math.ceil(capacity_factor * len(ids) / E) if capacity_factor else len(ids)
    kept = [min(ids.count(e), cap) for e in range(E)]
    to_others = sum(c for e, c in enumerate(kept) if not own.start <= e < own.stop)
    per_expert = torch.stack(_gather(torch.tensor(kept, dtype=torch.int64), mesh.ep_group))  # [ep, E]
    from_others = int(per_expert[:, own].sum()) - int(per_expert[mesh.ep_index, own].sum())
    row = H * 4
    counts_bytes = (mesh.ep - 1) / mesh.ep * E * 8
    assert forward_bytes == counts_bytes + (to_others + from_others) * row, (forward_bytes, to_others, from_others)
    assert backward_bytes == (to_others + from_others) * row


def _check_groups(rank: int) -> None:
    mesh = get_mesh()
    groups, data_groups = expert_ranks(mesh.dp, mesh.tp, mesh.pp, mesh.ep)
    assert mesh.ep_ranks == tuple(next(g for g in groups if rank in g))
    assert mesh.edp_ranks == tuple(next(g for g in data_groups if rank in g))
    assert dist.get_process_group_ranks(mesh.ep_group) == list(mesh.ep_ranks)
    assert dist.get_process_group_ranks(mesh.edp_group) == list(mesh.edp_ranks)
    assert mesh.ep_ranks[mesh.ep_index] == rank and mesh.edp_ranks[mesh.edp_index] == rank
    assert timing.part_of(mesh.ep_group) == "ep_comm" and timing.part_of(mesh.edp_group) == "dp_comm"


MESHES = {"dp4_ep4": (4, 1, 4), "dp4_ep2": (4, 1, 2), "dp2_tp2_ep2": (2, 2, 2)}


def _dispatch_cases(rank: int, world: int, verdicts: dict) -> None:
    for name, (dp, tp, ep) in MESHES.items():
        setup_mesh(1, dp, tp, ep=ep)
        for case, fn in (
            ("groups", lambda: _check_groups(rank)),
            ("dropless", lambda: _check_layer(rank, None)),
            ("capacity", lambda: _check_layer(rank, 0.6)),
            ("one_sided", lambda: _check_layer(rank, None, skew=True)),
        ):
            try:
                fn()
                verdicts[f"{name}/{case}"] = "ok"
            except Exception:  # recorded per case so one failure does not hide the others
                verdicts[f"{name}/{case}"] = traceback.format_exc()


def _worker(rank, world, out_dir):
    verdicts: dict[str, str] = {}
    _dispatch_cases(rank, world, verdicts)
    moe_engine_checks.run_all(rank, world, verdicts, out_dir)
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(verdicts, f)


CASES = [f"{m}/{c}" for m in MESHES for c in ("groups", "dropless", "capacity", "one_sided")] + moe_engine_checks.CASES


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe")
    launch_local(_worker, WORLD, args=(str(out),), timeout_s=240, collective_timeout_s=60)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.dist
@pytest.mark.parametrize("case", CASES)
def test_moe_on_four_ranks(verdicts, case):
    for rank, v in enumerate(verdicts):
        assert v.get(case) == "ok", f"rank {rank}, case {case}:\n{v.get(case)}"


# ---------------------------------------------------------------------- one process


def test_one_process_returns_the_rows_themselves():
    set_mesh(Mesh(1, 1, 1))
    rows = torch.randn(5, 3)
    local, offs, routing = dispatch(rows, torch.tensor([2.0, 0.0, 3.0]), 3)
    assert local is rows and offs.dtype == torch.int32 and offs.tolist() == [2, 2, 5]
    assert combine(local, routing) is local


def test_one_process_capacity_drops_rows_past_it_and_combine_zeros_them():
    set_mesh(Mesh(1, 1, 1))
    LOAD.reset()
    rows = torch.arange(14.0).view(7, 2).requires_grad_(True)
    # 7 rows over 2 experts at factor 0.5: ceil(0.5 * 7 / 2) = 2 rows each; expert 0 has 5, expert 1 has 2
    local, offs, routing = dispatch(rows, torch.tensor([5, 2]), 2, capacity_factor=0.5)
    assert local.tolist() == [[0, 1], [2, 3], [10, 11], [12, 13]] and offs.tolist() == [2, 4]
    back = combine(local * 10, routing)
    assert back[:2].tolist() == [[0, 10], [20, 30]] and back[2:5].abs().sum() == 0 and back[5, 0] == 100
    back.sum().backward()
    assert rows.grad[:, 0].tolist() == [10, 10, 0, 0, 0, 10, 10]
    assert LOAD.tokens_dropped == 3 and LOAD.per_expert == {2: [5, 2]}


def test_counts_that_do_not_match_the_rows_are_refused():
    set_mesh(Mesh(1, 1, 1))
    with pytest.raises(ValueError, match=r"do not add up to the 4 rows"):
        dispatch(torch.zeros(4, 2), torch.tensor([1.0, 2.0]), 2)
    with pytest.raises(ValueError, match=r"3 expert counts for 2 experts"):
        dispatch(torch.zeros(3, 2), torch.tensor([1, 1, 1]), 2)
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        dispatch(torch.zeros(2, 2), torch.tensor([1, 1]), 2, capacity_factor=0.0)


def test_expert_slice():
    assert expert_slice(8, 4, 3) == slice(6, 8) and expert_slice(8, 1, 0) == slice(0, 8)
    with pytest.raises(ValueError, match="cannot be split evenly"):
        expert_slice(6, 4, 0)


def test_mesh_refuses_ep_not_dividing_dp():
    with pytest.raises(ValueError, match="ep=3 must divide dp=4"):
        setup_mesh(1, 4, 1, ep=3)


def test_accumulator_sums_calls_and_expert_load_is_max_over_mean():
    LOAD.reset()
    LOAD.record([3, 1, 0, 0], dropped=1)
    LOAD.record([1, 1, 2, 0], dropped=0)
    LOAD.record([1, 1], dropped=2)  # a layer with another expert count is kept apart
    assert LOAD.per_expert == {4: [4, 2, 2, 0], 2: [1, 1]} and LOAD.tokens_dropped == 3 and LOAD.calls == 3
    # counts 4 2 2 0 1 1: max 4, mean 10 / 6
    assert expert_load(LOAD.per_expert) == pytest.approx(4 / (10 / 6))
    assert reduce_over(LOAD, [4, 2]) == (3, pytest.approx(2.4))
    assert reduce_over(LOAD, [4, 2], counted=False) == (0, None)  # nothing dispatched anywhere
    assert expert_load({4: [5, 5, 5, 5]}) == 1.0 and expert_load({}) == 1.0
    LOAD.reset()
    assert not LOAD.active and LOAD.per_expert == {} and LOAD.tokens_dropped == 0


def test_a_forward_recomputed_in_backward_is_not_counted_again():
    LOAD.reset()
    x = torch.ones(2, requires_grad=True)

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, g):
            LOAD.record([1, 1], dropped=1)  # what a checkpointed layer's recomputation would do
            return g * 2

    LOAD.record([1, 1], dropped=0)
    Probe.apply(x).sum().backward()
    assert LOAD.calls == 1 and LOAD.tokens_dropped == 0


def test_all_to_all_bytes_counts_every_chunk_but_the_own():
    # variable splits (the expert dispatch); balanced it is the ring convention's (n-1)/n
    assert all_to_all_bytes([200, 200, 200, 200], 1) == 600 == ring_bytes("all_to_all", 800, 4)
    assert all_to_all_bytes([0, 96, 8], 2) == 96 and all_to_all_bytes([5], 0) == 0
    with pytest.raises(ValueError, match="outside a group of 2"):
        all_to_all_bytes([1, 1], 2)
