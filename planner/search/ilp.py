"""The planner's search: enumerate degrees and batching, solve partition + recompute as an ILP.

Search (:func:`search`)
-----------------------
The small decisions are enumerated (:func:`planner.search.candidates.enumerate_candidates`): ``dp * tp *
pp = gpus`` (``tp`` divides the heads and key/value heads and stays inside a node unless allowed
across nodes; ``pp`` at most the number of layer-table rows), ZeRO stage 0-3 (only 0 when ``dp =
1``, where they are all the same), micro-batch size ``b`` with ``m = global_batch / (dp * b)``
micro-batches and ``m >= pp`` (1F1B needs it). Pins remove the other values.

Candidates are visited in increasing order of a sound step-time lower bound
(:func:`planner.search.candidates.time_lower_bound`). The winner and three runners-up are wanted, each
the best of its own ``(dp, tp, pp)``, so a candidate matters only if it can beat ``bound =
min(best time of its triple, 4th best time over triples)``. Two passes:

1. greedy: price :func:`planner.search.candidates.heuristic_strategy` (a feasible strategy found without
   a solver) for each candidate still under the bound, to seed the incumbents;
2. exact: skip a candidate whose memory lower bound exceeds the capacity, or whose time bound,
   or memory-aware bound (:func:`planner.search.candidates.uniform_time_bound`, which counts the
   recompute each stage is forced into), is above ``bound``; otherwise solve its ILP with
   ``min(bound, own greedy cost)`` as a cutoff (row ``time_cutoff``), so a candidate that cannot
   win is refuted at the root. The loop stops at the first time bound above the 4th best.

Every skipped candidate provably costs at least what it is compared with, and a cut-off ILP
proves the same, so the result equals solving every candidate to optimality (a test compares
with exhaustive enumeration).

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

Pipeline schedules. The ILP prices 1F1B (``(m - 1) T + sum_k T_k``, the closed form above);
interleaved 1F1B and zero bubble (ZB-H1) are priced after the search on the strategies it kept,
from the runtime's simulated schedule with the same per-layer constants
(:mod:`planner.search.schedule_search`, :mod:`cost_models.schedule_cost`): same work, another bubble,
``v`` times the sends, more activations in flight.

Solvers: pulp's CBC (default) or HiGHS (``solver="highs"``, needs ``highspy``; the environment
variable ``PLANNER_SOLVER`` sets the default). The optimal partition is priced again with
:func:`cost_models.strategy.evaluate`, which is what the plan reports.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
import warnings
from dataclasses import dataclass, field

import pulp

from cost_models.strategy import Candidate, CandidateCosts, Evaluation, evaluate
from planner.search.candidates import heuristic_strategy, is_repeated, time_lower_bound, uniform_time_bound
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
]

SOLVERS = ("cbc", "highs")
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


def _make_solver(name: str, time_limit: float | None):
    if name == "cbc":
        with warnings.catch_warnings():  # PuLP 3.3 deprecates the bundled-CBC class name only
            warnings.simplefilter("ignore", DeprecationWarning)
            return pulp.PULP_CBC_CMD(msg=False, gapRel=1e-9, timeLimit=time_limit)
    if name == "highs":
        if not highs_available():
            raise ValueError("solver 'highs' needs the highspy package: pip install highspy (or use 'cbc')")
        return pulp.HiGHS(msg=False, gapRel=1e-9, timeLimit=time_limit)
    raise ValueError(f"unknown solver {name!r}: expected one of {', '.join(SOLVERS)}")


def _var(prob: pulp.LpProblem, name: str, low=None, up=None, cat: str = "Continuous") -> pulp.LpVariable:
    """A variable attached to ``prob`` (PuLP >= 3.3 API, with a fallback for older PuLP)."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, low, up, cat=cat)
    return pulp.LpVariable(name, low, up, cat=cat)


@contextlib.contextmanager
def _quiet_stdout():
    """HiGHS prints a banner on stdout even with ``msg=False``; ``--json`` output must stay clean."""
    try:
        fd = os.dup(1)
    except OSError:  # pragma: no cover - no stdout
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            try:
                yield
            finally:
                os.dup2(fd, 1)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------- variables
