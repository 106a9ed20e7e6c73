"""``planner plan --plot FILE.png``: the chosen pipeline schedule as a Gantt chart, and memory.

Top panel: one row per pipeline stage, time on the x axis. The schedule is the runtime's own
action list for the plan's schedule (:func:`runtime.contract.schedule_ir.one_f_one_b`, or the interleaved and
zero-bubble lists through :func:`planner.search.schedule_search.build_schedule`), timed by
:func:`runtime.contract.schedule_ir.simulate`: under 1F1B with each stage's forward and backward micro-step
(forward/backward compute, TP all-reduces, recompute in the backward, ZeRO traffic and half the
stage transfers on each side); under the other schedules with the per-chunk ``F``, ``B`` and
``W`` times and the send time the search priced them with (``cost_models.schedule_cost``). ``W``
bars (weight gradients) have their own colour; with ``v`` chunks per rank, later chunks are drawn
lighter and labelled ``micro-batch.chunk``. Each row ends with the stage's
exposed DP/ZeRO communication and optimizer step. Bars are labelled with the micro-batch when
there is room. Long schedules are drawn for their first micro-batches only (the steady state
repeats), and the title says so.

Bottom panel: memory per device of each stage, stacked by kind (parameters, gradients,
optimizer state, activations) against the device capacity and the usable limit.

Per-stage numbers come from the search's priced strategy (``Solution.evaluation``, passed as
``evaluation``). A plan read back from plan.json only has totals: every stage is then drawn with the bottleneck
stage's micro-step split 1:2 between forward and backward, and memory shows the most loaded
device only; the title says which.
"""

from __future__ import annotations

import os

from cost_models.hardware import HardwareProfile
from cost_models.schedule_cost import ChunkTimes
from cost_models.strategy import Evaluation
from planner.errors import UserError
from planner.search.schedule_search import build_schedule
from runtime.contract.schedule_ir import B, F, W, one_f_one_b, simulate

__all__ = ["plot_plan", "stage_times", "chunk_times", "MAX_DRAWN_MICROBATCHES"]

#: Micro-batches drawn at most (the 1F1B steady state repeats after the warm-up).
MAX_DRAWN_MICROBATCHES = 48
_COLORS = {
    "F": "#4C78A8",
    "B": "#F58518",
    "W": "#54A24B",
    "tail": "#9D9D9D",
    "params": "#4C78A8",
    "grads": "#72B7B2",
    "optimizer": "#F58518",
    "activations": "#E45756",
}


def stage_times(plan, ev: Evaluation | None = None) -> tuple[list[float], list[float], list[float], bool]:
    """Per stage: forward and backward seconds of one micro-batch, exposed tail; exact flag
    (``ev``: the search's priced strategy; without it, an even split of the predicted step)."""
    if ev is not None and len(ev.stages) == plan.pp:
        return ([s.fwd_s for s in ev.stages], [s.bwd_s for s in ev.stages], [s.dp_s + s.opt_s for s in ev.stages], True)
    pred = plan.predicted
    m, p = plan.num_micro_batches, plan.pp
    tail = pred.time.get("optimizer", 0.0) + pred.time.get("dp_comm", 0.0)
    micro = max(pred.step_time_s - tail, 0.0) / (m + p - 1)
    return [micro / 3] * p, [2 * micro / 3] * p, [tail] * p, False


def chunk_times(plan, ev: Evaluation | None = None) -> tuple[ChunkTimes, list[float], bool]:
    """Per model chunk ``F``, ``B`` (and ``W``) seconds of the plan's schedule, the per-rank tail,
    and whether they are the search's priced times (``ev``); otherwise 1F1B's per-stage split
    (:func:`stage_times`) cut evenly into ``v`` chunks, backward halved into ``B`` and ``W``
    under zero bubble."""
    if ev is not None and isinstance(ev.extra.get("chunk_times"), ChunkTimes) and len(ev.stages) == plan.pp:
        return ev.extra["chunk_times"], [s.dp_s + s.opt_s for s in ev.stages], True
    fwd, bwd, tail, exact = stage_times(plan, ev)
    p, v = plan.pp, plan.virtual_stages
    f = [fwd[c % p] / v for c in range(p * v)]
    b = [bwd[c % p] / v for c in range(p * v)]
    w = None
    if plan.schedule == "zero-bubble":
        w = [x / 2 for x in b]
        b = [x / 2 for x in b]
    return ChunkTimes(tuple(f), tuple(b), tuple(w) if w else None, 0.0), tail, exact and v == 1


def _memory_rows(plan, ev: Evaluation | None) -> tuple[list[str], list[dict], bool]:
    if ev is not None and len(ev.stages) == plan.pp:
        return [f"stage {k}" for k in range(plan.pp)], [s.memory for s in ev.stages], True
    return ["most loaded device"], [plan.predicted.memory], False


