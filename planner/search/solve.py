"""The planner's entry point: from a request and a layer table to the best :class:`Plan`.

:func:`solve` validates the pins, enumerates candidates (:mod:`planner.search.candidates`),
prices each one's per-layer costs (:mod:`cost_models.strategy`), runs the pruned ILP search
(:mod:`planner.search.ilp`) and assembles plan.json's dataclass with the three best runners-up and why
each lost (:func:`planner.search.alternatives.alternative_reason`).

Compiled stages are a per-plan decision (:func:`choose_compile`): pinned by ``--compile on|off``,
or, by default, the search runs once with every candidate eager and, when compiling could pay,
once more with every candidate compiled (``Candidate.compile``, priced by
:mod:`cost_models.strategy`), and keeps the compiled winner only if its per-step saving over the
eager winner, times the run's steps (``--tokens``, else ``DEFAULT_HORIZON_STEPS``), exceeds its
compile time. "Could pay" is a sound bound checked before the second search: no compiled
strategy saves more per step than ``m`` times the sum of its layers' per-micro-batch savings, so
when the largest such bound over the candidates, times the steps, is below the compile time of
one layer class, the compiled search cannot change the answer and is skipped (the tiny models of
the tests, on the ``cpu`` profile, never compile).

Offload (``search_offload``): after the plain search, the offloaded versions of the candidates
that could still win (sound filters in its docstring) are searched with the plain result as the
incumbents; a pin (``--offload-optimizer``, ``--offload-params`` to cpu or nvme) searches only
offloaded candidates, a pin to none only plain ones.

When nothing fits, :class:`NoFeasiblePlan` says how much memory per device the least demanding
strategy needs (an exact minimum: the same ILPs with memory as the objective), which part
dominates it, and what would make it fit: dropping pins that forbid a fitting plan, offload
(when pins kept it out and it fits on these devices: the tier and its predicted speed, instead of
more devices), ZeRO-3, more devices (estimated from how model state shrinks with them), a smaller
micro-batch, recompute, a bigger device or more headroom.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

from cost_models.compute import optimizer_step_time
from cost_models.hardware import HardwareProfile
from cost_models.offload_cost import adam_rate_per_rank, offload_missing, ranks_per_node
from cost_models.strategy import (
    Candidate,
    CandidateCosts,
    Evaluation,
    NumericTable,
    candidate_costs,
    compile_seconds,
    evaluate,
    memory_bound,
    predicted_fields,
)
from planner.frontend.input_pins import resolve_inputs
from planner.plan import Alternative, HardwareInfo, ModelInfo, Plan, Predicted, SolverInfo
from planner.search.alternatives import alternative_reason
from planner.search.candidates import (
    check_offload_pins,
    check_pins,
    enumerate_candidates,
    memory_lower_bound,
    memory_may_bind,
    offload_pinned,
    offload_variants,
    tied_summary,
    time_lower_bound,
)
from planner.search.ilp import SOLVERS, TIME_TOL, SearchResult, default_solver, search, solve_candidate
from planner.search.schedule_search import apply_schedules, check_schedule_pins, schedule_allows
from planner.search.search_errors import NoFeasiblePlan, SearchError
from planner.units import format_seconds

__all__ = [
    "Solution",
    "solve",
    "build_plan",
    "least_memory",
    "candidate_entries",
    "CompileChoice",
    "choose_compile",
    "search_offload",
]


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


def candidate_entries(
    req, nt: NumericTable, hw: HardwareProfile, gpus_per_node: int, cands: list[Candidate]
) -> list[tuple[float, float, CandidateCosts]]:
    """``(time lower bound, memory lower bound, costs)`` of every candidate."""
    cap = hw.memory_bytes * req.memory_headroom
    out = []
    for c in cands:
        cc = candidate_costs(nt, hw, req.dtype, req.seq_len, c, gpus_per_node, cap)
        out.append((time_lower_bound(cc), memory_lower_bound(cc), cc))
    return out


def least_memory(entries, kinds: list[str], checkpoint: str = "auto", solver: str = "cbc") -> Evaluation | None:
    """The strategy with the least memory on its most loaded device, over all ``entries``.

    Visits candidates by increasing memory lower bound and stops once the bound reaches the best
    found, so the answer is exact.
    """
    best: Evaluation | None = None
    for _lb, mlb, cc in sorted(entries, key=lambda e: (e[1], e[2].cand)):
        if best is not None and mlb >= memory_bound(best):
            break
        ev = solve_candidate(cc, kinds, checkpoint, solver, objective="memory").evaluation
        if ev is not None and (
            best is None or (memory_bound(ev), ev.step_time_s) < (memory_bound(best), best.step_time_s)
        ):
            best = ev
    return best


def _no_feasible_plan(req, nt: NumericTable, hw: HardwareProfile, gpn: int, entries, solver: str) -> NoFeasiblePlan:
    usable = hw.memory_bytes * req.memory_headroom
    least = least_memory(entries, nt.kinds, req.checkpoint, solver)
    head = (
        f"No strategy fits in {_gib(usable)} per device ({req.memory_headroom:.0%} of "
        f"{_gib(hw.memory_bytes)} on {hw.name})."
    )
    if least is None:  # pragma: no cover - every candidate has some partition
        return NoFeasiblePlan(head)
    mem, c = least.memory, least.strategy.candidate
    parts = {
        "parameters": mem["params"],
        "gradients": mem["grads"],
        "optimizer state": mem["optimizer"],
        "activations": mem["activations"],
    }
    dominant = max(parts, key=parts.get)
    state = mem["params"] + mem["grads"] + mem["optimizer"]
    detail = ", ".join(f"{k} {_gib(v)}" for k, v in parts.items())
    msg = [
        head,
        f"The least any strategy needs is {_gib(memory_bound(least))} per device, peaking at "
        f"{_gib(mem['total'])} with every transient buffer at its likely moment ({c.describe()}, "
        f"{len(least.strategy.checkpoint)} of {len(nt.layers)} layers recomputed; most loaded stage "
        f"{least.peak_stage}): {detail}; {dominant} dominate{'' if dominant.endswith('s') else 's'}.",
    ]
    fixes: list[str] = []
    pinned = {
        k: getattr(req, k) for k in ("dp", "tp", "pp", "zero_stage", "micro_batch") if getattr(req, k) is not None
    }
    if req.checkpoint == "none":
        pinned["checkpoint"] = "none"
    if pinned:
        free = dataclasses.replace(req, dp=None, tp=None, pp=None, zero_stage=None, micro_batch=None, checkpoint="auto")
        free_entries = candidate_entries(free, nt, hw, gpn, enumerate_candidates(free, nt, gpn))
        alt = least_memory(free_entries, nt.kinds, "auto", solver)
        flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in pinned.items())
        if alt is not None and memory_bound(alt) <= usable:
            fixes.append(
                f"drop the pins ({flags}): {alt.strategy.candidate.describe()} needs only {_gib(memory_bound(alt))}"
            )
    offload = _offload_fix(req, nt, hw, gpn, solver) if state >= mem["activations"] else None
    if offload is not None:
        fixes.append(offload)
    elif req.offload_optimizer is None and req.offload_params is None and not offload_missing(hw, "cpu", "none"):
        msg.append(
            f"Offloading optimizer state and parameters to host memory or NVMe does not fit either "
            f"({_gib(hw.host_memory_bytes or 0)} of host memory per node of {gpn})."
        )
    if state >= mem["activations"]:
        if c.zero_stage < 3 and c.dp > 1:
            fixes.append("--zero-stage 3 (shards parameters, gradients and optimizer state over data parallelism)")
        room = usable - mem["activations"]
        if room > 0 and offload is None:  # more devices only when offload cannot fit on these
            need = req.gpus * state / room
            need = int(math.ceil(need / gpn) * gpn)
            fixes.append(f"more devices (about {need}: model state per device shrinks as they grow)")
    else:
        if c.micro_batch_size > 1:
            fixes.append("--micro-batch 1")
        if req.checkpoint == "none":
            fixes.append("--checkpoint auto (recompute activations in backward)")
        fixes.append("a shorter --seq-len, or more devices for tensor/pipeline parallelism")
    fixes.append(f"a device with at least {_gib(mem['total'] / req.memory_headroom)} of memory")
    if req.memory_headroom < 1.0 and mem["total"] <= hw.memory_bytes:
        fixes.append(f"--memory-headroom {min(1.0, math.ceil(mem['total'] / hw.memory_bytes * 100) / 100):.2f}")
    msg.append("To make it fit: " + "; or ".join(fixes) + ".")
    return NoFeasiblePlan(" ".join(msg), least)


def _offload_fix(req, nt: NumericTable, hw: HardwareProfile, gpn: int, solver: str) -> str | None:
    """The offload that would make the request fit on its devices (the pins that forbade it
    lifted), with its predicted speed; ``None`` when offload was searched already or fits nowhere."""
    if req.offload_optimizer is None and req.offload_params is None and req.zero_stage != 0:
        return None  # searched: nothing offloaded fits either
    free = dataclasses.replace(
        req, offload_optimizer=None, offload_params=None, zero_stage=None if req.zero_stage == 0 else req.zero_stage
    )
    cands = offload_variants(free, enumerate_candidates(free, nt, gpn), hw)
    if not cands:
        return None
    best = search(candidate_entries(free, nt, hw, gpn, cands), nt.kinds, free.checkpoint, solver).best
    if best is None:
        return None
    c = best.strategy.candidate
    flags = " ".join(
        f"--offload-{k} {v}"
        for k, v in (("optimizer", c.offload_optimizer), ("params", c.offload_params))
        if v != "none"
    )
    if req.zero_stage == 0:
        flags += f" --zero-stage {c.zero_stage}"
    tokens = req.global_batch * req.seq_len / best.step_time_s
    where = " and ".join(
        f"{'optimizer state' if k == 'optimizer' else 'parameters'} in {'host memory' if v == 'cpu' else 'NVMe files'}"
        for k, v in (("optimizer", c.offload_optimizer), ("params", c.offload_params))
        if v != "none"
    )
    here = f"these {req.gpus} devices" if req.gpus > 1 else "this device"
    return (
        f"offload ({flags}: {where}) fits on {here}, "
        f"{c.describe()}, predicted {format_seconds(best.step_time_s)} per step, {tokens:,.0f} tokens/s"
    )


@dataclass(frozen=True)
class CompileChoice:
    """Whether the plan compiles its stages, and the figures behind it (for the report)."""

    on: bool
    mode: str
    """``auto`` (the search decided), ``on`` or ``off`` (pinned by ``--compile``)."""
    saving_s: float
    """Seconds per step compiling saves: the eager winner's step minus the compiled winner's
    (or, where only one was searched, the winner re-priced the other way). Negative: slower."""
    compile_s: float
    """Estimated seconds of compilation, once per run (``cost_models.strategy.compile_seconds``)."""
    steps: int
    """Steps of the run it must pay back over."""
    from_tokens: bool
    """``steps`` comes from ``--tokens`` (else the default horizon)."""

    def reason(self) -> str:
        """One line: on or off, because ..."""
        fs, why = format_seconds, "operator overhead and fused memory-bound ops"
        slower = "compiled layers would not be faster" + (
            f" ({fs(-self.saving_s)} per step slower: few operators per compiled region, or graph breaks "
            "at tensor-parallel collectives)"
            if self.saving_s < 0
            else ""
        )
        if self.mode != "auto":
            tail = (
                f"compiled layers save {fs(self.saving_s)} per step ({why}) for about {fs(self.compile_s)} "
                "of compilation"
                if self.saving_s > 0
                else slower
            )
            return f"{self.mode}, pinned by --compile {self.mode}: {tail}"
        if self.saving_s <= 0:
            return f"off, because {slower}"
        run = f"the run's {self.steps:,} steps" + (
            " (--tokens)" if self.from_tokens else " (the default horizon without --tokens)"
        )
        head = (
            f"compiled layers {'save' if self.on else 'would save'} {fs(self.saving_s)} per step ({why}), "
            f"which repays about {fs(self.compile_s)} of compilation after "
            f"{math.ceil(self.compile_s / self.saving_s):,} steps"
        )
        return f"on, because {head}, within {run}" if self.on else f"off, because {head}, more than {run}"


@dataclass(frozen=True)
class Solution:
    """What the search found: the plan and what only the search knows about it."""

    plan: Plan
    """The fastest strategy that fits, as plan.json's dataclass."""
    evaluation: Evaluation
    """Its priced strategy: per-stage costs for the report and the plot."""
    search: SearchResult
    """Counts of candidates, ILPs and pruning, the runners-up and the search's notes."""
    compile: CompileChoice | None = None
    """Whether the stages are compiled, and why."""