class _Vars:
    """Variables of one ILP and the linear expressions the constraint families read."""

    uniform = False

    def __init__(self, prob: pulp.LpProblem, cc: CandidateCosts, kinds: list[str], checkpoint: str):
        self.prob, self.cc, self.kinds, self.mode = prob, cc, kinds, checkpoint
        self.p, self.m, self.n = cc.cand.pp, cc.cand.num_micro_batches, cc.num_layers
        # T and D are in units of 1/OBJECTIVE_SCALE of the step-time lower bound, so relative
        # differences of 1e-6 stay far above the solver's absolute tolerances
        self.scale = OBJECTIVE_SCALE / max(time_lower_bound(cc), 1e-30)
        self.T = self.var("T", 0)
        self.D = self.var("D", 0)
        self.micro_steps: list | None = None
        """Each stage's micro-step expression (``stage_micro_steps``), built once."""

    def var(self, name, low=None, up=None, cat="Continuous"):
        return _var(self.prob, name, low, up, cat)

    def can_select(self, l: int) -> bool:
        """Layer ``l`` may recompute selectively under this mode (it has attention cores; the
        ``selective`` pin covers the blocks)."""
        if self.cc.layers[l].sel_saved_b <= 0 or self.mode in ("none", "all"):
            return False
        return self.mode == "auto" or self.kinds[l] == "block"


class _GeneralVars(_Vars):
    """One binary per (layer, stage): any layer table."""

    def __init__(self, prob, cc, kinds, checkpoint):
        super().__init__(prob, cc, kinds, checkpoint)
        n, p = self.n, self.p
        self.window = [range(max(0, p - n + l), min(p - 1, l) + 1) for l in range(n)]
        self.members = [[l for l in range(n) if k in self.window[l]] for k in range(p)]
        self.x = {(l, k): self.var(f"x_{l}_{k}", cat="Binary") for l in range(n) for k in self.window[l]}
        self.c = {}
        if checkpoint == "auto":
            self.c = {lk: self.var(f"c_{lk[0]}_{lk[1]}", cat="Binary") for lk in self.x}
        self.y = {}
        if checkpoint == "auto":
            self.y = {lk: self.var(f"y_{lk[0]}_{lk[1]}", cat="Binary") for lk in self.x if self.can_select(lk[0])}
        elif checkpoint == "selective":
            self.y = {lk: self.x[lk] for lk in self.x if self.can_select(lk[0])}
        self.e = {
            (l, k): self.var(f"e_{l}_{k}", 0, 1)
            for (l, k) in self.x
            if k < p - 1 and l + 1 < n and k + 1 in self.window[l + 1]
        }
        self.ends = [[(l, e) for (l, kk), e in self.e.items() if kk == k] for k in range(p)]

    def rec(self, l, k):
        if self.mode == "auto":
            return self.c[(l, k)]
        if self.mode == "all" and self.kinds[l] == "block":
            return self.x[(l, k)]
        return None

    def stage_sum(self, k, f):
        L = self.cc.layers
        return pulp.lpSum(f(L[l]) * self.x[(l, k)] for l in self.members[k] if f(L[l]))

    def stage_rec_sum(self, k, f):
        L = self.cc.layers
        return pulp.lpSum(f(L[l]) * r for l in self.members[k] if (r := self.rec(l, k)) is not None and f(L[l]))

    def stage_sel_sum(self, k, f):
        L = self.cc.layers
        return pulp.lpSum(f(L[l]) * y for l in self.members[k] if (y := self.y.get((l, k))) is not None and f(L[l]))

    def p2p(self, k):
        send = self.cc.send_s
        terms = [send(l, k) * e for l, e in self.ends[k]] if k < self.p - 1 else []
        if k > 0:
            terms += [send(l, k - 1) * e for l, e in self.ends[k - 1]]
        return pulp.lpSum(terms)

    def held_terms(self, k, f):
        """``(x[l, k], f(layer l))`` for each layer stage ``k`` may hold (nonzero values)."""
        return [(self.x[(l, k)], v) for l in self.members[k] if (v := f(self.cc.layers[l]))]

    def trans_terms(self, k):
        return self.held_terms(k, lambda c: c.trans_b)

    def peak_terms(self, k):
        L = self.cc.layers
        rec = [(r, L[l].saved_b) for l in self.members[k] if (r := self.rec(l, k)) is not None and L[l].saved_b]
        rec += [(y, L[l].sel_saved_b) for l in self.members[k] if (y := self.y.get((l, k))) is not None]
        return rec + self.held_terms(k, lambda c: c.bt_b)

    def decode(self):
        stage_of = [next(k for k in self.window[l] if self.x[(l, k)].value() > 0.5) for l in range(self.n)]
        stages = []
        for k in range(self.p):
            ls = [l for l in range(self.n) if stage_of[l] == k]
            stages.append((ls[0], ls[-1]))
        ck = {l for l in range(self.n) if (r := self.rec(l, stage_of[l])) is not None and pulp.value(r) > 0.5}
        sel = {l for l in range(self.n) if (y := self.y.get((l, stage_of[l]))) is not None and pulp.value(y) > 0.5}
        return stages, ck, sel


