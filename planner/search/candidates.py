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
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from cost_models.context_cost import ContextSetting, ulysses_obstacle
from cost_models.expert_cost import valid_expert_degrees
from cost_models.hardware import HardwareProfile
from cost_models.offload_cost import TIERS, check_offload, offload_missing
from cost_models.strategy import Candidate, CandidateCosts, Evaluation, LayerCost, NumericTable, evaluate
from planner.frontend.spec import model_layer_names
from planner.search.search_errors import SearchError
from runtime.contract.choices import ContextMethod, GradCompression, Toggle, names
from runtime.contract.overlap import Overlap

__all__ = [
    "is_repeated",
    "head_rows",
    "MAX_HEAD_ROWS",
    "forced_micro_step",
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
    "compression_variants",
    "work_lower_bound",
]


#: Fewest positions of a sequence chunk the default search gives a context-parallel rank (it holds
#: two): below that the attention exchange's per-message latency outweighs any saving, and the
#: search would only multiply candidates. A ``--cp`` pin is not bound by it.
MIN_CONTEXT_CHUNK = 1024


def is_repeated(costs: CandidateCosts, kinds: Sequence[str]) -> bool:
    """True for ``pre``, identical ``block`` rows (the last may differ), ``post``: the tables the
    block-count ILP, the repeated-block bound and the min-max greedy handle."""
    return costs.is_uniform() and kinds[0] == "pre" and kinds[-1] == "post" and kinds.count("block") == len(kinds) - 2


#: Most distinct blocks before the repeated ones that :func:`head_rows` accepts: each way of
#: cutting them over the first stages is a structure the block-count solver walks (``2^head``).
MAX_HEAD_ROWS = 4


def head_rows(costs: CandidateCosts, kinds: Sequence[str]) -> int | None:
    """The distinct blocks between the embedding and identical ones when the table is ``pre``,
    at most :data:`MAX_HEAD_ROWS` distinct blocks, identical blocks (the last may differ),
    ``post`` (DeepSeek-V3's three dense blocks before its 58 mixtures of experts): what the
    block-count solver (:mod:`planner.search.block_counts`) solves; 0 for :func:`is_repeated`
    tables, ``None`` for any other. Remembered per costs object."""
    known = _HEAD_ROWS.get(costs)
    if known is not None and known[0] == tuple(kinds):
        return known[1]
    found = _head_rows(costs, kinds)
    _HEAD_ROWS[costs] = (tuple(kinds), found)
    return found


def _head_rows(costs: CandidateCosts, kinds: Sequence[str]) -> int | None:
    if is_repeated(costs, kinds):
        return 0
    first = repeated_run_start(costs, kinds)
    return first - 1 if first is not None and 0 < first - 1 <= MAX_HEAD_ROWS else None


def repeated_run_start(
    costs: CandidateCosts, kinds: Sequence[str], same: Callable[[LayerCost], Any] | None = None
) -> int | None:
    """The first row of the run of blocks that ends at the second-last block (the last block
    may differ) and are alike (equal, or equal in ``same(row)``); ``None`` unless the table is
    ``pre``, blocks, ``post`` with at least three blocks."""
    layers, n = costs.layers, costs.num_layers
    if n < 5 or kinds[0] != "pre" or kinds[-1] != "post" or list(kinds).count("block") != n - 2:
        return None
    key = same or (lambda row: row)
    reference = key(layers[n - 3])
    first = n - 3
    while first > 1 and (layers[first - 1] is layers[n - 3] or key(layers[first - 1]) == reference):
        first -= 1
    return first


#: :func:`head_rows` per costs object (by identity), with the kinds it was asked for.
_HEAD_ROWS: "weakref.WeakKeyDictionary[CandidateCosts, tuple[tuple[str, ...], int | None]]" = (
    weakref.WeakKeyDictionary()
)


# ---------------------------------------------------------------------------------- bounds
def total_work(costs: CandidateCosts) -> float:
    """Every layer's micro-step work once, plus the cheapest transfers over the ``p - 1`` boundaries:
    a lower bound of ``sum_k T_k`` (recompute only adds time)."""
    known = _TOTAL_WORK.get(costs)
    if known is not None:
        return known
    stages = costs.cand.pp
    work = sum(n * (cost.work_s + cost.zero_mb_s) for cost, n in costs.distinct)
    if stages > 1:
        # every boundary carries one activation forward and one gradient back, each at least
        # the smallest layer output (sends cost more for more bytes)
        small = min(range(costs.num_layers - 1), key=lambda i: costs.layers[i].boundary_b)
        work += 2 * sum(costs.send_s(small, j) for j in range(stages - 1))
    _TOTAL_WORK[costs] = work
    return work


#: :func:`total_work` per costs object (by identity; each bound asks for it again).
_TOTAL_WORK: "weakref.WeakKeyDictionary[CandidateCosts, float]" = weakref.WeakKeyDictionary()


def tail_bound(costs: CandidateCosts) -> float:
    """A lower bound of the exposed per-step tail (DP/ZeRO traffic and optimizer) of the tail
    stage: the average stage's share, and the largest single layer's."""
    distinct, stages = costs.distinct, costs.cand.pp
    return max(
        sum(n * (cost.dp_step_s + cost.opt_s) for cost, n in distinct) / stages,
        max(cost.dp_step_s + cost.opt_s for cost, _ in distinct),
    )


def time_lower_bound(costs: CandidateCosts) -> float:
    """A step time no strategy of this candidate can beat (sound: used to prune the search).

    The step is ``(m - 1) T + sum_k T_k + D`` (:func:`cost_models.strategy.evaluate`), where ``sum_k
    T_k >= W`` (:func:`total_work`) and ``T >= max(W / p, max_l (work_l + zero_mb_l))`` because
    the slowest stage is at least the average one and holds at least one layer; ``D >= sum_l
    (dp_l + opt_l) / p`` likewise.
    """
    stages, micro_batches = costs.cand.pp, costs.cand.num_micro_batches
    work = total_work(costs)
    slowest = max(work / stages, max(cost.work_s + cost.zero_mb_s for cost, _ in costs.distinct))
    return (micro_batches - 1) * slowest + max(work, slowest) + tail_bound(costs)


