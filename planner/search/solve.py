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
compile time. "Could pay" is checked before the second search from sound bounds: when no
compiled candidate's lower bound (its floor, else its priced ``time_lower_bound``) is below the
eager winner's step less the compile time of one layer class spread over the steps, the compiled
search cannot change the answer and is skipped (the tiny models of the tests, on the ``cpu``
profile, never compile). Unless the eager winner compiled already repays its compilation, the
compiled search prunes every strategy slower than that, which still finds the compiled winner
when it can pay; a whole one (for the runners-up) runs only when the compiled winner is kept.
When compiling looks likely to pay (the floors' gap, :func:`_compiling_likely`), the order turns
round (:func:`_compiled_first`): the compiled search runs whole and the eager one only as a probe
below the compiled winner plus its compile time per step, which prunes most eager candidates
unpriced; an eager strategy under that line sends the request down the eager-first path.

Every search prices lazily (:mod:`planner.search.entries`): a candidate's costs are worked out
when a search reaches it, in order of a floor from its rows' work alone.

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
import re
import time
from collections.abc import Iterator, Mapping
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
    draft_costs,
    evaluate,
    free_work_floor,
    memory_bound,
    predicted_fields,
    state_floor,
    work_floor,
)
from passes.mask_density import summarize
from planner.frontend.input_pins import resolve_inputs
from planner.frontend.spec import model_layer_names
from planner.plan import Alternative, HardwareInfo, ModelInfo, Plan, Predicted, SolverInfo
from planner.search.alternatives import alternative_reason
from planner.search.candidates import (
    check_offload_pins,
    check_pins,
    compression_variants,
    enumerate_candidates,
    memory_may_bind,
    offload_pinned,
    offload_variants,
    tied_summary,
)
from planner.search.compression_search import CompressionChoice, choose_compression, final_choice, with_runner_up
from planner.search.entries import Entry
from planner.search.expert_search import (
    ExpertSummary,
    expert_summary,
    listed_runners_up,
    model_moe,
    replicated_note,
    with_replicated_experts,
)
from planner.search.ilp import SOLVERS, TIME_TOL, SearchResult, default_solver, search, solve_candidate
from planner.search.request import PlanRequest
from planner.search.schedule_refit import make_refit, schedule_fix
from planner.search.schedule_search import apply_schedules, check_schedule_pins, schedule_allows, schedule_options
from planner.search.search_errors import NoFeasiblePlan, SearchError
from planner.units import format_seconds
from runtime.contract.choices import GradCompression
from runtime.contract.compressed_exchange import default_warmup

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


def _pricer(request, table: NumericTable, hw: HardwareProfile, gpus_per_node: int):
    """A function pricing one candidate of ``request`` (its ``CandidateCosts``)."""
    capacity = hw.memory_bytes * request.memory_headroom

    def price(candidate: Candidate) -> CandidateCosts:
        return candidate_costs(table, hw, request.dtype, request.seq_len, candidate, gpus_per_node, capacity)

    return price


def candidate_entries(
    request, table: NumericTable, hw: HardwareProfile, gpus_per_node: int, candidates: list[Candidate]
) -> list[Entry]:
    """The search entries of ``candidates``: each one's floor now, its costs when first read, and
    whether its model state alone overflows the device when first asked."""
    price = _pricer(request, table, hw, gpus_per_node)
    capacity = hw.memory_bytes * request.memory_headroom

    def too_big(candidate: Candidate) -> bool:
        return state_floor(table, hw, request.dtype, request.seq_len, candidate, gpus_per_node) > capacity

    return [
        Entry(
            candidate, work_floor(table, hw, request.dtype, request.seq_len, candidate, gpus_per_node), price, too_big
        )
        for candidate in candidates
    ]


def least_memory(entries, kinds: list[str], checkpoint: str = "auto", solver: str = "cbc") -> Evaluation | None:
    """The strategy with the least memory on its most loaded device, over all ``entries``.

    Visits candidates by increasing memory lower bound and stops once the bound reaches the best
    found, so the answer is exact.
    """
    best: Evaluation | None = None
    for entry in sorted(entries, key=lambda entry: (entry.memory_lb, entry.cand)):
        if best is not None and entry.memory_lb >= memory_bound(best):
            break
        evaluation = solve_candidate(
            entry.costs,
            kinds,
            checkpoint,
            solver,
            objective="memory",
            cutoff=None if best is None else memory_bound(best),
        ).evaluation
        if evaluation is not None and (
            best is None or (memory_bound(evaluation), evaluation.step_time_s) < (memory_bound(best), best.step_time_s)
        ):
            best = evaluation
    return best


