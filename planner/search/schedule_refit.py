"""A schedule's own recompute: the partition/recompute ILP solved for its in-flight activations.

The search (:mod:`planner.search.ilp`) chooses each candidate's stages and recomputed layers for
1F1B, whose stage ``k`` holds ``min(p - k, m)`` micro-batches of activations. The other schedules
hold more: interleaved rank ``r`` holds ``(2 (p - r - 1) + (v - 1) p + 1) / v`` (rank 0: ``1 +
(p - 1) / (p v)`` times 1F1B's ``p``; ``cost_models.schedule_cost.interleaved_inflight``), zero
bubble ``min(p, m)`` on every rank plus, while a ``W`` is pending, the output gradients its weight
products read (``LayerCost.wgrad_keep_b``). Priced on 1F1B's recompute set such a schedule often
does not fit, although more recompute (full or selective) would make it fit and still win: a deep
pipeline's bubble can cost more than recomputing every block.

:func:`refit` solves the same ILP (same constraint families, same objective) on a copy of the
candidate's costs whose in-flight counts are the schedule's (:func:`schedule_inflight`: what the
runtime's own action lists hold, ``runtime.contract.schedule_ir``), with zero bubble's kept
gradients added to each layer's resident bytes (at most one micro-batch of them is pending on a
rank, so the bound is safe), and prices the answer under the schedule with the simulator
(``planner.search.schedule_search``), which is what the plan reports:

- zero bubble runs the ILP's stages as they are;
- interleaved cuts the layer table into ``p v`` chunks anew (``split_chunks``), so rank ``r``
  holds other blocks than the ILP's stage ``r``: each rank recomputes the share of its blocks
  that stage ``r`` recomputes (full, then selective; rounded up), starting with its first chunks,
  which the schedule holds longest. Embedding and head rows keep the ILP's choice (they stay on
  ranks 0 and ``p - 1`` under both layouts).

The ILP's memory rows count activations per stage, the simulator per chunk in the order the
schedule runs them, so the answer can still overshoot by a little: the ILP is then solved again
with the capacity lowered by the overshoot (:data:`REFIT_TRIES` times at most). ``None`` when no
recompute makes the schedule fit the candidate.

The ILP's objective stays 1F1B's closed form (a proxy: the schedule changes the bubble, not which
layers are worth recomputing per byte), so the answer is the cheapest recompute that fits, not
proved the fastest under the schedule. Under ``--checkpoint auto`` the 1F1B ILP's answers with
every block recomputed selectively and fully are priced beside it (the ILP's rows only
approximate the schedule's memory, zero bubble's most), and the fastest that fits is kept; the
caller keeps whichever of this and the 1F1B set's pricing is faster.

A refused ``--schedule`` pin (:func:`schedule_fix`) is answered the same way: the kept strategies
under the other ``--checkpoint`` modes and at higher ZeRO stages, the settings that fit named with
their predicted step.
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import math
from typing import Callable, Collection, Sequence

from cost_models.schedule_cost import ChunkTimes, chunk_times, split_chunks
from cost_models.strategy import CandidateCosts, Evaluation, evaluate
from planner.search.candidates import head_rows, memory_lower_bound
from planner.search.ilp import solve_candidate
from planner.search.objective import block_capacity
from planner.search.schedule_search import Refit, _simulated, pipeline_memory, step_bound
from runtime.contract.choices import ScheduleName

__all__ = [
    "REFIT_TRIES",
    "REFIT_BUDGET",
    "SOLVE_BUDGET",
    "REFIT_TIME_LIMIT_S",
    "schedule_inflight",
    "schedule_costs",
    "refit",
    "make_refit",
    "schedule_fix",
    "FIX_MODES",
    "UNIFORM_MODES",
    "uniform_answer",
]

#: ILP solves per (strategy, schedule) at most: the first, and each retry with a lower capacity.
REFIT_TRIES = 3
#: Refits one search may run (:class:`_Refitter` counts them; the post-pass asks in increasing order
#: of the schedule's lower bound, so the most promising come first): on a 175B model over 1,024
#: GPUs the unbounded walk refitted 13 strategies, which doubled the post-pass's time; the 8 first
#: found the same plan.
REFIT_BUDGET = 8
#: New 1F1B strategies one post-pass may solve for candidates the search did not keep but another
#: micro-batch size of (:class:`_Refitter` counts them; the walk asks in increasing order of their
#: bound, so the most promising come first): on a 175B model over 1,024 GPUs about 60 have a
#: bound under the best step, at 0.05-2 s each; on the tests' small models far fewer.
SOLVE_BUDGET = 8
#: Seconds one refit ILP may take (the search's own ILPs get 60): its answer is priced again under
#: the schedule, so a time-limited one is still a correct price, if maybe not the best recompute.
REFIT_TIME_LIMIT_S = 10.0


def schedule_inflight(costs: CandidateCosts, name: str, virtual_stages: int) -> list[float]:
    """Per rank, the micro-batches of the rank's activations schedule ``name`` holds at a
    backward's start (equal chunks; what the runtime's action lists say)."""
    stages, micro_batches = costs.cand.pp, costs.cand.num_micro_batches
    zeros = tuple(0.0 for _ in range(stages * virtual_stages))
    times = ChunkTimes(zeros, zeros, zeros if name == ScheduleName.ZERO_BUBBLE else None, 0.0)
    return list(pipeline_memory(name, stages, micro_batches, virtual_stages, times).held)


def schedule_costs(costs: CandidateCosts, name: str, virtual_stages: int, capacity: float) -> CandidateCosts:
    """A copy of ``costs`` whose ILP memory rows are schedule ``name``'s: its in-flight counts and,
    under zero bubble, the kept output gradients as resident bytes; the capacity ``capacity``."""
    out = copy.copy(costs)
    out.inflight = schedule_inflight(costs, name, virtual_stages)
    out.capacity = capacity
    if name == ScheduleName.ZERO_BUBBLE:  # one micro-batch between B and W: re-made activations, kept gradients
        grown = {
            layer: dataclasses.replace(
                layer, grads_b=layer.grads_b + math.ceil(layer.wgrad_keep_b + max(layer.saved_b - layer.input_b, 0.0))
            )
            for layer in costs.layers
        }
        out.layers = [grown[layer] for layer in costs.layers]
        out.distinct = [(grown[layer], count) for layer, count in costs.distinct]
    return out


def _spread(
    kinds: Sequence[str],
    stages: Sequence[tuple[int, int]],
    chosen: tuple[set[int], set[int]],
    chunks: Sequence[tuple[int, int]],
    selectable: Collection[int],
) -> tuple[set[int], set[int]]:
    """The ILP's recompute (``chosen``: full, selective) on the interleaved ``chunks``: each rank
    recomputes the share of its blocks that the ILP's stage of the same index does. Selective
    recompute goes only to ``selectable`` blocks (those with an attention core: a hybrid's linear
    attention or Mamba blocks have none), the first of the rank's others after the whole ones."""
    full, sel = chosen
    blocks = [i for i, kind in enumerate(kinds) if kind == "block"]
    out_full = {i for i in full if kinds[i] != "block"}
    out_sel = {i for i in sel if kinds[i] != "block"}
    pp = len(stages)
    for rank, (first, last) in enumerate(stages):
        held = [i for i in blocks if first <= i <= last]
        mine = [
            i
            for c in range(rank, len(chunks), pp)
            for i in range(chunks[c][0], chunks[c][1] + 1)
            if kinds[i] == "block"
        ]
        if not held or not mine:
            continue
        n_full = math.ceil(sum(i in full for i in held) * len(mine) / len(held))
        n_sel = min(math.ceil(sum(i in sel for i in held) * len(mine) / len(held)), len(mine) - n_full)
        out_full.update(mine[:n_full])
        out_sel.update([i for i in mine[n_full:] if i in selectable][:n_sel])
    return out_full, out_sel


