"""``planner tune``: plan, then run the best K candidates here and keep the fastest that fits.

The request is ``planner plan``'s. The search's own plan and its runners-up (in the order ``plan``
lists them; ``planner.search.solve.candidate_plans``) are trained one after the other for
``--steps`` steps each, on ``--gpus`` local processes or, under torchrun, on torchrun's ranks
(every rank runs tune; rank 0 reads the metrics and writes the results). Each trial is measured
as ``planner validate`` measures a plan: the median step time after the warm-up steps
(``validate.WARMUP_STEPS``), the peak of live tensor bytes (max over ranks) tracked in the warm-up
steps, and, when the metrics carry it, the median seconds of each part of the step (``time``).

A trial ends in one of four states (``TRIAL_STATUSES``):

- ``ok``: every step ran and the measured peak fits;
- ``crashed``: a rank failed or was lost (the reason is the launcher's: the first rank to fail);
- ``timeout``: the trial did not finish within ``--timeout`` seconds (a local trial is stopped by
  a watchdog that kills its processes; every collective also gives up after that long, which is
  what ends a trial under torchrun), or a collective gave up;
- ``out of memory``: the device reported it (CUDA's out-of-memory error), or the measured peak is
  above the memory the plan had to fit in, ``memory_bytes x --memory-headroom`` of the hardware
  profile (the rest of the device is the allocator's fragmentation and the runtime's own state,
  which the live-tensor peak does not count).

A failed trial is recorded and the next one runs: tune never waits on a dead trial longer than
its timeout and never stops at one. The fastest ``ok`` trial becomes plan.json (written once, at
the end, atomically) with a ``measured`` section: its step time and peak, and every trial
(``Trial.to_json``). When no trial is ``ok`` the command prints the table and one error naming
each failure, writes nothing and exits 1.

The measured trials also refit the hardware profile (``refit_profile``: the compute efficiency
and per-operator cost, the links' speed and the cost of a blocking collective, from measured
against predicted times); ``--profile-out`` writes it, and re-planning with it predicts the
trials' step times more closely.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from rich.console import Console, JustifyMethod
from rich.markup import escape
from rich.table import Table

from cost_models.hardware import HardwareProfile, load_hardware
from cost_models.strategy import NumericTable, candidate_costs
from planner.commands.plan_command import (
    check_cost_flags,
    layer_table_for,
    plan_from_request,
    request_from_args,
    with_cost,
)
from planner.commands.train import train_plan
from planner.commands.validate import WARMUP_STEPS, compare
from planner.errors import UserError
from planner.plan import Plan, save_plan
from planner.search.request import PlanRequest
from planner.search.schedule_search import evaluate_strategy
from planner.search.solve import candidate_plans
from planner.units import format_bytes, format_seconds
from runtime.training.events import step_lines
from runtime.training.train_config import TrainOptions
from runtime.training.trainer import StepHook

__all__ = [
    "run_tune",
    "Trial",
    "TRIAL_STATUSES",
    "trial_status",
    "Refit",
    "refit_profile",
    "scaled_profile",
    "fit_bounded",
    "TrialHook",
    "COMPUTE_PARTS",
    "LINK_PARTS",
]

#: What became of a trial (see the module docstring).
TRIAL_STATUSES = ("ok", "crashed", "timeout", "out of memory")

#: The hook a test gives ``run_tune``: trial number (1 = the plan's own choice) -> the step hook
#: its ranks run before every step (``runtime.training.trainer.StepHook``), or None.
TrialHook = Callable[[int], "StepHook | None"]


@dataclass
class Trial:
    """One candidate plan run here, and what became of it."""

    index: int
    """1 for the plan's own choice, then its runners-up in ``plan``'s order."""
    plan: Plan
    status: str = "crashed"
    """One of ``TRIAL_STATUSES``."""
    error: str | None = None
    """Why it failed (None when ``ok``)."""
    step_time_s: float | None = None
    """Median step time after the warm-up steps; None when it did not finish."""
    peak_memory_bytes: int | None = None
    """Peak live tensor bytes, max over ranks (tracked in the warm-up steps)."""
    time: dict | None = None
    """Median measured seconds of each part of the step, when the metrics carry them."""
    wall_s: float = 0.0
    """Seconds the whole trial took (compile, start, every step)."""

    @property
    def measured(self) -> bool:
        """Every step ran (``ok``, or over the memory limit): its times are measurements."""
        return self.step_time_s is not None

    def to_json(self, chosen: bool = False) -> dict:
        """The trial as one entry of plan.json's ``measured.trials``."""
        plan = self.plan
        return {
            "candidate": self.index,
            "dp": plan.dp,
            "tp": plan.tp,
            "pp": plan.pp,
            "zero_stage": plan.zero_stage,
            "micro_batch_size": plan.micro_batch_size,
            "num_micro_batches": plan.num_micro_batches,
            "checkpoint_layers": list(plan.checkpoint_layers),
            "predicted_step_time_s": plan.predicted.step_time_s,
            "predicted_peak_memory_bytes": plan.predicted.peak_memory_bytes,
            "status": self.status,
            "error": self.error,
            "step_time_s": self.step_time_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "time": self.time,
            "wall_s": round(self.wall_s, 3),
            "chosen": chosen,
        }