def work_lower_bound(costs: CandidateCosts) -> float:
    """``time_lower_bound`` without its tail: a bound of every variant of this candidate that
    changes only the per-step tail (the same work, e.g. its 1-bit Adam version)."""
    return time_lower_bound(costs) - tail_bound(costs)


def memory_lower_bound(costs: CandidateCosts) -> float:
    """Bytes per device that every strategy of this candidate needs on its most loaded stage
    (by the memory bound feasibility is judged with: ``cost_models.strategy.memory_bound``).

    The most loaded stage holds at least the average of all stages (each layer's state once and
    at least ``min(saved, input)`` of activations once), stage 0 holds the first layer with
    ``min(p, m)`` micro-batches in flight, and some stage holds each single layer.
    """
    stages = costs.cand.pp
    distinct = costs.distinct
    avg = (
        sum(n * (cost.state_b + min(cost.saved_b, cost.input_b)) for cost, n in distinct)
        + max(cost.trans_b for cost, _ in distinct)
    ) / stages
    first_row = costs.layers[0]
    first = first_row.state_b + first_row.trans_b + costs.inflight[0] * min(first_row.saved_b, first_row.input_b)
    single = max(cost.state_b + min(cost.saved_b, cost.input_b) + cost.trans_b for cost, _ in distinct)
    return max(avg, first, single)


# ---------------------------------------------------------------------------------- candidates
def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order."""
    small = [divisor for divisor in range(1, int(math.isqrt(n)) + 1) if n % divisor == 0]
    return sorted(set(small + [n // divisor for divisor in small]))


def model_heads(table: NumericTable) -> tuple[int | None, int | None]:
    """``(heads, kv_heads)`` from the table's model facts (``None`` when unknown): stated by the
    front end or read from the graph's attention (``passes.attention``)."""
    heads = table.model.get("heads") or None
    kv_heads = table.model.get("kv_heads") or heads
    return heads, kv_heads


def tp_structure(tp: int, table: NumericTable) -> str | None:
    """Why the model's structure rules out ``tp`` > 1 (``None`` when it does not): the graph's
    tensor-parallel analysis split nothing (the reason names the node), or ``tp`` does not divide
    the heads, neither divides nor is a multiple of the key/value heads (a multiple replicates
    each key/value head on ``tp / kv_heads`` ranks), or does not divide a column-parallel
    matmul's output features (naming the first such node). Heads unknown (no attention core in
    the graph) leave the split to the graph's matmul analysis."""
    if tp == 1:
        return None
    blocked = table.model.get("tp_blocked")
    if blocked:
        return f"tensor parallelism cannot split this model: {blocked}"
    heads, kv_heads = model_heads(table)
    if heads and heads % tp:
        return f"--tp {tp} does not divide the model's {heads} attention heads"
    if kv_heads and kv_heads % tp and tp % kv_heads:
        return f"--tp {tp} neither divides the model's {kv_heads} key/value heads nor is a multiple of them"
    for size, where in (table.model.get("tp_divides") or {}).items():
        if int(size) % tp:
            return f"--tp {tp} does not divide the {size} output features of {where}"
    return None


def valid_tp(tp: int, table: NumericTable, gpus: int, gpus_per_node: int, across_nodes: bool) -> str | None:
    """Why ``tp`` cannot be used (``None`` when it can)."""
    if gpus % tp:
        return f"--tp {tp} does not divide --gpus {gpus}"
    why = tp_structure(tp, table)
    if why:
        return why
    if not across_nodes and (tp > gpus_per_node or gpus_per_node % tp):
        return (
            f"--tp {tp} would split tensor-parallel groups across nodes of {gpus_per_node} devices "
            f"(allow it with --tp-across-nodes, or use a --tp that divides {gpus_per_node})"
        )
    return None


def tied_summary(table: NumericTable) -> str:
    """``weight read by <row> and <row>, ...``: the tied weights, which pipeline stages hold one
    copy of per stage that reads them (kept in sync by an all-reduce of their gradients)."""
    spec = table.model.get("spec", "")
    names = model_layer_names(spec, list(table.names))  # as the model names them (no wrapper's prefix)
    return ", ".join(
        f"{model_layer_names(spec, [tie['weight']])[0]} read by {names[tie['layers'][0]]} and {names[tie['layers'][1]]}"
        for tie in table.tied
    )


def model_experts(table: NumericTable) -> int:
    """Routed experts of the table's MoE rows (``passes.moe``; the gcd if they differ), 0 for a
    dense model or one whose experts the pass could not read."""
    counts = [int(getattr(lay, "experts", 0) or 0) for lay in table.layers]
    return math.gcd(*counts) if any(counts) else 0


def expert_degrees(request: Any, table: NumericTable, dp: int) -> list[int]:
    """The expert-parallel degrees searched at data-parallel degree ``dp``: the divisors of
    ``gcd(dp, experts)`` (one, ep 1, for a dense model: it pays nothing for the option), or the pin."""
    pin = getattr(request, "ep", None)
    degrees = valid_expert_degrees(dp, model_experts(table))
    if pin is not None:
        return [pin] if pin in degrees else []
    return degrees


def _check_expert_pin(request: Any, table: NumericTable) -> None:
    """``--ep N`` needs routed experts that N divides (and a dp it can divide); the routing flags
    need routed experts at all."""
    pin = getattr(request, "ep", None)
    experts = model_experts(table)
    routing = [
        flag
        for flag, given in (
            ("--moe-capacity-factor", getattr(request, "moe_capacity_factor", None) is not None),
            ("--moe-imbalance", getattr(request, "moe_imbalance", 1.0) != 1.0),
        )
        if given
    ]
    if routing and not experts:
        raise SearchError(
            f"{' and '.join(routing)} describe{'s' if len(routing) == 1 else ''} a mixture of experts' routing, "
            "but this model has no routed experts the planner reads; drop "
            f"{'it' if len(routing) == 1 else 'them'}."
        )
    if pin is None or pin == 1:
        return
    if not experts:
        why = table.model.get("moe", {}).get("reason") if isinstance(table.model.get("moe"), dict) else None
        raise SearchError(
            f"--ep {pin}: this model has no routed experts the planner can shard"
            + (f" ({why})" if why else "")
            + "; drop --ep (or use --ep 1)."
        )
    if experts % pin:
        valid = [d for d in range(1, experts + 1) if experts % d == 0]
        raise SearchError(
            f"--ep {pin} does not divide the model's {experts} routed experts per layer: each rank must "
            f"hold whole experts. Valid --ep values: {', '.join(map(str, valid))} (that also divide dp)."
        )
    if request.gpus % pin:
        raise SearchError(f"--ep {pin} does not divide --gpus {request.gpus}: no dp is a multiple of it.")


