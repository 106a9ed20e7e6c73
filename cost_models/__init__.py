"""cost_models"""

from .comm import (
    GroupPlacement,
    axis_placement,
    collective_time,
    group_placement,
    ring_bytes_sent,
    zero_dp_collectives,
)
from .compute import compute_time, dtype_bytes, optimizer_step_time
from .hardware import KNOWN_KINDS, HardwareProfile, ProfileError, load_hardware
from .memory import (
    activation_bytes,
    inflight_microbatches,
    memory_breakdown,
    model_state_bytes,
    stage_activation_bytes,
)

__all__ = [
    "GroupPlacement",
    "axis_placement",
    "collective_time",
    "group_placement",
    "ring_bytes_sent",
    "zero_dp_collectives",
    "compute_time",
    "dtype_bytes",
    "optimizer_step_time",
    "KNOWN_KINDS",
    "HardwareProfile",
    "ProfileError",
    "load_hardware",
    "activation_bytes",
    "inflight_microbatches",
    "memory_breakdown",
    "model_state_bytes",
    "stage_activation_bytes",
]
