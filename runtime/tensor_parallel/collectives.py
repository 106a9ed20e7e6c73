"""The tensor-parallel collectives and the autograd functions built on them.

Helpers of :mod:`runtime.tensor_parallel`: each takes a *resolved* group (``None`` only when
there is nothing to communicate with) and issues its collective through
:mod:`runtime.distributed.comm`, so its bytes are counted. The public entry points that
generated stage code calls (``copy_to_tp``, ``all_gather_seq``, ...) live in the package itself.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from runtime.distributed import comm

__all__ = [
    "all_reduce_",
    "gather_along",
    "reduce_scatter_along",
    "split_along",
    "CopyToTP",
    "ReduceFromTP",
    "GatherFromTP",
    "ScatterToTP",
    "AllGatherSeq",
    "ReduceScatterSeq",
    "VocabParallelCrossEntropy",
]


def _group_size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def all_reduce_(tensor: torch.Tensor, group: Any, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce a contiguous tensor in place over ``group`` (a resolved group); returns it."""
    if group is not None and dist.get_world_size(group) > 1:
        comm.all_reduce(tensor, group=group, op=op)
    return tensor


def gather_along(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Concatenate the equal-shaped ``x`` of every rank along ``dim`` (rank order)."""
    n = _group_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    x = x.contiguous()
    out = torch.empty((n * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather_into(out, x, group=group)
    if dim == 0:
        return out
    return torch.cat(out.chunk(n, dim=0), dim=dim)


def reduce_scatter_along(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep this rank's contiguous chunk along ``dim``."""
    n = _group_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    if x.shape[dim] % n:
        raise ValueError(
            f"cannot reduce-scatter dim {dim} of size {x.shape[dim]} over {n} tensor-parallel "
            f"ranks: {x.shape[dim]} is not divisible by {n}"
        )
    full = x.movedim(dim, 0).contiguous()  # the collective splits the leading dim
    out = torch.empty((full.shape[0] // n,) + tuple(full.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter_into(out, full, group=group)
    return out.movedim(0, dim).contiguous() if dim else out


def split_along(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """This rank's contiguous chunk of ``x`` along ``dim``."""
    n = _group_size(group)
    if n == 1:
        return x
    size = x.shape[dim]
    if size % n:
        raise ValueError(
            f"cannot split dim {dim} of size {size} over {n} tensor-parallel ranks: {size} is not divisible by {n}"
        )
    return x.chunk(n, dim=dim)[dist.get_rank(group)].contiguous()


# --------------------------------------------------------------------------------------------
# Conjugate autograd functions
# --------------------------------------------------------------------------------------------


class CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        # The engine may hand the same gradient tensor to other consumers: reduce a copy.
        return all_reduce_(grad_out.clone(memory_format=torch.contiguous_format), ctx.group), None


class ReduceFromTP(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return all_reduce_(x.clone(memory_format=torch.contiguous_format), group)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        return grad_out, None


class GatherFromTP(torch.autograd.Function):
    """Concatenate shards along ``dim`` forward; keep this rank's chunk backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return gather_along(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        return split_along(grad_out, ctx.dim, ctx.group), None, None


class ScatterToTP(torch.autograd.Function):
    """Keep this rank's chunk along ``dim`` forward; concatenate the gradients backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return split_along(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        return gather_along(grad_out, ctx.dim, ctx.group), None, None


class AllGatherSeq(torch.autograd.Function):
    """All-gather the sequence shards forward; reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return gather_along(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        return reduce_scatter_along(grad_out, ctx.dim, ctx.group), None, None


class ReduceScatterSeq(torch.autograd.Function):
    """Reduce-scatter along the sequence forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return reduce_scatter_along(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        return gather_along(grad_out, ctx.dim, ctx.group), None, None


# --------------------------------------------------------------------------------------------
# Vocabulary-parallel cross-entropy
# --------------------------------------------------------------------------------------------


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over vocabulary-split logits; see :mod:`runtime.tensor_parallel` for the math
    (``m`` the global max logit, ``S`` the global sum of ``exp(z - m)``, ``z_y`` the target logit; ``scores`` holds
    ``z``)."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_start: int,
        vocab_size: int | None,
        ignore_index: int,
        reduction: str,
        group: Any,
    ) -> torch.Tensor:
        shard = logits.shape[-1]
        scores = logits.float().reshape(-1, shard)
        targets = labels.reshape(-1)
        if scores.shape[0] != targets.shape[0]:
            raise ValueError(
                f"logits have {scores.shape[0]} tokens (shape {tuple(logits.shape)}) but labels have "
                f"{targets.shape[0]} (shape {tuple(labels.shape)}); they must match except the vocab dim"
            )
        if vocab_size is not None and vocab_start + shard > vocab_size:
            # Padded columns (global index >= vocab_size) take no part in the softmax.
            pad_from = max(0, vocab_size - vocab_start)
            scores = scores.clone()
            scores[:, pad_from:] = float("-inf")
        max_logit = scores.amax(dim=-1)  # amax, not max: no indices to compute
        all_reduce_(max_logit, group, dist.ReduceOp.MAX)
        scores = scores - max_logit.unsqueeze(-1)
        exp_scores = scores.exp()
        exp_sum = exp_scores.sum(dim=-1)
        all_reduce_(exp_sum, group)
        valid = targets != ignore_index
        mine = valid & (targets >= vocab_start) & (targets < vocab_start + shard)
        local = (targets - vocab_start).masked_fill(~mine, 0)
        target_logit = scores.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(~mine, 0.0)
        all_reduce_(target_logit, group)
        per_token = (exp_sum.log() - target_logit).masked_fill(~valid, 0.0)
        count = valid.sum()  # a tensor: no host-device synchronisation
        if reduction == "mean":
            loss = per_token.sum() / count  # nan when every label is ignored, like torch
        elif reduction == "sum":
            loss = per_token.sum()
        else:
            loss = per_token.reshape(labels.shape)
        exp_scores.div_(exp_sum.unsqueeze(-1))  # softmax of the shard, reused as the gradient buffer
        ctx.save_for_backward(exp_scores, local, mine, valid, count)
        ctx.reduction, ctx.dtype, ctx.shape = reduction, logits.dtype, logits.shape
        return loss.to(logits.dtype)

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple:
        softmax, local, mine, valid, count = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local] -= mine.to(grad.dtype)  # subtract the one-hot of owned targets
        if ctx.reduction == "none":
            weight = grad_loss.float().reshape(-1)
        elif ctx.reduction == "mean":
            weight = grad_loss.float() / count.clamp(min=1)
            weight = weight.expand(grad.shape[0])
        else:
            weight = grad_loss.float().expand(grad.shape[0])
        grad.mul_((weight * valid.to(weight.dtype)).unsqueeze(-1))
        return grad.to(ctx.dtype).reshape(ctx.shape), None, None, None, None, None, None
