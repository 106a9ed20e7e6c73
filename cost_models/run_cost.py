"""What a whole training run costs: days, GPU-hours and money, split by where the time goes.

A plan predicts one optimizer step: ``step_time_s`` seconds on ``gpus`` devices, split into the
parts of ``predicted.time`` (compute, recompute, TP all-reduces, pipeline bubble, DP/ZeRO
traffic, optimizer, offload transfers to host memory and NVMe; more parts as the time model grows). A run that trains on ``tokens`` tokens
takes ``steps = ceil(tokens / (global_batch * seq_len))`` such steps, because an optimizer step
consumes whole global batches. Then::

    seconds   = steps * step_time_s
    days      = seconds / 86400
    gpu_hours = seconds / 3600 * gpus          (every device is held for the whole run)
    money     = gpu_hours * price_per_gpu_hour (None without a price)

``by_part[k]`` is the share of the bill that part ``k`` of the step accounts for: the money when a
price is given, else the GPU-hours, ``(money or gpu_hours) * time[k] / step_time_s``. The parts of
``predicted.time`` sum to the step time, so ``by_part`` sums to the total. A part is billed for
every device because a device waiting on a pipeline bubble or an all-reduce is paid for all the
same: that is why the bubble is worth buying down.

With 1-bit Adam (``warmup``: plan.json's ``compression_warmup`` and
``predicted.compression``) the first ``w = min(warmup steps, steps)`` steps run in full precision:
``seconds = w * warmup_step_s + (steps - w) * step_time_s``, and each part is billed for its
seconds in both kinds of step.

Pure functions of numbers; nothing here reads a profile or a model.
"""

from __future__ import annotations

import math

__all__ = ["run_cost", "scale_cost", "SECONDS_PER_DAY"]

SECONDS_PER_DAY = 86400.0


def run_cost(
    tokens: float,
    tokens_per_step: int,
    step_time_s: float,
    time: dict,
    gpus: int,
    price_per_gpu_hour: float | None = None,
    warmup: dict | None = None,
) -> dict:
    """plan.json's ``predicted.cost`` for a run of ``tokens`` tokens (see the module docstring).

    ``time`` is ``predicted.time`` (seconds by part); the result carries ``steps`` beside the
    contract's ``tokens, days, gpu_hours, money, by_part``. ``warmup``: ``{"steps", "step_time_s",
    "time"}`` of a compressed plan's full-precision warm-up steps (None: every step is alike).
    """
    if not tokens > 0 or not math.isfinite(tokens):
        raise ValueError(f"tokens must be a positive number, got {tokens!r}")
    if tokens_per_step < 1 or gpus < 1:
        raise ValueError(f"tokens_per_step and gpus must be positive, got {tokens_per_step}, {gpus}")
    if price_per_gpu_hour is not None and not price_per_gpu_hour > 0:
        raise ValueError(f"price_per_gpu_hour must be positive, got {price_per_gpu_hour!r}")
    steps = math.ceil(tokens / tokens_per_step)
    warm = min(int(warmup["steps"]), steps) if warmup else 0
    part_seconds = {part: (steps - warm) * part_s for part, part_s in time.items()}
    seconds = (steps - warm) * step_time_s
    if warmup and warm:
        seconds += warm * warmup["step_time_s"]
        for part, part_s in warmup["time"].items():
            part_seconds[part] = part_seconds.get(part, 0.0) + warm * part_s
    gpu_hours = seconds / 3600.0 * gpus
    money = gpu_hours * price_per_gpu_hour if price_per_gpu_hour is not None else None
    billed = money if money is not None else gpu_hours
    by_part = {part: (billed * part_s / seconds if seconds > 0 else 0.0) for part, part_s in part_seconds.items()}
    return {
        "tokens": float(tokens),
        "steps": int(steps),
        "days": seconds / SECONDS_PER_DAY,
        "gpu_hours": gpu_hours,
        "money": money,
        "by_part": by_part,
    }


def scale_cost(cost: dict, step_time_s: float, best_step_time_s: float) -> dict:
    """The cost of a runner-up of the same cluster and batch: the same steps on the same devices,
    each ``step_time_s`` long instead of ``best_step_time_s`` (its parts are not known here, so
    ``by_part`` is left out)."""
    ratio = step_time_s / best_step_time_s if best_step_time_s > 0 else 0.0
    return {
        "tokens": cost["tokens"],
        "steps": cost.get("steps"),
        "days": cost["days"] * ratio,
        "gpu_hours": cost["gpu_hours"] * ratio,
        "money": cost["money"] * ratio if cost["money"] is not None else None,
    }
