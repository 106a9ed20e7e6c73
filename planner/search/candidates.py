"""Around the ILP: which candidates exist, what they cost at least, and a good guess for each.

- :func:`enumerate_candidates` lists ``(dp, tp, pp, zero, micro-batch, count)`` under the pins,
  the model (tp divides the heads and key/value heads) and the cluster (tp inside a node unless
  allowed across); :func:`check_pins` rejects pins nothing can honour, saying what would work.
- :func:`time_lower_bound` and :func:`memory_lower_bound` are cheap sound bounds over every
  partition and recompute set of a candidate; :func:`uniform_time_bound` is a tighter one for
  repeated-block tables that accounts for the recompute memory forces on each stage.
- :func:`heuristic_strategy` builds a good feasible strategy without a solver; the search uses its
  cost as the ILP's cutoff.

Everything is priced by :mod:`cost_models.strategy`; nothing here decides the answer, it only lets
the search skip work that provably cannot change it.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Any, Sequence

from cost_models.hardware import HardwareProfile
from cost_models.offload_cost import TIERS, check_offload, offload_missing
from cost_models.strategy import Candidate, CandidateCosts, Evaluation, LayerCost, NumericTable, evaluate
from planner.search.search_errors import SearchError

__all__ = [
    "is_repeated",
    "divisors",
    "model_heads",
    "tp_structure",
    "valid_tp",
    "check_pins",
    "enumerate_candidates",
    "time_lower_bound",
    "memory_lower_bound",
    "uniform_time_bound",
    "balanced_partition",
    "heuristic_strategy",
    "tied_summary",
    "offload_pinned",
    "offload_variants",
    "check_offload_pins",
    "memory_may_bind",
]


def is_repeated(cc: CandidateCosts, kinds: Sequence[str]) -> bool:
    """True for ``pre``, identical ``block`` rows (the last may differ), ``post``: the tables the
    block-count ILP, the repeated-block bound and the min-max greedy handle."""
    return cc.is_uniform() and kinds[0] == "pre" and kinds[-1] == "post" and all(k == "block" for k in kinds[1:-1])


# ---------------------------------------------------------------------------------- bounds
def _total_work(cc: CandidateCosts) -> float:
    """Every layer's micro-step work once, plus the cheapest transfers over the ``p - 1`` boundaries:
    a lower bound of ``sum_k T_k`` (recompute only adds time)."""
    p = cc.cand.pp
    work = sum(n * (c.work_s + c.zero_mb_s) for c, n in cc.distinct)
    if p > 1:
        # every boundary carries one activation forward and one gradient back, each at least
        # the smallest layer output (sends cost more for more bytes)
        small = min(range(cc.num_layers - 1), key=lambda i: cc.layers[i].boundary_b)
        work += 2 * sum(cc.send_s(small, j) for j in range(p - 1))
    return work


def _tail_bound(cc: CandidateCosts) -> float:
    ds, p = cc.distinct, cc.cand.pp
    return max(sum(n * (c.dp_step_s + c.opt_s) for c, n in ds) / p, max(c.dp_step_s + c.opt_s for c, _ in ds))


def time_lower_bound(cc: CandidateCosts) -> float:
    """A step time no strategy of this candidate can beat (sound: used to prune the search).

    The step is ``(m - 1) T + sum_k T_k + D`` (:func:`cost_models.strategy.evaluate`), where ``sum_k
    T_k >= W`` (:func:`_total_work`) and ``T >= max(W / p, max_l (work_l + zero_mb_l))`` because
    the slowest stage is at least the average one and holds at least one layer; ``D >= sum_l
    (dp_l + opt_l) / p`` likewise.
    """
    p, m = cc.cand.pp, cc.cand.num_micro_batches
    work = _total_work(cc)
    T = max(work / p, max(c.work_s + c.zero_mb_s for c, _ in cc.distinct))
    return (m - 1) * T + max(work, T) + _tail_bound(cc)


def memory_lower_bound(cc: CandidateCosts) -> float:
    """Bytes per device that every strategy of this candidate needs on its most loaded stage
    (by the memory bound feasibility is judged with: ``cost_models.strategy.memory_bound``).

    The most loaded stage holds at least the average of all stages (each layer's state once and
    at least ``min(saved, input)`` of activations once), stage 0 holds the first layer with
    ``min(p, m)`` micro-batches in flight, and some stage holds each single layer.
    """
    p = cc.cand.pp
    ds = cc.distinct
    avg = (sum(n * (c.state_b + min(c.saved_b, c.input_b)) for c, n in ds) + max(c.trans_b for c, _ in ds)) / p
    l0 = cc.layers[0]
    first = l0.state_b + l0.trans_b + cc.inflight[0] * min(l0.saved_b, l0.input_b)
    single = max(c.state_b + min(c.saved_b, c.input_b) + c.trans_b for c, _ in ds)
    return max(avg, first, single)


# ---------------------------------------------------------------------------------- candidates
def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order."""
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def model_heads(nt: NumericTable) -> tuple[int | None, int | None]:
    """``(heads, kv_heads)`` from the table's model facts (``None`` when unknown): stated by the
    front end or read from the graph's attention (``passes.attention``)."""
    heads = nt.model.get("heads") or None
    kv = nt.model.get("kv_heads") or heads
    return heads, kv


