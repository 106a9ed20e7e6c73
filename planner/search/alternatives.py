"""Why a runner-up lost: the one-line reason stored with each of plan.json's ``alternatives``.

The reason says how much slower the alternative is and which part of the step time (compute,
recompute, TP collectives, pipeline bubble, DP/ZeRO traffic, optimizer, offload transfers, expert
all-to-alls) grew
the most, with the decision responsible for it, and where the runner-up keeps its state when that
differs from the winner (offload).
"""

from __future__ import annotations

from cost_models.strategy import Evaluation
from planner.plan import TIME_LABELS
from planner.units import format_bytes, format_seconds
from runtime.contract.choices import OffloadTier

__all__ = ["alternative_reason"]


def _context(part: str, evaluation) -> str:
    candidate = evaluation.strategy.candidate
    if part == "pp_bubble":
        return f"pp={candidate.pp} with {candidate.num_micro_batches} micro-batches"
    if part == "tp_comm":
        return f"tp={candidate.tp}" + (
            ", sequence-parallel: twice the collectives" if candidate.sequence_parallel else ""
        )
    if part == "dp_comm":
        exchange = "1-bit Adam" if candidate.compressed else "full-precision gradients"
        return f"dp={candidate.dp}, ZeRO-{candidate.zero_stage}, {exchange}"
    if part == "optimizer":
        if candidate.offload_optimizer != OffloadTier.NONE:
            return (
                f"optimizer offloaded to {candidate.offload_optimizer}: AdamW runs on the host's cores, "
                f"{'sharded' if candidate.dp > 1 else 'unsharded'} over dp={candidate.dp}"
            )
        return f"ZeRO-{candidate.zero_stage} {'shards' if candidate.zero_stage else 'does not shard'} the AdamW step over dp={candidate.dp}"
    if part == "offload":
        return _offload_context(candidate)
    if part == "ep_comm":
        return f"ep={candidate.expert_parallel}: every MoE layer's dispatch and combine, forward and backward" + (
            f", at {candidate.expert_load:g}x the even load" if candidate.expert_load != 1.0 else ""
        )
    if part == "compute":
        if candidate.pp > 1 and evaluation.strategy.virtual_stages > 1:
            k, chunks = evaluation.bottleneck_stage, evaluation.strategy.stages
            rows = ", ".join(f"{first}-{last}" for first, last in chunks[k :: candidate.pp])
            return f"its slowest of {candidate.pp} ranks runs {evaluation.strategy.virtual_stages} chunks, rows {rows}"
        if candidate.pp > 1:
            first, last = (
                evaluation.stages[evaluation.bottleneck_stage].first,
                evaluation.stages[evaluation.bottleneck_stage].last,
            )
            return f"its slowest of {candidate.pp} stages holds rows {first}-{last}"
        return ""  # said by _compute_change, which compares with the winner
    return ""


def _compute_change(best: Evaluation, alt: Evaluation) -> str:
    """What differs from ``best`` in the decisions that set a single-stage runner-up's compute: a
    wider tp (the work it does not split, norms and residuals, runs on every rank of a group), the
    ZeRO stage (the contention of the traffic hidden under compute), the micro-batch (the products'
    sizes), the pipeline, ep, cp and compilation; empty when none does."""
    a, b = alt.strategy.candidate, best.strategy.candidate
    said = []
    if a.tp != b.tp:
        said.append(
            f"tp={a.tp} vs {b.tp}"
            + (": the work tensor parallelism does not split runs on every rank of a group" if a.tp > b.tp else "")
        )
    if a.zero_stage != b.zero_stage:  # ZeRO 3's per-layer gathers contend with the compute they hide under
        said.append(f"ZeRO-{a.zero_stage} vs {b.zero_stage}")
    for label, mine, theirs in (
        ("micro-batch", a.micro_batch_size, b.micro_batch_size),
        ("pp", a.pp, b.pp),
        ("ep", a.expert_parallel, b.expert_parallel),
        ("cp", a.context_parallel, b.context_parallel),
    ):
        if mine != theirs:
            said.append(f"{label}={mine} vs {theirs}")
    if a.compile != b.compile:
        said.append("compiled" if a.compile else "not compiled")
    return ", ".join(said)


