"""What compiled stages call under context parallelism (``codegen.context_rewrite`` writes the calls).

Each function reads this rank's mesh (``runtime.distributed.mesh.get_mesh``: ``cp``, ``cp_group``,
``cp_index``) and the method the trainer set from the manifest's ``context_parallel.method``
(``set_method``). With ``cp == 1`` (or no mesh: a stage file imported on its own) each is exactly the
single-process computation the traced graph did.

The graph is traced at the local length ``n = seq_len / cp`` (``planner compile`` exports the model
at it), so every shape the graph bakes is already this rank's; only what depends on *which*
positions a rank holds goes through here:

- ``attention``: every attention core; its mask is positional (causal, sliding window, block-sparse
  layout) and each rank applies it to the positions it holds.
- ``positions(n)``: the global positions of this rank's ``n`` local tokens (its two chunks,
  ``layout.local_positions``), where the graph built ``arange(n)`` for position ids or rotary angles.
- ``targets``: the loss's targets. A causal LM's targets are the next tokens, and the next token
  of a chunk's last position is the first token of the next chunk, which another rank holds; so
  the labels (integers, no gradient) are all-gathered over the cp group, shifted at full length
  exactly as the model shifts them (the last position ignored), and this rank's positions taken
  back. The trainer feeds every rank its chunks of the *unshifted* inputs (``shard_sequence``).
- ``sequence_mean``: the cross-entropy a rank computes is the mean over its own counted tokens;
  weighted by its share of the whole sequence's counted (non-ignored) tokens and summed over the
  cp group it is the one-process mean, the same value on every rank (the logged loss). Its
  backward multiplies the incoming gradient by ``cp``: gradients are *averaged* over the dp_cp
  group (``dp * cp`` ranks), which turns the sum over the cp group's shares into a mean over dp
  only, as one process computes it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from runtime.context_parallel.blocks import AttentionMask
from runtime.context_parallel.layout import gather_sequence, local_positions, shard_sequence
from runtime.context_parallel.methods import context_attention
from runtime.contract.choices import ContextMethod, names
from runtime.distributed import comm
from runtime.distributed.mesh import get_mesh
from runtime.sparse_attention import BlockSparseLayout, block_sparse_attention

__all__ = ["attention", "positions", "full_length", "targets", "sequence_mean", "set_method", "get_method"]

_METHOD = {"name": "ring"}


def set_method(method: str) -> None:
    """The method ``attention`` uses (plan.json ``context_parallel.method``); set by the trainer."""
    if method not in names(ContextMethod):
        raise ValueError(
            f"unknown context-parallel method {method!r}: expected one of {', '.join(names(ContextMethod))}"
        )
    _METHOD["name"] = method


def get_method() -> str:
    return _METHOD["name"]


def _degree() -> int:
    mesh = get_mesh()
    return mesh.cp if mesh.cp_group is not None else 1


def _layout(layout: Any) -> BlockSparseLayout | None:
    if layout is None or isinstance(layout, BlockSparseLayout):
        return layout
    block, local_blocks, global_blocks = (int(x) for x in layout)
    return BlockSparseLayout(block, local_blocks, global_blocks)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    window: int | None = None,
    scale: float | None = None,
    layout: Any = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Attention of this rank's queries ``[b, heads, n, d]`` over the whole sequence under the
    positional mask (``causal``, sliding ``window``, block-sparse ``layout``: a ``BlockSparseLayout``
    or ``(block, local_blocks, global_blocks)``). Keys and values may carry fewer heads (grouped-query
    attention, ``enable_gqa``, as SDPA takes them)."""
    sparse = _layout(layout)
    mask = AttentionMask(causal=causal, window=window, layout=sparse)
    if _degree() == 1:
        if sparse is not None:
            return block_sparse_attention(q, k, v, sparse, scale)
        if window is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=enable_gqa)
        where = torch.arange(q.shape[2], device=q.device)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask.visible(where, where), scale=scale, enable_gqa=enable_gqa
        )
    return context_attention(q, k, v, method=_METHOD["name"], mask=mask, scale=scale, group=get_mesh().cp_group)


def positions(n: int, device: torch.device | str | None = None, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """The global positions of this rank's ``n`` local tokens (``arange(n)`` without context
    parallelism): chunks ``cp_index`` and ``2 cp - 1 - cp_index`` of a sequence of ``n * cp``."""
    cp = _degree()
    if cp == 1:
        return torch.arange(n, device=device, dtype=dtype)
    return local_positions(n * cp, get_mesh().cp_index, cp, device).to(dtype)


def full_length(n: int) -> int:
    """The whole sequence's length when this rank holds ``n`` of its positions."""
    return n * _degree()


class _SumOverGroup(torch.autograd.Function):
    """Forward: the sum of ``x`` over ``group``. Backward: the incoming gradient times the group's
    size: the all-reduce of the gradients, which are the same on every rank (each computes the same
    sum), without a collective."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.size = comm.group_size(group)
        total = x.detach().clone()
        comm.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return grad * ctx.size, None


def _full_labels(labels: torch.Tensor, group: Any, cp: int) -> torch.Tensor:
    """The whole sequence's labels ``[b, n cp]`` in position order from every rank's ``[b, n]``."""
    gathered = labels.new_empty(cp * labels.numel())
    comm.all_gather_into(gathered, labels.contiguous().view(-1), group=group)
    return gather_sequence(list(gathered.view(cp, *labels.shape).unbind(0)), dim=1)


def targets(labels: torch.Tensor, *, shift: bool, ignore_index: int = -100) -> torch.Tensor:
    """The loss's targets ``[b, n]`` at this rank's positions: ``labels`` itself, or with ``shift``
    the label of the next position of the whole sequence (``ignore_index`` at its last position),
    as a causal LM shifts its labels before its cross-entropy."""
    cp = _degree()
    if cp == 1:
        return _shifted(labels, ignore_index) if shift else labels
    mesh = get_mesh()
    full = _full_labels(labels, mesh.cp_group, cp)
    return shard_sequence(_shifted(full, ignore_index) if shift else full, 1, mesh.cp_index, cp)


def _shifted(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), ignore_index)], 1)


def sequence_mean(loss: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100) -> torch.Tensor:
    """The whole sequence's mean token loss from this rank's mean ``loss`` over its ``targets``
    (those not ``ignore_index`` count): ``sum over the cp group of loss * counted / all counted``,
    the same on every rank of the group (module doc: its backward). ``loss`` itself without
    context parallelism."""
    cp = _degree()
    if cp == 1:
        return loss
    group = get_mesh().cp_group
    counted = (targets != ignore_index).sum().to(torch.float64)
    total = counted.clone()
    comm.all_reduce(total, group=group)
    share = (counted / total.clamp(min=1)).to(loss.dtype)
    return _SumOverGroup.apply(loss * share, group)
