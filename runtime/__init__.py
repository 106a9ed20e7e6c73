"""planner's training runtime.

Compiled stage modules import only ``torch`` and ``runtime``. This package never imports
``planner``, ``passes``, ``codegen`` or ``cost_models``.

The two helpers generated code calls directly live here:

- ``runtime.device()``: the device this rank computes on (tensors the graph creates, such as
  position indices, are made there);
- ``runtime.checkpoint(layer, *args)``: run a layer without keeping its activations and
  recompute them in backward (non-reentrant, RNG state restored so dropout masks match).

This file imports torch only inside those helpers: the planner reads ``runtime.contract`` (the
dtype and input-role names) while planning, and importing any ``runtime`` module runs this file
first, so a module-level ``import torch`` here would cost every re-plan torch's import (most of
its time). Generated code and the trainer have imported torch long before they call these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__version__ = "0.1.0"

_DEVICE: "torch.device | None" = None


def device() -> "torch.device":
    """The device of this rank (set by the trainer; CPU by default)."""
    import torch

    return _DEVICE if _DEVICE is not None else torch.device("cpu")


def set_device(new_device: "torch.device | str") -> None:
    import torch

    global _DEVICE
    _DEVICE = torch.device(new_device)


def checkpoint(layer, *args):
    """Activation checkpointing of one layer: keep its inputs, recompute the rest in backward."""
    import torch
    import torch.utils.checkpoint

    if not torch.is_grad_enabled():
        return layer(*args)
    return torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False, preserve_rng_state=True)
