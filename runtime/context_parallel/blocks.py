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

Scores, probabilities and the running output are float32 whatever the inputs' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.sparse_attention import BlockSparseLayout

__all__ = ["AttentionMask", "Span", "block_forward", "block_backward", "merge", "masked_attention"]


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


def _scores(q, k, mask: AttentionMask, queries: Span, keys: Span, scale: float):
    """Float32 scores of one block, masked when the mask keeps only some pairs; None when it keeps none."""
    cover = _coverage(mask, queries, keys)
    if cover == "none":
        return None
    scores = torch.matmul(q.float(), _expand(k, q.shape[1]).float().transpose(-2, -1)) * scale
    if cover == "some":
        seen = mask.visible(queries.positions(q.device), keys.positions(q.device))
        scores = scores.masked_fill(~seen, float("-inf"))
    return scores


def block_forward(q, k, v, mask: AttentionMask, queries: Span, keys: Span, scale: float):
    """``(out, lse)`` of queries ``q`` ``[b, h, nq, d]`` over one block of keys (float32; ``lse``
    ``[b, h, nq]``, ``-inf`` where a query sees no key of the block), or None when it sees none."""
    scores = _scores(q, k, mask, queries, keys, scale)
    if scores is None:
        return None
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)  # rows that see nothing: -inf - -inf
    return torch.matmul(probs, _expand(v, q.shape[1]).float()), lse


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


def block_backward(q, k, v, grads, mask: AttentionMask, queries: Span, keys: Span, scale: float):
    """``(dq, dk, dv)`` float32 contributions of one block, from the final ``grads = (dout, out,
    lse, delta)`` of the queries (``delta = rowsum(dout * out)``); None when the block was skipped."""
    dout, _, lse, delta = grads
    scores = _scores(q, k, mask, queries, keys, scale)
    if scores is None:
        return None
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    k_full, v_full = _expand(k, q.shape[1]).float(), _expand(v, q.shape[1]).float()
    dv = torch.matmul(probs.transpose(-2, -1), dout)
    dscores = probs * (torch.matmul(dout, v_full.transpose(-2, -1)) - delta.unsqueeze(-1))
    dq = torch.matmul(dscores, k_full) * scale
    dk = torch.matmul(dscores.transpose(-2, -1), q.float()) * scale
    return dq, _fold(dk, k.shape[1]), _fold(dv, v.shape[1])


def masked_attention(q, k, v, query_pos: torch.Tensor, key_pos: torch.Tensor, mask: AttentionMask, scale: float):
    """Plain differentiable attention of ``q`` over every key at the given positions (the all-gather
    and Ulysses methods, where one rank holds all keys its queries need); output in ``q``'s dtype."""
    scores = torch.matmul(q.float(), _expand(k, q.shape[1]).float().transpose(-2, -1)) * scale
    scores = scores.masked_fill(~mask.visible(query_pos, key_pos), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.matmul(probs, _expand(v, q.shape[1]).float()).to(q.dtype)