def _chunks(costs: CandidateCosts, full: set[int], sel: set[int], count: int) -> tuple[tuple[int, int], ...] | None:
    """The min-max split of the layer table into ``count`` chunks with this recompute."""
    times = [
        layer.work_s + layer.zero_mb_s + (layer.rec_s if i in full else 0.0) + (layer.sel_rec_s if i in sel else 0.0)
        for i, layer in enumerate(costs.layers)
    ]
    try:
        return split_chunks(times, count)
    except ValueError:
        return None


def _priced(
    costs: CandidateCosts,
    kinds: Sequence[str],
    solved: Evaluation,
    name: str,
    virtual_stages: int,
    best: float = math.inf,
) -> Evaluation | None:
    """The ILP's answer ``solved`` (a 1F1B strategy) priced under ``name`` with the simulator;
    ``None`` without simulating when its :func:`~planner.search.schedule_search.step_bound` is not
    under ``best``."""
    stages = solved.strategy.stages
    full, sel = (
        set(solved.strategy.checkpoint),
        {i for i in solved.strategy.selective if i not in solved.strategy.checkpoint},
    )
    chunks: Sequence[tuple[int, int]] = stages
    if name == ScheduleName.INTERLEAVED:
        first = _chunks(costs, full, sel, costs.cand.pp * virtual_stages)
        if first is None:
            return None
        selectable = {i for i, layer in enumerate(costs.layers) if layer.sel_saved_b > 0}
        full, sel = _spread(kinds, stages, (full, sel), first, selectable)
        again = _chunks(costs, full, sel, costs.cand.pp * virtual_stages)
        if again is None:
            return None
        chunks = again
    times = chunk_times(costs, chunks, sorted(full), name, sorted(sel))
    if step_bound(costs, chunks, times) >= best * (1 - 1e-9):
        return None
    carrier = evaluate(costs, stages, sorted(full), sorted(sel))
    return _simulated(costs, carrier, name, virtual_stages, chunks, times)