def tp_structure(tp: int, nt: NumericTable) -> str | None:
    """Why the model's structure rules out ``tp`` > 1 (``None`` when it does not): the graph's
    tensor-parallel analysis split nothing (the reason names the node), or ``tp`` does not divide
    the heads, neither divides nor is a multiple of the key/value heads (a multiple replicates
    each key/value head on ``tp / kv_heads`` ranks), or does not divide a column-parallel
    matmul's output features (naming the first such node). Heads unknown (no attention core in
    the graph) leave the split to the graph's matmul analysis."""
    if tp == 1:
        return None
    blocked = nt.model.get("tp_blocked")
    if blocked:
        return f"tensor parallelism cannot split this model: {blocked}"
    heads, kv = model_heads(nt)
    if heads and heads % tp:
        return f"--tp {tp} does not divide the model's {heads} attention heads"
    if kv and kv % tp and tp % kv:
        return f"--tp {tp} neither divides the model's {kv} key/value heads nor is a multiple of them"
    for size, where in (nt.model.get("tp_divides") or {}).items():
        if int(size) % tp:
            return f"--tp {tp} does not divide the {size} output features of {where}"
    return None


def valid_tp(tp: int, nt: NumericTable, gpus: int, gpus_per_node: int, across_nodes: bool) -> str | None:
    """Why ``tp`` cannot be used (``None`` when it can)."""
    if gpus % tp:
        return f"--tp {tp} does not divide --gpus {gpus}"
    why = tp_structure(tp, nt)
    if why:
        return why
    if not across_nodes and (tp > gpus_per_node or gpus_per_node % tp):
        return (
            f"--tp {tp} would split tensor-parallel groups across nodes of {gpus_per_node} devices "
            f"(allow it with --tp-across-nodes, or use a --tp that divides {gpus_per_node})"
        )
    return None


def tied_summary(nt: NumericTable) -> str:
    """``weight read by <row> and <row>, ...``: the tied weights, which pipeline stages hold one
    copy of per stage that reads them (kept in sync by an all-reduce of their gradients)."""
    return ", ".join(
        f"{t['weight']} read by {nt.names[t['layers'][0]]} and {nt.names[t['layers'][1]]}" for t in nt.tied
    )


def check_pins(req: Any, nt: NumericTable, gpus_per_node: int) -> None:
    """Reject pins no strategy can honour, with what to use instead (``SearchError``)."""
    rows = len(nt.layers)
    dp, tp, pp = req.dp, req.tp, req.pp
    if dp and tp and pp and dp * tp * pp != req.gpus:
        raise SearchError(
            f"--dp {dp} x --tp {tp} x --pp {pp} = {dp * tp * pp}, but --gpus is {req.gpus}; "
            "the three degrees must multiply to the number of devices."
        )
    if tp:
        why = valid_tp(tp, nt, req.gpus, gpus_per_node, req.tp_across_nodes)
        if why:
            ok = [
                t for t in divisors(req.gpus) if valid_tp(t, nt, req.gpus, gpus_per_node, req.tp_across_nodes) is None
            ]
            raise SearchError(f"{why}. Valid --tp values here: {', '.join(map(str, ok))}.")
    if pp and pp > rows:
        raise SearchError(
            f"--pp {pp} is more stages than the layer table has rows ({rows}: embedding, "
            f"{rows - 2} blocks, head); every stage needs at least one layer. Use --pp <= {rows}."
        )
    if pp and pp > 1 and req.micro_batch and dp:
        m = req.global_batch // (dp * req.micro_batch)
        if m < pp:
            raise SearchError(
                f"--global-batch {req.global_batch} / (--dp {dp} x --micro-batch {req.micro_batch}) "
                f"= {m} micro-batches, fewer than --pp {pp}: 1F1B needs at least one "
                "micro-batch per stage. Use a smaller --micro-batch or fewer stages."
            )


