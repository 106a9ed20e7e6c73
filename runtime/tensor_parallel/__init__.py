"""Megatron-style tensor parallelism as plain functions on tensors.

Generated stage code calls these functions directly, so each one takes tensors and a process
group and nothing else. ``group=None`` means "the tensor-parallel group of the current mesh"
(``runtime.distributed.mesh.get_mesh().tp_group``); when that is ``None`` too (tp = 1, or no process group)
every function degenerates to the plain single-device operation and communicates nothing.
Every collective goes through ``runtime.distributed.comm`` so its bytes are counted.

Notation: ``t`` ranks in the group, this rank is ``r``; a linear layer is ``y = x W^T + b`` with
``W`` of shape ``[out, in]`` (``nn.Linear`` layout).

The four conjugate autograd functions
-------------------------------------
``f = copy_to_tp``      forward ``y = x`` (x is replicated),   backward ``dx = sum_r dy_r``
``g = reduce_from_tp``  forward ``y = sum_r x_r``,               backward ``dx_r = dy``
``gather_from_tp``      forward ``y = cat_r x_r`` along dim,     backward ``dx_r = chunk_r(dy)``
``scatter_to_tp``       forward ``y = chunk_r(x)`` along dim,    backward ``dx = cat_r dy_r``

Each pair is the other's adjoint, which is what makes the gradients exact. Sequence parallelism
adds a fifth pair (below): ``all_gather_seq`` / ``reduce_scatter_seq``.

Layers
------
* Column parallel: ``W`` split by rows (output features), ``W_r = W[r*o/t:(r+1)*o/t]``. With
  ``x`` replicated, ``y_r = f(x) W_r^T + b_r`` is this rank's slice of the output features. The
  backward of ``f`` sums the partial input gradients ``dy_r W_r`` of all ranks.
* Row parallel: ``W`` split by columns (input features). With the input already split the same
  way (the output of a column-parallel layer), ``y = g(x_r W_r^T) + b``: the partial products are
  summed by one all-reduce and the replicated bias is added once, after the reduction.
* A Megatron MLP is column (fc1) -> elementwise activation -> row (fc2): one all-reduce in the
  forward and one in the backward. Attention is split by heads: q/k/v are column parallel over
  whole heads (``shard_heads``), attention runs on local heads, the output projection is row
  parallel.
* Vocabulary parallel embedding: rank ``r`` holds rows ``[start, end)`` of the table; ids outside
  the range look up row 0 and are zeroed, and an all-reduce sums the one non-zero contribution.
* Vocabulary parallel cross-entropy on logits split by vocabulary (the output of a column
  parallel LM head): with ``m = max_r max_j z_rj`` (all-reduce MAX), ``S = sum_r sum_j
  exp(z_rj - m)`` (all-reduce SUM) and the target logit ``z_y`` (all-reduce SUM of the one rank
  that owns it), the loss of a token is ``log S - (z_y - m)``. Its gradient with respect to the
  local logits is ``softmax_rj - [j == y]``, computed locally from the saved shard softmax, so the
  full ``[tokens, vocab]`` logits never exist on one rank.

Sequence parallelism (Megatron, Korthikanti et al. 2022)
--------------------------------------------------------
Outside the parallel matmuls (norms, residual adds, dropout) plain tp computes the same
``[b, s, h]`` activations on every rank. Sequence parallelism keeps only this rank's positions
``chunk_r`` along the sequence dim ``d`` there (``s / t`` of them), and swaps the conjugate pair at
the region's edges for one whose collectives move the same bytes as the all-reduce they replace::

    all_gather_seq      forward ``y = cat_r x_r`` along d,        backward ``dx_r = chunk_r(sum_r' dy_r')``
    reduce_scatter_seq  forward ``y_r = chunk_r(sum_r' x_r')``,    backward ``dx = cat_r dy_r``

(an all-reduce is a reduce-scatter followed by an all-gather). Column parallel: ``y_r =
all_gather_seq(x_r) W_r^T + b_r`` (the backward reduce-scatters the partial input gradients of all
ranks: each keeps the sum for its positions). Row parallel: ``y_r = reduce_scatter_seq(x_r W_r^T) +
b``. The vocabulary-parallel embedding reduce-scatters instead of all-reducing. A replicated
parameter used on sequence shards (a norm's weight and bias, the row-parallel bias) sees only this
rank's tokens, so its gradient passes through ``copy_to_tp`` (all-reduced over the group); a
replicated full-length tensor that meets a sequence shard (a position embedding) passes through
``scatter_to_tp`` along its sequence dim (each rank keeps its positions, the gradient is gathered).

Dropout on a shard
------------------
``sharded_dropout`` replaces dropout on a tensor each rank holds a block of (heads, or the sequence
under sequence parallelism): the mask of the whole tensor is drawn from the random stream the tp
ranks share and each rank applies its block, so the ranks' masks are independent, as one
process's would be, and the streams stay in step.

Vocabulary padding
------------------
``vocab_range`` splits a vocabulary that ``t`` does not divide by padding it up to
``ceil(V / t) * t`` rows: every rank holds the same number of rows (collectives need equal
shapes) and rows ``>= V`` are padding. Padded embedding rows are zero and never looked up (ids are
``< V``); padded logit columns must be excluded from the softmax, which the cross-entropy does
when given ``vocab_size=V``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from runtime.distributed import comm
from runtime.distributed.mesh import get_mesh

__all__ = [
    "resolve_group",
    "tp_world_size",
    "tp_rank",
    "copy_to_tp",
    "reduce_from_tp",
    "gather_from_tp",
    "scatter_to_tp",
    "all_gather_seq",
    "reduce_scatter_seq",
    "column_parallel_linear",
    "row_parallel_linear",
    "vocab_parallel_embedding",
    "vocab_parallel_cross_entropy",
    "shard_dim",
    "shard_heads",
    "shard_qkv",
    "vocab_range",
    "padded_vocab_size",
    "shard_vocab",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "ParallelLMHeadLoss",
    "EAGER_ONLY",
    "sharded_dropout",
]

#: The entry points a ``torch.compile``'d layer calls eagerly (``runtime.compile`` wraps them in
#: ``torch.compiler.disable`` when a plan compiles its stages): each issues collectives through
#: ``runtime.distributed.comm`` (Python with timers and byte counters) or asks the mesh for the group, so
#: each call is a clean graph break and the layer compiles into the regions between them. The
#: parallel linear layers (``column_parallel_linear``, ``row_parallel_linear``) are traced, with
#: their matmul and bias, up to these calls.
EAGER_ONLY: tuple[str, ...] = (
    "resolve_group",
    "tp_world_size",
    "tp_rank",
    "copy_to_tp",
    "reduce_from_tp",
    "gather_from_tp",
    "scatter_to_tp",
    "all_gather_seq",
    "reduce_scatter_seq",
    "vocab_parallel_embedding",
    "vocab_parallel_cross_entropy",
    "sharded_dropout",
)


# --------------------------------------------------------------------------------------------
# Groups
# --------------------------------------------------------------------------------------------


def resolve_group(group=None):
    """The group to use: ``group`` itself, or the mesh's tp group when ``group`` is None.

    Returns ``None`` when there is nothing to communicate with (tp = 1 or no process group).
    Callers must not hand that ``None`` to ``runtime.distributed.comm``, where it means the default group.
    """
    g = get_mesh().tp_group if group is None else group
    if g is not None and not dist.is_initialized():
        raise RuntimeError(
            "a tensor-parallel group was given but torch.distributed is not initialized; "
            "call runtime.distributed.launch.init_distributed() and runtime.distributed.mesh.setup_mesh() first"
        )
    return g


def tp_world_size(group=None) -> int:
    """Number of ranks in the (resolved) tensor-parallel group; 1 without one."""
    g = resolve_group(group)
    return 1 if g is None else dist.get_world_size(g)


def tp_rank(group=None) -> int:
    """This rank's index inside the (resolved) tensor-parallel group; 0 without one."""
    g = resolve_group(group)
    return 0 if g is None else dist.get_rank(g)


