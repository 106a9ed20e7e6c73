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
often has ZeRO 0 and no recompute: the zero-bubble schedule's extra activations and kept
gradients may not fit beside it although the same stages at a higher ZeRO stage would (530B GPT
on 2240 A100-80GB: dp5 tp8 pp56 ZeRO 0 needs 78 GiB under zero bubble, 67 GiB at ZeRO 1). So
where a schedule whose bound beat a visited strategy's answer did not fit, its partition and
recompute priced on the candidates that differ only by a higher ZeRO stage
(:func:`_sharded_siblings`, among those the search enumerated: pins hold) join the walk under the
same rule, and the faster stays the triple's strategy. No ILP is solved: the partition is the
one the search found (ZeRO changes no layer's cost but the data-parallel traffic and the
optimizer step, so it stays a good one).

Why a post-pass is sound enough and cheap: a schedule changes the bubble and the sends, not the
work, so the candidates the 1F1B search ruled out on memory stay out (the schedules hold at least
1F1B's activations) and those it ruled out on time lose by more than the bubble they could
recover except at the margin; pricing a schedule is a few simulations, where re-solving the
ILPs per schedule would multiply the search's cost. What it can miss: a candidate that loses
under 1F1B by less than its bubble (typically a larger micro-batch with fewer micro-batches) and
was cut off before its ILP was solved, or one the search solved but dropped because another
candidate of its triple was faster under 1F1B (the search keeps one per triple); and it prices each
strategy's own recompute choice, which a schedule holding more activations than 1F1B (zero bubble
keeps the weight-gradient inputs) may not fit without more recompute. ``--schedule`` pins are
honoured on the same strategies. A schedule that does not fit in memory is never simulated: its
memory follows from the order of each rank's actions (:func:`pipeline_memory`), not their times.
Cost: on GPT-3 175B on 1024 A100s the post-pass takes about 0.4-0.5 s of a 2 s plan (10 kept
triples, 4 priced, the ZeRO 1-3 versions of two bounded out); on the 530B GPT about 1.6 s
(6 kept triples, 5 priced, and the winner, zero bubble at ZeRO 1).

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

import dataclasses
import functools
import heapq
import math
from typing import Any

from cost_models.schedule_cost import (
    ChunkTimes,
    SimulatedPipeline,
    chunk_times,
    evaluate_schedule,
    split_chunks,
)
from cost_models.strategy import Candidate, CandidateCosts, Evaluation, evaluate
from planner.search.ilp import _rank_key
from planner.search.search_errors import SearchError
from runtime.contract.schedule_ir import (
    B,
    F,
    Schedule,
    ScheduleError,
    W,
    analyze,
    interleaved_one_f_one_b,
    one_f_one_b,
    peak_inflight,
    peak_open,
    peak_weight_pending,
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
]

#: Schedules the search tries by default (pins always work): narrow it to ``("1f1b",)`` to plan
#: only what a runtime without the other executors runs.
SEARCHED_SCHEDULES = ("1f1b", "interleaved", "zero-bubble")

#: Largest number of model chunks per rank the search tries (Megatron-LM's runs use 2-8).
MAX_VIRTUAL_STAGES = 8


@functools.lru_cache(maxsize=128)
def build_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The runtime's action lists of schedule ``name`` (what the executor walks), cached: the
    kept strategies share their ``(p, m)``. Tuples, so that no caller can change a cached list."""
    if name == "interleaved":
        sched = interleaved_one_f_one_b(p, m, v)
    elif name == "zero-bubble":
        sched = zero_bubble_h1(p, m)
    else:
        sched = one_f_one_b(p, m)
    return tuple(tuple(acts) for acts in sched)


def _run(name: str, p: int, m: int, v: int, times: ChunkTimes):
    return analyze(
        build_schedule(name, p, m, v),
        forward_time=times.forward_s,
        backward_time=times.backward_s,
        weight_time=times.weight_s,
        send_time=times.send_s,
    )


def simulate_pipeline(name: str, p: int, m: int, v: int, times: ChunkTimes) -> SimulatedPipeline:
    """Makespan and per-rank activations held (in units of the rank's own activations of one
    micro-batch) of schedule ``name`` with these chunk times; extrapolated from two shorter
    simulations when ``m`` is large (module docstring)."""
    span, msgs = _makespan(name, p, m, v, times)
    return dataclasses.replace(pipeline_memory(name, p, m, v, times), makespan_s=span, messages=msgs)


def _makespan(name: str, p: int, m: int, v: int, times: ChunkTimes) -> tuple[float, int]:
    """:func:`simulate_pipeline`'s makespan and messages."""
    warm = _warm(name)
    if m <= (warm + 2) * p:
        st = _run(name, p, m, v, times)
        return st.makespan, st.messages
    a, b = _run(name, p, warm * p, v, times), _run(name, p, (warm + 1) * p, v, times)
    slope = max(b.makespan - a.makespan, p * _busiest(p, times)) / p
    return b.makespan + slope * (m - (warm + 1) * p), b.messages // ((warm + 1) * p) * m


