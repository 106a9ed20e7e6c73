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
from typing import Any

from cost_models.hardware import HardwareProfile
from cost_models.schedule_cost import ChunkTimes
from cost_models.strategy import Evaluation
from planner.errors import UserError
from planner.search.schedule_search import build_schedule
from runtime.contract.choices import ScheduleName
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
        return (
            [stage.fwd_s for stage in ev.stages],
            [stage.bwd_s for stage in ev.stages],
            [stage.dp_s + stage.opt_s for stage in ev.stages],
            True,
        )
    predicted = plan.predicted
    micro_batches, stages = plan.num_micro_batches, plan.pp
    tail = predicted.time.get("optimizer", 0.0) + predicted.time.get("dp_comm", 0.0)
    micro = max(predicted.step_time_s - tail, 0.0) / (micro_batches + stages - 1)
    return [micro / 3] * stages, [2 * micro / 3] * stages, [tail] * stages, False


def chunk_times(plan, ev: Evaluation | None = None) -> tuple[ChunkTimes, list[float], bool]:
    """Per model chunk ``F``, ``B`` (and ``W``) seconds of the plan's schedule, the per-rank tail,
    and whether they are the search's priced times (``ev``); otherwise 1F1B's per-stage split
    (:func:`stage_times`) cut evenly into ``v`` chunks, backward halved into ``B`` and ``W``
    under zero bubble."""
    if ev is not None and isinstance(ev.extra.get("chunk_times"), ChunkTimes) and len(ev.stages) == plan.pp:
        return ev.extra["chunk_times"], [stage.dp_s + stage.opt_s for stage in ev.stages], True
    fwd, bwd, tail, exact = stage_times(plan, ev)
    stages, virtual_stages = plan.pp, plan.virtual_stages
    forward = [fwd[chunk % stages] / virtual_stages for chunk in range(stages * virtual_stages)]
    backward = [bwd[chunk % stages] / virtual_stages for chunk in range(stages * virtual_stages)]
    weight = None
    if plan.schedule == ScheduleName.ZERO_BUBBLE:
        weight = [x / 2 for x in backward]
        backward = [x / 2 for x in backward]
    times = ChunkTimes(tuple(forward), tuple(backward), tuple(weight) if weight else None, 0.0)
    return times, tail, exact and virtual_stages == 1


def _memory_rows(plan, ev: Evaluation | None) -> tuple[list[str], list[dict], bool]:
    if ev is not None and len(ev.stages) == plan.pp:
        return [f"stage {k}" for k in range(plan.pp)], [stage.memory for stage in ev.stages], True
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

    stages = plan.pp
    times, tail, exact = chunk_times(plan, evaluation)
    drawn, simulated = _simulated_schedule(plan, times, max_microbatches)
    fig, (timeline_axes, memory_axes) = plt.subplots(
        2, 1, figsize=(12, 3.2 + 0.35 * stages + 3.5), gridspec_kw={"height_ratios": [1.2 + 0.3 * stages, 3.0]}
    )
    _draw_timeline(timeline_axes, plan, simulated, tail, drawn)
    micro_batches, virtual_stages = plan.num_micro_batches, plan.virtual_stages
    shown = (
        f"first {drawn} of {micro_batches} micro-batches" if drawn < micro_batches else f"{micro_batches} micro-batches"
    )
    how = "per-stage predicted times" if exact else "bottleneck stage's time for every stage (plan totals)"
    titles = {
        ScheduleName.ONE_F_ONE_B: "1F1B",
        ScheduleName.INTERLEAVED: f"Interleaved 1F1B (v={virtual_stages})",
        ScheduleName.ZERO_BUBBLE: "Zero-bubble (ZB-H1)",
    }
    title = titles.get(plan.schedule, plan.schedule)
    timeline_axes.set_title(
        f"{title} schedule: dp={plan.dp} tp={plan.tp} pp={stages}, ZeRO-{plan.zero_stage}, {shown} "
        f"of {plan.micro_batch_size}; bubble {simulated.bubble_fraction:.1%} ({how})",
        fontsize=9,
    )
    _draw_legend(timeline_axes, times, virtual_stages)
    _draw_memory(memory_axes, plan, hw, evaluation)
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