def solve(request, table, hw: HardwareProfile, solver: str | None = None) -> Solution:
    """The planner's entry point: search the strategies of ``request`` on ``hw``.

    ``table`` is a ``passes.layer_table.LayerTable`` or its :class:`~cost_models.strategy.NumericTable`.
    Raises ``SearchError`` for pins no strategy can honour and :class:`NoFeasiblePlan` when
    nothing fits in memory.
    """
    t0 = time.perf_counter()
    solver = (solver or default_solver()).lower()
    if solver not in SOLVERS:
        raise SearchError(f"unknown solver {solver!r}: expected one of {', '.join(SOLVERS)}")
    gpn = request.gpus_per_node or hw.gpus_per_node
    if hw.gpus_per_node != gpn:
        hw = hw.with_gpus_per_node(gpn)
    nt = table if isinstance(table, NumericTable) else NumericTable(table)
    check_pins(request, nt, gpn)
    check_offload_pins(request, hw)
    sched, vs = getattr(request, "schedule", None), getattr(request, "virtual_stages", None)
    check_schedule_pins(request, len(nt.layers))
    inputs = resolve_inputs(nt.model.get("inputs"), request.inputs, request.spec)
    cands = [
        dataclasses.replace(c, compile=request.compile == "on")
        for c in enumerate_candidates(request, nt, gpn)
        if schedule_allows(c, len(nt.layers), sched, vs)
    ]
    if not cands:
        raise SearchError(
            f"--schedule {sched}" + (f" --virtual-stages {vs}" if vs else "") + ": no candidate "
            "can run it (it needs pp >= 2, at least pp micro-batches, for interleaved a multiple of "
            "pp and pp x v chunks within the layer table's rows); relax the pins or drop it."
        )
    if offload_pinned(request):
        cands = offload_variants(request, cands, hw)
        if not cands:
            raise SearchError(
                "no candidate can offload as pinned: offloading needs ZeRO 1-3 (parameters: ZeRO 3) "
                "and the pins leave none; drop --zero-stage 0 or the offload pin."
            )
    entries = candidate_entries(request, nt, hw, gpn, cands)
    res = search(entries, nt.kinds, request.checkpoint, solver)
    if not offload_pinned(request) and None in (request.offload_optimizer, request.offload_params):
        res, entries = search_offload(request, nt, hw, gpn, entries, res, solver)
    choice = None
    if res.best is not None:
        res, choice = choose_compile(request, nt, hw, gpn, entries, res, solver)
    if nt.tied and res.best is not None and res.best.strategy.candidate.pp > 1:
        res.notes.append(
            f"tied weights ({tied_summary(nt)}): each stage that reads one holds a "
            "copy; their gradients are all-reduced over those stages after backward"
        )
    if nt.model.get("tp_blocked") and request.gpus > 1:
        res.notes.append(f"planned without tensor parallelism: {nt.model['tp_blocked']}")
    if res.best is None:
        raise _no_feasible_plan(request, nt, hw, gpn, entries, solver)
    res = apply_schedules(res, _costs_for(request, nt, hw, gpn, entries, res), len(nt.layers), sched, vs)
    plan = build_plan(request, nt, hw, gpn, res, solver, time.perf_counter() - t0, inputs)
    return Solution(plan=plan, evaluation=res.best, search=res, compile=choice)


