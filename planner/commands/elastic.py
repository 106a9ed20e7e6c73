"""``planner train --elastic``: re-plan a run for the world it finds.

A plan records the request it was made from (plan.json ``request``, ``PlanRequest.to_record``).
When ``planner train --elastic`` starts on another number of ranks than the plan's ``dp*tp*pp``
(``--nproc N`` locally, ``WORLD_SIZE`` under torchrun), ``plan_for_world`` plans that request
again in-process for ``gpus = world`` with the same global batch, so every step reads the same
samples (data is a function of (seed, step) and the global batch), writes the new plan beside the
old one (``<plan>.world<N>.json``; ``planner train`` compiles it into ``<plan>.world<N>.compiled``)
and says what changed; the run then resumes the newest checkpoint under it (checkpoints are
logical: any plan of the model loads them, resharded).

Pins that no longer fit the new world (``request_for_world``): a data-parallel pin is dropped
(dp follows the world); tensor- and pipeline-parallel pins are kept while their product divides
the world, else the one that does not fit is dropped. What was dropped is said.

A plan without ``request`` (hand-made, or written before it existed) cannot be re-planned: a
``UserError`` (exit status 2) that says so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from planner.commands.plan_command import plan_from_request, with_cost
from planner.errors import UserError
from planner.plan import Plan, save_plan
from planner.search.request import PlanRequest, request_flag
from planner.search.search_errors import SearchError

__all__ = ["Replan", "request_for_world", "plan_for_world", "replanned_path", "describe_change", "DROPOUT_NOTE"]

#: What a re-planned run does not continue exactly (issue 29, item 4): dropout draws its masks from
#: each rank's generator per micro-batch, so another layout draws other masks.
DROPOUT_NOTE = "a model with dropout continues with other dropout masks (they depend on the layout)"


@dataclass
class Replan:
    """A plan made again for another world: the new plan, where it was written, what changed."""

    plan: Plan
    """The new plan (``gpus`` = the world, the same global batch)."""
    path: str
    """Where it was written (``replanned_path``)."""
    old: Plan
    """The plan the run was started with."""
    dropped: list[str] = field(default_factory=list)
    """The pins of the old request that the new world does not allow, each with why."""

    def fields(self, step: int) -> dict:
        """The ``replan`` event's fields: worlds, degrees and micro-batching before and after, the
        step the run resumes at, the dropped pins and the new plan's path."""
        return {
            "old_world": _world(self.old),
            "new_world": _world(self.plan),
            "old": _layout(self.old),
            "new": _layout(self.plan),
            "step": step,
            "dropped_pins": list(self.dropped),
            "plan": self.path,
        }

    def message(self, step: int) -> str:
        """``re-planned for 1 rank(s): dp2 -> dp1, micro-batches 2 -> 4, resumed at step 12``."""
        where = f"resumed at step {step}" if step else "starting at step 0"
        text = f"re-planned for {_world(self.plan)} rank(s): {describe_change(self.old, self.plan)}, {where}"
        if self.dropped:
            text += f" (dropped {'; '.join(self.dropped)})"
        return f"{text}; {DROPOUT_NOTE}"


def _world(plan: Plan) -> int:
    return plan.dp * plan.cp * plan.tp * plan.pp


def _layout(plan: Plan) -> dict:
    return {
        "dp": plan.dp,
        "tp": plan.tp,
        "pp": plan.pp,
        "zero_stage": plan.zero_stage,
        "micro_batch_size": plan.micro_batch_size,
        "num_micro_batches": plan.num_micro_batches,
    }


