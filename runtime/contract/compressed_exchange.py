"""What 1-bit Adam's compressed data-parallel exchange sends and holds: one formula for the
runtime (``runtime.data_parallel.onebit_adam``), which counts what it issues, and for the cost
models, which price the same expressions (``numel`` may be a sympy expression there).

The exchange (Tang et al. 2021, "1-bit Adam"), over ``n`` data-parallel ranks, of a vector of
``numel`` elements padded to ``padded_numel`` (a multiple of ``8 n``, so that every rank's chunk
is a whole number of bytes of packed signs):

1. every rank adds its *worker error* to its vector, keeps the signs (8 to a byte) and one scale
   (the vector's L2 norm over ``sqrt(padded)``), and remembers what that lost as its new error;
2. ``all_to_all`` of the packed signs: rank ``j`` receives chunk ``j`` of every rank's signs,
   and an ``all_gather`` of the ``n`` scales;
3. rank ``j`` averages the ``n`` decoded chunks, adds its *server error*, compresses the chunk the
   same way (its own scale), and keeps its error;
4. ``all_gather`` of the packed chunk signs and of the ``n`` chunk scales: every rank decodes the
   same averaged vector.

Bytes one device sends (the ring convention of ``collective_bytes``): two packed-sign
collectives of ``padded / 8`` bytes (the all-to-all and the all-gather) and two all-gathers of
``n`` fp32 scales; against an uncompressed all-reduce of ``2 (n - 1)/n x 2 numel`` bytes in bf16,
a factor of about 16 less. Memory: the worker error is a full fp32 vector, the server error one
fp32 chunk (``4 padded (1 + 1/n)`` bytes).

The warm-up: full-precision AdamW for ``compression_warmup`` steps, after which the variance is
frozen. ``default_warmup`` takes ``WARMUP_FRACTION`` of the run: the paper warms up for a small
share of BERT pre-training (variance stable well before the end); the planner's report states the
assumption and ``planner train --compression-warmup N`` sets it.
"""

from __future__ import annotations

import math
from typing import Any

from runtime.contract.collective_bytes import ring_bytes

__all__ = [
    "SIGNS_PER_BYTE",
    "SCALE_BYTES",
    "ERROR_ELEMENT_BYTES",
    "WARMUP_FRACTION",
    "padded_numel",
    "exchange_bytes",
    "error_buffer_bytes",
    "default_warmup",
]

SIGNS_PER_BYTE = 8
"""Signs packed into one byte."""

SCALE_BYTES = 4
"""One fp32 scale per rank's vector (worker) and per chunk (server)."""

ERROR_ELEMENT_BYTES = 4
"""The error-feedback buffers are fp32."""

WARMUP_FRACTION = 0.15
"""Share of a run's steps trained with full-precision AdamW before compression starts (default)."""


def padded_numel(numel: int, ranks: int) -> int:
    """``numel`` rounded up to a multiple of ``8 ranks`` (whole bytes of signs per chunk)."""
    quantum = SIGNS_PER_BYTE * max(1, ranks)
    return -(-int(numel) // quantum) * quantum


def exchange_bytes(numel: Any, ranks: int) -> Any:
    """Bytes one device sends in one compressed exchange of ``numel`` elements over ``ranks``
    ranks (``numel`` is taken as already padded when it is symbolic)."""
    if ranks <= 1:
        return 0.0
    padded = padded_numel(numel, ranks) if isinstance(numel, int) else numel
    signs = padded / SIGNS_PER_BYTE
    scales = ranks * SCALE_BYTES
    return (
        ring_bytes("all_to_all", signs, ranks)
        + ring_bytes("all_gather", signs, ranks)
        + 2 * ring_bytes("all_gather", scales, ranks)
    )


def error_buffer_bytes(numel: Any, ranks: int) -> Any:
    """Bytes of the worker error (a full fp32 vector) and the server error (one fp32 chunk)
    that one rank holds for ``numel`` elements; none without data parallelism."""
    if ranks <= 1:
        return 0
    padded = padded_numel(numel, ranks) if isinstance(numel, int) else numel
    return ERROR_ELEMENT_BYTES * padded * (1 + 1 / ranks)


def default_warmup(run_steps: int) -> int:
    """Full-precision steps before compression for a run of ``run_steps`` steps (at least 1)."""
    return max(1, math.ceil(WARMUP_FRACTION * run_steps))