def sequence_parallel_options(req: Any, nt: NumericTable, tp: int) -> list[bool]:
    """Whether to plan degree ``tp`` without and with sequence parallelism: both where tp > 1,
    the model's analysis found sequence-shardable activations (``saved_bytes_sp``) and tp divides
    the sequence; the pin (``--sequence-parallel on|off``) keeps one."""
    pin = getattr(req, "sequence_parallel", None)
    kv = int(nt.model.get("kv_heads") or 0)
    # key/value projections tp does not split stay replicated, and attention cannot read sequence
    # shards there: code generation keeps those regions all-reducing, which the table's (full)
    # sequence-parallel savings would overstate, so such degrees plan without it
    able = (
        tp > 1
        and req.seq_len % tp == 0
        and (not kv or kv % tp == 0)
        and any(lay.saved_bytes_sp != 0 for lay in nt.layers)
    )
    if pin == "on":
        return [True] if able else []
    return [False, True] if able and pin is None else [False]


def sequence_parallel_obstacle(req: Any, nt: NumericTable, tp: int) -> str:
    """Why ``--sequence-parallel on`` cannot apply at degree ``tp`` (for the infeasibility message)."""
    kv = int(nt.model.get("kv_heads") or 0)
    if req.seq_len % tp:
        return f"--sequence-parallel on: tp={tp} does not divide --seq-len {req.seq_len}"
    if kv and kv % tp:
        return (
            f"--sequence-parallel on: tp={tp} does not divide the model's {kv} key/value heads, whose "
            "projections then stay replicated and cannot read sequence shards"
        )
    return (
        "--sequence-parallel on: this model keeps no activations between its tensor-parallel regions "
        "that can be split along the sequence (e.g. it flattens batch and sequence into one dim, as "
        "GPT-2's Conv1D does); use --sequence-parallel off"
    )