def _all_reduce(t: torch.Tensor, g, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce a contiguous tensor in place over ``g`` (a resolved group); returns it."""
    if g is not None and dist.get_world_size(g) > 1:
        comm.all_reduce(t, group=g, op=op)
    return t


def _all_gather(x: torch.Tensor, dim: int, g) -> torch.Tensor:
    """Concatenate the equal-shaped ``x`` of every rank along ``dim`` (rank order)."""
    n = 1 if g is None else dist.get_world_size(g)
    if n == 1:
        return x
    dim = dim % x.dim()
    x = x.contiguous()
    out = torch.empty((n * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather_into(out, x, group=g)
    if dim == 0:
        return out
    return torch.cat(out.chunk(n, dim=0), dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, g) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep this rank's contiguous chunk along ``dim``."""
    n = 1 if g is None else dist.get_world_size(g)
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
    comm.reduce_scatter_into(out, full, group=g)
    return out.movedim(0, dim).contiguous() if dim else out


def _split(x: torch.Tensor, dim: int, g) -> torch.Tensor:
    """This rank's contiguous chunk of ``x`` along ``dim``."""
    n = 1 if g is None else dist.get_world_size(g)
    if n == 1:
        return x
    size = x.shape[dim]
    if size % n:
        raise ValueError(
            f"cannot split dim {dim} of size {size} over {n} tensor-parallel ranks: {size} is not divisible by {n}"
        )
    return x.chunk(n, dim=dim)[dist.get_rank(g)].contiguous()


# --------------------------------------------------------------------------------------------
# Conjugate autograd functions
# --------------------------------------------------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x, g):
        ctx.g = g
        return x

    @staticmethod
    def backward(ctx, dy):
        # The engine may hand the same gradient tensor to other consumers: reduce a copy.
        return _all_reduce(dy.clone(memory_format=torch.contiguous_format), ctx.g), None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx, x, g):
        return _all_reduce(x.clone(memory_format=torch.contiguous_format), g)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _GatherFromTP(torch.autograd.Function):
    """Concatenate shards along ``dim`` forward; keep this rank's chunk backward."""

    @staticmethod
    def forward(ctx, x, dim, g):
        ctx.dim, ctx.g = dim, g
        return _all_gather(x, dim, g)

    @staticmethod
    def backward(ctx, dy):
        return _split(dy, ctx.dim, ctx.g), None, None


