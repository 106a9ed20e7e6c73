"""The planner's search: enumerate degrees and batching, solve partition + recompute as an ILP
(the search's pruning is described in :func:`search`).

ILP of one candidate ``(dp, tp, pp = p, zero, b, m)``
---------------------------------------------------
Layers ``l = 0..n-1`` (``n = L + 2``), stages ``k = 0..p-1``; per-layer constants from
:mod:`cost_models.strategy` (``w_l`` = forward+backward compute and TP time, ``rec_l``, ``z_l`` =
per-micro-batch ZeRO time, ``d_l`` = per-step DP time + optimizer, ``st_l`` model state bytes,
``tr_l`` transient ZeRO bytes, ``sv_l`` saved and ``in_l`` input activation bytes, ``snd_{l,j}``
time to send layer ``l``'s output over boundary ``j``, ``a_k = min(p - k, m)`` in flight)::

    x[l,k] in {0,1}     layer l is in stage k          (only k in [max(0, p-n+l), min(p-1, l)])
    c[l,k] in {0,1}     layer l is in stage k and recomputes      c[l,k] <= x[l,k]
    e[l,k] in [0,1]     layer l is the last of stage k (k < p-1)  e[l,k] >= x[l,k] - x[l+1,k]
    T, D >= 0           slowest micro-step, exposed tail

    minimize   (m - 1) T + sum_k T_k + D  (+ 1e-6 * (recompute + p2p) + 1e-7 * (recomputed layers) / n,
                                   tie-breaks toward less work; times are scaled so that the
                                   step-time lower bound is 1000)
    partition  sum_k x[l,k] = 1;  s_l = sum_k k x[l,k];  0 <= s_{l+1} - s_l <= 1
               (x[0,0] = x[n-1,p-1] = 1 by the windows: p contiguous non-empty stages)
    time       T >= T_k = sum_l (w_l + z_l) x[l,k] + sum_l rec_l c[l,k] + sum_l snd_{l,k} e[l,k]
                    + sum_l snd_{l,k-1} e[l,k-1]                                   for all k
               D >= sum_l d_l x[l,k]                                               for all k
    memory     sum_l st_l x[l,k] + TR_k + a_k (sum_l sv_l x[l,k] - sum_l (sv_l - in_l) c[l,k])
                   + PK_k <= capacity * headroom                                   for all k
               TR_k >= tr_l x[l,k];   PK_k >= sv_l c[l,k];   PK_k >= bt_l x[l,k]
                        (largest ZeRO buffers / largest recompute or backward transient)

Offload (``Candidate.offload_optimizer``, ``offload_params``) changes only the constants: the
exposed transfers join ``z_l`` (per micro-batch) and ``d_l`` (per step), the CPU AdamW step is
``d_l``'s optimizer, ``st_l`` and ``tr_l`` lose what left the device, and two more rows per stage
keep the offloaded state ``h_l`` (host) and ``v_l`` (NVMe) within the rank's share of the node::

    sum_l h_l x[l,k] <= host_memory * headroom / ranks_per_node - pinned buffers     (memory_host_k)
    sum_l v_l x[l,k] <= nvme_bytes * headroom / ranks_per_node                        (memory_nvme_k)

``e`` only appears on the cheap side of ``>=`` rows, so at the optimum it equals the indicator.
Overlap (``Candidate.overlap``) changes only constants: ``w_l``, ``z_l``, ``d_l`` hold what each
collective's window cannot hide plus contention (``cost_models.overlap_cost``).

Selective recompute. A layer with attention cores (``sel_l > 0``: the bytes only its cores keep)
may instead recompute just those: ``y[l,k] in {0,1}``, ``c[l,k] + y[l,k] <= x[l,k]``; it adds
``selrec_l y[l,k]`` to ``T_k``, takes ``a_k sel_l y[l,k]`` off the stage's memory and re-creates
``sel_l`` during its backward (``PK_k >= sel_l y[l,k]``).

Pins: ``--checkpoint none`` fixes ``c = y = 0``, ``all`` fixes ``c[l,k] = x[l,k]`` for the blocks,
``selective`` fixes ``c = 0`` and ``y[l,k] = x[l,k]`` for the blocks with attention cores.

Repeated blocks. When the blocks 1..L cost the same (the usual transformer), which blocks a
stage holds does not matter, only how many: integer ``n_k`` blocks and ``r_k <= n_k`` recomputed
ones per stage (``sum_k n_k = L``, ``n_k >= 1`` for the middle stages), binaries ``c_pre``,
``c_post`` for rows 0 and n-1 (always in stages 0 and p-1), ``z_0 = [n_0 >= 1]`` to know
whether stage 0 ends with a block or the embedding, and ``v_k >= r_k / L`` so that a stage with
recomputed blocks pays for re-materializing one (``n_k``, ``r_k`` are also bounded by the most
blocks stage ``k`` could hold with everything recomputed, :func:`block_capacity`, which tightens
the relaxation). A last block that differs from the others (HF models: it hands the head less)
is a row of its own with a binary ``q``: in the last stage, or ending stage ``p - 2`` while the
last stage holds only the head. The rows above become sums of ``n_k`` and ``r_k`` times the
block's constants: O(p) variables instead of O(n p). Selective recompute adds integer ``s_k``
(``r_k + s_k <= n_k``) with a binary ``u_k >= s_k / L``, and binaries for the last block row.
Both forms are built by the same ``add_*_constraints`` functions of :mod:`planner.search.ilp_form`
(rows named ``family_k{k}...``, so an infeasible model says which stage and family failed).
A uniform table's time objective is solved by counting instead (:mod:`planner.search.block_counts`:
the same rows and optimum, no solver; also after a head of distinct blocks, and on an envelope,
:mod:`planner.search.envelope`); ``formulation="uniform"`` keeps its ILP for comparison.

Pipeline schedules. The ILP prices 1F1B (``(m - 1) T + sum_k T_k``, the closed form above); the
other schedules are priced after the search (:mod:`planner.search.schedule_search`).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cost_models.strategy import Candidate, CandidateCosts, Evaluation, evaluate, memory_bound
from planner.search.block_counts import Counts, solve_counts
from planner.search.candidates import MAX_HEAD_ROWS, head_rows, heuristic_strategy, uniform_time_bound
from planner.search.entries import Entry
from planner.search.envelope import overlap_envelope
from planner.search.objective import block_capacity
from planner.search.periods import periodic_groups
from runtime.contract import environment

__all__ = [
    "SOLVERS",
    "default_solver",
    "solve_candidate",
    "ILPResult",
    "block_capacity",
    "search",
    "SearchResult",
    "COUNTERS",
    "layout_key",
    "by_layout",
]

#: The ILP solvers (pulp's CBC, or HiGHS with ``highspy``).
SOLVERS = ("cbc", "highs")
#: Relative tolerance when comparing step times (ties go to the lower memory).
TIME_TOL = 1e-9


def default_solver() -> str:
    """``PLANNER_SOLVER`` if set (``cbc`` or ``highs``), else CBC."""
    return environment.read(environment.SOLVER).lower()


@dataclass
class ILPResult:
    """Outcome of one candidate's ILP."""

    evaluation: Evaluation | None
    """The optimal strategy priced by :func:`cost_models.strategy.evaluate` (None when infeasible)."""
    status: str
    seconds: float
    uniform: bool