def _warm(name: str) -> int:
    """Groups of ``p`` micro-batches before the steady state."""
    return 2 if name == "interleaved" else 1


def pipeline_memory(name: str, p: int, m: int, v: int, times: ChunkTimes) -> SimulatedPipeline:
    """What :func:`simulate_pipeline` says of memory (``held``, ``w_pending``, ``held_between``),
    without simulating: the order of each rank's actions fixes it, not their times (makespan and
    messages 0). What lets :func:`best_schedule` skip simulating a schedule that does not fit."""
    warm = _warm(name)
    sched = build_schedule(name, p, m if m <= (warm + 2) * p else (warm + 1) * p, v)
    peaks = peak_weight_pending(sched) if name == "zero-bubble" else peak_inflight(sched)
    held = tuple(min(k, m * v) / v for k in peaks)
    short = build_schedule(name, p, min(m, (warm + 1) * p), v)
    pending = tuple(min(k, 1) / v for k in _peak_b_to_w(short))
    if times.act_bytes is not None:  # chunks of unequal size: which ones are in flight matters
        at_b, anywhere = _weighted_held(
            short, p, v, times.act_bytes, W if name == "zero-bubble" else B, times.keep_bytes, times.free_bytes
        )
        held = tuple(w if math.isfinite(w) else h for h, w in zip(held, at_b))
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


def _weighted_held(
    sched: Schedule, p: int, v: int, act_bytes, release: str, keep_bytes=None, free_bytes=None
) -> tuple[list[float], list[float]]:
    """Per rank, the bytes its in-flight (chunk, micro-batch) pairs hold (a chunk's ``F`` adds its
    activations, its ``release`` action frees them; with ``keep_bytes``, the end of a ``B`` adds the
    gradients kept for its ``W``, which frees them; with ``free_bytes``, the end of a ``B`` already
    frees that much of the activations, the rest goes at ``release``), in units of the rank's activations of one
    micro-batch (what the memory model multiplies): ``(most held when a backward starts, most held
    at any moment)``. A backward's transients come on top of the first; the second matters when
    kept gradients outlast them. The order of a rank's actions fixes both: no timing needed."""
    at_b, anywhere = [], []
    for r, acts in enumerate(sched):
        per_mb = sum(act_bytes[c * p + r] for c in range(v))
        live = peak = peak_b = 0.0
        for a in acts:
            c = a.chunk * p + r
            if a.kind == F:
                live += act_bytes[c]
            early = free_bytes[c] if free_bytes is not None and release != B else 0.0
            if a.kind == B:
                peak_b = max(peak_b, live)
                if keep_bytes is not None:
                    live += keep_bytes[c]
                peak = max(peak, live)  # the kept gradients are all made before B drops its outputs
                live -= early
            if a.kind == W and keep_bytes is not None:
                live -= keep_bytes[c]
            if a.kind == release:
                live -= act_bytes[c] - early
            peak = max(peak, live)
        at_b.append(peak_b / per_mb if per_mb > 0 else math.inf)
        anywhere.append(peak / per_mb if per_mb > 0 else math.inf)
    return at_b, anywhere


