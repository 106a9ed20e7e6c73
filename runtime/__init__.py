"""planner's training runtime.

Compiled stage modules import only ``torch`` and ``runtime``. This package never imports
``planner``, ``passes``, ``codegen`` or ``cost_models``.

The two helpers generated code calls directly live here:

- ``runtime.device()``: the device this rank computes on (tensors the graph creates, such as
  position indices, are made there);
- ``runtime.checkpoint(layer, *args)``: run a layer without keeping its activations and
  recompute them in backward (non-reentrant, RNG state restored so dropout masks match).
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint

__version__ = "0.1.0"

_DEVICE = torch.device("cpu")


def device() -> torch.device:
    """The device of this rank (set by the trainer; CPU by default)."""
    return _DEVICE


def set_device(d: torch.device | str) -> None:
    global _DEVICE
    _DEVICE = torch.device(d)


def checkpoint(layer, *args):
    """Activation checkpointing of one layer: keep its inputs, recompute the rest in backward."""
    if not torch.is_grad_enabled():
        return layer(*args)
    return torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False, preserve_rng_state=True)
