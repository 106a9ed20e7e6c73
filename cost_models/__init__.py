"""cost_models"""

from cost_models.comm_cost import (
    GroupPlacement,
    axis_placement,
    collective_time,
    group_placement,
    zero_dp_collectives,
)
from cost_models.compute import compute_time, dtype_bytes, optimizer_step_time
from cost_models.hardware import KNOWN_KINDS, HardwareProfile, ProfileError, load_hardware
from cost_models.memory import (
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