def refit(
    costs: CandidateCosts,
    base: Evaluation,
    name: str,
    virtual_stages: int,
    kinds: Sequence[str],
    checkpoint: str,
    solver: str,
    answers: dict | None = None,
) -> Evaluation | None:
    """``base``'s candidate under schedule ``name`` (``v`` chunks per rank) with the partition
    and recompute the ILP chooses for the schedule's memory (module docstring), or ``None`` when
    no recompute the ``checkpoint`` mode allows makes it fit. Under ``auto``, the 1F1B ILP's
    answers with every block recomputed selectively, then fully (:data:`UNIFORM_MODES`), are
    priced too, and the fastest that fits is the answer: the ILP's memory rows only approximate
    the schedule's, and a uniform set the simulator accepts can beat the one the rows chose.
    ``answers``: a cache of those 1F1B answers by ``(candidate, mode)`` (they do not depend on the
    schedule)."""
    del base  # the candidate is all that is kept: stages and recompute are chosen again
    found = [_schedule_ilp(costs, name, virtual_stages, kinds, checkpoint, solver)]
    for mode in UNIFORM_MODES if checkpoint == "auto" else ():
        solved = uniform_answer(costs, kinds, mode, solver, {} if answers is None else answers)
        found.append(None if solved is None else _priced(costs, kinds, solved, name, virtual_stages))
    fits = [got for got in found if got is not None and got.feasible]
    return min(fits, key=lambda got: got.step_time_s) if fits else None


#: The recompute pins whose 1F1B answers :func:`refit` prices beside the schedule's own ILP.
UNIFORM_MODES = ("selective", "all")


def uniform_answer(
    costs: CandidateCosts, kinds: Sequence[str], mode: str, solver: str, answers: dict
) -> Evaluation | None:
    """The candidate's 1F1B ILP answer under recompute ``mode`` (what ``--checkpoint mode`` plans
    for it), from ``answers`` (by ``(candidate, mode)``) when solved before."""
    key = (costs.cand, mode)
    if key not in answers:
        answers[key] = solve_candidate(costs, list(kinds), mode, solver, time_limit=REFIT_TIME_LIMIT_S).evaluation
    return answers[key]