def _busiest(p: int, times: ChunkTimes) -> float:
    """The busiest rank's compute and sends for one micro-batch (all its chunks)."""
    n = len(times.forward_s)
    w = times.weight_s
    return max(
        sum(
            times.forward_s[c] + times.backward_s[c] + (w[c] if w else 0.0) + times.send_s * ((c < n - 1) + (c > 0))
            for c in range(r, n, p)
        )
        for r in range(p)
    )


def _peak_b_to_w(sched: Schedule) -> list[int]:
    """Per rank, the most micro-batch chunks whose ``B`` has run and whose ``W`` has not (0 on a
    rank without ``W`` actions)."""
    peaks = peak_open(sched, B, W)
    return [peak if any(action.kind == W for action in acts) else 0 for peak, acts in zip(peaks, sched)]


def schedule_options(
    cand: Candidate,
    rows: int,
    schedule: str | None = None,
    virtual_stages: int | None = None,
    searched: tuple[str, ...] = SEARCHED_SCHEDULES,
) -> list[tuple[str, int]]:
    """``(schedule, v)`` pairs candidate ``cand`` may run, by the pins or the searched set."""
    p, m = cand.pp, cand.num_micro_batches
    names = (schedule,) if schedule else searched
    out: list[tuple[str, int]] = []
    for name in names:
        if name == "1f1b":
            out.append(("1f1b", 1))
        elif p < 2 or m < p:
            continue
        elif name == "zero-bubble":
            out.append(("zero-bubble", 1))
        elif name == "interleaved" and m % p == 0:
            vs = [virtual_stages] if virtual_stages else range(2, MAX_VIRTUAL_STAGES + 1)
            out += [("interleaved", v) for v in vs if p * v <= rows]
    return out


def schedule_allows(cand: Candidate, rows: int, schedule: str | None, virtual_stages: int | None) -> bool:
    """Whether ``cand`` can run the pinned schedule (always, without a pin)."""
    return not schedule or bool(schedule_options(cand, rows, schedule, virtual_stages))


def evaluate_strategy(cc: CandidateCosts, strategy) -> Evaluation:
    """Price a :class:`~cost_models.strategy.Strategy` under its own schedule (1F1B in closed form,
    the others simulated on its chunks): what re-pricing a plan on another profile needs."""
    ck, sel = sorted(strategy.checkpoint), sorted(strategy.selective)
    if strategy.schedule == "1f1b":
        return evaluate(cc, strategy.stages, ck, sel)
    times = chunk_times(cc, strategy.stages, ck, strategy.schedule, sel)
    sim = simulate_pipeline(strategy.schedule, cc.cand.pp, cc.cand.num_micro_batches, strategy.virtual_stages, times)
    return evaluate_schedule(cc, strategy.stages, ck, strategy.schedule, strategy.virtual_stages, sim, times, sel)


def step_bound(cc: CandidateCosts, chunks, times: ChunkTimes) -> float:
    """A step time no run of these chunks under these times can beat (sound; checked before
    simulating). Rank ``r`` cannot start before micro-batch 0 has crossed chunks ``0..r-1``
    (their forwards and sends), is then busy for its ``m`` micro-batches' compute and sends at
    least, and, without ``W`` actions (its last action is a backward of chunk ``r``), the step
    cannot end before that backward has crossed chunks ``r-1..0``; plus the rank's exposed tail."""
    p, m, n = cc.cand.pp, cc.cand.num_micro_batches, len(chunks)
    f, b, w, snd = times.forward_s, times.backward_s, times.weight_s, times.send_s
    best = 0.0
    for r in range(p):
        mine = range(r, n, p)
        sends = sum((c < n - 1) + (c > 0) for c in mine)
        busy = sum(f[c] + b[c] + (w[c] if w else 0.0) for c in mine) + sends * snd
        fill = sum(f[c] + snd for c in range(r))
        drain = 0.0 if w else sum(b[c] + snd for c in range(r))
        tail = sum(l.dp_step_s + l.opt_s for c in mine for l in cc.layers[chunks[c][0] : chunks[c][1] + 1])
        best = max(best, fill + m * busy + drain + tail)
    return best