def trial_status(finished: bool, error: str | None, timed_out: bool, peak_bytes: int | None, capacity: float) -> str:
    """What became of a trial (one of ``TRIAL_STATUSES``): ``finished`` is whether every step ran,
    ``error`` the failure's message, ``timed_out`` whether the watchdog stopped it, ``capacity``
    the bytes per device the plan had to fit in."""
    text = (error or "").lower()
    if timed_out or "timed out" in text or "timeout" in text:
        return "timeout"
    if "out of memory" in text or "outofmemoryerror" in text:
        return "out of memory"
    if not finished:
        return "crashed"
    if peak_bytes is not None and peak_bytes > capacity:
        return "out of memory"
    return "ok"


# --------------------------------------------------------------------------------------------
# Refitting the profile


@dataclass
class Refit:
    """A profile refit from measured trials, and how well each profile predicts them."""

    profile: HardwareProfile
    """The refit profile (same name and node size as the original; ``_write_profile`` renames it)."""
    flops_scale: float
    """Measured FLOP time / predicted: the achievable FLOP/s is divided by it."""
    op_overhead_s: float
    """The fitted seconds per operator call."""
    link_scale: float | None
    """Measured link time / predicted (latencies times it, bandwidths divided by it); None when
    the metrics did not say how long communication took, or no trial communicated."""
    sync_overhead_s: float
    """The fitted cost of a blocking collective beyond its alpha-beta time (the profile's when
    the trials do not determine it)."""
    before: list[float]
    """Each measured trial's predicted step time with the original profile."""
    after: list[float]
    """The same with the refit profile."""
    measured: list[float]
    """The trials' measured step times."""
    notes: list[str] = field(default_factory=list)

    @staticmethod
    def error(predicted: Sequence[float], measured: Sequence[float]) -> float:
        """Mean relative error of step-time predictions, ``|predicted - measured| / measured``."""
        return sum(
            abs(predicted_s - measured_s) / measured_s for predicted_s, measured_s in zip(predicted, measured)
        ) / max(len(measured), 1)

    @property
    def error_before(self) -> float:
        return self.error(self.before, self.measured)

    @property
    def error_after(self) -> float:
        return self.error(self.after, self.measured)


def scaled_profile(
    hw: HardwareProfile,
    flops: float = 1.0,
    op_overhead_s: float | None = None,
    links: float = 1.0,
    sync_overhead_s: float | None = None,
) -> HardwareProfile:
    """``hw`` with every FLOP taking ``flops`` times as long, every link ``links`` times as slow
    (latencies times it, bandwidths divided by it, per-collective links too), and
    ``op_overhead_s`` per operator call and ``sync_overhead_s`` per blocking collective (each
    unchanged when None).

    The FLOP rate is ``peak x compute_efficiency``, and a product priced by a measured GEMM table
    ``peak x`` its cell: the efficiency and every cell are divided by ``flops``; where that takes
    one above 1 (the datasheet peak was too low) every dtype's peak is raised by the largest such
    factor and the efficiencies divided by it too, so every FLOP's rate is still ``1 / flops`` of
    what it was.
    """
    changes: dict = {}
    if flops != 1.0:
        tables = hw.gemm_efficiency or {}
        cells = [cell for table in tables.values() for plane in table["efficiency"] for row in plane for cell in row]
        raise_by = max(1.0, max([hw.compute_efficiency, *cells]) / flops)
        if raise_by > 1.0:
            changes["peak_flops"] = {dtype: rate * raise_by for dtype, rate in hw.peak_flops.items()}
        changes["compute_efficiency"] = hw.compute_efficiency / flops / raise_by
        if tables:
            changes["gemm_efficiency"] = {
                dtype: dict(
                    table,
                    efficiency=[
                        [[cell / flops / raise_by for cell in row] for row in plane] for plane in table["efficiency"]
                    ],
                )
                for dtype, table in tables.items()
            }
    if op_overhead_s is not None:
        changes["op_overhead_s"] = max(0.0, float(op_overhead_s))
    if sync_overhead_s is not None:
        changes["sync_overhead_s"] = max(0.0, float(sync_overhead_s))
    if links != 1.0:
        changes.update(
            intra_node_latency=hw.intra_node_latency * links,
            inter_node_latency=hw.inter_node_latency * links,
            intra_node_bandwidth=hw.intra_node_bandwidth / links,
            inter_node_bandwidth=hw.inter_node_bandwidth / links,
        )
        if hw.intra_node_collectives:
            changes["intra_node_collectives"] = {
                collective: {"latency": link["latency"] * links, "bandwidth": link["bandwidth"] / links}
                for collective, link in hw.intra_node_collectives.items()
            }
    return dataclasses.replace(hw, **changes) if changes else hw