def _simulated_schedule(plan, times: ChunkTimes, max_microbatches: int) -> tuple[int, Any]:
    """How many micro-batches are drawn, and the runtime's action list for them, timed."""
    stages = plan.pp
    drawn = min(plan.num_micro_batches, max(max_microbatches, stages))
    if plan.schedule == ScheduleName.ONE_F_ONE_B or stages == 1:
        schedule = one_f_one_b(stages, drawn, strict=False)
    else:  # the same action list the runtime walks (interleaved: whole groups of p micro-batches)
        drawn -= drawn % stages
        schedule = build_schedule(plan.schedule, stages, drawn, plan.virtual_stages)
    simulated = simulate(
        schedule,
        forward_time=times.forward_s,
        backward_time=times.backward_s,
        weight_time=times.weight_s,
        send_time=times.send_s,
    )
    return drawn, simulated


def _draw_timeline(axes: Any, plan, simulated: Any, tail: list[float], drawn: int) -> None:
    """One row per stage: its ``F``, ``B``, ``W`` bars (later chunks lighter), labelled with the
    micro-batch where there is room, then its exposed tail."""
    stages, virtual_stages = plan.pp, plan.virtual_stages
    span = simulated.makespan + max(tail)
    for stage in range(stages):
        row = stages - 1 - stage
        for kind in (F, B, W):
            for chunk in range(virtual_stages):  # later chunks of a rank drawn lighter
                bars = [
                    (start, end - start)
                    for action, start, end in simulated.timeline[stage]
                    if action.kind == kind and action.chunk == chunk
                ]
                if bars:
                    axes.broken_barh(
                        bars,
                        (row - 0.4, 0.8),
                        facecolors=_COLORS[kind],
                        edgecolor="white",
                        linewidth=0.3,
                        alpha=1.0 - 0.45 * chunk / max(virtual_stages - 1, 1),
                    )
        if drawn <= 24:
            for action, start, end in simulated.timeline[stage]:
                if action.kind in (F, B, W) and (end - start) > span / 150:
                    label = str(action.microbatch) if virtual_stages == 1 else f"{action.microbatch}.{action.chunk}"
                    axes.text((start + end) / 2, row, label, ha="center", va="center", fontsize=6, color="white")
        last_end = max(end for _action, _start, end in simulated.timeline[stage])
        if tail[stage] > 0:
            axes.broken_barh([(last_end, tail[stage])], (row - 0.4, 0.8), facecolors=_COLORS["tail"])
    axes.set_yticks(range(stages))
    axes.set_yticklabels([f"stage {stage}" for stage in reversed(range(stages))])
    axes.set_xlabel("seconds")
    axes.set_xlim(0, span * 1.01 if span > 0 else 1)


def _draw_legend(axes: Any, times: ChunkTimes, virtual_stages: int) -> None:
    from matplotlib.patches import Patch

    handles = [
        Patch(color=_COLORS[F], label="forward"),
        Patch(color=_COLORS[B], label="backward (input gradients)" if times.weight_s else "backward"),
    ]
    if times.weight_s:
        handles.append(Patch(color=_COLORS[W], label="weight gradients (W)"))
    if virtual_stages > 1:
        handles.append(Patch(color="#BBBBBB", label="lighter: later model chunks (label mb.chunk)"))
    axes.legend(
        handles=handles + [Patch(color=_COLORS["tail"], label="DP/ZeRO comm + optimizer")],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=7,
    )


def _draw_memory(axes: Any, plan, hw: HardwareProfile | None, evaluation: Evaluation | None) -> None:
    """Memory per device of each stage (or the most loaded device), stacked by kind, against the
    capacity."""
    labels, memories, per_stage = _memory_rows(plan, evaluation)
    gib = 2.0**30
    positions = list(range(len(labels)))
    bottom = [0.0] * len(labels)
    for kind in ("params", "grads", "optimizer", "activations"):
        heights = [memory[kind] / gib for memory in memories]
        axes.bar(positions, heights, bottom=bottom, color=_COLORS[kind], label=kind)
        bottom = [below + height for below, height in zip(bottom, heights)]
    capacity = hw.memory_bytes if hw is not None else None
    if capacity:
        axes.axhline(capacity / gib, color="black", linewidth=1, label=f"capacity {capacity / gib:.0f} GiB")
    axes.set_xticks(positions)
    axes.set_xticklabels(labels, rotation=45 if len(labels) > 12 else 0, fontsize=7)
    axes.set_ylabel("GiB per device")
    axes.set_title("Memory per device" + ("" if per_stage else " (most loaded device)"), fontsize=9)
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
