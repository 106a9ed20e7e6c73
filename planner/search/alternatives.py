"""Why a runner-up lost: the one-line reason stored with each of plan.json's ``alternatives``.

The reason says how much slower the alternative is and which part of the step time (compute,
recompute, TP collectives, pipeline bubble, DP/ZeRO traffic, optimizer, offload transfers) grew
the most, with the decision responsible for it, and where the runner-up keeps its state when that
differs from the winner (offload).
"""

from __future__ import annotations

from cost_models.strategy import Evaluation
from planner.plan import TIME_LABELS
from planner.units import format_bytes, format_seconds

__all__ = ["alternative_reason"]


def _context(part: str, ev) -> str:
    c = ev.strategy.candidate
    if part == "pp_bubble":
        return f"pp={c.pp} with {c.num_micro_batches} micro-batches"
    if part == "tp_comm":
        return f"tp={c.tp}" + (", sequence-parallel: twice the collectives" if c.sequence_parallel else "")
    if part == "dp_comm":
        return f"dp={c.dp}, ZeRO-{c.zero_stage}"
    if part == "optimizer":
        if c.offload_optimizer != "none":
            return (
                f"optimizer offloaded to {c.offload_optimizer}: AdamW runs on the host's cores, "
                f"{'sharded' if c.dp > 1 else 'unsharded'} over dp={c.dp}"
            )
        return f"ZeRO-{c.zero_stage} {'shards' if c.zero_stage else 'does not shard'} the AdamW step over dp={c.dp}"
    if part == "offload":
        return _offload_context(c)
    if part == "compute":
        if c.pp > 1 and ev.strategy.virtual_stages > 1:
            k, chunks = ev.bottleneck_stage, ev.strategy.stages
            rows = ", ".join(f"{a}-{b}" for a, b in chunks[k :: c.pp])
            return f"its slowest of {c.pp} ranks runs {ev.strategy.virtual_stages} chunks, rows {rows}"
        if c.pp > 1:
            a, b = ev.stages[ev.bottleneck_stage].first, ev.stages[ev.bottleneck_stage].last
            return f"its slowest of {c.pp} stages holds rows {a}-{b}"
        return f"tp={c.tp}: work tensor parallelism does not split runs on every device"
    return ""


def _offload_context(c) -> str:
    """What the alternative offloads and which transfer costs it time."""
    moved = []
    if c.offload_params != "none":
        moved.append(
            f"parameters on {c.offload_params}: fetched for every layer's forward and backward, "
            f"{c.num_micro_batches} micro-batch{'es' if c.num_micro_batches != 1 else ''}"
        )
    if c.offload_optimizer != "none":
        moved.append(
            f"optimizer on {c.offload_optimizer}: gradients out and parameters back every step"
            + (", state read and written on NVMe" if c.offload_optimizer == "nvme" else "")
        )
    return "; ".join(moved) or "no offload"


def _offload_change(best: Evaluation, alt: Evaluation) -> str:
    """`` (offload ...)`` when the alternative keeps its state elsewhere than ``best``."""
    a, b = alt.strategy.candidate, best.strategy.candidate
    if (a.offload_optimizer, a.offload_params) == (b.offload_optimizer, b.offload_params):
        return ""
    if not a.offloads:
        return "; every state on the device"
    return "; offload " + ", ".join(
        f"{k} {v}" for k, v in (("optimizer", a.offload_optimizer), ("params", a.offload_params)) if v != "none"
    )


def _sp_change(best: Evaluation, alt: Evaluation) -> str:
    """``; sequence-parallel`` (or ``; no sequence parallelism``) when only that differs in kind."""
    a, b = alt.strategy.candidate, best.strategy.candidate
    if a.sequence_parallel == b.sequence_parallel or a.tp < 2:
        return ""
    return "; sequence-parallel" if a.sequence_parallel else "; no sequence parallelism"


def _schedule_change(best: Evaluation, alt: Evaluation) -> str:
    """``; <schedule>`` when the alternative runs another pipeline schedule than ``best``."""
    a, b = alt.strategy, best.strategy
    if alt.strategy.candidate.pp < 2 or (a.schedule, a.virtual_stages) == (b.schedule, b.virtual_stages):
        return ""
    return f"; {a.schedule}" + (f" v={a.virtual_stages}" if a.virtual_stages > 1 else "") + " schedule"


def alternative_reason(best: Evaluation, alt: Evaluation) -> str:
    """Why ``alt`` (an :class:`~cost_models.strategy.Evaluation`) lost to ``best``, in one line."""
    d = alt.step_time_s - best.step_time_s
    if d <= best.step_time_s * 1e-9:
        mb, ma = best.memory["total"], alt.memory["total"]
        more = "more" if ma > mb else "no less"
        return (
            f"ties on step time but needs {more} memory ({format_bytes(ma)} vs {format_bytes(mb)} "
            f"per device{_offload_change(best, alt)}{_sp_change(best, alt)}{_schedule_change(best, alt)})"
        )
    deltas = {k: alt.time[k] - best.time[k] for k in TIME_LABELS}
    part = max(deltas, key=lambda part: deltas[part])
    text = (
        f"{d / best.step_time_s:.1%} slower ({format_seconds(alt.step_time_s)}): "
        f"{TIME_LABELS[part]} {format_seconds(alt.time[part])} vs {format_seconds(best.time[part])}"
    )
    if part == "recompute":
        n, k = len(alt.strategy.checkpoint), len(alt.strategy.selective)
        what = f"{n} layer{'s' if n != 1 else ''}" + (f" and the attention core of {k}" if k else "")
        text += (
            f" ({what} recomputed to fit in memory{_offload_change(best, alt)}{_sp_change(best, alt)}"
            f"{_schedule_change(best, alt)})"
        )
    else:
        ctx = _context(part, alt)
        said = part == "tp_comm" and alt.strategy.candidate.sequence_parallel  # the context names it
        change = (
            (_offload_change(best, alt) if part != "offload" else "")
            + ("" if said else _sp_change(best, alt))
            + _schedule_change(best, alt)
        )
        text += f" ({ctx}{change})" if ctx else (f" ({change[2:]})" if change else "")
    return text
