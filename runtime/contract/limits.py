"""The runtime's buffering limits, which the memory model prices as the runtime keeps them."""

from __future__ import annotations

__all__ = [
    "REDUCTIONS_IN_FLIGHT",
    "GRAD_BUCKET_BYTES",
    "FIRST_BUCKET_BYTES",
    "ATTENTION_TILE",
    "ATTENTION_TILE_TENSORS",
]

REDUCTIONS_IN_FLIGHT = 2
"""Gradient reductions the ZeRO engine keeps in flight at once; launching another waits for the
oldest, so ``REDUCTIONS_IN_FLIGHT + 1`` layers' gradient buffers can be alive together."""

GRAD_BUCKET_BYTES = 25 * 2**20
"""Most bytes of one ZeRO 0/1 gradient bucket (``runtime.data_parallel.grad_reduction``), DDP's
default: consecutive layers in backward order share one all-reduce, launched when the bucket's
last layer's gradient is ready (``cost_models.overlap_cost`` prices each bucket's window so)."""

FIRST_BUCKET_BYTES = 2**20
"""Cap of the first gradient bucket of a step (the last layers' gradients, ready first), as DDP's:
the first reduction starts early in backward."""

ATTENTION_TILE = 512
"""Queries and keys per tile of context-parallel attention (``runtime.context_parallel.blocks``):
its float32 scores are computed ``ATTENTION_TILE x ATTENTION_TILE`` per head at a time."""

ATTENTION_TILE_TENSORS = 2
"""Float32 ``[b, heads, tile, tile]`` tensors alive at once in a tile's backward: the scores,
turned into the probabilities in place, and the probabilities' gradient, turned into the
scores' gradient in place."""