def solve_candidate(
    costs: CandidateCosts,
    kinds: list[str],
    checkpoint: str = "auto",
    solver: str = "cbc",
    objective: str = "time",
    formulation: str = "auto",
    cutoff: float | None = None,
    time_limit: float | None = 60.0,
) -> ILPResult:
    """Optimal partition and recompute set of one candidate.

    ``objective="time"`` minimizes the step time under the memory limit; ``"memory"`` minimizes
    the most loaded stage's memory with no limit (used to explain infeasibility). With a
    ``cutoff`` an infeasible answer means "nothing fits, or nothing is faster than the cutoff";
    under the memory objective the cutoff is bytes, and it means "nothing needs less" (what a
    caller that knows a strategy needing that much asks; only the block-count tables read it).

    ``formulation``: ``"auto"`` solves a uniform table's time objective by counting
    (:mod:`planner.search.block_counts`: the same optimum, no solver process) and everything else
    as an ILP; ``"counts"`` insists on counting, ``"uniform"`` and ``"general"`` on the ILP's
    forms (:func:`build_problem`).

    ``solver``: pulp's CBC (default) or HiGHS (``"highs"``, needs ``highspy``; the environment
    variable ``PLANNER_SOLVER`` sets the default). The optimal partition is priced again with
    :func:`cost_models.strategy.evaluate`, which is what the plan reports.
    """
    started = time.perf_counter()
    head = head_rows(costs, kinds) if objective == "time" and formulation in ("auto", "counts") else None
    if head is not None:
        return _solve_counts(costs, checkpoint, cutoff, started, _Counted(costs, head))
    counted = _counted_form(costs, kinds) if formulation == "auto" else None
    if counted is not None and objective == "time":
        return _solve_counts(costs, checkpoint, cutoff, started, counted)
    if objective == "memory" and formulation == "auto":
        head = head_rows(costs, kinds)
        counted = _Counted(costs, head) if head is not None else counted
        if counted is not None and head != 0:  # a uniform table's ILP is small; the general one is not
            return _least_memory_by_counts(costs, checkpoint, started, counted, cutoff)
    if formulation == "counts":
        raise ValueError(
            "the counts formulation needs identical blocks (after at most "
            f"{MAX_HEAD_ROWS} distinct ones) between a pre and a post row, and objective 'time'"
        )
    from planner.search import ilp_form  # pulp and its solvers load only when an ILP is solved

    evaluation, status, uniform = ilp_form.solve_ilp(
        costs, kinds, checkpoint, solver, objective, formulation, cutoff, time_limit
    )
    return ILPResult(evaluation, status, time.perf_counter() - started, uniform)


