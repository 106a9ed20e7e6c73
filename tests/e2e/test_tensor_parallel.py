"""Tensor parallelism: tp=2 over gloo against a single-process reference."""

from __future__ import annotations

import gc
import json
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

from runtime.distributed import comm
from runtime.distributed.launch import launch_local
from runtime.distributed.mesh import setup_mesh
from runtime.tensor_parallel import (
    ColumnParallelLinear,
    ParallelLMHeadLoss,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel_linear,
    gather_from_tp,
    row_parallel_linear,
    scatter_to_tp,
    shard_dim,
    shard_heads,
    shard_vocab,
    tp_world_size,
    vocab_parallel_cross_entropy,
    vocab_range,
)
from runtime.training.memtrack import MemoryTracker

TP = 2
F32 = 4


def _gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Re-assemble shards for checking, outside runtime.distributed.comm so the byte counter is untouched."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=dim)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _check_mlp(rank, world):
    """Column (fc1) -> gelu -> row (fc2), default group from the mesh."""
    torch.manual_seed(0)
    x, w1, b1 = torch.randn(2, 3, 8), torch.randn(16, 8), torch.randn(16)
    w2, b2, c = torch.randn(8, 16), torch.randn(8), torch.randn(2, 3, 8)
    ref = [_leaf(t) for t in (x, w1, b1, w2, b2)]
    y_ref = F.linear(F.gelu(F.linear(ref[0], ref[1], ref[2])), ref[3], ref[4])
    (y_ref * c).sum().backward()

    xs = _leaf(x)
    w1s, b1s = _leaf(shard_dim(w1, 0, rank, world)), _leaf(shard_dim(b1, 0, rank, world))
    w2s, b2s = _leaf(shard_dim(w2, 1, rank, world)), _leaf(b2)
    comm.STATS.reset()
    y = row_parallel_linear(F.gelu(column_parallel_linear(xs, w1s, b1s)), w2s, b2s)
    (y * c).sum().backward()
    # One all-reduce of [2, 3, 8] fp32 forward (fc2) and one backward (input gradient of fc1).
    assert comm.STATS.calls_by_kind == {"all_reduce": 2}, comm.STATS.calls_by_kind
    assert comm.STATS.total == 2 * comm.ring_bytes("all_reduce", 2 * 3 * 8 * F32, world)
    assert comm.STATS.total == 2 * 2 * (world - 1) / world * 192
    assert_close(y, y_ref)
    assert_close(xs.grad, ref[0].grad)
    assert_close(_gather(w1s.grad, 0), ref[1].grad)
    assert_close(_gather(b1s.grad, 0), ref[2].grad)
    assert_close(_gather(w2s.grad, 1), ref[3].grad)
    assert_close(b2s.grad, ref[4].grad)


def _attention(x, wq, bq, wk, bk, wv, bv, wo, bo, heads, kv_heads, hd, group, parallel):
    """Causal self-attention over ``heads`` local query heads and ``kv_heads`` kv heads."""
    b, s, _ = x.shape
    if parallel:
        pairs = ((wq, bq), (wk, bk), (wv, bv))
        q, k, v = (column_parallel_linear(x, w, bb, group) for w, bb in pairs)
    else:
        q, k, v = F.linear(x, wq, bq), F.linear(x, wk, bk), F.linear(x, wv, bv)
    q = q.view(b, s, heads, hd).transpose(1, 2)
    k = k.view(b, s, kv_heads, hd).transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    v = v.view(b, s, kv_heads, hd).transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    a = a.transpose(1, 2).reshape(b, s, heads * hd)
    if parallel:
        return row_parallel_linear(a, wo, bo, group)
    return F.linear(a, wo, bo)


