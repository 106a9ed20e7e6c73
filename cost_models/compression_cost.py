"""The price of 1-bit Adam's compressed data-parallel exchange (``dp_compression = onebit-adam``).

What the runtime does (``runtime.contract.compressed_exchange``; ``runtime.data_parallel.onebit_adam``):
for ``compression_warmup`` steps plain AdamW, priced exactly as an uncompressed plan (gradient
all-reduce after backward). Then, every step, *no* gradient collective in backward; in the
optimizer step each rank exchanges its whole fp32 momentum vector (``numel`` = the parameters its
pipeline stage holds after the tp split) once, compressed, and updates the whole model from the
frozen variance. Valid at ZeRO 0 and 1 only: at stage 1 the engine gathers its optimizer shards
at the switch, so the compressed phase holds stage 0's optimizer memory (``strategy`` prices it so).

Time of one compressed step's tail, on the data-parallel group's links (``comm_cost``):

- the exchange: an ``all_to_all`` and an ``all_gather`` of ``padded / 8`` bytes of packed signs,
  and the same two of the fp32 scales, one per block of ``BLOCK`` elements (``collective_time``
  each: alpha-beta, intra- or inter-node, ring or hierarchical, so four collectives' latencies),
  not overlapped with compute;
- the compression's own compute, memory-bound passes over fp32 vectors at the profile's memory
  bandwidth (``COMPRESSION_OPS`` operator calls of overhead besides), per element of the vector:

  ========================================  =========  =====================================
  pass                                      bytes      reads / writes
  ========================================  =========  =====================================
  worker: add error (m + e)                 12         read m, e; write the sum
  worker: L2 norm of each block             4          read
  worker: sign + pack                       4.125      read; write 1/8
  worker: error update (x - scale sign x)   8.125      read x, packed signs; write e
  server: unpack dp chunks, scale, average  16.125     read 1/8; write 4; read 4 write 4
                                                       (scale); read 4 (the sum over dp)
  decode the gathered result into m         12.125     read 1/8; write 4; read 4 write 4
  ========================================  =========  =====================================

  total ``WORKER + SERVER_UNPACK + DECODE = 56.625`` bytes per element, plus the server's own
  chunk (``1 / dp`` of the vector: write the average 4, add error 12, norm 4, sign + pack 4.125,
  error update 8.125: ``32.25 / dp``). About 57-73 bytes per element; the fp64 norm all-reduce
  is the existing gradient-norm control collective (``comm_cost.step_control_bytes``).

The exchange's bytes (``exchange_bytes``) are what ``comm_bytes`` counts on a compressed step;
the error buffers (``error_buffer_bytes``) sit beside the optimizer state. The ILP sums per-layer
shares (``shares``: the asymptotic seconds per element times a layer's elements, never above the
exact time, so the search's bounds stay sound); ``evaluate`` prices each stage's whole vector
exactly (``stage_exchange``).
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.comm_cost import GroupPlacement, collective_time
from cost_models.hardware import HardwareProfile
from runtime.contract.compressed_exchange import (
    BLOCK,
    SCALE_BYTES,
    SIGNS_PER_BYTE,
    error_buffer_bytes,
    exchange_bytes,
    exchange_numel,
)

__all__ = [
    "WORKER_BYTES",
    "SERVER_UNPACK_BYTES",
    "DECODE_BYTES",
    "SERVER_CHUNK_BYTES",
    "COMPRESSION_OPS",
    "StageExchange",
    "compression_compute_s",
    "exchange_time_s",
    "stage_exchange",
    "shares",
]

WORKER_BYTES = 12 + 4 + (4 + 1 / 8) + (8 + 1 / 8)
"""Bytes moved per element by the worker's compression (add error, norm, sign + pack, error update)."""
SERVER_UNPACK_BYTES = 1 / 8 + 4 + 8 + 4
"""Bytes per element of the vector to decode the ``dp`` received chunks and average them."""
DECODE_BYTES = 1 / 8 + 4 + 8
"""Bytes per element to decode the gathered, averaged signs into the momentum."""
SERVER_CHUNK_BYTES = 4 + 12 + 4 + (4 + 1 / 8) + (8 + 1 / 8)
"""Bytes per element of the server's own chunk (``1 / dp`` of the vector): write the average,
add error, norm, sign + pack, error update."""
COMPRESSION_OPS = 24
"""Operator calls of one compressed exchange's compute (each pass above is one or two calls)."""