def _costs_for(req, nt: NumericTable, hw: HardwareProfile, gpn: int, entries, res: SearchResult) -> dict:
    """``CandidateCosts`` of every strategy ``res`` kept (from ``entries``, else priced again:
    the compiled search's candidates), and, on demand, of any other candidate the search
    enumerated, compiled or not (the schedule post-pass asks for a kept strategy's other ZeRO
    stages); a candidate it did not enumerate (one the pins rule out) is a ``KeyError``."""
    known = _Costs(
        {cc.cand: cc for _lb, _mlb, cc in entries},
        lambda c: candidate_costs(nt, hw, req.dtype, req.seq_len, c, gpn, hw.memory_bytes * req.memory_headroom),
    )
    for ev in res.ranked + res.extra:
        c = ev.strategy.candidate
        if c not in known:
            known[c] = known.price(c)
    return known


class _Costs(dict):
    """Candidate -> ``CandidateCosts``: the ones given, else priced when first asked for, for a
    candidate whose eager version is among them."""

    def __init__(self, known: dict, price):
        super().__init__(known)
        self.price = price
        self._enumerated = {dataclasses.replace(c, compile=False) for c in known}

    def __missing__(self, cand: Candidate) -> CandidateCosts:
        if dataclasses.replace(cand, compile=False) not in self._enumerated:
            raise KeyError(cand)
        cc = self[cand] = self.price(cand)
        return cc