def plot_plan(
    plan,
    path: str,
    hw: HardwareProfile | None = None,
    evaluation: Evaluation | None = None,
    max_microbatches: int = MAX_DRAWN_MICROBATCHES,
) -> str:
    """Draw ``plan`` to ``path`` (PNG, or any format matplotlib infers from the suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p, m, v = plan.pp, plan.num_micro_batches, plan.virtual_stages
    times, tail, exact = chunk_times(plan, evaluation)
    drawn = min(m, max(max_microbatches, p))
    if plan.schedule == "1f1b" or p == 1:
        sched = one_f_one_b(p, drawn, strict=False)
    else:  # the same action list the runtime walks (interleaved: whole groups of p micro-batches)
        drawn -= drawn % p
        sched = build_schedule(plan.schedule, p, drawn, v)
    sim = simulate(
        sched,
        forward_time=times.forward_s,
        backward_time=times.backward_s,
        weight_time=times.weight_s,
        send_time=times.send_s,
    )

    fig, (ax, axm) = plt.subplots(
        2, 1, figsize=(12, 3.2 + 0.35 * p + 3.5), gridspec_kw={"height_ratios": [1.2 + 0.3 * p, 3.0]}
    )
    span = sim.makespan + max(tail)
    for s in range(p):
        y = p - 1 - s
        for kind in (F, B, W):
            for chunk in range(v):  # later chunks of a rank drawn lighter
                bars = [(t0, t1 - t0) for a, t0, t1 in sim.timeline[s] if a.kind == kind and a.chunk == chunk]
                if bars:
                    ax.broken_barh(
                        bars,
                        (y - 0.4, 0.8),
                        facecolors=_COLORS[kind],
                        edgecolor="white",
                        linewidth=0.3,
                        alpha=1.0 - 0.45 * chunk / max(v - 1, 1),
                    )
        if drawn <= 24:
            for a, t0, t1 in sim.timeline[s]:
                if a.kind in (F, B, W) and (t1 - t0) > span / 150:
                    label = str(a.microbatch) if v == 1 else f"{a.microbatch}.{a.chunk}"
                    ax.text((t0 + t1) / 2, y, label, ha="center", va="center", fontsize=6, color="white")
        end = max(t1 for _a, _t0, t1 in sim.timeline[s])
        if tail[s] > 0:
            ax.broken_barh([(end, tail[s])], (y - 0.4, 0.8), facecolors=_COLORS["tail"])
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"stage {s}" for s in reversed(range(p))])
    ax.set_xlabel("seconds")
    ax.set_xlim(0, span * 1.01 if span > 0 else 1)
    shown = f"first {drawn} of {m} micro-batches" if drawn < m else f"{m} micro-batches"
    how = "per-stage predicted times" if exact else "bottleneck stage's time for every stage (plan totals)"
    title = {"1f1b": "1F1B", "interleaved": f"Interleaved 1F1B (v={v})", "zero-bubble": "Zero-bubble (ZB-H1)"}
    ax.set_title(
        f"{title.get(plan.schedule, plan.schedule)} schedule: dp={plan.dp} tp={plan.tp} pp={p}, ZeRO-{plan.zero_stage}, {shown} "
        f"of {plan.micro_batch_size}; bubble {sim.bubble_fraction:.1%} ({how})",
        fontsize=9,
    )
    from matplotlib.patches import Patch

    handles = [
        Patch(color=_COLORS[F], label="forward"),
        Patch(color=_COLORS[B], label="backward (input gradients)" if times.weight_s else "backward"),
    ]
    if times.weight_s:
        handles.append(Patch(color=_COLORS[W], label="weight gradients (W)"))
    if v > 1:
        handles.append(Patch(color="#BBBBBB", label="lighter: later model chunks (label mb.chunk)"))
    ax.legend(
        handles=handles + [Patch(color=_COLORS["tail"], label="DP/ZeRO comm + optimizer")],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=7,
    )

    labels, mems, per_stage = _memory_rows(plan, evaluation)
    gib = 2.0**30
    x = list(range(len(labels)))
    bottom = [0.0] * len(labels)
    for kind in ("params", "grads", "optimizer", "activations"):
        vals = [mm[kind] / gib for mm in mems]
        axm.bar(x, vals, bottom=bottom, color=_COLORS[kind], label=kind)
        bottom = [b + v for b, v in zip(bottom, vals)]
    cap = hw.memory_bytes if hw is not None else None
    if cap:
        axm.axhline(cap / gib, color="black", linewidth=1, label=f"capacity {cap / gib:.0f} GiB")
    axm.set_xticks(x)
    axm.set_xticklabels(labels, rotation=45 if len(labels) > 12 else 0, fontsize=7)
    axm.set_ylabel("GiB per device")
    axm.set_title("Memory per device" + ("" if per_stage else " (most loaded device)"), fontsize=9)
    axm.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
        fig.savefig(path, dpi=120)
    except (OSError, ValueError) as e:
        raise UserError(f"Cannot write the plot to {path}: {e}. Pick a writable path ending in .png.") from None
    finally:
        plt.close(fig)
    return path