def _chunks_for(cc: CandidateCosts, base: Evaluation, name: str, v: int):
    if name != "interleaved":
        return base.strategy.stages
    ck, sel = base.strategy.checkpoint, base.strategy.selective
    costs = [
        l.work_s + l.zero_mb_s + (l.rec_s if i in ck else 0.0) + (l.sel_rec_s if i in sel else 0.0)
        for i, l in enumerate(cc.layers)
    ]
    try:
        return split_chunks(costs, cc.cand.pp * v)
    except ValueError:
        return None


def price_schedule(cc: CandidateCosts, base: Evaluation, name: str, v: int = 1) -> Evaluation | None:
    """``base`` (a 1F1B strategy of ``cc``) priced under schedule ``name`` with ``v`` chunks per rank;
    ``None`` when the schedule cannot run it."""
    if name == "1f1b":
        return base
    got = _prepared(cc, base, name, v)
    return None if got is None else _simulated(cc, base, name, v, *got)


def _prepared(cc: CandidateCosts, base: Evaluation, name: str, v: int):
    chunks = _chunks_for(cc, base, name, v)
    if chunks is None:
        return None
    return chunks, chunk_times(cc, chunks, sorted(base.strategy.checkpoint), name, sorted(base.strategy.selective))


def _simulated(
    cc: CandidateCosts,
    base: Evaluation,
    name: str,
    v: int,
    chunks,
    times: ChunkTimes,
    memory: SimulatedPipeline | None = None,
):
    """``base`` under ``name`` priced from its simulation (``memory``: its :func:`pipeline_memory`,
    when known), ``None`` when the schedule cannot run."""
    p, m = cc.cand.pp, cc.cand.num_micro_batches
    try:
        if memory is None:
            sim = simulate_pipeline(name, p, m, v, times)
        else:
            span, msgs = _makespan(name, p, m, v, times)
            sim = dataclasses.replace(memory, makespan_s=span, messages=msgs)
    except ScheduleError:
        return None
    return evaluate_schedule(
        cc, chunks, sorted(base.strategy.checkpoint), name, v, sim, times, sorted(base.strategy.selective)
    )


def schedule_bounds(cc: CandidateCosts, base: Evaluation, options: list[tuple[str, int]]) -> list[tuple]:
    """``(bound, index, name, v, prepared)`` of each option of ``options`` that can run ``base``:
    1F1B's bound is its price, another schedule's :func:`step_bound` on its chunks and times
    (``prepared``, what simulating it needs). Their least is a sound lower bound of
    :func:`best_schedule`'s answer, for a few milliseconds instead of simulations."""
    out = []
    for i, (name, v) in enumerate(options):
        if name == "1f1b":
            out.append((base.step_time_s, i, name, v, None))
            continue
        got = _prepared(cc, base, name, v)
        if got is not None:
            out.append((step_bound(cc, got[0], got[1]), i, name, v, got))
    return out


def _fitting(
    cc: CandidateCosts, base: Evaluation, name: str, v: int, chunks, times: ChunkTimes
) -> SimulatedPipeline | None:
    """``base`` under ``name``'s :func:`pipeline_memory` when it fits in memory (and host / NVMe
    room), else ``None``: the memory of a schedule follows from its action order alone, so a
    schedule that does not fit is rejected before it is simulated, with the same answer."""
    try:
        mem = pipeline_memory(name, cc.cand.pp, cc.cand.num_micro_batches, v, times)
    except ScheduleError:
        return None
    ev = evaluate_schedule(
        cc, chunks, sorted(base.strategy.checkpoint), name, v, mem, times, sorted(base.strategy.selective)
    )
    return mem if ev.feasible else None


def best_schedule(
    cc: CandidateCosts, base: Evaluation, options: list[tuple[str, int]], bounds: list[tuple] | None = None
) -> Evaluation | None:
    """The fastest feasible pricing of ``base`` over ``options`` (ties: 1F1B, then the earlier
    option), or ``None`` when none fits. Options are simulated in order of :func:`step_bound` and
    not at all once the bound reaches the best found, nor when they do not fit in memory: the
    answer is the same, for a few simulations instead of one per option. ``bounds``:
    :func:`schedule_bounds` of these options, when the caller has them."""
    return _best(cc, base, options, bounds)[0]