def fit_bounded(
    rows: Sequence[tuple[float, float, Sequence[float]]], lower: Sequence[float], keep: Sequence[float]
) -> list[float]:
    """Least squares on relative residuals with lower bounds, for one or two unknowns.

    Each row ``(y, c, a)`` is one measurement ``y ~ c + a . x``; the fit minimises
    ``sum ((c + a . x - y) / y)^2``. Two unknowns are fit together only when the rows
    over-determine them (more rows than unknowns: two noisy rows fit exactly, noise and all), tell
    their columns apart (``|cos| <= 0.999``, neither zero) and put the solution within the bounds
    (``x >= lower``); otherwise the second keeps ``keep[1]`` and only the first is fit. A fitted
    unknown below its bound sits on it. No usable row: ``keep``.
    """
    unknowns = len(lower)
    weighted = [(1.0 / y, y - c, list(a)) for y, c, a in rows if y > 0]  # (1/y, y - c, a) per row
    if not weighted or unknowns not in (1, 2):
        return list(keep)

    def solve_one(j: int, fixed: dict[int, float]) -> float:
        """Unknown ``j`` alone, the unknowns of ``fixed`` held at their values."""
        num = den = 0.0
        for weight, residual, slopes in weighted:
            rest = residual - sum(slopes[i] * value for i, value in fixed.items())
            num += weight * weight * slopes[j] * rest
            den += weight * weight * slopes[j] * slopes[j]
        return max(lower[j], num / den) if den > 0 else keep[j]

    if unknowns == 1:
        return [solve_one(0, {})]
    s00 = sum((weight * slopes[0]) ** 2 for weight, _, slopes in weighted)
    s11 = sum((weight * slopes[1]) ** 2 for weight, _, slopes in weighted)
    s01 = sum(weight * weight * slopes[0] * slopes[1] for weight, _, slopes in weighted)
    first_only = [solve_one(0, {1: keep[1]}), keep[1]]
    if len(weighted) <= 2 or s00 <= 0 or s11 <= 0 or abs(s01) / math.sqrt(s00 * s11) > 0.999:
        return first_only
    b0 = sum(weight * weight * slopes[0] * residual for weight, residual, slopes in weighted)
    b1 = sum(weight * weight * slopes[1] * residual for weight, residual, slopes in weighted)
    det = s00 * s11 - s01 * s01
    x = [(b0 * s11 - b1 * s01) / det, (b1 * s00 - b0 * s01) / det]
    return x if x[0] >= lower[0] and x[1] >= lower[1] else first_only


#: Parts of the step each fit reads (plan.json ``predicted.time`` keys): compute, then the links.
COMPUTE_PARTS = ("compute", "recompute")
LINK_PARTS = ("tp_comm", "dp_comm", "pp_bubble")