def search_offload(
    req, nt: NumericTable, hw: HardwareProfile, gpn: int, entries, res: SearchResult, solver: str
) -> tuple[SearchResult, list]:
    """Continue the plain search ``res`` with the offloaded candidates that could beat it.

    Offload leaves a strategy's work unchanged and only adds time: exposed transfers (never
    negative) and an AdamW step on the host's cores, which on every built-in profile are slower at
    it than the device. What it gives is memory, and memory buys time only where the plain
    candidate could not run its fastest strategy: where nothing fits, or the fit forces recompute
    or rules out a larger micro-batch. Two sound filters keep this cheap:

    - an offloaded candidate is searched only when its own step-time lower bound
      (``time_lower_bound``: memory ignored, so it holds whatever the memory) is below the best
      plain plan, and its memory lower bound fits;
    - when the host's AdamW is no faster per rank than the device's, every layer cost of an
      offloaded candidate is at least its plain one's (same work, transfers added, a slower step),
      so its bound is at least the plain candidate's bound (the bound only grows with the layer
      costs): candidates whose plain bound already fails the first test are not even priced;
    - nor are those whose plain version provably runs its fastest strategy within memory
      (``memory_may_bind``: every partition fits without recompute), which no offloaded version
      can beat, by the same argument.

    When memory suffices, the plain winner is close to its bound and the extra work is a few cost
    tables and rarely an ILP. Returns the search result and the entries searched (the plain ones
    and the kept offloaded ones)."""
    best = res.best.step_time_s if res.best is not None else math.inf
    ranks = ranks_per_node(req.gpus, gpn)
    host_slower = (
        hw.cpu_adam_params_per_s is None
        or adam_rate_per_rank(hw, ranks, req.dtype) * optimizer_step_time(1, hw, req.dtype) <= 1.0 + 1e-12
    )
    base = [
        cc.cand
        for lb, _mlb, cc in entries
        if not host_slower or (lb < best * (1 + TIME_TOL) and memory_may_bind(cc, nt.kinds, req.checkpoint))
    ]
    variants = offload_variants(req, base, hw)
    if not variants:
        return res, entries
    kept = [
        e
        for e in candidate_entries(req, nt, hw, gpn, variants)
        if e[0] < best * (1 + TIME_TOL) and e[1] <= e[2].capacity
    ]
    if not kept:
        return res, entries
    return search(kept, nt.kinds, req.checkpoint, solver, seed=res), entries + kept