def enumerate_candidates(req: Any, nt: NumericTable, gpus_per_node: int) -> list[Candidate]:
    """Every ``(dp, tp, pp, zero, b, m)`` the pins and the model allow (see planner.search.ilp).

    Raises ``SearchError`` listing why nothing is left when the pins and the batch admit no
    candidate at all.
    """
    gpus, gb = req.gpus, req.global_batch
    rows = len(nt.layers)
    out: list[Candidate] = []
    why: dict[str, int] = {}

    def skip(reason: str) -> None:
        why[reason] = why.get(reason, 0) + 1

    for tp in divisors(gpus):
        if req.tp and tp != req.tp:
            continue
        if valid_tp(tp, nt, gpus, gpus_per_node, req.tp_across_nodes):
            structural = tp_structure(tp, nt)  # the model's reason, naming its node, is kept
            skip(structural or "tensor-parallel degree not allowed by the node size")
            continue
        options = sequence_parallel_options(req, nt, tp)  # per degree, not per batching
        for pp in divisors(gpus // tp):
            dp = gpus // (tp * pp)
            if (req.pp and pp != req.pp) or (req.dp and dp != req.dp):
                continue
            if pp > rows:
                skip(f"more pipeline stages than the {rows} layer-table rows")
                continue
            if gb % dp:
                skip("global batch not divisible by the data-parallel degree")
                continue
            for b in divisors(gb // dp):
                if req.micro_batch and b != req.micro_batch:
                    continue
                m = gb // (dp * b)
                if pp > 1 and m < pp:
                    skip("fewer micro-batches than pipeline stages")
                    continue
                zeros = [req.zero_stage] if req.zero_stage is not None else ([0, 1, 2, 3] if dp > 1 else [0])
                if not options:
                    skip(sequence_parallel_obstacle(req, nt, tp))
                for sp in options:
                    out.extend(Candidate(dp, tp, pp, z, b, m, sequence_parallel=sp) for z in zeros)
    if not out:
        pins = " ".join(
            f"--{k.replace('_', '-')} {getattr(req, k)}"
            for k in ("dp", "tp", "pp", "micro_batch")
            if getattr(req, k) is not None
        )
        reasons = "; ".join(f"{r} ({n}x)" for r, n in why.items()) or "the pins exclude every degree"
        advice = (
            "Drop --sequence-parallel on, or pin a --tp it applies to."
            if why and all(r.startswith("--sequence-parallel") for r in why)
            else "Pick a global batch divisible by more data-parallel degrees, or pin fewer decisions."
        )
        raise SearchError(
            f"No combination of degrees and micro-batching satisfies --gpus {gpus}, --global-batch "
            f"{gb}{' and ' + pins if pins else ''}: {reasons}. {advice}"
        )
    return out


# ---------------------------------------------------------------------------------- offload
def offload_pinned(req: Any) -> bool:
    """True when the request pins some state off the device (``--offload-* cpu|nvme``): only
    offloaded candidates are then searched."""
    return any(getattr(req, f"offload_{k}", None) not in (None, "none") for k in ("optimizer", "params"))


def _tiers(req: Any, kind: str, hw: HardwareProfile) -> list[str]:
    pin = getattr(req, f"offload_{kind}", None)
    if pin is not None:
        return [pin]
    return [
        t
        for t in TIERS
        if t == "none" or not offload_missing(hw, *((t, "none") if kind == "optimizer" else ("cpu", t)))
    ]


def offload_variants(req: Any, cands: Sequence[Candidate], hw: HardwareProfile) -> list[Candidate]:
    """The offloaded versions of ``cands`` (offload none) that the pins and ``hw`` allow.

    Each keeps its degrees and batching; at ``dp = 1``, where every ZeRO stage is the same and the
    enumeration keeps only stage 0, the variants take stages 1, 2 and 3 (the runtime offloads a
    ZeRO shard, here the whole model), stage 3 only with the parameters offloaded (on one rank
    ZeRO 3 otherwise costs what ZeRO 2 does).
    """
    out: list[Candidate] = []
    seen: set[Candidate] = set()
    opt_tiers, par_tiers = _tiers(req, "optimizer", hw), _tiers(req, "params", hw)
    for c in cands:
        zeros = [c.zero_stage] if c.dp > 1 or req.zero_stage is not None else [1, 2, 3]
        for z in zeros:
            for o in opt_tiers:
                for q in par_tiers:
                    if o == q == "none" or check_offload(o, q, z):
                        continue
                    if c.dp == 1 and z == 3 and q == "none" and req.zero_stage is None:
                        continue  # ZeRO 3 on one rank without offloaded parameters is ZeRO 2
                    v = dataclasses.replace(c, zero_stage=z, offload_optimizer=o, offload_params=q)
                    if v not in seen:
                        seen.add(v)
                        out.append(v)
    return out


def memory_may_bind(cc: CandidateCosts, kinds: Sequence[str], checkpoint: str = "auto") -> bool:
    """False when every strategy of this (plain) candidate fits without recompute (or, under
    ``--checkpoint all``, with its forced recompute), so that memory cannot be what keeps it from
    its fastest strategy: then no offloaded version of it can be faster (same work, more time).

    One stage (``pp = 1``): the one partition is priced exactly. Several: every stage is bounded
    by all the layers' state, their saved activations times the first stage's micro-batches in
    flight (the most) and the largest ZeRO buffer and backward transient; when that fits, every
    partition does. ``True`` whenever neither test proves the slack."""
    n = cc.num_layers
    if cc.cand.pp == 1:
        ck = [i for i, k in enumerate(kinds) if k == "block"] if checkpoint == "all" else []
        return not evaluate(cc, [(0, n - 1)], ck, pinned_selective(cc, kinds, checkpoint)).feasible
    if checkpoint in ("all", "selective"):
        return True
    ls = cc.layers
    upper = (
        sum(l.state_b for l in ls)
        + max(l.trans_b for l in ls)
        + cc.inflight[0] * sum(l.saved_b for l in ls)
        + max(l.bt_b for l in ls)
    )
    return upper > cc.capacity


def pinned_selective(cc: CandidateCosts, kinds: Sequence[str], checkpoint: str) -> list[int]:
    """The layers ``--checkpoint selective`` recomputes selectively: every block with attention
    cores (none under the other modes)."""
    if checkpoint != "selective":
        return []
    return [i for i, k in enumerate(kinds) if k == "block" and cc.layers[i].sel_saved_b > 0]


def check_offload_pins(req: Any, hw: HardwareProfile) -> None:
    """Reject offload pins the hardware profile cannot price, naming the missing fields."""
    o, q = req.offload_optimizer or "none", req.offload_params or "none"
    missing = offload_missing(hw, o, q)
    if missing:
        flags = " ".join(f"--offload-{k} {v}" for k, v in (("optimizer", o), ("params", q)) if v != "none")
        raise SearchError(
            f"{flags}: hardware profile {hw.name!r} lacks {', '.join(missing)}, which pricing "
            "that offload needs. Add them to the profile (see cost_models/hardware.py), or run "
            "`planner calibrate` on the machine to measure them."
        )


# ---------------------------------------------------------------------------------- heuristic
def balanced_partition(weights: Sequence[float], p: int) -> list[tuple[int, int]]:
    """Contiguous split of ``weights`` into ``p`` non-empty ranges minimizing the largest sum.

    Bisection on the bound with a greedy packing check (exact up to the bisection tolerance).
    """
    n = len(weights)
    if not 1 <= p <= n:
        raise ValueError(f"cannot split {n} layers into {p} non-empty stages")

    def pack(bound: float) -> list[int] | None:
        cuts, acc = [], 0.0
        for i, w in enumerate(weights):
            if acc and acc + w > bound:
                cuts.append(i)
                acc = 0.0
            acc += w
        return cuts if len(cuts) <= p - 1 else None

    lo, hi = max(weights), sum(weights)
    for _ in range(60):
        mid = (lo + hi) / 2
        if pack(mid) is None:
            lo = mid
        else:
            hi = mid
    cuts = pack(hi) or []
    bounds = [0, *cuts, n]
    while len(bounds) - 1 < p:  # split the widest range until there are p (the bound still holds)
        i = max(range(len(bounds) - 1), key=lambda j: bounds[j + 1] - bounds[j])
        bounds.insert(i + 1, (bounds[i] + bounds[i + 1]) // 2)
    return [(bounds[i], bounds[i + 1] - 1) for i in range(p)]


def heuristic_strategy(cc: CandidateCosts, kinds: Sequence[str], checkpoint: str = "auto") -> Evaluation | None:
    """A good feasible strategy found without a solver, or ``None``.

    The search hands its cost to the ILP as a cutoff, so the solver starts with an incumbent
    (and refutes hopeless candidates at the root); the ILP's answer is never worse than this.
    Uniform tables (identical blocks between the embedding and head rows) use
    :func:`_uniform_heuristic`; others the time-balanced partition, then in each stage that
    overflows, recompute the layers that free the most memory per second of recompute.
    """
    if is_repeated(cc, kinds):
        return _uniform_heuristic(cc, checkpoint)
    p = cc.cand.pp
    stages = balanced_partition([l.work_s + l.zero_mb_s for l in cc.layers], p)
    ck: set[int] = set()
    if checkpoint == "all":
        ck = {i for i, k in enumerate(kinds) if k == "block"}
    elif checkpoint == "auto":
        for k, (a, b) in enumerate(stages):
            ls = range(a, b + 1)
            inflight = cc.inflight[k]
            L = cc.layers
            mem = sum(L[i].state_b + inflight * L[i].saved_b for i in ls) + max(L[i].trans_b for i in ls)
            order = sorted(
                (i for i in ls if L[i].saved_b > L[i].input_b),
                key=lambda i: -inflight * (L[i].saved_b - L[i].input_b) / max(L[i].rec_s, 1e-30),
            )
            peak = 0.0
            for i in order:
                if mem <= cc.capacity:
                    break
                new_peak = max(peak, L[i].saved_b)
                mem += new_peak - peak - inflight * (L[i].saved_b - L[i].input_b)
                peak = new_peak
                ck.add(i)
    ev = evaluate(cc, stages, sorted(ck), pinned_selective(cc, kinds, checkpoint))
    return ev if ev.feasible else None


def _as_selective(c: LayerCost) -> LayerCost:
    """A block that recomputes its attention cores, seen as a block that does not recompute:
    fewer activations kept, the cores' forward added to its work, their re-materialization a
    transient (what ``cost_models.strategy.selective_view`` and ``evaluate`` price)."""
    return dataclasses.replace(
        c, saved_b=c.saved_b - c.sel_saved_b, compute_s=c.compute_s + c.sel_rec_s, bt_b=max(c.bt_b, c.sel_saved_b)
    )


class _UniformStages:
    """Stage-by-stage model of a repeated-block table for a micro-step bound ``T``.

    Stage ``k`` holding ``n`` run blocks needs the fewest recomputed blocks ``r(n)`` that fit its
    memory; its micro-step is then ``t_k(n)``, increasing in ``n``; ``N_k(T)`` is the most blocks
    with ``t_k(n) <= T``. ``T`` is achievable when ``sum_k N_k(T) >= L``.

    Exact model (``relaxed=False``, for the greedy strategy): the embedding and head rows are
    never recomputed, a distinct last block rides in the last stage, transfers are priced with a
    block's output. Relaxed model (``relaxed=True``, for the lower bound): the embedding and head
    rows cost their least memory (``min(saved, input)``), a distinct last block is left out (it
    may sit in either of the last two stages), transfers are free, and no stage is forced to hold
    a block. Every feasible strategy's stages cost at least the relaxed ``t_k(n_k)``.
    """

    def __init__(self, cc: CandidateCosts, checkpoint: str, relaxed: bool):
        self.cc, self.mode, self.relaxed = cc, checkpoint, relaxed
        self.p = p = cc.cand.pp
        self.pre, self.blk, self.post = cc.layers[0], cc.layers[1], cc.layers[-1]
        self.tail = [cc.layers[-2]] if cc.layers[-2] != self.blk else []
        if checkpoint == "selective":  # every block recomputes its cores, none recomputes whole
            self.blk = _as_selective(self.blk) if self.blk.sel_saved_b > 0 else self.blk
            self.tail = [_as_selective(x) if x.sel_saved_b > 0 else x for x in self.tail]
            self.mode = "none"
        # auto may also free a block's core bytes at their (maybe cheaper) price: the relaxed
        # model charges forced freeing at the cheapest rate per byte of the two (sound)
        blk = self.blk
        self.sel_rate = (
            blk.sel_rec_s / blk.sel_saved_b if checkpoint == "auto" and relaxed and blk.sel_saved_b > 0 else math.inf
        )
        self.L = cc.num_layers - 2 - len(self.tail)
        self.lows = [0 if relaxed or not 0 < k < p - 1 else 1 for k in range(p)]
        self._memo: dict[tuple[int, int], tuple[int, float] | None] = {}

    def stage(self, k: int, n: int) -> tuple[int, float] | None:
        """``(r, t_k(n))`` of stage ``k`` holding ``n`` run blocks; ``None`` if it cannot fit."""
        key = (k, n)
        if key in self._memo:
            return self._memo[key]
        cc, blk, p = self.cc, self.blk, self.p
        tail = [] if self.relaxed else self.tail
        rows = ([self.pre] if k == 0 else []) + (tail + [self.post] if k == p - 1 else [])
        a = cc.inflight[k]
        trans = max([r.trans_b for r in rows] + ([blk.trans_b] if n else []) + [0])
        act = (lambda r: min(r.saved_b, r.input_b)) if self.relaxed else (lambda r: r.saved_b)
        mem = n * (blk.state_b + a * blk.saved_b) + trans + sum(r.state_b + a * act(r) for r in rows)
        delta = blk.saved_b - blk.input_b
        if self.mode == "auto" and math.isfinite(self.sel_rate) and mem > cc.capacity and n:
            # relaxed with selective: free the excess fractionally at the cheaper rate per byte,
            # re-materializing the smaller of the two transients (a lower bound of either choice)
            rates = [self.sel_rate] + ([blk.rec_s / delta] if delta > 0 else [])
            most = n * a * max(delta, blk.sel_saved_b)
            excess = mem + min(blk.saved_b, blk.sel_saved_b) - cc.capacity
            out = None
            if excess <= most:
                t = (
                    n * (blk.work_s + blk.zero_mb_s)
                    + max(excess, 0.0) / a * min(rates)
                    + sum(x.work_s + x.zero_mb_s for x in rows)
                )
                out = (0, t)
            self._memo[key] = out
            return out
        if self.mode == "all":
            r = n
        elif mem <= cc.capacity or self.mode == "none" or n == 0 or delta <= 0:
            r = 0
        else:
            r = max(1, math.ceil((mem + blk.saved_b - cc.capacity) / (a * delta)))
        if r:
            mem += blk.saved_b - a * r * delta
        out = None
        if r <= n and mem <= cc.capacity:
            t = n * (blk.work_s + blk.zero_mb_s) + r * blk.rec_s + sum(x.work_s + x.zero_mb_s for x in rows)
            if not self.relaxed:
                t += (cc.send_s(1, k) if k < p - 1 else 0.0) + (cc.send_s(1, k - 1) if k > 0 else 0.0)
            out = (r, t)
        self._memo[key] = out
        return out

    def allocate(self) -> tuple[float, list[int]] | None:
        """The smallest achievable micro-step ``T*`` and block counts achieving it (None: no fit).

        Min-max allocation with increasing per-stage costs: start every stage at its fewest
        blocks, then hand out the remaining blocks one at a time to the stage whose next block
        costs least. The ``j``-th block handed out has the ``j``-th smallest increment value, so the
        largest value reached is the least ``T`` with ``sum_k N_k(T) >= L`` (exact).
        """
        p, L = self.p, self.L
        counts = list(self.lows)
        left = L - sum(counts)
        if left < 0:
            return None
        base = [self.stage(k, counts[k]) for k in range(p)]
        if any(b is None for b in base):
            return None
        T = max(b[1] for b in base)
        heap = []
        for k in range(p):
            nxt = self.stage(k, counts[k] + 1) if counts[k] < L else None
            if nxt is not None:
                heap.append((nxt[1], -k))
        heapq.heapify(heap)
        for _ in range(left):
            if not heap:
                return None
            t, nk = heapq.heappop(heap)
            k = -nk
            counts[k] += 1
            T = max(T, t)
            nxt = self.stage(k, counts[k] + 1) if counts[k] < L else None
            if nxt is not None:
                heapq.heappush(heap, (nxt[1], -k))
        return T, counts


def uniform_time_bound(cc: CandidateCosts, kinds: Sequence[str], checkpoint: str = "auto") -> float:
    """A step-time lower bound for repeated-block tables that counts forced recompute.

    Every feasible strategy has ``T >= t_k(n_k)`` on each stage of the relaxed model of
    :class:`_UniformStages` with ``sum_k n_k = L``, hence ``T`` is at least the smallest
    achievable bound there; ``inf`` when no partition fits in memory at all. Falls back to
    :func:`time_lower_bound` for other tables.
    """
    base = time_lower_bound(cc)
    if not is_repeated(cc, kinds):
        return base
    found = _UniformStages(cc, checkpoint, relaxed=True).allocate()
    if found is None:
        return math.inf
    m = cc.cand.num_micro_batches
    return max(base, (m - 1) * found[0] + max(found[0], _total_work(cc)) + _tail_bound(cc))


def _uniform_heuristic(cc: CandidateCosts, checkpoint: str) -> Evaluation | None:
    """The min-max allocation of the exact :class:`_UniformStages` model, priced by ``evaluate``."""
    model = _UniformStages(cc, checkpoint, relaxed=False)
    found = model.allocate()
    if found is None:
        return None
    p, counts = model.p, found[1]
    stages, ck, start = [], set(), 0
    for k in range(p):
        last = start + counts[k] + (k == 0) + (k == p - 1) * (1 + len(model.tail)) - 1
        first_block = start + (k == 0)
        ck.update(range(first_block, first_block + model.stage(k, counts[k])[0]))
        stages.append((start, last))
        start = last + 1
    if checkpoint == "all":  # every block, the distinct last one included
        ck = set(range(1, cc.num_layers - 1))
    kinds = ["pre"] + ["block"] * (cc.num_layers - 2) + ["post"]
    ev = evaluate(cc, stages, sorted(ck), pinned_selective(cc, kinds, checkpoint))
    return ev if ev.feasible else None