def refit_profile(
    hw: HardwareProfile, trials: Sequence[dict], price: Callable[[HardwareProfile], list[dict]]
) -> Refit | None:
    """Refit ``hw``'s calibrated terms to measured trials.

    ``trials`` are what was measured, one dict per trial: ``step_time_s`` and, when the metrics
    carry it, ``time`` (seconds per part, the keys of plan.json's ``predicted.time``).
    ``price(profile)`` returns, per trial in the same order, the predicted seconds per part of
    its strategy on ``profile`` (the parts sum to the step time); it is the cost model, so this
    function only does arithmetic.

    The terms are refit in two least-squares problems on relative residuals (``fit_bounded``),
    each a change of the profile the cost model prices again, so that the fit never leaves the
    model's form:

    1. ``f`` (every FLOP takes f times as long: ``compute_efficiency / f``) and ``o``
       (``op_overhead_s``), from measured against predicted ``compute + recompute`` when the
       metrics break the step down, else from the whole step;
    2. then, on the profile of step 1 and only with a breakdown, ``g`` (latencies x g,
       bandwidths / g) and ``s`` (``sync_overhead_s``), from measured against predicted
       ``tp_comm + dp_comm + pp_bubble`` (the bubble holds the pipeline's transfers; its fill,
       the other stages' compute, is step 1's), over the trials that communicate.

    The predictions are linear in ``f``, ``o``, ``g`` and ``s`` on CPUs (sums of FLOP time,
    bytes, operator calls and alpha-beta times; a pipeline's slowest stage may change, so nearly)
    and nearly so on GPUs (a layer's time is the larger of device and host time): each part's
    slope in a term is the difference of two pricings. Bounds: ``f, g >= 1e-3``, ``o, s >= 0``.
    ``o`` and ``s`` are fit only from three trials or more that tell them from ``f`` and ``g``
    (``fit_bounded``), else they keep the profile's values and ``f``, ``g`` absorb them. None when
    no trial was measured.
    """
    trials = [trial for trial in trials if trial.get("step_time_s")]
    if not trials:
        return None
    notes: list[str] = []
    broken_down = all(isinstance(trial.get("time"), dict) and "compute" in trial["time"] for trial in trials)
    base = price(hw)
    if not broken_down:
        notes.append("the metrics have no time breakdown: compute is fit to whole steps, links are kept")
    flops_scale, op_overhead_s = _fit_compute(hw, trials, price, base, broken_down)
    fitted = scaled_profile(hw, flops=flops_scale, op_overhead_s=op_overhead_s)
    link_scale, sync_overhead_s = None, hw.sync_overhead_s
    if broken_down:
        link_scale, sync_overhead_s = _fit_links(fitted, trials, price)
        if link_scale is not None:
            fitted = scaled_profile(fitted, links=link_scale, sync_overhead_s=sync_overhead_s)
    return Refit(
        profile=fitted,
        flops_scale=flops_scale,
        op_overhead_s=op_overhead_s,
        link_scale=link_scale,
        sync_overhead_s=sync_overhead_s,
        before=[sum(parts.values()) for parts in base],
        after=[sum(parts.values()) for parts in price(fitted)],
        measured=[float(trial["step_time_s"]) for trial in trials],
        notes=notes,
    )


#: One measurement of a fit (``fit_bounded``): measured seconds, the constant part, the slopes.
_FitRow = tuple[float, float, list[float]]


def _fit_rows(
    trials: Sequence[dict],
    base: list[dict],
    slopes: list[list[dict]],
    start: Sequence[float],
    parts: Callable[[int], Sequence[str]],
    measured: Callable[[dict], float],
) -> list[_FitRow]:
    """One row per trial: ``measured(trial)`` against the predicted seconds of its ``parts(i)``,
    linear in the unknowns (``slopes``, one list per unknown) around their values ``start``."""
    rows = []
    for i, trial in enumerate(trials):
        keys = parts(i)
        coefficients = [sum(slope[i][k] for k in keys) for slope in slopes]
        constant = sum(base[i][k] for k in keys) - sum(slope * value for slope, value in zip(coefficients, start))
        rows.append((measured(trial), constant, coefficients))
    return rows


def _measured_parts(keys: Sequence[str]) -> Callable[[dict], float]:
    """A trial's measured seconds of the parts ``keys``."""
    return lambda trial: sum(float(trial["time"].get(k, 0.0)) for k in keys)


def _fit_compute(
    hw: HardwareProfile,
    trials: Sequence[dict],
    price: Callable[[HardwareProfile], list[dict]],
    base: list[dict],
    broken_down: bool,
) -> tuple[float, float]:
    """Step 1 of ``refit_profile``: ``f`` (FLOP time x f) and ``o`` (seconds per operator call),
    from the measured compute parts, or the whole step without a breakdown."""
    overhead_s, overhead_step = hw.op_overhead_s, max(hw.op_overhead_s, 1e-5)
    slopes = [
        _slopes(base, price(scaled_profile(hw, flops=2.0)), 1.0),
        _slopes(base, price(scaled_profile(hw, op_overhead_s=overhead_s + overhead_step)), overhead_step),
    ]
    if broken_down:
        rows = _fit_rows(
            trials, base, slopes, (1.0, overhead_s), lambda i: COMPUTE_PARTS, _measured_parts(COMPUTE_PARTS)
        )
    else:
        rows = _fit_rows(
            trials, base, slopes, (1.0, overhead_s), lambda i: tuple(base[i]), lambda trial: float(trial["step_time_s"])
        )
    flops_scale, op_overhead_s = fit_bounded(rows, lower=(1e-3, 0.0), keep=(1.0, overhead_s))
    return flops_scale, op_overhead_s


