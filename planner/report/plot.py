"""``planner plan --plot FILE.png``: the chosen 1F1B schedule as a Gantt chart, and memory.

Top panel: one row per pipeline stage, time on the x axis. The schedule is the runtime's own
(:func:`runtime.schedule.one_f_one_b`), timed by :func:`runtime.schedule.simulate` with each
stage's forward and backward micro-step (forward/backward compute, TP all-reduces, recompute in
the backward, ZeRO traffic and half the stage transfers on each side), followed by the stage's
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
from cost_models.strategy import Evaluation
from planner.errors import UserError
from runtime.schedule import B, F, one_f_one_b, simulate

__all__ = ["plot_plan", "stage_times", "MAX_DRAWN_MICROBATCHES"]

#: Micro-batches drawn at most (the 1F1B steady state repeats after the warm-up).
MAX_DRAWN_MICROBATCHES = 48
_COLORS = {"F": "#4C78A8", "B": "#F58518", "tail": "#9D9D9D", "params": "#4C78A8", "grads": "#72B7B2",
           "optimizer": "#F58518", "activations": "#E45756"}


def stage_times(plan, ev: Evaluation | None = None) -> tuple[list[float], list[float], list[float], bool]:
    """Per stage: forward and backward seconds of one micro-batch, exposed tail; exact flag
    (``ev``: the search's priced strategy; without it, an even split of the predicted step)."""
    if ev is not None and len(ev.stages) == plan.pp:
        return ([s.fwd_s for s in ev.stages], [s.bwd_s for s in ev.stages],
                [s.dp_s + s.opt_s for s in ev.stages], True)
    pred = plan.predicted
    m, p = plan.num_micro_batches, plan.pp
    tail = pred.time.get("optimizer", 0.0) + pred.time.get("dp_comm", 0.0)
    micro = max(pred.step_time_s - tail, 0.0) / (m + p - 1)
    return [micro / 3] * p, [2 * micro / 3] * p, [tail] * p, False


def _memory_rows(plan, ev: Evaluation | None) -> tuple[list[str], list[dict], bool]:
    if ev is not None and len(ev.stages) == plan.pp:
        return [f"stage {k}" for k in range(plan.pp)], [s.memory for s in ev.stages], True
    return ["most loaded device"], [plan.predicted.memory], False


def plot_plan(plan, path: str, hw: HardwareProfile | None = None, evaluation: Evaluation | None = None,
              max_microbatches: int = MAX_DRAWN_MICROBATCHES) -> str:
    """Draw ``plan`` to ``path`` (PNG, or any format matplotlib infers from the suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p, m = plan.pp, plan.num_micro_batches
    fwd, bwd, tail, exact = stage_times(plan, evaluation)
    drawn = min(m, max(max_microbatches, p))
    sim = simulate(one_f_one_b(p, drawn, strict=False), forward_time=fwd, backward_time=bwd)

    fig, (ax, axm) = plt.subplots(2, 1, figsize=(12, 3.2 + 0.35 * p + 3.5),
                                  gridspec_kw={"height_ratios": [1.2 + 0.3 * p, 3.0]})
    span = sim.makespan + max(tail)
    for s in range(p):
        y = p - 1 - s
        for kind in (F, B):
            bars = [(t0, t1 - t0) for a, t0, t1 in sim.timeline[s] if a.kind == kind]
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=_COLORS[kind], edgecolor="white", linewidth=0.3)
        if drawn <= 24:
            for a, t0, t1 in sim.timeline[s]:
                if a.kind in (F, B) and (t1 - t0) > span / 150:
                    ax.text((t0 + t1) / 2, y, str(a.microbatch), ha="center", va="center", fontsize=6,
                            color="white")
        end = max(t1 for _a, _t0, t1 in sim.timeline[s])
        if tail[s] > 0:
            ax.broken_barh([(end, tail[s])], (y - 0.4, 0.8), facecolors=_COLORS["tail"])
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"stage {s}" for s in reversed(range(p))])
    ax.set_xlabel("seconds")
    ax.set_xlim(0, span * 1.01 if span > 0 else 1)
    shown = f"first {drawn} of {m} micro-batches" if drawn < m else f"{m} micro-batches"
    how = "per-stage predicted times" if exact else "bottleneck stage's time for every stage (plan totals)"
    ax.set_title(f"1F1B schedule: dp={plan.dp} tp={plan.tp} pp={p}, ZeRO-{plan.zero_stage}, {shown} "
                 f"of {plan.micro_batch_size}; bubble {sim.bubble_fraction:.1%} ({how})", fontsize=9)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=_COLORS[F], label="forward"), Patch(color=_COLORS[B], label="backward"),
                       Patch(color=_COLORS["tail"], label="DP/ZeRO comm + optimizer")],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)

    labels, mems, per_stage = _memory_rows(plan, evaluation)
    gib = 2.0 ** 30
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