def _schedule_ilp(
    costs: CandidateCosts, name: str, virtual_stages: int, kinds: Sequence[str], checkpoint: str, solver: str
) -> Evaluation | None:
    """The ILP with the schedule's memory rows, priced under the schedule; solved again with a lower
    capacity while the simulator says it does not fit (:data:`REFIT_TRIES` solves at most)."""
    capacity = costs.capacity
    for _ in range(REFIT_TRIES):
        scheduled = schedule_costs(costs, name, virtual_stages, capacity)
        if not _may_fit(scheduled):
            return None
        solved = solve_candidate(scheduled, list(kinds), checkpoint, solver, time_limit=REFIT_TIME_LIMIT_S)
        if solved.evaluation is None:
            return None
        got = _priced(costs, kinds, solved.evaluation, name, virtual_stages)
        if got is None or got.feasible:
            return got
        peak = max(stage.memory["total"] for stage in got.stages)
        if peak <= 0 or not math.isfinite(peak):
            return None
        capacity *= min(costs.capacity / peak, 1.0) * (1 - 1e-4)
    return None


def _may_fit(costs: CandidateCosts) -> bool:
    """False when no partition can fit (a uniform table whose stages cannot hold every block even
    with all recomputed, :func:`planner.search.ilp.block_capacity`): what saves proving an
    infeasible ILP infeasible."""
    if memory_lower_bound(costs) > costs.capacity:
        return False
    if not costs.is_uniform():
        return True
    capacities = block_capacity(costs)
    return min(capacities) >= 0 and sum(capacities) >= costs.num_layers - 2


@dataclasses.dataclass(frozen=True)
class _Refitter:
    """The post-pass's solver (what ``planner.search.schedule_search.Refit`` asks for) with the
    search's layer kinds, recompute mode and solver bound; each 1F1B answer is solved once per
    candidate and mode, and shared between the schedules it is priced under."""

    kinds: tuple[str, ...]
    checkpoint: str
    solver: str
    spent: list[int] = dataclasses.field(default_factory=lambda: [0, 0], compare=False, repr=False)
    """Refits run so far, and new 1F1B ILPs (a list: the dataclass is frozen); past
    :data:`REFIT_BUDGET` a refit answers ``None`` (the schedule keeps its 1F1B recompute set's
    price), past :data:`SOLVE_BUDGET` a new 1F1B answer ``None`` (the candidate is not priced)."""
    answers: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    """1F1B ILP answers by ``(candidate, mode)``."""

    pending: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    """1F1B ILPs started ahead (:meth:`prefetch`) by ``(candidate, mode)``: their futures."""

    @property
    def modes(self) -> tuple[str, ...]:
        return UNIFORM_MODES if self.checkpoint == "auto" else ()

    def _solve(self, costs: CandidateCosts, mode: str) -> Evaluation | None:
        """The candidate's 1F1B ILP under ``mode``: the search's own (no time limit but the
        search's) for its mode, :func:`uniform_answer`'s for the others."""
        if mode == self.checkpoint:
            return solve_candidate(costs, list(self.kinds), mode, self.solver).evaluation
        return solve_candidate(costs, list(self.kinds), mode, self.solver, time_limit=REFIT_TIME_LIMIT_S).evaluation

    def _answer(self, costs: CandidateCosts, mode: str) -> Evaluation | None:
        """The 1F1B answer under ``mode``: known, started ahead, or solved now."""
        key = (costs.cand, mode)
        if key not in self.answers:
            future = self.pending.pop(key, None)
            if future is not None and not future.cancelled():
                self.answers[key] = future.result()
            else:
                self.answers[key] = self._solve(costs, mode)
        return self.answers[key]

    def prefetch(
        self, costs: CandidateCosts, mode: str, pool: concurrent.futures.Executor, budgeted: bool = False
    ) -> concurrent.futures.Future | None:
        """Start the 1F1B ILP under ``mode`` on ``pool`` unless known, started, or (``budgeted``)
        past :data:`SOLVE_BUDGET`; the answer is the one :meth:`strategy` or :meth:`uniform`
        would solve (the same ILP, deterministic), and nothing is counted against a budget until
        they ask. The future, or None when it started nothing."""
        key = (costs.cand, mode)
        if key in self.answers or key in self.pending or (budgeted and self.spent[1] >= SOLVE_BUDGET):
            return None
        if head_rows(costs, self.kinds) is not None:  # solved by counting, in this process: a thread only contends
            return None
        future = self.pending[key] = pool.submit(self._solve, costs, mode)
        return future

    def __call__(self, costs: CandidateCosts, base: Evaluation, name: str, virtual_stages: int) -> Evaluation | None:
        """The schedule's own ILP (:func:`refit` without the uniform answers, which the walk
        prices as items of their own: :meth:`uniform`)."""
        if self.spent[0] >= REFIT_BUDGET:
            return None
        self.spent[0] += 1
        got = _schedule_ilp(costs, name, virtual_stages, self.kinds, self.checkpoint, self.solver)
        return got if got is not None and got.feasible else None

    def _affords(self, costs: CandidateCosts, mode: str) -> bool:
        """Whether the answer is known or the :data:`SOLVE_BUDGET` allows solving it."""
        if (costs.cand, mode) in self.answers:
            return True
        if self.spent[1] >= SOLVE_BUDGET:
            return False
        self.spent[1] += 1
        return True

    def strategy(self, costs: CandidateCosts, budgeted: bool = True) -> Evaluation | None:
        if budgeted and not self._affords(costs, self.checkpoint):
            return None
        return self._answer(costs, self.checkpoint)

    def uniform(
        self, costs: CandidateCosts, mode: str, name: str, virtual_stages: int, best: float
    ) -> Evaluation | None:
        solved = self._answer(costs, mode)
        if solved is None:
            return None
        got = _priced(costs, self.kinds, solved, name, virtual_stages, best)
        return got if got is not None and got.feasible else None


