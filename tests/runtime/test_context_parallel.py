"""runtime.context_parallel: the balanced sequence layout, block attention merged by log-sum-exp,
and the three methods (ring, all-gather, Ulysses) on 2 and 4 gloo ranks against single-process
attention (torch's SDPA with an explicit mask): outputs and the gradients of queries, keys and
values, for causal, sliding-window and full masks with grouped-query heads, and the ring's bytes.
The same launch checks the mesh's cp and dp_cp groups (``setup_mesh(cp=)``) and the entry points
compiled stages call (``positions``, ``targets``, ``sequence_mean``, ``attention``) over them."""

from __future__ import annotations

import json
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from runtime import context_parallel as cpr
from runtime import timing
from runtime.context_parallel import (
    METHODS,
    AttentionMask,
    blocks,
    context_attention,
    gather_sequence,
    local_positions,
    shard_sequence,
)
from runtime.context_parallel.blocks import Span, _coverage, block_forward, merge
from runtime.distributed import comm
from runtime.distributed.launch import launch_local
from runtime.distributed.mesh import Mesh, set_mesh, setup_mesh
from runtime.sparse_attention import BlockSparseLayout

MASKS = {
    "causal": AttentionMask(),
    "sliding": AttentionMask(window=5),
    "full": AttentionMask(causal=False),
    # 12 blocks of 2 positions: each query sees its block and the one before, and block 0
    "block-sparse": AttentionMask(layout=BlockSparseLayout(block=2, local_blocks=2, global_blocks=1)),
}


def reference(q, k, v, mask: AttentionMask):
    """Single-process attention by torch's SDPA over the whole sequence (key/value heads repeated)."""
    positions = torch.arange(q.shape[2])
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.visible(positions, positions))


@settings(max_examples=40, deadline=None)
@given(cp=st.integers(1, 6), chunk=st.integers(1, 5))
def test_every_rank_holds_the_same_causal_work_and_the_layout_inverts(cp, chunk):
    """Rank i's chunks i and 2cp-1-i keep exactly c^2 (2cp - 1) + c (c + 1) causal pairs, the same on
    every rank; the ranks' positions partition the sequence; gather undoes shard."""
    seq = 2 * cp * chunk
    pairs = [int((local_positions(seq, r, cp) + 1).sum()) for r in range(cp)]
    assert pairs == [chunk * chunk * (2 * cp - 1) + chunk * (chunk + 1)] * cp
    assert sorted(torch.cat([local_positions(seq, r, cp) for r in range(cp)]).tolist()) == list(range(seq))
    x = torch.randn(2, seq, 3)
    parts = [shard_sequence(x, 1, r, cp) for r in range(cp)]
    assert all(torch.equal(p, x[:, local_positions(seq, r, cp)]) for r, p in enumerate(parts))
    assert torch.equal(gather_sequence(parts, 1), x)


def test_a_length_the_chunks_do_not_divide_is_refused():
    with pytest.raises(ValueError, match="seq_len 10 is not a multiple of 4"):
        local_positions(10, 0, 2)


@settings(max_examples=200, deadline=None)
@given(
    causal=st.booleans(),
    window=st.one_of(st.none(), st.integers(1, 9)),
    spans=st.tuples(st.integers(0, 12), st.integers(1, 5), st.integers(0, 12), st.integers(1, 5)),
    layout=st.one_of(st.none(), st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(0, 2))),
)
def test_block_coverage_matches_the_mask_pair_by_pair(causal, window, spans, layout):
    """A block is skipped only when the mask keeps none of its pairs and left unmasked only when
    it keeps all (a block-sparse layout's blocks are masked whenever not skipped, and skipped only
    when they keep nothing)."""
    if layout is not None and not causal:
        with pytest.raises(ValueError, match="block-sparse layout is causal"):
            AttentionMask(causal, window, BlockSparseLayout(*layout))
        return
    mask = AttentionMask(causal, window, BlockSparseLayout(*layout) if layout else None)
    queries, keys = Span(spans[0], spans[1]), Span(spans[2], spans[3])
    seen = mask.visible(queries.positions("cpu"), keys.positions("cpu"))
    cover = _coverage(mask, queries, keys)
    if layout is None:
        assert cover == ("all" if bool(seen.all()) else "none" if not bool(seen.any()) else "some")
    else:  # skipped only when nothing is visible; masked otherwise
        assert cover in ("none", "some") and (cover == "some" or not bool(seen.any()))