def _fit_links(
    fitted: HardwareProfile, trials: Sequence[dict], price: Callable[[HardwareProfile], list[dict]]
) -> tuple[float | None, float]:
    """Step 2 of ``refit_profile``, on step 1's profile: ``g`` (latency x g, bandwidth / g) and
    ``s`` (seconds per blocking collective) from the trials that communicate; ``(None, the
    profile's s)`` when none does."""
    sync = fitted.sync_overhead_s
    base = price(fitted)
    d_s = max(sync, 1e-5)
    slopes = [
        _slopes(base, price(scaled_profile(fitted, links=2.0)), 1.0),
        _slopes(base, price(scaled_profile(fitted, sync_overhead_s=sync + d_s)), d_s),
    ]
    rows = _fit_rows(trials, base, slopes, (1.0, sync), lambda i: LINK_PARTS, _measured_parts(LINK_PARTS))
    rows = [row for row in rows if row[2][0] > 0 or row[2][1] > 0]
    if not rows:
        return None, sync
    link_scale, sync = fit_bounded(rows, lower=(1e-3, 0.0), keep=(1.0, sync))
    return link_scale, sync


def _slopes(base: list[dict], moved: list[dict], step: float) -> list[dict]:
    return [
        {k: (moved_parts.get(k, 0.0) - priced[k]) / step for k in priced} for priced, moved_parts in zip(base, moved)
    ]


# --------------------------------------------------------------------------------------------
# Running the trials


def _torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


class _Watchdog:
    """After ``seconds``, kills this process's child processes (a local trial's ranks), and any
    it starts later, until the trial returns."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.fired = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        if self._done.wait(self.seconds):
            return
        self.fired = True
        while not self._done.is_set():
            for child in multiprocessing.active_children():
                with contextlib.suppress(Exception):
                    child.kill()
            self._done.wait(0.2)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
        return False


def _read_metrics(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return step_lines(json.loads(line) for line in f if line.strip())


def _measure(trial: Trial, lines: list[dict]) -> None:
    """Fill ``trial``'s measurements from its metrics lines (``validate.compare``)."""
    measured = compare(trial.plan, lines)["measured"]
    trial.step_time_s = float(measured["step_time_s"])
    trial.peak_memory_bytes = int(measured["peak_memory_bytes"])
    timed = lines[WARMUP_STEPS:]
    if timed and all(isinstance(row.get("time"), dict) for row in timed):
        keys = sorted(set().union(*(row["time"] for row in timed)))
        trial.time = {k: statistics.median(float(row["time"].get(k, 0.0)) for row in timed) for k in keys}


def _run_trial(trial: Trial, workdir: str, steps: int, timeout: float, capacity: float, hook: StepHook | None) -> None:
    """Train ``trial.plan`` for ``steps`` steps here and record what became of it."""
    index = trial.index
    plan_path = os.path.join(workdir, f"candidate-{index}.json")
    save_plan(trial.plan, plan_path)
    metrics = os.path.join(workdir, f"metrics-{index}.jsonl")
    opts = TrainOptions(
        steps=steps,
        timeout_s=timeout,
        metrics_path=metrics,
        memory_steps=WARMUP_STEPS,
        progress=False,
        overlap="on" if any(trial.plan.overlap.values()) else "off",  # as the plan was priced
    )
    local = not _torchrun()
    nproc = trial.plan.dp * trial.plan.cp * trial.plan.tp * trial.plan.pp if local else None
    err = io.StringIO()
    error: str | None = None
    start = time.perf_counter()
    watchdog = _Watchdog(timeout) if local else contextlib.nullcontext()
    with watchdog, contextlib.redirect_stderr(err):
        try:
            status = train_plan(
                trial.plan,
                plan_path,
                opts,
                nproc=nproc,
                compiled=os.path.join(workdir, f"compiled-{index}"),
                on_step_start=hook,
            )
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as e:  # a rank of an in-process (torchrun) trial raised: this trial failed
            status, error = 1, f"{type(e).__name__}: {e}".strip()
    trial.wall_s = time.perf_counter() - start
    timed_out = bool(getattr(watchdog, "fired", False))
    said = [line for line in err.getvalue().splitlines() if line.strip()]
    for line in said:
        if line.startswith("planner train: training failed: "):
            error = error or line.removeprefix("planner train: training failed: ")
        elif local:
            print(line, file=sys.stderr)
    if status != 0 and error is None:
        error = said[-1] if said else f"training exited with status {status}"
    if timed_out:
        error = f"did not finish within --timeout {timeout:g} s (stopped)"
    lines = _read_metrics(metrics)
    finished = status == 0 and len(lines) >= steps
    if finished:
        _measure(trial, lines)
    elif status == 0 and local:
        error = f"wrote {len(lines)} of {steps} metrics lines"
    trial.status = trial_status(finished, error, timed_out, trial.peak_memory_bytes, capacity)
    if trial.status == "out of memory" and finished and trial.peak_memory_bytes is not None:
        error = (
            f"measured peak {format_bytes(trial.peak_memory_bytes)} per device is above the "
            f"{format_bytes(capacity)} the plan must fit in"
        )
    trial.error = None if trial.status == "ok" else error