def block_capacity(cc: CandidateCosts) -> list[int]:
    """Most blocks each stage can hold in a uniform table (a valid bound that tightens the ILP).

    Stage ``k`` with ``n`` blocks needs at least ``n (st + a_k min(sv, in, sv - sel))`` plus the state and
    least activations of the embedding / head rows it holds, whatever it recomputes, so ``n_k <=
    (capacity - fixed_k) / (st + a_k min(sv, in))``; never more than ``L``.
    """
    p, L = cc.cand.pp, cc.num_layers - 2
    pre, blk, post = cc.layers[0], cc.layers[1], cc.layers[-1]
    out = []
    for k in range(p):
        a = cc.inflight[k]
        fixed = 0.0
        for row, here in ((pre, k == 0), (post, k == p - 1)):
            if here:
                fixed += row.state_b + a * min(row.saved_b, row.input_b)
        per = blk.state_b + a * min(blk.saved_b, blk.input_b, blk.saved_b - blk.sel_saved_b)
        room = cc.capacity - fixed
        n = L if per <= 0 else int(max(-1.0, math.floor(room / per * (1 + 1e-12))))
        out.append(max(0, min(L, n)) if room >= 0 else -1)
    return out


def _is_zero(e) -> bool:
    return isinstance(e, (int, float)) and e == 0