def compression_compute_s(numel: float, dp: int, hw: HardwareProfile) -> float:
    """Seconds of the compression's memory-bound passes over a ``numel``-element vector."""
    if dp <= 1 or numel <= 0:
        return 0.0
    moved = numel * (WORKER_BYTES + SERVER_UNPACK_BYTES + DECODE_BYTES + SERVER_CHUNK_BYTES / dp)
    return moved / hw.memory_bandwidth + COMPRESSION_OPS * hw.op_overhead_s


def exchange_time_s(padded: float, placement: GroupPlacement, hw: HardwareProfile) -> float:
    """Seconds of one exchange of ``padded`` elements over the dp group ``placement``: an
    all-to-all and an all-gather of the packed signs, and of the blocks' fp32 scales."""
    dp = placement.size
    if dp <= 1 or padded <= 0:
        return 0.0
    signs = padded / SIGNS_PER_BYTE
    scales = SCALE_BYTES * padded / BLOCK
    return float(
        sum(
            collective_time(kind, size, placement, hw)
            for kind in ("all_to_all", "all_gather")
            for size in (signs, scales)
        )
    )


#: Elements at which the exchange's time is taken as linear (latencies negligible beside it).
_LARGE = 1e15


def shares(numel: float, placement: GroupPlacement, hw: HardwareProfile) -> tuple[float, float]:
    """A layer's share of the exchange's seconds and of the compression compute's: its elements at
    the asymptotic seconds per element. Every collective's time is a min or max of affine
    functions of the bytes with non-negative intercepts, so the shares of a stage's layers never
    add up to more than the stage's exact times (``stage_exchange``)."""
    dp = placement.size
    if dp <= 1 or numel <= 0:
        return 0.0, 0.0
    slope = (exchange_time_s(2 * _LARGE, placement, hw) - exchange_time_s(_LARGE, placement, hw)) / _LARGE
    bytes_per_element = WORKER_BYTES + SERVER_UNPACK_BYTES + DECODE_BYTES + SERVER_CHUNK_BYTES / dp
    return numel * slope, numel * bytes_per_element / hw.memory_bandwidth


@dataclass(frozen=True)
class StageExchange:
    """One stage's compressed exchange, exactly (its whole vector)."""

    numel: int
    """Elements of the rank's momentum vector (before padding)."""
    exchange_s: float
    """Seconds of the exchange's collectives (``dp_comm``)."""
    compute_s: float
    """Seconds of the compression's own passes (part of the optimizer step)."""
    sent_b: float
    """Bytes one rank sends (``runtime.contract.compressed_exchange.exchange_bytes``)."""
    error_b: float
    """Bytes of the worker and server error buffers (``error_buffer_bytes``)."""


def stage_exchange(numel: int, placement: GroupPlacement, hw: HardwareProfile) -> StageExchange:
    """The exact exchange of a stage whose ranks hold ``numel`` parameters each."""
    dp = placement.size
    numel = int(numel)
    if dp <= 1 or numel <= 0:
        return StageExchange(numel, 0.0, 0.0, 0.0, 0.0)
    return StageExchange(
        numel=numel,
        exchange_s=exchange_time_s(exchange_numel(numel, dp), placement, hw),
        compute_s=compression_compute_s(exchange_numel(numel, dp), dp, hw),
        sent_b=float(exchange_bytes(numel, dp)),
        error_b=float(error_buffer_bytes(numel, dp)),
    )