@dataclass(frozen=True)
class _Counted:
    """A table the block-count solver takes (``costs`` after ``head`` distinct blocks): the
    candidate's own, its envelope (:mod:`planner.search.envelope`) or its periods grouped
    (:mod:`planner.search.periods`), with how the answer maps to the real rows (``expand``) and
    the status it is reported with."""

    costs: CandidateCosts
    head: int
    status: str = "Optimal"
    expand: Callable[[Counts], tuple[list[tuple[int, int]], list[int], list[int]]] | None = None

    def priced(self, real: CandidateCosts, found: Counts) -> Evaluation:
        """The counted strategy priced on the real rows."""
        if self.expand is None:
            return evaluate(real, found.stages, sorted(found.recomputed), sorted(found.selective))
        return evaluate(real, *self.expand(found))


def _counted_form(costs: CandidateCosts, kinds: Sequence[str]) -> _Counted | None:
    """The block-count form of a table that is not counted as it is: blocks alike but for the
    traffic their place hides, on their envelope; blocks repeating in a period, grouped."""
    enveloped = overlap_envelope(costs, kinds)
    if enveloped is not None:
        return _Counted(enveloped[0], enveloped[1], "Enveloped")
    grouped = periodic_groups(costs, kinds)
    if grouped is not None:
        return _Counted(grouped.costs, grouped.head, "Periodic", grouped.expand)
    return None


def _check_mode(checkpoint: str) -> None:
    if checkpoint not in ("auto", "none", "all", "selective"):
        raise ValueError(f"checkpoint must be auto, none, all or selective, got {checkpoint!r}")