class _ScatterToTP(torch.autograd.Function):
    """Keep this rank's chunk along ``dim`` forward; concatenate the gradients backward."""

    @staticmethod
    def forward(ctx, x, dim, g):
        ctx.dim, ctx.g = dim, g
        return _split(x, dim, g)

    @staticmethod
    def backward(ctx, dy):
        return _all_gather(dy, ctx.dim, ctx.g), None, None


class _AllGatherSeq(torch.autograd.Function):
    """All-gather the sequence shards forward; reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx, x, dim, g):
        ctx.dim, ctx.g = dim, g
        return _all_gather(x, dim, g)

    @staticmethod
    def backward(ctx, dy):
        return _reduce_scatter(dy, ctx.dim, ctx.g), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    """Reduce-scatter along the sequence forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, dim, g):
        ctx.dim, ctx.g = dim, g
        return _reduce_scatter(x, dim, g)

    @staticmethod
    def backward(ctx, dy):
        return _all_gather(dy, ctx.dim, ctx.g), None, None


def copy_to_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Enter a tensor-parallel region: identity forward, gradient all-reduced backward."""
    g = resolve_group(group)
    return x if g is None else _CopyToTP.apply(x, g)


def reduce_from_tp(x: torch.Tensor, group=None) -> torch.Tensor:
    """Leave a tensor-parallel region by summing partial results: all-reduce forward."""
    g = resolve_group(group)
    return x if g is None else _ReduceFromTP.apply(x, g)


def gather_from_tp(x: torch.Tensor, dim: int = -1, group=None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (forward); split the gradient (backward)."""
    g = resolve_group(group)
    return x if g is None else _GatherFromTP.apply(x, dim, g)


def scatter_to_tp(x: torch.Tensor, dim: int = -1, group=None) -> torch.Tensor:
    """Keep this rank's chunk of ``x`` along ``dim`` (forward); gather the gradient (backward)."""
    g = resolve_group(group)
    return x if g is None else _ScatterToTP.apply(x, dim, g)


