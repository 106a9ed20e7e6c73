"""runtime.tensor_parallel.sharding.TensorShard: every rank's piece, joined back, is the original tensor."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.tensor_parallel.sharding import TensorShard


@settings(max_examples=60, deadline=None)
@given(
    tp=st.sampled_from([1, 2, 3, 4]),
    per=st.integers(1, 5),
    other=st.integers(1, 4),
    dim=st.integers(0, 1),
    kind=st.sampled_from(["column", "row", "heads"]),
)
def test_cut_then_join_is_the_identity(tp, per, other, dim, kind):
    shape = [other, other]
    shape[dim] = per * tp
    full = torch.randn(shape)
    shard = TensorShard(dim=dim, kind=kind, size=per * tp)
    pieces = [shard.cut(full, r, tp) for r in range(tp)]
    assert all(p.shape[dim] == shard.local_size(tp) == per for p in pieces)
    torch.testing.assert_close(shard.join(pieces), full, rtol=0, atol=0)


@settings(max_examples=40, deadline=None)
@given(tp=st.sampled_from([2, 3, 4, 8]), vocab=st.integers(5, 40), hidden=st.integers(1, 4))
def test_vocab_rows_are_padded_with_zeros_and_dropped_on_join(tp, vocab, hidden):
    padded = -(-vocab // tp) * tp
    full = torch.randn(vocab, hidden)
    shard = TensorShard(dim=0, kind="vocab", size=vocab, padded=padded)
    pieces = [shard.cut(full, r, tp) for r in range(tp)]
    assert [p.shape[0] for p in pieces] == [padded // tp] * tp
    stacked = torch.cat(pieces)
    assert torch.count_nonzero(stacked[vocab:]) == 0  # the pad rows
    torch.testing.assert_close(shard.join(pieces), full, rtol=0, atol=0)


def test_fused_qkv_is_cut_per_part_in_megatron_layout():
    q, k, v = torch.arange(8.0), torch.arange(100.0, 104.0), torch.arange(200.0, 204.0)
    full = torch.cat([q, k, v]).view(-1, 1)
    shard = TensorShard(dim=0, kind="qkv", size=16, parts=(8, 4, 4))
    r0, r1 = shard.cut(full, 0, 2).flatten().tolist(), shard.cut(full, 1, 2).flatten().tolist()
    assert r0 == [0, 1, 2, 3, 100, 101, 200, 201]
    assert r1 == [4, 5, 6, 7, 102, 103, 202, 203]
    torch.testing.assert_close(shard.join([shard.cut(full, r, 2) for r in range(2)]), full, rtol=0, atol=0)


def test_manifest_form_round_trips_and_rejects_unknown_kinds():
    d = {"dim": 0, "kind": "qkv", "parts": [4, 2, 2], "size": 8}
    assert TensorShard.from_dict(d).to_dict() == d
    assert TensorShard.from_dict(None) is None
    with pytest.raises(ValueError, match="unknown shard kind 'diagonal'"):
        TensorShard(dim=0, kind="diagonal", size=4)
    with pytest.raises(ValueError, match="qkv shard needs the sizes of its parts"):
        TensorShard(dim=0, kind="qkv", size=4)