@pytest.mark.parametrize("mask", list(MASKS), ids=list(MASKS))
def test_blocks_merged_by_log_sum_exp_equal_whole_attention(mask):
    """Keys cut into three blocks, each attended separately and merged, give the whole attention."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 9, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    acc = None
    for start, length in ((0, 3), (3, 4), (7, 2)):
        keys = Span(start, length)
        part = block_forward(
            q, k[:, :, start : start + length], v[:, :, start : start + length], MASKS[mask], Span(0, 9), keys, 8**-0.5
        )
        acc = merge(acc, part)
    assert_close(acc[0], reference(q, k, v, MASKS[mask]))


@pytest.mark.parametrize("mask", list(MASKS), ids=list(MASKS))
@pytest.mark.parametrize("tile", [1, 3, 5])
def test_tiled_attention_keeps_the_math_and_no_score_matrix(mask, tile, monkeypatch):
    """Tiles of a few queries by a few keys (``blocks.TILE``) give whole attention and its
    gradients, and backward saves q, k, v, out and the log-sum-exp only, never a score matrix."""
    monkeypatch.setattr(blocks, "TILE", tile)
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 4, 13, 8), torch.randn(2, 2, 13, 8), torch.randn(2, 2, 13, 8)
    mine, ref = [t.clone().requires_grad_() for t in (q, k, v)], [t.clone().requires_grad_() for t in (q, k, v)]
    positions = torch.arange(13)
    saved: list[tuple] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        out = blocks.masked_attention(*mine, positions, positions, MASKS[mask], 8**-0.5)
    assert (13, 13) not in {shape[-2:] for shape in saved}
    expected = reference(*ref, MASKS[mask])
    assert_close(out, expected)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    for got, want in zip(mine, ref):
        assert_close(got.grad, want.grad)


@pytest.mark.parametrize("method", METHODS)
def test_one_rank_is_plain_attention(method):
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 4, 12, 8, requires_grad=True) for _ in range(3))
    out = context_attention(q, k, v, method=method, mask=MASKS["causal"])
    assert_close(out, reference(q, k, v, MASKS["causal"]))


def test_unknown_method_and_uneven_heads_are_refused():
    q, k = torch.randn(1, 4, 8, 8), torch.randn(1, 3, 8, 8)
    with pytest.raises(ValueError, match="unknown context-parallel method 'zigzag'"):
        context_attention(q, q, q, method="zigzag", mask=AttentionMask())
    with pytest.raises(ValueError, match="4 query heads cannot share 3 key/value heads"):
        context_attention(q, k, k, method="ring", mask=AttentionMask())


# ------------------------------------------------------------------------------------------------
# On gloo ranks: one launch of 4 ranks checks cp 4 over the world and cp 2 over two pairs.
# ------------------------------------------------------------------------------------------------

SEQ, HEADS, KV_HEADS, DIM = 24, 8, 4, 8


def _case(method: str, mask: str, group, cp: int, index: int) -> None:
    torch.manual_seed(7)  # the same full tensors on every rank
    q, k, v = torch.randn(2, HEADS, SEQ, DIM), torch.randn(2, KV_HEADS, SEQ, DIM), torch.randn(2, KV_HEADS, SEQ, DIM)
    dout = torch.randn(2, HEADS, SEQ, DIM)
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    expected = reference(*full, MASKS[mask])
    (expected * dout).sum().backward()
    local = [shard_sequence(t, 2, index, cp).requires_grad_(True) for t in (q, k, v)]
    comm.STATS.reset()
    out = context_attention(*local, method=method, mask=MASKS[mask], group=group)
    (out * shard_sequence(dout, 2, index, cp)).sum().backward()
    assert_close(out, shard_sequence(expected.detach(), 2, index, cp))
    for mine, whole in zip(local, full):
        assert_close(mine.grad, shard_sequence(whole.grad, 2, index, cp))
    if method == "ring":  # forward: cp - 1 key/value blocks; backward: as many, plus cp gradient blocks
        block = 2 * 2 * KV_HEADS * (SEQ // cp) * DIM * 4
        assert comm.STATS.total == (cp - 1) * block * 2 + cp * block


def _worker(rank: int, world: int, out_dir: str) -> None:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    groups = {4: (None, rank), 2: (pairs[rank // 2], rank % 2)}
    verdicts = {}
    for cp, (group, index) in groups.items():
        for method in METHODS:
            for mask in MASKS:
                name = f"cp{cp}-{method}-{mask}"
                try:
                    _case(method, mask, group if cp == 2 else dist.group.WORLD, cp, index)
                    verdicts[name] = "ok"
                except Exception:  # noqa: BLE001 -- reported per case to the test process
                    verdicts[name] = traceback.format_exc()
    for name, check in MESH_CASES.items():
        try:
            check(rank)
            verdicts[name] = "ok"
        except Exception:  # noqa: BLE001 -- reported per case to the test process
            verdicts[name] = traceback.format_exc()
    set_mesh(Mesh(1, 1, 1))
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(verdicts, f)


def _mesh_tp2_cp2(rank: int) -> None:
    """rank = cp_index * 2 + tp_index: a cp group is the ranks tp apart, and (dp 1) the dp_cp group."""
    mesh = setup_mesh(1, 1, 2, cp=2)
    t, c = rank % 2, rank // 2
    assert (mesh.cp, mesh.cp_index, mesh.tp_index, mesh.dp_index, mesh.pp_index) == (2, c, t, 0, 0)
    assert mesh.cp_ranks == (t, 2 + t) and mesh.dp_cp_ranks == (t, 2 + t) and mesh.tp_ranks == (2 * c, 2 * c + 1)
    assert dist.get_process_group_ranks(mesh.cp_group) == [t, 2 + t]
    assert timing.part_of(mesh.cp_group) == "cp_comm" and timing.part_of(mesh.dp_cp_group) == "dp_comm"


def _mesh_dp2_cp2(rank: int) -> None:
    """rank = dp_index * 2 + cp_index: gradients are reduced over all four ranks."""
    mesh = setup_mesh(1, 2, 1, cp=2)
    assert (mesh.cp_index, mesh.dp_index) == (rank % 2, rank // 2)
    assert mesh.cp_ranks == (rank - rank % 2, rank - rank % 2 + 1) and mesh.dp_ranks == (rank % 2, rank % 2 + 2)
    assert mesh.dp_cp_ranks == (0, 1, 2, 3) and dist.get_process_group_ranks(mesh.dp_cp_group) == [0, 1, 2, 3]
    assert mesh.world_size == 4


def _mesh_pp2_cp2(rank: int) -> None:
    mesh = setup_mesh(2, 1, 1, cp=2)
    assert (mesh.pp_index, mesh.cp_index) == (rank // 2, rank % 2)
    assert mesh.pp_ranks == (rank % 2, rank % 2 + 2) and mesh.cp_ranks == (rank - rank % 2, rank - rank % 2 + 1)


def _mesh_without_cp(rank: int) -> None:
    """cp 1: no cp group, and the dp_cp group is the dp group itself (the groups of before)."""
    mesh = setup_mesh(2, 2, 1)
    assert mesh.cp_group is None and mesh.dp_cp_group is mesh.dp_group and mesh.dp_cp_ranks == mesh.dp_ranks
    assert mesh.dp_ranks == (rank - rank % 2, rank - rank % 2 + 1) and mesh.pp_ranks == (rank % 2, rank % 2 + 2)
    assert cpr.positions(4).tolist() == [0, 1, 2, 3]


def _entry_points(rank: int) -> None:
    """dp 2 x cp 2: positions, the shifted targets and the sequence mean of the loss (its value the
    whole sequence's mean; its gradient, times cp, this rank's part of the one-process gradient)."""
    mesh = setup_mesh(1, 2, 1, cp=2)
    index, n, vocab = mesh.cp_index, 6, 11
    assert cpr.positions(n).tolist() == local_positions(2 * n, index, 2).tolist() and cpr.full_length(n) == 12
    torch.manual_seed(5 + mesh.dp_index)  # each dp rank its own sequences, the same on its cp pair
    labels = torch.randint(0, vocab, (2, 2 * n))
    logits = torch.randn(2, 2 * n, vocab, requires_grad=True)
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    expected.backward()
    local = shard_sequence(logits.detach(), 1, index, 2).requires_grad_(True)
    targets = cpr.targets(shard_sequence(labels, 1, index, 2), shift=True)
    assert_close(targets, shard_sequence(torch.cat([labels[:, 1:], torch.full((2, 1), -100)], 1), 1, index, 2))
    loss = cpr.sequence_mean(F.cross_entropy(local.flatten(0, 1), targets.flatten()), targets.flatten())
    loss.backward()
    assert_close(loss, expected)
    assert_close(local.grad / 2, shard_sequence(logits.grad, 1, index, 2))
    torch.manual_seed(9)
    q, k, v = torch.randn(1, 4, 2 * n, 8), torch.randn(1, 2, 2 * n, 8), torch.randn(1, 2, 2 * n, 8)
    whole = reference(q, k, v, AttentionMask(window=4))
    for method in METHODS:
        cpr.set_method(method)
        out = cpr.attention(*(shard_sequence(t, 2, index, 2) for t in (q, k, v)), causal=True, window=4)
        assert_close(out, shard_sequence(whole, 2, index, 2))
    cpr.set_method("ring")


MESH_CASES = {
    "mesh-tp2-cp2": _mesh_tp2_cp2,
    "mesh-dp2-cp2": _mesh_dp2_cp2,
    "mesh-pp2-cp2": _mesh_pp2_cp2,
    "mesh-without-cp": _mesh_without_cp,
    "entry-points-dp2-cp2": _entry_points,
}


CASES = [f"cp{cp}-{method}-{mask}" for cp in (4, 2) for method in METHODS for mask in MASKS] + list(MESH_CASES)


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp")
    launch_local(_worker, 4, args=(str(out),), timeout_s=180, collective_timeout_s=60)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.dist
@pytest.mark.parametrize("case", CASES)
def test_context_parallel_attention_matches_one_process(verdicts, case):
    for rank, v in enumerate(verdicts):
        assert v[case] == "ok", f"rank {rank}, {case}:\n{v[case]}"
