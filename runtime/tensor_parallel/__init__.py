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
ranks: each keeps the sum for its positions; ``column_parallel_linears`` keeps only ``x_r`` for
the weight gradients and gathers it again in backward). Row parallel: ``y_r = reduce_scatter_seq(x_r W_r^T) +
b``. The vocabulary-parallel embedding reduce-scatters instead of all-reducing. A replicated
parameter used on sequence shards (a norm's weight and bias, the row-parallel bias) sees only this
rank's tokens, so its gradient passes through ``copy_to_tp`` (all-reduced over the group); a
replicated full-length tensor that meets a sequence shard (a position embedding) passes through
``scatter_to_tp`` along its sequence dim (each rank keeps its positions, the gradient is gathered).

``sharded_dropout`` replaces dropout on a tensor each rank holds a block of (heads, or the
sequence under sequence parallelism). Vocabulary padding and the shard functions:
:mod:`runtime.tensor_parallel.shards`; the collectives and autograd functions:
:mod:`runtime.tensor_parallel.collectives`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from runtime.distributed.mesh import get_mesh
from runtime.tensor_parallel.collectives import (
    AllGatherSeq,
    CopyToTP,
    GatherFromTP,
    ReduceFromTP,
    ReduceScatterSeq,
    ScatterToTP,
    VocabParallelCrossEntropy,
)
from runtime.tensor_parallel.overlapped import ColumnLinears, LinearReduceScatter, overlap_enabled, set_overlap
from runtime.tensor_parallel.shards import (
    padded_vocab_size,
    shard_dim,
    shard_heads,
    shard_qkv,
    shard_vocab,
    vocab_range,
)

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
    "column_parallel_linears",
    "linear_reduce_scatter_seq",
    "set_overlap",
    "overlap_enabled",
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
    "CrossEntropyOptions",
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
    "column_parallel_linears",
    "linear_reduce_scatter_seq",
    "vocab_parallel_embedding",
    "vocab_parallel_cross_entropy",
    "sharded_dropout",
)


# --------------------------------------------------------------------------------------------
# Groups
# --------------------------------------------------------------------------------------------


def resolve_group(group: Any = None) -> Any:
    """The group to use: ``group`` itself, or the mesh's tp group when ``group`` is None.

    Returns ``None`` when there is nothing to communicate with (tp = 1 or no process group).
    Callers must not hand that ``None`` to ``runtime.distributed.comm``, where it means the default group.
    """
    resolved = get_mesh().tp_group if group is None else group
    if resolved is not None and not dist.is_initialized():
        raise RuntimeError(
            "a tensor-parallel group was given but torch.distributed is not initialized; "
            "call runtime.distributed.launch.init_distributed() and runtime.distributed.mesh.setup_mesh() first"
        )
    return resolved


def tp_world_size(group: Any = None) -> int:
    """Number of ranks in the (resolved) tensor-parallel group; 1 without one."""
    resolved = resolve_group(group)
    return 1 if resolved is None else dist.get_world_size(resolved)


def tp_rank(group: Any = None) -> int:
    """This rank's index inside the (resolved) tensor-parallel group; 0 without one."""
    resolved = resolve_group(group)
    return 0 if resolved is None else dist.get_rank(resolved)