# --------------------------------------------------------------------------------------------
# The command


def _describe(plan: Plan) -> str:
    return f"dp={plan.dp} tp={plan.tp} pp={plan.pp} ZeRO-{plan.zero_stage} micro-batch {plan.micro_batch_size} x {plan.num_micro_batches}"


def _pricer(req, table, hw: HardwareProfile, strategies: list) -> Callable:
    """``price(profile)`` for ``refit_profile``: each strategy's time parts priced on ``profile``."""
    numeric = table if isinstance(table, NumericTable) else NumericTable(table)
    gpn = req.gpus_per_node or hw.gpus_per_node

    def price(profile: HardwareProfile) -> list[dict]:
        if profile.gpus_per_node != gpn:
            profile = profile.with_gpus_per_node(gpn)
        out = []
        for strategy in strategies:
            costs = candidate_costs(
                numeric,
                profile,
                req.dtype,
                req.seq_len,
                strategy.candidate,
                gpn,
                profile.memory_bytes * req.memory_headroom,
            )
            out.append({k: float(seconds) for k, seconds in evaluate_strategy(costs, strategy).time.items()})
        return out

    return price


#: The trials table's columns and how each is aligned.
_TABLE_COLUMNS: tuple[tuple[str, JustifyMethod], ...] = (
    ("#", "right"),
    ("dp/tp/pp", "left"),
    ("ZeRO", "right"),
    ("micro-batch", "right"),
    ("recompute", "right"),
    ("predicted", "right"),
    ("measured", "right"),
    ("meas/pred", "right"),
    ("peak memory", "right"),
    ("status", "left"),
)


def _table(trials: list[Trial], chosen: Trial | None) -> Table:
    table = Table(title=f"planner tune: {len(trials)} candidate{'s' if len(trials) != 1 else ''} run here")
    for name, justify in _TABLE_COLUMNS:
        table.add_column(name, justify=justify)
    for trial in trials:
        plan = trial.plan
        status = (
            "ok, chosen"
            if trial is chosen
            else trial.status
            if trial.status == "ok"
            else escape(f"{trial.status}: {trial.error}")
        )
        ratio = f"{trial.step_time_s / plan.predicted.step_time_s:.2f}" if trial.step_time_s else "-"
        table.add_row(
            str(trial.index),
            f"{plan.dp}/{plan.tp}/{plan.pp}",
            str(plan.zero_stage),
            f"{plan.micro_batch_size} x {plan.num_micro_batches}",
            f"{len(plan.checkpoint_layers)} layers",
            format_seconds(plan.predicted.step_time_s),
            format_seconds(trial.step_time_s) if trial.step_time_s else "-",
            ratio,
            format_bytes(trial.peak_memory_bytes) if trial.peak_memory_bytes is not None else "-",
            status,
            style="bold" if trial is chosen else None,
        )
    return table


