"""How tensor parallelism shards one original tensor: the runtime's public shard description.

``planner compile`` decides, per sharded parameter, a ``TensorShard`` and records it in the
manifest (``TensorShard.to_dict``, the ``"shard"`` entry of each parameter). The runtime cuts each
tp rank's piece of the original weights with ``TensorShard.cut`` (``runtime.stages.compiled_stages``) and joins
the pieces back into the original tensor for checkpoints and exports (``TensorShard.join``,
``runtime.checkpointing.checkpoint_io``). Codegen and checkpoints use this type, never private helpers.

Kinds
-----
- ``column`` / ``row`` / ``heads``: rank ``r`` of ``t`` holds the contiguous block
  ``[r * n/t, (r + 1) * n/t)`` of dim ``dim`` (``heads``: rows grouped by attention head).
- ``vocab``: as ``column``, but the ``size`` rows are first padded with zeros up to ``padded``
  (a multiple of ``t``); ``join`` drops the padding.
- ``qkv``: a fused ``[q; k; v]`` projection with part sizes ``parts``: each part is split by
  heads and the rank's pieces re-fused as ``[q_r; k_r; v_r]`` (Megatron's layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from runtime.tensor_parallel import shard_dim, shard_vocab

__all__ = ["TensorShard", "SHARD_KINDS"]

SHARD_KINDS = ("column", "row", "heads", "vocab", "qkv")


@dataclass(frozen=True)
class TensorShard:
    """One tensor's tensor-parallel sharding (see the module doc)."""

    dim: int
    """The dimension split over the tp ranks."""
    kind: str
    """``column``, ``row``, ``heads``, ``vocab`` or ``qkv``."""
    size: int
    """Entries of ``dim`` in the original tensor."""
    padded: int | None = None
    """``vocab`` only: ``size`` rounded up to a multiple of tp (zero rows appended)."""
    parts: tuple[int, ...] | None = None
    """``qkv`` only: the sizes of the fused parts along ``dim``."""

    def __post_init__(self):
        if self.kind not in SHARD_KINDS:
            raise ValueError(f"unknown shard kind {self.kind!r}; expected one of {', '.join(SHARD_KINDS)}")
        if self.kind == "qkv" and not self.parts:
            raise ValueError("a qkv shard needs the sizes of its parts")

    @classmethod
    def from_dict(cls, entry: dict[str, Any] | None) -> TensorShard | None:
        """The manifest's ``"shard"`` entry (``None``: the tensor is not sharded)."""
        if not entry:
            return None
        parts = entry.get("parts")
        return cls(
            dim=int(entry["dim"]),
            kind=str(entry.get("kind", "column")),
            size=int(entry["size"]),
            padded=entry.get("padded"),
            parts=tuple(parts) if parts is not None else None,
        )

    def to_dict(self) -> dict[str, Any]:
        """The manifest's form: ``{"dim", "kind", "size"[, "padded"][, "parts"]}``."""
        entry: dict[str, Any] = {"dim": self.dim, "kind": self.kind}
        if self.padded is not None:
            entry["padded"] = self.padded
        if self.parts is not None:
            entry["parts"] = list(self.parts)
        entry["size"] = self.size
        return entry

    @property
    def part_sizes(self) -> tuple[int, ...]:
        """The fused parts' sizes (``qkv``; empty for the other kinds)."""
        return self.parts or ()

    def local_size(self, tp: int) -> int:
        """Entries of ``dim`` one rank holds."""
        return (self.padded or self.size) // tp

    def cut(self, full: torch.Tensor, tp_index: int, tp: int) -> torch.Tensor:
        """Rank ``tp_index``'s piece of the original tensor ``full`` (``runtime.tensor_parallel``'s
        ``shard_dim`` per part, ``shard_vocab`` for a padded vocabulary)."""
        if tp == 1:
            return full
        if self.kind == "qkv":
            pieces = full.split(list(self.part_sizes), dim=self.dim)
            return torch.cat([shard_dim(part, self.dim, tp_index, tp) for part in pieces], dim=self.dim)
        if self.padded is not None and self.padded != full.shape[self.dim]:
            return shard_vocab(full, tp_index, tp, self.dim)
        return shard_dim(full, self.dim, tp_index, tp)

    def join(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The original tensor from every rank's piece, in tp-rank order (``cut``'s inverse)."""
        if len(pieces) == 1:
            return pieces[0]
        dim = self.dim
        if self.kind == "qkv":  # each piece is [q_r; k_r; v_r]: join per part, then fuse
            tp = len(pieces)
            local = [n // tp for n in self.part_sizes]
            split = [piece.split(local, dim=dim) for piece in pieces]
            return torch.cat(
                [torch.cat([parts_of[i] for parts_of in split], dim=dim) for i in range(len(local))], dim=dim
            )
        full = torch.cat(pieces, dim=dim)
        if full.shape[dim] != self.size:
            full = full.narrow(dim, 0, self.size)
        return full
