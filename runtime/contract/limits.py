"""The runtime's buffering limits, which the memory model prices as the runtime keeps them."""

from __future__ import annotations

__all__ = ["REDUCTIONS_IN_FLIGHT", "ATTENTION_TILE", "ATTENTION_TILE_TENSORS"]

REDUCTIONS_IN_FLIGHT = 2
"""Gradient reductions the ZeRO engine keeps in flight at once; launching another waits for the
oldest, so ``REDUCTIONS_IN_FLIGHT + 1`` layers' gradient buffers can be alive together."""

ATTENTION_TILE = 512
"""Queries and keys per tile of context-parallel attention (``runtime.context_parallel.blocks``):
its float32 scores are computed ``ATTENTION_TILE x ATTENTION_TILE`` per head at a time."""

ATTENTION_TILE_TENSORS = 2
"""Float32 ``[b, heads, tile, tile]`` tensors alive at once in a tile's backward: the scores,
turned into the probabilities in place, and the probabilities' gradient, turned into the
scores' gradient in place."""