def all_gather_seq(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """Enter a tensor-parallel region from a sequence-parallel one: concatenate every rank's
    positions along ``dim`` (forward); reduce-scatter the partial gradients (backward)."""
    g = resolve_group(group)
    return x if g is None else _AllGatherSeq.apply(x, dim, g)


def reduce_scatter_seq(x: torch.Tensor, dim: int = 1, group=None) -> torch.Tensor:
    """Leave a tensor-parallel region into a sequence-parallel one: sum the partial results and
    keep this rank's positions along ``dim`` (forward); all-gather the gradient (backward)."""
    g = resolve_group(group)
    return x if g is None else _ReduceScatterSeq.apply(x, dim, g)


def sharded_dropout(x: torch.Tensor, p: float, train: bool, dim: int, group=None) -> torch.Tensor:
    """Dropout of this rank's shard along ``dim`` of a tensor split over the tp ranks (heads, or
    the sequence under sequence parallelism): the keep-mask of the *whole* tensor is drawn from
    the random stream every tp rank shares, and each rank uses its block of it. The ranks' masks
    are then independent of each other (plain dropout on a shard would repeat one mask on every
    rank), a checkpoint's recompute draws the same mask again (it restores that stream), and the
    streams of the tp ranks stay in step for the replicated dropouts that follow."""
    g = resolve_group(group)
    if not train or p == 0.0:
        return x
    if g is None or dist.get_world_size(g) == 1:
        return F.dropout(x, p, True)
    n = dist.get_world_size(g)
    dim = dim % x.dim()
    shape = list(x.shape)
    shape[dim] *= n
    keep = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1.0 - p)
    # a bool copy of this rank's block: what backward keeps (as plain dropout's mask), not the whole draw
    mask = keep.narrow(dim, dist.get_rank(g) * x.shape[dim], x.shape[dim]).to(torch.bool)
    return x * mask / (1.0 - p)


# --------------------------------------------------------------------------------------------
# Parallel layers as functions
# --------------------------------------------------------------------------------------------


def column_parallel_linear(
    x: torch.Tensor,
    weight_shard: torch.Tensor,
    bias_shard: torch.Tensor | None = None,
    group=None,
    gather_output: bool = False,
    sequence_dim: int | None = None,
) -> torch.Tensor:
    """``y_r = x W_r^T + b_r`` with ``W_r`` this rank's rows of ``W`` (output features).

    ``x`` is replicated over the group, or with ``sequence_dim`` this rank's positions along that
    dim (sequence parallelism: gathered first); the result holds this rank's output features for
    every position, or all of them (gathered along the last dim) with ``gather_output=True``.
    """
    x = copy_to_tp(x, group) if sequence_dim is None else all_gather_seq(x, sequence_dim, group)
    y = F.linear(x, weight_shard, bias_shard)
    return gather_from_tp(y, -1, group) if gather_output else y


def row_parallel_linear(
    x: torch.Tensor,
    weight_shard: torch.Tensor,
    bias: torch.Tensor | None = None,
    group=None,
    input_is_parallel: bool = True,
    sequence_dim: int | None = None,
) -> torch.Tensor:
    """``y = sum_r x_r W_r^T + b`` with ``W_r`` this rank's columns of ``W`` (input features).

    ``x`` is this rank's slice of the input features (``input_is_parallel=True``, the output of a
    column-parallel layer) or the full input, which is then split here. The replicated ``bias``
    is added once, after the all-reduce, so it is not counted ``t`` times. With ``sequence_dim``
    (sequence parallelism) the sum is reduce-scattered along that dim instead, so the result holds
    this rank's positions only; the bias, added to them, then passes through ``copy_to_tp`` (each
    rank's gradient covers its positions: the backward sums them).
    """
    if not input_is_parallel:
        x = scatter_to_tp(x, -1, group)
    y = F.linear(x, weight_shard)
    if sequence_dim is None:
        y = reduce_from_tp(y, group)
        return y if bias is None else y + bias
    y = reduce_scatter_seq(y, sequence_dim, group)
    return y if bias is None else y + copy_to_tp(bias, group)