def _no_feasible_plan(
    request, table: NumericTable, hw: HardwareProfile, gpus_per_node: int, entries, solver: str
) -> NoFeasiblePlan:
    usable = hw.memory_bytes * request.memory_headroom
    least = least_memory(entries, table.kinds, request.checkpoint, solver)
    head = (
        f"No strategy fits in {_gib(usable)} per device ({request.memory_headroom:.0%} of "
        f"{_gib(hw.memory_bytes)} on {hw.name})."
    )
    if least is None:  # pragma: no cover - every candidate has some partition
        return NoFeasiblePlan(head)
    memory, candidate = least.memory, least.strategy.candidate
    parts = {
        "parameters": memory["params"],
        "gradients": memory["grads"],
        "optimizer state": memory["optimizer"],
        "activations": memory["activations"],
    }
    dominant = max(parts, key=lambda part: parts[part])
    state = memory["params"] + memory["grads"] + memory["optimizer"]
    detail = ", ".join(f"{key} {_gib(value)}" for key, value in parts.items())
    msg = [
        head,
        f"The least any strategy needs is {_gib(memory_bound(least))} per device, peaking at "
        f"{_gib(memory['total'])} with every transient buffer at its likely moment ({candidate.describe()}, "
        f"{len(least.strategy.checkpoint)} of {len(table.layers)} layers recomputed; most loaded stage "
        f"{least.peak_stage}): {detail}; {dominant} dominate{'' if dominant.endswith('s') else 's'}.",
    ]
    fixes = [fix for fix in (_unpinned_fix(request, table, hw, gpus_per_node, solver, usable),) if fix]
    offload = _offload_fix(request, table, hw, gpus_per_node, solver) if state >= memory["activations"] else None
    if offload is not None:
        fixes.append(offload)
    elif (
        request.offload_optimizer is None and request.offload_params is None and not offload_missing(hw, "cpu", "none")
    ):
        msg.append(
            f"Offloading optimizer state and parameters to host memory or NVMe does not fit either "
            f"({_gib(hw.host_memory_bytes or 0)} of host memory per node of {gpus_per_node})."
        )
    if state >= memory["activations"]:
        # only a pin can have kept ZeRO 3 out: searched, it did not need less (a MoE whose
        # experts are replicated over ep = dp ranks has no expert state for it to shard)
        if request.zero_stage is not None and request.zero_stage < 3 and candidate.weight_dp > 1:
            fixes.append("--zero-stage 3 (shards parameters, gradients and optimizer state over data parallelism)")
        room = usable - memory["activations"]
        if room > 0 and offload is None:  # more devices only when offload cannot fit on these
            need = request.gpus * state / room
            need = int(math.ceil(need / gpus_per_node) * gpus_per_node)
            fixes.append(f"more devices (about {need}: model state per device shrinks as they grow)")
    else:
        if candidate.micro_batch_size > 1:
            fixes.append("--micro-batch 1")
        if request.checkpoint == "none":
            fixes.append("--checkpoint auto (recompute activations in backward)")
        fixes.append("a shorter --seq-len, or more devices for tensor/pipeline parallelism")
    fixes.append(f"a device with at least {_gib(memory['total'] / request.memory_headroom)} of memory")
    if request.memory_headroom < 1.0 and memory["total"] <= hw.memory_bytes:
        fixes.append(f"--memory-headroom {min(1.0, math.ceil(memory['total'] / hw.memory_bytes * 100) / 100):.2f}")
    moe_reason = (table.model.get("moe") or {}).get("reason")
    if moe_reason:  # the experts every rank holds whole are often what does not fit
        msg.append(f"No expert parallelism: {moe_reason}.")
    msg.append("To make it fit: " + "; or ".join(fixes) + ".")
    return NoFeasiblePlan(" ".join(msg), least)


def _unpinned_fix(
    request, table: NumericTable, hw: HardwareProfile, gpus_per_node: int, solver: str, usable: float
) -> str | None:
    """The fix "drop the pins" when the request pins degrees, ZeRO, micro-batch or no recompute
    and the unpinned search's least memory fits; else None."""
    pinned = {
        key: getattr(request, key)
        for key in ("dp", "tp", "pp", "zero_stage", "micro_batch")
        if getattr(request, key) is not None
    }
    if request.checkpoint == "none":
        pinned["checkpoint"] = "none"
    if not pinned:
        return None
    free = dataclasses.replace(request, dp=None, tp=None, pp=None, zero_stage=None, micro_batch=None, checkpoint="auto")
    free_entries = candidate_entries(free, table, hw, gpus_per_node, enumerate_candidates(free, table, gpus_per_node))
    alt = least_memory(free_entries, table.kinds, "auto", solver)
    flags = " ".join(f"--{key.replace('_', '-')} {value}" for key, value in pinned.items())
    if alt is not None and memory_bound(alt) <= usable:
        return f"drop the pins ({flags}): {alt.strategy.candidate.describe()} needs only {_gib(memory_bound(alt))}"
    return None