class _UniformVars(_Vars):
    """Integer block counts per stage: identical blocks between the embedding and head rows.

    When the last block differs from the others (HF models hand the head less than a block
    hands the next block), it is a separate row ``X``: in the last stage (``q = 1``), or ending
    stage ``p - 2`` while the last stage holds the head alone (``q = 0``).
    """

    uniform = True

    def __init__(self, prob, cc, kinds, checkpoint, bounded=True):
        super().__init__(prob, cc, kinds, checkpoint)
        p = self.p
        self.tail = cc.layers[-2] != cc.layers[1]
        self.L = L = self.n - 2 - self.tail
        self.pre, self.blk, self.post, self.X = cc.layers[0], cc.layers[1], cc.layers[-1], cc.layers[-2]
        # the capacity bounds n_k only when memory is a limit (not when it is the objective)
        self.ub = [min(u, L) for u in block_capacity(cc)] if bounded else [L] * p
        self.nb = [self.var(f"n_{k}", 0, self.ub[k], cat="Integer") for k in range(p)]
        auto = checkpoint == "auto"
        if auto:
            self.r = [self.var(f"r_{k}", 0, self.ub[k], cat="Integer") for k in range(p)]
            self.v = [self.var(f"v_{k}", cat="Binary") for k in range(p)]
            self.cpre = self.var("c_pre", cat="Binary")
            self.cpost = self.var("c_post", cat="Binary")
        else:
            self.r = list(self.nb) if checkpoint == "all" else [0] * p
            self.cpre = self.cpost = 0
        self.q = self.var("q_tail", cat="Binary") if self.tail and p > 1 else 1
        if not self.tail:
            self.cxa = self.cxb = 0
        elif auto:
            self.cxa = self.var("c_tail_last", cat="Binary")
            self.cxb = self.var("c_tail_prev", cat="Binary") if p > 1 else 0
        elif checkpoint == "all":
            self.cxa, self.cxb = self.q, 1 - self.q
        else:
            self.cxa = self.cxb = 0
        # has-blocks indicators of the end stages (middle stages always hold a block)
        self.z0 = self.var("z_first", cat="Binary") if p > 1 else 1
        self.ulast = self.var("u_last", cat="Binary") if p > 1 else 1
        self.has = [self.z0 if k == 0 else self.ulast if k == p - 1 else 1 for k in range(p)]
        if checkpoint == "all":
            self.v = list(self.has)
        # selective recompute of the blocks' attention cores: s_k blocks, u_k "stage has one";
        # the last block row X: sxa (in the last stage) / sxb (ending stage p - 2)
        self.sel_blk = self.L > 0 and self.can_select(1)
        sel_x = self.tail and self.can_select(self.n - 2)
        self.s, self.u = [0] * p, [0] * p
        self.sxa = self.sxb = 0
        if checkpoint == "auto":
            if self.sel_blk:
                self.s = [self.var(f"s_{k}", 0, self.ub[k], cat="Integer") for k in range(p)]
                self.u = [self.var(f"u_{k}", cat="Binary") for k in range(p)]
            if sel_x:
                self.sxa = self.var("s_tail_last", cat="Binary")
                self.sxb = self.var("s_tail_prev", cat="Binary") if p > 1 else 0
        elif checkpoint == "selective":
            if self.sel_blk:
                self.s, self.u = list(self.nb), list(self.has)
            if sel_x:
                self.sxa, self.sxb = self.q, 1 - self.q
        # stage 0 of two ends with a run block: q and z0 (linearized product)
        self.w = self.var("w_first_tail", cat="Binary") if self.tail and p == 2 else None

    def _tail_share(self, k):
        """(in stage k, recomputed in stage k) expressions of the last block row X."""
        if not self.tail:
            return 0, 0
        if k == self.p - 1:
            return self.q, self.cxa
        if k == self.p - 2:
            return 1 - self.q, self.cxb
        return 0, 0

    def stage_sum(self, k, f):
        e = f(self.blk) * self.nb[k] + f(self.X) * self._tail_share(k)[0]
        if k == 0:
            e = e + f(self.pre)
        if k == self.p - 1:
            e = e + f(self.post)
        return e

    def _tail_sel(self, k):
        """The last block row X recomputing selectively in stage k."""
        return self.sxa if k == self.p - 1 else self.sxb if k == self.p - 2 else 0

    def stage_sel_sum(self, k, f):
        e = 0
        if self.sel_blk:
            e = f(self.blk) * self.s[k]
        if not _is_zero(self._tail_sel(k)):
            e = e + f(self.X) * self._tail_sel(k)
        return e

    def stage_rec_sum(self, k, f):
        e = f(self.blk) * self.r[k] + f(self.X) * self._tail_share(k)[1]
        if k == 0:
            e = e + f(self.pre) * self.cpre
        if k == self.p - 1:
            e = e + f(self.post) * self.cpost
        return e

    def _boundary(self, j):
        send = self.cc.send_s
        run, pre, x = send(1, j), send(0, j), send(self.n - 2, j)
        if self.tail and j == self.p - 2:
            if j > 0:
                return x + (run - x) * self.q
            return x * (1 - self.q) + run * self.w + pre * (self.q - self.w)
        if j > 0:
            return run
        return pre + (run - pre) * self.z0

    def p2p(self, k):
        e = 0
        if k < self.p - 1:
            e = e + self._boundary(k)
        if k > 0:
            e = e + self._boundary(k - 1)
        return e

    def held_terms(self, k, f):
        """``(indicator, f(layer))`` for each kind of layer stage ``k`` may hold."""
        out = [(self.has[k], f(self.blk))] if self.L else []
        out.append((self._tail_share(k)[0], f(self.X) if self.tail else 0))
        if k == 0:
            out.append((1, f(self.pre)))
        if k == self.p - 1:
            out.append((1, f(self.post)))
        return out

    def trans_terms(self, k):
        return [t for t in self.held_terms(k, lambda c: c.trans_b) if t[1] and not _is_zero(t[0])]

    def peak_terms(self, k):
        out = [(self.v[k], self.blk.saved_b)] if self.mode in ("auto", "all") and self.L else []
        out.append((self._tail_share(k)[1], self.X.saved_b if self.tail else 0))
        if self.mode == "auto" and k == 0:
            out.append((self.cpre, self.pre.saved_b))
        if self.mode == "auto" and k == self.p - 1:
            out.append((self.cpost, self.post.saved_b))
        if self.sel_blk:
            out.append((self.u[k], self.blk.sel_saved_b))
        out.append((self._tail_sel(k), self.X.sel_saved_b if self.tail else 0))
        out += self.held_terms(k, lambda c: c.bt_b)  # backward transients of the layers held
        return [t for t in out if t[1] and not _is_zero(t[0])]

    def decode(self):
        val = lambda e: int(round(pulp.value(e)))  # noqa: E731
        counts = [val(v) for v in self.nb]
        recs = [val(r) for r in self.r]
        sels = [val(x) for x in self.s]
        q = val(self.q) if self.tail else 0
        stages, ck, sel, start = [], set(), set(), 0
        for k in range(self.p):
            has_x = self.tail and ((k == self.p - 1 and q) or (k == self.p - 2 and not q))
            last = start + counts[k] + (k == 0) + (k == self.p - 1) + has_x - 1
            first_block = start + (k == 0)
            stages.append((start, last))
            ck.update(range(first_block, first_block + recs[k]))
            sel.update(range(first_block + recs[k], first_block + recs[k] + sels[k]))
            start = last + 1
        if val(self.cpre):
            ck.add(0)
        if val(self.cpost):
            ck.add(self.n - 1)
        if self.tail and val(self.cxa + self.cxb):
            ck.add(self.n - 2)
        if self.tail and val(self.sxa + self.sxb):
            sel.add(self.n - 2)
        return stages, ck, sel