def _repriced(req, nt: NumericTable, hw: HardwareProfile, gpn: int, ev: Evaluation, compiled: bool) -> Evaluation:
    """``ev``'s strategy priced with its layers compiled (or not)."""
    c = dataclasses.replace(ev.strategy.candidate, compile=compiled)
    cc = candidate_costs(nt, hw, req.dtype, req.seq_len, c, gpn, hw.memory_bytes * req.memory_headroom)
    return evaluate(cc, ev.strategy.stages, sorted(ev.strategy.checkpoint), sorted(ev.strategy.selective))


def _saving_bound(eager: CandidateCosts, compiled: CandidateCosts) -> float:
    """The most any strategy of this candidate saves per step by compiling: ``m`` x the layers'
    per-micro-batch savings (work and recompute; nothing else changes). Sound: a step is
    ``(m - 1) T + sum_k T_k + D``, the slowest stage ``T`` shrinks by at most the sum of its
    layers' savings, ``sum_k T_k`` by exactly all of them, ``D`` not at all."""
    m = eager.cand.num_micro_batches
    return m * sum(max(0.0, (a.work_s + a.rec_s) - (b.work_s + b.rec_s)) for a, b in zip(eager.layers, compiled.layers))


def choose_compile(
    req, nt: NumericTable, hw: HardwareProfile, gpn: int, entries, res: SearchResult, solver: str
) -> tuple[SearchResult, CompileChoice]:
    """The search result to plan from and whether it compiles (see the module docstring).

    ``entries`` and ``res``: the candidates and search of the request's own mode (compiled when
    ``--compile on``, eager otherwise)."""
    steps, from_tokens = req.horizon_steps(), req.tokens is not None
    best = res.best
    if req.compile != "auto":
        other = _repriced(req, nt, hw, gpn, best, not best.strategy.candidate.compile)
        on, off = (best, other) if req.compile == "on" else (other, best)
        return res, CompileChoice(
            req.compile == "on",
            req.compile,
            off.step_time_s - on.step_time_s,
            on.extra["compile_s"],
            steps,
            from_tokens,
        )
    compiled = candidate_entries(req, nt, hw, gpn, [dataclasses.replace(cc.cand, compile=True) for _, _, cc in entries])
    bound = max(_saving_bound(a[2], b[2]) for a, b in zip(entries, compiled))
    if bound * steps <= compile_seconds(hw, 1):  # nothing compiled can pay: keep the eager answer
        on = _repriced(req, nt, hw, gpn, best, True)
        return res, CompileChoice(
            False, "auto", best.step_time_s - on.step_time_s, on.extra["compile_s"], steps, from_tokens
        )
    res_on = search(compiled, nt.kinds, req.checkpoint, solver)
    on = res_on.best  # not None: compiling changes no memory
    saving = best.step_time_s - on.step_time_s
    use = saving * steps > on.extra["compile_s"]
    return (res_on if use else res), CompileChoice(use, "auto", saving, on.extra["compile_s"], steps, from_tokens)


