"""AdamW on flat fp32 shards, gradient clipping math, and resharding of ZeRO optimizer state.

AdamW (decoupled weight decay, Loshchilov & Hutter), one step ``t`` (1-based) for a parameter
``w`` with gradient ``g``, learning rate ``lr`` and decay ``wd``::

    w   <- w * (1 - lr * wd)                       # decoupled decay, only on decayed elements
    m   <- beta1 * m + (1 - beta1) * g
    v   <- beta2 * v + (1 - beta2) * g * g
    w   <- w - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

Everything is elementwise, so it applies unchanged to a *flat shard*: a contiguous slice of the
concatenation of a layer's parameters. Padding elements have ``w = g = m = v = 0`` and stay 0
(the update is ``0 / (0 + eps)``). The order of operations follows ``torch.optim.AdamW``'s
single-tensor path so that results agree with it to rounding.

Gradient clipping by the global norm: with ``N = sqrt(sum over every element of every shard on
every rank of g^2)`` the gradients are multiplied by ``min(1, max_norm / (N + 1e-6))``, the same
coefficient ``torch.nn.utils.clip_grad_norm_`` uses.

Sharded state format (what ``ZeroEngine.state_dict`` returns, and what the helpers here reshard)::

    {"format": "planner.zero/1", "zero_stage", "num_shards", "shard_index", "step",
     "groups": [{"names": [...], "shapes": [[...], ...], "numel": n}, ...],
     "master": [Tensor], "exp_avg": [Tensor], "exp_avg_sq": [Tensor],   # one per group
     "loss_scaler": dict | None}

Group ``i``'s tensors are this shard's slice of the group's flat fp32 vector padded with zeros to
``padded = ceil(n / num_shards) * num_shards`` elements: shard ``k`` holds
``[k * padded / num_shards, (k + 1) * padded / num_shards)``. With ``num_shards == 1`` the
tensors hold exactly ``n`` elements (no padding). ``consolidate_shards`` joins the shards of all
ranks into one such full state; ``slice_shard`` cuts a full state for any other shard count, so
a checkpoint written at one data-parallel degree loads at another.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = [
    "FORMAT",
    "adamw_step_",
    "clip_coefficient",
    "padded_numel",
    "consolidate_shards",
    "slice_shard",
]

FORMAT = "planner.zero/1"
_STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


@torch.no_grad()
def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decay_ranges: Sequence[tuple[int, int]] | None = None,
) -> None:
    """One AdamW update of the flat fp32 ``param`` in place (see the module docstring).

    ``step`` is the 1-based count including this update. ``decay_ranges`` lists the
    ``[start, end)`` element ranges that receive weight decay; ``None`` decays everything.
    """
    if param.dtype != torch.float32 or exp_avg.dtype != torch.float32:
        raise TypeError(f"AdamW runs on fp32 masters and state, got {param.dtype}/{exp_avg.dtype}")
    if step < 1:
        raise ValueError(f"AdamW step count must be >= 1, got {step}")
    if weight_decay != 0.0:
        factor = 1.0 - lr * weight_decay
        if decay_ranges is None:
            param.mul_(factor)
        else:
            for a, b in decay_ranges:
                param[a:b].mul_(factor)
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """Multiplier that clips gradients of global norm ``total_norm`` to ``max_norm`` (1.0: none)."""
    if max_norm is None:
        return 1.0
    if max_norm <= 0:
        raise ValueError(f"max_grad_norm must be > 0, got {max_norm}")
    return min(1.0, max_norm / (total_norm + 1e-6))


def padded_numel(numel: int, num_shards: int) -> int:
    """``numel`` rounded up to a multiple of ``num_shards`` (the flat buffer length)."""
    return -(-numel // num_shards) * num_shards


def _check_format(state: dict, what: str) -> None:
    if state.get("format") != FORMAT:
        raise ValueError(
            f"{what} is not a ZeRO engine state dict (format {state.get('format')!r}, "
            f"expected {FORMAT!r})"
        )


def consolidate_shards(states: Sequence[dict]) -> dict:
    """Join the state dicts of all shards (one per dp rank, any order) into one full state.

    The result has ``num_shards == 1`` and unpadded tensors; pass it to ``slice_shard`` or
    directly to ``ZeroEngine.load_state_dict`` at any data-parallel degree or ZeRO stage.
    """
    if not states:
        raise ValueError("consolidate_shards needs at least one state dict")
    for s in states:
        _check_format(s, "a shard")
    n = states[0]["num_shards"]
    by_index = {s["shard_index"]: s for s in states}
    if sorted(by_index) != list(range(n)) or len(states) != n:
        raise ValueError(
            f"consolidate_shards needs exactly one state per shard index 0..{n - 1}, "
            f"got indices {sorted(s['shard_index'] for s in states)}"
        )
    first = by_index[0]
    for s in states:
        if s["groups"] != first["groups"] or s["step"] != first["step"]:
            raise ValueError("shards come from different models or steps; they cannot be joined")
    out = {k: v for k, v in first.items() if k not in _STATE_KEYS}
    out["num_shards"], out["shard_index"] = 1, 0
    for key in _STATE_KEYS:
        out[key] = [
            torch.cat([by_index[k][key][g] for k in range(n)])[: grp["numel"]].clone()
            for g, grp in enumerate(first["groups"])
        ]
    return out


def slice_shard(full: dict, num_shards: int, index: int) -> dict:
    """Shard ``index`` of ``num_shards`` of a full state (``num_shards == 1``), padding each group."""
    _check_format(full, "the full state")
    if full["num_shards"] != 1:
        raise ValueError(
            f"slice_shard needs a full state (num_shards 1), got num_shards {full['num_shards']}; "
            "join the shards with consolidate_shards first"
        )
    if not 0 <= index < num_shards:
        raise ValueError(f"shard index {index} is outside 0..{num_shards - 1}")
    out = {k: v for k, v in full.items() if k not in _STATE_KEYS}
    out["num_shards"], out["shard_index"] = num_shards, index
    for key in _STATE_KEYS:
        tensors = []
        for g, grp in enumerate(full["groups"]):
            flat = full[key][g]
            n = grp["numel"]
            if flat.numel() != n:
                raise ValueError(f"group {g} {key} has {flat.numel()} elements, expected {n}")
            if num_shards == 1:
                tensors.append(flat.clone())
                continue
            size = padded_numel(n, num_shards) // num_shards
            piece = torch.zeros(size, dtype=flat.dtype)
            lo, hi = index * size, min((index + 1) * size, n)
            if hi > lo:
                piece[: hi - lo] = flat[lo:hi]
            tensors.append(piece)
        out[key] = tensors
    return out