def _solve_counts(
    costs: CandidateCosts, checkpoint: str, cutoff: float | None, started: float, counted: _Counted
) -> ILPResult:
    """:func:`solve_candidate` of a table the block-count solver takes
    (:func:`planner.search.block_counts.solve_counts`), solved on ``counted`` and priced on ``costs``."""
    _check_mode(checkpoint)
    found = solve_counts(counted.costs, checkpoint, cutoff, counted.head)
    evaluation = None
    if found is not None:
        evaluation = counted.priced(costs, found)
        evaluation = evaluation if evaluation.feasible else None
    status = "Infeasible" if evaluation is None else counted.status
    return ILPResult(evaluation, status, time.perf_counter() - started, True)


def _least_memory_by_counts(
    costs: CandidateCosts, checkpoint: str, started: float, counted: _Counted, below: float | None = None
) -> ILPResult:
    """The memory objective of a table the block-count solver takes (``counted``), by bisection
    on the capacity: a strategy fits under a capacity exactly when counting finds one, and
    fitting only gets easier as the capacity grows. The answer is priced on ``costs``; its memory
    is the least to within :data:`MEMORY_BISECTION_TOLERANCE` (the general ILP took its 60 s limit
    on a 61-block model), on a grouped table the least of the strategies it can express."""
    _check_mode(checkpoint)

    def strategy_under(capacity: float) -> Evaluation | None:
        probe = copy.copy(counted.costs)  # a fresh object: the bounds remember a costs object's answers
        probe.capacity = capacity
        found = solve_counts(probe, checkpoint, None, counted.head)
        if found is None:
            return None
        priced = counted.priced(costs, found)
        return priced if memory_bound(priced) <= capacity else None

    per_row = (row.state_b + row.saved_b * max(costs.inflight) + row.trans_b + row.bt_b for row, _ in costs.distinct)
    everything = 2.0 * sum(n * size for (_, n), size in zip(costs.distinct, per_row)) + 1.0
    # one probe settles a candidate that cannot beat ``below``
    best = strategy_under(everything if below is None else min(below, everything))
    low = 0.0
    while best is not None and memory_bound(best) - low > MEMORY_BISECTION_TOLERANCE * memory_bound(best):
        middle = (low + memory_bound(best)) / 2
        found = strategy_under(middle)
        if found is None:
            low = middle
        else:
            best = found
    status = "Infeasible" if best is None else "Optimal"
    return ILPResult(best, status, time.perf_counter() - started, counted.head == 0 and counted.expand is None)


#: What :class:`SearchResult` counts, summed when two searches' results are merged.
COUNTERS = (
    "enumerated",
    "solved",
    "infeasible",
    "pruned_time",
    "pruned_memory",
    "time_limited",
    "enveloped",
    "periodic",
)

#: Relative gap at which :func:`_least_memory_by_counts` stops bisecting.
MEMORY_BISECTION_TOLERANCE = 1e-3