def vocab_parallel_embedding(
    ids: torch.Tensor,
    weight_shard: torch.Tensor,
    vocab_start: int,
    group=None,
    sequence_dim: int | None = None,
) -> torch.Tensor:
    """Embedding lookup with the table split by rows (vocabulary) over the group.

    This rank owns ids ``[vocab_start, vocab_start + weight_shard.shape[0])``. Other ids read row
    0 and are zeroed; the all-reduce then adds the single owner's row to every rank. With
    ``sequence_dim`` (sequence parallelism, a dim of ``ids``) a reduce-scatter along it replaces
    the all-reduce: each rank keeps the embeddings of its positions.
    """
    g = resolve_group(group)
    if g is None:
        return F.embedding(ids - vocab_start if vocab_start else ids, weight_shard)
    rows = weight_shard.shape[0]
    outside = (ids < vocab_start) | (ids >= vocab_start + rows)
    local = (ids - vocab_start).masked_fill(outside, 0)
    out = F.embedding(local, weight_shard).masked_fill(outside.unsqueeze(-1), 0.0)
    return reduce_from_tp(out, g) if sequence_dim is None else reduce_scatter_seq(out, sequence_dim, g)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over vocabulary-split logits; see the module docstring for the math."""

    @staticmethod
    def forward(ctx, logits, labels, vocab_start, vocab_size, ignore_index, reduction, g):
        shard = logits.shape[-1]
        z = logits.float().reshape(-1, shard)
        y = labels.reshape(-1)
        if z.shape[0] != y.shape[0]:
            raise ValueError(
                f"logits have {z.shape[0]} tokens (shape {tuple(logits.shape)}) but labels have "
                f"{y.shape[0]} (shape {tuple(labels.shape)}); they must match except the vocab dim"
            )
        if vocab_size is not None and vocab_start + shard > vocab_size:
            # Padded columns (global index >= vocab_size) take no part in the softmax.
            pad_from = max(0, vocab_size - vocab_start)
            z = z.clone()
            z[:, pad_from:] = float("-inf")
        m = z.amax(dim=-1)  # amax, not max: no indices to compute
        _all_reduce(m, g, dist.ReduceOp.MAX)
        z = z - m.unsqueeze(-1)
        e = z.exp()
        s = e.sum(dim=-1)
        _all_reduce(s, g)
        valid = y != ignore_index
        mine = valid & (y >= vocab_start) & (y < vocab_start + shard)
        local = (y - vocab_start).masked_fill(~mine, 0)
        target = z.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(~mine, 0.0)
        _all_reduce(target, g)
        per_token = (s.log() - target).masked_fill(~valid, 0.0)
        count = valid.sum()  # a tensor: no host-device synchronisation
        if reduction == "mean":
            loss = per_token.sum() / count  # nan when every label is ignored, like torch
        elif reduction == "sum":
            loss = per_token.sum()
        else:
            loss = per_token.reshape(labels.shape)
        e.div_(s.unsqueeze(-1))  # softmax of the shard, reused as the gradient buffer
        ctx.save_for_backward(e, local, mine, valid, count)
        ctx.reduction, ctx.dtype, ctx.shape = reduction, logits.dtype, logits.shape
        return loss.to(logits.dtype)

    @staticmethod
    def backward(ctx, dloss):
        p, local, mine, valid, count = ctx.saved_tensors
        grad = p.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local] -= mine.to(grad.dtype)  # subtract the one-hot of owned targets
        if ctx.reduction == "none":
            w = dloss.float().reshape(-1)
        elif ctx.reduction == "mean":
            w = dloss.float() / count.clamp(min=1)
            w = w.expand(grad.shape[0])
        else:
            w = dloss.float().expand(grad.shape[0])
        grad.mul_((w * valid.to(w.dtype)).unsqueeze(-1))
        return grad.to(ctx.dtype).reshape(ctx.shape), None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int = 0,
    group=None,
    ignore_index: int = -100,
    vocab_size: int | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of logits split by vocabulary, without gathering the full logits.

    ``logits_shard``: ``[..., V_r]``, this rank's columns ``[vocab_start, vocab_start + V_r)``.
    ``labels``: ``[...]`` global class ids (replicated over the group), ``ignore_index`` skipped.
    ``vocab_size``: the true vocabulary when it was padded (columns at or beyond it are ignored).
    ``reduction``: ``mean`` over non-ignored tokens (default), ``sum``, or ``none``.
    Three all-reduces of ``[tokens]`` fp32 vectors (max, sum of exp, target logit) in forward;
    nothing in backward. The math is computed in fp32 whatever the logits dtype.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels must be an integer tensor of class ids, got {labels.dtype}")
    g = resolve_group(group)
    return _VocabParallelCrossEntropy.apply(
        logits_shard, labels.long(), int(vocab_start), vocab_size, ignore_index, reduction, g
    )


# --------------------------------------------------------------------------------------------
# Shard helpers (pure: no communication)
# --------------------------------------------------------------------------------------------


def _check_rank(rank: int, world: int) -> None:
    if world < 1:
        raise ValueError(f"tensor-parallel world size must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside the tensor-parallel group of {world} ranks")


def shard_dim(full: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous chunk of ``full`` along ``dim``, as a new contiguous tensor.

    The chunk is ``[rank * n / world, (rank + 1) * n / world)`` of the ``n`` entries of ``dim``;
    ``world`` must divide ``n``. The copy owns its memory, so ``full`` can be freed afterwards.
    """
    _check_rank(rank, world)
    d = dim % full.dim() if full.dim() else 0
    n = full.shape[d]
    if n % world:
        raise ValueError(
            f"cannot shard dim {dim} (size {n}) of a tensor of shape {tuple(full.shape)} over "
            f"{world} tensor-parallel ranks: {n} is not divisible by {world}; choose a tp "
            f"degree that divides {n}"
        )
    k = n // world
    return full.narrow(d, rank * k, k).clone(memory_format=torch.contiguous_format)


