"""Portable versions of operators a traced graph may hold but a device cannot run as traced.

The planner traces on the meta device, so a model's own device checks (``if x.device.type ==
"cpu"``) take their accelerator branch, and library operators registered outside torch are
called by name. Codegen (``codegen.lower``) writes calls to these functions in their place:

- ``histc``: CPU (and MPS) kernels take only floating-point input, CUDA's deterministic one only
  integers. transformers' mixture-of-experts layers count tokens per expert with an integer
  ``histc`` off the CPU; on a CPU rank the input is counted as floats (the same bins).
- ``grouped_mm``: transformers' ``grouped_mm_fallback`` (``[S, K]`` rows sorted by expert times
  ``[E, K, N]`` expert weights, ``offs`` the cumulative row counts), which exists only while
  transformers is imported; compiled code runs with torch and ``runtime`` alone. The same loop
  of matrix products over the groups, differentiated by autograd (rows past ``offs[-1]`` give 0,
  as there).
"""

from __future__ import annotations

import torch

__all__ = ["histc", "grouped_mm"]


def histc(x: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:  # noqa: A002
    """``torch.histc`` with the input dtype the device's kernel takes."""
    if x.device.type in ("cpu", "mps") and not x.is_floating_point():
        x = x.float()
    return torch.histc(x, bins=bins, min=min, max=max)


def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:  # noqa: A002
    """Row block ``g`` of ``input`` (up to ``offs[g]``) times ``weight[g]``."""
    parts, start = [], 0
    for group_index, end in enumerate(offs.tolist()):
        parts.append(input[start:end] @ weight[group_index])
        start = end
    if start < input.shape[0]:
        parts.append(input.new_zeros(input.shape[0] - start, weight.shape[2]))
    return torch.cat(parts)
