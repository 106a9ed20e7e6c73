"""The price of a strategy under a pipeline schedule other than 1F1B.

:func:`cost_models.strategy.evaluate` prices 1F1B in closed form (the ILP optimizes that form).
Interleaved 1F1B and zero bubble (ZB-H1, Qi et al. 2023) are priced here from the *same*
per-layer costs (``LayerCost``), so that the schedules compare like for like.

Model chunks. The interleaved schedule cuts the layer table into ``p v`` contiguous chunks, chunk
``c`` on pipeline rank ``c % p`` (``runtime.contract.schedule_ir``; plan.json's ``stages`` lists
them in model order). :func:`split_chunks` minimizes the slowest chunk's micro-step (min-max
contiguous partition, bisection on the threshold). Zero bubble keeps the 1F1B partition; the
recomputed layers are the 1F1B solution's.

Times (:func:`chunk_times`), per chunk and micro-batch: ``F`` = forward compute, forward TP
all-reduces and a third of ZeRO-3's gathers; the backward is the rest of the chunk's micro-step,
exactly 1F1B's split. Each chunk boundary costs one send each way per micro-batch, ``send_s``
(the slowest boundary's alpha-beta time plus its wait).

The W split. Zero bubble splits each backward into ``B`` (input gradients) and ``W`` (weight
gradients, run when the schedule says). ``W`` of a layer is ``LayerCost.wgrad_s``
(``cost_models.wgrad``: the products that contract over the micro-batch's tokens, ``dW = X^T dY``,
plus the gradient accumulation, with their share of the host overhead; without listed products
half of the backward's matmul FLOPs). A recomputed layer's forward runs in ``B`` and again in
``W`` (the runtime's ``W`` re-enters the checkpoint).

Time from the simulated schedule. The caller (``planner.search.schedule_search``) runs the
runtime's own action lists through its simulator with these times and hands back a
:class:`SimulatedPipeline`; :func:`evaluate_schedule` turns it into an ``Evaluation``::

    step            = makespan + D         (D: the exposed DP/ZeRO tail + optimizer, as 1F1B)
    pp_bubble       = makespan - m (compute + recompute + tp + ZeRO per micro-batch) of the busiest rank
    bubble_fraction = (makespan - m T) / makespan    (T: the busiest rank's micro-step)

so the parts still sum to the step. With equal chunks and free sends the idle time per unit of
compute is ``(p - 1) / m`` (1F1B), ``(p - 1) / (v m)`` (interleaved), ``(p - 1) / (3 m)`` (ZB-H1,
``F = B = W``); the tests hold the simulation to these.

Memory. Activations held per rank, in units of the rank's activations of one micro-batch (its
``v`` chunks together), replace 1F1B's ``min(p - k, m)`` in ``cost_models.memory``:

- interleaved: the simulated peak of chunk activations (``F`` done, ``B`` not) over ``v``; closed
  form (:func:`interleaved_inflight`) ``(2 (p - r - 1) + (v - 1) p + 1) / v`` on rank ``r``;
- zero bubble: a chunk's autograd graph lives from ``B`` until its ``W``, so a rank holds one
  micro-batch of activations per ``F`` whose ``W`` has not run (``min(p, m)`` on every rank).
  ``B`` also keeps the gradient at each node that reads a weight (``LayerCost.wgrad_keep_b``;
  none in the first chunk, which has no ``B``) and frees what only the chunk's outputs hold
  (``LayerCost.tail_b``, the loss's log-probabilities for the head; ``passes.split_backward``).
  With the chunks' sizes known (``ChunkTimes.act_bytes``, ``keep_bytes``, ``free_bytes``) both
  are followed through the rank's action order, so kept gradients count only while their ``W``
  is pending (``SimulatedPipeline.w_pending`` is then 0).

Parameters, gradients and optimizer state are those of the rank's layers (all its chunks); the
ZeRO transients those of its largest layer. Bytes sent grow with the sends.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

from cost_models.strategy import (
    CandidateCosts,
    Evaluation,
    LayerCost,
    StageCost,
    StageWork,
    Strategy,
    _stage_memory,
    capacity_extra,
    check_selective,
    critical_stages,
    selective_view,
    stage_cost,
    time_breakdown,
)
from runtime.contract.choices import ScheduleName, names

__all__ = [
    "SCHEDULES",
    "ChunkTimes",
    "SimulatedPipeline",
    "split_chunks",
    "chunk_times",
    "interleaved_inflight",
    "chunk_ranges_of_rank",
    "evaluate_schedule",
]

#: Pipeline schedules a strategy may run (plan.json ``schedule``).
SCHEDULES = names(ScheduleName)


@dataclass(frozen=True)
class ChunkTimes:
    """Seconds of one micro-batch per model chunk (index = chunk in model order)."""

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    """``B``: the whole backward, or without ``weight_s`` when the schedule splits it."""
    weight_s: tuple[float, ...] | None
    """``W`` (weight gradients) per chunk under zero bubble; ``None`` otherwise."""
    send_s: float
    """One point-to-point transfer (the slowest boundary's), occupying the sending rank."""
    act_bytes: tuple[float, ...] | None = None
    """Activation bytes one micro-batch leaves on each chunk until its backward (a recomputed
    layer its input): weights the schedule's in-flight chunks by their size (``None``: equal)."""
    keep_bytes: tuple[float, ...] | None = None
    """Under zero bubble, the gradients each chunk keeps from ``B`` to ``W`` (``wgrad_keep_b``)."""
    free_bytes: tuple[float, ...] | None = None
    """Under zero bubble, the activations each chunk frees at ``B`` already, not at ``W``: its last
    layer's tail (``LayerCost.tail_b``; the first chunk, whose backward all runs at ``W``, none)."""


@dataclass(frozen=True)
class SimulatedPipeline:
    """What the simulated schedule says (filled by ``planner.search.schedule_search``)."""

    makespan_s: float
    """Time from the first forward to the last rank's last action, ``m`` micro-batches."""
    held: tuple[float, ...]
    """Per rank, peak micro-batches of activations held, in units of the rank's own activations
    of one micro-batch."""
    messages: int
    """Point-to-point messages of one step, over all ranks."""
    w_pending: tuple[float, ...] = ()
    """Per rank, micro-batches whose weight products' output gradients (``LayerCost.wgrad_keep_b``)
    count at the peak, same units as ``held`` (module docstring, "Memory"); empty without ``W``."""
    held_between: tuple[float, ...] = ()
    """Per rank, the most activations and kept gradients held at any moment (same units as
    ``held``, which counts what is held when a backward starts, under its transients): a floor
    for the activation memory when kept gradients outlast the transients; empty if not followed."""


def split_chunks(costs: Sequence[float], num_chunks: int) -> tuple[tuple[int, int], ...]:
    """``num_chunks`` contiguous non-empty ranges of ``costs`` (per layer) minimizing the largest
    range's sum: bisection on the threshold with a greedy fill that leaves a layer for every
    remaining chunk. Cached: the schedule search splits the same layer times for every depth it
    prices and again for each recompute answer."""
    return _split_chunks(tuple(costs), num_chunks)


@functools.lru_cache(maxsize=4096)
def _split_chunks(costs: tuple[float, ...], num_chunks: int) -> tuple[tuple[int, int], ...]:
    n = len(costs)
    if not 1 <= num_chunks <= n:
        raise ValueError(f"cannot cut {n} layers into {num_chunks} non-empty chunks")
    lower, upper = max(costs), sum(costs)
    best, upper, _ = _greedy_cut(costs, num_chunks, upper * (1 + 1e-12))
    for _ in range(60):
        if upper - lower <= 1e-9 * upper:
            break
        mid = (lower + upper) / 2
        got, largest, exceeded = _greedy_cut(costs, num_chunks, mid)
        if got is None:
            lower = max(mid, exceeded)  # the fill fails alike under any threshold below `exceeded`
        else:
            upper, best = largest, got  # and succeeds alike down to its largest chunk
    if best is None:  # pragma: no cover - a fill under the whole sum always succeeds
        raise ValueError("no chunking found")
    return tuple(best)


def _greedy_cut(
    costs: tuple[float, ...], num_chunks: int, limit: float
) -> tuple[list[tuple[int, int]] | None, float, float]:
    """The greedy fill of ``split_chunks`` under ``limit``: a chunk closes before the layer that
    would take it past ``limit``, or where the layers left are one per chunk left. Returns the
    chunks (None when there are not exactly ``num_chunks`` or one exceeds ``limit``), the largest
    chunk's sum, and the least sum above ``limit`` the fill met (a layer's ``acc + cost`` that
    closed a chunk, or a chunk over the limit): every threshold in ``[limit, that)`` makes the
    same comparisons, so the same fill and the same outcome."""
    n = len(costs)
    out: list[tuple[int, int]] = []
    start, acc, exceeded = 0, 0.0, math.inf
    for i, cost in enumerate(costs):
        left = num_chunks - len(out) - 1  # chunks still to open after the current one
        if i > start:
            grown = acc + cost
            if grown > limit:
                exceeded = min(exceeded, grown)
            if grown > limit or n - i == left:
                out.append((start, i - 1))
                start, acc = i, 0.0
        acc += cost
    out.append((start, n - 1))
    largest = max(sum(costs[first : last + 1]) for first, last in out)
    if largest > limit:
        exceeded = min(exceeded, largest)
    return (out if len(out) == num_chunks and largest <= limit else None), largest, exceeded


def _chunk_forward(costs: CandidateCosts, first: int, last: int) -> float:
    chunk_layers = costs.layers[first : last + 1]
    zmb = sum(layer.zero_mb_s for layer in chunk_layers)
    return sum(layer.fwd_s + layer.tp_fwd_s + layer.ep_fwd_s + layer.cp_fwd_s for layer in chunk_layers) + (
        zmb / 3 if costs.cand.zero_stage == 3 else 0.0
    )


def _chunk_step(
    costs: CandidateCosts, first: int, last: int, checkpointed: frozenset, selective: frozenset = frozenset()
) -> float:
    """One micro-batch through chunk ``[a, b]`` without its sends."""
    return sum(
        layer.work_s
        + layer.zero_mb_s
        + (layer.rec_s if i in checkpointed else 0.0)
        + (layer.sel_rec_s if i in selective else 0.0)
        for i, layer in zip(range(first, last + 1), costs.layers[first : last + 1])
    )


def send_seconds(costs: CandidateCosts, chunks: Sequence[tuple[int, int]]) -> float:
    """The slowest chunk boundary's transfer (a boundary between ranks ``c % p`` and ``(c+1) % p``
    is priced on 1F1B's placement of stage boundary ``c % p``, the wrap from rank ``p - 1`` to 0
    on the slowest one)."""
    pp = costs.cand.pp
    if pp == 1 or len(chunks) < 2:
        return 0.0
    return max(costs.send_s(last, min(chunk % pp, pp - 2)) for chunk, (_first, last) in enumerate(chunks[:-1]))


def chunk_times(
    costs: CandidateCosts,
    chunks: Sequence[tuple[int, int]],
    checkpoint: Sequence[int],
    schedule: str,
    selective: Sequence[int] = (),
) -> ChunkTimes:
    """Per-chunk ``F``, ``B`` (and ``W`` under zero bubble) of one micro-batch (module docstring).
    A selectively recomputed core runs again in ``B`` only (``W`` restarts autograd at the weight
    products, outside the cores)."""
    checkpointed = frozenset(checkpoint)
    fwd = [_chunk_forward(costs, first, last) for first, last in chunks]
    full = [
        _chunk_step(costs, first, last, checkpointed, frozenset(selective)) - f for (first, last), f in zip(chunks, fwd)
    ]
    weight = None
    if schedule == ScheduleName.ZERO_BUBBLE:
        weight = tuple(
            min(sum(layer.wgrad_s for layer in costs.layers[first : last + 1]), backward)
            for (first, last), backward in zip(chunks, full)
        )
        full = [backward - weight_s for backward, weight_s in zip(full, weight)]
        # a recomputed layer's forward runs again at W (the runtime's W is its own autograd task)
        weight = tuple(
            weight_s + sum(costs.layers[i].rec_s for i in range(first, last + 1) if i in checkpointed)
            for (first, last), weight_s in zip(chunks, weight)
        )
    sel = frozenset(selective)
    layers = costs.layers
    # what each layer keeps: its input when recomputed whole, less its cores when selective
    # (``cost_models.strategy.selective_view``'s ``saved_b``)
    kept = [
        layer.input_b if i in checkpointed else layer.saved_b - (layer.sel_saved_b if i in sel else 0)
        for i, layer in enumerate(layers)
    ]
    acts = tuple(sum(kept[first : last + 1]) for first, last in chunks)
    keep = free = None
    if weight is not None:
        # the first chunk has no B (nothing before it needs a gradient): W runs its whole backward
        keep = tuple(
            0.0 if chunk == 0 else sum(layer.wgrad_keep_b for layer in costs.layers[first : last + 1])
            for chunk, (first, last) in enumerate(chunks)
        )
        free = tuple(
            0.0 if chunk == 0 or last in checkpointed or last in sel else costs.layers[last].tail_b
            for chunk, (_first, last) in enumerate(chunks)
        )
    return ChunkTimes(tuple(fwd), tuple(full), weight, send_seconds(costs, chunks), acts, keep, free)


def interleaved_inflight(rank: int, num_stages: int, num_micro_batches: int, virtual_stages: int) -> float:
    """Closed form of the interleaved schedule's peak activations on ``rank``, in units of the
    rank's activations of one micro-batch: ``min(2 (p - r - 1) + (v - 1) p + 1, m v) / v``."""
    return (
        min(2 * (num_stages - rank - 1) + (virtual_stages - 1) * num_stages + 1, num_micro_batches * virtual_stages)
        / virtual_stages
    )


def chunk_ranges_of_rank(chunks: Sequence[tuple[int, int]], pp: int, rank: int) -> list[tuple[int, int]]:
    """The chunks pipeline rank ``rank`` runs (chunk ``c`` on rank ``c % p``)."""
    return [chunk_range for chunk, chunk_range in enumerate(chunks) if chunk % pp == rank]


@dataclass(frozen=True)
class _ScheduledStrategy:
    """A strategy under a schedule with its simulation: what each rank's cost is read from."""

    chunks: Sequence[tuple[int, int]]
    checkpointed: frozenset
    selected: frozenset
    schedule: str
    simulated: SimulatedPipeline
    times: ChunkTimes


def evaluate_schedule(
    costs: CandidateCosts,
    chunks: Sequence[tuple[int, int]],
    checkpoint: Sequence[int],
    schedule: str,
    virtual_stages: int,
    sim: SimulatedPipeline,
    times: ChunkTimes,
    selective: Sequence[int] = (),
) -> Evaluation:
    """Price a strategy run under ``schedule`` from its simulation (see the module docstring)."""
    cand = costs.cand
    pp, micro_batches, v = cand.pp, cand.num_micro_batches, virtual_stages
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
    if len(chunks) != pp * v or len(sim.held) != pp:
        raise ValueError(f"{len(chunks)} chunks and {len(sim.held)} ranks for pp={pp}, v={v}")
    checkpointed = frozenset(int(i) for i in checkpoint)
    selected = frozenset(int(i) for i in selective)
    check_selective(costs, checkpointed, selected)
    run = _ScheduledStrategy(chunks, checkpointed, selected, schedule, sim, times)
    out = [_rank_stage(costs, run, rank) for rank in range(pp)]
    critical = critical_stages(out)
    tail = out[critical.tail].dp_s + out[critical.tail].opt_s
    busiest = out[critical.bottleneck]
    micro_step = busiest.micro_step_s
    span = sim.makespan_s
    busy = micro_batches * (
        busiest.compute_s + busiest.recompute_s + busiest.tp_s + busiest.ep_s + busiest.cp_s + busiest.zero_mb_s
    )
    extra, fits = capacity_extra(
        costs,
        out,
        [_rank_layers(chunks, pp, rank) for rank in range(pp)],
        more={"messages": sim.messages, "chunk_times": times},
    )
    return Evaluation(
        strategy=Strategy(
            cand, tuple((int(first), int(last)) for first, last in chunks), checkpointed, schedule, v, selected
        ),
        stages=out,
        step_time_s=span + tail,
        micro_step_s=micro_step,
        tail_s=tail,
        time=time_breakdown(out, micro_batches, critical, pp_bubble=span - busy),
        memory=dict(out[critical.peak].memory),
        peak_stage=critical.peak,
        bottleneck_stage=critical.bottleneck,
        comm_bytes_per_device=max(stage.comm_bytes for stage in out),
        bubble_fraction=max(span - micro_batches * micro_step, 0.0) / span if span > 0 else 0.0,
        feasible=fits and math.isfinite(span),
        capacity=costs.capacity,
        extra=extra,
    )


def _rank_layers(chunks: Sequence[tuple[int, int]], pp: int, rank: int) -> list[int]:
    """The layer indices pipeline rank ``rank`` holds, over all its chunks."""
    return [i for first, last in chunk_ranges_of_rank(chunks, pp, rank) for i in range(first, last + 1)]


def _rank_stage(costs: CandidateCosts, run: _ScheduledStrategy, rank: int) -> StageCost:
    """Pipeline rank ``rank``'s cost under the simulated schedule (all its chunks together)."""
    pp, chunks = costs.cand.pp, run.chunks
    mine = chunk_ranges_of_rank(chunks, pp, rank)
    indices = [i for first, last in mine for i in range(first, last + 1)]
    view = selective_view([costs.layers[i] for i in indices], indices, run.selected)
    recomputed = [i in run.checkpointed for i in indices]
    recompute_s = sum(layer.rec_s for layer, whole in zip(view, recomputed) if whole) * (
        2 if run.schedule == ScheduleName.ZERO_BUBBLE else 1
    ) + sum(layer.sel_rec_s for i, layer in zip(indices, view) if i in run.selected)
    sends, sent_b = 0, 0.0
    for chunk in range(rank, len(chunks), pp):
        if chunk < len(chunks) - 1:  # activations forward
            sends, sent_b = sends + 1, sent_b + costs.layers[chunks[chunk][1]].boundary_b
        if chunk > 0:  # gradients back
            sends, sent_b = sends + 1, sent_b + costs.layers[chunks[chunk - 1][1]].boundary_b
    p2p_s = sends * run.times.send_s
    memory, bound = _rank_memory(costs, run.simulated, rank, view, recomputed)
    forward_s = sum(run.times.forward_s[chunk] for chunk in range(rank, len(chunks), pp))
    work = StageWork(mine[0][0], mine[-1][1], view, recomputed, recompute_s, p2p_s, sent_b)
    return stage_cost(costs, work, forward_s, memory, bound)


def _rank_memory(
    costs: CandidateCosts,
    sim: SimulatedPipeline,
    rank: int,
    view: Sequence[LayerCost],
    recomputed: Sequence[bool],
) -> tuple[dict, int]:
    """A rank's memory (and its conservative bound) with the simulated activations in flight."""
    memory, bound = _stage_memory(costs, view, recomputed, rank, inflight=sim.held[rank])
    if sim.held_between:  # kept gradients held past the backward's transients
        kept = sum(layer.input_b if whole else layer.saved_b for layer, whole in zip(view, recomputed))
        floor = int(math.ceil(sim.held_between[rank] * kept))
        if floor > memory["activations"]:
            memory = {**memory, "total": memory["total"] + floor - memory["activations"], "activations": floor}
            bound = max(bound, memory["total"])
    if sim.w_pending:  # output gradients kept for W (module docstring, "Memory")
        keep = int(math.ceil(sim.w_pending[rank] * sum(layer.wgrad_keep_b for layer in view)))
        memory = {**memory, "activations": memory["activations"] + keep, "total": memory["total"] + keep}
        bound += keep
    return memory, bound
