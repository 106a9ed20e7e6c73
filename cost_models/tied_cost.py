"""The price of a weight tied across pipeline stages (Megatron's embedding group).

With ``pp > 1`` a weight read by rows ``a < b`` of the layer table (a tied embedding and LM head)
is held by the stages of both rows (``runtime.data_parallel.tied_weights``); the planner assumes those are different
stages (rows 0 and L+1 always are). The layer table counts the weight in row ``a``, so:

- memory: row ``b`` carries one more copy, with its gradient and optimizer state as the ZeRO
  stage keeps them (``model_state_bytes`` of the weight's per-device elements);
- time and bytes: after the last backward both holders all-reduce the copy's gradient over the
  tied group (2 ranks, the same dp and tp coordinates): at ZeRO 0/1 the full gradient buffer
  (padded to a multiple of dp, compute dtype), at ZeRO 2/3 the fp32 shard (``ceil(P / dp)``
  elements), exposed like the per-step dp collectives and charged to both rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from cost_models.comm_cost import GroupPlacement, collective_time, group_placement
from cost_models.hardware import HardwareProfile
from cost_models.memory import FP32_GRAD_SHARD, bytes_per_param, model_state_bytes, shard_elements
from runtime.contract.collective_bytes import ring_bytes

__all__ = ["TiedCost", "tied_weight_costs"]


@dataclass(frozen=True)
class TiedCost:
    """What one tied weight adds to its two rows at one candidate."""

    first: int
    """The row that already counts the weight (its first reader)."""
    last: int
    """The row whose stage holds the extra copy."""
    params_b: int
    grads_b: int
    optimizer_b: int
    """Model state of the extra copy (bytes on one device)."""
    allreduce_bytes: int
    """Size of the gradient all-reduce over the tied group."""
    sent_b: float
    """Bytes one holder sends for it (ring convention over 2 ranks: the size)."""
    time_s: float


@functools.lru_cache(maxsize=1024)
def _worst_tied_group(width: int, pp: int, gpus_per_node: int) -> GroupPlacement:
    """The slowest tied group: stage 0 and stage pp-1 at the same (dp, tp) coordinates."""
    placements = [group_placement([i, (pp - 1) * width + i], gpus_per_node) for i in range(width)]
    return max(
        placements,
        key=lambda placement: (
            placement.nodes,
            -(placement.min_ranks_per_node or placement.ranks_per_node),
            placement.ranks_per_node,
        ),
    )


def tied_weight_costs(
    tied: list[dict], dp: int, tp: int, pp: int, zero_stage: int, dtype: str, hw: HardwareProfile, gpus_per_node: int
) -> list[TiedCost]:
    """The extra cost of each tied weight (``LayerTable.tied`` entries with ``params``) at this
    candidate; empty at ``pp == 1``, where one stage holds the weight."""
    if pp == 1 or not tied:
        return []
    placement = _worst_tied_group(dp * tp, pp, gpus_per_node)
    out = []
    for weight in tied:
        count, count_tp = int(weight.get("params", 0)), int(weight.get("params_tp", 0))
        per_dev = -(-count_tp // tp) + (count - count_tp)
        if not per_dev:
            continue
        state = model_state_bytes(per_dev, dtype, zero_stage, dp)
        shard = shard_elements(per_dev, dp)
        size = shard * FP32_GRAD_SHARD if zero_stage >= 2 else shard * dp * bytes_per_param(dtype)["grads"]
        out.append(
            TiedCost(
                first=int(weight["layers"][0]),
                last=int(weight["layers"][1]),
                params_b=state["params"],
                grads_b=state["grads"],
                optimizer_b=state["optimizer"],
                allreduce_bytes=size,
                sent_b=float(ring_bytes("all_reduce", size, 2)),
                time_s=float(collective_time("all_reduce", size, placement, hw)),
            )
        )
    return out