def shard_heads(
    weight: torch.Tensor, num_heads: int, head_dim: int, rank: int, world: int, dim: int = 0
) -> torch.Tensor:
    """This rank's whole heads of a q, k or v projection (weight or bias) laid out head-major.

    ``weight.shape[dim]`` must be ``num_heads * head_dim`` with head ``h`` at
    ``[h * head_dim, (h + 1) * head_dim)``. Rank ``r`` takes heads ``[r*num_heads/world,
    (r+1)*num_heads/world)``. For grouped-query attention call it with the query head count for
    q and the kv head count for k and v: query head ``h`` uses kv head ``h // (H / K)``, and the
    contiguous split gives rank ``r`` exactly the kv heads its query heads use. ``dim=0`` for the
    ``[out, in]`` weight of a q/k/v ``nn.Linear`` (and its bias); ``dim=1`` for the output
    projection, whose input features are the heads.
    """
    _check_rank(rank, world)
    d = dim % weight.dim()
    if num_heads < 1 or head_dim < 1:
        raise ValueError(f"num_heads ({num_heads}) and head_dim ({head_dim}) must be >= 1")
    if weight.shape[d] != num_heads * head_dim:
        raise ValueError(
            f"dim {dim} of the projection has size {weight.shape[d]}, expected num_heads x "
            f"head_dim = {num_heads} x {head_dim} = {num_heads * head_dim}"
        )
    if num_heads % world:
        raise ValueError(
            f"cannot split {num_heads} heads over {world} tensor-parallel ranks: not divisible; "
            f"the tp degree must divide both the query and the key/value head counts"
        )
    return shard_dim(weight, d, rank, world)


def shard_qkv(
    weight: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rank: int,
    world: int,
    dim: int = 0,
) -> torch.Tensor:
    """This rank's part of a fused ``[q; k; v]`` projection, as ``[q_r; k_r; v_r]``.

    ``weight.shape[dim]`` is ``(num_heads + 2 * num_kv_heads) * head_dim`` (q first, then k,
    then v); each part is split by heads with ``shard_heads``. Use ``dim=1`` for a GPT-2
    ``Conv1D`` (``[in, out]`` layout).
    """
    d = dim % weight.dim()
    q_n, kv_n = num_heads * head_dim, num_kv_heads * head_dim
    if weight.shape[d] != q_n + 2 * kv_n:
        raise ValueError(
            f"dim {dim} of the fused qkv projection has size {weight.shape[d]}, expected "
            f"({num_heads} + 2 x {num_kv_heads}) x {head_dim} = {q_n + 2 * kv_n}"
        )
    q, k, v = weight.split([q_n, kv_n, kv_n], dim=d)
    return torch.cat(
        [
            shard_heads(q, num_heads, head_dim, rank, world, d),
            shard_heads(k, num_kv_heads, head_dim, rank, world, d),
            shard_heads(v, num_kv_heads, head_dim, rank, world, d),
        ],
        dim=d,
    )


