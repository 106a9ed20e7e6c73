"""The price of a strategy under a pipeline schedule other than 1F1B.

:func:`cost_models.strategy.evaluate` prices 1F1B in closed form (the ILP optimizes that form).
Interleaved 1F1B and zero bubble (ZB-H1, Qi et al. 2023) change three things, priced here with
the *same* per-layer costs (``LayerCost``) so that the schedules compare like for like:

Model chunks
------------
The interleaved schedule cuts the layer table into ``p v`` contiguous chunks, chunk ``c`` on
pipeline rank ``c % p`` (``runtime.contract.schedule_ir``; plan.json's ``stages`` lists them in model order).
:func:`split_chunks` cuts them to minimize the slowest chunk's micro-step (the classic min-max
contiguous partition, by bisection on the threshold): with identical blocks every rank gets
``v`` chunks of about ``L / (p v)`` blocks, the embedding rides in chunk 0 and the head in chunk
``p v - 1``. Zero bubble keeps the 1F1B partition (one chunk per rank). The recomputed layers are
the 1F1B solution's.

Times (:func:`chunk_times`): per chunk and micro-batch, ``F`` = forward compute, forward TP
all-reduces (and a third of ZeRO-3's gathers); the full backward is the rest of the chunk's
micro-step (backward compute, backward TP, recompute, ZeRO-2/3 traffic), exactly 1F1B's split.
Every chunk boundary costs one send each way per micro-batch, ``send_s`` (the slowest boundary's
alpha-beta time plus its wait): with ``v`` chunks a rank sends ``v`` times as often as under 1F1B.

The W split
-----------
Zero bubble splits each backward into ``B`` (input gradients, what the previous stage waits for)
and ``W`` (weight gradients, run when the schedule says). ``W`` of a layer is
``LayerCost.wgrad_s`` (``cost_models.wgrad``): the backward products that contract over the
micro-batch's tokens (``dW = X^T dY``: ``k = b s`` and ``m != b s`` in the layer table's
``bwd_gemms``), priced by shape like every product, plus the gradient accumulation, scaled by the backward's host overhead. A
recomputed layer's forward runs in ``B`` and again in ``W`` (the runtime's ``W`` is an autograd
call of its own, which re-enters the checkpoint), so ``W`` also pays its recompute. A table
without listed products (older tables, the closed-form test tables) takes half of the backward's
matmul FLOPs: a linear layer's backward is an input-gradient and a weight-gradient product of
equal size, attention's core products have no weight. On GPT blocks this gives ``W`` about 40%
of the backward (the attention core and the memory-bound ops are ``B``).

Time from the simulated schedule
--------------------------------
The caller (``planner.search.schedule_search``, which may import the runtime) runs the runtime's own
action lists (``runtime.contract.schedule_ir``) through its simulator with these times and hands back a
:class:`SimulatedPipeline`: the makespan of the ``m`` micro-batches and what each rank holds.
:func:`evaluate_schedule` turns it into an :class:`~cost_models.strategy.Evaluation`::

    step       = makespan + D                        (D: the exposed DP/ZeRO tail + optimizer, as 1F1B)
    pp_bubble  = makespan - m x (compute + recompute + tp + ZeRO per micro-batch) of the busiest rank
    bubble_fraction = (makespan - m T) / makespan    (T: the busiest rank's micro-step, sends included)

so the parts still sum to the step. Documented checks with equal chunks (``F``, ``B``, ``W``
per stage, free sends), which the tests hold the simulation to: 1F1B's idle time per unit of
compute is ``(p - 1) / m``, interleaved's ``(p - 1) / (v m)``, ZB-H1's ``(p - 1) / (3 m)`` when
``F = B = W``. The 1F1B closed form is exact for equal stages and a few percent under the
simulation when the last stage (the head) is slower, so a schedule priced by simulation is
compared against 1F1B slightly pessimistically: it must win by more than that to be chosen.

Memory
------
Activations held per rank, in units of the rank's own activations of one micro-batch (its ``v``
chunks together), replace 1F1B's ``min(p - k, m)`` in ``cost_models.memory``:

- interleaved: the simulated peak of chunk activations (``F`` done, ``B`` not) over ``v``; closed
  form on rank ``r`` (:func:`interleaved_inflight`): ``(2 (p - r - 1) + (v - 1) p + 1) / v``, on
  rank 0 ``p (1 + (p - 1) / (p v))``: ``1 + (p - 1) / (p v)`` times 1F1B's ``p``;
- zero bubble: the runtime keeps a chunk's autograd graph from ``B`` until its ``W``, so a rank
  holds one full micro-batch of activations per ``F`` whose ``W`` has not run
  (``runtime.contract.schedule_ir.peak_weight_pending``): 1F1B's ``min(p - r, m)`` plus rank ``r``'s ``W``
  delay, ``min(p, m)`` on every rank. The last stage (the head, the largest activations) goes
  from 1 to ``min(p, m)``. Two corrections, both from ``passes.split_backward``:

  * ``B`` keeps the gradient recorded at each node that reads a weight (``runtime.pipeline.executor``:
    ``W`` restarts autograd there): products with a weight and norms, their outputs' size
    (``LayerCost.wgrad_keep_b``; for the head, the logits' gradient). The first chunk has no
    ``B`` (nothing before it needs a gradient) and keeps none.
  * ``B`` frees what only the chunk's outputs hold: the saved tensors downstream of every weight
    product of its last layer (``LayerCost.tail_b``; for the head, the loss's log-probabilities,
    as large as the logits), kept by every other schedule until the backward too.

  With the chunks' sizes known (``ChunkTimes.act_bytes``, ``keep_bytes``, ``free_bytes``) both
  are followed through the rank's action order (``F`` adds a chunk's activations; the end of a
  ``B`` adds its kept gradients, then frees the tail; ``W`` frees the rest), so the gradients
  count only while their ``W`` is pending; ``SimulatedPipeline.w_pending`` (the same gradients
  counted for one micro-batch, when the sizes are not known) is then 0. Measured with
  ``planner validate`` (2 CPU processes, GPT 4 x 256, vocab 8192, seq 128, fp32, micro-batch 4,
  4 micro-batches), predicted / measured, the peak on the head's rank:

  | stages | 1F1B | ZB-H1 |
  |---|---|---|
  | embed+3 blocks, block+head | 125.3 / 122.3 MiB | 132.1 / 133.6 MiB (-1.1%) |
  | embed+1 block, 3 blocks+head | 141.2 / 142.7 MiB | 200.3 / 202.8 MiB (-1.2%) |

  Before the two corrections (gradients of the weight products only, charged to the first chunk
  too, and no early tail) ZB-H1 predicted 146.6 and 211.8 MiB; the runtime also kept the log-
  probabilities of the micro-batch that last ran ``F`` until the next ``F`` (a loop variable),
  which the second layout measured as 210.3 MiB.

Parameters, gradients and optimizer state are those of the rank's layers (all its chunks); the
ZeRO transients of its largest layer. Bytes sent grow with the sends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from cost_models.comm_cost import step_control_bytes
from cost_models.offload_cost import offload_breakdown
from cost_models.strategy import (
    CandidateCosts,
    Evaluation,
    StageCost,
    Strategy,
    _stage_memory,
    check_selective,
    compile_seconds,
    selective_view,
)

__all__ = [
    "SCHEDULES",
    "ChunkTimes",
    "SimulatedPipeline",
    "split_chunks",
    "chunk_times",
    "interleaved_inflight",
    "chunk_ranges_of_rank",
    "evaluate_schedule",
]

#: Pipeline schedules a strategy may run (plan.json ``schedule``).
SCHEDULES = ("1f1b", "interleaved", "zero-bubble")


@dataclass(frozen=True)
class ChunkTimes:
    """Seconds of one micro-batch per model chunk (index = chunk in model order)."""

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    """``B``: the whole backward, or without ``weight_s`` when the schedule splits it."""
    weight_s: tuple[float, ...] | None
    """``W`` (weight gradients) per chunk under zero bubble; ``None`` otherwise."""
    send_s: float
    """One point-to-point transfer (the slowest boundary's), occupying the sending rank."""
    act_bytes: tuple[float, ...] | None = None
    """Activation bytes one micro-batch leaves on each chunk until its backward (a recomputed
    layer its input): weights the schedule's in-flight chunks by their size (``None``: equal)."""
    keep_bytes: tuple[float, ...] | None = None
    """Under zero bubble, the gradients each chunk keeps from ``B`` to ``W`` (``wgrad_keep_b``)."""
    free_bytes: tuple[float, ...] | None = None
    """Under zero bubble, the activations each chunk frees at ``B`` already, not at ``W``: its last
    layer's tail (``LayerCost.tail_b``; the first chunk, whose backward all runs at ``W``, none)."""


@dataclass(frozen=True)
class SimulatedPipeline:
    """What the simulated schedule says (filled by ``planner.search.schedule_search``)."""

    makespan_s: float
    """Time from the first forward to the last rank's last action, ``m`` micro-batches."""
    held: tuple[float, ...]
    """Per rank, peak micro-batches of activations held, in units of the rank's own activations
    of one micro-batch."""
    messages: int
    """Point-to-point messages of one step, over all ranks."""
    w_pending: tuple[float, ...] = ()
    held_between: tuple[float, ...] = ()
    """Per rank, the most activations and kept gradients held at any moment (same units as
    ``held``, which counts what is held when a backward starts, under its transients): a floor
    for the activation memory when kept gradients outlast the transients; empty if not followed."""
    """Per rank, micro-batches whose weight products' output gradients (``LayerCost.wgrad_keep_b``)
    count at the peak, same units as ``held`` (module docstring, "Memory"); empty without ``W``."""


def split_chunks(costs: Sequence[float], num_chunks: int) -> tuple[tuple[int, int], ...]:
    """``num_chunks`` contiguous non-empty ranges of ``costs`` (per layer) minimizing the largest
    range's sum: bisection on the threshold with a greedy fill that leaves a layer for every
    remaining chunk."""
    n = len(costs)
    if not 1 <= num_chunks <= n:
        raise ValueError(f"cannot cut {n} layers into {num_chunks} non-empty chunks")

    def cut(limit: float) -> list[tuple[int, int]] | None:
        out, a, acc = [], 0, 0.0
        for i, c in enumerate(costs):
            left = num_chunks - len(out) - 1  # chunks still to open after the current one
            if i > a and (acc + c > limit or n - i == left):
                out.append((a, i - 1))
                a, acc = i, 0.0
            acc += c
        out.append((a, n - 1))
        return out if len(out) == num_chunks and max(sum(costs[x : y + 1]) for x, y in out) <= limit else None

    lo, hi = max(costs), sum(costs)
    best = cut(hi * (1 + 1e-12))
    for _ in range(60):
        if hi - lo <= 1e-9 * hi:
            break
        mid = (lo + hi) / 2
        got = cut(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    if best is None:  # pragma: no cover - cut(sum) always succeeds
        raise ValueError("no chunking found")
    return tuple(best)


def _chunk_forward(cc: CandidateCosts, a: int, b: int) -> float:
    ls = cc.layers[a : b + 1]
    zmb = sum(l.zero_mb_s for l in ls)
    return sum(l.fwd_s + l.tp_fwd_s for l in ls) + (zmb / 3 if cc.cand.zero_stage == 3 else 0.0)


def _chunk_step(cc: CandidateCosts, a: int, b: int, ck: frozenset, sel: frozenset = frozenset()) -> float:
    """One micro-batch through chunk ``[a, b]`` without its sends."""
    return sum(
        l.work_s + l.zero_mb_s + (l.rec_s if i in ck else 0.0) + (l.sel_rec_s if i in sel else 0.0)
        for i, l in zip(range(a, b + 1), cc.layers[a : b + 1])
    )


def send_seconds(cc: CandidateCosts, chunks: Sequence[tuple[int, int]]) -> float:
    """The slowest chunk boundary's transfer (a boundary between ranks ``c % p`` and ``(c+1) % p``
    is priced on 1F1B's placement of stage boundary ``c % p``, the wrap from rank ``p - 1`` to 0
    on the slowest one)."""
    p = cc.cand.pp
    if p == 1 or len(chunks) < 2:
        return 0.0
    return max(cc.send_s(b, min(c % p, p - 2)) for c, (_a, b) in enumerate(chunks[:-1]))


def chunk_times(
    cc: CandidateCosts,
    chunks: Sequence[tuple[int, int]],
    checkpoint: Sequence[int],
    schedule: str,
    selective: Sequence[int] = (),
) -> ChunkTimes:
    """Per-chunk ``F``, ``B`` (and ``W`` under zero bubble) of one micro-batch (module docstring).
    A selectively recomputed core runs again in ``B`` only (``W`` restarts autograd at the weight
    products, outside the cores)."""
    ck = frozenset(checkpoint)
    fwd = [_chunk_forward(cc, a, b) for a, b in chunks]
    full = [_chunk_step(cc, a, b, ck, frozenset(selective)) - f for (a, b), f in zip(chunks, fwd)]
    weight = None
    if schedule == "zero-bubble":
        weight = tuple(min(sum(l.wgrad_s for l in cc.layers[a : b + 1]), bw) for (a, b), bw in zip(chunks, full))
        full = [bw - w for bw, w in zip(full, weight)]
        # a recomputed layer's forward runs again at W (the runtime's W is its own autograd task)
        weight = tuple(
            w + sum(cc.layers[i].rec_s for i in range(a, b + 1) if i in ck) for (a, b), w in zip(chunks, weight)
        )
    sel = frozenset(selective)
    acts = tuple(
        sum(
            l.input_b if i in ck else l.saved_b
            for i, l in zip(range(a, b + 1), selective_view(cc.layers[a : b + 1], range(a, b + 1), sel))
        )
        for a, b in chunks
    )
    keep = free = None
    if weight is not None:
        # the first chunk has no B (nothing before it needs a gradient): W runs its whole backward
        keep = tuple(
            0.0 if c == 0 else sum(l.wgrad_keep_b for l in cc.layers[a : b + 1]) for c, (a, b) in enumerate(chunks)
        )
        free = tuple(0.0 if c == 0 or b in ck or b in sel else cc.layers[b].tail_b for c, (_a, b) in enumerate(chunks))
    return ChunkTimes(tuple(fwd), tuple(full), weight, send_seconds(cc, chunks), acts, keep, free)


def interleaved_inflight(rank: int, p: int, m: int, v: int) -> float:
    """Closed form of the interleaved schedule's peak activations on ``rank``, in units of the
    rank's activations of one micro-batch: ``min(2 (p - r - 1) + (v - 1) p + 1, m v) / v``."""
    return min(2 * (p - rank - 1) + (v - 1) * p + 1, m * v) / v


def chunk_ranges_of_rank(chunks: Sequence[tuple[int, int]], p: int, rank: int) -> list[tuple[int, int]]:
    """The chunks pipeline rank ``rank`` runs (chunk ``c`` on rank ``c % p``)."""
    return [ch for c, ch in enumerate(chunks) if c % p == rank]


def evaluate_schedule(
    cc: CandidateCosts,
    chunks: Sequence[tuple[int, int]],
    checkpoint: Sequence[int],
    schedule: str,
    virtual_stages: int,
    sim: SimulatedPipeline,
    times: ChunkTimes,
    selective: Sequence[int] = (),
) -> Evaluation:
    """Price a strategy run under ``schedule`` from its simulation (see the module docstring)."""
    cand = cc.cand
    p, m, v = cand.pp, cand.num_micro_batches, virtual_stages
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
    if len(chunks) != p * v or len(sim.held) != p:
        raise ValueError(f"{len(chunks)} chunks and {len(sim.held)} ranks for pp={p}, v={v}")
    ck = frozenset(int(i) for i in checkpoint)
    sel = frozenset(int(i) for i in selective)
    check_selective(cc, ck, sel)
    nchunks = len(chunks)
    out: list[StageCost] = []
    for r in range(p):
        mine = chunk_ranges_of_rank(chunks, p, r)
        idx = [i for a, b in mine for i in range(a, b + 1)]
        ls = selective_view([cc.layers[i] for i in idx], idx, sel)
        rc = [i in ck for i in idx]
        compute = sum(l.compute_s for l in ls)
        tp = sum(l.tp_s for l in ls)
        rec = sum(l.rec_s for l, x in zip(ls, rc) if x) * (2 if schedule == "zero-bubble" else 1) + sum(
            l.sel_rec_s for i, l in zip(idx, ls) if i in sel
        )
        zmb = sum(l.zero_mb_s for l in ls)
        sends, sent = 0, 0.0
        for c in range(r, nchunks, p):
            if c < nchunks - 1:  # activations forward
                sends, sent = sends + 1, sent + cc.layers[chunks[c][1]].boundary_b
            if c > 0:  # gradients back
                sends, sent = sends + 1, sent + cc.layers[chunks[c - 1][1]].boundary_b
        p2p = sends * times.send_s
        work = compute + tp + rec + p2p
        mem, bound = _stage_memory(cc, ls, rc, r, inflight=sim.held[r])
        if sim.held_between:  # kept gradients held past the backward's transients
            floor = int(math.ceil(sim.held_between[r] * sum(l.input_b if x else l.saved_b for l, x in zip(ls, rc))))
            if floor > mem["activations"]:
                mem = {**mem, "total": mem["total"] + floor - mem["activations"], "activations": floor}
                bound = max(bound, mem["total"])
        if sim.w_pending:  # output gradients kept for W (module docstring, "Memory")
            keep = int(math.ceil(sim.w_pending[r] * sum(l.wgrad_keep_b for l in ls)))
            mem = {**mem, "activations": mem["activations"] + keep, "total": mem["total"] + keep}
            bound += keep
        tp_passes = sum(l.tp_sent_b + (l.tp_rec_sent_b if x else 0.0) + l.tp_bwd_sent_b for l, x in zip(ls, rc))
        comm = (
            m * (tp_passes + sent + sum(l.zero_mb_sent_b for l in ls))
            + sum(l.dp_step_sent_b for l in ls)
            + step_control_bytes(cand.dp, cand.tp, p)
        )
        fwd = sum(times.forward_s[c] for c in range(r, nchunks, p)) + p2p / 2
        out.append(
            StageCost(
                first=mine[0][0],
                last=mine[-1][1],
                compute_s=compute,
                recompute_s=rec,
                tp_s=tp,
                p2p_s=p2p,
                zero_mb_s=zmb,
                work_s=work,
                micro_step_s=work + zmb,
                dp_s=sum(l.dp_step_s for l in ls),
                opt_s=sum(l.opt_s for l in ls),
                fwd_s=fwd,
                bwd_s=work + zmb - fwd,
                memory=mem,
                comm_bytes=comm,
                memory_bound=bound,
                offload_mb_s=sum(l.offload_mb_s for l in ls),
                offload_step_s=sum(l.offload_step_s for l in ls),
                host_b=sum(l.host_b for l in ls) + (cc.host_buffers_b if cand.offloads else 0),
                nvme_b=sum(l.nvme_b for l in ls),
            )
        )
    kb = max(range(p), key=lambda k: out[k].micro_step_s)
    kd = max(range(p), key=lambda k: out[k].dp_s + out[k].opt_s)
    D = out[kd].dp_s + out[kd].opt_s
    sb = out[kb]
    T = sb.micro_step_s
    span = sim.makespan_s
    busy = m * (sb.compute_s + sb.recompute_s + sb.tp_s + sb.zero_mb_s)
    time = {
        "compute": m * sb.compute_s,
        "recompute": m * sb.recompute_s,
        "tp_comm": m * sb.tp_s,
        "pp_bubble": span - busy,
        "dp_comm": m * (sb.zero_mb_s - sb.offload_mb_s) + out[kd].dp_s - out[kd].offload_step_s,
        "optimizer": out[kd].opt_s,
        "offload": m * sb.offload_mb_s + out[kd].offload_step_s,
    }
    kp = max(range(p), key=lambda k: out[k].memory["total"])
    bound = max(st.memory_bound for st in out)
    g = cc.ranks_per_node
    nvme_rank = max(st.nvme_b for st in out)
    extra: dict = {
        "memory_bound": bound,
        "host_bytes": g * max(st.host_b for st in out),
        "nvme_bytes": g * nvme_rank,
        "messages": sim.messages,
        "chunk_times": times,
    }
    if cand.offloads:
        kh = max(range(p), key=lambda i: (out[i].host_b, out[i].nvme_b))
        extra["offload_bytes"] = offload_breakdown(
            [cc.layers[i].num_params for a, b in chunk_ranges_of_rank(chunks, p, kh) for i in range(a, b + 1)],
            cand.dp,
            cand.zero_stage,
            cc.dtype,
            cand.offload_optimizer,
            cand.offload_params,
            cc.host_buffers_b,
        )
    fits_off = (
        max(st.host_b for st in out) - (cc.host_buffers_b if cand.offloads else 0) <= cc.host_room
        and nvme_rank <= cc.nvme_room
    )
    if cand.compile:
        extra["compile_s"] = compile_seconds(
            cc.hw,
            max(
                len({cc.layers[i] for a, b in chunk_ranges_of_rank(chunks, p, r) for i in range(a, b + 1)})
                for r in range(p)
            ),
        )
    return Evaluation(
        strategy=Strategy(cand, tuple((int(a), int(b)) for a, b in chunks), ck, schedule, v, sel),
        stages=out,
        step_time_s=span + D,
        micro_step_s=T,
        tail_s=D,
        time=time,
        memory=dict(out[kp].memory),
        peak_stage=kp,
        bottleneck_stage=kb,
        comm_bytes_per_device=max(s.comm_bytes for s in out),
        bubble_fraction=max(span - m * T, 0.0) / span if span > 0 else 0.0,
        feasible=bound <= cc.capacity and fits_off and math.isfinite(span),
        capacity=cc.capacity,
        extra=extra,
    )
