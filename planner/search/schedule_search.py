"""Choosing the pipeline schedule: 1F1B, interleaved 1F1B with ``v`` chunks, or zero bubble.

The partition ILP (:mod:`planner.search.ilp`) optimizes 1F1B's closed form. Other schedules are
priced afterwards, on the strategies the search kept, by :func:`apply_schedules`:

- for each such strategy with ``pp >= 2``, every schedule of :data:`SEARCHED_SCHEDULES` the
  candidate allows (:func:`schedule_options`: zero bubble needs ``m >= p``; interleaved ``m`` a
  multiple of ``p`` and ``p v`` chunks no more than the layer-table rows, ``v`` up to
  :data:`MAX_VIRTUAL_STAGES`) is priced by :func:`price_schedule`: the chunks
  (``cost_models.schedule_cost.split_chunks``, with the strategy's recomputed layers), their ``F``,
  ``B`` (and ``W``) times, the runtime's own action list (``runtime.contract.schedule_ir``) run through its
  simulator (:func:`simulate_pipeline`), and ``cost_models.schedule_cost.evaluate_schedule``;
- the fastest that fits replaces the 1F1B strategy (ties keep 1F1B: fewer messages, less
  memory), and the kept strategies are ranked again. The winner records the best plain 1F1B
  plan's step (``extra["plain_step_s"]``) so the report can say what the schedule gains.

Which strategies. The search keeps the best strategy of each degree triple it solved
(``res.ranked``), fastest under 1F1B first. The four fastest (what the plan shows as runners-up),
and the other batchings while fewer triples fit (``res.extra``), are always priced. The others are
visited by a sound lower bound of their best schedule (:func:`schedule_bounds`: the least of the
1F1B price and each option's :func:`step_bound`, milliseconds per strategy) and priced only while
that bound does not exceed the best step found: a triple further down the 1F1B ranking that wins
under zero bubble or interleaved (a deep pipeline with a large bubble) is found, and the winner is
the fastest of every kept strategy under its best schedule; those left unpriced keep their 1F1B
price (only ``planner tune`` reaches them). With a ``--schedule`` pin, every kept strategy is
priced under it.

Room for the schedule. The search keeps one strategy per triple, its fastest under 1F1B, which
often has ZeRO 0, a large micro-batch and no recompute, where another schedule wins with another
ZeRO stage, micro-batch or recompute of the same triple. So the walk (:class:`_Walk`) also
visits, each by a lower bound of its own: the triple's other candidates the search enumerated
(their 1F1B strategy from the search's ILP, ``Refit.strategy``; bound
:func:`schedule_free_bound`, which counts the recompute memory forces), each candidate's 1F1B
answers with every block recomputed selectively or fully (``Refit.uniform``, shared between the
schedules; bound :func:`recompute_free_bound`), and, where a schedule that could win did not fit,
the same stages at a higher ZeRO stage (:func:`_sharded_siblings`, no ILP). The
other candidates' ILPs but other micro-batch sizes of the kept strategies are capped
(``planner.search.schedule_refit.SOLVE_BUDGET``, by bound). Triples the 1F1B search pruned are
not revisited.

Recompute for the schedule. Where the schedule's bound beat the answer but it did not fit on the
strategy's 1F1B recompute set, ``refit`` (:mod:`planner.search.schedule_refit`, passed in by
``planner.search.solve``) re-solves the partition and recompute ILP with the schedule's own
in-flight activations and prices the answer here; :func:`_refit_options` says which schedules get
one. A pinned schedule's strategies are refitted too; the other batchings (runners-up) are not.

Why a post-pass is sound enough and cheap: a schedule changes the bubble and the sends, not the
work, so the candidates the 1F1B search ruled out on memory stay out (the schedules hold at least
1F1B's activations) and those it ruled out on time lose by more than the bubble they could
recover except at the margin; pricing a schedule is a few simulations, where re-solving the
ILPs per schedule would multiply the search's cost. ``--schedule`` pins are honoured on the same
strategies. A schedule that does not fit in memory is never simulated: its memory follows from
the order of each rank's actions (:func:`pipeline_memory`), not their times.

Simulation cost. The action lists grow as ``p m v``; for large ``m`` the makespan is simulated at
``w p`` and ``(w + 1) p`` micro-batches (``w = 1`` for 1F1B and zero bubble, 2 for interleaved,
whose warm-up spans two groups) and extended to ``m`` at the steady state's pace: each further
group of ``p`` micro-batches adds the larger of the last simulated group's time and ``p`` times
the busiest rank's work (compute and sends of one micro-batch over its chunks). In the steady
state the busiest rank runs without idling, so the increment converges to the second; with
unequal chunks the interleaved order can take a few groups to get there, and the larger of the
two never extrapolates below the full simulation (a fraction of a percent above it on the tests'
random chunk times: ``tests/planner/search/test_schedules.py`` checks both).
Options are simulated in order of a sound lower bound (:func:`step_bound`) and not
at all once it reaches the best found, and the action lists are cached per ``(p, m, v)``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import heapq
import math
from typing import Any, Callable, Mapping, Protocol, Sequence, cast

from cost_models.schedule_cost import (
    ChunkTimes,
    SimulatedPipeline,
    chunk_times,
    evaluate_schedule,
    split_chunks,
)
from cost_models.strategy import Candidate, CandidateCosts, Evaluation, evaluate
from planner.search.candidates import forced_micro_step, memory_lower_bound, tail_bound, total_work
from planner.search.ilp import _rank_key
from planner.search.order_arrays import OrderArrays, has_kind, peak_open, weighted_held
from planner.search.program_cache import cached_order, cached_program
from planner.search.search_errors import SearchError
from runtime.contract.choices import ScheduleName
from runtime.contract.schedule_ir import (
    B,
    F,
    Schedule,
    ScheduleError,
    TimingProgram,
    W,
    interleaved_compute,
    interleaved_one_f_one_b,
    one_f_one_b,
    zero_bubble_h1,
)

__all__ = [
    "SEARCHED_SCHEDULES",
    "MAX_VIRTUAL_STAGES",
    "schedule_options",
    "build_schedule",
    "simulate_pipeline",
    "price_schedule",
    "best_schedule",
    "schedule_bounds",
    "pipeline_memory",
    "step_bound",
    "evaluate_strategy",
    "apply_schedules",
    "check_schedule_pins",
    "schedule_allows",
    "schedule_free_bound",
    "recompute_free_bound",
    "Refit",
]

#: Schedules the search tries by default (pins always work): narrow it to ``("1f1b",)`` to plan
#: only what a runtime without the other executors runs.
SEARCHED_SCHEDULES: tuple[str, ...] = tuple(ScheduleName)

#: Largest number of model chunks per rank the search tries (Megatron-LM's runs use 2-8).
MAX_VIRTUAL_STAGES = 8
#: Items of the walk's queue :meth:`_Walk.prefetch` looks through for the next ILP to start.
PREFETCH_LOOKAHEAD = 6
#: ILPs the walk keeps started ahead of the one it waits for: each solver is a process of its own,
#: so two use two cores while the walk prices what it has.
PREFETCH_AHEAD = 2


#: What simulating a strategy under a schedule needs: its model chunks (inclusive layer ranges)
#: and their ``F``, ``B`` (and ``W``) times.
Prepared = tuple[Sequence[tuple[int, int]], ChunkTimes]
#: One option of :func:`schedule_bounds`: ``(bound, index, name, v, prepared)`` (``prepared`` is
#: ``None`` for 1F1B, priced in closed form).
Bounded = tuple[float, int, str, int, Prepared | None]


class Refit(Protocol):
    """What the post-pass may solve (:mod:`planner.search.schedule_refit` builds one)."""

    def __call__(self, costs: CandidateCosts, base: Evaluation, name: str, virtual_stages: int) -> Evaluation | None:
        """``base``'s candidate under the schedule with the partition and recompute chosen for the
        schedule's memory, or ``None``."""

    def strategy(self, costs: CandidateCosts, budgeted: bool = True) -> Evaluation | None:
        """The candidate's best 1F1B strategy (the search's own ILP), or ``None`` when none fits
        (or, ``budgeted``, when the post-pass has solved as many as it may)."""

    @property
    def kinds(self) -> Sequence[str]:
        """The layer table's row kinds."""

    @property
    def checkpoint(self) -> str:
        """The search's ``--checkpoint`` mode."""

    @property
    def modes(self) -> Sequence[str]:
        """The uniform recompute modes the search's ``--checkpoint`` allows (none but under ``auto``)."""

    def uniform(
        self, costs: CandidateCosts, mode: str, name: str, virtual_stages: int, best: float
    ) -> Evaluation | None:
        """The candidate's 1F1B strategy with every block recomputed under ``mode`` priced under
        the schedule; ``None`` when it does not run, or provably not faster than ``best``."""

    def prefetch(
        self, costs: CandidateCosts, mode: str, pool: concurrent.futures.Executor, budgeted: bool = False
    ) -> concurrent.futures.Future | None:
        """Start on ``pool`` the 1F1B ILP under ``mode`` that :meth:`strategy` (the search's
        mode) or :meth:`uniform` will ask for, so that it runs beside the one being solved; the
        answers stay what they would be. The future, or None when it started nothing."""