def _best(
    cc: CandidateCosts, base: Evaluation, options: list[tuple[str, int]], bounds: list[tuple] | None = None
) -> tuple[Evaluation | None, bool]:
    """:func:`best_schedule`, and whether a schedule whose bound beat the answer did not fit."""
    best = base if ("1f1b", 1) in options and base.feasible else None
    todo = schedule_bounds(cc, base, options) if bounds is None else bounds
    unfit = math.inf  # the least bound of a schedule that did not fit
    for bound, _i, name, v, got in sorted(todo, key=lambda t: t[:2]):
        if name == "1f1b":
            continue
        if best is not None and bound >= best.step_time_s * (1 - 1e-9):
            break
        mem = _fitting(cc, base, name, v, *got)
        if mem is None:
            unfit = min(unfit, bound)
            continue
        ev = _simulated(cc, base, name, v, *got, mem)
        if ev is not None and ev.feasible and (best is None or ev.step_time_s < best.step_time_s * (1 - 1e-9)):
            best = ev
    return best, unfit < (best.step_time_s if best is not None else math.inf)


def check_schedule_pins(req: Any, rows: int) -> None:
    """Reject ``--schedule`` / ``--virtual-stages`` pins that contradict each other or the
    other pins (``SearchError``, exit 2), saying what would work."""
    sched, v = req.schedule, req.virtual_stages
    if v is not None and v > 1 and sched != "interleaved":
        raise SearchError(
            f"--virtual-stages {v} needs --schedule interleaved (only the interleaved schedule runs "
            f"several model chunks per pipeline rank){'' if sched is None else f', not {sched}'}. "
            "Add --schedule interleaved, or drop --virtual-stages."
        )
    if not sched or sched == "1f1b":
        return
    if req.pp == 1 or req.gpus == 1:
        raise SearchError(
            f"--schedule {sched} needs a pipeline (pp >= 2), but "
            + ("--pp is 1" if req.pp == 1 else "there is one device")
            + ". Use --schedule 1f1b, or a --pp of 2 or more."
        )
    if sched == "interleaved":
        p = req.pp
        if p and v and p * v > rows:
            raise SearchError(
                f"--pp {p} x --virtual-stages {v} = {p * v} model chunks, more than the layer table's "
                f"{rows} rows (embedding, {rows - 2} blocks, head): every chunk needs a layer. "
                f"Use --virtual-stages <= {rows // p}."
            )
        if p and req.dp and req.micro_batch:
            m = req.global_batch // (req.dp * req.micro_batch)
            if m % p:
                ok = [
                    b
                    for b in range(1, req.global_batch // req.dp + 1)
                    if (req.global_batch // req.dp) % b == 0 and (req.global_batch // (req.dp * b)) % p == 0
                ]
                raise SearchError(
                    f"--schedule interleaved runs micro-batches in groups of --pp {p}, but --global-batch "
                    f"{req.global_batch} / (--dp {req.dp} x --micro-batch {req.micro_batch}) = {m} micro-batches "
                    f"is not a multiple of {p}. Micro-batch counts that work: multiples of {p} (--micro-batch "
                    + (", ".join(map(str, ok)) if ok else "none at this --dp")
                    + ")."
                )


def apply_schedules(
    res,
    cc_of: dict,
    rows: int,
    schedule: str | None = None,
    virtual_stages: int | None = None,
    searched: tuple[str, ...] = SEARCHED_SCHEDULES,
    keep: int = 4,
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
    if not schedule and tuple(searched) == ("1f1b",):
        return res

    def reprice(evs: list[Evaluation]) -> list[Evaluation]:
        out = []
        for ev in evs:
            cand = ev.strategy.candidate
            opts = schedule_options(cand, rows, schedule, virtual_stages, searched)
            got = best_schedule(cc_of[cand], ev, opts) if opts else None
            if got is not None:
                out.append(got)
        return out

    if schedule:  # pinned: every strategy the search kept
        ranked = sorted(reprice(res.ranked), key=_rank_key)
        extra = sorted(reprice(res.extra), key=_rank_key)
    else:  # the triples that can rank among the `keep` best, then as many other batchings as the plan needs
        ranked = sorted(_bound_walk(res.ranked, cc_of, rows, searched, keep), key=_rank_key)
        shown = max(0, keep - len(res.ranked))
        extra = sorted(reprice(res.extra[:shown]), key=_rank_key) + res.extra[shown:]
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
    if ranked[0].strategy.schedule != "1f1b" or schedule:
        ranked[0].extra["plain_step_s"] = plain.step_time_s
        ranked[0].extra["plain_schedule"] = plain.strategy.schedule
    return out


def _bound_walk(
    evs: list[Evaluation], cc_of: dict, rows: int, searched: tuple[str, ...], keep: int
) -> list[Evaluation]:
    """``evs`` (1F1B strategies, one per degree triple, fastest first) with the ``keep`` first, and
    every other that could beat the best found, priced under their best schedule
    (:func:`best_schedule`); the rest unchanged, and a strategy that can run none of ``searched``
    dropped. Visits them by increasing lower bound (:func:`schedule_bounds`) and, past the ``keep``
    first, skips those whose bound exceeds the best upper bound (a re-priced step, else a 1F1B
    price when 1F1B is searched): they cannot beat it, so the winner is the fastest of them all.
    Where a schedule that could beat a strategy's answer did not fit in memory, the same stages
    and recompute on the candidates of a higher ZeRO stage (:func:`_sharded_siblings`) join the
    walk, and the faster of each triple's strategies stays (module docstring)."""
    items: list[tuple] = []  # (lower, order, ev, opts, bounds, triple's 1F1B rank, a sibling?)
    heap: list[tuple[float, int]] = []
    best = math.inf

    def add(ev: Evaluation, owner: int, sibling: bool) -> None:
        nonlocal best
        cand = ev.strategy.candidate
        opts = schedule_options(cand, rows, None, None, searched)
        bounds = schedule_bounds(cc_of[cand], ev, opts)
        if bounds:
            items.append((min(b[0] for b in bounds), len(items), ev, opts, bounds, owner, sibling))
            heapq.heappush(heap, (items[-1][0], items[-1][1]))
            if ("1f1b", 1) in opts and ev.feasible:
                best = min(best, ev.step_time_s)

    for k, ev in enumerate(evs):
        add(ev, k, False)
    per_triple: dict[int, Evaluation] = {}
    while heap:
        lower, n = heapq.heappop(heap)
        _lower, _n, ev, opts, bounds, owner, sibling = items[n]
        if (sibling or owner >= keep) and lower > best:  # cannot win: keeps its 1F1B price (a sibling: dropped)
            if not sibling:
                per_triple[owner] = ev
            continue
        got, unfit = _best(cc_of[ev.strategy.candidate], ev, opts, bounds)
        if got is not None:
            best = min(best, got.step_time_s)
            if owner not in per_triple or _rank_key(got) < _rank_key(per_triple[owner]):
                per_triple[owner] = got
        if unfit and not sibling:
            for sib in _sharded_siblings(ev, cc_of):
                add(sib, owner, True)
    return list(per_triple.values())


def _sharded_siblings(ev: Evaluation, cc_of: dict) -> list[Evaluation]:
    """``ev``'s stages and recompute (1F1B-priced) on each candidate the search enumerated
    (``cc_of``: the pins hold) that differs from ``ev``'s only by a higher ZeRO stage: less
    model state per device, for a little more data-parallel traffic. The search keeps one
    strategy per degree triple, its fastest under 1F1B; where another schedule's extra
    activations do not fit beside it, sharding more often makes room (no ILP: the same
    partition, priced again)."""
    c = ev.strategy.candidate
    out = []
    for z in range(c.zero_stage + 1, 4) if c.dp > 1 else ():
        try:
            cc = cc_of[dataclasses.replace(c, zero_stage=z)]
        except KeyError:  # not enumerated: pinned out, or not a stage this candidate can use
            continue
        out.append(evaluate(cc, ev.strategy.stages, sorted(ev.strategy.checkpoint), sorted(ev.strategy.selective)))
    return out
