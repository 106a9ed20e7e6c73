"""Choosing the pipeline schedule: 1F1B, interleaved 1F1B with ``v`` chunks, or zero bubble.

The partition ILP (:mod:`planner.search.ilp`) optimizes 1F1B's closed form. Other schedules are
priced afterwards, on the strategies the plan shows (the best of the four fastest degree triples,
or other batchings while fewer triples fit; with a ``--schedule`` pin, every strategy the search
kept), by :func:`apply_schedules`:

- for each such strategy with ``pp >= 2``, every schedule of :data:`SEARCHED_SCHEDULES` the
  candidate allows (:func:`schedule_options`: zero bubble needs ``m >= p``; interleaved ``m`` a
  multiple of ``p`` and ``p v`` chunks no more than the layer-table rows, ``v`` up to
  :data:`MAX_VIRTUAL_STAGES`) is priced by :func:`price_schedule`: the chunks
  (``cost_models.schedules.split_chunks``, with the strategy's recomputed layers), their ``F``,
  ``B`` (and ``W``) times, the runtime's own action list (``runtime.schedule``) run through its
  simulator (:func:`simulate_pipeline`), and ``cost_models.schedules.evaluate_schedule``;
- the fastest that fits replaces the 1F1B strategy (ties keep 1F1B: fewer messages, less
  memory), and the kept strategies are ranked again. The winner records the best plain 1F1B
  plan's step (``extra["plain_step_s"]``) so the report can say what the schedule gains.

Why a post-pass is sound enough and cheap: a schedule changes the bubble and the sends, not the
work, so the candidates the 1F1B search ruled out on memory stay out (the schedules hold at least
1F1B's activations) and those it ruled out on time lose by more than the bubble they could
recover except at the margin; pricing a schedule is a few simulations, where re-solving the
ILPs per schedule would multiply the search's cost. What it can miss: a candidate that loses
under 1F1B by less than its bubble (typically a larger micro-batch with fewer micro-batches) and
was cut off before its ILP was solved, or a fifth-best triple under 1F1B whose bubble is larger
than its distance to the fourth. ``--schedule`` pins are honoured on the same strategies. Cost:
on GPT-3 175B on 1024 A100s the post-pass takes 0.06-0.09 s of a 1.5-2 s plan (4 strategies,
8 simulations).

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
import math
from typing import Any

from cost_models.schedules import (
    ChunkTimes,
    SimulatedPipeline,
    chunk_times,
    evaluate_schedule,
    split_chunks,
)
from cost_models.strategy import Candidate, CandidateCosts, Evaluation, evaluate
from planner.search.errors import SearchError
from planner.search.ilp import _rank_key
from runtime.schedule import (
    B,
    F,
    Schedule,
    ScheduleError,
    W,
    analyze,
    interleaved_one_f_one_b,
    one_f_one_b,
    zero_bubble_h1,
)

__all__ = ["SEARCHED_SCHEDULES", "MAX_VIRTUAL_STAGES", "schedule_options", "build_schedule", "simulate_pipeline",
           "price_schedule", "best_schedule", "step_bound", "evaluate_strategy", "apply_schedules", "check_schedule_pins", "schedule_allows"]

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
    return analyze(build_schedule(name, p, m, v), forward_time=times.forward_s, backward_time=times.backward_s,
                   weight_time=times.weight_s, send_time=times.send_s)


def simulate_pipeline(name: str, p: int, m: int, v: int, times: ChunkTimes) -> SimulatedPipeline:
    """Makespan and per-rank activations held (in units of the rank's own activations of one
    micro-batch) of schedule ``name`` with these chunk times; extrapolated from two shorter
    simulations when ``m`` is large (module docstring)."""
    warm = 2 if name == "interleaved" else 1  # groups of p micro-batches before the steady state
    if m <= (warm + 2) * p:
        st = _run(name, p, m, v, times)
        span, msgs = st.makespan, st.messages
    else:
        a, b = _run(name, p, warm * p, v, times), _run(name, p, (warm + 1) * p, v, times)
        slope = max(b.makespan - a.makespan, p * _busiest(p, times)) / p
        span = b.makespan + slope * (m - (warm + 1) * p)
        msgs = b.messages // ((warm + 1) * p) * m
        st = b
    peaks = st.peak_weight_inputs if name == "zero-bubble" else st.peak_activations
    held = tuple(min(k, m * v) / v for k in peaks)
    pending = tuple(min(k, 1) / v for k in _peak_b_to_w(build_schedule(name, p, min(m, (warm + 1) * p), v)))
    if times.act_bytes is not None:  # chunks of unequal size: which ones are in flight matters
        sched = build_schedule(name, p, min(m, (warm + 1) * p), v)
        at_b, anywhere = _weighted_held(sched, p, v, times.act_bytes, W if name == "zero-bubble" else B,
                                        times.keep_bytes, times.free_bytes)
        held = tuple(w if math.isfinite(w) else h for h, w in zip(held, at_b))
        if times.keep_bytes is not None:  # the kept gradients are in the followed bytes
            pending = tuple(0.0 for _ in pending)
            return SimulatedPipeline(makespan_s=span, held=held, messages=msgs, w_pending=pending,
                                     held_between=tuple(x if math.isfinite(x) else 0.0 for x in anywhere))
    return SimulatedPipeline(makespan_s=span, held=held, messages=msgs, w_pending=pending)


def _weighted_held(sched: Schedule, p: int, v: int, act_bytes, release: str,
                   keep_bytes=None, free_bytes=None) -> tuple[list[float], list[float]]:
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
    return max(sum(times.forward_s[c] + times.backward_s[c] + (w[c] if w else 0.0)
                   + times.send_s * ((c < n - 1) + (c > 0)) for c in range(r, n, p)) for r in range(p))


def _peak_b_to_w(sched: Schedule) -> list[int]:
    """Per rank, the most micro-batch chunks whose ``B`` has run and whose ``W`` has not (0
    without ``W`` actions)."""
    out = []
    for acts in sched:
        live = peak = 0
        for a in acts:
            if a.kind == B:
                live += 1
            elif a.kind == W:
                live -= 1
            peak = max(peak, live)
        out.append(peak if any(a.kind == W for a in acts) else 0)
    return out


def schedule_options(cand: Candidate, rows: int, schedule: str | None = None,
                     virtual_stages: int | None = None,
                     searched: tuple[str, ...] = SEARCHED_SCHEDULES) -> list[tuple[str, int]]:
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
        tail = sum(l.dp_step_s + l.opt_s for c in mine for l in cc.layers[chunks[c][0]:chunks[c][1] + 1])
        best = max(best, fill + m * busy + drain + tail)
    return best


def _chunks_for(cc: CandidateCosts, base: Evaluation, name: str, v: int):
    if name != "interleaved":
        return base.strategy.stages
    ck, sel = base.strategy.checkpoint, base.strategy.selective
    costs = [l.work_s + l.zero_mb_s + (l.rec_s if i in ck else 0.0) + (l.sel_rec_s if i in sel else 0.0)
             for i, l in enumerate(cc.layers)]
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


def _simulated(cc: CandidateCosts, base: Evaluation, name: str, v: int, chunks, times: ChunkTimes):
    try:
        sim = simulate_pipeline(name, cc.cand.pp, cc.cand.num_micro_batches, v, times)
    except ScheduleError:
        return None
    return evaluate_schedule(cc, chunks, sorted(base.strategy.checkpoint), name, v, sim, times,
                             sorted(base.strategy.selective))


def best_schedule(cc: CandidateCosts, base: Evaluation, options: list[tuple[str, int]]) -> Evaluation | None:
    """The fastest feasible pricing of ``base`` over ``options`` (ties: 1F1B, then the earlier
    option), or ``None`` when none fits. Options are simulated in order of :func:`step_bound` and
    not at all once the bound reaches the best found: the answer is the same, for a few
    simulations instead of one per option."""
    best = base if ("1f1b", 1) in options and base.feasible else None
    todo = []
    for i, (name, v) in enumerate(options):
        if name == "1f1b":
            continue
        got = _prepared(cc, base, name, v)
        if got is not None:
            todo.append((step_bound(cc, got[0], got[1]), i, name, v, got))
    for bound, _i, name, v, (chunks, times) in sorted(todo):
        if best is not None and bound >= best.step_time_s * (1 - 1e-9):
            break
        ev = _simulated(cc, base, name, v, chunks, times)
        if ev is not None and ev.feasible and (best is None or ev.step_time_s < best.step_time_s * (1 - 1e-9)):
            best = ev
    return best


def check_schedule_pins(req: Any, rows: int) -> None:
    """Reject ``--schedule`` / ``--virtual-stages`` pins that contradict each other or the
    other pins (``SearchError``, exit 2), saying what would work."""
    sched, v = req.schedule, req.virtual_stages
    if v is not None and v > 1 and sched != "interleaved":
        raise SearchError(f"--virtual-stages {v} needs --schedule interleaved (only the interleaved schedule runs "
                          f"several model chunks per pipeline rank){'' if sched is None else f', not {sched}'}. "
                          "Add --schedule interleaved, or drop --virtual-stages.")
    if not sched or sched == "1f1b":
        return
    if req.pp == 1 or req.gpus == 1:
        raise SearchError(f"--schedule {sched} needs a pipeline (pp >= 2), but "
                          + ("--pp is 1" if req.pp == 1 else "there is one device")
                          + ". Use --schedule 1f1b, or a --pp of 2 or more.")
    if sched == "interleaved":
        p = req.pp
        if p and v and p * v > rows:
            raise SearchError(f"--pp {p} x --virtual-stages {v} = {p * v} model chunks, more than the layer table's "
                              f"{rows} rows (embedding, {rows - 2} blocks, head): every chunk needs a layer. "
                              f"Use --virtual-stages <= {rows // p}.")
        if p and req.dp and req.micro_batch:
            m = req.global_batch // (req.dp * req.micro_batch)
            if m % p:
                ok = [b for b in range(1, req.global_batch // req.dp + 1)
                      if (req.global_batch // req.dp) % b == 0 and (req.global_batch // (req.dp * b)) % p == 0]
                raise SearchError(
                    f"--schedule interleaved runs micro-batches in groups of --pp {p}, but --global-batch "
                    f"{req.global_batch} / (--dp {req.dp} x --micro-batch {req.micro_batch}) = {m} micro-batches "
                    f"is not a multiple of {p}. Micro-batch counts that work: multiples of {p} (--micro-batch "
                    + (", ".join(map(str, ok)) if ok else "none at this --dp") + ").")


def apply_schedules(res, cc_of: dict, rows: int, schedule: str | None = None, virtual_stages: int | None = None,
                    searched: tuple[str, ...] = SEARCHED_SCHEDULES, keep: int = 4):
    """The search result ``res`` with each strategy the plan can show (the best of each degree
    triple, and other batchings while there are fewer than ``keep`` triples) run under its best
    schedule (module docstring); the search's further runners-up (which only ``planner tune``
    reaches) stay 1F1B, unless a schedule is pinned. ``cc_of`` maps a candidate to its
    ``CandidateCosts``. With a schedule pin, strategies that cannot run it are dropped;
    ``SearchError`` when none is left."""
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

    # the runners-up the plan can show: the other triples, then as many other batchings as it needs
    top = len(res.ranked) if schedule else keep
    shown = len(res.extra) if schedule else max(0, keep - len(res.ranked))
    ranked = sorted(reprice(res.ranked[:top]) + res.ranked[top:], key=_rank_key)
    extra = sorted(reprice(res.extra[:shown]), key=_rank_key) + res.extra[shown:]
    if not ranked and not extra:
        what = f"--schedule {schedule}" + (f" --virtual-stages {virtual_stages}" if virtual_stages else "")
        raise SearchError(f"{what}: no strategy the search found can run it within memory (its schedule holds "
                          "more activations than 1F1B, or the micro-batch counts do not allow it). Pin a larger "
                          "--pp, a smaller --micro-batch or --checkpoint all, or drop the schedule pin.")
    if not ranked:
        ranked, extra = extra[:1], extra[1:]
    out = dataclasses.replace(res, ranked=ranked, extra=extra)
    if ranked[0].strategy.schedule != "1f1b" or schedule:
        ranked[0].extra["plain_step_s"] = plain.step_time_s
        ranked[0].extra["plain_schedule"] = plain.strategy.schedule
    return out
