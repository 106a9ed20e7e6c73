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
block's constants: O(p) variables instead of O(n p), which is what makes 96 layers on 1024
devices fast. Selective recompute adds integer ``s_k`` (``r_k + s_k <= n_k``) with a binary
``u_k >= s_k / L`` for its re-materialization, and binaries for the last block row. Both forms are built by the same ``add_*_constraints`` functions (one
per family; every row is named ``family_k{k}...`` so an infeasible model says which stage and
which family failed).

Pipeline schedules. The ILP prices 1F1B (``(m - 1) T + sum_k T_k``, the closed form above); the
other schedules are priced after the search (:mod:`planner.search.schedule_search`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import pulp

from cost_models.strategy import Candidate, CandidateCosts, Evaluation, LayerCost, evaluate
from planner.search.candidates import heuristic_strategy, is_repeated, time_lower_bound, uniform_time_bound
from planner.search.entries import Entry
from runtime.contract import environment

__all__ = [
    "SOLVERS",
    "default_solver",
    "highs_available",
    "solve_candidate",
    "build_problem",
    "ILPResult",
    "block_capacity",
    "add_partition_constraints",
    "add_boundary_constraints",
    "add_checkpoint_constraints",
    "add_time_constraints",
    "add_memory_constraints",
    "add_offload_capacity_constraints",
    "search",
    "SearchResult",
    "layout_key",
    "by_layout",
]

SOLVERS = ("cbc", "highs")
#: CBC's options. Cut generation off: these ILPs are small (O(p) integers in the uniform form) and
#: CBC's root cut loop was most of their time; branching closes them faster. On the 68 ILPs of
#: GPT-3 175B on 1,024 A100 they took 2.7 s with cuts and 1.1 s without (the 126-layer GQA model's
#: 39 on 8,192 H100: 1.6 s and 1.0 s), the same optima, no ILP more than 17% slower.
CBC_OPTIONS = ("cutsOnOff off",)
#: Weight of the tie-break terms (recompute + transfer seconds) against the step time.
TIE_BREAK = 1e-6
#: The objective is scaled to about this value (the step-time bound, or the capacity, maps to it).
OBJECTIVE_SCALE = 1000.0
#: Relative slack on a cutoff (the tie-break terms and solver tolerances sit well inside it).
CUTOFF_SLACK = 1e-5
#: Relative margin kept below the capacity in the ILP (solver feasibility tolerance).
MEMORY_MARGIN = 1e-6
#: Relative tolerance when comparing step times (ties go to the lower memory).
TIME_TOL = 1e-9


@functools.lru_cache(maxsize=None)
def highs_available() -> bool:
    try:
        return pulp.HiGHS().available()
    except Exception:  # pragma: no cover - depends on the installation
        return False


def default_solver() -> str:
    """``PLANNER_SOLVER`` if set (``cbc`` or ``highs``), else CBC."""
    return environment.read(environment.SOLVER).lower()


def _make_solver(name: str, time_limit: float | None) -> Any:
    if name == "cbc":
        with warnings.catch_warnings():  # PuLP 3.3 deprecates the bundled-CBC class name only
            warnings.simplefilter("ignore", DeprecationWarning)
            return pulp.PULP_CBC_CMD(msg=False, gapRel=1e-9, timeLimit=time_limit, options=list(CBC_OPTIONS))
    if name == "highs":
        if not highs_available():
            raise ValueError("solver 'highs' needs the highspy package: pip install highspy (or use 'cbc')")
        return pulp.HiGHS(msg=False, gapRel=1e-9, timeLimit=time_limit)
    raise ValueError(f"unknown solver {name!r}: expected one of {', '.join(SOLVERS)}")


def _var(
    prob: pulp.LpProblem, name: str, lower: float | None = None, upper: float | None = None, cat: str = "Continuous"
) -> pulp.LpVariable:
    """A variable attached to ``prob`` (PuLP >= 3.3 API, with a fallback for older PuLP)."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, lower, upper, cat=cat)
    return pulp.LpVariable(name, lower, upper, cat=cat)


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """HiGHS prints a banner on stdout even with ``msg=False``; ``--json`` output must stay clean."""
    try:
        saved_stdout = os.dup(1)
    except OSError:  # pragma: no cover - no stdout
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            try:
                yield
            finally:
                os.dup2(saved_stdout, 1)
    finally:
        os.close(saved_stdout)


# ---------------------------------------------------------------------------------- variables
#: A pulp linear expression, variable or plain number (pulp ships no type stubs).
Expr = Any
#: Reads one constant of a layer (``LayerCost``) into a coefficient.
LayerField = Callable[[LayerCost], float]


class _Vars:
    """Variables of one ILP and the linear expressions the constraint families read."""

    uniform = False

    def __init__(self, prob: pulp.LpProblem, costs: CandidateCosts, kinds: list[str], checkpoint: str):
        self.prob, self.costs, self.kinds, self.mode = prob, costs, kinds, checkpoint
        self.p, self.m, self.n = costs.cand.pp, costs.cand.num_micro_batches, costs.num_layers
        # T and D are in units of 1/OBJECTIVE_SCALE of the step-time lower bound, so relative
        # differences of 1e-6 stay far above the solver's absolute tolerances
        self.scale = OBJECTIVE_SCALE / max(time_lower_bound(costs), 1e-30)
        self.T = self.var("T", 0)
        self.D = self.var("D", 0)
        self.micro_steps: list[Expr] | None = None
        """Each stage's micro-step expression (``stage_micro_steps``), built once."""

    def var(self, name: str, lower: float | None = None, upper: float | None = None, cat: str = "Continuous") -> Expr:
        return _var(self.prob, name, lower, upper, cat)

    def can_select(self, layer: int) -> bool:
        """Layer ``layer`` may recompute selectively under this mode (it has attention cores; the
        ``selective`` pin covers the blocks)."""
        if self.costs.layers[layer].sel_saved_b <= 0 or self.mode in ("none", "all"):
            return False
        return self.mode == "auto" or self.kinds[layer] == "block"


class _GeneralVars(_Vars):
    """One binary per (layer, stage): any layer table."""

    def __init__(self, prob: pulp.LpProblem, costs: CandidateCosts, kinds: list[str], checkpoint: str):
        super().__init__(prob, costs, kinds, checkpoint)
        n, stages = self.n, self.p
        self.window = [range(max(0, stages - n + layer), min(stages - 1, layer) + 1) for layer in range(n)]
        self.members = [[layer for layer in range(n) if k in self.window[layer]] for k in range(stages)]
        self.x = {
            (layer, k): self.var(f"x_{layer}_{k}", cat="Binary") for layer in range(n) for k in self.window[layer]
        }
        self.c: dict[tuple[int, int], Expr] = {}
        if checkpoint == "auto":
            self.c = {cell: self.var(f"c_{cell[0]}_{cell[1]}", cat="Binary") for cell in self.x}
        self.y: dict[tuple[int, int], Expr] = {}
        if checkpoint == "auto":
            self.y = {
                cell: self.var(f"y_{cell[0]}_{cell[1]}", cat="Binary") for cell in self.x if self.can_select(cell[0])
            }
        elif checkpoint == "selective":
            self.y = {cell: self.x[cell] for cell in self.x if self.can_select(cell[0])}
        self.e = {
            (layer, k): self.var(f"e_{layer}_{k}", 0, 1)
            for (layer, k) in self.x
            if k < stages - 1 and layer + 1 < n and k + 1 in self.window[layer + 1]
        }
        self.ends = [[(layer, end) for (layer, stage), end in self.e.items() if stage == k] for k in range(stages)]

    def rec(self, layer: int, k: int) -> Expr | None:
        """``c[layer, k]`` (or the pinned recompute of the layer in stage ``k``; ``None``: never)."""
        if self.mode == "auto":
            return self.c[(layer, k)]
        if self.mode == "all" and self.kinds[layer] == "block":
            return self.x[(layer, k)]
        return None

    def stage_sum(self, k: int, f: LayerField) -> Expr:
        layers = self.costs.layers
        return pulp.lpSum(f(layers[layer]) * self.x[(layer, k)] for layer in self.members[k] if f(layers[layer]))

    def stage_rec_sum(self, k: int, f: LayerField) -> Expr:
        layers = self.costs.layers
        return pulp.lpSum(
            f(layers[layer]) * recomputes
            for layer in self.members[k]
            if (recomputes := self.rec(layer, k)) is not None and f(layers[layer])
        )

    def stage_sel_sum(self, k: int, f: LayerField) -> Expr:
        layers = self.costs.layers
        return pulp.lpSum(
            f(layers[layer]) * selects
            for layer in self.members[k]
            if (selects := self.y.get((layer, k))) is not None and f(layers[layer])
        )

    def p2p(self, k: int) -> Expr:
        send = self.costs.send_s
        terms = [send(layer, k) * end for layer, end in self.ends[k]] if k < self.p - 1 else []
        if k > 0:
            terms += [send(layer, k - 1) * end for layer, end in self.ends[k - 1]]
        return pulp.lpSum(terms)

    def held_terms(self, k: int, f: LayerField) -> list[tuple[Expr, float]]:
        """``(x[l, k], f(layer l))`` for each layer stage ``k`` may hold (nonzero values)."""
        return [(self.x[(layer, k)], value) for layer in self.members[k] if (value := f(self.costs.layers[layer]))]

    def trans_terms(self, k: int) -> list[tuple[Expr, float]]:
        return self.held_terms(k, lambda cost: cost.trans_b)

    def peak_terms(self, k: int) -> list[tuple[Expr, float]]:
        layers = self.costs.layers
        terms = [
            (recomputes, layers[layer].saved_b)
            for layer in self.members[k]
            if (recomputes := self.rec(layer, k)) is not None and layers[layer].saved_b
        ]
        terms += [
            (selects, layers[layer].sel_saved_b)
            for layer in self.members[k]
            if (selects := self.y.get((layer, k))) is not None
        ]
        return terms + self.held_terms(k, lambda cost: cost.bt_b)

    def decode(self) -> tuple[list[tuple[int, int]], set[int], set[int]]:
        """``(stages, recomputed layers, selectively recomputed layers)`` of the solution."""
        stage_of = [next(k for k in self.window[layer] if self.x[(layer, k)].value() > 0.5) for layer in range(self.n)]
        stages = []
        for k in range(self.p):
            held = [layer for layer in range(self.n) if stage_of[layer] == k]
            stages.append((held[0], held[-1]))
        recomputed = {
            layer
            for layer in range(self.n)
            if (recomputes := self.rec(layer, stage_of[layer])) is not None and pulp.value(recomputes) > 0.5
        }
        selective = {
            layer
            for layer in range(self.n)
            if (selects := self.y.get((layer, stage_of[layer]))) is not None and pulp.value(selects) > 0.5
        }
        return stages, recomputed, selective


def block_capacity(costs: CandidateCosts) -> list[int]:
    """Most blocks each stage can hold in a uniform table (a valid bound that tightens the ILP).

    Stage ``k`` with ``n`` blocks needs at least ``n (st + a_k min(sv, in, sv - sel))`` plus the state and
    least activations of the embedding / head rows it holds, whatever it recomputes, so ``n_k <=
    (capacity - fixed_k) / (st + a_k min(sv, in))``; never more than ``L``.
    """
    stages, blocks = costs.cand.pp, costs.num_layers - 2
    pre, blk, post = costs.layers[0], costs.layers[1], costs.layers[-1]
    capacities = []
    for k in range(stages):
        in_flight = costs.inflight[k]
        fixed = 0.0
        for row, here in ((pre, k == 0), (post, k == stages - 1)):
            if here:
                fixed += row.state_b + in_flight * min(row.saved_b, row.input_b)
        per_block = blk.state_b + in_flight * min(blk.saved_b, blk.input_b, blk.saved_b - blk.sel_saved_b)
        room = costs.capacity - fixed
        n = blocks if per_block <= 0 else int(max(-1.0, math.floor(room / per_block * (1 + 1e-12))))
        capacities.append(max(0, min(blocks, n)) if room >= 0 else -1)
    return capacities


def _is_zero(expr: Expr) -> bool:
    return isinstance(expr, (int, float)) and expr == 0


class _UniformVars(_Vars):
    """Integer block counts per stage: identical blocks between the embedding and head rows.

    When the last block differs from the others (HF models hand the head less than a block
    hands the next block), it is a separate row ``X``: in the last stage (``q = 1``), or ending
    stage ``p - 2`` while the last stage holds the head alone (``q = 0``).
    """

    uniform = True
    r: list[Expr]
    """``r_k``: recomputed blocks per stage (pinned: all or none of ``n_k``)."""
    v: list[Expr]
    """``v_k``: stage ``k`` recomputes some block (pays one re-materialization)."""
    cpre: Expr
    cpost: Expr
    q: Expr
    """The distinct last block row X sits in the last stage (1) or ends stage ``p - 2`` (0)."""
    cxa: Expr
    cxb: Expr
    w: Expr
    """Stage 0 of two ends with a run block (``q`` and ``z0``, linearized product); ``None`` otherwise."""

    def __init__(
        self, prob: pulp.LpProblem, costs: CandidateCosts, kinds: list[str], checkpoint: str, bounded: bool = True
    ):
        super().__init__(prob, costs, kinds, checkpoint)
        stages = self.p
        self.tail = costs.layers[-2] != costs.layers[1]
        self.L = blocks = self.n - 2 - self.tail
        self.pre, self.blk, self.post, self.X = costs.layers[0], costs.layers[1], costs.layers[-1], costs.layers[-2]
        # the capacity bounds n_k only when memory is a limit (not when it is the objective)
        self.ub = [min(most, blocks) for most in block_capacity(costs)] if bounded else [blocks] * stages
        self.nb = [self.var(f"n_{k}", 0, self.ub[k], cat="Integer") for k in range(stages)]
        self._add_recompute_vars(checkpoint)
        # has-blocks indicators of the end stages (middle stages always hold a block)
        self.z0 = self.var("z_first", cat="Binary") if stages > 1 else 1
        self.ulast = self.var("u_last", cat="Binary") if stages > 1 else 1
        self.has = [self.z0 if k == 0 else self.ulast if k == stages - 1 else 1 for k in range(stages)]
        if checkpoint == "all":
            self.v = list(self.has)
        self._add_selective_vars(checkpoint)
        # stage 0 of two ends with a run block: q and z0 (linearized product)
        self.w = self.var("w_first_tail", cat="Binary") if self.tail and stages == 2 else None

    def _add_recompute_vars(self, checkpoint: str) -> None:
        """``r_k``, ``v_k``, ``c_pre``, ``c_post``, ``q`` and the last block row's recompute."""
        stages = self.p
        auto = checkpoint == "auto"
        if auto:
            self.r = [self.var(f"r_{k}", 0, self.ub[k], cat="Integer") for k in range(stages)]
            self.v = [self.var(f"v_{k}", cat="Binary") for k in range(stages)]
            self.cpre = self.var("c_pre", cat="Binary")
            self.cpost = self.var("c_post", cat="Binary")
        else:
            self.r = list(self.nb) if checkpoint == "all" else [0] * stages
            self.cpre = self.cpost = 0
        self.q = self.var("q_tail", cat="Binary") if self.tail and stages > 1 else 1
        if not self.tail:
            self.cxa = self.cxb = 0
        elif auto:
            self.cxa = self.var("c_tail_last", cat="Binary")
            self.cxb = self.var("c_tail_prev", cat="Binary") if stages > 1 else 0
        elif checkpoint == "all":
            self.cxa, self.cxb = self.q, 1 - self.q
        else:
            self.cxa = self.cxb = 0

    def _add_selective_vars(self, checkpoint: str) -> None:
        """Selective recompute of the blocks' attention cores: ``s_k`` blocks, ``u_k`` "stage has
        one"; the last block row X: ``sxa`` (in the last stage) / ``sxb`` (ending stage p - 2)."""
        stages = self.p
        self.sel_blk = self.L > 0 and self.can_select(1)
        sel_x = self.tail and self.can_select(self.n - 2)
        self.s: list[Expr] = [0] * stages
        self.u: list[Expr] = [0] * stages
        self.sxa: Expr = 0
        self.sxb: Expr = 0
        if checkpoint == "auto":
            if self.sel_blk:
                self.s = [self.var(f"s_{k}", 0, self.ub[k], cat="Integer") for k in range(stages)]
                self.u = [self.var(f"u_{k}", cat="Binary") for k in range(stages)]
            if sel_x:
                self.sxa = self.var("s_tail_last", cat="Binary")
                self.sxb = self.var("s_tail_prev", cat="Binary") if stages > 1 else 0
        elif checkpoint == "selective":
            if self.sel_blk:
                self.s, self.u = list(self.nb), list(self.has)
            if sel_x:
                self.sxa, self.sxb = self.q, 1 - self.q

    def _tail_share(self, k: int) -> tuple[Expr, Expr]:
        """(in stage k, recomputed in stage k) expressions of the last block row X."""
        if not self.tail:
            return 0, 0
        if k == self.p - 1:
            return self.q, self.cxa
        if k == self.p - 2:
            return 1 - self.q, self.cxb
        return 0, 0

    def stage_sum(self, k: int, f: LayerField) -> Expr:
        total = f(self.blk) * self.nb[k] + f(self.X) * self._tail_share(k)[0]
        if k == 0:
            total = total + f(self.pre)
        if k == self.p - 1:
            total = total + f(self.post)
        return total

    def _tail_sel(self, k: int) -> Expr:
        """The last block row X recomputing selectively in stage k."""
        return self.sxa if k == self.p - 1 else self.sxb if k == self.p - 2 else 0

    def stage_sel_sum(self, k: int, f: LayerField) -> Expr:
        total: Expr = 0
        if self.sel_blk:
            total = f(self.blk) * self.s[k]
        if not _is_zero(self._tail_sel(k)):
            total = total + f(self.X) * self._tail_sel(k)
        return total

    def stage_rec_sum(self, k: int, f: LayerField) -> Expr:
        total = f(self.blk) * self.r[k] + f(self.X) * self._tail_share(k)[1]
        if k == 0:
            total = total + f(self.pre) * self.cpre
        if k == self.p - 1:
            total = total + f(self.post) * self.cpost
        return total

    def _boundary(self, j: int) -> Expr:
        send = self.costs.send_s
        run, pre, last_block = send(1, j), send(0, j), send(self.n - 2, j)
        if self.tail and j == self.p - 2:
            if j > 0:
                return last_block + (run - last_block) * self.q
            return last_block * (1 - self.q) + run * self.w + pre * (self.q - self.w)
        if j > 0:
            return run
        return pre + (run - pre) * self.z0

    def p2p(self, k: int) -> Expr:
        total: Expr = 0
        if k < self.p - 1:
            total = total + self._boundary(k)
        if k > 0:
            total = total + self._boundary(k - 1)
        return total

    def held_terms(self, k: int, f: LayerField) -> list[tuple[Expr, float]]:
        """``(indicator, f(layer))`` for each kind of layer stage ``k`` may hold."""
        terms = [(self.has[k], f(self.blk))] if self.L else []
        terms.append((self._tail_share(k)[0], f(self.X) if self.tail else 0))
        if k == 0:
            terms.append((1, f(self.pre)))
        if k == self.p - 1:
            terms.append((1, f(self.post)))
        return terms

    def trans_terms(self, k: int) -> list[tuple[Expr, float]]:
        return [term for term in self.held_terms(k, lambda cost: cost.trans_b) if term[1] and not _is_zero(term[0])]

    def peak_terms(self, k: int) -> list[tuple[Expr, float]]:
        terms = [(self.v[k], self.blk.saved_b)] if self.mode in ("auto", "all") and self.L else []
        terms.append((self._tail_share(k)[1], self.X.saved_b if self.tail else 0))
        if self.mode == "auto" and k == 0:
            terms.append((self.cpre, self.pre.saved_b))
        if self.mode == "auto" and k == self.p - 1:
            terms.append((self.cpost, self.post.saved_b))
        if self.sel_blk:
            terms.append((self.u[k], self.blk.sel_saved_b))
        terms.append((self._tail_sel(k), self.X.sel_saved_b if self.tail else 0))
        terms += self.held_terms(k, lambda cost: cost.bt_b)  # backward transients of the layers held
        return [term for term in terms if term[1] and not _is_zero(term[0])]

    def decode(self) -> tuple[list[tuple[int, int]], set[int], set[int]]:
        """``(stages, recomputed layers, selectively recomputed layers)`` of the solution."""

        def value(expr: Expr) -> int:
            return int(round(pulp.value(expr)))

        counts = [value(blocks) for blocks in self.nb]
        recs = [value(recomputed) for recomputed in self.r]
        sels = [value(selected) for selected in self.s]
        last_in_last = value(self.q) if self.tail else 0
        stages: list[tuple[int, int]] = []
        recomputed: set[int] = set()
        selective: set[int] = set()
        start = 0
        for k in range(self.p):
            has_x = self.tail and ((k == self.p - 1 and last_in_last) or (k == self.p - 2 and not last_in_last))
            last = start + counts[k] + (k == 0) + (k == self.p - 1) + has_x - 1
            first_block = start + (k == 0)
            stages.append((start, last))
            recomputed.update(range(first_block, first_block + recs[k]))
            selective.update(range(first_block + recs[k], first_block + recs[k] + sels[k]))
            start = last + 1
        if value(self.cpre):
            recomputed.add(0)
        if value(self.cpost):
            recomputed.add(self.n - 1)
        if self.tail and value(self.cxa + self.cxb):
            recomputed.add(self.n - 2)
        if self.tail and value(self.sxa + self.sxb):
            selective.add(self.n - 2)
        return stages, recomputed, selective


#: The variables of one ILP, in either formulation.
IlpVars = _GeneralVars | _UniformVars


# ---------------------------------------------------------------------------------- families
def add_partition_constraints(prob: pulp.LpProblem, ilp: IlpVars) -> None:
    """Each layer in exactly one stage; stages contiguous, in order, none empty."""
    if isinstance(ilp, _UniformVars):
        prob += pulp.lpSum(ilp.nb) == ilp.L, "partition_blocks"
        for k in range(1, ilp.p - 1):
            prob += ilp.nb[k] + ilp._tail_share(k)[0] >= 1, f"partition_nonempty_k{k}"
        if ilp.tail and ilp.p > 1:  # a last stage without the last block holds the head alone
            prob += ilp.nb[-1] <= ilp.ub[-1] * ilp.q, "partition_head_alone"
        return
    for layer in range(ilp.n):
        prob += pulp.lpSum(ilp.x[(layer, k)] for k in ilp.window[layer]) == 1, f"partition_assign_l{layer}"
    stage_of = [pulp.lpSum(k * ilp.x[(layer, k)] for k in ilp.window[layer]) for layer in range(ilp.n)]
    for layer in range(ilp.n - 1):
        prob += stage_of[layer + 1] - stage_of[layer] >= 0, f"partition_order_l{layer}"
        prob += stage_of[layer + 1] - stage_of[layer] <= 1, f"partition_noskip_l{layer}"


def add_boundary_constraints(prob: pulp.LpProblem, ilp: IlpVars) -> None:
    """Which layer ends each stage (its output is what crosses the boundary)."""
    if isinstance(ilp, _UniformVars):
        if ilp.p > 1:
            prob += ilp.nb[0] <= ilp.ub[0] * ilp.z0, "boundary_first_has_block"
            prob += ilp.z0 <= ilp.nb[0], "boundary_first_no_block"
            prob += ilp.nb[-1] <= ilp.ub[-1] * ilp.ulast, "boundary_last_has_block"
        if ilp.w is not None:
            prob += ilp.w <= ilp.q, "boundary_first_tail_a"
            prob += ilp.w <= ilp.z0, "boundary_first_tail_b"
            prob += ilp.w >= ilp.q + ilp.z0 - 1, "boundary_first_tail_c"
        return
    for (layer, k), e in ilp.e.items():
        following = ilp.x.get((layer + 1, k), 0)
        prob += e >= ilp.x[(layer, k)] - following, f"boundary_end_l{layer}_k{k}"


def add_checkpoint_constraints(prob: pulp.LpProblem, ilp: IlpVars) -> None:
    """A layer recomputes (whole or its attention cores, not both) only where it is; a stage that
    recomputes pays one re-materialization."""
    if ilp.mode != "auto":
        return
    if isinstance(ilp, _UniformVars):
        for k in range(ilp.p):
            prob += ilp.r[k] + ilp.s[k] <= ilp.nb[k], f"checkpoint_within_k{k}"
            prob += ilp.r[k] <= ilp.ub[k] * ilp.v[k], f"checkpoint_any_k{k}"
            if ilp.sel_blk:
                prob += ilp.s[k] <= ilp.ub[k] * ilp.u[k], f"checkpoint_selective_any_k{k}"
        if ilp.tail:
            prob += ilp.cxa + ilp.sxa <= ilp.q, "checkpoint_tail_last"
            if ilp.p > 1:
                prob += ilp.cxb + ilp.sxb <= 1 - ilp.q, "checkpoint_tail_prev"
        return
    for (layer, k), recomputes in ilp.c.items():
        prob += recomputes + ilp.y.get((layer, k), 0) <= ilp.x[(layer, k)], f"checkpoint_l{layer}_k{k}"


def stage_micro_steps(ilp: IlpVars) -> list[Expr]:
    """Each stage's micro-step (unscaled): its layers' work, recompute and transfers; built once
    per problem (the objective, the cutoff row and the ``T`` rows share them)."""
    if ilp.micro_steps is None:
        ilp.micro_steps = [
            ilp.stage_sum(k, lambda cost: cost.work_s + cost.zero_mb_s)
            + ilp.stage_rec_sum(k, lambda cost: cost.rec_s)
            + ilp.stage_sel_sum(k, lambda cost: cost.sel_rec_s)
            + ilp.p2p(k)
            for k in range(ilp.p)
        ]
    return ilp.micro_steps


def step_time_expr(ilp: IlpVars) -> Expr:
    """The scaled step time ``(m - 1) T + sum_k T_k + D`` (``T`` bounds every ``T_k``)."""
    return (ilp.m - 1) * ilp.T + ilp.scale * pulp.lpSum(stage_micro_steps(ilp)) + ilp.D


def add_time_constraints(prob: pulp.LpProblem, ilp: IlpVars) -> None:
    """``T`` bounds every stage's micro-step, ``D`` every stage's exposed tail."""
    for k, work in enumerate(stage_micro_steps(ilp)):
        prob += ilp.T >= ilp.scale * work, f"time_microstep_k{k}"
        prob += ilp.D >= ilp.stage_sum(k, lambda cost: ilp.scale * (cost.dp_step_s + cost.opt_s)), f"time_tail_k{k}"


def add_memory_constraints(prob: pulp.LpProblem, ilp: IlpVars, bound: Expr | None = None) -> None:
    """Each stage's device memory (scaled by the capacity) at most ``bound`` (1 - margin if None)."""
    capacity = ilp.costs.capacity
    for k in range(ilp.p):
        zero_buffer = _var(prob, f"zero_buffer_{k}", 0)
        recompute_peak = _var(prob, f"recompute_peak_{k}", 0)
        for i, (indicator, size) in enumerate(ilp.trans_terms(k)):
            prob += zero_buffer >= (size / capacity) * indicator, f"memory_zero_buffer_k{k}_{i}"
        for i, (indicator, size) in enumerate(ilp.peak_terms(k)):
            prob += recompute_peak >= (size / capacity) * indicator, f"memory_recompute_peak_k{k}_{i}"
        in_flight = ilp.costs.inflight[k]
        memory = (
            ilp.stage_sum(k, lambda cost: (cost.state_b + in_flight * cost.saved_b) / capacity)
            - ilp.stage_rec_sum(k, lambda cost: in_flight * (cost.saved_b - cost.input_b) / capacity)
            - ilp.stage_sel_sum(k, lambda cost: in_flight * cost.sel_saved_b / capacity)
            + zero_buffer
            + recompute_peak
        )
        prob += memory <= (1 - MEMORY_MARGIN if bound is None else bound), f"memory_k{k}"
    add_offload_capacity_constraints(prob, ilp)


def add_offload_capacity_constraints(prob: pulp.LpProblem, ilp: IlpVars) -> None:
    """Each stage's offloaded state fits its rank's share of the node's host memory (after the
    pinned buffers) and NVMe (``cost_models.offload_cost``): rows ``memory_host_k{k}``,
    ``memory_nvme_k{k}``; none without offload."""
    costs = ilp.costs
    tiers: tuple[tuple[str, float, LayerField], ...] = (
        ("host", costs.host_room, lambda cost: cost.host_b),
        ("nvme", costs.nvme_room, lambda cost: cost.nvme_b),
    )
    for name, room, f in tiers:
        total = sum(n * f(cost) for cost, n in costs.distinct)
        if not math.isfinite(room) or total <= 0:
            continue
        for k in range(ilp.p):
            prob += (
                ilp.stage_sum(k, lambda cost: f(cost) / total) <= room / total * (1 - MEMORY_MARGIN),
                f"memory_{name}_k{k}",
            )


# ---------------------------------------------------------------------------------- solve
@dataclass
class ILPResult:
    """Outcome of one candidate's ILP."""

    evaluation: Evaluation | None
    """The optimal strategy priced by :func:`cost_models.strategy.evaluate` (None when infeasible)."""
    status: str
    seconds: float
    uniform: bool


def _tie_break(ilp: IlpVars) -> Expr:
    """Tie-breaks: less recompute and transfer time, then fewer recomputed layers (a layer whose
    recompute is free in the FLOP model, such as an embedding, is not recomputed for nothing)."""
    stages = range(ilp.p)
    return TIE_BREAK * ilp.scale * (
        pulp.lpSum(ilp.stage_rec_sum(k, lambda cost: cost.rec_s) for k in stages)
        + pulp.lpSum(ilp.stage_sel_sum(k, lambda cost: cost.sel_rec_s) for k in stages)
        + pulp.lpSum(ilp.p2p(k) for k in stages)
    ) + 0.1 * TIE_BREAK * OBJECTIVE_SCALE / ilp.n * pulp.lpSum(
        ilp.stage_rec_sum(k, lambda cost: 1.0) + ilp.stage_sel_sum(k, lambda cost: 0.5) for k in stages
    )


def build_problem(
    costs: CandidateCosts,
    kinds: list[str],
    checkpoint: str = "auto",
    objective: str = "time",
    formulation: str = "auto",
    cutoff: float | None = None,
) -> tuple[pulp.LpProblem, IlpVars]:
    """The ILP of one candidate (see the module docstring) and its variables.

    ``formulation``: ``"uniform"`` (block counts; needs identical blocks between a ``pre`` and a
    ``post`` row), ``"general"`` (one binary per layer and stage) or ``"auto"`` (uniform when it
    applies). ``objective``: ``"time"`` or ``"memory"`` (see :func:`solve_candidate`).
    ``cutoff`` (seconds, time objective only) adds the row ``time_cutoff``: step time at most
    ``cutoff``, so the solver can stop as soon as its bound proves the candidate cannot win.
    """
    if checkpoint not in ("auto", "none", "all", "selective"):
        raise ValueError(f"checkpoint must be auto, none, all or selective, got {checkpoint!r}")
    can_uniform = is_repeated(costs, kinds)
    if formulation == "uniform" and not can_uniform:
        raise ValueError("the uniform formulation needs identical blocks between a pre and a post row")
    if formulation not in ("auto", "uniform", "general"):
        raise ValueError(f"formulation must be auto, uniform or general, got {formulation!r}")
    uniform = can_uniform and formulation != "general"
    prob = pulp.LpProblem("plan", pulp.LpMinimize)
    ilp: IlpVars
    if uniform:
        ilp = _UniformVars(prob, costs, kinds, checkpoint, bounded=objective == "time")
    else:
        ilp = _GeneralVars(prob, costs, kinds, checkpoint)
    tie = _tie_break(ilp)
    bound = None
    step = step_time_expr(ilp)
    if objective == "time":
        prob += step + tie
    elif objective == "memory":
        bound = _var(prob, "M", 0)
        prob += OBJECTIVE_SCALE * bound + tie
    else:
        raise ValueError(f"objective must be 'time' or 'memory', got {objective!r}")
    add_partition_constraints(prob, ilp)
    add_boundary_constraints(prob, ilp)
    add_checkpoint_constraints(prob, ilp)
    add_time_constraints(prob, ilp)
    add_memory_constraints(prob, ilp, bound=bound)
    if cutoff is not None and objective == "time":
        prob += step <= ilp.scale * cutoff * (1 + CUTOFF_SLACK), "time_cutoff"
    return prob, ilp


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
    ``cutoff`` an infeasible answer means "nothing fits, or nothing is faster than the cutoff".

    ``solver``: pulp's CBC (default) or HiGHS (``"highs"``, needs ``highspy``; the environment
    variable ``PLANNER_SOLVER`` sets the default). The optimal partition is priced again with
    :func:`cost_models.strategy.evaluate`, which is what the plan reports.
    """
    started = time.perf_counter()
    prob, ilp = build_problem(costs, kinds, checkpoint, objective, formulation, cutoff)
    quiet = _quiet_stdout() if solver == "highs" else contextlib.nullcontext()
    with quiet:
        prob.solve(_make_solver(solver, time_limit))
    status = pulp.LpStatus[prob.status]
    if prob.sol_status == pulp.LpSolutionIntegerFeasible:  # stopped by the time limit
        status = "Feasible"
    evaluation = None
    if prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        stages, recomputed, selective = ilp.decode()
        evaluation = evaluate(costs, stages, sorted(recomputed), sorted(selective))
        if objective == "time" and not evaluation.feasible:  # within the solver's tolerance of the limit
            evaluation, status = None, "Infeasible"
    return ILPResult(evaluation, status, time.perf_counter() - started, ilp.uniform)


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
    notes: list[str] = field(default_factory=list)
    """What the model ruled out before the search (printed under the plan)."""
    answers: dict = field(default_factory=dict, repr=False)
    """Candidate -> its optimal strategy, for each ILP solved to a strategy (a cutoff only rules
    strategies out, so an answer found under one is the optimum): what the schedule post-pass
    would otherwise solve again."""

    @property
    def status(self) -> str:
        """``optimal``, or ``feasible`` when some ILP hit its time limit."""
        return "optimal" if not self.time_limited else f"feasible ({self.time_limited} ILPs hit the time limit)"

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
        self, entries: list[Entry], kinds: list[str], checkpoint: str, solver: str, keep: int, seed: SearchResult | None
    ):
        self.kinds, self.checkpoint, self.solver, self.keep = kinds, checkpoint, solver, keep
        self.result = SearchResult(ranked=[], enumerated=len(entries))
        self.order = sorted(entries, key=lambda entry: (entry.floor, entry.cand))
        self.best: dict[tuple, Evaluation] = {
            evaluation.strategy.candidate.mesh: evaluation for evaluation in (seed.ranked if seed else [])
        }
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
            threshold = times[self.keep - 1] if len(times) >= self.keep else float("inf")
            if entry.floor > threshold * (1 + TIME_TOL):  # so is every later one's (and its bound)
                result.pruned_time += (len(self.order) - i) * exact
                return
            costs = entry.costs
            if entry.memory_lb > costs.capacity:
                result.pruned_memory += exact
                continue
            triple = costs.cand.mesh
            bound = min(best[triple].step_time_s if triple in best else float("inf"), threshold)
            if entry.time_lb > bound * (1 + TIME_TOL):
                result.pruned_time += exact
                continue
            if exact and uniform_time_bound(costs, self.kinds, self.checkpoint) > bound * (1 + TIME_TOL):
                result.pruned_time += 1  # forced recompute (or no fit at all) makes it lose
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
            if entry.floor > bound * (1 + TIME_TOL) or entry.time_lb > bound * (1 + TIME_TOL):
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
) -> SearchResult:
    """Best strategies over ``entries`` (:class:`planner.search.entries.Entry`) with sound pruning.

    Keeps the best of each ``(dp, tp, pp)`` among the ``keep`` fastest triples; when fewer than
    ``keep`` triples are feasible, fills the runners-up with the best other candidates. A first
    pass prices greedy strategies (:func:`planner.search.candidates.heuristic_strategy`) to seed the
    incumbents; the second solves the ILPs with the incumbents as cutoffs.

    ``seed``: an earlier search over other candidates (the offload variants' search continues the
    plain one): its strategies are the starting incumbents, its counts carry over, and a strategy
    it ranked that loses its place to a new one stays a runner-up.

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
    state = _Search(entries, kinds, checkpoint, solver, keep, seed)
    result = state.result
    state.sweep(exact=False)
    state.sweep(exact=True)
    result.ranked = sorted(state.best.values(), key=_rank_key)
    need = keep - len(result.ranked)
    if result.ranked and need > 0:
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
    for counter in ("enumerated", "solved", "infeasible", "pruned_time", "pruned_memory", "time_limited"):
        setattr(result, counter, getattr(result, counter) + getattr(seed, counter))
    result.solver_seconds += seed.solver_seconds
    result.answers = {**seed.answers, **result.answers}
    result.uniform = result.uniform and seed.uniform
    result.notes = seed.notes + result.notes
