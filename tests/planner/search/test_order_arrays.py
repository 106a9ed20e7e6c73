"""A schedule's compute order as arrays: its memory figures are the step-by-step walk's, bit for bit,
and an order kept on disk is the order built."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.search import program_cache
from planner.search.order_arrays import OrderArrays, has_kind, peak_open, weighted_held
from planner.search.schedule_search import compute_order, order_arrays
from runtime.contract.choices import ScheduleName
from runtime.contract.schedule_ir import B, F, W
from runtime.contract.schedule_ir import peak_open as walked_peak_open


def walked_held(sched, stages, virtual_stages, act_bytes, release, keep_bytes=None, free_bytes=None):
    """The reference: each rank's actions walked one by one, the running total in a Python float."""
    at_b, anywhere = [], []
    for rank, acts in enumerate(sched):
        per_mb = sum(act_bytes[chunk * stages + rank] for chunk in range(virtual_stages))
        live = peak = peak_b = 0.0
        for action in acts:
            chunk = action.chunk * stages + rank
            if action.kind == F:
                live += act_bytes[chunk]
            early = free_bytes[chunk] if free_bytes is not None and release != B else 0.0
            if action.kind == B:
                peak_b = max(peak_b, live)
                if keep_bytes is not None:
                    live += keep_bytes[chunk]
                peak = max(peak, live)
                live -= early
            if action.kind == W and keep_bytes is not None:
                live -= keep_bytes[chunk]
            if action.kind == release:
                live -= act_bytes[chunk] - early
            peak = max(peak, live)
        at_b.append(peak_b / per_mb if per_mb > 0 else math.inf)
        anywhere.append(peak / per_mb if per_mb > 0 else math.inf)
    return at_b, anywhere


def _layout(draw):
    name = draw(st.sampled_from(list(ScheduleName)))
    stages = draw(st.integers(1 if name == ScheduleName.ONE_F_ONE_B else 2, 6))
    virtual = draw(st.integers(2, 4)) if name == ScheduleName.INTERLEAVED else 1
    micro_batches = (
        stages * draw(st.integers(1, 4)) if name == ScheduleName.INTERLEAVED else draw(st.integers(stages, 3 * stages))
    )
    return name, stages, micro_batches, virtual


@st.composite
def orders_and_bytes(draw):
    name, stages, micro_batches, virtual = _layout(draw)
    chunks = stages * virtual
    sizes = st.floats(0.0, 1e9, allow_nan=False, allow_infinity=False)
    act = draw(st.lists(sizes, min_size=chunks, max_size=chunks))
    keep = draw(st.none() | st.lists(sizes, min_size=chunks, max_size=chunks))
    free = draw(st.none() | st.lists(st.floats(0.0, 1.0), min_size=chunks, max_size=chunks))
    free = None if free is None else [a * share for a, share in zip(act, free)]  # never more than a chunk holds
    return name, stages, micro_batches, virtual, act, keep, free


@settings(max_examples=150, deadline=None)
@given(orders_and_bytes())
def test_the_arrays_memory_figures_are_the_walks_exactly(case):
    name, stages, micro_batches, virtual, act, keep, free = case
    sched = compute_order(name, stages, micro_batches, virtual)
    order = OrderArrays.of(sched, virtual)
    order.check()
    for opens, closes in ((F, B), (F, W), (B, W)):
        assert peak_open(order, opens, closes) == walked_peak_open(sched, opens, closes)
    assert has_kind(order, W) == [any(action.kind == W for action in acts) for acts in sched]
    for release in (B, W) if name == ScheduleName.ZERO_BUBBLE else (B,):
        got = weighted_held(order, act, release, keep, free)
        want = walked_held(sched, stages, virtual, act, release, keep, free)
        assert got == want  # the same floats, not merely close


def _cached(builds: list) -> OrderArrays:
    def build() -> OrderArrays:
        builds.append(1)
        return OrderArrays.of(compute_order(ScheduleName.INTERLEAVED, 3, 6, 2), 2)

    return program_cache.cached_order("interleaved", 3, 6, 2, build)


def test_an_order_kept_on_disk_is_the_order_built_and_a_damaged_one_is_rebuilt(cache):
    builds: list = []
    built, read = _cached(builds), _cached(builds)
    assert len(builds) == 1 and dict(program_cache.stats) == {"miss": 1, "stored": 1, "hit": 1}
    for field in ("kinds", "model_chunks", "starts"):
        assert np.array_equal(getattr(read, field), getattr(built, field))
    (path,) = cache.iterdir()
    with np.load(path) as entry:
        arrays = {name: entry[name] for name in entry.files}
    arrays["model_chunks"] = arrays["model_chunks"] + 1  # every action on its neighbour's chunk
    np.savez(path, **arrays)
    rebuilt = _cached(builds)
    assert len(builds) == 2 and program_cache.stats["rejected"] == 1
    assert np.array_equal(rebuilt.model_chunks, built.model_chunks)
    assert np.array_equal(_cached(builds).model_chunks, built.model_chunks) and len(builds) == 2  # overwritten


def test_the_planner_reads_the_order_of_the_schedule_it_prices():
    order = order_arrays(ScheduleName.ZERO_BUBBLE, 4, 8, 1)
    sched = compute_order(ScheduleName.ZERO_BUBBLE, 4, 8, 1)
    assert order.kinds.tolist() == [("F", "B", "W").index(action.kind) for acts in sched for action in acts]
    assert order.starts.tolist() == np.cumsum([0] + [len(acts) for acts in sched]).tolist()
