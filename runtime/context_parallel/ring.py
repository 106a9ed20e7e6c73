"""Ring attention: key/value blocks travel round the context-parallel group while each rank's
queries stay put.

Rank ``r`` of ``cp`` holds queries, keys and values of chunks ``r`` and ``2cp - 1 - r``
(``runtime.context_parallel.layout``). Forward runs ``cp`` steps: at step ``t`` the rank holds the
key/value block of rank ``(r - t) mod cp``, posts its send to the next rank and the receive of
the following block from the previous one, computes its queries against the block it holds while
the transfer is in flight (``blocks.block_forward``, merged by log-sum-exp), then waits. Each
rank sends ``cp - 1`` blocks of ``2 * (seq_len / cp) * kv_heads * head_dim`` elements per layer.

Backward walks the same ring with the forward's ``out`` and ``lse``: the block's gradient
contributions (``blocks.block_backward``) accumulate into a float32 key/value gradient that
travels with the block; after the last step one more pass brings each block's gradient home to its
owner. Queries' gradients stay local. The communication is therefore: forward ``cp - 1`` blocks,
backward ``cp - 1`` blocks plus ``cp`` gradient blocks (float32) per rank and layer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from runtime.context_parallel.blocks import AttentionMask, Span, block_backward, block_forward, heads_inner, merge
from runtime.context_parallel.layout import chunk_indices
from runtime.distributed import comm

__all__ = ["RingAttention", "ring_attention"]


class _Ring:
    """This rank's neighbours in the group: blocks go to ``next`` and come from ``previous``."""

    def __init__(self, group: Any):
        self.group = group
        self.size = comm.group_size(group)
        self.index = dist.get_rank(group) if self.size > 1 else 0
        if self.size > 1:
            ranks = dist.get_process_group_ranks(group)
            self.next, self.previous = ranks[(self.index + 1) % self.size], ranks[self.index - 1]

    def owner(self, step: int) -> int:
        """The group index of the rank whose block this rank holds at ``step``."""
        return (self.index - step) % self.size

    def pass_on(self, block: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Post the send of ``block`` to the next rank and the receive of the previous rank's
        into a new buffer; returns the buffer and the handles to wait for."""
        incoming = torch.empty_like(block)
        return incoming, [comm.isend(block, self.next, self.group), comm.irecv(incoming, self.previous, self.group)]


def _spans(index: int, size: int, chunk: int) -> list[Span]:
    return [Span(i * chunk, chunk) for i in chunk_indices(index, size)]


class RingAttention(torch.autograd.Function):
    """``out = softmax(q k^T * scale, masked) v`` over the whole sequence, for this rank's queries
    (``[b, heads, n, d]``, ``n = seq_len / cp``) with keys and values ``[b, kv_heads, n, d]`` held
    in the layout's chunks across the group (see the module doc)."""

    @staticmethod
    def forward(ctx: Any, q, k, v, mask: AttentionMask, scale: float, group: Any):
        ring = _Ring(group)
        chunk = q.shape[2] // 2
        mine = _spans(ring.index, ring.size, chunk)
        block = torch.stack([k, v]).contiguous()
        acc: list = [None, None]
        for step in range(ring.size):
            pending: list = []
            if step < ring.size - 1:
                incoming, pending = ring.pass_on(block)
            theirs = _spans(ring.owner(step), ring.size, chunk)
            for a, q_part in enumerate(q.split(chunk, dim=2)):
                for b, (k_part, v_part) in enumerate(zip(block[0].split(chunk, dim=2), block[1].split(chunk, dim=2))):
                    acc[a] = merge(acc[a], block_forward(q_part, k_part, v_part, mask, mine[a], theirs[b], scale))
            for handle in pending:
                comm.wait(handle)
            if pending:
                block = incoming
        out = heads_inner(torch.cat([part[0] for part in acc], dim=2), q.dtype)
        lse = torch.cat([part[1] for part in acc], dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.scale, ctx.group = mask, scale, group
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        out = out.float()
        ring = _Ring(ctx.group)
        chunk = q.shape[2] // 2
        mine = _spans(ring.index, ring.size, chunk)
        dout = grad_out.float()
        delta = (dout * out).sum(-1)
        grads = [(d, o, s, e) for d, o, s, e in zip(*(t.split(chunk, dim=2) for t in (dout, out, lse, delta)))]
        dq = torch.zeros_like(q, dtype=torch.float32)
        dq_parts = dq.split(chunk, dim=2)
        block = torch.stack([k, v]).contiguous()
        dblock = torch.zeros_like(block, dtype=torch.float32)
        for step in range(ring.size):
            pending: list = []
            if step < ring.size - 1:
                incoming, pending = ring.pass_on(block)
            theirs = _spans(ring.owner(step), ring.size, chunk)
            _accumulate(q, block, dblock, (grads, dq_parts), (mine, theirs), ctx)
            for handle in pending:
                comm.wait(handle)
            if pending:
                block = incoming
            if ring.size > 1:  # the gradient follows its block, one more pass after the last step
                arriving, moving = ring.pass_on(dblock)
                for handle in moving:
                    comm.wait(handle)
                dblock = arriving
        return dq.to(q.dtype), dblock[0].to(k.dtype), dblock[1].to(v.dtype), None, None, None


def _accumulate(q, block, dblock, grads_and_dq, spans, ctx) -> None:
    """Add one visiting block's contributions to this rank's query gradient and to the block's
    travelling key/value gradient (every pair of a query chunk and a key chunk)."""
    grads, dq_parts = grads_and_dq
    mine, theirs = spans
    chunk = q.shape[2] // 2
    keys, values = block[0].split(chunk, dim=2), block[1].split(chunk, dim=2)
    dkeys, dvalues = dblock[0].split(chunk, dim=2), dblock[1].split(chunk, dim=2)
    for a, q_part in enumerate(q.split(chunk, dim=2)):
        for b in range(2):
            part = block_backward(q_part, keys[b], values[b], grads[a], ctx.mask, mine[a], theirs[b], ctx.scale)
            if part is None:
                continue
            dq_parts[a].add_(part[0])
            dkeys[b].add_(part[1])
            dvalues[b].add_(part[2])


def ring_attention(q, k, v, mask: AttentionMask, scale: float, group: Any) -> torch.Tensor:
    """``RingAttention.apply`` with keyword-friendly arguments (see the class)."""
    return RingAttention.apply(q, k, v, mask, scale, group)
