"""Bytes one device sends per collective: the convention of plan.json's ``comm_bytes_per_device``
and of the metrics' ``comm_bytes``. The runtime counts what it issues with ``ring_bytes``; the cost
models price the same expression (``size_bytes`` may be a sympy expression there).

Under ring algorithms over ``n`` ranks, for a buffer of ``size`` bytes (the full tensor for the
gathers and scatters):

==================================  ======================
all-reduce                          ``2 (n-1)/n * size``
all-gather, reduce-scatter,         ``(n-1)/n * size``
broadcast, all-to-all
send (``p2p``)                      ``size``
recv                                ``0``
==================================  ======================

All-to-all is counted as the bytes a device sends to OTHER ranks (its own chunk stays put): a
balanced all-to-all of a ``size``-byte input sends ``(n-1)/n`` of it, which is the row above; an
all-to-all with variable splits (the expert dispatch of ``runtime.moe``) sends the sum of its
chunks for the other ranks, ``all_to_all_bytes``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["COLLECTIVES", "ring_bytes", "all_to_all_bytes"]

COLLECTIVES: tuple[str, ...] = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "all_to_all",
    "send",
    "p2p",
    "recv",
)
"""Every collective kind (``p2p`` is a send under another name)."""


def ring_bytes(kind: str, size_bytes: Any, ranks: int) -> Any:
    """Bytes one device sends for a collective ``kind`` of ``size_bytes`` over ``ranks`` ranks."""
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {', '.join(COLLECTIVES)}")
    if ranks <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (ranks - 1) / ranks * size_bytes
    if kind in ("all_gather", "reduce_scatter", "broadcast", "all_to_all"):
        return (ranks - 1) / ranks * size_bytes
    if kind in ("send", "p2p"):
        return 1.0 * size_bytes
    return 0.0  # recv


def all_to_all_bytes(chunk_bytes: list[Any], own_index: int) -> Any:
    """Bytes one device sends in an all-to-all whose input holds ``chunk_bytes[j]`` bytes for
    rank ``j`` of the group (this device being rank ``own_index``): every chunk but its own."""
    if not 0 <= own_index < len(chunk_bytes):
        raise ValueError(f"rank index {own_index} outside a group of {len(chunk_bytes)} chunks")
    return sum(size for j, size in enumerate(chunk_bytes) if j != own_index)