def padded_vocab_size(vocab: int, world: int) -> int:
    """``vocab`` rounded up to a multiple of ``world`` (every rank holds the same rows)."""
    if vocab < 1:
        raise ValueError(f"vocabulary size must be >= 1, got {vocab}")
    _check_rank(0, world)
    return math.ceil(vocab / world) * world


def vocab_range(vocab: int, rank: int, world: int) -> tuple[int, int]:
    """``(start, end)`` of the rows of the (padded) vocabulary owned by ``rank``.

    The vocabulary is padded up to ``padded_vocab_size(vocab, world)`` so that every rank holds
    ``ceil(vocab / world)`` rows; ``end`` may exceed ``vocab`` on the last ranks, and rows at or
    beyond ``vocab`` are padding (zero embedding rows, logits excluded by passing ``vocab_size``
    to ``vocab_parallel_cross_entropy``).
    """
    _check_rank(rank, world)
    per = padded_vocab_size(vocab, world) // world
    return rank * per, (rank + 1) * per


def shard_vocab(full: torch.Tensor, rank: int, world: int, dim: int = 0) -> torch.Tensor:
    """This rank's rows of a ``[vocab, ...]`` table (or ``dim`` = vocab axis), zero-padded."""
    d = dim % full.dim()
    vocab = full.shape[d]
    padded = padded_vocab_size(vocab, world)
    if padded != vocab:
        pad_shape = list(full.shape)
        pad_shape[d] = padded - vocab
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=d)
    return shard_dim(full, d, rank, world)


# --------------------------------------------------------------------------------------------
# Module wrappers
# --------------------------------------------------------------------------------------------


def _linear_init(out_features: int, in_features: int, bias: bool, dtype, device):
    """Full ``nn.Linear``-initialised weight and bias (same RNG draws as ``nn.Linear``)."""
    ref = nn.Linear(in_features, out_features, bias=bias, dtype=dtype, device=device)
    return ref.weight.detach(), (ref.bias.detach() if bias else None)


class ColumnParallelLinear(nn.Module):
    """``nn.Linear`` with the output features split over the tensor-parallel group.

    Initialization draws the full weight exactly as ``nn.Linear`` does (so equal seeds give the
    single-device model) and keeps this rank's rows. ``from_linear`` shards an existing layer.
    """

    def __init__(self, in_features, out_features, bias=True, gather_output=False, group=None, dtype=None, device=None):
        super().__init__()
        w, b = _linear_init(out_features, in_features, bias, dtype, device)
        self._setup(w, b, gather_output, group)

    def _setup(self, w, b, gather_output, group):
        self.group, self.gather_output = group, gather_output
        world, rank = tp_world_size(group), tp_rank(group)
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.weight = nn.Parameter(shard_dim(w, 0, rank, world))
        self.bias = nn.Parameter(shard_dim(b, 0, rank, world)) if b is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, gather_output=False, group=None):
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        b = linear.bias.detach() if linear.bias is not None else None
        self._setup(linear.weight.detach(), b, gather_output, group)
        return self

    def forward(self, x):
        return column_parallel_linear(x, self.weight, self.bias, self.group, self.gather_output)

    def extra_repr(self):
        return (
            f"in={self.in_features}, out={self.out_features} (local {self.weight.shape[0]}), "
            f"gather_output={self.gather_output}"
        )


