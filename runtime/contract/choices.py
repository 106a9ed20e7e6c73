"""The names a plan, the command line and the runtime share for each closed choice: one
enumeration each. The members are strings (``StrEnum``), so they compare equal to, print as and
serialize as plan.json's values (``ScheduleName.ZERO_BUBBLE == "zero-bubble"``)."""

from __future__ import annotations

import functools
from enum import StrEnum

__all__ = [
    "ScheduleName",
    "RecomputeMode",
    "OffloadTier",
    "Toggle",
    "GradCompression",
    "ContextMethod",
    "ZERO_STAGES",
    "names",
]


class ScheduleName(StrEnum):
    """A pipeline schedule (plan.json ``schedule``)."""

    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZERO_BUBBLE = "zero-bubble"


class RecomputeMode(StrEnum):
    """How the search may recompute activations (``planner plan --checkpoint``)."""

    AUTO = "auto"
    NONE = "none"
    SELECTIVE = "selective"
    ALL = "all"


class OffloadTier(StrEnum):
    """Where optimizer state or parameter shards live between uses (plan.json ``offload``)."""

    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"


class Toggle(StrEnum):
    """A feature pinned on or off on the command line (``--compile``, ``--sequence-parallel``);
    omitted, the search decides."""

    ON = "on"
    OFF = "off"


class GradCompression(StrEnum):
    """How the data-parallel exchange of a step is encoded (plan.json ``dp_compression``,
    ``planner plan --dp-compression``): uncompressed gradients, or 1-bit Adam's sign-compressed
    momentum after a full-precision warm-up (``runtime.contract.compressed_exchange``)."""

    NONE = "none"
    ONEBIT_ADAM = "onebit-adam"


class ContextMethod(StrEnum):
    """How a context-parallel group computes one sequence's attention (plan.json
    ``context_parallel.method``, ``planner plan --cp-method``): key/value blocks passed round a
    ring and merged by log-sum-exp; keys and values all-gathered (Llama 3); or the sequence
    exchanged for heads by all-to-all (DeepSpeed-Ulysses: needs the heads to divide)."""

    RING = "ring"
    ALL_GATHER = "all-gather"
    ULYSSES = "ulysses"


ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)
"""The ZeRO stages: 0 replicates; 1 shards the optimizer state; 2 also the gradients; 3 also the
parameters (plan.json ``zero_stage``, ``planner plan --zero-stage``)."""


@functools.cache  # an enumeration's members are fixed: every candidate built checks its method here
def names(choice: type[StrEnum]) -> tuple[str, ...]:
    """The values of an enumeration, in declaration order (for argparse ``choices`` and messages)."""
    return tuple(member.value for member in choice)