def _offload_context(candidate) -> str:
    """What the alternative offloads and which transfer costs it time."""
    moved = []
    if candidate.offload_params != OffloadTier.NONE:
        moved.append(
            f"parameters on {candidate.offload_params}: fetched for every layer's forward and backward, "
            f"{candidate.num_micro_batches} micro-batch{'es' if candidate.num_micro_batches != 1 else ''}"
        )
    if candidate.offload_optimizer != OffloadTier.NONE:
        moved.append(
            f"optimizer on {candidate.offload_optimizer}: gradients out and parameters back every step"
            + (", state read and written on NVMe" if candidate.offload_optimizer == OffloadTier.NVME else "")
        )
    return "; ".join(moved) or "no offload"


def _offload_change(best: Evaluation, alt: Evaluation) -> str:
    """`` (offload ...)`` when the alternative keeps its state elsewhere than ``best``."""
    alt_candidate, best_candidate = alt.strategy.candidate, best.strategy.candidate
    if (alt_candidate.offload_optimizer, alt_candidate.offload_params) == (
        best_candidate.offload_optimizer,
        best_candidate.offload_params,
    ):
        return ""
    if not alt_candidate.offloads:
        return "; every state on the device"
    return "; offload " + ", ".join(
        f"{kind} {tier}"
        for kind, tier in (("optimizer", alt_candidate.offload_optimizer), ("params", alt_candidate.offload_params))
        if tier != OffloadTier.NONE
    )


def _sp_change(best: Evaluation, alt: Evaluation) -> str:
    """``; sequence-parallel`` (or ``; no sequence parallelism``) when only that differs in kind."""
    alt_candidate, best_candidate = alt.strategy.candidate, best.strategy.candidate
    if alt_candidate.sequence_parallel == best_candidate.sequence_parallel or alt_candidate.tp < 2:
        return ""
    return "; sequence-parallel" if alt_candidate.sequence_parallel else "; no sequence parallelism"


def _schedule_change(best: Evaluation, alt: Evaluation) -> str:
    """``; <schedule>`` when the alternative runs another pipeline schedule than ``best``."""
    alt_strategy, best_strategy = alt.strategy, best.strategy
    if alt.strategy.candidate.pp < 2 or (alt_strategy.schedule, alt_strategy.virtual_stages) == (
        best_strategy.schedule,
        best_strategy.virtual_stages,
    ):
        return ""
    return (
        f"; {alt_strategy.schedule}"
        + (f" v={alt_strategy.virtual_stages}" if alt_strategy.virtual_stages > 1 else "")
        + " schedule"
    )


def alternative_reason(best: Evaluation, alt: Evaluation) -> str:
    """Why ``alt`` (an :class:`~cost_models.strategy.Evaluation`) lost to ``best``, in one line."""
    slower_by = alt.step_time_s - best.step_time_s
    if slower_by <= best.step_time_s * 1e-9:
        best_memory, alt_memory = best.memory["total"], alt.memory["total"]
        more = "more" if alt_memory > best_memory else "no less"
        return (
            f"ties on step time but needs {more} memory ({format_bytes(alt_memory)} vs {format_bytes(best_memory)} "
            f"per device{_offload_change(best, alt)}{_sp_change(best, alt)}{_schedule_change(best, alt)})"
        )
    deltas = {key: alt.time[key] - best.time[key] for key in TIME_LABELS}
    part = max(deltas, key=lambda part: deltas[part])
    text = (
        f"{slower_by / best.step_time_s:.1%} slower ({format_seconds(alt.step_time_s)}): "
        f"{TIME_LABELS[part]} {format_seconds(alt.time[part])} vs {format_seconds(best.time[part])}"
    )
    if part == "recompute":
        whole, cores = len(alt.strategy.checkpoint), len(alt.strategy.selective)
        what = f"{whole} layer{'s' if whole != 1 else ''}" + (f" and the attention core of {cores}" if cores else "")
        text += (
            f" ({what} recomputed to fit in memory{_offload_change(best, alt)}{_sp_change(best, alt)}"
            f"{_schedule_change(best, alt)})"
        )
    else:
        context = _context(part, alt) or (_compute_change(best, alt) if part == "compute" else "")
        said = part == "tp_comm" and alt.strategy.candidate.sequence_parallel  # the context names it
        change = (
            (_offload_change(best, alt) if part != "offload" else "")
            + ("" if said else _sp_change(best, alt))
            + _schedule_change(best, alt)
        )
        text += f" ({context}{change})" if context else (f" ({change[2:]})" if change else "")
    return text
