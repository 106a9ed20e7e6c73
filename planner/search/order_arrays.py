"""A schedule's compute order as flat arrays, and what it says of memory, vectorized.

The schedule walk asks, for each strategy it prices under a pipeline schedule, how many
micro-batches of activations each rank holds at its peak (:func:`planner.search.schedule_search.pipeline_memory`).
The answer follows from the order of each rank's ``F``, ``B`` and ``W`` actions alone, not their
times; walked action by action in Python it cost most of a deep pipeline's re-plan (a
128-stage zero-bubble order of 256 micro-batches is 98,304 actions, and the walk reads it for
every strategy of its ``(p, m)``). Here the order is three integer arrays (:class:`OrderArrays`:
each action's kind and model chunk, and where each rank's actions start), built once from the
runtime's own order (``runtime.contract.schedule_ir.interleaved_compute``), kept on disk by
:mod:`planner.search.program_cache` beside the timing programs, and read with numpy:

- :func:`peak_open`: per rank, the most actions of one kind whose closing kind has not run (the
  activations in flight, the weight gradients pending): a cumulative sum of +1 and -1, exact;
- :func:`weighted_held`: per rank, the most bytes its in-flight (chunk, micro-batch) pairs hold
  when each chunk holds its own bytes. Each action is three additions to the rank's running
  total, in the order the step-by-step walk made them, accumulated left to right per rank
  (``numpy.cumsum`` adds in sequence), so the figures are the walk's to the last bit
  (``tests/planner/search/test_order_arrays.py`` checks them against it on random orders and bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from runtime.contract.schedule_ir import COMPUTE, B, F, Schedule, W

__all__ = ["OrderArrays", "has_kind", "peak_open", "weighted_held"]

#: An action kind's code in :attr:`OrderArrays.kinds`.
KIND_CODES = {kind: code for code, kind in enumerate(COMPUTE)}


@dataclass(frozen=True, eq=False)
class OrderArrays:
    """Each rank's compute actions, rank after rank, in the rank's order."""

    stages: int
    virtual_stages: int
    kinds: np.ndarray
    """Each action's kind (:data:`KIND_CODES`), int8."""
    model_chunks: np.ndarray
    """Each action's model chunk, ``chunk p + rank`` (what per-chunk byte lists are indexed by), int32."""
    starts: np.ndarray
    """Where each rank's actions start, and the end: ``p + 1`` offsets, int64."""

    @classmethod
    def of(cls, sched: Schedule, virtual_stages: int) -> "OrderArrays":
        """The arrays of a compute order (``F``, ``B``, ``W`` actions only)."""
        stages = len(sched)
        kinds = [KIND_CODES[action.kind] for acts in sched for action in acts]
        chunks = [action.chunk * stages + rank for rank, acts in enumerate(sched) for action in acts]
        starts = np.cumsum([0] + [len(acts) for acts in sched], dtype=np.int64)
        return cls(stages, virtual_stages, np.array(kinds, dtype=np.int8), np.array(chunks, dtype=np.int32), starts)

    def check(self) -> None:
        """Raise ValueError unless the arrays are an order of ``stages`` ranks of
        ``virtual_stages`` chunks each (what an entry read from disk must be)."""
        p, v, starts = self.stages, self.virtual_stages, self.starts
        n = len(self.kinds)
        if p < 1 or v < 1 or self.kinds.ndim != 1 or self.model_chunks.shape != (n,) or starts.shape != (p + 1,):
            raise ValueError("arrays of the wrong shapes")
        if any(array.dtype.kind != "i" for array in (self.kinds, self.model_chunks, starts)):
            raise ValueError("arrays that are not integers")
        if starts[0] != 0 or starts[-1] != n or (np.diff(starts) < 0).any():
            raise ValueError("rank offsets out of order")
        if ((self.kinds < 0) | (self.kinds >= len(COMPUTE))).any():
            raise ValueError("an unknown action kind")
        ranks = np.repeat(np.arange(p), np.diff(starts))
        if ((self.model_chunks < 0) | (self.model_chunks >= p * v)).any() or (self.model_chunks % p != ranks).any():
            raise ValueError("an action of another rank's chunk")

    def ranks(self) -> range:
        return range(self.stages)

    def segment(self, rank: int) -> slice:
        return slice(int(self.starts[rank]), int(self.starts[rank + 1]))