# ---------------------------------------------------------------------------------- families
def add_partition_constraints(prob: pulp.LpProblem, v: _Vars) -> None:
    """Each layer in exactly one stage; stages contiguous, in order, none empty."""
    if v.uniform:
        prob += pulp.lpSum(v.nb) == v.L, "partition_blocks"
        for k in range(1, v.p - 1):
            prob += v.nb[k] + v._tail_share(k)[0] >= 1, f"partition_nonempty_k{k}"
        if v.tail and v.p > 1:  # a last stage without the last block holds the head alone
            prob += v.nb[-1] <= v.ub[-1] * v.q, "partition_head_alone"
        return
    for l in range(v.n):
        prob += pulp.lpSum(v.x[(l, k)] for k in v.window[l]) == 1, f"partition_assign_l{l}"
    s = [pulp.lpSum(k * v.x[(l, k)] for k in v.window[l]) for l in range(v.n)]
    for l in range(v.n - 1):
        prob += s[l + 1] - s[l] >= 0, f"partition_order_l{l}"
        prob += s[l + 1] - s[l] <= 1, f"partition_noskip_l{l}"


def add_boundary_constraints(prob: pulp.LpProblem, v: _Vars) -> None:
    """Which layer ends each stage (its output is what crosses the boundary)."""
    if v.uniform:
        if v.p > 1:
            prob += v.nb[0] <= v.ub[0] * v.z0, "boundary_first_has_block"
            prob += v.z0 <= v.nb[0], "boundary_first_no_block"
            prob += v.nb[-1] <= v.ub[-1] * v.ulast, "boundary_last_has_block"
        if v.w is not None:
            prob += v.w <= v.q, "boundary_first_tail_a"
            prob += v.w <= v.z0, "boundary_first_tail_b"
            prob += v.w >= v.q + v.z0 - 1, "boundary_first_tail_c"
        return
    for (l, k), e in v.e.items():
        nxt = v.x.get((l + 1, k), 0)
        prob += e >= v.x[(l, k)] - nxt, f"boundary_end_l{l}_k{k}"


def add_checkpoint_constraints(prob: pulp.LpProblem, v: _Vars) -> None:
    """A layer recomputes (whole or its attention cores, not both) only where it is; a stage that
    recomputes pays one re-materialization."""
    if v.mode != "auto":
        return
    if v.uniform:
        for k in range(v.p):
            prob += v.r[k] + v.s[k] <= v.nb[k], f"checkpoint_within_k{k}"
            prob += v.r[k] <= v.ub[k] * v.v[k], f"checkpoint_any_k{k}"
            if v.sel_blk:
                prob += v.s[k] <= v.ub[k] * v.u[k], f"checkpoint_selective_any_k{k}"
        if v.tail:
            prob += v.cxa + v.sxa <= v.q, "checkpoint_tail_last"
            if v.p > 1:
                prob += v.cxb + v.sxb <= 1 - v.q, "checkpoint_tail_prev"
        return
    for (l, k), c in v.c.items():
        prob += c + v.y.get((l, k), 0) <= v.x[(l, k)], f"checkpoint_l{l}_k{k}"


def stage_micro_steps(v: _Vars) -> list:
    """Each stage's micro-step (unscaled): its layers' work, recompute and transfers; built once
    per problem (the objective, the cutoff row and the ``T`` rows share them)."""
    if v.micro_steps is None:
        v.micro_steps = [
            v.stage_sum(k, lambda c: c.work_s + c.zero_mb_s)
            + v.stage_rec_sum(k, lambda c: c.rec_s)
            + v.stage_sel_sum(k, lambda c: c.sel_rec_s)
            + v.p2p(k)
            for k in range(v.p)
        ]
    return v.micro_steps


def step_time_expr(v: _Vars):
    """The scaled step time ``(m - 1) T + sum_k T_k + D`` (``T`` bounds every ``T_k``)."""
    return (v.m - 1) * v.T + v.scale * pulp.lpSum(stage_micro_steps(v)) + v.D


def add_time_constraints(prob: pulp.LpProblem, v: _Vars) -> None:
    """``T`` bounds every stage's micro-step, ``D`` every stage's exposed tail."""
    for k, work in enumerate(stage_micro_steps(v)):
        prob += v.T >= v.scale * work, f"time_microstep_k{k}"
        prob += v.D >= v.stage_sum(k, lambda c: v.scale * (c.dp_step_s + c.opt_s)), f"time_tail_k{k}"


