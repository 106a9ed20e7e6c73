"""The runtime's buffering limits, which the memory model prices as the runtime keeps them."""

from __future__ import annotations

__all__ = ["REDUCTIONS_IN_FLIGHT"]

REDUCTIONS_IN_FLIGHT = 2
"""Gradient reductions the ZeRO engine keeps in flight at once; launching another waits for the
oldest, so ``REDUCTIONS_IN_FLIGHT + 1`` layers' gradient buffers can be alive together."""