# ---------------------------------------------------------------------------------- search
@dataclass
class SearchResult:
    """Best strategy per ``(dp, tp, pp)``, and what the search did."""

    ranked: list[Evaluation]
    """Best evaluation of each degree triple, fastest first (ties: less memory first)."""
    extra: list[Evaluation] = field(default_factory=list)
    """Runners-up of other (zero, micro-batch) when fewer than three other triples are feasible."""
    enumerated: int = 0
    solved: int = 0
    infeasible: int = 0
    pruned_time: int = 0
    pruned_memory: int = 0
    seconds: float = 0.0
    solver_seconds: float = 0.0
    uniform: bool = True
    time_limited: int = 0
    """ILPs stopped by their time limit (their answer is feasible, maybe not optimal)."""
    enveloped: int = 0
    """Candidates solved on the envelope of their blocks' overlap (:mod:`planner.search.envelope`:
    optimal there, priced on the real rows)."""
    periodic: int = 0
    """Candidates solved with their periods of unlike blocks grouped (:mod:`planner.search.periods`:
    optimal among cuts between whole periods, priced on the real rows)."""
    notes: list[str] = field(default_factory=list)
    """What the model ruled out before the search (printed under the plan)."""
    answers: dict = field(default_factory=dict, repr=False)
    """Candidate -> its optimal strategy, for each ILP solved to a strategy (a cutoff only rules
    strategies out, so an answer found under one is the optimum): what the schedule post-pass
    would otherwise solve again."""

    @property
    def status(self) -> str:
        """``optimal``, or ``feasible`` when some ILP hit its time limit; what was solved on an
        envelope is said."""
        status = "optimal" if not self.time_limited else f"feasible ({self.time_limited} ILPs hit the time limit)"
        if self.enveloped:
            status += (
                f"; {self.enveloped} candidates' blocks, alike but for the traffic their place hides, were "
                "partitioned as if each hid the least"
            )
        if self.periodic:
            status += (
                f"; {self.periodic} candidates' blocks, repeating in a period of unlike blocks, were cut "
                "between whole periods"
            )
        return status

    @property
    def best(self) -> Evaluation | None:
        return self.ranked[0] if self.ranked else None

    def winner(self) -> Evaluation:
        """:attr:`best`, for a search known to have found a strategy (``ValueError`` otherwise)."""
        if not self.ranked:
            raise ValueError("the search found no strategy that fits")
        return self.ranked[0]

    def alternatives(self, n: int = 3) -> list[Evaluation]:
        return (self.ranked[1:] + self.extra)[:n]

    def runners_up(self, n: int = 3) -> list[Evaluation]:
        """What plan.json's ``alternatives`` show: the best strategy of each of the ``n`` fastest
        layouts other than the winner's (:func:`layout_key`)."""
        if not self.ranked:
            return []
        return by_layout(self.ranked[1:] + self.extra, {layout_key(self.ranked[0])})[:n]


def _better(candidate: Evaluation, incumbent: Evaluation | None) -> bool:
    if incumbent is None:
        return True
    if candidate.step_time_s < incumbent.step_time_s * (1 - TIME_TOL):
        return True
    if candidate.step_time_s <= incumbent.step_time_s * (1 + TIME_TOL):
        return _tie_key(candidate) < _tie_key(incumbent)
    return False


def _tie_key(evaluation: Evaluation) -> tuple[bool, float, Candidate]:
    """Among equally fast strategies: state on the device first (offload then only costs host
    memory and drives, and its transfers rarely hide as fully as priced), then less memory."""
    candidate = evaluation.strategy.candidate
    return (candidate.offloads, evaluation.memory["total"], candidate)


def _rank_key(evaluation: Evaluation) -> tuple[float, bool, float, Candidate]:
    return (evaluation.step_time_s, *_tie_key(evaluation))


def _candidate_layout(candidate: Candidate, schedule: str = "1f1b") -> tuple:
    return (
        candidate.dp,
        candidate.tp,
        candidate.pp,
        schedule,
        # a compressed exchange keeps stage 0's state after its warm-up, and is priced so at
        # every stage: its ZeRO stages are the same layout
        0 if candidate.compressed else candidate.zero_stage,
        candidate.expert_parallel,
        candidate.context_parallel,
    )


def layout_key(evaluation: Evaluation) -> tuple:
    """What makes two strategies different layouts for the runners-up: degrees, schedule and ZeRO
    stage (the micro-batch, recompute, offload and compile follow from them, or are near-copies)."""
    return _candidate_layout(evaluation.strategy.candidate, evaluation.strategy.schedule)


