"""runtime.tensor_parallel's sequence-parallel functions: the adjoint pair ``all_gather_seq`` /
``reduce_scatter_seq`` and the layers that use it, on 2 gloo ranks against single-process math
(values, gradients, byte counts), plus their single-process behaviour; and the overlapped parallel
linears (``runtime.tensor_parallel.overlapped``) with and without sequence parallelism, overlap on
and off, against the same math and each other's byte counts."""

from __future__ import annotations

import json
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from runtime.distributed import comm
from runtime.distributed.launch import launch_local
from runtime.distributed.mesh import setup_mesh
from runtime.pipeline.backward_split import backward_input, backward_weight
from runtime.tensor_parallel import (
    EAGER_ONLY,
    all_gather_seq,
    column_parallel_linear,
    column_parallel_linears,
    copy_to_tp,
    linear_reduce_scatter_seq,
    overlap_enabled,
    reduce_scatter_seq,
    row_parallel_linear,
    set_overlap,
    shard_dim,
    shard_vocab,
    sharded_dropout,
    vocab_parallel_embedding,
    vocab_range,
)

TP, F32 = 2, 4


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _all(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``t``, outside runtime.distributed.comm so the byte counter is untouched."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


def test_single_process_is_the_identity():
    x = torch.randn(2, 4, 3)
    assert all_gather_seq(x, 1) is x and reduce_scatter_seq(x, 1) is x
    assert {"all_gather_seq", "reduce_scatter_seq"} <= set(EAGER_ONLY)


def _check_adjoint_pair(rank, world):
    """Each rank holds different data; forward values, gradients and the adjoint identity
    <AG(x), y> = <x, RS(y)> summed over the ranks, for dims 0, 1 and -1."""
    torch.manual_seed(10 + rank)  # rank-specific data: a wrong chunk or a missing sum shows
    for dim in (0, 1, -1):
        x = _leaf(torch.randn(2, 3, 4))  # this rank's positions
        dy = torch.randn(*[n * world if k == dim % 3 else n for k, n in enumerate((2, 3, 4))])
        comm.STATS.reset()
        y = all_gather_seq(x, dim)
        (y * dy).sum().backward()
        assert_close(y, torch.cat(_all(x.detach()), dim))
        assert_close(x.grad, sum(_all(dy)).chunk(world, dim)[rank])
        full = dy.numel() * F32
        assert dict(comm.STATS.calls_by_kind) == {"all_gather": 1, "reduce_scatter": 1}
        assert comm.STATS.total == 2 * (world - 1) / world * full

        z = _leaf(dy)  # a full-length partial sum per rank
        g = torch.randn_like(x)
        out = reduce_scatter_seq(z, dim)
        (out * g).sum().backward()
        assert_close(out, sum(_all(dy)).chunk(world, dim)[rank])
        assert_close(z.grad, torch.cat(_all(g), dim))
        lhs = (y.detach() * dy).sum()  # <AG(x), dy> on this rank
        rhs = (x.detach() * out.detach()).sum()  # <x, RS(dy)> on this rank
        assert_close(sum(_all(lhs.reshape(1))), sum(_all(rhs.reshape(1))))


def _check_sp_mlp(rank, world):
    """Column (gathers the positions) -> gelu -> row (reduce-scatters them), bias and LayerNorm
    weight used on sequence shards through copy_to_tp: equal to one process."""
    torch.manual_seed(0)
    s, h, f = 6, 8, 16
    x, ln_w = torch.randn(2, s, h), torch.randn(h)
    w1, b1, w2, b2, c = torch.randn(f, h), torch.randn(f), torch.randn(h, f), torch.randn(h), torch.randn(2, s, h)
    ref = [_leaf(t) for t in (x, ln_w, w1, b1, w2, b2)]
    hid = F.layer_norm(ref[0], (h,), ref[1])
    y_ref = F.linear(F.gelu(F.linear(hid, ref[2], ref[3])), ref[4], ref[5])
    (y_ref * c).sum().backward()

    xs = _leaf(shard_dim(x, 1, rank, world))
    lw = _leaf(ln_w)
    w1s, b1s = _leaf(shard_dim(w1, 0, rank, world)), _leaf(shard_dim(b1, 0, rank, world))
    w2s, b2s = _leaf(shard_dim(w2, 1, rank, world)), _leaf(b2)
    comm.STATS.reset()
    hid = F.layer_norm(xs, (h,), copy_to_tp(lw))
    y = row_parallel_linear(F.gelu(column_parallel_linear(hid, w1s, b1s, sequence_dim=1)), w2s, b2s, sequence_dim=1)
    (y * c.chunk(world, 1)[rank]).sum().backward()
    assert_close(y, y_ref.chunk(world, 1)[rank])
    assert_close(xs.grad, ref[0].grad.chunk(world, 1)[rank])
    assert_close(lw.grad, ref[1].grad)
    assert_close(torch.cat(_all(w1s.grad), 0), ref[2].grad)
    assert_close(torch.cat(_all(b1s.grad), 0), ref[3].grad)
    assert_close(torch.cat(_all(w2s.grad), 1), ref[4].grad)
    assert_close(b2s.grad, ref[5].grad)
    # the all-reduce pair of plain tp became all-gather + reduce-scatter (each way), and the column
    # linear's backward gathers its saved positions again (Megatron's extra all-gather); the
    # LayerNorm weight and the row-parallel bias have their gradients all-reduced
    assert dict(comm.STATS.calls_by_kind) == {"all_gather": 3, "reduce_scatter": 2, "all_reduce": 2}
    full = 2 * s * h * F32  # each gathered or scattered [2, s, h] tensor, whole
    assert comm.STATS.bytes_by_kind["all_gather"] == 3 * (world - 1) / world * full
    assert comm.STATS.bytes_by_kind["reduce_scatter"] == 2 * (world - 1) / world * full


def _check_sp_embedding(rank, world):
    """The vocabulary-parallel embedding reduce-scatters along the sequence (vocab 11, padded)."""
    vocab, dim = 11, 6
    torch.manual_seed(2)
    table = torch.randn(vocab, dim)
    ids = torch.tensor([[0, 5, 6, 10, 3, 7], [1, 2, 4, 8, 10, 6]])
    c = torch.randn(2, 6, dim)
    ref = _leaf(table)
    (F.embedding(ids, ref) * c).sum().backward()
    start, _ = vocab_range(vocab, rank, world)
    w = _leaf(shard_vocab(table, rank, world))
    out = vocab_parallel_embedding(ids, w, start, sequence_dim=1)
    (out * c.chunk(world, 1)[rank]).sum().backward()
    assert_close(out, F.embedding(ids, table).chunk(world, 1)[rank])
    assert_close(torch.cat(_all(w.grad), 0)[:vocab], ref.grad)


def _check_sharded_dropout(rank, world):
    """Each rank's mask is its block of the one mask drawn for the whole tensor: the ranks' masks
    differ (plain dropout would repeat one), a re-draw under the same stream state repeats it (a
    checkpoint's recompute), and the gradient is the mask's."""
    p = 0.5
    for dim in (1, 2):
        torch.manual_seed(7)  # the stream every tp rank shares
        state = torch.get_rng_state()
        x = _leaf(torch.ones(2, 8, 6))
        y = sharded_dropout(x, p, True, dim)
        torch.set_rng_state(state)
        full_shape = [2, 8, 6]
        full_shape[dim] *= world
        want = torch.empty(full_shape).bernoulli_(1 - p).narrow(dim, rank * x.shape[dim], x.shape[dim]) / (1 - p)
        assert_close(y, want)
        torch.set_rng_state(state)
        assert_close(sharded_dropout(x, p, True, dim), y)  # recompute draws it again
        masks = _all((y != 0).to(torch.float32))
        assert not torch.equal(masks[0], masks[1])
        y.backward(torch.ones_like(y))
        assert_close(x.grad, want)
    assert sharded_dropout(x, p, False, 1) is x and sharded_dropout(x, 0.0, True, 1) is x


def _overlap_reference(x, params, c):
    """One process: four linears of ``x`` (the fourth unused), mixed, then a linear; the loss and the leaves."""
    leaves = [_leaf(x)] + [None if t is None else _leaf(t) for t in params]
    xr, wq, bq, wk, wv, bv, wu, bu, w2, b2 = leaves
    q, k, v = F.linear(xr, wq, bq), F.linear(xr, wk), F.linear(xr, wv, bv)
    F.linear(xr, wu, bu)  # no gradient reaches it
    y = F.linear(F.gelu(q) * k + v, w2, b2)
    (y * c).sum().backward()
    return y, leaves


def _overlap_run(rank, world, x, params, c, seq, split=False):
    """The same on this rank's shards: ``column_parallel_linears`` then ``row_parallel_linear``
    (``seq``: sequence parallel along that dim); the output, the leaves and the bytes counted.
    ``split``: backward as a zero-bubble schedule runs it, ``B`` (the input's gradient, left in its
    ``.grad`` here) then ``W`` (the weights')."""
    wq, bq, wk, wv, bv, wu, bu, w2, b2 = params
    local = [shard_dim(t, 0, rank, world) for t in (wq, bq, wk, wv, bv, wu, bu)] + [shard_dim(w2, 1, rank, world), b2]
    leaves = [_leaf(x if seq is None else shard_dim(x, seq, rank, world))] + [_leaf(t) for t in local]
    xs, wq_s, bq_s, wk_s, wv_s, bv_s, wu_s, bu_s, w2_s, b2_s = leaves
    comm.STATS.reset()
    q, k, v, _ = column_parallel_linears(xs, [wq_s, wk_s, wv_s, wu_s], [bq_s, None, bv_s, bu_s], sequence_dim=seq)
    y = row_parallel_linear(F.gelu(q) * k + v, w2_s, b2_s, sequence_dim=seq)
    dy = c if seq is None else shard_dim(c, seq, rank, world)
    if split:
        (xs.grad,), work = backward_input([y], [dy], [xs])
        assert getattr(q.grad_fn, "gathered", None) is None  # B gathers nothing for W to keep
        before = comm.STATS.calls_by_kind.get("all_gather", 0)
        backward_weight(work)
        # W gathers the column input's positions itself (SP): one all-gather, the input saved as a shard
        assert comm.STATS.calls_by_kind.get("all_gather", 0) - before == (seq is not None and overlap_enabled())
    else:
        y.backward(dy)
    return y, leaves, dict(comm.STATS.bytes_by_kind)


def _check_overlap_equivalence(rank, world):
    """Overlap on and off, and on with a split backward (zero-bubble's ``B`` then ``W``), plain tp
    and sequence parallel along dim 1 or 0, sequences cut in pieces (8 positions: 2 pieces a rank)
    or not (6): the values and gradients of one process, and the bytes counted with overlap on
    (split or not) exactly those counted with it off: nothing is computed or sent twice. In float64:
    the pieces sum in another order than one matmul does, and float32 rounding of that order is not
    what is under test."""
    h, f = 8, 16

    def randn(*shape):
        return torch.randn(*shape, dtype=torch.float64)

    for s in (8, 6):
        for seq in (None, 1, 0):
            torch.manual_seed(s)
            shape = (s, 2, h) if seq == 0 else (2, s, h)
            x, c = randn(*shape), randn(*shape)
            params = [randn(f, h), randn(f), randn(f, h), randn(f, h), randn(f)]
            params += [randn(f, h), randn(f), randn(h, f), randn(h)]
            y_ref, ref = _overlap_reference(x, params, c)
            counted = {}
            for on, split in ((False, False), (True, False), (True, True)):
                set_overlap(on)
                y, got, counted[on, split] = _overlap_run(rank, world, x, params, c, seq, split)
                assert_close(y, y_ref if seq is None else shard_dim(y_ref, seq, rank, world))
                want_dx = ref[0].grad if seq is None else shard_dim(ref[0].grad, seq, rank, world)
                assert_close(got[0].grad, want_dx)
                for i in range(1, 8):  # column shards: output features; the unused linear gets none
                    if ref[i].grad is None:
                        assert got[i].grad is None
                        continue
                    assert_close(torch.cat(_all(got[i].grad), 0), ref[i].grad)
                assert_close(torch.cat(_all(got[8].grad), 1), ref[8].grad)
                assert_close(got[9].grad, ref[9].grad)
            set_overlap(True)
            off = counted[False, False]
            assert counted[True, False] == off and counted[True, True] == off and off["all_reduce"] > 0
            assert ("all_gather" in off) == (seq is not None)


def _check_overlap_pieces(rank, world):
    """The pieces each overlapped collective is cut into: 2 (the tp degree) when it divides a
    rank's positions, else 1; a frozen input communicates nothing backward, as without overlap."""
    torch.manual_seed(4)
    assert overlap_enabled()
    x, w = torch.randn(2, 8, 6), _leaf(torch.randn(4, 6))
    for seq, pieces in ((8, 2), (6, 1)):
        comm.STATS.reset()
        y = column_parallel_linears(_leaf(x[:, :seq]).narrow(1, 0, seq // world), [w], sequence_dim=1)[0]
        assert dict(comm.STATS.calls_by_kind) == {"all_gather": pieces}
        z = linear_reduce_scatter_seq(y, _leaf(torch.randn(3, 4)), 1)
        assert dict(comm.STATS.calls_by_kind) == {"all_gather": pieces, "reduce_scatter": pieces}
        z.sum().backward()  # + the gathered gradient's pieces, the input's re-gather, dx's reduce-scatter
        assert dict(comm.STATS.calls_by_kind) == {"all_gather": 2 * pieces + 1, "reduce_scatter": pieces + 1}
    counted = []
    for on in (True, False):
        set_overlap(on)
        comm.STATS.reset()
        column_parallel_linears(x, [w])[0].sum().backward()  # x requires no grad: nothing to all-reduce
        counted.append(dict(comm.STATS.calls_by_kind))
    set_overlap(True)
    assert counted == [{}, {}]
    with pytest.raises(ValueError, match="2 weights but 1 biases"):
        column_parallel_linears(x, [w, w], [None])


class _AddedByGemm(TorchDispatchMode):
    """Records the storage each in-place ``addmm_`` writes (a GEMM that accumulates)."""

    def __init__(self):
        super().__init__()
        self.pointers: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.addmm_.default:
            self.pointers.add(args[0].data_ptr())
        return func(*args, **(kwargs or {}))


def _check_fused_accumulation(rank, world):
    """A weight that already has a gradient buffer (the ZeRO engine's flat-buffer views) gets its
    weight gradient added by the GEMM into that buffer, which stays its ``.grad`` (same storage),
    in a plain backward and in a split one (``B`` writes nothing there, ``W`` does); the values are
    the buffer's plus one process's gradient. A weight used twice (tied) gets both terms."""
    h, f = 8, 16

    def randn(*shape):
        return torch.randn(*shape, dtype=torch.float64)

    for seq, split in ((None, False), (1, False), (1, True), (None, True)):
        torch.manual_seed(7)
        x, c = randn(2, 8, h), randn(2, 8, h)
        w1, w2 = randn(f, h), randn(h, f)
        ref = [_leaf(w1), _leaf(w2)]
        (F.linear(F.gelu(F.linear(x, ref[0])), ref[1]) * c).sum().backward()
        local = [_leaf(shard_dim(w1, 0, rank, world)), _leaf(shard_dim(w2, 1, rank, world))]
        flat = randn(sum(t.numel() for t in local))
        start = flat.clone()
        spans, at = [], 0  # (no reference to the views kept: autograd takes a buffer no one else holds)
        for leaf in local:
            leaf.grad = flat[at : at + leaf.numel()].view(leaf.shape)
            spans.append((at, leaf.grad.data_ptr()))
            at += leaf.numel()
        xs = _leaf(x if seq is None else shard_dim(x, seq, rank, world))
        hidden = column_parallel_linears(xs, [local[0]], sequence_dim=seq)[0]
        y = row_parallel_linear(F.gelu(hidden), local[1], sequence_dim=seq)
        dy = c if seq is None else shard_dim(c, seq, rank, world)
        with _AddedByGemm() as added:
            if split:
                _, work = backward_input([y], [dy], [xs])
                assert_close(flat, start)  # B computes no weight gradient into the buffers
                backward_weight(work)
            else:
                y.backward(dy)
        fused = [True, seq is not None]  # the row-parallel product without SP is F.linear's
        for leaf, (at, pointer), whole, dim, one in zip(local, spans, ref, (0, 1), fused):
            assert leaf.grad.data_ptr() == pointer  # in the buffer either way (autograd adds in place)
            assert (pointer in added.pointers) == one, (seq, split, dim)
            want = shard_dim(whole.grad, dim, rank, world) + start[at : at + leaf.numel()].view(leaf.shape)
            assert_close(leaf.grad, want)
    tied = _leaf(randn(f, h))
    tied.grad = torch.zeros(f, h, dtype=torch.float64)
    x = randn(3, h)
    a, b = column_parallel_linears(x, [tied])[0], column_parallel_linears(x, [tied])[0]
    (a.sum() + 2 * b.sum()).backward()
    assert_close(tied.grad, 3 * torch.ones(3, f, dtype=torch.float64).t() @ x)
    hooked, seen = _leaf(randn(f, h)), []  # a gradient hook sees this backward's gradient, not the sum
    hooked.grad = torch.ones(f, h, dtype=torch.float64)
    hooked.register_hook(lambda grad: seen.append(grad.clone()))
    column_parallel_linears(x, [hooked])[0].sum().backward()
    fresh = torch.ones(3, f, dtype=torch.float64).t() @ x
    assert_close(seen[0], fresh)
    assert_close(hooked.grad, 1 + fresh)


CHECKS = {
    "adjoint_pair": _check_adjoint_pair,
    "sp_mlp": _check_sp_mlp,
    "sp_embedding": _check_sp_embedding,
    "sharded_dropout": _check_sharded_dropout,
    "overlap_equivalence": _check_overlap_equivalence,
    "overlap_pieces": _check_overlap_pieces,
    "fused_accumulation": _check_fused_accumulation,
}


def _worker(rank, world, out_dir):
    setup_mesh(1, 1, world)
    verdicts = {}
    for name, fn in CHECKS.items():
        try:
            fn(rank, world)
            verdicts[name] = "ok"
        except Exception:  # recorded per check so one failure does not hide the others
            verdicts[name] = traceback.format_exc()
        finally:
            set_overlap(True)  # the default, whatever a failed check left
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(verdicts, f)


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp")
    launch_local(_worker, TP, args=(str(out),), timeout_s=120, collective_timeout_s=60)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(TP)]


@pytest.mark.dist
@pytest.mark.parametrize("check", list(CHECKS))
def test_sp_functions_match_single_process(verdicts, check):
    for rank, v in enumerate(verdicts):
        assert v[check] == "ok", f"rank {rank}, check {check}:\n{v[check]}"