def build_plan(
    req,
    nt: NumericTable,
    hw: HardwareProfile,
    gpn: int,
    res: SearchResult,
    solver: str,
    seconds: float,
    inputs: list[dict] | None = None,
) -> Plan:
    """Assemble plan.json's dataclass from the search's winner and runners-up."""
    ev = res.best
    c = ev.strategy.candidate
    flops = nt.flops_per_sequence(req.seq_len) * req.global_batch
    sizes = {k: v for k, v in (req.sizes or {}).items() if isinstance(v, int) and not isinstance(v, bool) and v >= 1}
    model = ModelInfo(
        spec=req.spec,
        params=int(nt.model.get("params") or nt.total_params()),
        layers=len(nt.layers) - 2,
        flops_per_step=float(flops),
        sizes=sizes,
        layer_names=list(nt.names),
        inputs=list(inputs or []),
    )
    alts = [
        Alternative(
            dp=a.strategy.candidate.dp,
            tp=a.strategy.candidate.tp,
            pp=a.strategy.candidate.pp,
            zero_stage=a.strategy.candidate.zero_stage,
            micro_batch_size=a.strategy.candidate.micro_batch_size,
            step_time_s=float(a.step_time_s),
            reason=alternative_reason(ev, a),
            offload={
                "optimizer": a.strategy.candidate.offload_optimizer,
                "params": a.strategy.candidate.offload_params,
            },
            sequence_parallel=a.strategy.candidate.sequence_parallel,
        )
        for a in res.alternatives(3)
    ]
    plan = Plan(
        model=model,
        hardware=HardwareInfo(name=str(req.hardware), gpus=req.gpus, gpus_per_node=gpn),
        global_batch=req.global_batch,
        seq_len=req.seq_len,
        dtype=req.dtype,
        dp=c.dp,
        tp=c.tp,
        pp=c.pp,
        zero_stage=c.zero_stage,
        micro_batch_size=c.micro_batch_size,
        num_micro_batches=c.num_micro_batches,
        schedule=ev.strategy.schedule,
        virtual_stages=ev.strategy.virtual_stages,
        stages=[list(s) for s in ev.strategy.stages],
        checkpoint_layers=sorted(ev.strategy.checkpoint),
        selective_layers=sorted(ev.strategy.selective),
        sequence_parallel=c.sequence_parallel,
        compile=c.compile,
        offload={"optimizer": c.offload_optimizer, "params": c.offload_params},
        predicted=Predicted(**predicted_fields(ev, flops, req.gpus, hw.peak(req.dtype))),
        solver=SolverInfo(name=f"pulp-{solver}", seconds=float(seconds), status=res.status, candidates=res.enumerated),
        alternatives=alts,
    )
    return plan