def peak_open(order: OrderArrays, opens: str, closes: str) -> list[int]:
    """Per rank, the most actions of kind ``opens`` whose ``closes`` has not run yet (chunk units;
    ``runtime.contract.schedule_ir.peak_open`` of the order)."""
    step = (order.kinds == KIND_CODES[opens]).astype(np.int64) - (order.kinds == KIND_CODES[closes])
    peaks = []
    for rank in order.ranks():
        counts = np.cumsum(step[order.segment(rank)])
        peaks.append(max(0, int(counts.max())) if len(counts) else 0)
    return peaks


def has_kind(order: OrderArrays, kind: str) -> list[bool]:
    """Per rank, whether any of its actions is of ``kind``."""
    found = order.kinds == KIND_CODES[kind]
    return [bool(found[order.segment(rank)].any()) for rank in order.ranks()]


def weighted_held(
    order: OrderArrays,
    act_bytes: Sequence[float],
    release: str,
    keep_bytes: Sequence[float] | None = None,
    free_bytes: Sequence[float] | None = None,
) -> tuple[list[float], list[float]]:
    """Per rank, the bytes its in-flight (chunk, micro-batch) pairs hold, in units of the rank's
    activations of one micro-batch: ``(most held when a backward starts, most held at any
    moment)`` (``inf`` for a rank whose chunks hold nothing).

    A chunk's ``F`` adds its activations (``act_bytes``, by model chunk) and its ``release``
    action frees them; with ``keep_bytes`` the end of a ``B`` adds the gradients kept for its
    ``W``, which frees them; with ``free_bytes`` the end of a ``B`` already frees that much of the
    activations (when ``release`` is ``W``), the rest goes at ``release``. A backward's transients
    come on top of the first figure; the second matters when kept gradients outlast them."""
    act = np.asarray(act_bytes, dtype=np.float64)[order.model_chunks]
    zero = np.zeros_like(act)
    keep = np.asarray(keep_bytes, dtype=np.float64)[order.model_chunks] if keep_bytes is not None else zero
    early = (
        np.asarray(free_bytes, dtype=np.float64)[order.model_chunks]
        if free_bytes is not None and release != B
        else zero
    )
    is_f, is_b, is_w = (order.kinds == KIND_CODES[kind] for kind in (F, B, W))
    released = order.kinds == KIND_CODES[release]
    # three additions per action, in the walk's order: F adds its bytes; B adds the kept
    # gradients (a peak is read there), frees the early part, then (if it releases) the rest;
    # W frees the kept gradients, then (if it releases) the rest of the activations
    first = np.where(is_f, act, np.where(is_b, keep, np.where(is_w, -keep, 0.0)))
    second = np.where(is_b, -early, np.where(is_w & released, -(act - early), 0.0))
    third = np.where(is_b & released, -(act - early), 0.0)
    steps = np.stack([first, second, third], axis=1).reshape(-1)
    at_b, anywhere = [], []
    for rank in order.ranks():
        part = order.segment(rank)
        per_mb = sum(float(act_bytes[chunk * order.stages + rank]) for chunk in range(order.virtual_stages))
        lives = np.cumsum(steps[3 * part.start : 3 * part.stop]).reshape(-1, 3)
        before = np.concatenate(([0.0], lives[:-1, 2]))  # the total as each action starts
        peak_b = max(0.0, float(before[is_b[part]].max(initial=0.0)))
        peak = max(0.0, float(lives[:, 2].max(initial=0.0)), float(lives[is_b[part], 0].max(initial=0.0)))
        at_b.append(peak_b / per_mb if per_mb > 0 else math.inf)
        anywhere.append(peak / per_mb if per_mb > 0 else math.inf)
    return at_b, anywhere
