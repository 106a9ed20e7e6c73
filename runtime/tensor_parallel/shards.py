"""Each tensor-parallel rank's piece of a full tensor: pure functions, no communication.

Vocabulary padding: ``vocab_range`` splits a vocabulary that ``t`` does not divide by padding it
up to ``ceil(V / t) * t`` rows: every rank holds the same number of rows (collectives need equal
shapes) and rows ``>= V`` are padding. Padded embedding rows are zero and never looked up (ids are
``< V``); padded logit columns must be excluded from the softmax, which the cross-entropy does
when given ``vocab_size=V``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["check_rank", "shard_dim", "shard_heads", "shard_qkv", "padded_vocab_size", "vocab_range", "shard_vocab"]


def check_rank(rank: int, world: int) -> None:
    """Raise ``ValueError`` unless ``0 <= rank < world`` and ``world >= 1``."""
    if world < 1:
        raise ValueError(f"tensor-parallel world size must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside the tensor-parallel group of {world} ranks")


def shard_dim(full: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous chunk of ``full`` along ``dim``, as a new contiguous tensor.

    The chunk is ``[rank * n / world, (rank + 1) * n / world)`` of the ``n`` entries of ``dim``;
    ``world`` must divide ``n``. The copy owns its memory, so ``full`` can be freed afterwards.
    """
    check_rank(rank, world)
    axis = dim % full.dim() if full.dim() else 0
    n = full.shape[axis]
    if n % world:
        raise ValueError(
            f"cannot shard dim {dim} (size {n}) of a tensor of shape {tuple(full.shape)} over "
            f"{world} tensor-parallel ranks: {n} is not divisible by {world}; choose a tp "
            f"degree that divides {n}"
        )
    per_rank = n // world
    return full.narrow(axis, rank * per_rank, per_rank).clone(memory_format=torch.contiguous_format)


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
    check_rank(rank, world)
    axis = dim % weight.dim()
    if num_heads < 1 or head_dim < 1:
        raise ValueError(f"num_heads ({num_heads}) and head_dim ({head_dim}) must be >= 1")
    if weight.shape[axis] != num_heads * head_dim:
        raise ValueError(
            f"dim {dim} of the projection has size {weight.shape[axis]}, expected num_heads x "
            f"head_dim = {num_heads} x {head_dim} = {num_heads * head_dim}"
        )
    if num_heads % world:
        raise ValueError(
            f"cannot split {num_heads} heads over {world} tensor-parallel ranks: not divisible; "
            f"the tp degree must divide both the query and the key/value head counts"
        )
    return shard_dim(weight, axis, rank, world)


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
    axis = dim % weight.dim()
    q_rows, kv_rows = num_heads * head_dim, num_kv_heads * head_dim
    if weight.shape[axis] != q_rows + 2 * kv_rows:
        raise ValueError(
            f"dim {dim} of the fused qkv projection has size {weight.shape[axis]}, expected "
            f"({num_heads} + 2 x {num_kv_heads}) x {head_dim} = {q_rows + 2 * kv_rows}"
        )
    query, key, value = weight.split([q_rows, kv_rows, kv_rows], dim=axis)
    return torch.cat(
        [
            shard_heads(query, num_heads, head_dim, rank, world, axis),
            shard_heads(key, num_kv_heads, head_dim, rank, world, axis),
            shard_heads(value, num_kv_heads, head_dim, rank, world, axis),
        ],
        dim=axis,
    )


def padded_vocab_size(vocab: int, world: int) -> int:
    """``vocab`` rounded up to a multiple of ``world`` (every rank holds the same rows)."""
    if vocab < 1:
        raise ValueError(f"vocabulary size must be >= 1, got {vocab}")
    check_rank(0, world)
    return math.ceil(vocab / world) * world


def vocab_range(vocab: int, rank: int, world: int) -> tuple[int, int]:
    """``(start, end)`` of the rows of the (padded) vocabulary owned by ``rank``.

    The vocabulary is padded up to ``padded_vocab_size(vocab, world)`` so that every rank holds
    ``ceil(vocab / world)`` rows; ``end`` may exceed ``vocab`` on the last ranks, and rows at or
    beyond ``vocab`` are padding (zero embedding rows, logits excluded by passing ``vocab_size``
    to ``vocab_parallel_cross_entropy``).
    """
    check_rank(rank, world)
    per_rank = padded_vocab_size(vocab, world) // world
    return rank * per_rank, (rank + 1) * per_rank


def shard_vocab(full: torch.Tensor, rank: int, world: int, dim: int = 0) -> torch.Tensor:
    """This rank's rows of a ``[vocab, ...]`` table (or ``dim`` = vocab axis), zero-padded."""
    axis = dim % full.dim()
    vocab = full.shape[axis]
    padded = padded_vocab_size(vocab, world)
    if padded != vocab:
        pad_shape = list(full.shape)
        pad_shape[axis] = padded - vocab
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=axis)
    return shard_dim(full, axis, rank, world)