def copy_to_tp(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Enter a tensor-parallel region: identity forward, gradient all-reduced backward."""
    resolved = resolve_group(group)
    return x if resolved is None else CopyToTP.apply(x, resolved)


def reduce_from_tp(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Leave a tensor-parallel region by summing partial results: all-reduce forward."""
    resolved = resolve_group(group)
    return x if resolved is None else ReduceFromTP.apply(x, resolved)


def gather_from_tp(x: torch.Tensor, dim: int = -1, group: Any = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (forward); split the gradient (backward)."""
    resolved = resolve_group(group)
    return x if resolved is None else GatherFromTP.apply(x, dim, resolved)


def scatter_to_tp(x: torch.Tensor, dim: int = -1, group: Any = None) -> torch.Tensor:
    """Keep this rank's chunk of ``x`` along ``dim`` (forward); gather the gradient (backward)."""
    resolved = resolve_group(group)
    return x if resolved is None else ScatterToTP.apply(x, dim, resolved)


def all_gather_seq(x: torch.Tensor, dim: int = 1, group: Any = None) -> torch.Tensor:
    """Enter a tensor-parallel region from a sequence-parallel one: concatenate every rank's
    positions along ``dim`` (forward); reduce-scatter the partial gradients (backward)."""
    resolved = resolve_group(group)
    return x if resolved is None else AllGatherSeq.apply(x, dim, resolved)


def reduce_scatter_seq(x: torch.Tensor, dim: int = 1, group: Any = None) -> torch.Tensor:
    """Leave a tensor-parallel region into a sequence-parallel one: sum the partial results and
    keep this rank's positions along ``dim`` (forward); all-gather the gradient (backward)."""
    resolved = resolve_group(group)
    return x if resolved is None else ReduceScatterSeq.apply(x, dim, resolved)


def sharded_dropout(x: torch.Tensor, probability: float, train: bool, dim: int, group: Any = None) -> torch.Tensor:
    """Dropout of this rank's shard along ``dim`` of a tensor split over the tp ranks (heads, or
    the sequence under sequence parallelism): the keep-mask of the *whole* tensor is drawn from
    the random stream every tp rank shares, and each rank uses its block of it. The ranks' masks
    are then independent of each other (plain dropout on a shard would repeat one mask on every
    rank), a checkpoint's recompute draws the same mask again (it restores that stream), and the
    streams of the tp ranks stay in step for the replicated dropouts that follow."""
    resolved = resolve_group(group)
    if not train or probability == 0.0:
        return x
    if resolved is None or dist.get_world_size(resolved) == 1:
        return F.dropout(x, probability, True)
    n = dist.get_world_size(resolved)
    dim = dim % x.dim()
    shape = list(x.shape)
    shape[dim] *= n
    keep = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1.0 - probability)
    # a bool copy of this rank's block: what backward keeps (as plain dropout's mask), not the whole draw
    mask = keep.narrow(dim, dist.get_rank(resolved) * x.shape[dim], x.shape[dim]).to(torch.bool)
    return x * mask / (1.0 - probability)


# --------------------------------------------------------------------------------------------
# Parallel layers as functions
# --------------------------------------------------------------------------------------------


def column_parallel_linear(
    x: torch.Tensor,
    weight_shard: torch.Tensor,
    bias_shard: torch.Tensor | None = None,
    group: Any = None,
    gather_output: bool = False,
    sequence_dim: int | None = None,
) -> torch.Tensor:
    """``y_r = x W_r^T + b_r`` with ``W_r`` this rank's rows of ``W`` (output features).

    ``x`` is replicated over the group, or with ``sequence_dim`` this rank's positions along that
    dim (sequence parallelism: gathered first); the result holds this rank's output features for
    every position, or all of them (gathered along the last dim) with ``gather_output=True``.
    """
    out = column_parallel_linears(x, [weight_shard], [bias_shard], sequence_dim, group)[0]
    return gather_from_tp(out, -1, group) if gather_output else out


def column_parallel_linears(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None] | None = None,
    sequence_dim: int | None = None,
    group: Any = None,
) -> tuple[torch.Tensor, ...]:
    """``y_i = x W_i^T + b_i`` for column-parallel linears sharing one input (q, k and v; or one
    linear): ``copy_to_tp(x)`` (or ``all_gather_seq(x, sequence_dim)``) once, then each linear.

    With overlap on (:func:`set_overlap`, the default) one autograd function
    (:mod:`runtime.tensor_parallel.overlapped`) runs the input's collective beside the matmuls:
    the gradient's all-reduce (reduce-scatter) beside the weight gradients, and under sequence
    parallelism the forward all-gather in pieces beside the partial products. Off: the plain
    ``copy_to_tp``, then ``F.linear`` each; under sequence parallelism the same autograd function
    with every collective waited where issued. Under sequence parallelism only this rank's
    positions are kept for backward, which gathers them again for the weight gradients (one
    all-gather more per backward, as Megatron-LM). The same values and bytes either way.
    """
    biases = list(biases) if biases is not None else [None] * len(weights)
    if len(biases) != len(weights):
        raise ValueError(f"{len(weights)} weights but {len(biases)} biases: give one bias (or None) per weight")
    resolved = resolve_group(group)
    if resolved is None or (sequence_dim is None and not overlap_enabled()):
        x = copy_to_tp(x, group) if sequence_dim is None else all_gather_seq(x, sequence_dim, group)
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))
    return ColumnLinears.apply(x, sequence_dim, resolved, len(weights), *weights, *biases)