def candidate_plans(req, table, hw: HardwareProfile, solution: Solution, k: int) -> list[Plan]:
    """One :class:`Plan` for each of the ``k`` best strategies ``solution``'s search kept: its own
    plan first, then its runners-up in the order ``plan`` lists them (the best of each other
    degree triple, then other ZeRO stages and micro-batch sizes). Fewer when the search kept fewer.

    ``req``, ``table`` and ``hw`` are what :func:`solve` was given. A runner-up's plan is the one
    :func:`build_plan` writes for it as the winner; its ``alternatives`` are the kept strategies
    predicted slower than it (``planner tune`` runs these plans and keeps the fastest measured).
    """
    gpn = req.gpus_per_node or hw.gpus_per_node
    if hw.gpus_per_node != gpn:
        hw = hw.with_gpus_per_node(gpn)
    nt = table if isinstance(table, NumericTable) else NumericTable(table)
    kept = [solution.search.best] + solution.search.alternatives(
        max(0, len(solution.search.ranked) + len(solution.search.extra))
    )
    solver = solution.plan.solver.name.removeprefix("pulp-")
    plans = [solution.plan]
    for i, ev in enumerate(kept[1:k], start=1):
        slower = sorted(
            (e for j, e in enumerate(kept) if j != i and e.step_time_s >= ev.step_time_s),
            key=lambda e: (e.step_time_s, e.memory["total"], e.strategy.candidate),
        )
        res = dataclasses.replace(solution.search, ranked=[ev] + slower, extra=[])
        plans.append(
            build_plan(req, nt, hw, gpn, res, solver, solution.plan.solver.seconds, solution.plan.model.inputs)
        )
    return plans[: max(k, 1)]


__all__ += ["candidate_plans"]
