"""Mixed precision for the ZeRO engine: compute dtypes and the dynamic loss scaler.

Training keeps fp32 *master* weights and AdamW state; the module computes in a *compute dtype*
(``param_dtype``): fp32, bf16 or fp16.

bf16 has fp32's exponent range, so gradients neither overflow nor underflow in practice and no
loss scaling is needed. fp16 has a 5-bit exponent: small gradients flush to zero. The standard
remedy is to multiply the loss by a large factor ``s`` before backward (all gradients are scaled
by ``s`` by linearity), then divide the reduced gradients by ``s`` in fp32 before the optimizer.
If ``s`` is too large some gradient overflows to inf/nan; that step is skipped and ``s`` shrinks.

``DynamicLossScaler`` keeps ``s`` near the largest value that does not overflow:

- an overflow step is always skipped. The first ``hysteresis - 1`` overflows since the last growth
  only use up the hysteresis budget; once it is spent, every overflow multiplies ``s`` by
  ``backoff_factor`` (never below ``min_scale``). Hysteresis tolerates isolated spikes without
  throwing away scale.
- after ``growth_interval`` consecutive good steps, ``s`` is multiplied by ``growth_factor`` and
  the hysteresis budget is refilled.

The overflow decision must be identical on every rank (one skips, all skip); the engine reduces
the overflow flag across data-, tensor- and pipeline-parallel ranks before calling ``update``,
so every rank's scaler walks through the same states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from runtime.dtypes import TORCH_DTYPES, name_of

__all__ = ["DynamicLossScaler", "check_compute_dtype", "cast_floating", "dtype_name"]


def check_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Return ``dtype`` if the engine can compute in it (``runtime.dtypes``), else raise a
    ValueError naming the options."""
    if dtype not in TORCH_DTYPES.values():
        raise ValueError(f"param_dtype={dtype} is not supported; use torch.float32, torch.bfloat16 or torch.float16")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """``fp32`` / ``bf16`` / ``fp16`` for a compute dtype."""
    return name_of(check_compute_dtype(dtype))


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor inside ``obj`` (nested tuples/lists/dicts) to ``dtype``.

    Integer tensors (token ids, labels) and non-tensors pass through unchanged.
    """
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, tuple):
        return tuple(cast_floating(item, dtype) for item in obj)
    if isinstance(obj, list):
        return [cast_floating(item, dtype) for item in obj]
    if isinstance(obj, dict):
        return {k: cast_floating(value, dtype) for k, value in obj.items()}
    return obj


@dataclass
class DynamicLossScaler:
    """Loss scale for fp16 training; see the module docstring for the update rule.

    The defaults are the usual fp16 recipe: start at 2**16, double after 1000 good steps, halve
    on overflow once two overflows have been seen since the last growth, never below 1.
    """

    init_scale: float = 2.0**16
    """Scale before the first step."""
    growth_factor: float = 2.0
    """Multiplier applied after ``growth_interval`` consecutive steps without overflow (> 1)."""
    backoff_factor: float = 0.5
    """Multiplier applied on an overflow once the hysteresis budget is spent (in (0, 1))."""
    growth_interval: int = 1000
    """Number of consecutive good steps before the scale grows (>= 1)."""
    hysteresis: int = 2
    """Overflows tolerated (skipped, scale kept) since the last growth; the ``hysteresis``-th
    overflow and every later one back off. 1 means: back off on every overflow."""
    min_scale: float = 1.0
    """Lower bound of the scale (> 0)."""

    def __post_init__(self) -> None:
        if not self.init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {self.init_scale}")
        if not self.growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {self.growth_factor}")
        if not 0 < self.backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor}")
        if self.growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {self.growth_interval}")
        if self.hysteresis < 1:
            raise ValueError(f"hysteresis must be >= 1, got {self.hysteresis}")
        if not 0 < self.min_scale <= self.init_scale:
            raise ValueError(f"min_scale must be in (0, init_scale={self.init_scale}], got {self.min_scale}")
        self.scale: float = float(self.init_scale)
        self.good_steps: int = 0
        """Consecutive steps without overflow since the last overflow or growth."""
        self.hysteresis_left: int = int(self.hysteresis)
        """Overflows still tolerated before backing off."""
        self.overflows: int = 0
        """Total overflow (skipped) steps so far."""

    def update(self, found_overflow: bool) -> None:
        """Advance the state by one step that did (``True``) or did not overflow."""
        if found_overflow:
            self.overflows += 1
            self.good_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, float(self.min_scale))
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
            self.hysteresis_left = int(self.hysteresis)

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "good_steps": self.good_steps,
            "hysteresis_left": self.hysteresis_left,
            "overflows": self.overflows,
        }

    def load_state_dict(self, state: dict) -> None:
        missing = {"scale", "good_steps", "hysteresis_left"} - set(state)
        if missing:
            raise KeyError(f"loss scaler state is missing {sorted(missing)}")
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.overflows = int(state.get("overflows", 0))
