"""The block-count problem solved exactly by counting: the uniform ILP without an ILP solver.

A uniform table (``pre``, identical blocks, maybe a distinct last block ``X``, ``post``: the
"Repeated blocks" form of :mod:`planner.search.ilp`) leaves two kinds of choice: how many blocks
each stage holds (``n_k``, summing to ``L``) and what each stage recomputes. The second is local:
a stage's memory row, micro-step and tail involve only its own counts. So:

1. **Stage tables** (:func:`_stage_table`). For each stage and each count ``n``, the recompute of
   least cost that fits the stage's memory row: every full-recompute count ``r``, the fewest
   selective blocks ``s`` that make the row hold, each choice for the rows the stage holds beside
   its blocks (the embedding, the head, ``X``). It gives three numbers per count, in the ILP's
   scaled units: ``F`` the micro-step, ``H`` the micro-step plus its tie-break terms, ``G`` the
   per-step tail.
2. **Partition** (:func:`_partition`). The ILP's objective over counts is
   ``(m - 1) max_k F_k(n_k) + sum_k H_k(n_k) + max_k G_k(n_k)``. Caps on ``max F`` are tried in
   increasing order, and under each cap, caps on ``max G``; under both, the least ``sum H`` is a
   min-plus dynamic program over the stages (:func:`_least_sum`). The least ``sum H + max G``
   with no cap on ``F`` bounds every later cap's, so the walk stops as soon as
   ``(m - 1) cap + bound`` cannot beat the best found (likewise for ``G``).
3. **Structure.** The ILP's binaries that are not counts (stage 0 holds blocks or only the
   embedding, ``z0``; ``X`` in the last stage or ending stage ``p - 2``, ``q``) change which rows
   and which boundary sends each stage has: each of their (at most four) settings is solved and
   the best kept. A table whose first blocks differ (a *head*: DeepSeek-V3's three dense blocks
   before its 58 mixtures of experts) adds the head's cuts over the first stages
   (:class:`_Layout`: ``2^head`` of them, the head at most four blocks); a stage then holds its
   piece of the head beside its blocks, as stage 0 holds the embedding, and the optimum is the
   general ILP's (the tests compare them on random tables).

The rows are the ILP's rows (memory with its margin, the ZeRO buffer and recompute peaks, the
offload capacities, the cutoff), so the optimum is the ILP's. Two approximations, both within the
tie-break terms (about 1e-7 of the step): each stage's recompute is the one of least ``H`` for its
count (not least ``F``), and the cutoff is checked on the optimum (the ILP minimizes under it). The tests check
the optimum against the ILP and against brute force (``tests/planner/search/test_block_counts.py``).

Why: the ILP of a 96-block model on 1,024 GPUs took 30-40 ms through CBC (model building, an MPS
file, a solver process); the search and the schedule walk solve tens of them per plan.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from cost_models.layer_work import LayerCost
from cost_models.strategy import CandidateCosts
from planner.search.candidates import total_work
from planner.search.objective import (
    CUTOFF_SLACK,
    MEMORY_MARGIN,
    TIE_BREAK,
    block_capacity,
    count_weight,
    objective_scale,
)

__all__ = ["Counts", "solve_counts"]

INF = math.inf


@dataclass(frozen=True)
class Counts:
    """An optimal strategy of the block-count problem, as the ILP's ``decode`` gives it."""

    stages: list[tuple[int, int]]
    recomputed: set[int]
    selective: set[int]
    objective: float
    """The ILP's objective (scaled step time plus tie-breaks) at this strategy."""
    step: float
    """The scaled step time without tie-breaks (what the ILP's cutoff row bounds)."""


@dataclass(frozen=True)
class _RowChoice:
    """What one combination of the non-block rows' recompute adds to a stage."""

    seconds: float
    """Recompute seconds (full or selective) of the rows."""
    count: float
    """Recomputed rows (a selective one counts half)."""
    freed: float
    """Activation bytes the recompute frees per micro-batch in flight."""
    peak: float
    """The largest activation a recomputed row re-materializes at once."""
    recompute: tuple[str, ...]
    """``"pre"``, ``"post"``, ``"X"`` (or head row ``i``'s ``"H{i}"``) recomputed fully, ``"X-sel"``
    (``"H{i}-sel"``) selectively."""