def make_refit(kinds: Sequence[str], checkpoint: str, solver: str, known: dict | None = None) -> Refit:
    """:func:`refit` (and the 1F1B ILP) with the search's layer kinds, recompute mode and solver;
    ``known``: candidate -> its 1F1B strategy, where the search solved it already
    (``SearchResult.answers``)."""
    refitter = _Refitter(tuple(kinds), checkpoint, solver)
    refitter.answers.update({(candidate, checkpoint): answer for candidate, answer in (known or {}).items()})
    return refitter


#: Recompute modes a refused schedule pin is tried with, in the order the message prefers them.
FIX_MODES = ("selective", "all", "auto")


def schedule_fix(
    strategies: list[Evaluation],
    cc_of,
    options_of: Callable[[Evaluation], list[tuple[str, int]]],
    kinds: Sequence[str],
    checkpoint: str,
    solver: str,
) -> str:
    """What makes a refused ``--schedule`` pin fit, searched: each of the search's kept
    ``strategies`` (the four first) under each option ``options_of`` allows, with the schedule's
    own recompute under another ``--checkpoint`` mode, or at a higher ZeRO stage (the candidate
    priced again with ``cc_of.price``: also one the pins ruled out). A sentence naming the
    settings that fit and the fastest step of each, or ``""`` when none does."""
    found: dict[str, Evaluation] = {}
    answers: dict = {}  # the uniform 1F1B answers, shared between the schedules

    def consider(setting: str, got: Evaluation | None) -> None:
        if got is not None and got.feasible and (setting not in found or got.step_time_s < found[setting].step_time_s):
            found[setting] = got

    for evaluation in strategies[:4]:
        candidate = evaluation.strategy.candidate
        for name, virtual_stages in options_of(evaluation):
            for mode in (mode for mode in FIX_MODES if mode != checkpoint):
                consider(
                    f"--checkpoint {mode}",
                    refit(cc_of[candidate], evaluation, name, virtual_stages, kinds, mode, solver, answers),
                )
            for zero in (
                range(candidate.zero_stage + 1, 4) if candidate.weight_dp > 1 and not candidate.compressed else ()
            ):
                costs = cc_of.price(dataclasses.replace(candidate, zero_stage=zero))
                for mode in dict.fromkeys((checkpoint, "all")):
                    setting = f"--zero-stage {zero}" + (f" --checkpoint {mode}" if mode != checkpoint else "")
                    consider(setting, refit(costs, evaluation, name, virtual_stages, kinds, mode, solver, answers))
    if not found:
        return ""
    ranked = sorted(found.items(), key=lambda item: item[1].step_time_s)[:3]
    return (
        "It fits with "
        + "; or ".join(
            f"{setting} ({got.strategy.candidate.describe()}, predicted {got.step_time_s:.3g} s per step)"
            for setting, got in ranked
        )
        + "."
    )