def linear_reduce_scatter_seq(x: torch.Tensor, weight: torch.Tensor, dim: int = 1, group: Any = None) -> torch.Tensor:
    """``reduce_scatter_seq(F.linear(x, weight), dim)``: a row-parallel product (no bias) summed over
    the group, each rank keeping its positions along ``dim``. With overlap on, the product is
    computed in pieces and each piece's reduce-scatter launched before the next is computed; the
    gradient's all-gather likewise (:mod:`runtime.tensor_parallel.overlapped`)."""
    resolved = resolve_group(group)
    if resolved is None or not overlap_enabled():
        return reduce_scatter_seq(F.linear(x, weight), dim, group)
    return LinearReduceScatter.apply(x, weight, dim, resolved)


def row_parallel_linear(
    x: torch.Tensor,
    weight_shard: torch.Tensor,
    bias: torch.Tensor | None = None,
    group: Any = None,
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
    if sequence_dim is None:
        out = reduce_from_tp(F.linear(x, weight_shard), group)
        return out if bias is None else out + bias
    out = linear_reduce_scatter_seq(x, weight_shard, sequence_dim, group)
    return out if bias is None else out + copy_to_tp(bias, group)


def vocab_parallel_embedding(
    ids: torch.Tensor,
    weight_shard: torch.Tensor,
    vocab_start: int,
    group: Any = None,
    sequence_dim: int | None = None,
) -> torch.Tensor:
    """Embedding lookup with the table split by rows (vocabulary) over the group.

    This rank owns ids ``[vocab_start, vocab_start + weight_shard.shape[0])``. Other ids read row
    0 and are zeroed; the all-reduce then adds the single owner's row to every rank. With
    ``sequence_dim`` (sequence parallelism, a dim of ``ids``) a reduce-scatter along it replaces
    the all-reduce: each rank keeps the embeddings of its positions.
    """
    resolved = resolve_group(group)
    if resolved is None:
        return F.embedding(ids - vocab_start if vocab_start else ids, weight_shard)
    rows = weight_shard.shape[0]
    outside = (ids < vocab_start) | (ids >= vocab_start + rows)
    local = (ids - vocab_start).masked_fill(outside, 0)
    out = F.embedding(local, weight_shard).masked_fill(outside.unsqueeze(-1), 0.0)
    return reduce_from_tp(out, resolved) if sequence_dim is None else reduce_scatter_seq(out, sequence_dim, resolved)


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int = 0,
    group: Any = None,
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
    resolved = resolve_group(group)
    return VocabParallelCrossEntropy.apply(
        logits_shard, labels.long(), int(vocab_start), vocab_size, ignore_index, reduction, resolved
    )


# --------------------------------------------------------------------------------------------
# Module wrappers
# --------------------------------------------------------------------------------------------


def _linear_init(
    out_features: int, in_features: int, bias: bool, dtype: torch.dtype | None, device: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Full ``nn.Linear``-initialised weight and bias (same RNG draws as ``nn.Linear``)."""
    reference = nn.Linear(in_features, out_features, bias=bias, dtype=dtype, device=device)
    return reference.weight.detach(), (reference.bias.detach() if bias else None)


class ColumnParallelLinear(nn.Module):
    """``nn.Linear`` with the output features split over the tensor-parallel group.

    Initialization draws the full weight exactly as ``nn.Linear`` does (so equal seeds give the
    single-device model) and keeps this rank's rows. ``from_linear`` shards an existing layer.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = False,
        group: Any = None,
        dtype: torch.dtype | None = None,
        device: Any = None,
    ):
        super().__init__()
        weight, bias_full = _linear_init(out_features, in_features, bias, dtype, device)
        self._setup(weight, bias_full, gather_output, group)

    def _setup(self, weight: torch.Tensor, bias: torch.Tensor | None, gather_output: bool, group: Any) -> None:
        self.group, self.gather_output = group, gather_output
        world, rank = tp_world_size(group), tp_rank(group)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = nn.Parameter(shard_dim(weight, 0, rank, world))
        self.bias = nn.Parameter(shard_dim(bias, 0, rank, world)) if bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, gather_output: bool = False, group: Any = None) -> "ColumnParallelLinear":
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        bias = linear.bias.detach() if linear.bias is not None else None
        self._setup(linear.weight.detach(), bias, gather_output, group)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_parallel_linear(x, self.weight, self.bias, self.group, self.gather_output)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features} (local {self.weight.shape[0]}), "
            f"gather_output={self.gather_output}"
        )