@dataclass
class _Table:
    """One stage's best recompute per block count ``n = 0..len - 1``: scaled micro-step ``F``,
    objective share ``H`` (``F`` + tie-breaks), scaled tail ``G``; ``inf`` in each where the count
    does not fit."""

    F: np.ndarray
    H: np.ndarray
    G: np.ndarray
    full: np.ndarray
    """Blocks recomputed fully per count."""
    sel: np.ndarray
    """Blocks recomputed selectively per count."""
    rows: list[_RowChoice]
    choice: np.ndarray
    """Index into ``rows`` per count."""


@dataclass(frozen=True)
class _Layout:
    """The structure's binaries: how the head (the embedding and the distinct blocks after it) is
    cut over the first stages (``pieces``: the rows of each, stages ``0..t``; one piece without a
    head), whether stage ``t`` also holds blocks (``z0``), and whether ``X`` sits in the last stage
    (``q``) or ends stage ``p - 2``."""

    pieces: tuple[int, ...]
    z0: bool
    q: bool

    @property
    def t(self) -> int:
        """The stage holding the head's last piece."""
        return len(self.pieces) - 1


class _Problem:
    """One candidate's block-count problem: the distinct rows and the constants the ILP reads.

    ``head``: the distinct blocks between the embedding and the identical ones (rows ``1..head``;
    DeepSeek-V3's dense blocks before its mixtures of experts)."""

    def __init__(self, costs: CandidateCosts, mode: str, most: int, head: int = 0):
        self.costs, self.mode, self.head = costs, mode, head
        self.p, self.m = costs.cand.pp, costs.cand.num_micro_batches
        layers = costs.layers
        self.rows = costs.num_layers
        self.pre, self.blk, self.post, self.X = layers[0], layers[1 + head], layers[-1], layers[-2]
        self.tail = self.X != self.blk
        self.L = self.rows - 2 - self.tail - head
        self.scale = objective_scale(costs)
        self.per_count = count_weight(costs)
        # counts above ``most`` are left out (:func:`solve_counts` proves they cannot win)
        self.ub = [min(fits, self.L, most) for fits in block_capacity(costs, self.blk)]
        selects = mode in ("auto", "selective")
        self.sel_blk = selects and self.blk.sel_saved_b > 0
        self.selects = selects
        self.limit = costs.capacity * (1 - MEMORY_MARGIN)
        self.tables: dict[tuple, _Table] = {}
        self.rows_made: dict[tuple, tuple] = {}
        """:func:`_stage_row`'s rows, by what decides them."""

    # ------------------------------------------------------------------ structure
    def layouts(self) -> list[_Layout]:
        """Every structure: the head's cuts over stages ``0..t`` (``t < p``), then ``(z0, q)``."""
        qs = (False, True) if self.tail else (True,)
        if self.p == 1:
            return [_Layout((1 + self.head,), True, True)]
        out = []
        for t in range(min(self.head, self.p - 1) + 1):
            for cuts in itertools.combinations(range(1, 1 + self.head), t):
                ends = (0,) + cuts + (1 + self.head,)
                pieces = tuple(b - a for a, b in zip(ends, ends[1:]))
                out += [_Layout(pieces, z0, q) for z0 in (False, True) for q in qs if q or t < self.p - 1]
        return out

    def head_rows(self, k: int, lay: _Layout) -> range:
        """The head rows stage ``k`` holds."""
        if k > lay.t:
            return range(0)
        start = sum(lay.pieces[:k])
        return range(start, start + lay.pieces[k])

    def holds_x(self, k: int, q: bool) -> bool:
        return self.tail and ((k == self.p - 1 and q) or (k == self.p - 2 and not q))

    def boundary(self, j: int, lay: _Layout) -> float:
        """Seconds of the send over boundary ``j`` (the ILP's ``_boundary`` at these binaries)."""
        # the row whose output crosses it: a block's, the head's last row in stage j, or X
        if j < lay.t or (j == lay.t and not lay.z0 and not (self.tail and j == self.p - 2 and not lay.q)):
            row = self.head_rows(j, lay)[-1]
        elif self.tail and j == self.p - 2 and not lay.q:
            row = self.rows - 2
        else:
            row = 1 + self.head
        return self.costs.send_s(row, j)

    def p2p(self, k: int, lay: _Layout) -> float:
        total = self.boundary(k, lay) if k < self.p - 1 else 0.0
        return total + (self.boundary(k - 1, lay) if k > 0 else 0.0)

    def domain(self, k: int, lay: _Layout) -> tuple[int, int]:
        """Counts stage ``k`` may hold under the structure (before memory)."""
        top = self.ub[k]
        if self.p == 1:  # every block (the stage table stops at ``ub``: beyond it nothing fits)
            return self.L, self.L
        if k < lay.t:
            return 0, 0
        if k == lay.t:
            return (1, top) if lay.z0 else (0, 0)
        if k == self.p - 1:
            return (0, top) if lay.q else (0, 0)
        return (0 if self.holds_x(k, lay.q) else 1), top

    def others(self, k: int, lay: _Layout) -> list[LayerCost]:
        """The rows stage ``k`` holds beside its blocks."""
        held = [self.costs.layers[row] for row in self.head_rows(k, lay)]
        if self.holds_x(k, lay.q):
            held.append(self.X)
        return held + ([self.post] if k == self.p - 1 else [])

    # ------------------------------------------------------------------ stage tables
    def _block_options(self, name: str, row: LayerCost) -> list[tuple[str, LayerCost, bool]]:
        """A distinct block's recompute options (``X`` or a head row) under the mode."""
        can_select = self.selects and row.sel_saved_b > 0
        return {
            "auto": [("", row, False), (name, row, False)] + ([(f"{name}-sel", row, True)] if can_select else []),
            "all": [(name, row, False)],
            "selective": [(f"{name}-sel", row, True)] if can_select else [("", row, False)],
            "none": [("", row, False)],
        }[self.mode]

    def row_choices(self, k: int, lay: _Layout) -> list[_RowChoice]:
        """Each combination of recompute for the non-block rows of stage ``k``."""
        auto = self.mode == "auto"
        per_row: list[list[tuple[str, LayerCost, bool]]] = []
        for row in self.head_rows(k, lay):
            if row == 0:
                per_row.append([("", self.pre, False)] + ([("pre", self.pre, False)] if auto else []))
            else:
                per_row.append(self._block_options(f"H{row}", self.costs.layers[row]))
        if k == self.p - 1:
            per_row.append([("", self.post, False)] + ([("post", self.post, False)] if auto else []))
        if self.holds_x(k, lay.q):
            per_row.append(self._block_options("X", self.X))
        out = []
        for combo in itertools.product(*per_row):
            chosen = [(name, row, selective) for name, row, selective in combo if name]
            out.append(
                _RowChoice(
                    seconds=sum(row.sel_rec_s if sel else row.rec_s for _, row, sel in chosen),
                    count=sum(0.5 if sel else 1.0 for _, _, sel in chosen),
                    freed=sum(row.sel_saved_b if sel else row.saved_b - row.input_b for _, row, sel in chosen),
                    peak=max([row.sel_saved_b if sel else row.saved_b for _, row, sel in chosen], default=0.0),
                    recompute=tuple(name for name, _, _ in chosen),
                )
            )
        return out

    def stage_table(self, k: int, lay: _Layout) -> _Table:
        """Stage ``k``'s best recompute per count (boundary sends not included). The middle
        stages without head rows or ``X`` are tabulated together on first asking."""
        heads, holds_x = tuple(self.head_rows(k, lay)), self.holds_x(k, lay.q)
        if (k, heads, holds_x) not in self.tables:
            if 0 < k < self.p - 1 and not heads and not holds_x:  # every plain middle stage not tabulated yet
                ks = [j for j in range(1, self.p - 1) if (j, (), False) not in self.tables]
            else:
                ks = [k]
            # the uniform ILP counts a middle stage's block buffers whether or not it holds a block
            # (its ``has``); with a head the reference is the general ILP, which counts what is held
            has_always = self.p == 1 or (not self.head and 0 < k < self.p - 1)
            tables = _stage_tables(self, ks, self.others(k, lay), self.row_choices(k, lay), has_always)
            self.tables.update({(j, heads, holds_x): table for j, table in zip(ks, tables)})
        return self.tables[(k, heads, holds_x)]


