"""runtime.tensor_parallel without processes: shard helpers, the single-rank ops and the vocab-parallel loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from passes.tensor_parallel.tp_costs import vocab_loss_bytes
from runtime.distributed import comm
from runtime.tensor_parallel import (
    column_parallel_linear,
    padded_vocab_size,
    row_parallel_linear,
    shard_dim,
    shard_heads,
    shard_qkv,
    shard_vocab,
    tp_world_size,
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
    vocab_range,
)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), world=st.integers(1, 4), data=st.data())
def test_shard_dim_reassembles(shape, world, data):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    shape[dim] *= world
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    parts = [shard_dim(full, dim, r, world) for r in range(world)]
    assert all(p.is_contiguous() and p.shape[dim] == shape[dim] // world for p in parts)
    assert torch.equal(torch.cat(parts, dim=dim), full)
    parts[0].add_(1)  # a copy: the full tensor is untouched
    assert torch.equal(torch.cat([shard_dim(full, dim, r, world) for r in range(world)], dim), full)


def test_shard_dim_errors():
    with pytest.raises(ValueError, match=r"size 10.*over 4.*not divisible"):
        shard_dim(torch.zeros(3, 10), 1, 0, 4)
    with pytest.raises(ValueError, match="rank 2 is outside"):
        shard_dim(torch.zeros(4), 0, 2, 2)


@settings(max_examples=40, deadline=None)
@given(
    world=st.sampled_from([1, 2, 4]),
    q_per=st.integers(1, 3),
    group=st.integers(1, 3),
    hd=st.integers(1, 3),
    hidden=st.integers(1, 3),
)
def test_shard_heads_gqa_mapping(world, q_per, group, hd, hidden):
    kv_heads = world * q_per
    heads = kv_heads * group  # group = query heads per kv head
    wq = torch.arange(heads * hd * hidden, dtype=torch.float32).view(heads * hd, hidden)
    wk = -torch.arange(kv_heads * hd * hidden, dtype=torch.float32).view(kv_heads * hd, hidden)
    for r in range(world):
        q_r = shard_heads(wq, heads, hd, r, world).view(heads // world, hd, hidden)
        k_r = shard_heads(wk, kv_heads, hd, r, world).view(kv_heads // world, hd, hidden)
        for j in range(heads // world):  # local query head j is global head h
            h = r * heads // world + j
            assert torch.equal(q_r[j], wq.view(heads, hd, hidden)[h])
            # its kv head, found locally the way the attention kernel does, is the global one
            assert torch.equal(k_r[j // group], wk.view(kv_heads, hd, hidden)[h // group])
    parts = [shard_heads(wq.t(), heads, hd, r, world, dim=1) for r in range(world)]
    assert torch.equal(torch.cat(parts, 1), wq.t())


def test_shard_heads_errors():
    with pytest.raises(ValueError, match="cannot split 2 heads over 4"):
        shard_heads(torch.zeros(2 * 3, 5), 2, 3, 0, 4)
    with pytest.raises(ValueError, match="expected num_heads x head_dim = 4 x 3 = 12"):
        shard_heads(torch.zeros(10, 5), 4, 3, 0, 2)


def test_shard_qkv_fused_layout():
    heads, kv, hd, hidden, world = 4, 2, 2, 3, 2
    q = torch.randn(heads * hd, hidden)
    k, v = torch.randn(kv * hd, hidden), torch.randn(kv * hd, hidden)
    fused = torch.cat([q, k, v]).t()  # GPT-2 Conv1D layout [in, out]
    for r in range(world):
        got = shard_qkv(fused, heads, kv, hd, r, world, dim=1).t()
        parts = ((q, heads), (k, kv), (v, kv))
        want = torch.cat([shard_heads(t, n, hd, r, world) for t, n in parts])
        assert torch.equal(got, want)


@settings(max_examples=60, deadline=None)
@given(vocab=st.integers(1, 300), world=st.integers(1, 8))
def test_vocab_range_covers_padded_vocab(vocab, world):
    padded = padded_vocab_size(vocab, world)
    assert padded % world == 0 and vocab <= padded < vocab + world
    ranges = [vocab_range(vocab, r, world) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == padded
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert len({e - s for s, e in ranges}) == 1
    full = torch.randn(vocab, 2)
    parts = [shard_vocab(full, r, world) for r in range(world)]
    cat = torch.cat(parts)
    assert torch.equal(cat[:vocab], full) and torch.all(cat[vocab:] == 0)


def test_single_process_degenerates_to_plain_ops():
    """Without a tp group every function is the plain op and nothing is communicated."""
    torch.manual_seed(0)
    assert tp_world_size() == 1
    comm.STATS.reset()
    x, w, b = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5)
    assert_close(column_parallel_linear(x, w, b, gather_output=True), F.linear(x, w, b))
    assert_close(row_parallel_linear(x, w, b), F.linear(x, w, b))
    ids = torch.tensor([[0, 4, 2]])
    assert_close(vocab_parallel_embedding(ids, w, 0), F.embedding(ids, w))
    assert comm.STATS.total == 0


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_single_rank_with_padding(reduction):
    torch.manual_seed(0)
    vocab = 7
    z = torch.randn(4, 6, vocab)
    labels = torch.randint(0, vocab, (4, 6))
    labels[0, :3] = -100
    padded = torch.cat([z, torch.randn(4, 6, 3)], -1)  # 3 padded columns that must not count
    zp, zr = _leaf(padded), _leaf(z)
    a = vocab_parallel_cross_entropy(zp, labels, 0, vocab_size=vocab, reduction=reduction)
    b = F.cross_entropy(zr.permute(0, 2, 1), labels, reduction=reduction)
    assert_close(a, b)
    (a * 1.5).sum().backward()
    (b * 1.5).sum().backward()
    assert_close(zp.grad[..., :vocab], zr.grad)
    assert torch.all(zp.grad[..., vocab:] == 0)


def test_cross_entropy_bf16_and_errors():
    z = torch.randn(8, 5, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 5, (8,))
    loss = vocab_parallel_cross_entropy(z, labels)
    assert loss.dtype == torch.bfloat16
    assert_close(loss.float(), F.cross_entropy(z.float(), labels), rtol=1e-2, atol=1e-2)
    loss.backward()
    assert z.grad.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="reduction must be"):
        vocab_parallel_cross_entropy(z, labels, reduction="avg")
    with pytest.raises(ValueError, match="logits have 8 tokens"):
        vocab_parallel_cross_entropy(z, torch.zeros(7, dtype=torch.long))


class _ByteCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Sums the cost model's memory-bound bytes of every op run, split at ``mark()``."""

    def __init__(self):
        super().__init__()
        self.parts = [0]

    def mark(self):
        self.parts.append(0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from passes.autograd_costs import bytes_moved

        out = func(*args, **(kwargs or {}))
        moved = bytes_moved(func, args, kwargs or {}, out)
        self.parts[-1] += int(moved or 0)
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_loss_bytes_count_the_runtimes_passes(dtype):
    """The cost model's figure for the vocab-parallel loss is what the runtime's code moves,
    up to the per-row vectors (max, sum, target, labels: a few words per row)."""
    rows, cols = 64, 1000
    z = torch.randn(rows, cols, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, cols, (rows,))
    with _ByteCounter() as c:
        loss = vocab_parallel_cross_entropy(z, labels)
        c.mark()
        loss.backward()
    fwd, bwd = vocab_loss_bytes(rows * cols, z.element_size())
    per_row = 256 * rows  # ~30 ops on per-row vectors of 4- and 8-byte words
    assert fwd <= c.parts[0] <= fwd + per_row
    assert bwd <= c.parts[1] <= bwd + per_row
