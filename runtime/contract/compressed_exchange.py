"""What 1-bit Adam's compressed data-parallel exchange sends and holds: one formula for the
runtime (``runtime.data_parallel.onebit_adam``), which counts what it issues, and for the cost
models, which price the same expressions (``numel`` may be a sympy expression there).

The exchange (Tang et al. 2021, "1-bit Adam"), over ``n`` data-parallel ranks, of a vector of
``numel`` elements padded to ``exchange_numel`` (a multiple of ``BLOCK n``, so that every rank's
chunk is a whole number of blocks):

1. every rank adds its *worker error* to its vector and keeps, per block of ``BLOCK`` elements,
   the signs (8 to a byte) and one scale (the block's L2 norm over ``sqrt(BLOCK)``); what that
   lost is its new error;
2. ``all_to_all`` of the packed signs and of the scales: rank ``j`` receives chunk ``j`` of every
   rank's vector;
3. rank ``j`` averages the ``n`` decoded chunks, adds its *server error*, compresses the chunk the
   same way, and keeps its error;
4. ``all_gather`` of the chunks' packed signs and scales: every rank decodes the same average.

A scale per block rather than per vector: one scale for a whole model would give a layer norm's
small momenta the magnitude of an embedding's (Tang et al. compress each tensor on its own for the
same reason); 256 elements keep the scales at 1/8 bit per element. Bytes one device sends (the
ring convention of ``collective_bytes``): an all-to-all and an all-gather of ``padded (1/8 +
4/BLOCK)`` bytes each; against a bf16 all-reduce of ``2 (n - 1)/n x 2 numel`` bytes, about 14
times fewer (28 against fp32). Memory: the worker error is a full fp32 vector, the server error
one fp32 chunk (``4 padded (1 + 1/n)`` bytes).

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
    "BLOCK",
    "SCALE_BYTES",
    "ERROR_ELEMENT_BYTES",
    "WARMUP_FRACTION",
    "exchange_numel",
    "exchange_bytes",
    "error_buffer_bytes",
    "default_warmup",
]

SIGNS_PER_BYTE = 8
"""Signs packed into one byte."""

BLOCK = 256
"""Elements that share one scale."""

SCALE_BYTES = 4
"""One fp32 scale per block."""

ERROR_ELEMENT_BYTES = 4
"""The error-feedback buffers are fp32."""

WARMUP_FRACTION = 0.15
"""Share of a run's steps trained with full-precision AdamW before compression starts (default)."""


def exchange_numel(numel: int, ranks: int) -> int:
    """``numel`` rounded up to a multiple of ``BLOCK ranks`` (whole blocks per rank's chunk)."""
    quantum = BLOCK * max(1, ranks)
    return -(-int(numel) // quantum) * quantum


def exchange_bytes(numel: Any, ranks: int) -> Any:
    """Bytes one device sends in one compressed exchange of ``numel`` elements over ``ranks``
    ranks (``numel`` is taken as already padded when it is symbolic)."""
    if ranks <= 1:
        return 0.0
    padded = exchange_numel(numel, ranks) if isinstance(numel, int) else numel
    packed = padded / SIGNS_PER_BYTE + SCALE_BYTES * padded / BLOCK
    return ring_bytes("all_to_all", packed, ranks) + ring_bytes("all_gather", packed, ranks)


def error_buffer_bytes(numel: Any, ranks: int) -> Any:
    """Bytes of the worker error (a full fp32 vector) and the server error (one fp32 chunk)
    that one rank holds for ``numel`` elements; none without data parallelism."""
    if ranks <= 1:
        return 0
    padded = exchange_numel(numel, ranks) if isinstance(numel, int) else numel
    return ERROR_ELEMENT_BYTES * padded * (1 + 1 / ranks)


def default_warmup(run_steps: int) -> int:
    """Full-precision steps before compression for a run of ``run_steps`` steps (at least 1)."""
    return max(1, math.ceil(WARMUP_FRACTION * run_steps))