@functools.lru_cache(maxsize=128)
def build_schedule(name: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """The runtime's action lists of schedule ``name`` (what the executor walks), cached: the
    kept strategies share their ``(p, m)``. Tuples, so that no caller can change a cached list."""
    if name == ScheduleName.INTERLEAVED:
        sched = interleaved_one_f_one_b(stages, micro_batches, virtual_stages)
    elif name == ScheduleName.ZERO_BUBBLE:
        sched = zero_bubble_h1(stages, micro_batches)
    else:
        sched = one_f_one_b(stages, micro_batches)
    # tuples, so that no caller can change a cached list; every reader only iterates them
    return cast(Schedule, tuple(tuple(acts) for acts in sched))


@functools.lru_cache(maxsize=128)
def compute_order(name: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """:func:`build_schedule`'s compute actions alone (``F``, ``B``, ``W`` in each rank's order),
    cached: all the memory analyses read (they skip the messages), built without placing every
    message (most of a deep interleaved schedule's building)."""
    if name == ScheduleName.INTERLEAVED and virtual_stages > 1:
        sched = interleaved_compute(stages, micro_batches, virtual_stages)
    elif name == ScheduleName.ZERO_BUBBLE:
        sched = interleaved_compute(stages, micro_batches, 1, split=True)
    else:
        sched = [
            [action for action in acts if action.kind in (F, B, W)]
            for acts in build_schedule(name, stages, micro_batches, 1)
        ]
    return cast(Schedule, tuple(tuple(acts) for acts in sched))


@functools.lru_cache(maxsize=64)
def timing_program(name: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> TimingProgram:
    """:func:`build_schedule`'s schedule compiled for pricing under many chunk times, cached:
    the kept strategies share their ``(p, m)`` and differ in their times, and later plans read it
    from disk (:mod:`planner.search.program_cache`)."""
    return cached_program(
        name,
        stages,
        micro_batches,
        virtual_stages,
        lambda: TimingProgram.of(build_schedule(name, stages, micro_batches, virtual_stages)),
    )


def _run(name: str, stages: int, micro_batches: int, virtual_stages: int, times: ChunkTimes) -> tuple[float, int]:
    """Makespan and messages of one simulation of the schedule under ``times``."""
    program = timing_program(name, stages, micro_batches, virtual_stages)
    span = program.makespan(
        forward_time=times.forward_s,
        backward_time=times.backward_s,
        weight_time=times.weight_s,
        send_time=times.send_s,
    )
    return span, program.messages


def simulate_pipeline(
    name: str, stages: int, micro_batches: int, virtual_stages: int, times: ChunkTimes
) -> SimulatedPipeline:
    """Makespan and per-rank activations held (in units of the rank's own activations of one
    micro-batch) of schedule ``name`` with these chunk times; extrapolated from two shorter
    simulations when ``m`` is large (module docstring)."""
    span, msgs = _makespan(name, stages, micro_batches, virtual_stages, times)
    return dataclasses.replace(
        pipeline_memory(name, stages, micro_batches, virtual_stages, times), makespan_s=span, messages=msgs
    )


def _makespan(name: str, stages: int, micro_batches: int, virtual_stages: int, times: ChunkTimes) -> tuple[float, int]:
    """:func:`simulate_pipeline`'s makespan and messages."""
    warm = _warm(name)
    if micro_batches <= (warm + 2) * stages:
        return _run(name, stages, micro_batches, virtual_stages, times)
    short_span, _ = _run(name, stages, warm * stages, virtual_stages, times)
    long_span, long_messages = _run(name, stages, (warm + 1) * stages, virtual_stages, times)
    slope = max(long_span - short_span, stages * _busiest(stages, times)) / stages
    return long_span + slope * (micro_batches - (warm + 1) * stages), long_messages // (
        (warm + 1) * stages
    ) * micro_batches


def _warm(name: str) -> int:
    """Groups of ``p`` micro-batches before the steady state."""
    return 2 if name == ScheduleName.INTERLEAVED else 1


def pipeline_memory(
    name: str, stages: int, micro_batches: int, virtual_stages: int, times: ChunkTimes
) -> SimulatedPipeline:
    """What :func:`simulate_pipeline` says of memory (``held``, ``w_pending``, ``held_between``),
    without simulating: the order of each rank's actions fixes it, not their times (makespan and
    messages 0). What lets :func:`best_schedule` skip simulating a schedule that does not fit.
    Read off the order as arrays (:mod:`planner.search.order_arrays`)."""
    warm = _warm(name)
    order = order_arrays(
        name, stages, micro_batches if micro_batches <= (warm + 2) * stages else (warm + 1) * stages, virtual_stages
    )
    # the activations in flight; zero bubble keeps a chunk's whole graph until its W
    split = name == ScheduleName.ZERO_BUBBLE and any(has_kind(order, W))
    peaks = peak_open(order, F, W if split else B)
    held = tuple(min(k, micro_batches * virtual_stages) / virtual_stages for k in peaks)
    short = order_arrays(name, stages, min(micro_batches, (warm + 1) * stages), virtual_stages)
    pending = tuple(
        min(peak if with_w else 0, 1) / virtual_stages
        for peak, with_w in zip(peak_open(short, B, W), has_kind(short, W))
    )
    if times.act_bytes is not None:  # chunks of unequal size: which ones are in flight matters
        at_b, anywhere = weighted_held(
            short, times.act_bytes, W if name == ScheduleName.ZERO_BUBBLE else B, times.keep_bytes, times.free_bytes
        )
        held = tuple(weighted if math.isfinite(weighted) else plain for plain, weighted in zip(held, at_b))
        if times.keep_bytes is not None:  # the kept gradients are in the followed bytes
            pending = tuple(0.0 for _ in pending)
            return SimulatedPipeline(
                makespan_s=0.0,
                held=held,
                messages=0,
                w_pending=pending,
                held_between=tuple(x if math.isfinite(x) else 0.0 for x in anywhere),
            )
    return SimulatedPipeline(makespan_s=0.0, held=held, messages=0, w_pending=pending)


@functools.lru_cache(maxsize=128)
def order_arrays(name: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> OrderArrays:
    """:func:`compute_order` as arrays, cached in this process and on disk
    (:func:`planner.search.program_cache.cached_order`): what the memory analyses read."""
    return cached_order(
        name,
        stages,
        micro_batches,
        virtual_stages,
        lambda: OrderArrays.of(compute_order(name, stages, micro_batches, virtual_stages), virtual_stages),
    )


def _busiest(stages: int, times: ChunkTimes) -> float:
    """The busiest rank's compute and sends for one micro-batch (all its chunks)."""
    n = len(times.forward_s)
    weight = times.weight_s
    return max(
        sum(
            times.forward_s[chunk]
            + times.backward_s[chunk]
            + (weight[chunk] if weight else 0.0)
            + times.send_s * ((chunk < n - 1) + (chunk > 0))
            for chunk in range(rank, n, stages)
        )
        for rank in range(stages)
    )


def schedule_options(
    cand: Candidate,
    rows: int,
    schedule: str | None = None,
    virtual_stages: int | None = None,
    searched: tuple[str, ...] = SEARCHED_SCHEDULES,
) -> list[tuple[str, int]]:
    """``(schedule, v)`` pairs candidate ``cand`` may run, by the pins or the searched set."""
    stages, micro_batches = cand.pp, cand.num_micro_batches
    names = (schedule,) if schedule else searched
    out: list[tuple[str, int]] = []
    for name in names:
        if name == ScheduleName.ONE_F_ONE_B:
            out.append((ScheduleName.ONE_F_ONE_B, 1))
        elif stages < 2 or micro_batches < stages:
            continue
        elif name == ScheduleName.ZERO_BUBBLE:
            out.append((ScheduleName.ZERO_BUBBLE, 1))
        elif name == ScheduleName.INTERLEAVED and micro_batches % stages == 0:
            choices = [virtual_stages] if virtual_stages else range(2, MAX_VIRTUAL_STAGES + 1)
            out += [(ScheduleName.INTERLEAVED, chunks) for chunks in choices if stages * chunks <= rows]
    return out


def schedule_allows(cand: Candidate, rows: int, schedule: str | None, virtual_stages: int | None) -> bool:
    """Whether ``cand`` can run the pinned schedule (always, without a pin)."""
    return not schedule or bool(schedule_options(cand, rows, schedule, virtual_stages))


def evaluate_strategy(costs: CandidateCosts, strategy) -> Evaluation:
    """Price a :class:`~cost_models.strategy.Strategy` under its own schedule (1F1B in closed form,
    the others simulated on its chunks): what re-pricing a plan on another profile needs."""
    recomputed, sel = sorted(strategy.checkpoint), sorted(strategy.selective)
    if strategy.schedule == ScheduleName.ONE_F_ONE_B:
        return evaluate(costs, strategy.stages, recomputed, sel)
    times = chunk_times(costs, strategy.stages, recomputed, strategy.schedule, sel)
    sim = simulate_pipeline(
        strategy.schedule, costs.cand.pp, costs.cand.num_micro_batches, strategy.virtual_stages, times
    )
    return evaluate_schedule(
        costs, strategy.stages, recomputed, strategy.schedule, strategy.virtual_stages, sim, times, sel
    )


def step_bound(costs: CandidateCosts, chunks: Sequence[tuple[int, int]], times: ChunkTimes) -> float:
    """A step time no run of these chunks under these times can beat (sound; checked before
    simulating). Rank ``r`` cannot start before micro-batch 0 has crossed chunks ``0..r-1``
    (their forwards and sends), is then busy for its ``m`` micro-batches' compute and sends at
    least, and, without ``W`` actions (its last action is a backward of chunk ``r``), the step
    cannot end before that backward has crossed chunks ``r-1..0``; plus the rank's exposed tail."""
    stages, micro_batches, n = costs.cand.pp, costs.cand.num_micro_batches, len(chunks)
    f, backward, weight, snd = times.forward_s, times.backward_s, times.weight_s, times.send_s
    best = 0.0
    for rank in range(stages):
        mine = range(rank, n, stages)
        sends = sum((chunk < n - 1) + (chunk > 0) for chunk in mine)
        busy = sum(f[chunk] + backward[chunk] + (weight[chunk] if weight else 0.0) for chunk in mine) + sends * snd
        fill = sum(f[chunk] + snd for chunk in range(rank))
        drain = 0.0 if weight else sum(backward[chunk] + snd for chunk in range(rank))
        tail = sum(
            layer.dp_step_s + layer.opt_s
            for chunk in mine
            for layer in costs.layers[chunks[chunk][0] : chunks[chunk][1] + 1]
        )
        best = max(best, fill + micro_batches * busy + drain + tail)
    return best


def _chunks_for(
    costs: CandidateCosts, base: Evaluation, name: str, virtual_stages: int
) -> Sequence[tuple[int, int]] | None:
    if name != ScheduleName.INTERLEAVED:
        return base.strategy.stages
    recomputed, selective = base.strategy.checkpoint, base.strategy.selective
    layer_times = [
        layer.work_s
        + layer.zero_mb_s
        + (layer.rec_s if i in recomputed else 0.0)
        + (layer.sel_rec_s if i in selective else 0.0)
        for i, layer in enumerate(costs.layers)
    ]
    try:
        return split_chunks(layer_times, costs.cand.pp * virtual_stages)
    except ValueError:
        return None


def price_schedule(costs: CandidateCosts, base: Evaluation, name: str, virtual_stages: int = 1) -> Evaluation | None:
    """``base`` (a 1F1B strategy of ``cc``) priced under schedule ``name`` with ``v`` chunks per rank;
    ``None`` when the schedule cannot run it."""
    if name == ScheduleName.ONE_F_ONE_B:
        return base
    prepared = _prepared(costs, base, name, virtual_stages)
    return None if prepared is None else _simulated(costs, base, name, virtual_stages, *prepared)


def _prepared(costs: CandidateCosts, base: Evaluation, name: str, virtual_stages: int) -> Prepared | None:
    """The chunks and chunk times simulating ``base`` under ``name`` needs (``None``: it cannot run)."""
    chunks = _chunks_for(costs, base, name, virtual_stages)
    if chunks is None:
        return None
    return chunks, chunk_times(costs, chunks, sorted(base.strategy.checkpoint), name, sorted(base.strategy.selective))


def _simulated(
    costs: CandidateCosts,
    base: Evaluation,
    name: str,
    virtual_stages: int,
    chunks: Sequence[tuple[int, int]],
    times: ChunkTimes,
    memory: SimulatedPipeline | None = None,
) -> Evaluation | None:
    """``base`` under ``name`` priced from its simulation (``memory``: its :func:`pipeline_memory`,
    when known), ``None`` when the schedule cannot run."""
    stages, micro_batches = costs.cand.pp, costs.cand.num_micro_batches
    try:
        if memory is None:
            sim = simulate_pipeline(name, stages, micro_batches, virtual_stages, times)
        else:
            span, msgs = _makespan(name, stages, micro_batches, virtual_stages, times)
            sim = dataclasses.replace(memory, makespan_s=span, messages=msgs)
    except ScheduleError:
        return None
    return evaluate_schedule(
        costs,
        chunks,
        sorted(base.strategy.checkpoint),
        name,
        virtual_stages,
        sim,
        times,
        sorted(base.strategy.selective),
    )


def schedule_bounds(costs: CandidateCosts, base: Evaluation, options: list[tuple[str, int]]) -> list[Bounded]:
    """``(bound, index, name, v, prepared)`` of each option of ``options`` that can run ``base``:
    1F1B's bound is its price, another schedule's :func:`step_bound` on its chunks and times
    (``prepared``, what simulating it needs). Their least is a sound lower bound of
    :func:`best_schedule`'s answer, for a few milliseconds instead of simulations."""
    out: list[Bounded] = []
    for i, (name, virtual_stages) in enumerate(options):
        if name == ScheduleName.ONE_F_ONE_B:
            out.append((base.step_time_s, i, name, virtual_stages, None))
            continue
        prepared = _prepared(costs, base, name, virtual_stages)
        if prepared is not None:
            out.append((step_bound(costs, *prepared), i, name, virtual_stages, prepared))
    return out


def _fitting(
    costs: CandidateCosts,
    base: Evaluation,
    name: str,
    virtual_stages: int,
    chunks: Sequence[tuple[int, int]],
    times: ChunkTimes,
) -> SimulatedPipeline | None:
    """``base`` under ``name``'s :func:`pipeline_memory` when it fits in memory (and host / NVMe
    room), else ``None``: the memory of a schedule follows from its action order alone, so a
    schedule that does not fit is rejected before it is simulated, with the same answer."""
    try:
        mem = pipeline_memory(name, costs.cand.pp, costs.cand.num_micro_batches, virtual_stages, times)
    except ScheduleError:
        return None
    evaluation = evaluate_schedule(
        costs,
        chunks,
        sorted(base.strategy.checkpoint),
        name,
        virtual_stages,
        mem,
        times,
        sorted(base.strategy.selective),
    )
    return mem if evaluation.feasible else None


def best_schedule(
    costs: CandidateCosts, base: Evaluation, options: list[tuple[str, int]], bounds: list[Bounded] | None = None
) -> Evaluation | None:
    """The fastest feasible pricing of ``base`` over ``options`` (ties: 1F1B, then the earlier
    option), or ``None`` when none fits. Options are simulated in order of :func:`step_bound` and
    not at all once the bound reaches the best found, nor when they do not fit in memory: the
    answer is the same, for a few simulations instead of one per option. ``bounds``:
    :func:`schedule_bounds` of these options, when the caller has them."""
    return _best(costs, base, options, bounds)[0]


def _best(
    costs: CandidateCosts, base: Evaluation, options: list[tuple[str, int]], bounds: list[Bounded] | None = None
) -> tuple[Evaluation | None, list[tuple[float, str, int]]]:
    """:func:`best_schedule`, and the ``(bound, name, v)`` of each schedule whose bound beat the
    answer but which did not fit on ``base``'s recompute set."""
    best = base if (ScheduleName.ONE_F_ONE_B, 1) in options and base.feasible else None
    todo = schedule_bounds(costs, base, options) if bounds is None else bounds
    unfit: list[tuple[float, str, int]] = []  # schedules that did not fit, by bound
    for bound, _index, name, virtual_stages, prepared in sorted(todo, key=lambda option: option[:2]):
        if name == ScheduleName.ONE_F_ONE_B:
            continue
        if best is not None and bound >= best.step_time_s * (1 - 1e-9):
            break
        assert prepared is not None  # every schedule but 1F1B comes with its chunks and times
        mem = _fitting(costs, base, name, virtual_stages, *prepared)
        if mem is None:
            unfit.append((bound, name, virtual_stages))
            continue
        evaluation = _simulated(costs, base, name, virtual_stages, *prepared, mem)
        if (
            evaluation is not None
            and evaluation.feasible
            and (best is None or evaluation.step_time_s < best.step_time_s * (1 - 1e-9))
        ):
            best = evaluation
    answer = best.step_time_s if best is not None else math.inf
    return best, [option for option in unfit if option[0] < answer]


def _refitted(
    costs: CandidateCosts,
    base: Evaluation,
    best: Evaluation | None,
    unfit: list[tuple[float, str, int]],
    refit: Refit | None,
) -> Evaluation | None:
    """``best``, or faster: the schedules of ``unfit`` that :func:`_refit_options` picks (by
    bound, while the bound beats the best found) with the recompute the ILP chooses for their own
    memory (``refit``, :mod:`planner.search.schedule_refit`)."""
    if refit is None:
        return best
    for bound, name, virtual_stages in _refit_options(unfit):
        if best is not None and bound >= best.step_time_s * (1 - 1e-9):
            break
        got = refit(costs, base, name, virtual_stages)
        if got is not None and got.feasible and (best is None or got.step_time_s < best.step_time_s * (1 - 1e-9)):
            best = got
    return best


def _uniform_refitted(
    costs: CandidateCosts, options: list[tuple[str, int]], best: Evaluation | None, refit: Refit | None
) -> Evaluation | None:
    """``best``, or faster: the candidate's 1F1B answers with every block recomputed (each of
    ``refit.modes``) priced under each option but 1F1B (``refit.uniform``)."""
    if refit is None:
        return best
    for mode in refit.modes:
        for name, virtual_stages in options:
            if name == ScheduleName.ONE_F_ONE_B:
                continue
            bound = best.step_time_s if best is not None else math.inf
            got = refit.uniform(costs, mode, name, virtual_stages, bound)
            if got is not None and got.step_time_s < bound * (1 - 1e-9):
                best = got
    return best


def _refit_options(unfit: list[tuple[float, str, int]]) -> list[tuple[float, str, int]]:
    """Which schedules that did not fit get their own recompute, by bound: zero bubble, and of the
    interleaved depths the one with the least bound and the deepest (rank 0, the most loaded,
    holds ``p + (p - 1) / v`` micro-batches, so the deepest needs the least recompute and has the
    least bubble; only its ``v`` times more sends can make a shallower one win). Each costs up to
    :data:`planner.search.schedule_refit.REFIT_TRIES` ILPs: trying every depth would multiply the
    post-pass's cost by the depths for a rare gain."""
    ordered = sorted(unfit)
    interleaved = [option for option in ordered if option[1] == ScheduleName.INTERLEAVED]
    chosen = {option for option in ordered if option[1] != ScheduleName.INTERLEAVED}
    if interleaved:
        chosen |= {interleaved[0], max(interleaved, key=lambda option: option[2])}
    return sorted(chosen)


def check_schedule_pins(req: Any, rows: int) -> None:
    """Reject ``--schedule`` / ``--virtual-stages`` pins that contradict each other or the
    other pins (``SearchError``, exit 2), saying what would work."""
    sched, virtual = req.schedule, req.virtual_stages
    if virtual is not None and virtual > 1 and sched != ScheduleName.INTERLEAVED:
        raise SearchError(
            f"--virtual-stages {virtual} needs --schedule interleaved (only the interleaved schedule runs "
            f"several model chunks per pipeline rank){'' if sched is None else f', not {sched}'}. "
            "Add --schedule interleaved, or drop --virtual-stages."
        )
    if not sched or sched == ScheduleName.ONE_F_ONE_B:
        return
    if req.pp == 1 or req.gpus == 1:
        raise SearchError(
            f"--schedule {sched} needs a pipeline (pp >= 2), but "
            + ("--pp is 1" if req.pp == 1 else "there is one device")
            + ". Use --schedule 1f1b, or a --pp of 2 or more."
        )
    if sched == ScheduleName.INTERLEAVED:
        stages = req.pp
        if stages and virtual and stages * virtual > rows:
            raise SearchError(
                f"--pp {stages} x --virtual-stages {virtual} = {stages * virtual} model chunks, more than the layer table's "
                f"{rows} rows (embedding, {rows - 2} blocks, head): every chunk needs a layer. "
                f"Use --virtual-stages <= {rows // stages}."
            )
        if stages and req.dp and req.micro_batch:
            micro_batches = req.global_batch // (req.dp * req.micro_batch)
            if micro_batches % stages:
                valid = [
                    micro_batch
                    for micro_batch in range(1, req.global_batch // req.dp + 1)
                    if (req.global_batch // req.dp) % micro_batch == 0
                    and (req.global_batch // (req.dp * micro_batch)) % stages == 0
                ]
                raise SearchError(
                    f"--schedule interleaved runs micro-batches in groups of --pp {stages}, but --global-batch "
                    f"{req.global_batch} / (--dp {req.dp} x --micro-batch {req.micro_batch}) = {micro_batches} micro-batches "
                    f"is not a multiple of {stages}. Micro-batch counts that work: multiples of {stages} (--micro-batch "
                    + (", ".join(map(str, valid)) if valid else "none at this --dp")
                    + ")."
                )


def apply_schedules(
    res,
    cc_of: Mapping,
    rows: int,
    schedule: str | None = None,
    virtual_stages: int | None = None,
    searched: tuple[str, ...] = SEARCHED_SCHEDULES,
    keep: int = 4,
    refit: Refit | None = None,
):
    """The search result ``res`` with its strategies under their best schedule (module docstring,
    "Which strategies"): the ``keep`` fastest under 1F1B (what the plan shows), the other
    batchings while there are fewer than ``keep`` triples, and every other triple, or the same
    stages at a higher ZeRO stage, whose lower bound does not exceed the best found; the rest
    keep their 1F1B price (only ``planner tune`` reaches them). With a schedule pin every kept
    strategy is priced under it, and those that cannot run it are dropped; ``SearchError`` when
    none is left. ``cc_of`` maps a candidate to its ``CandidateCosts`` (a ``KeyError`` for one
    the search did not enumerate)."""
    if res.best is None:
        return res
    plain = res.best
    if not schedule and tuple(searched) == (ScheduleName.ONE_F_ONE_B,):
        return res

    def reprice(evs: list[Evaluation], fit: Refit | None = refit) -> list[Evaluation]:
        out = []
        for evaluation in evs:
            cand = evaluation.strategy.candidate
            opts = schedule_options(cand, rows, schedule, virtual_stages, searched)
            if not opts:
                continue
            got, unfit = _best(cc_of[cand], evaluation, opts)
            got = _refitted(cc_of[cand], evaluation, got, unfit, fit)
            got = _uniform_refitted(cc_of[cand], opts, got, fit if unfit else None)
            if got is not None:
                out.append(got)
        return out

    if schedule:  # pinned: every strategy the search kept
        ranked = sorted(reprice(res.ranked), key=_rank_key)
        extra = sorted(reprice(res.extra), key=_rank_key)
    else:  # the triples that can rank among the `keep` best, then as many other batchings as the plan needs
        ranked = sorted(_bound_walk(res.ranked, cc_of, rows, searched, keep, refit), key=_rank_key)
        shown = max(0, keep - len(res.ranked))
        # the other batchings are runners-up: their 1F1B recompute will do
        extra = sorted(reprice(res.extra[:shown], None), key=_rank_key) + res.extra[shown:]
    if not ranked and not extra:
        what = f"--schedule {schedule}" + (f" --virtual-stages {virtual_stages}" if virtual_stages else "")
        raise SearchError(
            f"{what}: no strategy the search found can run it within memory (its schedule holds "
            "more activations than 1F1B, or the micro-batch counts do not allow it). Pin a larger "
            "--pp, a smaller --micro-batch or --checkpoint all, or drop the schedule pin."
        )
    if not ranked:
        ranked, extra = extra[:1], extra[1:]
    out = dataclasses.replace(res, ranked=ranked, extra=extra)
    if ranked[0].strategy.schedule != ScheduleName.ONE_F_ONE_B or schedule:
        ranked[0].extra["plain_step_s"] = plain.step_time_s
        ranked[0].extra["plain_schedule"] = plain.strategy.schedule
    if not schedule and ranked[0].strategy.schedule != ScheduleName.ONE_F_ONE_B:  # 1F1B: another layout
        out.extra = sorted(out.extra + [plain], key=_rank_key)
    return out


def _bound_walk(
    evs: list[Evaluation], cc_of: Mapping, rows: int, searched: tuple[str, ...], keep: int, refit: Refit | None = None
) -> list[Evaluation]:
    """``evs`` (1F1B strategies, one per degree triple, fastest first) with the ``keep`` first, and
    every other that could beat the best found, priced under their best schedule; the rest
    unchanged, and a strategy that can run none of ``searched`` dropped (:class:`_Walk`)."""
    walk = _Walk(cc_of, rows, searched, keep, refit)
    for k, evaluation in enumerate(evs):
        walk.owners.setdefault(evaluation.strategy.candidate.mesh, k)
        walk.add(evaluation, k, False)
    if refit is not None:
        walk.add_candidates([evaluation.strategy.candidate for evaluation in evs])
    return walk.run()


#: One item of the walk's queue: (bound, order, kind, payload, the tighter bound to come or None).
_Item = tuple[float, int, str, tuple, "Callable[[], Any] | None"]


class _Walk:
    """The post-pass's walk over work items, each keyed by a sound lower bound of what it can
    find, visited by increasing bound and skipped once the bound exceeds the best step found (so
    the winner is the fastest of them all):

    - ``base``: a strategy priced under each schedule on its own partition and recompute
      (:func:`_best`; the bound: the least of :func:`schedule_bounds`), refitted where a schedule
      that could win did not fit (:func:`_refitted`); the same stages at a higher ZeRO stage
      (:func:`_sharded_siblings`) join as ``base`` items. The ``keep`` fastest triples are priced
      whatever their bound (what the plan shows);
    - ``uniform``: the candidate's 1F1B answer with every block recomputed selectively or fully
      (what ``--checkpoint selective|all`` plans) priced under each other schedule (bound:
      :func:`recompute_free_bound`): more recompute can buy a schedule's memory on another
      partition, faster than the 1F1B set's pricing even where that fits;
    - ``strategy``: any other candidate the search enumerated (``cc_of``: another ZeRO stage,
      micro-batch, sequence parallelism or offload of a kept triple, or a triple the 1F1B search
      pruned) whose :func:`schedule_free_bound` beats the best: its 1F1B strategy (the search's
      ILP, ``refit.strategy``) joins as a ``base`` item with its ``uniform`` items.

    What a pinned search can plan (ZeRO stage x micro-batch x schedule x recompute mode) is thus
    reached by the free walk too, with its own bound (``tests/planner/search/test_schedule_refit.py``).
    """

    def __init__(self, cc_of: Mapping, rows: int, searched: tuple[str, ...], keep: int, refit: Refit | None):
        self.cc_of, self.rows, self.searched, self.keep, self.refit = cc_of, rows, searched, keep, refit
        self.heap: list[_Item] = []
        self.order = 0
        self.best = math.inf
        self.per_triple: dict[int, Evaluation] = {}
        self.owners: dict[tuple[int, int, int, int, int], int] = {}
        self.seen: set[Candidate] = set()
        self.ahead: list[concurrent.futures.Future] = []
        """The ILPs started ahead (:meth:`prefetch`) that may still run."""

    def push(self, bound: float, kind: str, payload: tuple, tighter: Callable[[], Any] | None = None) -> None:
        """Queue an item under ``bound``; ``tighter``: a dearer, tighter bound, computed only when
        the item comes first under the best found (then it is queued again under that), so the
        visiting order is that of the tight bounds and the items the cheap one rules out never
        pay for it."""
        self.order += 1
        heapq.heappush(self.heap, (bound, self.order, kind, payload, tighter))

    def tighten(self, lower: float, kind: str, payload: tuple, tighter: Callable[[], Any]) -> None:
        """Queue an item again under its tighter bound; a bound that comes in steps returns
        ``(bound, the next step)``, and the item is queued with that step to come."""
        got = tighter()
        bound, following = got if isinstance(got, tuple) else (got, None)
        self.push(max(lower, bound), kind, payload, following)

    def keep_best(self, owner: int, got: Evaluation | None) -> None:
        if got is None or not got.feasible:
            return
        self.best = min(self.best, got.step_time_s)
        if owner not in self.per_triple or _rank_key(got) < _rank_key(self.per_triple[owner]):
            self.per_triple[owner] = got

    def add(self, evaluation: Evaluation, owner: int, sibling: bool) -> None:
        """A ``base`` item (and, the first time a candidate comes, its ``uniform`` items)."""
        cand = evaluation.strategy.candidate
        opts = schedule_options(cand, self.rows, None, None, self.searched)
        bounds = schedule_bounds(self.cc_of[cand], evaluation, opts)
        if not bounds:
            return
        # the `keep` fastest are priced whatever their bound: first, so that the best found
        # is low before the others are weighed against it
        forced = not sibling and owner < self.keep
        self.push(
            -math.inf if forced else min(bound[0] for bound in bounds),
            "base",
            (evaluation, opts, bounds, owner, sibling),
        )
        if (ScheduleName.ONE_F_ONE_B, 1) in opts and evaluation.feasible:
            self.best = min(self.best, evaluation.step_time_s)
        if cand in self.seen or self.refit is None:
            return
        self.seen.add(cand)
        others = [option for option in opts if option[0] != ScheduleName.ONE_F_ONE_B]
        for mode in self.refit.modes if others else ():
            if not _is_uniform(evaluation, self.cc_of[cand], self.refit.kinds, mode):
                costs, kinds = self.cc_of[cand], self.refit.kinds
                self.push(
                    recompute_free_bound(costs, kinds, mode, forced=False),
                    "uniform",
                    (cand, mode, owner),
                    functools.partial(recompute_free_bound, costs, kinds, mode),
                )

    def add_candidates(self, kept_candidates: list[Candidate]) -> None:
        """``strategy`` items: every enumerated candidate of a kept strategy's degrees not seen yet
        that may run another schedule than 1F1B and fit (in the kept strategies' compile mode).
        Another micro-batch size of a kept strategy is solved whatever the budget
        (``Refit.strategy``), the others within it."""
        refit = self.refit
        assert refit is not None  # the walk adds candidates only with a refit
        compiled = {cand.compile for cand in kept_candidates}
        kept_layouts = {_layout(cand) for cand in kept_candidates}
        for cand in list(self.cc_of.keys()):
            if cand in self.seen or cand.compile not in compiled or cand.mesh not in self.owners:
                continue
            if not any(
                o[0] != ScheduleName.ONE_F_ONE_B for o in schedule_options(cand, self.rows, None, None, self.searched)
            ):
                continue
            if _known_too_big(self.cc_of, cand):
                continue
            payload = (cand, self.owners[cand.mesh], _layout(cand) not in kept_layouts)
            unpriced = getattr(self.cc_of, "unpriced", None)
            if unpriced is not None:  # priced only once its cheaper bounds come first under the best found
                self.push(
                    unpriced.free_floor(cand), "strategy", payload, functools.partial(self._draft_bound, unpriced, cand)
                )
                continue
            costs = self.cc_of[cand]
            if memory_lower_bound(costs) > costs.capacity:
                continue
            self.push(
                schedule_free_bound(costs),
                "strategy",
                payload,
                functools.partial(schedule_free_bound, costs, refit.kinds, refit.checkpoint),
            )

    def _draft_bound(self, unpriced: Any, cand: Candidate) -> tuple[float, Callable[[], float] | None]:
        """A ``strategy`` item's second bound, :func:`schedule_free_bound` with the micro-step the
        memory forces on ``cand``'s costs without data-parallel traffic (``unpriced.draft``: at
        most the priced figures), ``inf`` when even those do not fit; and the third, priced."""
        assert self.refit is not None  # strategy items come with a refit
        following = functools.partial(self._priced_bound, cand)
        if _known_priced(self.cc_of, cand):  # the priced bound costs no more than the draft's
            return following(), None
        draft = unpriced.draft(cand)
        if memory_lower_bound(draft) > draft.capacity:
            return math.inf, following
        return schedule_free_bound(draft, self.refit.kinds, self.refit.checkpoint), following

    def _priced_bound(self, cand: Candidate) -> float:
        """A ``strategy`` item's tight bound (:func:`schedule_free_bound` with the micro-step the
        memory forces), ``inf`` when nothing of ``cand`` fits."""
        assert self.refit is not None  # strategy items come with a refit
        costs = self.cc_of[cand]
        if memory_lower_bound(costs) > costs.capacity:
            return math.inf
        return schedule_free_bound(costs, self.refit.kinds, self.refit.checkpoint)

    def run(self) -> list[Evaluation]:
        workers = max(1, PREFETCH_AHEAD)
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="planner-ilp") as pool:
            try:
                while self.heap:
                    self.visit(*heapq.heappop(self.heap), pool)
            finally:
                for future in self.ahead:  # not asked for: not waited for either
                    future.cancel()
        return list(self.per_triple.values())

    def prefetch(self, pool: concurrent.futures.Executor) -> None:
        """Start the ILPs of the next items that will need one (the least bounds under the best
        found), :data:`PREFETCH_AHEAD` at most, while this one is visited; what is started is what
        would be asked (an item whose bound the best then passes wastes its solve, never changes
        an answer)."""
        refit = self.refit
        self.ahead = [future for future in self.ahead if not future.done()]
        if refit is None or len(self.ahead) >= PREFETCH_AHEAD:
            return
        # the next items come with their tight bounds (what they would get at their turn)
        while self.heap and self.heap[0][4] is not None and self.heap[0][0] <= self.best * (1 - 1e-9):
            lower, _order, kind, payload, tighter = heapq.heappop(self.heap)
            assert tighter is not None  # the loop's condition
            self.tighten(lower, kind, payload, tighter)
        for lower, _order, kind, payload, tighter in heapq.nsmallest(PREFETCH_LOOKAHEAD, self.heap):
            if kind == "base" or tighter is not None or lower > self.best * (1 - 1e-9):
                continue
            if kind == "uniform":
                cand, mode, _owner = payload
                budgeted = False
            else:
                cand, _owner, budgeted = payload
                mode = refit.checkpoint
            started = refit.prefetch(self.cc_of[cand], mode, pool, budgeted)
            if started is not None:
                self.ahead.append(started)
                if len(self.ahead) >= PREFETCH_AHEAD:
                    return

    def visit(
        self,
        lower: float,
        _order: int,
        kind: str,
        payload: tuple,
        tighter: Callable[[], Any] | None,
        pool: concurrent.futures.Executor,
    ) -> None:
        """One work item (the class docstring), after starting the next one's ILP; an item with a
        tighter bound to come is queued again under it (:meth:`push`)."""
        if kind != "base" and lower > self.best * (1 - 1e-9):
            return
        if tighter is not None:
            self.tighten(lower, kind, payload, tighter)
            return
        self.prefetch(pool)
        if kind == "base":
            self.visit_base(lower, *payload)
        elif kind == "uniform":
            self.visit_uniform(*payload)
        else:
            cand, owner, budgeted = payload
            assert self.refit is not None  # strategy items come with a refit
            got = self.refit.strategy(self.cc_of[cand], budgeted)
            if got is not None:
                self.add(got, owner, True)

    def visit_base(
        self, lower: float, evaluation: Evaluation, opts: list, bounds: list, owner: int, sibling: bool
    ) -> None:
        if (
            sibling or owner >= self.keep
        ) and lower > self.best:  # cannot win: keeps its 1F1B price (a sibling: dropped)
            if not sibling and owner not in self.per_triple:
                self.per_triple[owner] = evaluation
            return
        costs = self.cc_of[evaluation.strategy.candidate]
        got, unfit = _best(costs, evaluation, opts, bounds)
        got = _refitted(costs, evaluation, got, unfit, self.refit)
        if got is not None:
            self.best = min(self.best, got.step_time_s)
            if owner not in self.per_triple or _rank_key(got) < _rank_key(self.per_triple[owner]):
                self.per_triple[owner] = got
        if unfit and not sibling:
            for sib in _sharded_siblings(evaluation, self.cc_of):
                self.add(sib, owner, True)

    def visit_uniform(self, cand: Candidate, mode: str, owner: int) -> None:
        """The candidate's ``mode`` answer priced under each schedule but 1F1B."""
        assert self.refit is not None  # uniform items come with a refit
        for name, virtual_stages in schedule_options(cand, self.rows, None, None, self.searched):
            if name != ScheduleName.ONE_F_ONE_B:
                self.keep_best(owner, self.refit.uniform(self.cc_of[cand], mode, name, virtual_stages, self.best))


def schedule_free_bound(costs: CandidateCosts, kinds: Sequence[str] | None = None, checkpoint: str = "auto") -> float:
    """A step no schedule of this candidate can beat: the busiest rank runs ``m`` micro-batches of
    at least the average rank's work and of its largest layer, then the tail
    (:func:`planner.search.candidates.time_lower_bound` without 1F1B's fill and drain); given the
    layer ``kinds``, also of the micro-step the memory forces (:func:`forced_micro_step` under
    ``checkpoint``: what rules out the large micro-batches that only fit with much recompute)."""
    forced = forced_micro_step(costs, kinds, checkpoint) if kinds is not None else 0.0
    return _free_bound(costs, None, forced)


def recompute_free_bound(costs: CandidateCosts, kinds: Sequence[str], mode: str, forced: bool = True) -> float:
    """:func:`schedule_free_bound` of the strategies that recompute every block under ``mode``
    (``all``: whole blocks, ``selective``: their attention cores): each block's recompute is added
    to its work, the rest as there; without the micro-step the memory forces unless ``forced``
    (a looser bound that costs no allocation)."""
    extra = [
        (layer.rec_s if mode == "all" else layer.sel_rec_s if layer.sel_saved_b > 0 else 0.0)
        if kind == "block"
        else 0.0
        for layer, kind in zip(costs.layers, kinds)
    ]
    return _free_bound(costs, extra, forced_micro_step(costs, kinds, mode) if forced else 0.0)


def _free_bound(costs: CandidateCosts, extra: Sequence[float] | None, forced: float) -> float:
    """``extra``: each layer's added work (None: none, read off the distinct layers)."""
    if extra is None:
        work = total_work(costs)
        largest = max(layer.work_s + layer.zero_mb_s for layer, _ in costs.distinct)
    else:
        work = total_work(costs) + sum(extra)
        largest = max(layer.work_s + layer.zero_mb_s + more for layer, more in zip(costs.layers, extra))
    slowest = max(work / costs.cand.pp, largest, forced)
    return costs.cand.num_micro_batches * slowest + tail_bound(costs)


def _is_uniform(evaluation: Evaluation, costs: CandidateCosts, kinds: Sequence[str], mode: str) -> bool:
    """``evaluation`` (the candidate's optimal 1F1B strategy) already recomputes what ``mode``
    pins (``all``: every block whole; ``selective``: every block's attention cores, nothing
    whole): then it is also ``mode``'s optimum, whose own ILP need not be solved."""
    blocks = {i for i, kind in enumerate(kinds) if kind == "block"}
    full, sel = (
        set(evaluation.strategy.checkpoint),
        set(evaluation.strategy.selective) - set(evaluation.strategy.checkpoint),
    )
    if mode == "all":
        return full == blocks and not sel
    return not full and sel == {i for i in blocks if costs.layers[i].sel_saved_b > 0}


def _known_priced(cc_of: Mapping, cand: Candidate) -> bool:
    """Whether ``cc_of`` has priced ``cand`` already (a plain mapping of priced costs has)."""
    check = getattr(cc_of, "priced", None)
    return bool(check(cand)) if check is not None else cand in cc_of


def _known_too_big(cc_of: Mapping, cand: Candidate) -> bool:
    """Whether ``cc_of`` knows without pricing ``cand`` that none of its strategies fits (its
    model state alone overflows the device: ``planner.search.entries.Entry.too_big``); a plain
    mapping of priced costs cannot tell."""
    check = getattr(cc_of, "too_big", None)
    return bool(check(cand)) if check is not None else False


#: The fields of a candidate that are its micro-batching (``_layout``).
_BATCHING_FIELDS = frozenset({"micro_batch_size", "num_micro_batches"})


def _layout(candidate: Candidate) -> tuple:
    """``candidate``'s compared fields but its micro-batching: two candidates with the same
    layout differ only by their micro-batch size."""
    return tuple(
        getattr(candidate, field.name)
        for field in dataclasses.fields(candidate)
        if field.compare and field.name not in _BATCHING_FIELDS
    )


def _sharded_siblings(evaluation: Evaluation, cc_of: Mapping) -> list[Evaluation]:
    """``ev``'s stages and recompute (1F1B-priced) on each candidate the search enumerated
    (``cc_of``: the pins hold) that differs from ``ev``'s only by a higher ZeRO stage: less
    model state per device, for a little more data-parallel traffic. The search keeps one
    strategy per degree triple, its fastest under 1F1B; where another schedule's extra
    activations do not fit beside it, sharding more often makes room (no ILP: the same
    partition, priced again)."""
    candidate = evaluation.strategy.candidate
    out = []
    top = 2 if candidate.compressed else 4  # 1-bit Adam runs at ZeRO 0 and 1 only
    for zero in range(candidate.zero_stage + 1, top) if candidate.weight_dp > 1 else ():
        try:
            costs = cc_of[dataclasses.replace(candidate, zero_stage=zero)]
        except KeyError:  # not enumerated: pinned out, or not a stage this candidate can use
            continue
        out.append(
            evaluate(
                costs,
                evaluation.strategy.stages,
                sorted(evaluation.strategy.checkpoint),
                sorted(evaluation.strategy.selective),
            )
        )
    return out
