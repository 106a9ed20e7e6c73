"""Blocks that repeat in a period: cut a pipeline between whole periods, by counting.

Many models of today alternate blocks of a few kinds: Llama-4 a dense and an expert block
(``interleave_moe_layer_step``), Jamba one attention block in eight and an expert MLP in every
other, models with local and global attention their pattern of windows. No two neighbouring
blocks cost the same, so neither the block-count solver (:mod:`planner.search.block_counts`,
which needs identical blocks after a short head) nor the envelope (:mod:`planner.search.envelope`)
applied, and the general ILP (one binary per layer and stage) ran into its 60 s limit on every
pipelined candidate: a Llama-4-Maverick-shaped model on 512 H100 did not finish in ten minutes.

A table ``pre``, at most :data:`~planner.search.candidates.MAX_HEAD_ROWS` distinct blocks, blocks
repeating every ``P <= MAX_PERIOD`` rows, ``post`` is grouped: each period becomes one row (its
fields summed; the backward transient and the ZeRO buffers at their largest, since one layer runs
at a time; its output the period's last), and the rows after the last whole period one row of
their own (the block solver's distinct last block). The block-count solver's optimum on the grouped
table is a partition and a recompute set that the search prices on the real rows.

What the grouping gives up. Stages are cut between whole periods, and a period is recomputed
whole or not at all (selectively: every attention core of it). A period recomputed whole is
priced as if its activations came back at once, though the runtime brings back one layer's at a
time, and its buffers as the largest of each kind: the grouped table asks for at least the
memory the real rows need, so what fits it fits them. It is the grouped table's optimum, not
always the real rows' (which may cut inside a period): ``planner.search.ilp.solve_candidate``
reports it as ``Periodic``, and the plan says how many candidates were solved so. On Llama-4's
48 blocks that is a cut every two blocks, as practitioners cut it (a whole number of
dense + expert pairs per stage); a pipeline deeper than the periods goes to the general ILP.
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, fields
from typing import Any, Callable, Sequence

from cost_models.layer_work import LayerCost
from cost_models.strategy import CandidateCosts
from planner.search.block_counts import Counts
from planner.search.candidates import MAX_HEAD_ROWS
from planner.search.envelope import envelope_row, exposure_free

__all__ = ["MAX_PERIOD", "Grouped", "periodic_groups", "group_rows"]

#: Longest period looked for (Jamba's is eight: an attention block in eight, experts in every other).
MAX_PERIOD = 8
#: A grouped row holds one layer's at a time of these (the largest of each over the period).
_LARGEST_FIELDS = frozenset({"bt_b", "trans_params_b", "trans_grads_b"})
#: The period's output is its last layer's.
_LAST_FIELDS = frozenset({"boundary_b"})
_FIELD_NAMES = tuple(field.name for field in fields(LayerCost))


@dataclass(frozen=True)
class Grouped:
    """A table grouped by periods: what the block-count solver solves and how its answer maps back."""

    costs: CandidateCosts
    """The grouped table: ``pre``, the head, one row per whole period, the rest, ``post``."""
    head: int
    """Distinct blocks between the embedding and the periods (the solver's head)."""
    period: int
    """Rows per period."""
    rows: tuple[range, ...]
    """The real rows of each grouped row."""
    real: tuple[LayerCost, ...]
    """The real table's rows."""

    def expand(self, found: Counts) -> tuple[list[tuple[int, int]], list[int], list[int]]:
        """The counted strategy on the real rows: stages as ``(first, last)``, the rows recomputed
        fully and selectively (a selective period recomputes the cores of the rows that have them)."""
        stages = [(self.rows[first][0], self.rows[last][-1]) for first, last in found.stages]
        full = sorted(row for group in found.recomputed for row in self.rows[group])
        selective = sorted(
            row for group in found.selective for row in self.rows[group] if self.real[row].sel_saved_b > 0
        )
        return stages, full, selective


def group_rows(rows: Sequence[LayerCost]) -> LayerCost:
    """One row standing for ``rows`` run one after another (module docstring)."""
    if len(rows) == 1:
        return rows[0]
    values: dict[str, Any] = {}
    for name in _FIELD_NAMES:
        column = [getattr(row, name) for row in rows]
        if name in _LARGEST_FIELDS:
            values[name] = max(column)
        elif name in _LAST_FIELDS:
            values[name] = column[-1]
        else:
            values[name] = sum(column)
    return rows[0].but(**values)


def periodic_groups(costs: CandidateCosts, kinds: Sequence[str]) -> Grouped | None:
    """The table grouped by its period (module docstring), or ``None`` unless it is ``pre``, a
    head of at most ``MAX_HEAD_ROWS`` blocks, at least two whole periods of ``2..MAX_PERIOD``
    blocks alike, any rest, ``post``. Blocks alike but for the traffic their place hides
    (:data:`~planner.search.envelope.EXPOSURE_FIELDS`) are grouped on their envelope: each such
    field at its largest over the rows of the same place in the period."""
    layers, n = costs.layers, costs.num_layers
    if n < 7 or kinds[0] != "pre" or kinds[-1] != "post" or list(kinds).count("block") != n - 2:
        return None
    for key in (lambda row: row, exposure_free()):
        found = _period(layers, key)
        if found is not None:
            return _grouped(costs, *found)
    return None


def _period(layers: list[LayerCost], key: Callable[[LayerCost], Any]) -> tuple[int, int, int] | None:
    """The shortest period, then head, that repeats (alike in ``key``) at least twice: ``(head,
    period, whole periods)``."""
    blocks = layers[1:-1]
    keyed = [key(row) for row in blocks]
    for period in range(2, MAX_PERIOD + 1):
        for head in range(0, MAX_HEAD_ROWS + 1):
            body = keyed[head:]
            whole = len(body) // period
            # the last period may differ (the solver's distinct last block) unless it is followed by a rest
            alike = whole - 1 if len(body) % period == 0 else whole
            if alike < 2 or len(set(body[:period])) == 1:
                continue
            first = body[:period]
            if all(body[start : start + period] == first for start in range(period, alike * period, period)):
                return head, period, alike
    return None


def _grouped(costs: CandidateCosts, head: int, period: int, alike: int) -> Grouped:
    layers, n = costs.layers, costs.num_layers
    start = 1 + head
    rows = [range(row, row + 1) for row in range(start)]
    rows += [range(start + i * period, start + (i + 1) * period) for i in range(alike)]
    rest = range(start + alike * period, n - 1)
    rows += [rest] if len(rest) else []
    rows.append(range(n - 1, n))
    # each place in the period at its envelope over the whole periods (equal rows: the row itself)
    places = [envelope_row([layers[start + i * period + place] for i in range(alike)]) for place in range(period)]
    block = group_rows(places)
    grouped_layers = [layers[row] for row in range(start)] + [block] * alike
    grouped_layers += [group_rows([layers[row] for row in rest])] if len(rest) else []
    grouped_layers.append(layers[-1])
    out = copy.copy(costs)
    out.layers = grouped_layers
    out.distinct = list(Counter(grouped_layers).items())
    return Grouped(out, head, period, tuple(rows), tuple(layers))
