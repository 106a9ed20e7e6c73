"""The ILP of :mod:`planner.search.ilp` (its docstring has the rows), written in pulp and solved
by CBC or HiGHS: variables in either form (one binary per layer and stage, or block counts),
the constraint families, the objective. Imported only when an ILP is solved: a uniform table's
time objective is solved by counting (:mod:`planner.search.block_counts`), and pulp with its
solver interfaces costs 0.15-0.2 s to import."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import warnings
from typing import Any, Callable, Iterator

import pulp

from cost_models.strategy import CandidateCosts, Evaluation, LayerCost, evaluate
from planner.search.candidates import is_repeated
from planner.search.objective import (
    CUTOFF_SLACK,
    MEMORY_MARGIN,
    OBJECTIVE_SCALE,
    TIE_BREAK,
    block_capacity,
    count_weight,
    objective_scale,
)

__all__ = [
    "CBC_OPTIONS",
    "highs_available",
    "build_problem",
    "solve_ilp",
    "add_partition_constraints",
    "add_boundary_constraints",
    "add_checkpoint_constraints",
    "add_time_constraints",
    "add_memory_constraints",
    "add_offload_capacity_constraints",
]

#: The solver names (``planner.search.ilp.SOLVERS``; that module imports this one).
SOLVERS = ("cbc", "highs")

#: CBC's options. Cut generation off: these ILPs are small (O(p) integers in the uniform form) and
#: CBC's root cut loop was most of their time; branching closes them faster. On the 68 ILPs of
#: GPT-3 175B on 1,024 A100 they took 2.7 s with cuts and 1.1 s without (the 126-layer GQA model's
#: 39 on 8,192 H100: 1.6 s and 1.0 s), the same optima, no ILP more than 17% slower.
CBC_OPTIONS = ("cutsOnOff off",)


@functools.lru_cache(maxsize=None)
def highs_available() -> bool:
    try:
        return pulp.HiGHS().available()
    except Exception:  # pragma: no cover - depends on the installation
        return False


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
        # T and D are in units of 1/OBJECTIVE_SCALE of the step-time lower bound
        self.scale = objective_scale(costs)
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


def _tie_break(ilp: IlpVars) -> Expr:
    """Tie-breaks: less recompute and transfer time, then fewer recomputed layers (a layer whose
    recompute is free in the FLOP model, such as an embedding, is not recomputed for nothing)."""
    stages = range(ilp.p)
    return TIE_BREAK * ilp.scale * (
        pulp.lpSum(ilp.stage_rec_sum(k, lambda cost: cost.rec_s) for k in stages)
        + pulp.lpSum(ilp.stage_sel_sum(k, lambda cost: cost.sel_rec_s) for k in stages)
        + pulp.lpSum(ilp.p2p(k) for k in stages)
    ) + count_weight(ilp.costs) * pulp.lpSum(
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


def solve_ilp(
    costs: CandidateCosts,
    kinds: list[str],
    checkpoint: str,
    solver: str,
    objective: str,
    formulation: str,
    cutoff: float | None,
    time_limit: float | None,
) -> tuple[Evaluation | None, str, bool]:
    """The ILP of ``planner.search.ilp.solve_candidate``: its optimal strategy priced by
    :func:`cost_models.strategy.evaluate` (``None`` when infeasible), the status, and whether the
    uniform form was built."""
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
    return evaluation, status, ilp.uniform
