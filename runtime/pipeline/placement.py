"""Where one rank's stage sits in the pipeline: :class:`StagePlacement`.

With ``virtual_stages = v > 1`` (interleaved schedules) a rank holds ``v`` chunk modules, its local
chunks ``0 .. v - 1`` = model chunks ``s, s + p, ...``. Chunk ``c`` sends to rank ``(c + 1) % p``:
``prev_rank`` and ``next_rank`` are then needed on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from runtime.distributed.mesh import Mesh, get_mesh

__all__ = ["StagePlacement"]


@dataclass(frozen=True)
class StagePlacement:
    """This rank's place in the pipeline and the ranks it talks to."""

    stage_index: int
    """This rank's index ``s`` among the pipeline's ranks, ``0 .. num_stages - 1``."""
    num_stages: int
    """Pipeline ranks ``p``."""
    virtual_stages: int = 1
    """Model chunks per rank ``v`` (interleaved schedules); 1 otherwise."""
    prev_rank: int | None = None
    """Global rank of stage ``(s - 1) % p`` (activations come from it); ``None`` on a first stage without chunks."""
    next_rank: int | None = None
    """Global rank of stage ``(s + 1) % p`` (activations go to it); ``None`` on a last stage without chunks."""
    last_rank: int | None = None
    """Global rank of the last stage, which broadcasts the loss; required with more than one stage."""
    pp_group: Any = None
    """The pipeline process group; ``None`` means the default group, allowed only when the whole
    world is this one pipeline."""

    def __post_init__(self) -> None:
        if not 0 <= self.stage_index < self.num_stages:
            raise ValueError(f"stage_index {self.stage_index} is outside 0..{self.num_stages - 1}")
        if self.virtual_stages < 1:
            raise ValueError(f"virtual_stages must be >= 1, got {self.virtual_stages}")
        if self.virtual_stages > 1 and self.num_stages < 2:
            raise ValueError(f"{self.virtual_stages} model chunks need at least 2 pipeline ranks; use virtual_stages=1")

    @classmethod
    def from_mesh(cls, mesh: Mesh | None = None, virtual_stages: int = 1) -> "StagePlacement":
        """This rank's placement in ``mesh`` (default :func:`runtime.distributed.mesh.get_mesh`)."""
        if mesh is None:
            mesh = get_mesh()
        stage, stages, ranks = mesh.pp_index, mesh.pp, mesh.pp_ranks
        wrap = virtual_stages > 1
        return cls(
            stage,
            stages,
            virtual_stages,
            prev_rank=ranks[(stage - 1) % stages] if stage > 0 or wrap else None,
            next_rank=ranks[(stage + 1) % stages] if stage < stages - 1 or wrap else None,
            last_rank=ranks[-1],
            pp_group=mesh.pp_group,
        )

    def check_neighbours(self) -> None:
        """Raise ``ValueError`` unless every rank this stage talks to is given."""
        stage, stages, chunked = self.stage_index, self.num_stages, self.virtual_stages > 1
        if stages == 1:
            return
        if (stage > 0 or chunked) and self.prev_rank is None:
            raise ValueError(f"stage {stage} needs prev_rank (global rank of stage {(stage - 1) % stages})")
        if (stage < stages - 1 or chunked) and self.next_rank is None:
            raise ValueError(f"stage {stage} needs next_rank (global rank of stage {(stage + 1) % stages})")
        if self.last_rank is None:
            raise ValueError("last_rank (global rank of the last stage, which broadcasts the loss) is required")
        if self.pp_group is None and dist.is_initialized() and dist.get_world_size() != stages:
            raise ValueError(
                f"pp_group is None but the world has {dist.get_world_size()} ranks for {stages} "
                "stages: pass the pipeline group (get_mesh().pp_group)"
            )

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def model_chunk(self, local_chunk: int) -> int:
        """The model chunk index of this rank's local chunk ``local_chunk``."""
        return local_chunk * self.num_stages + self.stage_index

    def holds_first(self, local_chunk: int) -> bool:
        """Is the local chunk the model's first (it receives nothing)?"""
        return self.model_chunk(local_chunk) == 0

    def holds_last(self, local_chunk: int) -> bool:
        """Is the local chunk the model's last (it returns the loss)?"""
        return self.model_chunk(local_chunk) == self.num_stages * self.virtual_stages - 1

    def chunk_name(self, local_chunk: int) -> str:
        """``stage s``, or ``model chunk c`` with chunks (for messages)."""
        if self.virtual_stages == 1:
            return f"stage {self.stage_index}"
        return f"model chunk {self.model_chunk(local_chunk)}"

    def successor_name(self, local_chunk: int) -> str:
        """The name of what the local chunk sends to (for messages)."""
        if self.virtual_stages == 1:
            return f"stage {self.stage_index + 1}"
        return f"model chunk {self.model_chunk(local_chunk) + 1}"