def check_pins(request: Any, table: NumericTable, gpus_per_node: int) -> None:
    """Reject pins no strategy can honour, with what to use instead (``SearchError``)."""
    if request.gpus > gpus_per_node and request.gpus % gpus_per_node:
        nodes = request.gpus // gpus_per_node
        raise SearchError(
            f"--gpus {request.gpus} is not a whole number of nodes of {gpus_per_node} devices: ranks are laid "
            f"out node by node, and the last node would hold {request.gpus % gpus_per_node}. Use "
            f"{nodes * gpus_per_node} or {(nodes + 1) * gpus_per_node} devices, or give the real node size "
            "with --gpus-per-node."
        )
    _check_expert_pin(request, table)
    rows = len(table.layers)
    dp, tp, pp = request.dp, request.tp, request.pp
    cp = getattr(request, "cp", None)
    if dp and tp and pp and dp * tp * pp * (cp or 1) != request.gpus:
        context = f" x --cp {cp}" if cp and cp > 1 else ""
        raise SearchError(
            f"--dp {dp} x --tp {tp} x --pp {pp}{context} = {dp * tp * pp * (cp or 1)}, but --gpus is "
            f"{request.gpus}; the degrees must multiply to the number of devices."
        )
    if tp:
        why = valid_tp(tp, table, request.gpus, gpus_per_node, request.tp_across_nodes)
        if why:
            valid = [
                degree
                for degree in divisors(request.gpus)
                if valid_tp(degree, table, request.gpus, gpus_per_node, request.tp_across_nodes) is None
            ]
            raise SearchError(f"{why}. Valid --tp values here: {', '.join(map(str, valid))}.")
    if pp and pp > rows:
        raise SearchError(
            f"--pp {pp} is more stages than the layer table has rows ({rows}: embedding, "
            f"{rows - 2} blocks, head); every stage needs at least one layer. Use --pp <= {rows}."
        )
    if pp and pp > 1 and request.micro_batch and dp:
        micro_batches = request.global_batch // (dp * request.micro_batch)
        if micro_batches < pp:
            raise SearchError(
                f"--global-batch {request.global_batch} / (--dp {dp} x --micro-batch {request.micro_batch}) "
                f"= {micro_batches} micro-batches, fewer than --pp {pp}: 1F1B needs at least one "
                "micro-batch per stage. Use a smaller --micro-batch or fewer stages."
            )


def sequence_parallel_options(request: Any, table: NumericTable, tp: int) -> list[bool]:
    """Whether to plan degree ``tp`` without and with sequence parallelism: both where tp > 1,
    the model's analysis found sequence-shardable activations (``saved_bytes_sp``) and tp divides
    the sequence; the pin (``--sequence-parallel on|off``) keeps one."""
    pin = getattr(request, "sequence_parallel", None)
    kv_heads = int(table.model.get("kv_heads") or 0)
    # key/value projections tp does not split stay replicated, and attention cannot read sequence
    # shards there: code generation keeps those regions all-reducing, which the table's (full)
    # sequence-parallel savings would overstate, so such degrees plan without it
    able = (
        tp > 1
        and request.seq_len % tp == 0
        and (not kv_heads or kv_heads % tp == 0)
        and table.has_field("saved_bytes_sp")
    )
    if pin == "on":
        return [True] if able else []
    return [False, True] if able and pin is None else [False]


def sequence_parallel_obstacle(request: Any, table: NumericTable, tp: int) -> str:
    """Why ``--sequence-parallel on`` cannot apply at degree ``tp`` (for the infeasibility message)."""
    kv_heads = int(table.model.get("kv_heads") or 0)
    if request.seq_len % tp:
        return f"--sequence-parallel on: tp={tp} does not divide --seq-len {request.seq_len}"
    if kv_heads and kv_heads % tp:
        return (
            f"--sequence-parallel on: tp={tp} does not divide the model's {kv_heads} key/value heads, whose "
            "projections then stay replicated and cannot read sequence shards"
        )
    return (
        "--sequence-parallel on: this model keeps no activations between its tensor-parallel regions "
        "that can be split along the sequence (e.g. it flattens batch and sequence into one dim, as "
        "GPT-2's Conv1D does); use --sequence-parallel off"
    )


def enumerate_candidates(request: Any, table: NumericTable, gpus_per_node: int) -> list[Candidate]:
    """Every ``(dp, tp, pp, zero, b, m)`` the pins and the model allow (see planner.search.ilp).

    Raises ``SearchError`` listing why nothing is left when the pins and the batch admit no
    candidate at all, and the nearest device counts that admit one.
    """
    out, why = _enumerated(request, table, gpus_per_node)
    if not out:
        raise _nothing_left(request, why, _nearby_gpus(request, table, gpus_per_node))
    return out