class RowParallelLinear(nn.Module):
    """``nn.Linear`` with the input features split over the tensor-parallel group."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        group: Any = None,
        dtype: torch.dtype | None = None,
        device: Any = None,
    ):
        super().__init__()
        weight, bias_full = _linear_init(out_features, in_features, bias, dtype, device)
        self._setup(weight, bias_full, input_is_parallel, group)

    def _setup(self, weight: torch.Tensor, bias: torch.Tensor | None, input_is_parallel: bool, group: Any) -> None:
        self.group, self.input_is_parallel = group, input_is_parallel
        world, rank = tp_world_size(group), tp_rank(group)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = nn.Parameter(shard_dim(weight, 1, rank, world))
        self.bias = nn.Parameter(bias.clone()) if bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, input_is_parallel: bool = True, group: Any = None) -> "RowParallelLinear":
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        bias = linear.bias.detach() if linear.bias is not None else None
        self._setup(linear.weight.detach(), bias, input_is_parallel, group)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_parallel_linear(x, self.weight, self.bias, self.group, self.input_is_parallel)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features} (local {self.weight.shape[1]}), out={self.out_features}, "
            f"input_is_parallel={self.input_is_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` with the rows split by vocabulary (padded, see ``vocab_range``)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        group: Any = None,
        dtype: torch.dtype | None = None,
        device: Any = None,
    ):
        super().__init__()
        full = nn.Embedding(num_embeddings, embedding_dim, dtype=dtype, device=device).weight
        self._setup(full.detach(), group)

    def _setup(self, full: torch.Tensor, group: Any) -> None:
        self.group = group
        world, rank = tp_world_size(group), tp_rank(group)
        self.num_embeddings, self.embedding_dim = full.shape
        self.vocab_start, self.vocab_end = vocab_range(self.num_embeddings, rank, world)
        self.weight = nn.Parameter(shard_vocab(full, rank, world))

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: Any = None) -> "VocabParallelEmbedding":
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(embedding.weight.detach(), group)
        return self

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embedding(ids, self.weight, self.vocab_start, self.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end})"


@dataclass(frozen=True)
class CrossEntropyOptions:
    """How :class:`ParallelLMHeadLoss` reduces its vocabulary-parallel cross-entropy."""

    ignore_index: int = -100
    """Label value whose tokens take no part in the loss."""
    reduction: str = "mean"
    """``mean`` over non-ignored tokens, ``sum``, or ``none`` (per token)."""

    def __post_init__(self) -> None:
        if self.reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {self.reduction!r}")


class ParallelLMHeadLoss(nn.Module):
    """LM head split by vocabulary followed by the vocabulary-parallel cross-entropy.

    ``forward(hidden, labels)`` returns the loss (``loss.reduction``, default mean over
    non-ignored tokens); the ``[tokens, vocab]`` logits are only ever materialised per shard. Pass
    ``tied_embedding`` (a ``VocabParallelEmbedding``) to share its weight (GPT-2 style tying).
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        bias: bool = False,
        group: Any = None,
        loss: CrossEntropyOptions = CrossEntropyOptions(),
        tied_embedding: VocabParallelEmbedding | None = None,
        dtype: torch.dtype | None = None,
        device: Any = None,
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
            full, _ = _linear_init(vocab_size, hidden_size, False, dtype, device)
            weight = nn.Parameter(shard_vocab(full, tp_rank(group), tp_world_size(group)))
        bias_shard = None
        if bias:
            bias_shard = nn.Parameter(torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device))
        self._setup(hidden_size, vocab_size, weight, bias_shard, group, loss)

    def _setup(
        self,
        hidden_size: int,
        vocab_size: int,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        group: Any,
        loss: CrossEntropyOptions,
    ) -> None:
        self.group, self.ignore_index, self.reduction = group, loss.ignore_index, loss.reduction
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.vocab_start, self.vocab_end = vocab_range(vocab_size, tp_rank(group), tp_world_size(group))
        self.weight, self.bias = weight, bias

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, group: Any = None, ignore_index: int = -100, reduction: str = "mean"
    ) -> "ParallelLMHeadLoss":
        """Shard an existing full ``nn.Linear(hidden, vocab)`` head."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        world, rank = tp_world_size(group), tp_rank(group)
        weight = nn.Parameter(shard_vocab(linear.weight.detach(), rank, world))
        bias = None
        if linear.bias is not None:
            bias = nn.Parameter(shard_vocab(linear.bias.detach(), rank, world))
        options = CrossEntropyOptions(ignore_index, reduction)
        self._setup(linear.in_features, linear.out_features, weight, bias, group, options)
        return self

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
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
