"""Attention over one block of keys at a time, and the merge of blocks by log-sum-exp.

Context parallelism computes a query chunk's attention against key/value chunks that arrive one
after another (the ring) or all at once (all-gather, Ulysses). A block's softmax is normalized
only over its own keys, so each block returns its output *and* the log-sum-exp of its scores;
two partial results merge exactly (the online softmax of FlashAttention and ring attention)::

    lse = log(exp(lse_a) + exp(lse_b))
    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

Backward needs no partial results: with the final ``out`` and ``lse`` of a query row, a block's
probabilities are ``exp(q k^T * scale - lse)`` exactly, so each block's gradients follow from the
block alone (FlashAttention-2's backward): ``dv = p^T do``, ``ds = p * (do v^T - rowsum(do * out))``,
``dq = ds k * scale``, ``dk = ds^T q * scale``.

Masks are positional (``AttentionMask``): a query at position ``t`` sees key position ``u`` when
``u <= t`` (causal), ``t - u < window`` (sliding window) and the block-sparse layout's blocks
(``runtime.sparse_attention``), so every rank builds its masks from
the positions it holds (``runtime.context_parallel.layout``). A block whose keys are all visible
is computed unmasked and a block with no visible key is skipped: under a causal mask, chunks below
the diagonal cost no mask and chunks above it cost nothing.

Grouped-query attention: ``k`` and ``v`` carry ``heads / group`` heads; query head ``i`` uses
key/value head ``i // group`` (transformers' ``repeat_kv`` layout). Blocks travel compact and are
expanded only for the products; their gradients are summed back over each group.

Scores, probabilities and the running output are float32 whatever the inputs' dtype. A block is
computed in tiles of at most ``TILE`` queries by ``TILE`` keys (merged the same way), so the
float32 scores alive at once are ``heads x TILE x TILE`` per block whatever the sequence length,
and ``masked_attention`` saves only ``q, k, v, out`` and the log-sum-exp for backward, never a
score matrix: memory linear in the sequence, as the planner prices it (``cost_models.context_cost``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.contract.limits import ATTENTION_TILE
from runtime.sparse_attention import BlockSparseLayout

__all__ = [
    "TILE",
    "AttentionMask",
    "Span",
    "block_forward",
    "block_backward",
    "heads_inner",
    "merge",
    "masked_attention",
]

TILE = ATTENTION_TILE
"""Queries and keys per tile of a block: bounds the float32 scores alive at once (the cost
models price ``ATTENTION_TILE_TENSORS`` of them in a backward)."""


@dataclass(frozen=True)
class AttentionMask:
    """Which (query, key) position pairs attend: ``causal`` (keys at or before the query),
    ``window`` (only the ``window`` most recent keys, the query's own included; None: no limit)
    and ``layout`` (a causal block-sparse layout, ``runtime.sparse_attention.BlockSparseLayout``;
    None: none)."""

    causal: bool = True
    window: int | None = None
    layout: BlockSparseLayout | None = None

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"a sliding window must hold at least one key, got {self.window}")
        if self.layout is not None and not self.causal:
            raise ValueError("a block-sparse layout is causal: build its mask with causal=True")

    def visible(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """``[nq, nk]`` booleans: which keys each query sees."""
        gap = query_pos[:, None] - key_pos[None, :]
        seen = gap >= 0 if self.causal else torch.ones_like(gap, dtype=torch.bool)
        if self.window is not None:
            seen = seen & (gap < self.window) if self.causal else seen & (gap.abs() < self.window)
        if self.layout is not None:
            seen = seen & self.layout.visible(query_pos, key_pos)
        return seen


@dataclass(frozen=True)
class Span:
    """A run of consecutive positions ``[start, start + length)``: one chunk of a sequence."""

    start: int
    length: int

    @property
    def last(self) -> int:
        return self.start + self.length - 1

    def positions(self, device: torch.device) -> torch.Tensor:
        return torch.arange(self.start, self.start + self.length, device=device)


def _coverage(mask: AttentionMask, queries: Span, keys: Span) -> str:
    """``none``, ``all`` or ``some``: how many of the block's pairs the mask keeps."""
    if mask.layout is not None:
        return _layout_coverage(mask, queries, keys)
    nearest, farthest = queries.start - keys.last, queries.last - keys.start  # smallest / largest t - u
    if mask.causal:
        if farthest < 0:
            return "none"
        if mask.window is not None and nearest >= mask.window:
            return "none"
        if nearest >= 0 and (mask.window is None or farthest < mask.window):
            return "all"
        return "some"
    if mask.window is None:
        return "all"
    if nearest >= mask.window or farthest <= -mask.window:
        return "none"
    return "all" if max(abs(nearest), abs(farthest)) < mask.window else "some"


def _layout_coverage(mask: AttentionMask, queries: Span, keys: Span) -> str:
    """A block-sparse mask's coverage: ``none`` when the causal and window parts keep nothing or
    every key block is neither global nor near enough to any query block, else ``some``."""
    layout = mask.layout
    assert layout is not None
    if _coverage(AttentionMask(mask.causal, mask.window), queries, keys) == "none":
        return "none"
    nearest_blocks = queries.start // layout.block - keys.last // layout.block
    if keys.start // layout.block >= layout.global_blocks and nearest_blocks >= layout.local_blocks:
        return "none"
    return "some"


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """Repeat each key/value head for the query heads of its group."""
    group = heads // kv.shape[1]
    return kv if group == 1 else kv.repeat_interleave(group, dim=1)


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum an expanded key/value gradient back over each head group."""
    b, heads, n, d = grad.shape
    return grad if heads == kv_heads else grad.view(b, kv_heads, heads // kv_heads, n, d).sum(2)


def _tiles(span: Span, offset: int = 0) -> list[tuple[Span, slice]]:
    """``span`` cut into runs of at most ``TILE`` positions, each with its rows in the tensor
    (starting at ``offset``)."""
    return [
        (Span(span.start + lo, min(TILE, span.length - lo)), slice(offset + lo, offset + min(lo + TILE, span.length)))
        for lo in range(0, span.length, TILE)
    ]


def _scores(q, k, mask: AttentionMask, queries: Span, keys: Span, scale: float):
    """Float32 scores of one block, masked when the mask keeps only some pairs; None when it keeps none."""
    cover = _coverage(mask, queries, keys)
    if cover == "none":
        return None
    scores = torch.matmul(q.float(), _expand(k, q.shape[1]).float().transpose(-2, -1)).mul_(scale)
    if cover == "some":
        seen = mask.visible(queries.positions(q.device), keys.positions(q.device))
        scores.masked_fill_(~seen, float("-inf"))
    return scores


def _tile_forward(q, k, v, mask: AttentionMask, queries: Span, keys: Span, scale: float):
    """``block_forward`` of one tile pair (all of it in one product)."""
    scores = _scores(q, k, mask, queries, keys, scale)
    if scores is None:
        return None
    lse = torch.logsumexp(scores, dim=-1)
    probs = scores.sub_(lse.unsqueeze(-1)).exp_().nan_to_num_(0.0)  # in place; rows that see nothing: -inf - -inf
    return torch.matmul(probs, _expand(v, q.shape[1]).float()), lse


def _forward_over(q, k, v, cuts, mask: AttentionMask, scale: float, part):
    """``(out, lse)`` of ``q`` over ``k, v`` cut into ``cuts = (query pieces, key pieces)``, each a
    ``(Span, rows)``: ``part`` (a tile's or a block's forward) per pair, merged by log-sum-exp; a
    query piece that sees no key gets zeros and ``-inf``."""
    outs, lses = [], []
    for query_span, rows in cuts[0]:
        acc = None
        for key_span, cols in cuts[1]:
            acc = merge(acc, part(q[:, :, rows], k[:, :, cols], v[:, :, cols], mask, query_span, key_span, scale))
        if acc is None:
            shape = (q.shape[0], q.shape[1], query_span.length)
            acc = (
                q.new_zeros(*shape, q.shape[3], dtype=torch.float32),
                q.new_full(shape, float("-inf"), dtype=torch.float32),
            )
        outs.append(acc[0])
        lses.append(acc[1])
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _backward_over(q, k, v, grads, cuts, mask: AttentionMask, scale: float, part):
    """Float32 ``(dq, dk, dv)`` over the pieces of ``_forward_over``: ``part`` (a tile's or a
    block's backward) per pair, its contributions added in place."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for query_span, rows in cuts[0]:
        piece = tuple(g[:, :, rows] for g in grads)
        for key_span, cols in cuts[1]:
            got = part(q[:, :, rows], k[:, :, cols], v[:, :, cols], piece, mask, query_span, key_span, scale)
            if got is not None:
                dq[:, :, rows] += got[0]
                dk[:, :, cols] += got[1]
                dv[:, :, cols] += got[2]
    return dq, dk, dv


def block_forward(q, k, v, mask: AttentionMask, queries: Span, keys: Span, scale: float):
    """``(out, lse)`` of queries ``q`` ``[b, h, nq, d]`` over one block of keys (float32; ``lse``
    ``[b, h, nq]``, ``-inf`` where a query sees no key of the block), or None when it sees none.
    Computed tile by tile (``TILE``), merged by log-sum-exp."""
    if _coverage(mask, queries, keys) == "none":
        return None
    return _forward_over(q, k, v, (_tiles(queries), _tiles(keys)), mask, scale, _tile_forward)


def heads_inner(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out`` (``[b, heads, n, d]``) in ``dtype``, stored position-major (``[b, n, heads, d]``
    in memory) as SDPA returns it: the model's ``transpose(1, 2).contiguous()`` before its output
    projection is then free and the projection's saved input is the tensor attention saved, one
    copy of the output per layer as the planner prices it, not two."""
    by_position = out.transpose(1, 2)
    return torch.empty(by_position.shape, dtype=dtype, device=out.device).copy_(by_position).transpose(1, 2)


def merge(acc, part):
    """Two partial ``(out, lse)`` of the same queries over disjoint keys -> their union's (either may be None)."""
    if acc is None:
        return part
    if part is None:
        return acc
    (out_a, lse_a), (out_b, lse_b) = acc, part
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = torch.exp(lse_a - lse).nan_to_num(0.0).unsqueeze(-1)
    weight_b = torch.exp(lse_b - lse).nan_to_num(0.0).unsqueeze(-1)
    return out_a * weight_a + out_b * weight_b, lse


def _tile_backward(q, k, v, grads, mask: AttentionMask, queries: Span, keys: Span, scale: float):
    """``block_backward`` of one tile pair."""
    dout, _, lse, delta = grads
    scores = _scores(q, k, mask, queries, keys, scale)
    if scores is None:
        return None
    # in place: the scores become the probabilities, the probabilities' gradient the scores'
    # gradient, so two tile-sized tensors are alive at once (ATTENTION_TILE_TENSORS)
    probs = scores.sub_(lse.unsqueeze(-1)).exp_().nan_to_num_(0.0)
    k_full, v_full = _expand(k, q.shape[1]).float(), _expand(v, q.shape[1]).float()
    dv = torch.matmul(probs.transpose(-2, -1), dout)
    dscores = torch.matmul(dout, v_full.transpose(-2, -1)).sub_(delta.unsqueeze(-1)).mul_(probs)
    dq = torch.matmul(dscores, k_full).mul_(scale)
    dk = torch.matmul(dscores.transpose(-2, -1), q.float()).mul_(scale)
    return dq, _fold(dk, k.shape[1]), _fold(dv, v.shape[1])


def block_backward(q, k, v, grads, mask: AttentionMask, queries: Span, keys: Span, scale: float):
    """``(dq, dk, dv)`` float32 contributions of one block, from the final ``grads = (dout, out,
    lse, delta)`` of the queries (``delta = rowsum(dout * out)``); None when the block was skipped.
    Tile by tile (``TILE``): each tile pair adds its share."""
    if _coverage(mask, queries, keys) == "none":
        return None
    return _backward_over(q, k, v, grads, (_tiles(queries), _tiles(keys)), mask, scale, _tile_backward)


def _spans(positions: torch.Tensor) -> list[tuple[Span, slice]]:
    """Runs of consecutive positions in ``positions`` (a rank's chunks, or every rank's in rank
    order), each with its rows."""
    values = positions.tolist()
    out, first = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[i - 1] + 1:
            out.append((Span(values[first], i - first), slice(first, i)))
            first = i
    return out


class _MaskedAttention(torch.autograd.Function):
    """Attention of ``q`` over ``k, v`` at arbitrary positions, block by block over their runs of
    consecutive positions (``block_forward``), saving only ``q, k, v, out, lse``."""

    @staticmethod
    def forward(ctx, q, k, v, query_pos, key_pos, mask: AttentionMask, scale: float):
        queries, keys = _spans(query_pos), _spans(key_pos)
        out, lse = _forward_over(q, k, v, (queries, keys), mask, scale, block_forward)
        out = heads_inner(out, q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spans, ctx.mask, ctx.scale = (queries, keys), mask, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        out = out.float()
        queries, keys = ctx.spans
        dout = grad_out.float()
        delta = (dout * out).sum(-1)
        grads = (dout, out, lse, delta)
        dq, dk, dv = _backward_over(q, k, v, grads, (queries, keys), ctx.mask, ctx.scale, block_backward)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def masked_attention(q, k, v, query_pos: torch.Tensor, key_pos: torch.Tensor, mask: AttentionMask, scale: float):
    """Differentiable attention of ``q`` over every key at the given positions (the all-gather and
    Ulysses methods, where one rank holds all keys its queries need); output in ``q``'s dtype.
    Block by block and tile by tile: no score matrix is kept (module docstring)."""
    return _MaskedAttention.apply(q, k, v, query_pos, key_pos, mask, scale)