def _check_attention(rank, world, kv_heads):
    """Attention split by heads, explicit group, with grouped-query attention when kv < heads."""
    heads, hd = 4, 3
    hidden = heads * hd
    torch.manual_seed(1 + kv_heads)
    x = torch.randn(2, 5, hidden)
    full = {
        "wq": torch.randn(heads * hd, hidden),
        "bq": torch.randn(heads * hd),
        "wk": torch.randn(kv_heads * hd, hidden),
        "bk": torch.randn(kv_heads * hd),
        "wv": torch.randn(kv_heads * hd, hidden),
        "bv": torch.randn(kv_heads * hd),
        "wo": torch.randn(hidden, heads * hd),
        "bo": torch.randn(hidden),
    }
    full = {k: v * hidden**-0.5 for k, v in full.items()}  # unit-scale activations
    c = torch.randn(2, 5, hidden)
    ref = {k: _leaf(v) for k, v in full.items()}
    xr = _leaf(x)
    y_ref = _attention(xr, *ref.values(), heads, kv_heads, hd, None, parallel=False)
    (y_ref * c).sum().backward()

    shard_spec = {  # name -> (head count, dim)
        "wq": (heads, 0),
        "bq": (heads, 0),
        "wk": (kv_heads, 0),
        "bk": (kv_heads, 0),
        "wv": (kv_heads, 0),
        "bv": (kv_heads, 0),
        "wo": (heads, 1),
    }
    loc = {k: _leaf(shard_heads(full[k], n, hd, rank, world, d)) for k, (n, d) in shard_spec.items()}
    loc["bo"] = _leaf(full["bo"])
    xs = _leaf(x)
    group = dist.group.WORLD
    y = _attention(xs, *loc.values(), heads // world, kv_heads // world, hd, group, parallel=True)
    (y * c).sum().backward()
    assert_close(y, y_ref)
    assert_close(xs.grad, xr.grad)
    for k, (_, d) in shard_spec.items():
        assert_close(_gather(loc[k].grad, d), ref[k].grad, msg=lambda m, k=k: f"{k}: {m}")
    assert_close(loc["bo"].grad, ref["bo"].grad)


def _check_embedding(rank, world):
    """Vocab 11 over 2 ranks: padded to 12, boundary ids on both sides of the split."""
    vocab, dim = 11, 6
    torch.manual_seed(2)
    emb = torch.nn.Embedding(vocab, dim)
    ids = torch.tensor([[0, 5, 6, 10, 3, 7, 9], [1, 2, 4, 8, 10, 6, 5]])
    c = torch.randn(2, 7, dim)
    (emb(ids) * c).sum().backward()

    pe = VocabParallelEmbedding.from_embedding(emb)
    assert (pe.vocab_start, pe.vocab_end) == (6 * rank, 6 * rank + 6)
    comm.STATS.reset()
    out = pe(ids)
    (out * c).sum().backward()
    assert comm.STATS.calls_by_kind == {"all_reduce": 1}
    assert comm.STATS.total == comm.ring_bytes("all_reduce", 2 * 7 * dim * F32, world)
    assert_close(out, emb(ids))
    g = _gather(pe.weight.grad, 0)
    assert_close(g[:vocab], emb.weight.grad)
    assert torch.all(g[vocab:] == 0), "padded rows must get no gradient"


def _check_cross_entropy(rank, world):
    """LM head + vocab-parallel CE vs. F.cross_entropy: loss, hidden and weight gradients."""
    vocab, hidden = 13, 8
    torch.manual_seed(3)
    h, w = torch.randn(3, 5, hidden), torch.randn(vocab, hidden)
    labels = torch.randint(0, vocab, (3, 5))
    labels[0, 1] = labels[2, 4] = -100
    labels[1, 0], labels[1, 1], labels[1, 2] = 0, 6, 12  # both shards and the last real id
    hr, wr = _leaf(h), _leaf(w)
    loss_ref = F.cross_entropy(F.linear(hr, wr).view(-1, vocab), labels.view(-1))
    loss_ref.backward()

    start, end = vocab_range(vocab, rank, world)
    hs, ws = _leaf(h), _leaf(shard_vocab(w, rank, world))
    comm.STATS.reset()
    logits = column_parallel_linear(hs, ws)
    assert logits.shape == (3, 5, end - start)
    loss = vocab_parallel_cross_entropy(logits, labels, start, vocab_size=vocab)
    loss.backward()
    # Forward: max, sum-exp and target all-reduces of [15] fp32; backward: dL/dh all-reduce.
    assert comm.STATS.calls_by_kind == {"all_reduce": 4}, comm.STATS.calls_by_kind
    expect = 3 * comm.ring_bytes("all_reduce", 15 * F32, world)
    expect += comm.ring_bytes("all_reduce", 15 * hidden * F32, world)
    assert comm.STATS.total == expect
    assert_close(loss, loss_ref)
    assert_close(hs.grad, hr.grad)
    g = _gather(ws.grad, 0)
    assert_close(g[:vocab], wr.grad)
    assert torch.all(g[vocab:] == 0)

    # The module wrapper (here with a bias, padded like the weight) gives the same.
    lin = torch.nn.Linear(hidden, vocab)
    lb_ref = F.cross_entropy(lin(h).view(-1, vocab), labels.view(-1))
    lb_ref.backward()
    head = ParallelLMHeadLoss.from_linear(lin)
    lb = head(h, labels)
    lb.backward()
    assert_close(lb, lb_ref)
    assert_close(_gather(head.weight.grad, 0)[:vocab], lin.weight.grad)
    assert_close(_gather(head.bias.grad, 0)[:vocab], lin.bias.grad)

    # The sum / none reductions agree with torch.
    z = torch.randn(15, vocab)
    zs = _leaf(shard_vocab(z, rank, world, dim=1))
    zr = _leaf(z)
    for red in ("sum", "none"):
        zs.grad = zr.grad = None
        a = vocab_parallel_cross_entropy(zs, labels.view(-1), start, vocab_size=vocab, reduction=red)
        b = F.cross_entropy(zr, labels.view(-1), reduction=red)
        assert_close(a, b)
        (a * torch.arange(1.0, a.numel() + 1).view_as(a)).sum().backward()
        (b * torch.arange(1.0, b.numel() + 1).view_as(b)).sum().backward()
        assert_close(_gather(zs.grad, 1)[:, :vocab], zr.grad)


def _check_tied_model(rank, world):
    """Embedding -> column/row MLP -> tied LM head loss, built from the module wrappers."""
    vocab, hidden, ffn = 10, 8, 12
    torch.manual_seed(4)
    emb, fc1, fc2 = torch.nn.Embedding(vocab, hidden), torch.nn.Linear(hidden, ffn), torch.nn.Linear(ffn, hidden)
    ids, labels = torch.randint(0, vocab, (2, 6)), torch.randint(0, vocab, (2, 6))

    def ref_loss():
        x = emb(ids)
        x = x + fc2(torch.relu(fc1(x)))
        return F.cross_entropy(F.linear(x, emb.weight).view(-1, vocab), labels.view(-1))

    lr = ref_loss()
    lr.backward()
    pe = VocabParallelEmbedding.from_embedding(emb)
    c1, r2 = ColumnParallelLinear.from_linear(fc1), RowParallelLinear.from_linear(fc2)
    head = ParallelLMHeadLoss(hidden, vocab, tied_embedding=pe)
    assert head.weight is pe.weight
    x = pe(ids)
    x = x + r2(torch.relu(c1(x)))
    loss = head(x, labels)
    loss.backward()
    assert_close(loss, lr)
    assert_close(_gather(pe.weight.grad, 0)[:vocab], emb.weight.grad)
    assert_close(_gather(c1.weight.grad, 0), fc1.weight.grad)
    assert_close(_gather(c1.bias.grad, 0), fc1.bias.grad)
    assert_close(_gather(r2.weight.grad, 1), fc2.weight.grad)
    assert_close(r2.bias.grad, fc2.bias.grad)


def _check_gather_scatter(rank, world):
    """scatter/gather are adjoint: values, gradients and all-gather byte counts."""
    torch.manual_seed(5)
    x, c = torch.randn(4, 6, 2), torch.randn(4, 6, 2)
    for dim in (0, 1, -1):
        xs = _leaf(x)
        comm.STATS.reset()
        part = scatter_to_tp(xs, dim)
        assert_close(part, x.chunk(world, dim)[rank])
        y = gather_from_tp(part * 2.0, dim)
        (y * c).sum().backward()
        assert_close(y, 2 * x)
        assert_close(xs.grad, 2 * c)
        # forward gather + backward gather of the scatter, each of the full 48 fp32 values
        assert comm.STATS.calls_by_kind == {"all_gather": 2}
        assert comm.STATS.total == 2 * (world - 1) / world * 48 * F32


def _check_memtrack_with_collectives(rank, world):
    """The CPU memory tracker works around gloo collectives and TP autograd functions."""
    torch.manual_seed(6)
    fc1, fc2 = ColumnParallelLinear(8, 16), RowParallelLinear(16, 8)
    x = torch.randn(4, 8, requires_grad=True)
    mt = MemoryTracker(backend="storage")
    registered = mt.track_existing(fc1, fc2, x)
    assert registered == (8 * 16 // world + 16 // world + 16 * 8 // world + 8 + 32) * F32
    with mt:
        y = fc2(torch.relu(fc1(x)))
        y.sum().backward()
        del y
    # Live now: parameters, their gradients, x and its gradient. Gloo's work objects may hold
    # a collective's tensor a moment longer (released from its own thread), so wait for it.
    deadline = time.monotonic() + 5.0
    while mt.current_bytes != 2 * registered and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert mt.current_bytes == 2 * registered, (mt.current_bytes, registered)
    assert mt.peak_bytes > mt.current_bytes


def _tp_worker(rank, world, out_dir):
    mesh = setup_mesh(1, 1, world)
    assert tp_world_size() == world and mesh.tp_group is not None
    checks = {
        "mlp": lambda: _check_mlp(rank, world),
        "attention_mha": lambda: _check_attention(rank, world, kv_heads=4),
        "attention_gqa": lambda: _check_attention(rank, world, kv_heads=2),
        "embedding": lambda: _check_embedding(rank, world),
        "cross_entropy": lambda: _check_cross_entropy(rank, world),
        "tied_model": lambda: _check_tied_model(rank, world),
        "gather_scatter": lambda: _check_gather_scatter(rank, world),
        "memtrack_with_collectives": lambda: _check_memtrack_with_collectives(rank, world),
    }
    verdicts = {}
    for name, fn in checks.items():
        try:
            fn()
            verdicts[name] = "ok"
        except Exception:  # recorded per check so one failure does not hide the others
            verdicts[name] = traceback.format_exc()
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(verdicts, f)


CHECKS = [
    "mlp",
    "attention_mha",
    "attention_gqa",
    "embedding",
    "cross_entropy",
    "tied_model",
    "gather_scatter",
    "memtrack_with_collectives",
]


@pytest.fixture(scope="module")
def tp_verdicts(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    launch_local(_tp_worker, TP, args=(str(out),), timeout_s=120, collective_timeout_s=60)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(TP)]


@pytest.mark.dist
@pytest.mark.parametrize("check", CHECKS)
def test_tp2_matches_single_process(tp_verdicts, check):
    for rank, verdicts in enumerate(tp_verdicts):
        assert verdicts[check] == "ok", f"rank {rank}, check {check}:\n{verdicts[check]}"
