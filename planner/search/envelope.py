"""Repeated blocks that differ only in how much of their data-parallel traffic hides.

A layer's gradient reduction and ZeRO gathers run beside the compute around it, and how much of
them that compute hides depends on the layer's place (``cost_models.strategy._overlap_dp``):
with heavy traffic, DeepSeek-V3's experts under ZeRO 2 say, the reductions queue behind one
another and the exposed seconds change along the model in steps. The blocks are then identical
but for those time fields, and the block-count solver (:mod:`planner.search.block_counts`),
which needs identical blocks, did not apply: the general ILP (one binary per layer and stage)
ran into its 60 s limit on each such candidate of a 61-block model, and a plan on 256 GPUs did
not finish in five minutes.

The envelope is one row for the whole run: each of those fields (:data:`EXPOSURE_FIELDS`) at
its largest over the run, every other field as the blocks share it. The block-count solver's
optimum on the envelope (after the head of distinct blocks, as usual) is a partition and a
recompute set that the search then prices on the real rows. It fits: the fields that differ
are times, never bytes. It is the envelope's optimum, not always the real rows' (which cost
each block at most what the envelope does): ``planner.search.ilp.solve_candidate`` reports it as
``Enveloped``, and the plan says how many candidates were solved so.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Callable, Sequence

from cost_models.layer_work import LayerCost
from cost_models.strategy import CandidateCosts
from planner.search.candidates import MAX_HEAD_ROWS, repeated_run_start

__all__ = ["EXPOSURE_FIELDS", "overlap_envelope", "exposure_free", "envelope_row"]

#: The fields the data-parallel overlap sets per row (``cost_models.strategy._exposed_layer``).
EXPOSURE_FIELDS = (
    "compute_s",
    "zero_mb_s",
    "zero_mb_hidden_s",
    "dp_step_s",
    "warmup_dp_step_s",
    "dp_step_hidden_s",
    "dp_contention_s",
    "warmup_dp_contention_s",
)


def overlap_envelope(costs: CandidateCosts, kinds: Sequence[str]) -> tuple[CandidateCosts, int] | None:
    """A copy of ``costs`` whose repeated blocks are their envelope, and the head's length (the
    distinct blocks before them, at most ``MAX_HEAD_ROWS``); ``None`` unless the table is
    ``pre``, a head, blocks that differ only in :data:`EXPOSURE_FIELDS` (the last block may
    differ in anything), ``post``, and the blocks do differ."""
    layers, n = costs.layers, costs.num_layers
    first = repeated_run_start(costs, kinds, exposure_free())
    if first is None:
        return None
    head, run = first - 1, layers[first : n - 2]
    if head > MAX_HEAD_ROWS or all(row is run[0] or row == run[0] for row in run):
        return None
    out = copy.copy(costs)
    out.layers = layers[:first] + [envelope_row(run)] * len(run) + layers[n - 2 :]
    out.distinct = list(Counter(out.layers).items())
    return out, head


def exposure_free() -> Callable[[LayerCost], LayerCost]:
    """A key telling rows apart but for :data:`EXPOSURE_FIELDS` (each row with them at 0),
    remembered per row object for the one table it is used on."""
    neutral: dict[int, LayerCost] = {}

    def without_exposure(row: LayerCost) -> LayerCost:
        if id(row) not in neutral:
            neutral[id(row)] = row.but(**{name: 0.0 for name in EXPOSURE_FIELDS})
        return neutral[id(row)]

    return without_exposure


def envelope_row(rows: Sequence[LayerCost]) -> LayerCost:
    """The first of ``rows`` with each of :data:`EXPOSURE_FIELDS` at its largest over them (the
    row itself when they are all equal)."""
    if all(row is rows[0] or row == rows[0] for row in rows):
        return rows[0]
    return rows[0].but(**{name: max(getattr(row, name) for row in rows) for name in EXPOSURE_FIELDS})