def by_layout(evaluations: list[Evaluation], exclude: set | None = None) -> list[Evaluation]:
    """The fastest of each layout among ``evaluations`` (:func:`layout_key`), fastest first,
    without the layouts of ``exclude``."""
    best: dict[tuple, Evaluation] = {}
    for evaluation in sorted(evaluations, key=_rank_key):
        key = layout_key(evaluation)
        if key not in best and key not in (exclude or set()):
            best[key] = evaluation
    return list(best.values())


class _Search:
    """The state of one :func:`search`: the incumbents, the greedy strategies, the counts."""

    def __init__(
        self,
        entries: list[Entry],
        kinds: list[str],
        checkpoint: str,
        solver: str,
        keep: int,
        seed: SearchResult | None,
        below: float = math.inf,
        incumbents: Sequence[Evaluation] = (),
    ):
        self.kinds, self.checkpoint, self.solver, self.keep, self.below = kinds, checkpoint, solver, keep, below
        self.result = SearchResult(ranked=[], enumerated=len(entries))
        self.order = sorted(entries, key=lambda entry: (entry.floor, entry.cand))
        self.best: dict[tuple, Evaluation] = {
            evaluation.strategy.candidate.mesh: evaluation for evaluation in (seed.ranked if seed else [])
        }
        for evaluation in incumbents:
            triple = evaluation.strategy.candidate.mesh
            if evaluation.feasible and _better(evaluation, self.best.get(triple)):
                self.best[triple] = evaluation
        self.heuristic: dict[Candidate, Evaluation | None] = {}

    def greedy(self, costs: CandidateCosts) -> Evaluation | None:
        if costs.cand not in self.heuristic:
            self.heuristic[costs.cand] = heuristic_strategy(costs, self.kinds, self.checkpoint)
        return self.heuristic[costs.cand]

    def run(self, costs: CandidateCosts, cutoff: float) -> Evaluation | None:
        """The ILP's answer, or the greedy strategy's when that is better."""
        result = self.result
        # the greedy strategy's cost tightens the cutoff the ILP must beat
        greedy = self.greedy(costs)
        if greedy is not None:
            cutoff = min(cutoff, greedy.step_time_s)
        solved = solve_candidate(
            costs, self.kinds, self.checkpoint, self.solver, cutoff=None if cutoff == float("inf") else cutoff
        )
        result.solved += 1
        result.solver_seconds += solved.seconds
        result.uniform = result.uniform and solved.uniform
        result.time_limited += solved.status == "Feasible"
        result.enveloped += solved.status == "Enveloped"
        result.periodic += solved.status == "Periodic"
        evaluation = solved.evaluation
        if evaluation is not None and solved.status == "Optimal":
            result.answers[costs.cand] = evaluation
        if greedy is not None and (evaluation is None or _better(greedy, evaluation)):
            evaluation = greedy
        if evaluation is None:
            result.infeasible += 1
        return evaluation

    def sweep(self, exact: bool) -> None:
        """One pass in bound order: greedy strategies only (seeding incumbents), then exact ILPs."""
        result, best = self.result, self.best
        for i, entry in enumerate(self.order):
            times = sorted(evaluation.step_time_s for evaluation in best.values())
            threshold = min(times[self.keep - 1] if len(times) >= self.keep else math.inf, self.below)
            if entry.floor > threshold * (1 + TIME_TOL):  # so is every later one's (and its bound)
                result.pruned_time += (len(self.order) - i) * exact
                return
            if entry.too_big:
                result.pruned_memory += exact
                continue
            triple = entry.cand.mesh
            bound = min(best[triple].step_time_s if triple in best else float("inf"), threshold)
            if entry.floor > bound * (1 + TIME_TOL):  # its triple has a faster strategy: not priced
                result.pruned_time += exact
                continue
            costs = entry.costs
            if entry.memory_lb > costs.capacity:
                result.pruned_memory += exact
                continue
            if entry.time_lb > bound * (1 + TIME_TOL):
                result.pruned_time += exact
                continue
            if uniform_time_bound(costs, self.kinds, self.checkpoint) > bound * (1 + TIME_TOL):
                # forced recompute (or no fit at all) makes it lose: no greedy seed either (it could
                # only be slower than the bound, which a seed must beat to matter)
                result.pruned_time += exact
                continue
            evaluation = self.run(costs, bound) if exact else self.greedy(costs)
            if evaluation is not None and _better(evaluation, best.get(triple)):
                best[triple] = evaluation

    def runners_up(self, need: int) -> list[Evaluation]:
        """The best strategies of the ``need`` best layouts (:func:`layout_key`: degrees and ZeRO
        stage) other than the ranked ones (solved again: their first ILP may have been cut off):
        a runner-up that only offloads or re-batches the winner's layout says little."""
        taken = {layout_key(evaluation) for evaluation in self.result.ranked}
        per_layout: dict[tuple, Evaluation] = {}
        for entry in self.order:
            key = _candidate_layout(entry.cand)
            if key in taken:
                continue
            best = sorted(per_layout.values(), key=_rank_key)
            enough = best[need - 1].step_time_s if len(best) >= need else float("inf")
            if entry.floor > enough * (1 + TIME_TOL):  # every later one's floor (and bound) too
                break
            bound = min(enough, per_layout[key].step_time_s) if key in per_layout else enough
            if entry.floor > bound * (1 + TIME_TOL) or entry.too_big or entry.time_lb > bound * (1 + TIME_TOL):
                continue
            costs = entry.costs
            if entry.memory_lb > costs.capacity:
                continue
            if uniform_time_bound(costs, self.kinds, self.checkpoint) > bound * (1 + TIME_TOL):
                continue
            evaluation = self.run(costs, bound)
            if evaluation is not None and (key not in per_layout or _better(evaluation, per_layout[key])):
                per_layout[key] = evaluation
        return sorted(per_layout.values(), key=_rank_key)[:need]