class RowParallelLinear(nn.Module):
    """``nn.Linear`` with the input features split over the tensor-parallel group."""

    def __init__(
        self, in_features, out_features, bias=True, input_is_parallel=True, group=None, dtype=None, device=None
    ):
        super().__init__()
        w, b = _linear_init(out_features, in_features, bias, dtype, device)
        self._setup(w, b, input_is_parallel, group)

    def _setup(self, w, b, input_is_parallel, group):
        self.group, self.input_is_parallel = group, input_is_parallel
        world, rank = tp_world_size(group), tp_rank(group)
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.weight = nn.Parameter(shard_dim(w, 1, rank, world))
        self.bias = nn.Parameter(b.clone()) if b is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, input_is_parallel=True, group=None):
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        b = linear.bias.detach() if linear.bias is not None else None
        self._setup(linear.weight.detach(), b, input_is_parallel, group)
        return self

    def forward(self, x):
        return row_parallel_linear(x, self.weight, self.bias, self.group, self.input_is_parallel)

    def extra_repr(self):
        return (
            f"in={self.in_features} (local {self.weight.shape[1]}), out={self.out_features}, "
            f"input_is_parallel={self.input_is_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` with the rows split by vocabulary (padded, see ``vocab_range``)."""

    def __init__(self, num_embeddings, embedding_dim, group=None, dtype=None, device=None):
        super().__init__()
        full = nn.Embedding(num_embeddings, embedding_dim, dtype=dtype, device=device).weight
        self._setup(full.detach(), group)

    def _setup(self, full, group):
        self.group = group
        world, rank = tp_world_size(group), tp_rank(group)
        self.num_embeddings, self.embedding_dim = full.shape
        self.vocab_start, self.vocab_end = vocab_range(self.num_embeddings, rank, world)
        self.weight = nn.Parameter(shard_vocab(full, rank, world))

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group=None):
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(emb.weight.detach(), group)
        return self

    def forward(self, ids):
        return vocab_parallel_embedding(ids, self.weight, self.vocab_start, self.group)

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end})"


class ParallelLMHeadLoss(nn.Module):
    """LM head split by vocabulary followed by the vocabulary-parallel cross-entropy.

    ``forward(hidden, labels)`` returns the loss (``reduction``, default mean over non-ignored
    tokens); the ``[tokens, vocab]`` logits are only ever materialised per shard. Pass
    ``tied_embedding`` (a ``VocabParallelEmbedding``) to share its weight (GPT-2 style tying).
    """

    def __init__(
        self,
        hidden_size,
        vocab_size,
        bias=False,
        group=None,
        ignore_index=-100,
        reduction="mean",
        tied_embedding: VocabParallelEmbedding | None = None,
        dtype=None,
        device=None,
    ):
        super().__init__()
        if tied_embedding is not None:
            if tied_embedding.embedding_dim != hidden_size or tied_embedding.num_embeddings != vocab_size:
                raise ValueError(
                    f"tied embedding is {tied_embedding.num_embeddings} x "
                    f"{tied_embedding.embedding_dim}, the head needs {vocab_size} x {hidden_size}"
                )
            weight = tied_embedding.weight  # already this rank's (padded) vocab rows
        else:
            w, _ = _linear_init(vocab_size, hidden_size, False, dtype, device)
            weight = nn.Parameter(shard_vocab(w, tp_rank(group), tp_world_size(group)))
        b = None
        if bias:
            b = nn.Parameter(torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device))
        self._setup(hidden_size, vocab_size, weight, b, group, ignore_index, reduction)

    def _setup(self, hidden_size, vocab_size, weight, bias, group, ignore_index, reduction):
        self.group, self.ignore_index, self.reduction = group, ignore_index, reduction
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.vocab_start, self.vocab_end = vocab_range(vocab_size, tp_rank(group), tp_world_size(group))
        self.weight, self.bias = weight, bias

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, ignore_index=-100, reduction="mean"):
        """Shard an existing full ``nn.Linear(hidden, vocab)`` head."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        world, rank = tp_world_size(group), tp_rank(group)
        w = nn.Parameter(shard_vocab(linear.weight.detach(), rank, world))
        b = None
        if linear.bias is not None:
            b = nn.Parameter(shard_vocab(linear.bias.detach(), rank, world))
        self._setup(linear.in_features, linear.out_features, w, b, group, ignore_index, reduction)
        return self

    def forward(self, hidden, labels):
        logits = column_parallel_linear(hidden, self.weight, self.bias, self.group)
        return vocab_parallel_cross_entropy(
            logits,
            labels,
            self.vocab_start,
            self.group,
            self.ignore_index,
            vocab_size=self.vocab_size,
            reduction=self.reduction,
        )
