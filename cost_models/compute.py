"""Compute time: a roofline with an efficiency term.

An operator that performs ``F`` floating-point operations and moves ``M`` bytes between device
memory and the compute units takes, on a device with peak ``P[dtype]`` FLOP/s, achievable
fraction ``e`` of that peak and memory bandwidth ``W`` bytes/s::

    t = max( F / (P[dtype] * e),  M / W )

The first term is the compute ceiling (matmuls, attention), the second the memory ceiling
(norms, elementwise ops, the optimizer step). Which one binds is decided by the operator's
arithmetic intensity ``F / M`` against the device's ridge point ``P * e / W``.

The functions accept plain numbers or sympy expressions (costs symbolic in micro-batch size and
sequence length): ``max`` then becomes ``sympy.Max`` so a symbolic cost can be substituted later.
"""

from __future__ import annotations

from typing import Any

import sympy

from .hardware import HardwareProfile, ProfileError

__all__ = [
    "DTYPES",
    "DTYPE_BYTES",
    "dtype_bytes",
    "compute_time",
    "matmul_flops",
    "matmul_time",
    "ridge_intensity",
    "adam_step_bytes",
    "adam_step_flops",
    "optimizer_step_time",
    "smax",
    "smin",
]

#: The training dtypes of the CLI contract (``--dtype``); ``tf32`` is an fp32 matmul mode.
DTYPES: tuple[str, ...] = ("fp32", "bf16", "fp16")

#: Bytes per element of each dtype name (``tf32`` is stored as fp32).
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` (``fp32``, ``tf32``, ``bf16``, ``fp16``)."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}: expected one of {', '.join(DTYPE_BYTES)}") from None


def _is_symbolic(x: Any) -> bool:
    return type(x).__module__.startswith("sympy")


def smax(a: Any, b: Any) -> Any:
    """``max`` that also works on sympy expressions (``sympy.Max``)."""
    if _is_symbolic(a) or _is_symbolic(b):
        return sympy.Max(a, b)
    return a if a >= b else b


def smin(a: Any, b: Any) -> Any:
    """``min`` that also works on sympy expressions (``sympy.Min``)."""
    if _is_symbolic(a) or _is_symbolic(b):
        return sympy.Min(a, b)
    return a if a <= b else b


def _check_nonneg(name: str, v: Any) -> None:
    if not _is_symbolic(v) and v < 0:
        raise ValueError(f"{name} must be >= 0 (got {v!r})")


def compute_time(flops: Any, bytes_moved: Any, hw: HardwareProfile, dtype: str) -> Any:
    """Roofline time in seconds: ``max(flops / (peak[dtype] * efficiency), bytes / mem_bw)``.

    ``flops`` counts floating-point operations (a multiply-add is 2), ``bytes_moved`` the bytes
    read plus written in device memory. ``dtype`` picks the peak: ``fp32``, ``bf16``, ``fp16``
    (or ``tf32`` where the profile has it).
    """
    _check_nonneg("flops", flops)
    _check_nonneg("bytes_moved", bytes_moved)
    try:
        rate = hw.achievable_flops(dtype)
    except ProfileError as e:
        raise ValueError(str(e)) from None
    return smax(flops / rate, bytes_moved / hw.memory_bandwidth)


def matmul_flops(m: Any, n: Any, k: Any, batch: Any = 1) -> Any:
    """FLOPs of ``batch`` products of an ``m x k`` by a ``k x n`` matrix: ``2 * batch * m * n * k``."""
    return 2 * batch * m * n * k


def matmul_time(m: Any, n: Any, k: Any, hw: HardwareProfile, dtype: str, batch: Any = 1) -> Any:
    """Roofline time of a (batched) matmul that reads both operands and writes the result once."""
    b = dtype_bytes(dtype)
    moved = batch * (m * k + k * n + m * n) * b
    return compute_time(matmul_flops(m, n, k, batch), moved, hw, dtype)


def ridge_intensity(hw: HardwareProfile, dtype: str) -> float:
    """FLOPs per byte above which an operator is compute-bound on ``hw``: ``P * e / W``."""
    return hw.achievable_flops(dtype) / hw.memory_bandwidth


def adam_step_bytes(num_params: Any, dtype: str) -> Any:
    """Device-memory bytes one AdamW step moves for ``num_params`` (this device's shard).

    Per parameter the step reads the gradient, the fp32 (master) weight and both fp32 moments,
    and writes the weight and both moments; mixed precision also writes the low-precision copy
    of the weight that the next forward uses:

    - fp32:       read 4 (grad) + 4 (w) + 4 (m) + 4 (v), write 4 + 4 + 4        = 28 bytes
    - bf16/fp16:  read 2 (grad) + 4 (master) + 4 + 4, write 4 + 4 + 4 + 2 (w)    = 28 bytes
    """
    if dtype == "fp32":
        per = 4 + 4 + 4 + 4 + 4 + 4 + 4
    elif dtype in ("bf16", "fp16"):
        per = 2 + 4 + 4 + 4 + 4 + 4 + 4 + 2
    else:
        raise ValueError(f"unknown training dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    return per * num_params


def adam_step_flops(num_params: Any) -> Any:
    """About 12 FLOPs per parameter: two moment updates, bias corrections, sqrt, divide, decay."""
    return 12 * num_params


def optimizer_step_time(num_params: Any, hw: HardwareProfile, dtype: str) -> Any:
    """Roofline time of one AdamW step over ``num_params`` parameters (memory-bound in practice).

    The elementwise arithmetic runs in fp32 whatever the training dtype, so the fp32 peak applies.
    """
    return compute_time(adam_step_flops(num_params), adam_step_bytes(num_params, dtype), hw, "fp32")
