"""Which positions of a sequence each context-parallel rank holds.

A context-parallel group of ``cp`` ranks cuts every sequence into ``2 cp`` equal chunks; rank ``i``
holds chunks ``i`` and ``2 cp - 1 - i``, in that order. Under a causal mask the query at position
``t`` attends to ``t + 1`` keys, so a rank holding only the first chunk would do a fraction of the
last rank's work; pairing an early chunk with a late one gives every rank the same number of
(query, key) pairs: chunk ``i`` keeps about ``(i + 1/2) c^2`` pairs and chunk ``2cp - 1 - i`` about
``(2cp - i - 1/2) c^2``, together ``2 cp c^2`` on every rank (Megatron-LM's and Llama 3's split).

Everything a rank computes position by position (rotary embeddings, masks, the loss's labels)
follows ``local_positions``; ``shard_sequence`` and ``gather_sequence`` move a full-length tensor
to the ranks' layout and back.
"""

from __future__ import annotations

import torch

__all__ = ["chunk_indices", "local_positions", "shard_sequence", "gather_sequence", "check_length"]


def check_length(seq_len: int, cp: int) -> int:
    """The chunk length ``seq_len / (2 cp)``; a ``ValueError`` when it does not divide."""
    if cp < 1 or seq_len % (2 * cp):
        raise ValueError(
            f"context parallelism over {cp} ranks cuts a sequence into {2 * cp} equal chunks: "
            f"seq_len {seq_len} is not a multiple of {2 * cp}"
        )
    return seq_len // (2 * cp)


def chunk_indices(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks rank ``rank`` of ``cp`` holds, in its local order."""
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is outside a context-parallel group of {cp}")
    return rank, 2 * cp - 1 - rank


def local_positions(seq_len: int, rank: int, cp: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The sequence positions of rank ``rank``'s tokens, in its local order (int64, ``seq_len / cp``)."""
    chunk = check_length(seq_len, cp)
    return torch.cat([torch.arange(i * chunk, (i + 1) * chunk, device=device) for i in chunk_indices(rank, cp)])


def shard_sequence(x: torch.Tensor, dim: int, rank: int, cp: int) -> torch.Tensor:
    """Rank ``rank``'s part of a full-length ``x`` along ``dim``: its two chunks, concatenated."""
    chunk = check_length(x.shape[dim], cp)
    return torch.cat([x.narrow(dim, i * chunk, chunk) for i in chunk_indices(rank, cp)], dim=dim)


def gather_sequence(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The full-length tensor from every rank's part (``parts[r]`` from rank ``r``): the inverse of
    ``shard_sequence``."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        first, second = part.chunk(2, dim=dim)
        low, high = chunk_indices(rank, cp)
        chunks[low], chunks[high] = first, second
    return torch.cat([c for c in chunks if c is not None], dim=dim)
