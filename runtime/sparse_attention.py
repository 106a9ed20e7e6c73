"""Block-sparse causal attention with a fixed layout, as one operator the planner can see.

A long sequence's attention need not be the whole causal triangle. A *fixed block-sparse layout*
(Child et al. 2019's fixed pattern, BigBird's and Longformer's local-plus-global shape) cuts the
sequence into blocks of ``block`` positions and lets a query in block ``i`` see a key in block
``j`` when the key is not after the query and

* ``i - j < local_blocks``: its own block and the ``local_blocks - 1`` blocks before it, or
* ``j < global_blocks``: the first blocks, which every later query sees (summary tokens, a prompt).

Each query sees at most ``(local_blocks + global_blocks) * block`` keys, so the work grows as
``s`` rather than ``s^2``; with ``local_blocks ~ sqrt(s / block)`` it is the ``O(s sqrt s)`` of the
sparse transformers. ``passes.mask_density`` counts the kept pairs exactly and the planner prices
the core at that density.

A model uses it by calling ``block_sparse_attention(q, k, v, layout)`` where it would call SDPA
(``q`` ``[b, heads, s, d]``, ``k``/``v`` ``[b, kv_heads, s, d]``, grouped-query heads allowed). It
dispatches to one custom operator, ``torch.ops.planner_runtime.block_sparse_attention``, so that
``torch.export`` keeps it as a single node on the meta device (a 128K-token layout traces without
memory) and compiled stages call the same operator. Its backward is a second operator
(``..._backward``), so traces see the gradients' work as one node too.

The kernel works block by block on any device: each query block gathers only the key blocks it
may see (``(global_blocks + local_blocks) * block`` keys), so time and memory follow the kept
pairs, not the square. Backward recomputes the block probabilities from ``q``, ``k`` and ``v``
(nothing but the inputs is saved) and applies FlashAttention-2's formulas. Scores and
probabilities are float32 (float64 for float64 inputs). FlexAttention's ``BlockMask`` expresses the
same layout on CUDA, but torch 2.13 neither traces it on the meta device nor runs its backward on
the CPU, so this operator is what plans and trains everywhere.

Under context parallelism the layout is a positional mask like causal or sliding
(``runtime.context_parallel.blocks.AttentionMask(layout=...)``): ranks apply it to the positions
they hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BlockSparseLayout", "block_sparse_attention"]


@dataclass(frozen=True)
class BlockSparseLayout:
    """A fixed causal block-sparse layout (module doc)."""

    block: int
    """Positions per block."""
    local_blocks: int
    """A query's own block and the ``local_blocks - 1`` blocks before it are visible."""
    global_blocks: int = 0
    """The first ``global_blocks`` blocks are visible to every later query."""

    def __post_init__(self) -> None:
        for name in ("block", "local_blocks"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"a block-sparse layout needs {name} >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.global_blocks, int) or self.global_blocks < 0:
            raise ValueError(f"a block-sparse layout needs global_blocks >= 0, got {self.global_blocks!r}")

    def visible(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """``[nq, nk]`` booleans: which keys each query sees."""
        query_block, key_block = query_pos[:, None] // self.block, key_pos[None, :] // self.block
        near = (query_block - key_block) < self.local_blocks
        return (key_pos[None, :] <= query_pos[:, None]) & (near | (key_block < self.global_blocks))

    def check(self, seq_len: int) -> None:
        """A ``ValueError`` unless ``seq_len`` is a whole number of blocks."""
        if seq_len % self.block:
            raise ValueError(
                f"block-sparse attention cuts the sequence into blocks of {self.block} positions: "
                f"sequence length {seq_len} is not a multiple of {self.block}; pad the sequence or "
                "change the layout's block"
            )


def _key_positions(layout: BlockSparseLayout, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """For every query block, the key positions it may see and which pairs it keeps.

    Returns ``keys`` ``[n, K]`` (int64 positions, ``K = (global_blocks + local_blocks) * block``,
    clamped into range where a slot is unused) and ``kept`` ``[n, block, K]`` (booleans), ``n =
    seq_len / block``. A query block's slots are the global blocks, then its local blocks; a global
    block that is also local is kept in its local slot only, so no pair counts twice.
    """
    n, size = seq_len // layout.block, layout.block
    query_block = torch.arange(n, device=device)[:, None]
    slots = torch.cat(
        [
            torch.arange(layout.global_blocks, device=device).expand(n, -1),
            query_block - layout.local_blocks + 1 + torch.arange(layout.local_blocks, device=device),
        ],
        dim=1,
    )  # [n, G + L] key block ids
    is_global = torch.arange(slots.shape[1], device=device) < layout.global_blocks
    usable = (slots >= 0) & (slots <= query_block) & ~(is_global & (slots > query_block - layout.local_blocks))
    keys = (slots[:, :, None] * size + torch.arange(size, device=device)).flatten(1)  # [n, K]
    query_pos = (query_block * size + torch.arange(size, device=device))[:, :, None]  # [n, b, 1]
    kept = usable.repeat_interleave(size, dim=1)[:, None, :] & (keys[:, None, :] <= query_pos)
    return keys.clamp(0, seq_len - 1), kept


def _gathered(q, k, v, layout: BlockSparseLayout, scale: float):
    """Each query block's scores over its kept key blocks, the probabilities and the gathered
    keys/values (float32; key/value heads expanded to the query heads)."""
    batch, heads, seq_len, dim = q.shape
    n = seq_len // layout.block
    keys, kept = _key_positions(layout, seq_len, q.device)
    group = heads // k.shape[1]
    wide = torch.promote_types(q.dtype, torch.float32)  # float32 math, float64 kept
    k_rows = k.to(wide).repeat_interleave(group, dim=1)[:, :, keys]  # [b, h, n, K, d]
    v_rows = v.to(wide).repeat_interleave(group, dim=1)[:, :, keys]
    q_blocks = q.to(wide).reshape(batch, heads, n, layout.block, dim)
    scores = torch.matmul(q_blocks, k_rows.transpose(-2, -1)) * scale  # [b, h, n, block, K]
    probs = torch.softmax(scores.masked_fill(~kept, float("-inf")), dim=-1)
    return keys, q_blocks, k_rows, v_rows, probs


def _scatter_keys(grad_rows: torch.Tensor, keys: torch.Tensor, seq_len: int, kv_heads: int) -> torch.Tensor:
    """Sum gradients of gathered key/value rows ``[b, h, n, K, d]`` back to ``[b, kv_heads, s, d]``."""
    batch, heads, _, _, dim = grad_rows.shape
    out = grad_rows.new_zeros(batch, heads, seq_len, dim)
    out.index_add_(2, keys.flatten(), grad_rows.flatten(2, 3))
    return out.view(batch, kv_heads, heads // kv_heads, seq_len, dim).sum(2)


def _sparse_forward(q, k, v, layout: BlockSparseLayout, scale: float) -> torch.Tensor:
    _, _, _, v_rows, probs = _gathered(q, k, v, layout, scale)
    return torch.matmul(probs, v_rows).flatten(2, 3).to(q.dtype)


def _sparse_backward(grad, q, k, v, layout: BlockSparseLayout, scale: float):
    """FlashAttention-2's backward over the kept blocks: ``dv = p^T do``, ``ds = p * (do v^T -
    rowsum(do * out))``, ``dq = ds k * scale``, ``dk = ds^T q * scale``."""
    batch, heads, seq_len, dim = q.shape
    keys, q_blocks, k_rows, v_rows, probs = _gathered(q, k, v, layout, scale)
    grad_blocks = grad.to(q_blocks.dtype).reshape(q_blocks.shape)
    out = torch.matmul(probs, v_rows)
    grad_probs = torch.matmul(grad_blocks, v_rows.transpose(-2, -1))
    grad_scores = probs * (grad_probs - (grad_blocks * out).sum(-1, keepdim=True))
    dq = (torch.matmul(grad_scores, k_rows) * scale).flatten(2, 3)
    dk = _scatter_keys(torch.matmul(grad_scores.transpose(-2, -1), q_blocks) * scale, keys, seq_len, k.shape[1])
    dv = _scatter_keys(torch.matmul(probs.transpose(-2, -1), grad_blocks), keys, seq_len, v.shape[1])
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _layout(block: int, local_blocks: int, global_blocks: int) -> BlockSparseLayout:
    return BlockSparseLayout(int(block), int(local_blocks), int(global_blocks))


@torch.library.custom_op("planner_runtime::block_sparse_attention", mutates_args=())
def _forward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int, local_blocks: int, global_blocks: int, scale: float
) -> torch.Tensor:
    return _sparse_forward(q, k, v, _layout(block, local_blocks, global_blocks), scale)


@_forward_op.register_fake
def _forward_fake(q, k, v, block, local_blocks, global_blocks, scale):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


@torch.library.custom_op("planner_runtime::block_sparse_attention_backward", mutates_args=())
def _backward_op(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block: int,
    local_blocks: int,
    global_blocks: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _sparse_backward(grad, q, k, v, _layout(block, local_blocks, global_blocks), scale)


@_backward_op.register_fake
def _backward_fake(grad, q, k, v, block, local_blocks, global_blocks, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, block, local_blocks, global_blocks, scale = inputs
    ctx.save_for_backward(q, k, v)
    ctx.layout = (block, local_blocks, global_blocks, scale)


def _backward(ctx, grad):
    q, k, v = ctx.saved_tensors
    dq, dk, dv = _backward_op(grad.contiguous(), q, k, v, *ctx.layout)
    return dq, dk, dv, None, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockSparseLayout, scale: float | None = None
) -> torch.Tensor:
    """Attention of ``q`` ``[b, heads, s, d]`` over ``k``/``v`` ``[b, kv_heads, s, d]`` under the
    causal block-sparse ``layout`` (module doc); ``scale`` defaults to ``1 / sqrt(d)``."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"block-sparse attention takes [batch, heads, seq, dim] tensors, got q {tuple(q.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads cannot share {k.shape[1]} key/value heads evenly")
    if not isinstance(q.shape[-2], torch.SymInt):
        layout.check(q.shape[-2])
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _forward_op(q, k, v, layout.block, layout.local_blocks, layout.global_blocks, scale)