def run_tune(args: argparse.Namespace, *, trial_hook: TrialHook | None = None) -> int:
    """``planner tune <plan's flags> [--candidates K] [--steps N] [--timeout S] [--profile-out F]``:
    plan, run the K best candidates here, write the fastest that fits (see the module docstring).
    ``trial_hook(i)`` gives trial ``i``'s ranks a step hook (fault injection in tests; it must
    pickle for local trials). Exit 0 with a plan; 1 when every trial failed; bad input raises."""
    req = _tune_request(args)
    local = not _torchrun()
    rank0 = local or int(os.environ["RANK"]) == 0

    def say(*parts: object) -> None:  # progress and results: stdout, or stderr under --json; rank 0 only
        if rank0:
            print(*parts, file=sys.stderr if args.json else sys.stdout, flush=True)

    table = layer_table_for(req)
    solution, hw = plan_from_request(req, table)
    plans = candidate_plans(req, table, hw, solution, args.candidates)
    kept = solution.search.ranked + solution.search.extra  # the plan's own strategy, then its runners-up
    if len(plans) < args.candidates:
        say(
            f"planner tune: the search kept {len(plans)} candidate{'s' if len(plans) != 1 else ''} "
            f"(asked for {args.candidates}); running {'them' if len(plans) != 1 else 'it'}."
        )
    trials = [Trial(index=i + 1, plan=plan) for i, plan in enumerate(plans)]
    where = "torchrun's ranks" if not local else f"{req.gpus} local process{'es' if req.gpus != 1 else ''}"
    _run_trials(trials, args, where, hw.memory_bytes * req.memory_headroom, trial_hook, say)
    if not rank0:
        return 0
    chosen = _choose(trials, args)
    if chosen is None:
        return 1
    measured = [trial for trial in trials if trial.measured]  # ok, and over the memory limit: their times count
    refit = refit_profile(
        hw,
        [{"step_time_s": trial.step_time_s, "time": trial.time} for trial in measured],
        _pricer(req, table, hw, [kept[trial.index - 1].strategy for trial in measured]),
    )
    _announce_choice(chosen, trials[0], say)
    if refit is not None:
        say(_refit_line(refit, hw))
    plan = dataclasses.replace(
        with_cost(chosen.plan, args.tokens, args.price_per_gpu_hour),
        measured={
            "step_time_s": chosen.step_time_s,
            "peak_memory_bytes": chosen.peak_memory_bytes,
            "trials": [trial.to_json(chosen=trial is chosen) for trial in trials],
        },
    )
    one_node = req.gpus <= (req.gpus_per_node or hw.gpus_per_node)
    _write_profile(args, refit, len(measured), one_node, say)
    save_plan(plan, args.out)
    if args.json:
        sys.stdout.write(plan.to_json())
    else:
        say(f"Wrote {args.out}.")
    return 0


def _tune_request(args: argparse.Namespace) -> PlanRequest:
    """The request of ``tune``'s flags, once they are known to measure something and, under
    torchrun, to match its world size."""
    if args.steps <= WARMUP_STEPS:
        raise UserError(
            f"tune times the steps after {WARMUP_STEPS} warm-up steps, so --steps {args.steps} "
            f"measures nothing; use --steps {WARMUP_STEPS + 1} or more."
        )
    check_cost_flags(args)
    req = request_from_args(args)
    if _torchrun() and int(os.environ["WORLD_SIZE"]) != req.gpus:
        raise UserError(
            f"tune runs each candidate on --gpus {req.gpus} devices, but torchrun started "
            f"{os.environ['WORLD_SIZE']} processes; use --gpus {os.environ['WORLD_SIZE']}."
        )
    return req


def _run_trials(
    trials: list[Trial],
    args: argparse.Namespace,
    where: str,
    capacity: float,
    trial_hook: TrialHook | None,
    say: Callable[..., None],
) -> None:
    """Run every trial in turn, in a scratch folder, saying what each did."""
    with tempfile.TemporaryDirectory(prefix="planner-tune-") as workdir:
        for trial in trials:
            say(
                f"trial {trial.index}/{len(trials)}: {_describe(trial.plan)} (predicted "
                f"{format_seconds(trial.plan.predicted.step_time_s)} per step), {args.steps} steps on {where} ..."
            )
            hook = trial_hook(trial.index) if trial_hook else None
            _run_trial(trial, workdir, args.steps, args.timeout, capacity, hook)
            if trial.status == "ok" and trial.step_time_s is not None and trial.peak_memory_bytes is not None:
                say(
                    f"  measured {format_seconds(trial.step_time_s)} per step, peak "
                    f"{format_bytes(trial.peak_memory_bytes)} ({trial.wall_s:.0f} s)"
                )
            else:
                say(f"  {trial.status}: {trial.error} (recorded; going on)")


def _choose(trials: list[Trial], args: argparse.Namespace) -> Trial | None:
    """The fastest ``ok`` trial, after printing the table; None (and the error) when none is ok."""
    ok_trials = [trial for trial in trials if trial.status == "ok"]
    chosen = min(ok_trials, key=lambda trial: (trial.step_time_s or 0.0, trial.index)) if ok_trials else None
    out = sys.stderr if args.json else sys.stdout
    console = Console(file=out, width=None if out.isatty() else 132)  # a log file gets the whole table
    console.print(_table(trials, chosen))
    if chosen is None:
        why = "; ".join(
            f"trial {trial.index} ({_describe(trial.plan)}) {trial.status}: {trial.error}" for trial in trials
        )
        print(
            f"planner tune: error: no candidate ran to the end within its memory: {why}. Nothing was "
            f"written; see the table above, or raise --timeout, or re-plan with other pins.",
            file=sys.stderr,
        )
    return chosen


