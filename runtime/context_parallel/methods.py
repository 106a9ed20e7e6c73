"""The three ways a context-parallel group computes one sequence's attention (``context_attention``;
the package's doc compares them)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from runtime.context_parallel.blocks import AttentionMask, masked_attention
from runtime.context_parallel.layout import local_positions
from runtime.context_parallel.ring import ring_attention
from runtime.contract.choices import ContextMethod, names
from runtime.distributed import comm
from runtime.tensor_parallel.collectives import AllGatherSeq

__all__ = ["METHODS", "context_attention"]

METHODS = names(ContextMethod)
"""plan.json ``context_parallel.method`` values."""


def _group_positions(group: Any, chunk_positions: int, device) -> tuple[int, int, torch.Tensor]:
    """(this rank's index, the group's size, every rank's positions in rank order)."""
    size = comm.group_size(group)
    index = dist.get_rank(group) if size > 1 else 0
    seq_len = chunk_positions * size
    every = torch.cat([local_positions(seq_len, r, size, device) for r in range(size)])
    return index, size, every


def _gathered_attention(q, k, v, mask: AttentionMask, scale: float, group: Any) -> torch.Tensor:
    """The all-gather method: this rank's queries against the gathered keys and values."""
    index, size, every = _group_positions(group, q.shape[2], q.device)
    n = q.shape[2]
    if size > 1:
        k, v = AllGatherSeq.apply(k, 2, group), AllGatherSeq.apply(v, 2, group)
    return masked_attention(q, k, v, every[index * n : (index + 1) * n], every, mask, scale)


class _HeadsForPositions(torch.autograd.Function):
    """All-to-all ``[b, heads, n, d]`` (all heads, my positions) -> ``[b, heads / cp, cp n, d]``
    (my heads, every rank's positions in rank order); backward the inverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _heads_for_positions(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _positions_for_heads(grad.contiguous(), ctx.group), None


class _PositionsForHeads(torch.autograd.Function):
    """The inverse of ``_HeadsForPositions``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _positions_for_heads(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _heads_for_positions(grad.contiguous(), ctx.group), None


def _heads_for_positions(x: torch.Tensor, group: Any) -> torch.Tensor:
    size = comm.group_size(group)
    b, heads, n, d = x.shape
    source = x.view(b, size, heads // size, n, d).transpose(0, 1).contiguous()  # head groups leading
    received = torch.empty_like(source)  # [source rank, b, heads / cp, n, d]
    comm.all_to_all_into(received, source, group=group)
    return received.permute(1, 2, 0, 3, 4).reshape(b, heads // size, size * n, d)


def _positions_for_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    size = comm.group_size(group)
    b, my_heads, total, d = x.shape
    n = total // size
    source = x.view(b, my_heads, size, n, d).permute(2, 0, 1, 3, 4).contiguous()  # destination rank leading
    received = torch.empty_like(source)  # [source rank = head group, b, heads / cp, n, d]
    comm.all_to_all_into(received, source, group=group)
    return received.transpose(0, 1).reshape(b, size * my_heads, n, d)


def _ulysses_attention(q, k, v, mask: AttentionMask, scale: float, group: Any) -> torch.Tensor:
    """The Ulysses method: heads scattered, positions gathered, attention whole, and back."""
    _, size, every = _group_positions(group, q.shape[2], q.device)
    if size == 1:
        return masked_attention(q, k, v, every, every, mask, scale)
    for name, heads in (("query", q.shape[1]), ("key/value", k.shape[1])):
        if heads % size:
            raise ValueError(
                f"Ulysses context parallelism splits attention heads over {size} ranks, but the "
                f"{heads} {name} heads do not divide; use the ring or all-gather method"
            )
    q, k, v = (_HeadsForPositions.apply(t.contiguous(), group) for t in (q, k, v))
    out = masked_attention(q, k, v, every, every, mask, scale)
    return _PositionsForHeads.apply(out.contiguous(), group)


def context_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    method: str,
    mask: AttentionMask,
    scale: float | None = None,
    group: Any = None,
) -> torch.Tensor:
    """Attention of this rank's queries ``[b, heads, n, d]`` over the whole sequence, whose keys
    and values ``[b, kv_heads, n, d]`` are spread over ``group`` in the layout's chunks; returns
    ``[b, heads, n, d]`` in ``q``'s dtype. ``scale`` defaults to ``1 / sqrt(d)``."""
    if method not in METHODS:
        raise ValueError(f"unknown context-parallel method {method!r}: expected one of {', '.join(METHODS)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads cannot share {k.shape[1]} key/value heads evenly")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if method == "ring":
        return ring_attention(q, k, v, mask, scale, group)
    if method == "all-gather":
        return _gathered_attention(q, k, v, mask, scale, group)
    return _ulysses_attention(q, k, v, mask, scale, group)