def search(
    entries: list[Entry],
    kinds: list[str],
    checkpoint: str = "auto",
    solver: str = "cbc",
    keep: int = 4,
    seed: SearchResult | None = None,
    below: float = math.inf,
    incumbents: Sequence[Evaluation] = (),
) -> SearchResult:
    """Best strategies over ``entries`` (:class:`planner.search.entries.Entry`) with sound pruning.

    Keeps the best of each ``(dp, tp, pp)`` among the ``keep`` fastest triples; when fewer than
    ``keep`` triples are feasible, fills the runners-up with the best other candidates. A first
    pass prices greedy strategies (:func:`planner.search.candidates.heuristic_strategy`) to seed the
    incumbents; the second solves the ILPs with the incumbents as cutoffs.

    ``seed``: an earlier search over other candidates (the offload variants' search continues the
    plain one): its strategies are the starting incumbents, its counts carry over, and a strategy
    it ranked that loses its place to a new one stays a runner-up.

    ``incumbents``: strategies of some of ``entries``' candidates known beforehand (the eager
    winners repriced compiled), each its triple's first incumbent: the sweeps then skip at once
    what they would skip only after finding as good a strategy. The result is the same, since an
    incumbent's own candidate is still solved against it and ties break alike (``_tie_key``).

    ``below``: only strategies faster than this matter (a probe: the others are pruned as if four
    layouts were already faster; the runners-up are then incomplete).

    The small decisions are enumerated (:func:`planner.search.candidates.enumerate_candidates`):
    ``dp * tp * pp = gpus`` (``tp`` divides the heads and key/value heads and stays inside a node unless allowed
    across nodes; ``pp`` at most the number of layer-table rows), ZeRO stage 0-3 (only 0 when ``dp =
    1``, where they are all the same), micro-batch size ``b`` with ``m = global_batch / (dp * b)``
    micro-batches and ``m >= pp`` (1F1B needs it). Pins remove the other values.

    Candidates are visited in increasing order of a sound step-time floor (``Entry.floor``, from
    the rows' work alone) and priced when visited, which gives the tighter sound lower bound
    (:func:`planner.search.candidates.time_lower_bound`). The winner and three runners-up are wanted, each
    the best of its own ``(dp, tp, pp)``, so a candidate matters only if it can beat ``bound =
    min(best time of its triple, 4th best time over triples)``. Two passes:

    1. greedy: price :func:`planner.search.candidates.heuristic_strategy` (a feasible strategy found without
       a solver) for each candidate still under the bound, to seed the incumbents;
    2. exact: skip a candidate whose memory lower bound exceeds the capacity, or whose time bound,
       or memory-aware bound (:func:`planner.search.candidates.uniform_time_bound`, which counts the
       recompute each stage is forced into), is above ``bound``; otherwise solve its ILP with
       ``min(bound, own greedy cost)`` as a cutoff (row ``time_cutoff``), so a candidate that cannot
       win is refuted at the root. The loop stops at the first floor above the 4th best: the
       candidates after it are never priced.

    Every skipped candidate provably costs at least what it is compared with, and a cut-off ILP
    proves the same, so the result equals solving every candidate to optimality (a test compares
    with exhaustive enumeration).
    """
    started = time.perf_counter()
    state = _Search(entries, kinds, checkpoint, solver, keep, seed, below, incumbents)
    result = state.result
    state.sweep(exact=False)
    state.sweep(exact=True)
    ranked = sorted((evaluation for evaluation in state.best.values() if evaluation.step_time_s < below), key=_rank_key)
    # an incumbent beyond the `keep` fastest that nothing replaced is one the search did not reach
    given = {id(evaluation) for evaluation in incumbents}
    result.ranked = [evaluation for k, evaluation in enumerate(ranked) if k < keep or id(evaluation) not in given]
    need = keep - len(result.ranked)
    if result.ranked and need > 0 and below == math.inf:
        result.extra = state.runners_up(need)
    if seed is not None:
        _merge_seed(result, seed, keep)
    result.seconds = time.perf_counter() - started
    return result


