"""runtime.sparse_attention: the block-sparse operator against whole-square attention under the
layout's mask (values and gradients), its errors, and its trace on the meta device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from runtime.sparse_attention import BlockSparseLayout, block_sparse_attention


def _reference(q, k, v, layout: BlockSparseLayout):
    positions = torch.arange(q.shape[2])
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=layout.visible(positions, positions))


@settings(max_examples=25, deadline=None)
@given(
    block=st.integers(1, 8),
    blocks=st.integers(1, 9),
    local=st.integers(1, 4),
    glob=st.integers(0, 3),
    kv_heads=st.sampled_from([1, 2, 4]),
)
def test_values_and_gradients_equal_masked_attention(block, blocks, local, glob, kv_heads):
    layout = BlockSparseLayout(block, local, glob)
    torch.manual_seed(block * 100 + blocks)
    seq = block * blocks
    q = torch.randn(2, 4, seq, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, seq, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = block_sparse_attention(q, k, v, layout)
    expected = _reference(q, k, v, layout)
    assert_close(out, expected)
    grad = torch.randn_like(out)
    for mine, theirs in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad)):
        assert_close(mine, theirs)


def test_float32_inputs_and_scale():
    layout = BlockSparseLayout(4, 2, 1)
    q, k, v = (torch.randn(1, 2, 32, 8) for _ in range(3))
    assert_close(block_sparse_attention(q, k, v, layout, scale=0.5), _reference(q * 0.5 * 8**0.5, k, v, layout))


def test_bad_layouts_and_lengths_are_refused():
    with pytest.raises(ValueError, match="block >= 1"):
        BlockSparseLayout(0, 2)
    with pytest.raises(ValueError, match="global_blocks >= 0"):
        BlockSparseLayout(4, 2, -1)
    q = torch.randn(1, 2, 30, 8)
    with pytest.raises(ValueError, match="sequence length 30 is not a multiple of 4"):
        block_sparse_attention(q, q, q, BlockSparseLayout(4, 2))
    with pytest.raises(ValueError, match="3 query heads cannot share 2"):
        block_sparse_attention(
            torch.randn(1, 3, 8, 4), torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4), BlockSparseLayout(4, 1)
        )


def test_one_node_on_the_meta_device():
    """A 128K-token layout exports as one operator (no s x s mask built) and costs no memory."""
    layout = BlockSparseLayout(128, 8, 1)

    class Core(torch.nn.Module):
        def forward(self, q, k, v):
            return block_sparse_attention(q, k, v, layout)

    with torch.device("meta"):
        q, kv = torch.randn(1, 8, 131072, 64), torch.randn(1, 2, 131072, 64)
    program = torch.export.export(Core(), (q, kv, kv))
    calls = [n for n in program.graph.nodes if n.op == "call_function"]
    assert [str(n.target) for n in calls] == ["planner_runtime.block_sparse_attention.default"]
    assert list(calls[0].args[3:6]) == [128, 8, 1]