def _stage_tables(
    problem: _Problem, ks: Sequence[int], others: list[LayerCost], rows: list[_RowChoice], has_always: bool
) -> list[_Table]:
    """The tables of :meth:`_Problem.stage_table` for stages ``ks`` that hold the same rows
    beside their blocks (``others``, recomputed as ``rows`` choose; they differ in their in-flight
    micro-batches and block capacity): every stage ``k``, row choice ``c``, full-recompute count
    ``r`` and count ``n`` at once (numpy axes 0 to 3), the fewest selective blocks for each, the
    best per stage and ``n``."""
    blk, mode, scale = problem.blk, problem.mode, problem.scale
    tops = np.array([max(problem.ub[k], 0) for k in ks])
    counts = np.arange(int(tops.max()) + 1, dtype=float)
    grid = _Grid(problem, counts, rows, has_always=has_always)
    a = np.array([problem.costs.inflight[k] for k in ks], dtype=float)[:, None, None, None]
    memory = (
        sum(row.state_b for row in others)
        + a * sum(row.saved_b for row in others)
        + grid.n * (blk.state_b + a * blk.saved_b)
        + np.maximum(max([row.trans_b for row in others], default=0.0), grid.has * blk.trans_b)
        - grid.r * a * (blk.saved_b - blk.input_b)
        - a * grid.column("freed")
    )
    base_s = sum(row.work_s + row.zero_mb_s for row in others)
    bt0 = max([row.bt_b for row in others], default=0.0)
    within = grid.n <= tops[:, None, None, None]
    best_h, best_f = (np.full((len(ks), len(counts)), INF) for _ in range(2))
    picked = (np.zeros(best_h.shape), np.zeros(best_h.shape), np.zeros(best_h.shape, dtype=int))
    # whether the blocks' attention cores are recomputed (``u_k``): pinned under ``selective``
    for selective in (False,) if not problem.sel_blk else (True,) if mode == "selective" else (False, True):
        peak = functools.reduce(
            np.maximum,
            [
                np.maximum(grid.column("peak"), bt0),
                grid.has * blk.bt_b,
                grid.recomputes * (blk.saved_b if mode in ("auto", "all") else 0.0),
                (grid.has if mode == "selective" else 1.0) * blk.sel_saved_b * selective,
            ],
        )
        sel, fits = grid.selective(memory + peak - problem.limit, selective, a * blk.sel_saved_b)
        extra = grid.column("seconds") + grid.r * blk.rec_s + sel * blk.sel_rec_s
        micro = scale * (base_s + grid.n * (blk.work_s + blk.zero_mb_s) + extra)
        share = micro + TIE_BREAK * scale * extra + problem.per_count * (grid.column("count") + grid.r + 0.5 * sel)
        shape = np.broadcast_shapes(share.shape, fits.shape, within.shape, micro.shape, sel.shape, grid.r.shape)
        flat = (shape[0], shape[1] * shape[2], shape[3])
        share = np.broadcast_to(np.where(fits & within, share, INF), shape).reshape(flat)
        at = np.argmin(share, axis=1)[:, None, :]
        h = np.take_along_axis(share, at, axis=1)[:, 0, :]

        def pick(values: np.ndarray) -> np.ndarray:
            return np.take_along_axis(np.broadcast_to(values, shape).reshape(flat), at, axis=1)[:, 0, :]

        better = h < best_h
        best_h, best_f = np.where(better, h, best_h), np.where(better, pick(micro), best_f)
        picked = (
            np.where(better, pick(grid.r), picked[0]),
            np.where(better, pick(sel), picked[1]),
            np.where(better, at[:, 0, :] // shape[2], picked[2]),
        )
    tail = scale * (sum(row.dp_step_s + row.opt_s for row in others) + counts * (blk.dp_step_s + blk.opt_s))
    return [
        _Table(
            best_f[i],
            best_h[i],
            np.where(np.isfinite(best_h[i]), tail, INF),
            picked[0][i],
            picked[1][i],
            rows,
            picked[2][i],
        )
        for i in range(len(ks))
    ]


class _Grid:
    """The axes of :func:`_stage_tables` beside the stage's: row choice (1), full-recompute count
    ``r`` (2, only under ``auto``; pinned: ``r = n`` or 0) and count ``n`` (3), as broadcastable
    arrays."""

    def __init__(self, problem: _Problem, counts: np.ndarray, rows: list[_RowChoice], has_always: bool):
        self.mode, self.rows = problem.mode, rows
        self.n = counts[None, None, None, :]
        # middle stages count the blocks' buffers whether or not they hold one (the ILP's ``has``)
        self.has = np.ones_like(self.n) if has_always else (self.n > 0).astype(float)
        if self.mode == "auto":
            self.r = counts[None, None, :, None]
            self.recomputes = (self.r > 0).astype(float)
        elif self.mode == "all":
            self.r, self.recomputes = self.n, self.has
        else:
            self.r = self.recomputes = np.zeros((1, 1, 1, 1))

    def column(self, name: str) -> np.ndarray:
        """One number of each row choice, along axis 1."""
        return np.array([getattr(row, name) for row in self.rows], dtype=float)[None, :, None, None]

    def selective(self, need: np.ndarray, selective: bool, frees: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Selectively recomputed blocks and whether the stage fits: none (``need <= 0`` must
        hold), all of them (pinned), or the fewest (at least one) that cover ``need``."""
        if not selective:
            return np.zeros((1, 1, 1, 1)), (need <= 0) & (self.r <= self.n)
        if self.mode == "selective":
            return self.n, need - self.n * frees <= 0
        sel = np.maximum(1.0, np.ceil(need / frees))
        return sel, sel <= self.n - self.r


# ---------------------------------------------------------------------------------- partition
# Stage tables stacked: one row per stage, one column per count (``inf``: not allowed).


def _bracket(allowed: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Each stage's smallest and largest allowed count; ``None`` if a stage allows none."""
    if not allowed.any(axis=1).all():
        return None
    width = allowed.shape[1]
    return np.argmax(allowed, axis=1), width - 1 - np.argmax(allowed[:, ::-1], axis=1)


def _may_sum(allowed: np.ndarray, total: int) -> bool:
    """A quick necessary condition for :func:`_least_sum`: the smallest and largest allowed
    counts bracket ``total``."""
    ends = _bracket(allowed)
    return ends is not None and int(ends[0].sum()) <= total <= int(ends[1].sum())


def _least_sum(values: np.ndarray, allowed: np.ndarray, total: int) -> tuple[float, list[int]] | None:
    """Least ``sum_k values[k, n_k]`` over ``n_k`` with ``allowed[k, n_k]`` and ``sum n_k =
    total`` (a min-plus dynamic program over the stages), and the counts; ``None`` if none."""
    ends = _bracket(allowed)
    if ends is None:
        return None
    low, high = ends
    if int(low.sum()) > total or int(high.sum()) < total:
        return None
    affine = _affine_sum(values, allowed, low, high, total)
    if affine is not None:
        return affine
    # a stage holds at least what the others cannot
    floor = total - (int(high.sum()) - high)
    counts_all = np.arange(allowed.shape[1])
    reach = np.full(total + 1, INF)
    reach[0] = 0.0
    picks = []
    sums = np.arange(total + 1)
    for k in range(allowed.shape[0]):
        counts = np.flatnonzero(allowed[k] & (counts_all >= floor[k]) & (counts_all <= total))
        if counts.size == 0:
            return None
        before = sums[:, None] - counts[None, :]
        trial = np.where(before >= 0, reach[np.maximum(before, 0)], INF) + values[k, counts][None, :]
        at = np.argmin(trial, axis=1)
        reach = trial[sums, at]
        picks.append(counts[at])
    if not math.isfinite(reach[total]):
        return None
    chosen, left = [], total
    for pick in reversed(picks):
        chosen.append(int(pick[left]))
        left -= chosen[-1]
    return float(reach[total]), chosen[::-1]


def _affine_sum(
    values: np.ndarray, allowed: np.ndarray, low: np.ndarray, high: np.ndarray, total: int
) -> tuple[float, list[int]] | None:
    """:func:`_least_sum` without the program when every stage allows an interval of counts and
    its values rise by one common step per block (pinned recompute, or none needed): every
    distribution then sums the same, and the counts are spread evenly. ``None`` otherwise."""
    if (allowed.sum(axis=1) != high - low + 1).any():
        return None
    inside = allowed[:, :-1] & allowed[:, 1:]
    steps = (values[:, 1:] - np.where(inside, values[:, :-1], 0.0))[inside]
    if steps.size and np.ptp(steps) > 1e-12 * max(float(np.abs(steps).max()), 1e-300):
        return None
    counts, room, extra = low.copy(), high - low, total - int(low.sum())
    while extra > 0:
        share = max(1, extra // int((room > 0).sum()))
        for k in np.flatnonzero(room > 0):
            give = min(int(room[k]), share, extra)
            counts[k] += give
            room[k] -= give
            extra -= give
            if extra == 0:
                break
    chosen = [int(count) for count in counts]
    return float(values[np.arange(len(chosen)), chosen].sum()), chosen


def _at(table: np.ndarray, counts: list[int]) -> float:
    """The largest entry of ``table`` at these counts (one per stage)."""
    return float(table[np.arange(len(counts)), counts].max())


def _caps(table: np.ndarray, allowed: np.ndarray, total: int) -> np.ndarray:
    """The values a cap on ``table``'s maximum can take, in increasing order, from the first
    under which the allowed counts can still sum to ``total`` (bisection: a higher cap only
    allows more)."""
    caps = np.unique(table[allowed])
    low, high = 0, len(caps)
    while low < high:
        middle = (low + high) // 2
        if _may_sum(allowed & (table <= caps[middle]), total):
            high = middle
        else:
            low = middle + 1
    return caps[low:]


def _inner(
    H: np.ndarray, G: np.ndarray, allowed: np.ndarray, total: int, bound: float
) -> tuple[float, list[int]] | None:
    """Least ``sum H + max G`` over the allowed counts, if under ``bound``: the value and the counts."""
    free = _least_sum(H, allowed, total)
    if free is None:
        return None
    least_h, counts = free
    best: tuple[float, list[int]] | None = None
    if least_h + _at(G, counts) < bound:
        best = (least_h + _at(G, counts), counts)
    for cap in _caps(G, allowed, total):
        beat = bound if best is None else best[0]
        if cap + least_h >= beat:  # every later cap's strategies cost at least this
            break
        found = _least_sum(H, allowed & (G <= cap), total)
        if found is not None and found[0] + _at(G, found[1]) < beat:
            best = (found[0] + _at(G, found[1]), found[1])
    return best


def _partition(
    F: np.ndarray, H: np.ndarray, G: np.ndarray, total: int, weight: float, bound: float
) -> tuple[float, list[int]] | None:
    """Least ``weight max F + sum H + max G`` over counts summing to ``total`` (``inf`` entries
    not allowed), if under ``bound``: the value and the counts."""
    allowed = np.isfinite(H)
    if not _may_sum(allowed, total):
        return None
    free = _inner(H, G, allowed, total, INF)
    if free is None:
        return None

    def value(found: tuple[float, list[int]]) -> float:
        return weight * _at(F, found[1]) + found[0]

    best = (value(free), free[1]) if value(free) < bound else None
    if weight > 0:
        for cap in _caps(F, allowed, total):
            beat = bound if best is None else best[0]
            if weight * cap + free[0] >= beat:  # the inner part cannot drop below free's
                break
            found = _inner(H, G, allowed & (F <= cap), total, beat - weight * cap)
            if found is not None and value(found) < beat:
                best = (value(found), found[1])
    return best


# ---------------------------------------------------------------------------------- solve
def _layout_arrays(problem: _Problem, lay: _Layout) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[_Table]] | None:
    """Per stage ``F``, ``H``, ``G`` under structure ``lay``: the stage tables with the stages'
    sends added, and counts outside the structure's domain or the offload capacities removed
    (``inf``). Stacked from rows remembered per stage and what decides them (most stages' rows
    are the same under every cut of a head)."""
    domains = [problem.domain(k, lay) for k in range(problem.p)]
    if any(high < low for low, high in domains):
        return None
    rows = [_stage_row(problem, k, lay, domains[k]) for k in range(problem.p)]
    F = np.stack([row[0] for row in rows])
    H = np.stack([row[1] for row in rows])
    G = np.stack([row[2] for row in rows])
    return F, H, G, [row[3] for row in rows]


def _stage_row(
    problem: _Problem, k: int, lay: _Layout, domain: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, _Table]:
    """Stage ``k``'s row of :func:`_layout_arrays`, remembered by what decides it: its rows beside
    the blocks, its count domain and its sends."""
    heads, holds_x = tuple(problem.head_rows(k, lay)), problem.holds_x(k, lay.q)
    sends = problem.scale * problem.p2p(k, lay)
    key = (k, heads, holds_x, domain, sends)
    known = problem.rows_made.get(key)
    if known is not None:
        return known
    table = problem.stage_table(k, lay)
    F, H, G = (np.full(problem.L + 1, INF) for _ in range(3))
    F[: len(table.F)], H[: len(table.H)], G[: len(table.G)] = table.F, table.H, table.G
    counts = np.arange(problem.L + 1)
    ok = (counts >= domain[0]) & (counts <= domain[1]) & np.isfinite(H)
    costs = problem.costs
    for room, field in ((costs.host_room, "host_b"), (costs.nvme_room, "nvme_b")):
        if not math.isfinite(room) or sum(count * getattr(cost, field) for cost, count in costs.distinct) <= 0:
            continue
        held = sum(getattr(row, field) for row in problem.others(k, lay))
        ok &= held + counts * getattr(problem.blk, field) <= room * (1 - MEMORY_MARGIN)
    made = (
        np.where(ok, F + sends, INF),
        np.where(ok, H + sends * (1 + TIE_BREAK), INF),
        np.where(ok, G, INF),
        table,
    )
    problem.rows_made[key] = made
    return made


def _lower_bound(F: np.ndarray, H: np.ndarray, G: np.ndarray, total: int, weight: float) -> float:
    """A value no strategy of these tables beats: the least feasible cap on ``F``, each stage's
    least ``H`` and the largest least ``G``."""
    allowed = np.isfinite(H)
    caps = _caps(F, allowed, total)
    if not allowed.any(axis=1).all() or caps.size == 0:
        return INF
    return weight * float(caps[0]) + float(np.min(H, axis=1).sum()) + float(np.min(G, axis=1).max())


def _decode(
    problem: _Problem, lay: _Layout, counts: list[int], tables: list[_Table], objective: float, step: float
) -> Counts:
    """The ILP's ``decode`` of these counts and each stage's recompute."""
    stages: list[tuple[int, int]] = []
    recomputed: set[int] = set()
    selective: set[int] = set()
    start = 0
    for k, (n, table) in enumerate(zip(counts, tables)):
        heads = len(problem.head_rows(k, lay))
        last = start + heads + n + (k == problem.p - 1) + problem.holds_x(k, lay.q) - 1
        first_block = start + heads
        full, sel = int(table.full[n]), int(table.sel[n])
        stages.append((start, last))
        recomputed.update(range(first_block, first_block + full))
        selective.update(range(first_block + full, first_block + full + sel))
        for name in table.rows[int(table.choice[n])].recompute:
            row, _, how = name.partition("-")
            index = {"pre": 0, "post": problem.rows - 1, "X": problem.rows - 2}.get(row)
            (selective if how else recomputed).add(index if index is not None else int(row[1:]))
        start = last + 1
    return Counts(stages, recomputed, selective, objective, step)


def solve_counts(costs: CandidateCosts, checkpoint: str, cutoff: float | None = None, head: int = 0) -> Counts | None:
    """The optimal partition and recompute of a uniform table (``planner.search.candidates.
    is_repeated``) under recompute mode ``checkpoint``: the ILP's optimum (module docstring).
    ``None`` when nothing fits the memory (and the offload capacities), or the optimum's step
    (without tie-breaks) is above ``cutoff`` seconds (with ``CUTOFF_SLACK``).

    The tables first stop at twice the even share of blocks (plus two): a stage with more has a
    micro-step of at least ``n`` blocks' work, and when ``(m - 1)`` times that plus the least
    total work is above the best found, no stage can hold more. Otherwise the bound doubles.

    ``head``: the distinct blocks after the embedding (``planner.search.candidates.head_rows``),
    cut over the first stages in every way (:meth:`_Problem.layouts`)."""
    blocks = costs.num_layers - 2 - head - (costs.layers[-2] != costs.layers[1 + head])
    most = 2 * math.ceil(blocks / costs.cand.pp) + 2 if costs.cand.num_micro_batches > 1 else blocks
    while True:
        problem = _Problem(costs, checkpoint, most, head)
        if min(problem.ub) < 0:
            return None
        limit = INF if cutoff is None else problem.scale * cutoff * (1 + CUTOFF_SLACK)
        # the tie-breaks are far below 1% of the step: a bound that keeps every strategy under the cutoff
        bound = limit * 1.01 + 1.0
        best = _solve_layouts(problem, bound)
        if most >= blocks or (best[0] if best else bound) <= _count_bound(problem, most + 1):
            break
        most = min(2 * most, blocks)
    if best is None:
        return None
    if best[1].step > limit:
        return None
    return best[1]


def _count_bound(problem: _Problem, count: int) -> float:
    """A value every strategy with a stage of ``count`` or more blocks reaches: ``(m - 1)`` times
    that stage's work plus every layer's work once (:func:`planner.search.candidates.total_work`)."""
    blk = problem.blk
    stage = count * (blk.work_s + blk.zero_mb_s)
    return problem.scale * ((problem.m - 1) * stage + total_work(problem.costs))


def _solve_layouts(problem: _Problem, bound: float) -> tuple[float, Counts] | None:
    """The best of :func:`_partition` over the structures (:meth:`_Problem.layouts`), in the
    order of their lower bounds, if under ``bound``: its value and strategy."""
    best: tuple[float, Counts] | None = None
    weight = problem.m - 1
    layouts = []
    for order, lay in enumerate(problem.layouts()):
        arrays = _layout_arrays(problem, lay)
        if arrays is not None:
            layouts.append((_lower_bound(*arrays[:3], problem.L, weight), order, lay, arrays))
    for lower, _order, lay, (F, H, G, tables) in sorted(layouts, key=lambda layout: layout[:2]):
        if lower >= (bound if best is None else min(bound, best[0])):
            break
        found = _partition(F, H, G, problem.L, weight, bound if best is None else min(bound, best[0]))
        if found is not None and (best is None or found[0] < best[0]):
            counts = found[1]
            step = weight * _at(F, counts) + float(F[np.arange(problem.p), counts].sum()) + _at(G, counts)
            best = (found[0], _decode(problem, lay, counts, tables, found[0], step))
    return best