def _dominated(evaluation: Evaluation, plain: list[Evaluation]) -> bool:
    """An offloaded strategy whose degrees and batching run at least as fast with every state on
    the device: the same plan plus transfers, which says nothing a runner-up should."""

    def batching(candidate: Candidate) -> tuple:
        return (candidate.dp, candidate.tp, candidate.pp, candidate.micro_batch_size, candidate.compile)

    candidate = evaluation.strategy.candidate
    key = batching(candidate)
    return candidate.offloads and any(
        batching(other.strategy.candidate) == key and other.step_time_s <= evaluation.step_time_s for other in plain
    )


def _merge_seed(result: SearchResult, seed: SearchResult, keep: int) -> None:
    """Fold an earlier search into ``result``: its counts, and its runners-up (with its ranked
    strategies that lost their triple to a new one) among ``result``'s."""
    chosen = {evaluation.strategy.candidate for evaluation in result.ranked}
    pool = {
        evaluation.strategy.candidate: evaluation
        for evaluation in seed.ranked + seed.extra + result.extra
        if evaluation.strategy.candidate not in chosen
    }
    plain = [
        evaluation for evaluation in result.ranked + list(pool.values()) if not evaluation.strategy.candidate.offloads
    ]
    pool = {candidate: evaluation for candidate, evaluation in pool.items() if not _dominated(evaluation, plain)}
    taken = {layout_key(evaluation) for evaluation in result.ranked}
    result.extra = by_layout(list(pool.values()), taken)[: max(keep - len(result.ranked), 0)]
    for counter in COUNTERS:
        setattr(result, counter, getattr(result, counter) + getattr(seed, counter))
    result.solver_seconds += seed.solver_seconds
    result.answers = {**seed.answers, **result.answers}
    result.uniform = result.uniform and seed.uniform
    result.notes = seed.notes + result.notes