def _offload_fix(request, table: NumericTable, hw: HardwareProfile, gpus_per_node: int, solver: str) -> str | None:
    """The offload that would make the request fit on its devices (the pins that forbade it
    lifted), with its predicted speed; ``None`` when offload was searched already or fits nowhere."""
    if request.offload_optimizer is None and request.offload_params is None and request.zero_stage != 0:
        return None  # searched: nothing offloaded fits either
    free = dataclasses.replace(
        request,
        offload_optimizer=None,
        offload_params=None,
        zero_stage=None if request.zero_stage == 0 else request.zero_stage,
    )
    cands = offload_variants(free, enumerate_candidates(free, table, gpus_per_node), hw)
    if not cands:
        return None
    best = search(candidate_entries(free, table, hw, gpus_per_node, cands), table.kinds, free.checkpoint, solver).best
    if best is None:
        return None
    candidate = best.strategy.candidate
    flags = " ".join(
        f"--offload-{kind} {tier}"
        for kind, tier in (("optimizer", candidate.offload_optimizer), ("params", candidate.offload_params))
        if tier != "none"
    )
    if request.zero_stage == 0:
        flags += f" --zero-stage {candidate.zero_stage}"
    tokens = request.global_batch * request.seq_len / best.step_time_s
    where = " and ".join(
        f"{'optimizer state' if kind == 'optimizer' else 'parameters'} in {'host memory' if tier == 'cpu' else 'NVMe files'}"
        for kind, tier in (("optimizer", candidate.offload_optimizer), ("params", candidate.offload_params))
        if tier != "none"
    )
    here = f"these {request.gpus} devices" if request.gpus > 1 else "this device"
    return (
        f"offload ({flags}: {where}) fits on {here}, "
        f"{candidate.describe()}, predicted {format_seconds(best.step_time_s)} per step, {tokens:,.0f} tokens/s"
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
        seconds, why = format_seconds, "operator overhead and fused memory-bound ops"
        slower = "compiled layers would not be faster" + (
            f" ({seconds(-self.saving_s)} per step slower: few operators per compiled region, or graph breaks "
            "at tensor-parallel collectives)"
            if self.saving_s < 0
            else ""
        )
        if self.mode != "auto":
            tail = (
                f"compiled layers save {seconds(self.saving_s)} per step ({why}) for about {seconds(self.compile_s)} "
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
        compiling = f"{self.compile_s:.0f} s" if self.compile_s >= 10 else seconds(self.compile_s)
        head = (
            f"compiled layers {'save' if self.on else 'would save'} {seconds(self.saving_s)} per step ({why}): "
            f"about {compiling} of compilation, repaid {'' if self.on else 'only '}after "
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
    compression: CompressionChoice | None = None
    """Whether the data-parallel exchange is compressed (1-bit Adam), and why; None when the
    search did not weigh it (nothing compressed could win)."""
    experts: ExpertSummary | None = None
    """A mixture of experts' figures for the report (``planner.search.expert_search``); None when dense."""


def solve(request, table, hw: HardwareProfile, solver: str | None = None) -> Solution:
    """The planner's entry point: search the strategies of ``request`` on ``hw``.

    ``table`` is a ``passes.layer_table.LayerTable`` or its :class:`~cost_models.strategy.NumericTable`.
    Raises ``SearchError`` for pins no strategy can honour and :class:`NoFeasiblePlan` when
    nothing fits in memory.
    """
    started = time.perf_counter()
    solver = (solver or default_solver()).lower()
    if solver not in SOLVERS:
        raise SearchError(f"unknown solver {solver!r}: expected one of {', '.join(SOLVERS)}")
    gpus_per_node = request.gpus_per_node or hw.gpus_per_node
    if hw.gpus_per_node != gpus_per_node:
        hw = hw.with_gpus_per_node(gpus_per_node)
    table = table if isinstance(table, NumericTable) else NumericTable(table)
    check_pins(request, table, gpus_per_node)
    check_offload_pins(request, hw)
    sched, virtual_stages = getattr(request, "schedule", None), getattr(request, "virtual_stages", None)
    check_schedule_pins(request, len(table.layers))
    inputs = resolve_inputs(table.model.get("inputs"), request.inputs, request.spec)
    candidates = [
        candidate.compiled_as(True) if request.compile == "on" else candidate  # eager as enumerated
        for candidate in enumerate_candidates(request, table, gpus_per_node)
        if schedule_allows(candidate, len(table.layers), sched, virtual_stages)
    ]
    if not candidates:
        raise SearchError(
            f"--schedule {sched}"
            + (f" --virtual-stages {virtual_stages}" if virtual_stages else "")
            + ": no candidate "
            "can run it (it needs pp >= 2, at least pp micro-batches, for interleaved a multiple of "
            "pp and pp x v chunks within the layer table's rows); relax the pins or drop it."
        )
    candidates = _pinned_variants(request, candidates, hw)
    entries = candidate_entries(request, table, hw, gpus_per_node, candidates)
    first = _compiled_first(request, table, hw, gpus_per_node, entries, solver) if request.compile == "auto" else None
    if first is not None:
        result, choice, entries = first
    else:
        result = search(entries, table.kinds, request.checkpoint, solver)
        if _searches_offload(request):
            result, entries = search_offload(request, table, hw, gpus_per_node, entries, result, solver)
        choice = None
        if result.best is not None:
            result, choice, entries = choose_compile(request, table, hw, gpus_per_node, entries, result, solver)
    compiled = choice is not None and choice.on
    result, entries, compression = choose_compression(
        request,
        lambda variants: candidate_entries(
            request, table, hw, gpus_per_node, [v.compiled_as(compiled) for v in variants]
        ),
        table.kinds,
        entries,
        result,
        solver,
    )
    result.notes.extend(_model_notes(request, table, result))
    if result.best is None:
        raise _no_feasible_plan(request, table, hw, gpus_per_node, entries, solver)
    result = _with_experts_replicated(request, table, hw, gpus_per_node, entries, result, solver)
    result = _scheduled(request, table, _costs_for(request, table, hw, gpus_per_node, entries, result), result, solver)
    compression = final_choice(request, compression, result)
    result = with_runner_up(result)
    plan = build_plan(request, table, hw, gpus_per_node, result, solver, time.perf_counter() - started, inputs)
    experts = expert_summary(request, table, hw, gpus_per_node, result.winner())
    return Solution(
        plan=plan,
        evaluation=result.winner(),
        search=result,
        compile=choice,
        compression=compression,
        experts=experts,
    )


def _with_experts_replicated(
    request, table: NumericTable, hw: HardwareProfile, gpus_per_node: int, entries, result: SearchResult, solver: str
) -> SearchResult:
    """``result`` with the best ep-1 strategy among the runners-up when the winner shards its
    experts, and the note of a model whose experts stay replicated (``planner.search.expert_search``)."""
    result = with_replicated_experts(
        result,
        [entry.cand for entry in entries],
        lambda plain: candidate_entries(request, table, hw, gpus_per_node, plain),
        table.kinds,
        request.checkpoint,
        solver,
    )
    note = replicated_note(table.model)
    if note:
        result.notes.append(note)
    return result


def _scheduled(request, table: NumericTable, cc_of: Mapping, result: SearchResult, solver: str) -> SearchResult:
    """``result`` with each kept strategy under its best schedule, recompute re-chosen for the
    schedule's memory (:mod:`planner.search.schedule_refit`); a refused ``--schedule`` pin's
    ``SearchError`` says which recompute or ZeRO setting makes it fit, when one does."""
    sched, virtual_stages = getattr(request, "schedule", None), getattr(request, "virtual_stages", None)
    rows = len(table.layers)
    try:
        return apply_schedules(
            result,
            cc_of,
            rows,
            sched,
            virtual_stages,
            refit=make_refit(table.kinds, request.checkpoint, solver, result.answers),
        )
    except SearchError as refused:
        fix = schedule_fix(
            result.ranked + result.extra,
            cc_of,
            lambda evaluation: schedule_options(evaluation.strategy.candidate, rows, sched, virtual_stages),
            table.kinds,
            request.checkpoint,
            solver,
        )
        if not fix:
            raise
        raise SearchError(f"{refused} {fix}") from None


def _model_notes(request, table: NumericTable, result: SearchResult) -> list[str]:
    """What the model's structure does to the winner: tied weights held per stage, tensor
    parallelism that splits nothing, or keeps part of each block whole."""
    notes = []
    best = result.best.strategy.candidate if result.best is not None else None
    if table.tied and best is not None and best.pp > 1:
        notes.append(
            f"tied weights ({tied_summary(table)}): each stage that reads one holds a "
            "copy; their gradients are all-reduced over those stages after backward"
        )
    if table.model.get("tp_blocked") and request.gpus > 1:
        notes.append(f"planned without tensor parallelism: {table.model['tp_blocked']}")
    replicated = table.model.get("tp_replicated")
    if replicated and best is not None and best.tp > 1:
        whole = _whole_share(table, request.seq_len)
        if whole >= NOTED_WHOLE_SHARE:
            routed = bool((table.model.get("moe") or {}).get("experts"))
            notes.append(_replicated_note(replicated, table.model.get("spec", ""), whole, routed))
    return notes


#: Share of a block's weights tensor parallelism keeps whole from which a plan under tp says so
#: (a single key/value head's projections, a few percent, are the design: not worth a note).
NOTED_WHOLE_SHARE = 0.05


def _whole_share(table: NumericTable, seq_len: int) -> float:
    """The largest share of a block's weights that tensor parallelism keeps whole on every rank,
    its routed experts aside (expert parallelism, not tp, splits those: counted in, DeepSeek-V3's
    blocks read as 98% whole under tp)."""
    rows, row_of_layer = table.layer_rows(1, seq_len)
    shares = []
    for row, kind in zip(row_of_layer, table.kinds):
        params, experts = rows[row].param_count, rows[row].experts.param_count
        whole = params.whole - experts.whole
        if kind == "block" and whole > 0:
            shares.append(1 - (params.tp_part - experts.tp_part) / whole)
    return max(shares, default=0.0)


def _replicated_note(replicated: dict[str, str], spec: str, whole: float, routed: bool = False) -> str:
    """The modules tensor parallelism keeps whole (``model.tp_replicated``), named as the model
    names them, and why the first did (its source file without the directories); ``routed``: the
    share leaves the routed experts out."""
    names = model_layer_names(spec, list(replicated))
    why = re.sub(r"/\S*/", "", next(iter(replicated.values())))
    why = re.sub(r"'([^']+)'", lambda quoted: "'" + model_layer_names(spec, [quoted[1]])[0] + "'", why)
    listed = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (
        f"tensor parallelism keeps {whole:.0%} of a block's weights"
        + (" (its routed experts aside, which expert parallelism splits)" if routed else "")
        + f" whole on every rank, {listed} "
        f"(the first because {why}): they run unsplit on each rank"
    )


def _pinned_variants(request, candidates: list[Candidate], hw: HardwareProfile) -> list[Candidate]:
    """The candidates an offload or compression pin leaves (``SearchError`` when none)."""
    if offload_pinned(request):
        candidates = offload_variants(request, candidates, hw)
        if not candidates:
            raise SearchError(
                "no candidate can offload as pinned: offloading needs ZeRO 1-3 (parameters: ZeRO 3) "
                "and the pins leave none; drop --zero-stage 0 or the offload pin."
            )
    if request.dp_compression == GradCompression.ONEBIT_ADAM:
        candidates = compression_variants(candidates)
        if not candidates:
            raise SearchError(
                "--dp-compression onebit-adam: no candidate has more than one data-parallel rank "
                "(the global batch and the pins leave dp = 1); drop --dp-compression or the pins "
                "that force dp = 1."
            )
    return candidates


def _costs_for(
    request, table: NumericTable, hw: HardwareProfile, gpus_per_node: int, entries, result: SearchResult
) -> "_Costs":
    """``CandidateCosts`` of every strategy ``res`` kept (from ``entries``, else priced again:
    the compiled search's candidates), and, on demand, of any other candidate the search
    enumerated, compiled or not (the schedule post-pass asks for a kept strategy's other ZeRO
    stages); a candidate it did not enumerate (one the pins rule out) is a ``KeyError``."""
    known = _Costs(entries, _pricer(request, table, hw, gpus_per_node), _Unpriced(request, table, hw, gpus_per_node))
    for evaluation in result.ranked + result.extra:
        known.add(evaluation.strategy.candidate)
    return known


class _Unpriced:
    """What a request's candidates cost before they are priced: a step no schedule beats from the
    rows' work alone (``free_work_floor``), then the candidate's costs without its data-parallel
    traffic (``draft_costs``), on which any lower bound bounds the priced candidate."""

    def __init__(self, request, table: NumericTable, hw: HardwareProfile, gpus_per_node: int):
        self.request, self.table, self.hw, self.gpus_per_node = request, table, hw, gpus_per_node

    def free_floor(self, candidate: Candidate) -> float:
        request = self.request
        return free_work_floor(self.table, self.hw, request.dtype, request.seq_len, candidate, self.gpus_per_node)

    def draft(self, candidate: Candidate) -> CandidateCosts:
        request, hw = self.request, self.hw
        capacity = hw.memory_bytes * request.memory_headroom
        return draft_costs(self.table, hw, request.dtype, request.seq_len, candidate, self.gpus_per_node, capacity)


class _Costs(Mapping):
    """Candidate -> ``CandidateCosts`` of the entries' candidates (priced when first read), and of
    their compiled or eager versions (priced when first asked for); another is a ``KeyError``
    unless :meth:`add` made it known."""

    def __init__(self, entries: list[Entry], price, unpriced: "_Unpriced"):
        self.entries = {entry.cand: entry for entry in entries}
        self.unpriced = unpriced
        """What is known of a candidate before pricing it (the schedule walk's first bounds)."""
        self.others: dict[Candidate, CandidateCosts] = {}
        self.price = price

    def add(self, candidate: Candidate) -> None:
        """Make ``candidate`` known, whether the search enumerated it or not."""
        if candidate not in self:
            self.others[candidate] = self.price(candidate)

    def __getitem__(self, candidate: Candidate) -> CandidateCosts:
        entry = self.entries.get(candidate)
        if entry is not None:
            return entry.costs
        if candidate not in self.others:
            if candidate.compiled_as(not candidate.compile) not in self.entries:
                raise KeyError(candidate)  # neither it nor its other compile mode was enumerated
            self.others[candidate] = self.price(candidate)
        return self.others[candidate]

    def priced(self, candidate: Candidate) -> bool:
        """Whether ``candidate``'s costs are known already (reading them costs nothing)."""
        entry = self.entries.get(candidate)
        return entry.priced if entry is not None else candidate in self.others

    def too_big(self, candidate: Candidate) -> bool:
        """Whether ``candidate``'s entry knows, unpriced, that none of its strategies fits."""
        entry = self.entries.get(candidate)
        return entry is not None and entry.too_big

    def __contains__(self, candidate: object) -> bool:
        return candidate in self.entries or candidate in self.others

    def __iter__(self) -> Iterator[Candidate]:
        yield from self.entries
        yield from list(self.others)  # never an entry's candidate: add() and __getitem__ check

    def __len__(self) -> int:
        return len(self.entries) + len(self.others)


def _searches_offload(request) -> bool:
    """Whether offloaded candidates are searched after the plain ones (:func:`search_offload`)."""
    return not offload_pinned(request) and None in (request.offload_optimizer, request.offload_params)


def search_offload(
    request,
    table: NumericTable,
    hw: HardwareProfile,
    gpus_per_node: int,
    entries,
    result: SearchResult,
    solver: str,
    below: float = math.inf,
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
    and the kept offloaded ones). ``below``: a probe's limit (``search``), when ``result`` is one."""
    best = min(result.best.step_time_s if result.best is not None else math.inf, below)
    ranks = ranks_per_node(request.gpus, gpus_per_node)
    host_slower = (
        hw.cpu_adam_params_per_s is None
        or adam_rate_per_rank(hw, ranks, request.dtype) * optimizer_step_time(1, hw, request.dtype) <= 1.0 + 1e-12
    )
    limit = best * (1 + TIME_TOL)
    base = [
        entry.cand
        for entry in entries
        if not host_slower
        or (
            entry.floor < limit
            # a candidate whose state overflows the device needs offload: its variants are
            # priced and bounded on their own (``kept``), so it is not priced here
            and (
                entry.too_big
                or (entry.time_lb < limit and memory_may_bind(entry.costs, table.kinds, request.checkpoint))
            )
        )
    ]
    variants = offload_variants(request, base, hw)
    if not variants:
        return result, entries
    kept = [
        entry
        for entry in candidate_entries(request, table, hw, gpus_per_node, variants)
        if entry.floor < limit
        and not entry.too_big
        and entry.time_lb < limit
        and entry.memory_lb <= entry.costs.capacity
    ]
    if not kept:
        return result, entries
    return search(kept, table.kinds, request.checkpoint, solver, seed=result, below=below), entries + kept


def _repriced(
    request, table: NumericTable, hw: HardwareProfile, gpus_per_node: int, evaluation: Evaluation, compiled: bool
) -> Evaluation:
    """``ev``'s strategy priced with its layers compiled (or not)."""
    candidate = evaluation.strategy.candidate.compiled_as(compiled)
    costs = candidate_costs(
        table, hw, request.dtype, request.seq_len, candidate, gpus_per_node, hw.memory_bytes * request.memory_headroom
    )
    return evaluate(
        costs, evaluation.strategy.stages, sorted(evaluation.strategy.checkpoint), sorted(evaluation.strategy.selective)
    )


def choose_compile(
    request, table: NumericTable, hw: HardwareProfile, gpus_per_node: int, entries, result: SearchResult, solver: str
) -> tuple[SearchResult, CompileChoice, list[Entry]]:
    """The search result to plan from, whether it compiles (see the module docstring) and the
    candidates of its mode (what the later passes walk: the schedule walk visits the result's
    siblings among them, so a compiled result needs the compiled candidates).

    ``entries`` and ``res``: the candidates and search of the request's own mode (compiled when
    ``--compile on``, eager otherwise)."""
    steps, from_tokens = request.horizon_steps(), request.tokens is not None
    best = result.winner()
    if request.compile != "auto":
        other = _repriced(request, table, hw, gpus_per_node, best, not best.strategy.candidate.compile)
        compiled_eval, eager_eval = (best, other) if request.compile == "on" else (other, best)
        return (
            result,
            CompileChoice(
                request.compile == "on",
                request.compile,
                eager_eval.step_time_s - compiled_eval.step_time_s,
                compiled_eval.extra["compile_s"],
                steps,
                from_tokens,
            ),
            entries,
        )
    repriced = _repriced(request, table, hw, gpus_per_node, best, True)
    compiled = candidate_entries(request, table, hw, gpus_per_node, [entry.cand.compiled_as(True) for entry in entries])
    pays = best.step_time_s - compile_seconds(hw, 1) / steps
    whole: SearchResult | None = None
    if (best.step_time_s - repriced.step_time_s) * steps > repriced.extra["compile_s"]:
        # the winner compiled pays already; the eager search's strategies, compiled, start it off
        whole = search(compiled, table.kinds, request.checkpoint, solver, incumbents=_compiled_twins(result, compiled))
        found = whole
    elif _compiling_may_pay(compiled, pays):
        # only compiled strategies faster than `pays` could repay their compilation: a search that
        # prunes the others finds the compiled winner if it is one of them
        found = search(compiled, table.kinds, request.checkpoint, solver, below=pays * (1 - TIME_TOL))
    else:
        found = SearchResult(ranked=[])
    if found.best is None:
        choice = CompileChoice(
            False, "auto", best.step_time_s - repriced.step_time_s, repriced.extra["compile_s"], steps, from_tokens
        )
        return result, choice, entries
    compiled_eval = found.winner()
    saving = best.step_time_s - compiled_eval.step_time_s
    use = saving * steps > compiled_eval.extra["compile_s"]
    if use and whole is None:  # the plan's runners-up come from a whole search (the probe pruned them)
        whole = search(compiled, table.kinds, request.checkpoint, solver)
    choice = CompileChoice(use, "auto", saving, compiled_eval.extra["compile_s"], steps, from_tokens)
    return (whole, choice, compiled) if use and whole is not None else (result, choice, entries)


def _compiled_first(
    request, table: NumericTable, hw: HardwareProfile, gpus_per_node: int, entries: list[Entry], solver: str
) -> tuple[SearchResult, CompileChoice, list[Entry]] | None:
    """:func:`choose_compile`'s answer found the other way round, when compiling looks likely to pay
    (:func:`_compiling_likely`): the compiled candidates are searched (offloaded ones too), then the
    eager ones only as a probe below the compiled winner's step plus its compilation spread over
    the run. An eager strategy that fast could still win: None, and the caller searches eager first
    (the probe's prices are kept in ``entries``). Otherwise the compiled search is the answer,
    found with one whole search in place of two: the probe prunes most eager candidates unpriced.
    The saving reported is the compiled winner's over its own strategy run eager (the eager winner,
    slower still, is known only when the probe found it)."""
    steps = request.horizon_steps()
    compiled = candidate_entries(request, table, hw, gpus_per_node, [entry.cand.compiled_as(True) for entry in entries])
    if not _compiling_likely(entries, compiled, steps, compile_seconds(hw, len(set(table.kinds)))):
        return None
    result = search(compiled, table.kinds, request.checkpoint, solver)
    if _searches_offload(request):
        result, compiled = search_offload(request, table, hw, gpus_per_node, compiled, result, solver)
    if result.best is None:
        return None
    winner = result.winner()
    limit = winner.step_time_s + winner.extra["compile_s"] / steps
    probe = search(entries, table.kinds, request.checkpoint, solver, below=limit * (1 + TIME_TOL))
    if _searches_offload(request):
        probe, _ = search_offload(
            request, table, hw, gpus_per_node, entries, probe, solver, below=limit * (1 + TIME_TOL)
        )
    if probe.best is not None and probe.best.step_time_s <= limit:  # compiling may not repay itself
        return None
    eager = probe.winner() if probe.best is not None else _repriced(request, table, hw, gpus_per_node, winner, False)
    saving = eager.step_time_s - winner.step_time_s
    return (
        result,
        CompileChoice(True, "auto", saving, winner.extra["compile_s"], steps, request.tokens is not None),
        compiled,
    )


def _compiling_likely(eager: list[Entry], compiled: list[Entry], steps: int, compile_s: float) -> bool:
    """Whether compiling looks likely to repay itself: the least compiled floor (work alone) saves,
    over the run's ``steps``, more than 1.5 times ``compile_s`` (the compile time of every layer
    kind) on the least eager one. Only a guess, which orders the two searches, never their answer."""
    if not eager:
        return False
    gap = min(entry.floor for entry in eager) - min(entry.floor for entry in compiled)
    return gap * steps > 1.5 * compile_s


def _compiled_twins(result: SearchResult, compiled: list[Entry]) -> list[Evaluation]:
    """The strategies ``result`` ranked, each priced on its candidate's compiled entry."""
    entries = {entry.cand: entry for entry in compiled}
    twins = []
    for evaluation in result.ranked + result.extra:
        strategy = evaluation.strategy
        entry = entries.get(strategy.candidate.compiled_as(True))
        if entry is not None:
            twins.append(
                evaluate(entry.costs, strategy.stages, sorted(strategy.checkpoint), sorted(strategy.selective))
            )
    return twins


def _compiling_may_pay(compiled: list[Entry], pays: float) -> bool:
    """Whether some compiled candidate may step faster than ``pays`` (the eager winner's step less
    one layer class's compile time spread over the horizon): only then can compiling repay itself.
    A candidate is priced only when its floor does not already rule it out."""
    limit = pays * (1 - TIME_TOL)
    return any(
        entry.time_lb < limit for entry in sorted(compiled, key=lambda entry: entry.floor) if entry.floor < limit
    )


def _attention(model: dict, seq_len: int, sequences: int) -> dict:
    """plan.json's ``model.attention`` (``passes.mask_density.summarize``); ``{}`` without attention."""
    facts = model.get("attention")
    if not facts:
        return {}
    return summarize(facts, seq_len, int(model.get("heads") or 0), int(model.get("head_dim") or 0), sequences)


def context_entry(candidate) -> dict:
    """plan.json's ``context_parallel`` of a candidate."""
    return {"degree": candidate.context_parallel, "method": candidate.cp_method}


def _alternative_entries(result: SearchResult, evaluation: Evaluation) -> list[Alternative]:
    """plan.json's ``alternatives``: each listed runner-up (``listed_runners_up``) and why it lost."""
    return [
        Alternative(
            dp=alt.strategy.candidate.dp,
            tp=alt.strategy.candidate.tp,
            pp=alt.strategy.candidate.pp,
            zero_stage=alt.strategy.candidate.zero_stage,
            micro_batch_size=alt.strategy.candidate.micro_batch_size,
            step_time_s=float(alt.step_time_s),
            reason=alternative_reason(evaluation, alt),
            offload={
                "optimizer": alt.strategy.candidate.offload_optimizer,
                "params": alt.strategy.candidate.offload_params,
            },
            sequence_parallel=alt.strategy.candidate.sequence_parallel,
            dp_compression=alt.strategy.candidate.dp_compression,
            schedule=alt.strategy.schedule,
            virtual_stages=alt.strategy.virtual_stages,
            expert_parallel=alt.strategy.candidate.expert_parallel,
            context_parallel=context_entry(alt.strategy.candidate),
        )
        for alt in listed_runners_up(result, evaluation)
    ]


def build_plan(
    request,
    table: NumericTable,
    hw: HardwareProfile,
    gpus_per_node: int,
    result: SearchResult,
    solver: str,
    seconds: float,
    inputs: list[dict] | None = None,
) -> Plan:
    """Assemble plan.json's dataclass from the search's winner and runners-up."""
    evaluation = result.winner()
    candidate = evaluation.strategy.candidate
    flops = table.flops_per_sequence(request.seq_len) * request.global_batch
    sizes = {
        key: value
        for key, value in (request.sizes or {}).items()
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1
    }
    model = ModelInfo(
        spec=request.spec,
        params=int(table.model.get("params") or table.total_params()),
        layers=len(table.layers) - 2,
        flops_per_step=float(flops),
        sizes=sizes,
        layer_names=model_layer_names(request.spec, list(table.names)),
        inputs=list(inputs or []),
        attention=_attention(table.model, request.seq_len, request.global_batch),
        moe=model_moe(table.model, getattr(request, "moe_capacity_factor", None)),
    )
    alts = _alternative_entries(result, evaluation)
    plan = Plan(
        model=model,
        hardware=HardwareInfo(name=str(request.hardware), gpus=request.gpus, gpus_per_node=gpus_per_node),
        global_batch=request.global_batch,
        seq_len=request.seq_len,
        dtype=request.dtype,
        dp=candidate.dp,
        tp=candidate.tp,
        pp=candidate.pp,
        zero_stage=candidate.zero_stage,
        micro_batch_size=candidate.micro_batch_size,
        num_micro_batches=candidate.num_micro_batches,
        schedule=evaluation.strategy.schedule,
        virtual_stages=evaluation.strategy.virtual_stages,
        stages=[list(stage) for stage in evaluation.strategy.stages],
        checkpoint_layers=sorted(evaluation.strategy.checkpoint),
        selective_layers=sorted(evaluation.strategy.selective),
        sequence_parallel=candidate.sequence_parallel,
        compile=candidate.compile,
        offload={"optimizer": candidate.offload_optimizer, "params": candidate.offload_params},
        dp_compression=candidate.dp_compression,
        expert_parallel=candidate.expert_parallel,
        context_parallel=context_entry(candidate),
        overlap=candidate.overlap.to_json(),
        compression_warmup=default_warmup(request.horizon_steps()) if candidate.compressed else 0,
        predicted=Predicted(**predicted_fields(evaluation, flops, request.gpus, hw.peak(request.dtype))),
        solver=SolverInfo(
            name=f"pulp-{solver}", seconds=float(seconds), status=result.status, candidates=result.enumerated
        ),
        alternatives=alts,
        request=_request_record(request, gpus_per_node),
    )
    return plan


def _request_record(request, gpus_per_node: int) -> dict | None:
    """plan.json's ``request``: the request with the devices per node it was planned with (None
    for a caller's stand-in that is not a ``PlanRequest``)."""
    if not isinstance(request, PlanRequest):
        return None
    return {**request.to_record(), "gpus_per_node": gpus_per_node}


def candidate_plans(request, table, hw: HardwareProfile, solution: Solution, k: int) -> list[Plan]:
    """One :class:`Plan` for each of the ``k`` best strategies ``solution``'s search kept: its own
    plan first, then its runners-up in the order ``plan`` lists them (the best of each other
    degree triple, then other ZeRO stages and micro-batch sizes). Fewer when the search kept fewer.

    ``req``, ``table`` and ``hw`` are what :func:`solve` was given. A runner-up's plan is the one
    :func:`build_plan` writes for it as the winner; its ``alternatives`` are the kept strategies
    predicted slower than it (``planner tune`` runs these plans and keeps the fastest measured).
    """
    gpus_per_node = request.gpus_per_node or hw.gpus_per_node
    if hw.gpus_per_node != gpus_per_node:
        hw = hw.with_gpus_per_node(gpus_per_node)
    table = table if isinstance(table, NumericTable) else NumericTable(table)
    kept = [solution.search.winner()] + solution.search.alternatives(
        max(0, len(solution.search.ranked) + len(solution.search.extra))
    )
    solver = solution.plan.solver.name.removeprefix("pulp-")
    plans = [solution.plan]
    for i, evaluation in enumerate(kept[1:k], start=1):
        slower = sorted(
            (other for index, other in enumerate(kept) if index != i and other.step_time_s >= evaluation.step_time_s),
            key=lambda other: (other.step_time_s, other.memory["total"], other.strategy.candidate),
        )
        result = dataclasses.replace(solution.search, ranked=[evaluation] + slower, extra=[])
        plans.append(
            build_plan(
                request,
                table,
                hw,
                gpus_per_node,
                result,
                solver,
                solution.plan.solver.seconds,
                solution.plan.model.inputs,
            )
        )
    return plans[: max(k, 1)]


__all__ += ["candidate_plans"]