def _announce_choice(chosen: Trial, first: Trial, say: Callable[..., None]) -> None:
    """Which trial won, against the plan's own choice (trial 1)."""
    step_time_s = chosen.step_time_s or 0.0
    if chosen is first:
        say(
            f"Chose trial 1, the plan's own choice ({_describe(chosen.plan)}): measured fastest, "
            f"{format_seconds(step_time_s)} per step."
        )
        return
    versus = (
        f"{(1 - step_time_s / first.step_time_s):.0%} faster than the plan's own choice "
        f"(trial 1, {format_seconds(first.step_time_s)})"
        if first.step_time_s
        else f"while the plan's own choice (trial 1) ended in {first.status}"
    )
    say(f"Chose trial {chosen.index} ({_describe(chosen.plan)}): {format_seconds(step_time_s)} per step, {versus}.")


def _refit_line(refit: Refit, hw: HardwareProfile) -> str:
    refit_hw = refit.profile
    parts = [f"compute efficiency {hw.compute_efficiency:.3g} -> {refit_hw.compute_efficiency:.3g}"]
    if refit_hw.peak_flops != hw.peak_flops:
        parts.append(
            f"peak FLOP/s x{next(iter(refit_hw.peak_flops.values())) / next(iter(hw.peak_flops.values())):.3g}"
        )
    parts.append(f"op overhead {format_seconds(hw.op_overhead_s)} -> {format_seconds(refit_hw.op_overhead_s)}")
    if refit.link_scale is not None:
        parts.append(
            f"links x{refit.link_scale:.3g} slower"
            if refit.link_scale >= 1
            else f"links {1 / refit.link_scale:.3g}x faster"
        )
        parts.append(f"sync cost {format_seconds(hw.sync_overhead_s)} -> {format_seconds(refit_hw.sync_overhead_s)}")
    line = (
        f"Refit from {len(refit.measured)} trial{'s' if len(refit.measured) != 1 else ''}: "
        f"{', '.join(parts)}; step-time error of the predictions {refit.error_before:.0%} -> "
        f"{refit.error_after:.0%}."
    )
    if refit.notes:
        line += " (" + "; ".join(refit.notes) + ")"
    return line


def _write_profile(args, refit: Refit | None, n: int, one_node: bool, say) -> None:
    """Write the refit profile to ``--profile-out``: the original (as given, without
    ``--gpus-per-node``) with the refit terms, renamed ``<name>-tuned``. Trials on one node say
    nothing about the links between nodes: those keep the original's numbers."""
    if not args.profile_out:
        return
    if refit is None:
        say(f"planner tune: no trial ran to the end: {args.profile_out} was not written.")
        return
    original = load_hardware(args.hardware)
    refit_hw = refit.profile
    inter = original if one_node else refit_hw
    what = (
        "compute efficiency and op overhead from measured compute times, links and sync cost from "
        "measured communication"
        if refit.link_scale is not None
        else "compute efficiency and op overhead from measured step times"
    )
    fitted = dataclasses.replace(
        original,
        name=f"{original.name.removesuffix('-tuned')}-tuned",
        peak_flops=dict(refit_hw.peak_flops),
        compute_efficiency=refit_hw.compute_efficiency,
        gemm_efficiency=refit_hw.gemm_efficiency,
        op_overhead_s=refit_hw.op_overhead_s,
        intra_node_latency=refit_hw.intra_node_latency,
        intra_node_bandwidth=refit_hw.intra_node_bandwidth,
        inter_node_latency=inter.inter_node_latency,
        inter_node_bandwidth=inter.inter_node_bandwidth,
        sync_overhead_s=refit_hw.sync_overhead_s,
        intra_node_collectives=refit_hw.intra_node_collectives,
        source=(
            f"Refit by planner tune from {n} trial{'s' if n != 1 else ''} of {args.model} "
            f"({time.strftime('%Y-%m-%d')}): {what}. Based on: {original.source}"
        ),
        calibration={
            **(original.calibration or {}),
            "tune": {
                "trials": n,
                "flops_scale": refit.flops_scale,
                "op_overhead_s": refit.op_overhead_s,
                "link_scale": refit.link_scale,
                "sync_overhead_s": refit.sync_overhead_s,
                "measured_step_s": refit.measured,
                "predicted_step_s_before": refit.before,
                "predicted_step_s_after": refit.after,
            },
        },
    )
    fitted.save(args.profile_out)
    say(f"Wrote {args.profile_out} (hardware profile refit from {n} trial{'s' if n != 1 else ''}).")