def add_memory_constraints(prob: pulp.LpProblem, v: _Vars, bound=None) -> None:
    """Each stage's device memory (scaled by the capacity) at most ``bound`` (1 - margin if None)."""
    cap = v.cc.capacity
    for k in range(v.p):
        tr = _var(prob, f"zero_buffer_{k}", 0)
        pk = _var(prob, f"recompute_peak_{k}", 0)
        for i, (ind, val) in enumerate(v.trans_terms(k)):
            prob += tr >= (val / cap) * ind, f"memory_zero_buffer_k{k}_{i}"
        for i, (ind, val) in enumerate(v.peak_terms(k)):
            prob += pk >= (val / cap) * ind, f"memory_recompute_peak_k{k}_{i}"
        a = v.cc.inflight[k]
        mem = (
            v.stage_sum(k, lambda c: (c.state_b + a * c.saved_b) / cap)
            - v.stage_rec_sum(k, lambda c: a * (c.saved_b - c.input_b) / cap)
            - v.stage_sel_sum(k, lambda c: a * c.sel_saved_b / cap)
            + tr
            + pk
        )
        prob += mem <= (1 - MEMORY_MARGIN if bound is None else bound), f"memory_k{k}"
    add_offload_capacity_constraints(prob, v)


def add_offload_capacity_constraints(prob: pulp.LpProblem, v: _Vars) -> None:
    """Each stage's offloaded state fits its rank's share of the node's host memory (after the
    pinned buffers) and NVMe (``cost_models.offload_cost``): rows ``memory_host_k{k}``,
    ``memory_nvme_k{k}``; none without offload."""
    cc = v.cc
    for name, room, f in (("host", cc.host_room, lambda c: c.host_b), ("nvme", cc.nvme_room, lambda c: c.nvme_b)):
        total = sum(n * f(c) for c, n in cc.distinct)
        if not math.isfinite(room) or total <= 0:
            continue
        for k in range(v.p):
            prob += v.stage_sum(k, lambda c: f(c) / total) <= room / total * (1 - MEMORY_MARGIN), f"memory_{name}_k{k}"


# ---------------------------------------------------------------------------------- solve
@dataclass
class ILPResult:
    """Outcome of one candidate's ILP."""

    evaluation: Evaluation | None
    """The optimal strategy priced by :func:`cost_models.strategy.evaluate` (None when infeasible)."""
    status: str
    seconds: float
    uniform: bool


def build_problem(
    cc: CandidateCosts,
    kinds: list[str],
    checkpoint: str = "auto",
    objective: str = "time",
    formulation: str = "auto",
    cutoff: float | None = None,
) -> tuple[pulp.LpProblem, _Vars]:
    """The ILP of one candidate (see the module docstring) and its variables.

    ``formulation``: ``"uniform"`` (block counts; needs identical blocks between a ``pre`` and a
    ``post`` row), ``"general"`` (one binary per layer and stage) or ``"auto"`` (uniform when it
    applies). ``objective``: ``"time"`` or ``"memory"`` (see :func:`solve_candidate`).
    ``cutoff`` (seconds, time objective only) adds the row ``time_cutoff``: step time at most
    ``cutoff``, so the solver can stop as soon as its bound proves the candidate cannot win.
    """
    if checkpoint not in ("auto", "none", "all", "selective"):
        raise ValueError(f"checkpoint must be auto, none, all or selective, got {checkpoint!r}")
    can_uniform = is_repeated(cc, kinds)
    if formulation == "uniform" and not can_uniform:
        raise ValueError("the uniform formulation needs identical blocks between a pre and a post row")
    if formulation not in ("auto", "uniform", "general"):
        raise ValueError(f"formulation must be auto, uniform or general, got {formulation!r}")
    uniform = can_uniform and formulation != "general"
    prob = pulp.LpProblem("plan", pulp.LpMinimize)
    if uniform:
        v = _UniformVars(prob, cc, kinds, checkpoint, bounded=objective == "time")
    else:
        v = _GeneralVars(prob, cc, kinds, checkpoint)
    p = v.p
    # tie-breaks: less recompute and transfer time, then fewer recomputed layers (a layer whose
    # recompute is free in the FLOP model, such as an embedding, is not recomputed for nothing)
    tie = TIE_BREAK * v.scale * (
        pulp.lpSum(v.stage_rec_sum(k, lambda c: c.rec_s) for k in range(p))
        + pulp.lpSum(v.stage_sel_sum(k, lambda c: c.sel_rec_s) for k in range(p))
        + pulp.lpSum(v.p2p(k) for k in range(p))
    ) + 0.1 * TIE_BREAK * OBJECTIVE_SCALE / v.n * pulp.lpSum(
        v.stage_rec_sum(k, lambda c: 1.0) + v.stage_sel_sum(k, lambda c: 0.5) for k in range(p)
    )
    bound = None
    step = step_time_expr(v)
    if objective == "time":
        prob += step + tie
    elif objective == "memory":
        bound = _var(prob, "M", 0)
        prob += OBJECTIVE_SCALE * bound + tie
    else:
        raise ValueError(f"objective must be 'time' or 'memory', got {objective!r}")
    add_partition_constraints(prob, v)
    add_boundary_constraints(prob, v)
    add_checkpoint_constraints(prob, v)
    add_time_constraints(prob, v)
    add_memory_constraints(prob, v, bound=bound)
    if cutoff is not None and objective == "time":
        prob += step <= v.scale * cutoff * (1 + CUTOFF_SLACK), "time_cutoff"
    return prob, v