def _enumerated(request: Any, table: NumericTable, gpus_per_node: int) -> tuple[list[Candidate], dict[str, int]]:
    """``enumerate_candidates``'s candidates and, per reason, how many layouts it ruled out."""
    gpus, global_batch = request.gpus, request.global_batch
    overlap = Overlap.of(getattr(request, "overlap", Toggle.ON))
    rows = len(table.layers)
    out: list[Candidate] = []
    why: dict[str, int] = {}

    def skip(reason: str) -> None:
        why[reason] = why.get(reason, 0) + 1

    for tp in divisors(gpus):
        if request.tp and tp != request.tp:
            continue
        if valid_tp(tp, table, gpus, gpus_per_node, request.tp_across_nodes):
            structural = tp_structure(tp, table)  # the model's reason, naming its node, is kept
            skip(structural or "tensor-parallel degree not allowed by the node size")
            continue
        options = sequence_parallel_options(request, table, tp)  # per degree, not per batching
        for cp, methods in context_options(request, table, tp, skip):
            for pp in divisors(gpus // (tp * cp)):
                dp = gpus // (tp * cp * pp)
                if (request.pp and pp != request.pp) or (request.dp and dp != request.dp):
                    continue
                if pp > rows:
                    skip(f"more pipeline stages than the {rows} layer-table rows")
                    continue
                if global_batch % dp:
                    skip("global batch not divisible by the data-parallel degree")
                    continue
                layout = _Layout(dp, tp, pp, cp, methods, options)
                out.extend(_batchings(request, table, layout, overlap, skip))
    return out, why


def _nearby_gpus(request: Any, table: NumericTable, gpus_per_node: int, reach: int = 64) -> list[int]:
    """The nearest device counts below and above ``request.gpus`` (whole nodes when it spans
    nodes) that some strategy can run with the same pins and batch: what to suggest when the
    count itself admits none (1,000 GPUs share no factor 5 with a power-of-two batch or heads).
    Empty when the degrees are pinned, or nothing within ``reach`` steps runs."""
    if any(getattr(request, pin, None) for pin in ("dp", "tp", "pp")):
        return []
    asked: int = request.gpus
    step = gpus_per_node if asked >= gpus_per_node else 1
    found = []
    for direction in (-1, 1):
        for k in range(1, reach + 1):
            gpus = (asked // step + k) * step if direction > 0 else (-(-asked // step) - k) * step
            if gpus < 1:
                break
            try:
                varied = dataclasses.replace(request, gpus=gpus)
            except TypeError:  # not a dataclass request: nothing to vary
                return []
            except (SearchError, ValueError):  # a count the request's own checks refuse
                continue
            try:
                runs = bool(_enumerated(varied, table, gpus_per_node)[0])
            except (SearchError, ValueError):  # a pin this count cannot honour
                runs = False
            if runs:
                found.append(gpus)
                break
    return found


class _Layout(NamedTuple):
    """Degrees of one layout of the devices, and the choices made per layout."""

    dp: int
    tp: int
    pp: int
    cp: int
    methods: Sequence[str]
    """The context-parallel methods searched (one, unused, at cp 1)."""
    sequence_parallel: Sequence[bool]


def _batchings(request: Any, table: NumericTable, layout: _Layout, overlap: Overlap, skip: Any) -> list[Candidate]:
    """The candidates of one layout: every micro-batching, ZeRO stage, sequence-parallel setting,
    expert-parallel degree and context-parallel method the pins allow."""
    dp, tp, pp, cp = layout.dp, layout.tp, layout.pp, layout.cp
    out: list[Candidate] = []
    if request.micro_batch and (request.global_batch // dp) % request.micro_batch:
        skip(f"--micro-batch {request.micro_batch} does not divide the global batch's share of a data-parallel rank")
    for micro_batch in divisors(request.global_batch // dp):
        if request.micro_batch and micro_batch != request.micro_batch:
            continue
        micro_batches = request.global_batch // (dp * micro_batch)
        if pp > 1 and micro_batches < pp:
            skip("fewer micro-batches than pipeline stages")
            continue
        sharded = dp * cp > 1  # ZeRO shards over the dp * cp ranks holding the same weights
        zeros = [request.zero_stage] if request.zero_stage is not None else ([0, 1, 2, 3] if sharded else [0])
        options = [on for on in layout.sequence_parallel if not on or (request.seq_len // cp) % tp == 0]
        if not options:
            skip(sequence_parallel_obstacle(request, table, tp))
        eps = expert_degrees(request, table, dp) if cp == 1 else [1]
        if not eps:
            skip(f"--ep {request.ep} does not divide the data-parallel degree")
        out.extend(
            Candidate(
                dp,
                tp,
                pp,
                zero,
                micro_batch,
                micro_batches,
                sequence_parallel=sequence_parallel,
                overlap=overlap,
                expert_parallel=ep,
                moe_imbalance=float(getattr(request, "moe_imbalance", 1.0)),
                moe_capacity_factor=getattr(request, "moe_capacity_factor", None),
                context_parallel=cp,
                cp_method=method,
            )
            for sequence_parallel in options
            for ep in eps
            for zero in zeros
            for method in layout.methods
        )
    return out


def context_options(request: Any, table: NumericTable, tp: int, skip: Any) -> list[tuple[int, Sequence[str]]]:
    """The context-parallel degrees searched at tensor-parallel degree ``tp``, each with its
    methods: the pin, or every degree whose ``2 cp`` chunks divide the sequence and leave each
    rank at least ``MIN_CONTEXT_CHUNK`` positions per chunk (no degree above 1 for a request that
    offloads, compresses or pins ep > 1, which the runtime does not split sequences beside);
    Ulysses only where the heads per tp rank divide by cp (``cost_models.context_cost``)."""
    pin, method_pin = getattr(request, "cp", None), getattr(request, "cp_method", None)
    default = method_pin or ContextMethod.RING.value
    if pin is not None:
        degrees = [pin]
    elif _context_excluded(request):
        degrees = [1]
    else:
        room = request.gpus // tp
        degrees = [
            cp
            for cp in divisors(room)
            if request.seq_len % (2 * cp) == 0 and request.seq_len // (2 * cp) >= MIN_CONTEXT_CHUNK
        ] or [1]
        degrees = sorted(set(degrees) | {1})
    out: list[tuple[int, Sequence[str]]] = []
    for cp in degrees:
        if cp == 1:
            out.append((1, (default,)))
            continue
        if (request.gpus // tp) % cp:
            skip(f"--cp {cp} does not divide what tp={tp} leaves of the devices")
            continue
        methods = [method_pin] if method_pin else list(names(ContextMethod))
        heads = int(table.model.get("heads") or 0)
        kv_heads = int(table.model.get("kv_heads") or heads)
        setting = ContextSetting(cp=cp, heads=heads, kv_heads=kv_heads)
        if ContextMethod.ULYSSES in methods and ulysses_obstacle(setting, tp):
            if method_pin:
                skip(f"--cp-method ulysses at tp={tp}, cp={cp}: {ulysses_obstacle(setting, tp)}")
            methods.remove(ContextMethod.ULYSSES.value)
        if methods:
            out.append((cp, tuple(methods)))
    return out


def _context_excluded(request: Any) -> bool:
    """Whether the request pins what the runtime does not split sequences beside."""
    offloads = any(getattr(request, f"offload_{kind}", None) not in (None, "none") for kind in ("optimizer", "params"))
    ep = getattr(request, "ep", None)
    return offloads or getattr(request, "dp_compression", None) == GradCompression.ONEBIT_ADAM or bool(ep and ep > 1)


def _nothing_left(request: Any, why: dict[str, int], nearby: Sequence[int] = ()) -> SearchError:
    """The error of an enumeration that kept no candidate: the pins, each reason counted (the
    degrees a reason shares listed once), and the nearest device counts that do run."""
    pins = " ".join(
        f"--{pin.replace('_', '-')} {getattr(request, pin)}"
        for pin in ("dp", "tp", "pp", "micro_batch")
        if getattr(request, pin) is not None
    )
    reasons = "; ".join(f"{reason} ({n}x)" for reason, n in _grouped(why).items()) or "the pins exclude every degree"
    advice = (
        "Drop --sequence-parallel on, or pin a --tp it applies to."
        if why and all(reason.startswith("--sequence-parallel") for reason in why)
        else "Pick a global batch divisible by more data-parallel degrees, or pin fewer decisions."
    )
    if nearby:
        counts = " and ".join(f"{gpus:,}" for gpus in nearby)
        advice += f" The nearest device counts some strategy runs on: --gpus {counts}."
    return SearchError(
        f"No combination of degrees and micro-batching satisfies --gpus {request.gpus}, --global-batch "
        f"{request.global_batch}{' and ' + pins if pins else ''}: {reasons}. {advice}"
    )


def _grouped(why: dict[str, int]) -> dict[str, int]:
    """``why`` with the reasons that differ only in a degree (``--tp 5 does not divide ...``,
    ``--tp 8 does not divide ...``) merged into one listing the degrees (``--tp 5, 8 or 10 does
    not divide ...``), their counts summed."""
    groups: dict[tuple[str, str], list[tuple[int, int]]] = {}
    out: dict[str, int] = {}
    for reason, n in why.items():
        flag, _, rest = reason.partition(" ")
        value, _, tail = rest.partition(" ")
        if flag.startswith("--") and value.isdigit() and tail:
            groups.setdefault((flag, tail), []).append((int(value), n))
        else:
            out[reason] = n
    for (flag, tail), values in groups.items():
        degrees = [str(value) for value, _ in sorted(values)]
        listed = degrees[0] if len(degrees) == 1 else f"{', '.join(degrees[:-1])} or {degrees[-1]}"
        out[f"{flag} {listed} {tail}"] = sum(n for _, n in values)
    return out


# ---------------------------------------------------------------------------------- offload
def offload_pinned(request: Any) -> bool:
    """True when the request pins some state off the device (``--offload-* cpu|nvme``): only
    offloaded candidates are then searched."""
    return any(getattr(request, f"offload_{kind}", None) not in (None, "none") for kind in ("optimizer", "params"))


def _tiers(request: Any, kind: str, hw: HardwareProfile) -> list[str]:
    pin = getattr(request, f"offload_{kind}", None)
    if pin is not None:
        return [pin]
    return [
        tier
        for tier in TIERS
        if tier == "none" or not offload_missing(hw, *((tier, "none") if kind == "optimizer" else ("cpu", tier)))
    ]


def offload_variants(request: Any, candidates: Sequence[Candidate], hw: HardwareProfile) -> list[Candidate]:
    """The offloaded versions of ``cands`` (offload none) that the pins and ``hw`` allow.

    Each keeps its degrees and batching; at ``dp = 1``, where every ZeRO stage is the same and the
    enumeration keeps only stage 0, the variants take stages 1, 2 and 3 (the runtime offloads a
    ZeRO shard, here the whole model), stage 3 only with the parameters offloaded (on one rank
    ZeRO 3 otherwise costs what ZeRO 2 does).
    """
    out: list[Candidate] = []
    seen: set[Candidate] = set()
    opt_tiers, par_tiers = _tiers(request, "optimizer", hw), _tiers(request, "params", hw)
    for candidate in candidates:
        if candidate.compressed or candidate.expert_parallel > 1 or candidate.context_parallel > 1:
            # 1-bit Adam, ep and cp keep state on the device
            continue
        zeros = [candidate.zero_stage] if candidate.weight_dp > 1 or request.zero_stage is not None else [1, 2, 3]
        for zero in zeros:
            for optimizer_tier in opt_tiers:
                for params_tier in par_tiers:
                    if optimizer_tier == params_tier == "none" or check_offload(optimizer_tier, params_tier, zero):
                        continue
                    if candidate.dp == 1 and zero == 3 and params_tier == "none" and request.zero_stage is None:
                        continue  # ZeRO 3 on one rank without offloaded parameters is ZeRO 2
                    variant = dataclasses.replace(
                        candidate, zero_stage=zero, offload_optimizer=optimizer_tier, offload_params=params_tier
                    )
                    if variant not in seen:
                        seen.add(variant)
                        out.append(variant)
    return out


def compression_variants(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The 1-bit Adam versions of the ``candidates`` it applies to: dp > 1, ZeRO 0 or 1, every
    state on the device (``cost_models.compression_cost``)."""
    return [
        dataclasses.replace(candidate, dp_compression=GradCompression.ONEBIT_ADAM.value)
        for candidate in candidates
        if candidate.dp > 1
        and candidate.zero_stage <= 1
        and not candidate.offloads
        and not candidate.compressed
        and candidate.expert_parallel == 1
        and candidate.context_parallel == 1
    ]


def memory_may_bind(costs: CandidateCosts, kinds: Sequence[str], checkpoint: str = "auto") -> bool:
    """False when every strategy of this (plain) candidate fits without recompute (or, under
    ``--checkpoint all``, with its forced recompute), so that memory cannot be what keeps it from
    its fastest strategy: then no offloaded version of it can be faster (same work, more time).

    One stage (``pp = 1``): the one partition is priced exactly. Several: every stage is bounded
    by all the layers' state, their saved activations times the first stage's micro-batches in
    flight (the most) and the largest ZeRO buffer and backward transient; when that fits, every
    partition does. ``True`` whenever neither test proves the slack."""
    rows = costs.num_layers
    if costs.cand.pp == 1:
        recomputed = [i for i, k in enumerate(kinds) if k == "block"] if checkpoint == "all" else []
        return not evaluate(costs, [(0, rows - 1)], recomputed, pinned_selective(costs, kinds, checkpoint)).feasible
    if checkpoint in ("all", "selective"):
        return True
    layers = costs.layers
    upper = (
        sum(layer.state_b for layer in layers)
        + max(layer.trans_b for layer in layers)
        + costs.inflight[0] * sum(layer.saved_b for layer in layers)
        + max(layer.bt_b for layer in layers)
    )
    return upper > costs.capacity


def pinned_selective(costs: CandidateCosts, kinds: Sequence[str], checkpoint: str) -> list[int]:
    """The layers ``--checkpoint selective`` recomputes selectively: every block with attention
    cores (none under the other modes)."""
    if checkpoint != "selective":
        return []
    return [i for i, kind in enumerate(kinds) if kind == "block" and costs.layers[i].sel_saved_b > 0]


def check_offload_pins(request: Any, hw: HardwareProfile) -> None:
    """Reject offload pins the hardware profile cannot price, naming the missing fields."""
    optimizer_tier, params_tier = request.offload_optimizer or "none", request.offload_params or "none"
    missing = offload_missing(hw, optimizer_tier, params_tier)
    if missing:
        flags = " ".join(
            f"--offload-{kind} {tier}"
            for kind, tier in (("optimizer", optimizer_tier), ("params", params_tier))
            if tier != "none"
        )
        raise SearchError(
            f"{flags}: hardware profile {hw.name!r} lacks {', '.join(missing)}, which pricing "
            "that offload needs. Add them to the profile (see cost_models/hardware.py), or run "
            "`planner calibrate` on the machine to measure them."
        )


# ---------------------------------------------------------------------------------- heuristic
def balanced_partition(weights: Sequence[float], stages: int) -> list[tuple[int, int]]:
    """Contiguous split of ``weights`` into ``p`` non-empty ranges minimizing the largest sum.

    Bisection on the bound with a greedy packing check (exact up to the bisection tolerance).
    """
    n = len(weights)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} layers into {stages} non-empty stages")

    def pack(bound: float) -> list[int] | None:
        cuts, acc = [], 0.0
        for i, weight in enumerate(weights):
            if acc and acc + weight > bound:
                cuts.append(i)
                acc = 0.0
            acc += weight
        return cuts if len(cuts) <= stages - 1 else None

    low, high = max(weights), sum(weights)
    for _ in range(60):
        mid = (low + high) / 2
        if pack(mid) is None:
            low = mid
        else:
            high = mid
    cuts = pack(high) or []
    bounds = [0, *cuts, n]
    while len(bounds) - 1 < stages:  # split the widest range until there are p (the bound still holds)
        i = max(range(len(bounds) - 1), key=lambda index: bounds[index + 1] - bounds[index])
        bounds.insert(i + 1, (bounds[i] + bounds[i + 1]) // 2)
    return [(bounds[i], bounds[i + 1] - 1) for i in range(stages)]


def heuristic_strategy(costs: CandidateCosts, kinds: Sequence[str], checkpoint: str = "auto") -> Evaluation | None:
    """A good feasible strategy found without a solver, or ``None``.

    The search hands its cost to the ILP as a cutoff, so the solver starts with an incumbent
    (and refutes hopeless candidates at the root); the ILP's answer is never worse than this.
    Uniform tables (identical blocks between the embedding and head rows) use
    :func:`_uniform_heuristic`; others the time-balanced partition, then in each stage that
    overflows, recompute the layers that free the most memory per second of recompute.
    """
    if is_repeated(costs, kinds):
        return _uniform_heuristic(costs, checkpoint)
    stage_count = costs.cand.pp
    stages = balanced_partition([layer.work_s + layer.zero_mb_s for layer in costs.layers], stage_count)
    recomputed: set[int] = set()
    if checkpoint == "all":
        recomputed = {i for i, k in enumerate(kinds) if k == "block"}
    elif checkpoint == "auto":
        for k, (first, last) in enumerate(stages):
            held = range(first, last + 1)
            inflight = costs.inflight[k]
            layers = costs.layers
            mem = sum(layers[i].state_b + inflight * layers[i].saved_b for i in held) + max(
                layers[i].trans_b for i in held
            )
            order = sorted(
                (i for i in held if layers[i].saved_b > layers[i].input_b),
                key=lambda i: -inflight * (layers[i].saved_b - layers[i].input_b) / max(layers[i].rec_s, 1e-30),
            )
            peak = 0.0
            for i in order:
                if mem <= costs.capacity:
                    break
                new_peak = max(peak, layers[i].saved_b)
                mem += new_peak - peak - inflight * (layers[i].saved_b - layers[i].input_b)
                peak = new_peak
                recomputed.add(i)
    evaluation = evaluate(costs, stages, sorted(recomputed), pinned_selective(costs, kinds, checkpoint))
    return evaluation if evaluation.feasible else None


def _as_selective(cost: LayerCost) -> LayerCost:
    """A block that recomputes its attention cores, seen as a block that does not recompute:
    fewer activations kept, the cores' forward added to its work, their re-materialization a
    transient (what ``cost_models.strategy.selective_view`` and ``evaluate`` price)."""
    return dataclasses.replace(
        cost,
        saved_b=cost.saved_b - cost.sel_saved_b,
        compute_s=cost.compute_s + cost.sel_rec_s,
        bt_b=max(cost.bt_b, cost.sel_saved_b),
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

    def __init__(self, costs: CandidateCosts, checkpoint: str, relaxed: bool):
        self.costs, self.mode, self.relaxed = costs, checkpoint, relaxed
        self.p = stages = costs.cand.pp
        self.pre, self.blk, self.post = costs.layers[0], costs.layers[1], costs.layers[-1]
        # a draft's last block may differ once priced: the relaxed model leaves it out either way
        distinct_last = costs.layers[-2] != self.blk or (relaxed and costs.draft)
        self.tail = [costs.layers[-2]] if distinct_last else []
        if checkpoint == "selective":  # every block recomputes its cores, none recomputes whole
            self.blk = _as_selective(self.blk) if self.blk.sel_saved_b > 0 else self.blk
            self.tail = [_as_selective(row) if row.sel_saved_b > 0 else row for row in self.tail]
            self.mode = "none"
        # auto may also free a block's core bytes at their (maybe cheaper) price: the relaxed
        # model charges forced freeing at the cheapest rate per byte of the two (sound)
        blk = self.blk
        self.sel_rate = (
            blk.sel_rec_s / blk.sel_saved_b if checkpoint == "auto" and relaxed and blk.sel_saved_b > 0 else math.inf
        )
        self.L = costs.num_layers - 2 - len(self.tail)
        self.lows = [0 if relaxed or not 0 < k < stages - 1 else 1 for k in range(stages)]
        self._memo: dict[tuple[int, int], tuple[int, float] | None] = {}
        # a block's figures, read once (LayerCost's are properties summing fields)
        self._block = (blk.state_b, blk.saved_b, blk.trans_b, blk.work_s + blk.zero_mb_s, blk.saved_b - blk.input_b)
        self._fixed = [self._stage_rows(k) for k in range(stages)]

    def _stage_rows(self, k: int) -> tuple[float, float, float, float, float]:
        """Stage ``k``'s figures that do not depend on its block count: its in-flight
        micro-batches, the largest transient of its own rows, their memory, their work and
        (exact model) its sends."""
        costs, stages = self.costs, self.p
        tail = [] if self.relaxed else self.tail
        rows = ([self.pre] if k == 0 else []) + (tail + [self.post] if k == stages - 1 else [])
        in_flight = costs.inflight[k]
        trans = max([row.trans_b for row in rows] + [0])
        act = (lambda row: min(row.saved_b, row.input_b)) if self.relaxed else (lambda row: row.saved_b)
        memory = sum(row.state_b + in_flight * act(row) for row in rows)
        work = sum(row.work_s + row.zero_mb_s for row in rows)
        sends = 0.0
        if not self.relaxed:
            sends = (costs.send_s(1, k) if k < stages - 1 else 0.0) + (costs.send_s(1, k - 1) if k > 0 else 0.0)
        return in_flight, trans, memory, work, sends

    def stage(self, k: int, blocks: int) -> tuple[int, float] | None:
        """``(r, t_k(n))`` of stage ``k`` holding ``n`` run blocks; ``None`` if it cannot fit."""
        key = (k, blocks)
        if key in self._memo:
            return self._memo[key]
        blk, capacity = self.blk, self.costs.capacity
        state_b, saved_b, trans_b, work_s, delta = self._block
        in_flight, rows_trans, rows_memory, rows_work, sends = self._fixed[k]
        trans = max(rows_trans, trans_b) if blocks else rows_trans
        mem = blocks * (state_b + in_flight * saved_b) + trans + rows_memory
        if self.mode == "auto" and math.isfinite(self.sel_rate) and mem > capacity and blocks:
            # relaxed with selective: free the excess fractionally at the cheaper rate per byte,
            # re-materializing the smaller of the two transients (a lower bound of either choice)
            rates = [self.sel_rate] + ([blk.rec_s / delta] if delta > 0 else [])
            most = blocks * in_flight * max(delta, blk.sel_saved_b)
            excess = mem + min(saved_b, blk.sel_saved_b) - capacity
            out = None
            if excess <= most:
                out = (0, blocks * work_s + max(excess, 0.0) / in_flight * min(rates) + rows_work)
            self._memo[key] = out
            return out
        if self.mode == "all":
            recomputed = blocks
        elif mem <= capacity or self.mode == "none" or blocks == 0 or delta <= 0:
            recomputed = 0
        else:
            recomputed = max(1, math.ceil((mem + saved_b - capacity) / (in_flight * delta)))
        if recomputed:
            mem += saved_b - in_flight * recomputed * delta
        out = None
        if recomputed <= blocks and mem <= capacity:
            micro_step = blocks * work_s + recomputed * blk.rec_s + rows_work
            if not self.relaxed:
                micro_step += sends
            out = (recomputed, micro_step)
        self._memo[key] = out
        return out

    def least_micro_step(self) -> float | None:
        """``allocate()``'s ``T*`` alone (None: no fit), every stage's ``t_k(n)`` computed at once:
        the ``j``-th block handed out has the ``j``-th smallest increment, so ``T*`` is the
        ``L - sum(lows)``-th smallest of the stages' increasing sequences (each cut where a stage
        stops fitting), or the largest starting cost. The same arithmetic as :meth:`stage`,
        elementwise, so the same figure to the bit (a test compares them)."""
        stages, blocks = self.p, self.L
        state_b, saved_b, trans_b, work_s, delta = self._block
        fixed = np.array(self._fixed, dtype=float)  # per stage: in flight, trans, memory, work, sends
        in_flight, rows_trans, rows_memory, rows_work, sends = (fixed[:, i : i + 1] for i in range(5))
        n = np.arange(blocks + 1, dtype=float)[None, :]
        trans = np.where(n > 0, np.maximum(rows_trans, trans_b), rows_trans)
        mem = n * (state_b + in_flight * saved_b) + trans + rows_memory
        micro_step, fits = self._micro_steps(n, mem, in_flight, rows_work, (state_b, saved_b, work_s, delta))
        if not self.relaxed:
            micro_step = micro_step + sends
        lows = np.array(self.lows)[:, None]
        fits &= n >= lows
        # a stage that stops fitting at n takes no more blocks (memory grows with n)
        fits &= np.cumsum(~fits & (n >= lows), axis=1) == 0
        starts = micro_step[np.arange(stages), lows[:, 0]]
        if not fits[np.arange(stages), lows[:, 0]].all():
            return None
        handed = blocks - int(lows.sum())
        if handed < 0:
            return None
        increments = micro_step[fits & (n > lows)]
        if increments.size < handed:
            return None
        slowest = float(starts.max())
        if handed == 0:
            return slowest
        return max(slowest, float(np.partition(increments, handed - 1)[handed - 1]))

    def _micro_steps(self, n, mem, in_flight, rows_work, block: tuple) -> tuple[Any, Any]:
        """:meth:`stage`'s micro-step and fit of every stage (rows) and block count (columns)."""
        state_b, saved_b, work_s, delta = block
        blk, capacity = self.blk, self.costs.capacity
        if self.mode == "auto" and math.isfinite(self.sel_rate):
            rates = min([self.sel_rate] + ([blk.rec_s / delta] if delta > 0 else []))
            most = n * in_flight * max(delta, blk.sel_saved_b)
            excess = mem + min(saved_b, blk.sel_saved_b) - capacity
            freeing = (mem > capacity) & (n > 0)
            step = np.where(freeing, n * work_s + np.maximum(excess, 0.0) / in_flight * rates + rows_work, 0.0)
            fits_freeing = excess <= most
        else:
            freeing = np.zeros(mem.shape, dtype=bool)
            step, fits_freeing = np.zeros(mem.shape), np.zeros(mem.shape, dtype=bool)
        if self.mode == "all":
            recomputed = np.broadcast_to(n, mem.shape).copy()
        elif self.mode == "none" or delta <= 0:
            recomputed = np.zeros(mem.shape)
        else:
            needed = np.maximum(1.0, np.ceil((mem + saved_b - capacity) / (in_flight * delta)))
            recomputed = np.where((mem <= capacity) | (n == 0), 0.0, needed)
        after = np.where(recomputed > 0, mem + (saved_b - in_flight * recomputed * delta), mem)
        plain = n * work_s + recomputed * blk.rec_s + rows_work
        fits = np.where(freeing, fits_freeing, (recomputed <= n) & (after <= capacity))
        return np.where(freeing, step, plain), fits

    def allocate(self) -> tuple[float, list[int]] | None:
        """The smallest achievable micro-step ``T*`` and block counts achieving it (None: no fit).

        Min-max allocation with increasing per-stage costs: start every stage at its fewest
        blocks, then hand out the remaining blocks one at a time to the stage whose next block
        costs least. The ``j``-th block handed out has the ``j``-th smallest increment value, so the
        largest value reached is the least ``T`` with ``sum_k N_k(T) >= L`` (exact).
        """
        stages, blocks = self.p, self.L
        counts = list(self.lows)
        left = blocks - sum(counts)
        if left < 0:
            return None
        base = [self.stage(k, counts[k]) for k in range(stages)]
        fitting = [cost for cost in base if cost is not None]
        if len(fitting) < len(base):
            return None
        slowest = max(cost[1] for cost in fitting)
        heap: list[tuple[float, int]] = []
        for k in range(stages):
            following = self.stage(k, counts[k] + 1) if counts[k] < blocks else None
            if following is not None:
                heap.append((following[1], -k))
        heapq.heapify(heap)
        for _ in range(left):
            if not heap:
                return None
            micro_step, negated_stage = heapq.heappop(heap)
            k = -negated_stage
            counts[k] += 1
            slowest = max(slowest, micro_step)
            following = self.stage(k, counts[k] + 1) if counts[k] < blocks else None
            if following is not None:
                heapq.heappush(heap, (following[1], -k))
        return slowest, counts


def uniform_time_bound(costs: CandidateCosts, kinds: Sequence[str], checkpoint: str = "auto") -> float:
    """A step-time lower bound for repeated-block tables that counts forced recompute.

    Every feasible strategy has ``T >= t_k(n_k)`` on each stage of the relaxed model of
    :class:`_UniformStages` with ``sum_k n_k = L``, hence ``T`` is at least the smallest
    achievable bound there; ``inf`` when no partition fits in memory at all. Falls back to
    :func:`time_lower_bound` for other tables.
    """
    base = time_lower_bound(costs)
    if not is_repeated(costs, kinds):
        return base
    found = _relaxed_allocation(costs, checkpoint)
    if found is None:
        return math.inf
    micro_batches = costs.cand.num_micro_batches
    return max(base, (micro_batches - 1) * found + max(found, total_work(costs)) + tail_bound(costs))


def forced_micro_step(costs: CandidateCosts, kinds: Sequence[str], checkpoint: str = "auto") -> float:
    """The least slowest-stage micro-step of any partition of a repeated-block table, counting the
    recompute each stage's memory forces at 1F1B's in-flight counts (the relaxed model of
    :class:`_UniformStages`; ``inf`` when nothing fits, 0 for other tables). The other schedules
    hold at least as many micro-batches on each rank (zero bubble ``min(p, m)``, interleaved rank
    ``r`` ``(2 (p - r - 1) + (v - 1) p + 1) / v >= p - r``), so on equal chunks it bounds them too."""
    if not is_repeated(costs, kinds):
        return 0.0
    found = _relaxed_allocation(costs, checkpoint)
    return math.inf if found is None else found


#: The relaxed allocations found so far, per candidate's costs (by identity: a copy with other
#: in-flight counts or capacity, ``planner.search.schedule_refit.schedule_costs``, is another key)
#: and recompute mode; the search's bounds and the schedule walk's ask for the same ones.
_RELAXED: "weakref.WeakKeyDictionary[CandidateCosts, dict]" = weakref.WeakKeyDictionary()


def _relaxed_allocation(costs: CandidateCosts, checkpoint: str) -> float | None:
    """The least micro-step of the relaxed model (:meth:`_UniformStages.least_micro_step`), once
    per costs object and mode."""
    known = _RELAXED.setdefault(costs, {})
    if checkpoint not in known:
        known[checkpoint] = _UniformStages(costs, checkpoint, relaxed=True).least_micro_step()
    return known[checkpoint]


def _uniform_heuristic(costs: CandidateCosts, checkpoint: str) -> Evaluation | None:
    """The min-max allocation of the exact :class:`_UniformStages` model, priced by ``evaluate``."""
    model = _UniformStages(costs, checkpoint, relaxed=False)
    found = model.allocate()
    if found is None:
        return None
    stage_count, counts = model.p, found[1]
    stages: list[tuple[int, int]] = []
    recomputed: set[int] = set()
    start = 0
    for k in range(stage_count):
        last = start + counts[k] + (k == 0) + (k == stage_count - 1) * (1 + len(model.tail)) - 1
        first_block = start + (k == 0)
        allotted = model.stage(k, counts[k])
        assert allotted is not None  # allocate() only hands out counts that fit
        recomputed.update(range(first_block, first_block + allotted[0]))
        stages.append((start, last))
        start = last + 1
    if checkpoint == "all":  # every block, the distinct last one included
        recomputed = set(range(1, costs.num_layers - 1))
    kinds = ["pre"] + ["block"] * (costs.num_layers - 2) + ["post"]
    evaluation = evaluate(costs, stages, sorted(recomputed), pinned_selective(costs, kinds, checkpoint))
    return evaluation if evaluation.feasible else None