def describe_change(old: Plan, new: Plan) -> str:
    """What differs between two plans of one model, in words: ``dp2 -> dp1, micro-batches 2 -> 4``
    (the degrees, ZeRO stage, micro-batch size and count, schedule that changed)."""
    parts = []
    for name in ("dp", "tp", "pp"):
        before, after = getattr(old, name), getattr(new, name)
        if before != after:
            parts.append(f"{name}{before} -> {name}{after}")
    if old.zero_stage != new.zero_stage:
        parts.append(f"ZeRO {old.zero_stage} -> {new.zero_stage}")
    if old.micro_batch_size != new.micro_batch_size:
        parts.append(f"micro-batch size {old.micro_batch_size} -> {new.micro_batch_size}")
    if old.num_micro_batches != new.num_micro_batches:
        parts.append(f"micro-batches {old.num_micro_batches} -> {new.num_micro_batches}")
    if old.schedule != new.schedule and max(old.pp, new.pp) > 1:
        parts.append(f"schedule {old.schedule} -> {new.schedule}")
    return ", ".join(parts) or "the same layout"


def request_for_world(request: PlanRequest, world: int) -> tuple[PlanRequest, list[str]]:
    """``request`` for ``world`` devices, the same global batch, and the pins that still fit; the
    dropped pins, each with why (module docstring)."""
    dropped = []
    changes: dict = {"gpus": world}
    if request.dp is not None and request.dp * (request.tp or 1) * (request.pp or 1) != world:
        dropped.append(f"{request_flag('dp')} {request.dp}: data parallelism follows the world")
        changes["dp"] = None
    tp, pp = request.tp, request.pp
    if tp is not None and world % tp:
        dropped.append(f"{request_flag('tp')} {tp}: it does not divide {world} rank(s)")
        tp = changes["tp"] = None
    if pp is not None and world % ((tp or 1) * pp):
        dropped.append(f"{request_flag('pp')} {pp}: {(tp or 1) * pp} does not divide {world} rank(s)")
        changes["pp"] = None
    if request.sequence_parallel == "on" and "tp" in changes:
        changes["sequence_parallel"] = None
        dropped.append("--sequence-parallel on: its --tp was dropped")
    return replace(request, **changes), dropped


def replanned_path(plan_path: str, world: int) -> str:
    """Where the plan re-made for ``world`` ranks goes: ``plan.json`` -> ``plan.world4.json``
    (the original's own name when it already is one)."""
    stem = os.path.splitext(os.path.abspath(plan_path))[0]
    base = stem.rsplit(".world", 1)[0] if stem.rsplit(".world", 1)[-1].isdigit() else stem
    return f"{base}.world{world}.json"


def plan_for_world(plan: Plan, plan_path: str, world: int, *, write: bool = True) -> Replan:
    """Plan ``plan``'s request again for ``world`` ranks (in-process) and, with ``write``, save it
    at ``replanned_path``. A plan without ``request``, or a request nothing fits, is a ``UserError``."""
    if plan.request is None:
        raise UserError(
            f"{plan_path} has no `request` (it was made by hand or by an older planner), so it "
            f"cannot be re-planned for {world} rank(s): --elastic needs a plan written by "
            f"`planner plan`. Re-plan it (planner plan ... --gpus {world}) or start {_world(plan)} rank(s)."
        )
    try:
        request = PlanRequest.from_record(plan.request)
    except SearchError as e:
        raise UserError(f"{plan_path}: {e}") from None
    request, dropped = request_for_world(request, world)
    request = _resolve_hardware(request, plan_path)
    try:
        solution, _ = plan_from_request(request)
    except SearchError as e:  # nothing fits the new world: say which world
        raise SearchError(f"re-planning {plan_path} for {world} rank(s): {e}") from None
    new = with_cost(solution.plan, request.tokens, request.price_per_gpu_hour)
    path = replanned_path(plan_path, world)
    if write:
        save_plan(new, path)
    return Replan(plan=new, path=path, old=plan, dropped=dropped)


def _resolve_hardware(request: PlanRequest, plan_path: str) -> PlanRequest:
    """A profile path recorded relative to where ``planner plan`` ran: kept when it exists from
    here, else taken relative to the plan file's folder when it exists there."""
    hardware = str(request.hardware)
    if not hardware.endswith(".json") or os.path.exists(hardware) or os.path.isabs(hardware):
        return request
    beside = os.path.join(os.path.dirname(os.path.abspath(plan_path)), hardware)
    return replace(request, hardware=beside) if os.path.exists(beside) else request