def solve_candidate(
    cc: CandidateCosts,
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
    """
    t0 = time.perf_counter()
    prob, v = build_problem(cc, kinds, checkpoint, objective, formulation, cutoff)
    ctx = _quiet_stdout() if solver == "highs" else contextlib.nullcontext()
    with ctx:
        prob.solve(_make_solver(solver, time_limit))
    status = pulp.LpStatus[prob.status]
    if prob.sol_status == pulp.LpSolutionIntegerFeasible:  # stopped by the time limit
        status = "Feasible"
    ev = None
    if prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        stages, ck, sel = v.decode()
        ev = evaluate(cc, stages, sorted(ck), sorted(sel))
        if objective == "time" and not ev.feasible:  # within the solver's tolerance of the limit
            ev, status = None, "Infeasible"
    return ILPResult(ev, status, time.perf_counter() - t0, v.uniform)


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

    @property
    def status(self) -> str:
        """``optimal``, or ``feasible`` when some ILP hit its time limit."""
        return "optimal" if not self.time_limited else f"feasible ({self.time_limited} ILPs hit the time limit)"

    @property
    def best(self) -> Evaluation | None:
        return self.ranked[0] if self.ranked else None

    def alternatives(self, n: int = 3) -> list[Evaluation]:
        return (self.ranked[1:] + self.extra)[:n]


def _better(a: Evaluation, b: Evaluation | None) -> bool:
    if b is None:
        return True
    if a.step_time_s < b.step_time_s * (1 - TIME_TOL):
        return True
    if a.step_time_s <= b.step_time_s * (1 + TIME_TOL):
        return _tie_key(a) < _tie_key(b)
    return False


def _tie_key(e: Evaluation):
    """Among equally fast strategies: state on the device first (offload then only costs host
    memory and drives, and its transfers rarely hide as fully as priced), then less memory."""
    return (e.strategy.candidate.offloads, e.memory["total"], e.strategy.candidate)


def _rank_key(e: Evaluation):
    return (e.step_time_s, *_tie_key(e))


def search(
    entries: list[tuple[float, float, CandidateCosts]],
    kinds: list[str],
    checkpoint: str = "auto",
    solver: str = "cbc",
    keep: int = 4,
    seed: SearchResult | None = None,
) -> SearchResult:
    """Best strategies over ``entries`` = ``(time_lb, memory_lb, costs)`` with sound pruning.

    Keeps the best of each ``(dp, tp, pp)`` among the ``keep`` fastest triples; when fewer than
    ``keep`` triples are feasible, fills the runners-up with the best other candidates. A first
    pass prices greedy strategies (:func:`planner.search.candidates.heuristic_strategy`) to seed the
    incumbents; the second solves the ILPs with the incumbents as cutoffs.

    ``seed``: an earlier search over other candidates (the offload variants' search continues the
    plain one): its strategies are the starting incumbents, its counts carry over, and a strategy
    it ranked that loses its place to a new one stays a runner-up.
    """
    t0 = time.perf_counter()
    res = SearchResult(ranked=[], enumerated=len(entries))
    order = sorted(entries, key=lambda e: (e[0], e[2].cand))
    best: dict[tuple, Evaluation] = {e.strategy.candidate.degrees: e for e in (seed.ranked if seed else [])}

    heur: dict[Candidate, Evaluation | None] = {}

    def greedy(cc: CandidateCosts) -> Evaluation | None:
        if cc.cand not in heur:
            heur[cc.cand] = heuristic_strategy(cc, kinds, checkpoint)
        return heur[cc.cand]

    def run(cc: CandidateCosts, cutoff: float) -> Evaluation | None:
        # the greedy strategy's cost tightens the cutoff the ILP must beat
        h = greedy(cc)
        if h is not None:
            cutoff = min(cutoff, h.step_time_s)
        r = solve_candidate(cc, kinds, checkpoint, solver, cutoff=None if cutoff == float("inf") else cutoff)
        res.solved += 1
        res.solver_seconds += r.seconds
        res.uniform = res.uniform and r.uniform
        res.time_limited += r.status == "Feasible"
        ev = r.evaluation
        if h is not None and (ev is None or _better(h, ev)):
            ev = h
        if ev is None:
            res.infeasible += 1
        return ev

    def sweep(exact: bool) -> None:
        """One pass in bound order: greedy strategies only (seeding incumbents), then exact ILPs."""
        for i, (lb, mlb, cc) in enumerate(order):
            vals = sorted(e.step_time_s for e in best.values())
            thr = vals[keep - 1] if len(vals) >= keep else float("inf")
            if lb > thr * (1 + TIME_TOL):
                res.pruned_time += (len(order) - i) * exact
                return
            if mlb > cc.capacity:
                res.pruned_memory += exact
                continue
            t = cc.cand.degrees
            bound = min(best[t].step_time_s if t in best else float("inf"), thr)
            if lb > bound * (1 + TIME_TOL):
                res.pruned_time += exact
                continue
            if exact and uniform_time_bound(cc, kinds, checkpoint) > bound * (1 + TIME_TOL):
                res.pruned_time += 1  # forced recompute (or no fit at all) makes it lose
                continue
            ev = run(cc, bound) if exact else greedy(cc)
            if ev is not None and _better(ev, best.get(t)):
                best[t] = ev

    sweep(exact=False)
    sweep(exact=True)
    res.ranked = sorted(best.values(), key=_rank_key)
    need = keep - len(res.ranked)
    if res.ranked and need > 0:
        chosen = {e.strategy.candidate for e in res.ranked}
        extra: list[Evaluation] = []
        for lb, mlb, cc in order:  # candidates solved above against a cutoff are solved again
            if cc.cand in chosen or mlb > cc.capacity:
                continue
            bound = extra[need - 1].step_time_s if len(extra) >= need else float("inf")
            if lb > bound * (1 + TIME_TOL):
                break
            if uniform_time_bound(cc, kinds, checkpoint) > bound * (1 + TIME_TOL):
                continue
            ev = run(cc, bound)
            if ev is not None:
                extra = sorted(extra + [ev], key=_rank_key)[:need]
        res.extra = extra
    if seed is not None:
        _merge_seed(res, seed, keep)
    res.seconds = time.perf_counter() - t0
    return res


def _dominated(e: Evaluation, plain: list[Evaluation]) -> bool:
    """An offloaded strategy whose degrees and batching run at least as fast with every state on
    the device: the same plan plus transfers, which says nothing a runner-up should."""
    c = e.strategy.candidate
    key = (c.dp, c.tp, c.pp, c.micro_batch_size, c.compile)
    return c.offloads and any(
        (
            p.strategy.candidate.dp,
            p.strategy.candidate.tp,
            p.strategy.candidate.pp,
            p.strategy.candidate.micro_batch_size,
            p.strategy.candidate.compile,
        )
        == key
        and p.step_time_s <= e.step_time_s
        for p in plain
    )


def _merge_seed(res: SearchResult, seed: SearchResult, keep: int) -> None:
    """Fold an earlier search into ``res``: its counts, and its runners-up (with its ranked
    strategies that lost their triple to a new one) among ``res``'s."""
    chosen = {e.strategy.candidate for e in res.ranked}
    pool = {e.strategy.candidate: e for e in seed.ranked + seed.extra + res.extra if e.strategy.candidate not in chosen}
    plain = [e for e in res.ranked + list(pool.values()) if not e.strategy.candidate.offloads]
    pool = {c: e for c, e in pool.items() if not _dominated(e, plain)}
    res.extra = sorted(pool.values(), key=_rank_key)[: max(keep - len(res.ranked), 0)]
    for f in ("enumerated", "solved", "infeasible", "pruned_time", "pruned_memory", "time_limited"):
        setattr(res, f, getattr(res, f) + getattr(seed, f))
    res.solver_seconds += seed.solver_seconds
    res.uniform = res.uniform and seed.uniform
    res.notes = seed.notes + res.notes
