"""What the partition/recompute problem of one candidate is, whichever way it is solved: the
objective's scale and tie-break weights, the capacity margin, and the most blocks a stage can
hold. The ILP (:mod:`planner.search.ilp`) and the block-count solver
(:mod:`planner.search.block_counts`) read the same numbers, so they find the same optimum."""

from __future__ import annotations

import math

from cost_models.layer_work import LayerCost
from cost_models.strategy import CandidateCosts
from planner.search.candidates import time_lower_bound

__all__ = [
    "TIE_BREAK",
    "COUNT_TIE_BREAK",
    "OBJECTIVE_SCALE",
    "CUTOFF_SLACK",
    "MEMORY_MARGIN",
    "objective_scale",
    "count_weight",
    "block_capacity",
]

#: Weight of the tie-break terms (recompute + transfer seconds) against the step time.
TIE_BREAK = 1e-6
#: Weight of the recomputed-layer count (per layer of the table, after the seconds): a layer whose
#: recompute is free in the FLOP model, such as an embedding, is not recomputed for nothing.
COUNT_TIE_BREAK = 0.1 * TIE_BREAK
#: The objective is scaled to about this value (the step-time bound, or the capacity, maps to it).
OBJECTIVE_SCALE = 1000.0
#: Relative slack on a cutoff (the tie-break terms and solver tolerances sit well inside it).
CUTOFF_SLACK = 1e-5
#: Relative margin kept below the capacity (an ILP solver's feasibility tolerance).
MEMORY_MARGIN = 1e-6


def objective_scale(costs: CandidateCosts) -> float:
    """Seconds to objective units: the step-time lower bound maps to :data:`OBJECTIVE_SCALE`, so
    relative differences of 1e-6 stay far above a solver's absolute tolerances."""
    return OBJECTIVE_SCALE / max(time_lower_bound(costs), 1e-30)


def count_weight(costs: CandidateCosts) -> float:
    """The objective's weight of one recomputed layer (half of it for a selective one)."""
    return COUNT_TIE_BREAK * OBJECTIVE_SCALE / costs.num_layers


def block_capacity(costs: CandidateCosts, blk: LayerCost | None = None) -> list[int]:
    """Most blocks each stage can hold in a uniform table (a valid bound that tightens the ILP).

    Stage ``k`` with ``n`` blocks needs at least ``n (st + a_k min(sv, in, sv - sel))`` plus the
    state and least activations of the embedding / head rows it holds, whatever it recomputes, so
    ``n_k <= (capacity - fixed_k) / (st + a_k min(sv, in, sv - sel))``; never more than ``L``; -1
    when even the embedding / head rows alone do not fit. ``blk``: the repeated block (the table's
    second row unless given; other rows a stage may hold are left out, which keeps the bound valid).
    """
    stages, blocks = costs.cand.pp, costs.num_layers - 2
    pre, post = costs.layers[0], costs.layers[-1]
    blk = costs.layers[1] if blk is None else blk
    capacities = []
    for k in range(stages):
        in_flight = costs.inflight[k]
        fixed = 0.0
        for row, here in ((pre, k == 0), (post, k == stages - 1)):
            if here:
                fixed += row.state_b + in_flight * min(row.saved_b, row.input_b)
        per_block = blk.state_b + in_flight * min(blk.saved_b, blk.input_b, blk.saved_b - blk.sel_saved_b)
        room = costs.capacity - fixed
        n = blocks if per_block <= 0 else int(max(-1.0, math.floor(room / per_block * (1 + 1e-12))))
        capacities.append(max(0, min(blocks, n)) if room >= 0 else -1)
    return capacities
