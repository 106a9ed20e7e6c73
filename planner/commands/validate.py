"""``planner validate``: run a plan here for K steps and compare prediction with measurement.

Measured step time and bytes are medians over the steps after the first two (warm-up). Memory is
measured (live tensor bytes, max over ranks) only during those two warm-up steps, because the
tracker slows every operation down; the timed steps run untracked.

With offload (plan.json ``offload``), the metrics lines carry ``host_memory_bytes`` (the bytes of
host memory the rank's offloaded state and its transfer buffers hold, max over ranks) and the
comparison adds it, against the prediction's per-node ``predicted.memory.host`` divided by the
node's ranks (``min(gpus_per_node, gpus)``): both per rank.

The time breakdown (``time``: plan.json's ``predicted.time`` beside the measured parts of the
metrics lines, each part's median over the same steps) says which part of the prediction is off.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile

from rich.console import Console
from rich.table import Table

from planner.commands.train import WARMUP_STEPS, breakdown_table, median_breakdown, overlap_mismatch, train_plan
from planner.errors import UserError
from planner.plan import load_plan
from runtime.contract.choices import OffloadTier
from runtime.contract.overlap import Overlap
from runtime.training.events import step_lines
from runtime.training.train_config import TrainOptions

__all__ = ["run_validate", "compare"]

KEYS = ("step_time_s", "peak_memory_bytes", "comm_bytes_per_device")

#: How the table prints each compared quantity.
_FORMATS = {
    "step_time_s": lambda seconds: f"{seconds:.4f} s",
    "peak_memory_bytes": lambda nbytes: f"{nbytes / 2**20:,.1f} MiB",
    "comm_bytes_per_device": lambda nbytes: f"{nbytes / 2**20:,.2f} MiB",
    "host_memory_bytes": lambda nbytes: f"{nbytes / 2**20:,.1f} MiB",
}


def compare(plan, metrics: list[dict]) -> dict:
    """The ``validate --json`` object from a plan and its metrics lines: ``predicted`` and
    ``measured`` step time, peak memory and bytes; the timed steps' times and parts
    (``step_parts``); the median collective wait; ``time``, the predicted and measured (median)
    seconds of each part of the step. A 1-bit
    Adam plan whose run ends inside its full-precision warm-up is compared with the warm-up step
    (``predicted.compression``: its step, parts, bytes and peak, before the error buffers exist),
    which is what ran."""
    rows = metrics[WARMUP_STEPS:]
    if not rows:
        raise UserError(
            f"validate needs a measured step after the {WARMUP_STEPS} warm-up steps; "
            f"use --steps {WARMUP_STEPS + 1} or more."
        )
    measured = {
        "step_time_s": statistics.median(row["step_time_s"] for row in rows),
        "peak_memory_bytes": int(max(row["peak_memory_bytes"] for row in metrics)),
        "comm_bytes_per_device": statistics.median(row["comm_bytes"] for row in rows),
    }
    prediction = plan.predicted
    predicted = {
        "step_time_s": prediction.step_time_s,
        "peak_memory_bytes": prediction.peak_memory_bytes,
        "comm_bytes_per_device": prediction.comm_bytes_per_device,
    }
    predicted_time = plan.time_of_run(len(metrics))
    warmup = prediction.compression
    if warmup is not None and plan.in_warmup(len(metrics)):
        # 1-bit Adam still in its full-precision warm-up: every timed step is a warm-up step.
        predicted["step_time_s"] = warmup["warmup_step_time_s"]
        predicted["comm_bytes_per_device"] = warmup["warmup_comm_bytes_per_device"]
        predicted["peak_memory_bytes"] = warmup.get("warmup_peak_memory_bytes", prediction.peak_memory_bytes)
    host = [row["host_memory_bytes"] for row in metrics if "host_memory_bytes" in row]
    if host and set(plan.offload.values()) != {OffloadTier.NONE}:  # only a plan that keeps state on the host
        ranks = max(1, min(plan.hardware.gpus_per_node, plan.hardware.gpus))
        predicted["host_memory_bytes"] = int(prediction.memory.get("host", 0) // ranks)
        measured["host_memory_bytes"] = int(max(host))
    times = [row["time"] for row in metrics if "time" in row]
    parts, _ = median_breakdown(times)
    return {
        "predicted": predicted,
        "measured": measured,
        "step_times_s": [float(row["step_time_s"]) for row in rows],
        "step_parts": [{part: float(seconds) for part, seconds in step.items()} for step in times[WARMUP_STEPS:]],
        "comm_wait_s": statistics.median(float(row.get("comm_wait_s", 0.0)) for row in rows),
        "time": {"predicted": predicted_time, "measured": parts},
    }


def run_validate(args) -> int:
    """``planner validate plan.json --nproc N --steps K``: train the plan for K steps (default
    settings but ``--seed``, ``--timeout`` and ``--nvme-path``, by default a temporary folder for a
    plan with an NVMe tier; memory tracked in the warm-up steps only, no progress bar), then compare
    (``compare``)."""
    if args.steps <= WARMUP_STEPS:
        raise UserError(
            f"validate times the steps after {WARMUP_STEPS} warm-up steps (first-touch "
            f"allocations, lazy initialization), so --steps {args.steps} measures nothing; "
            f"use --steps {WARMUP_STEPS + 1} or more (10 is a good start)."
        )
    plan = load_plan(args.plan)
    with tempfile.TemporaryDirectory(prefix="planner-validate-") as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        nvme = getattr(args, "nvme_path", None) or os.path.join(tmp, "nvme")
        opts = TrainOptions(
            steps=args.steps,
            seed=args.seed,
            timeout_s=args.timeout,
            metrics_path=metrics,
            memory_steps=WARMUP_STEPS,
            progress=False,
            nvme_path=nvme,
            overlap=args.overlap,
        )
        status = train_plan(plan, args.plan, opts, nproc=args.nproc, compiled=os.path.join(tmp, "compiled"))
        if status != 0:
            return status
        with open(metrics, encoding="utf-8") as f:
            lines = step_lines(json.loads(line) for line in f if line.strip())
    result = compare(plan, lines)
    run_overlap = Overlap.from_toggle(args.overlap)
    result["overlap"] = {"priced": dict(plan.overlap), "run": run_overlap.to_json()}
    note = overlap_mismatch(plan.overlap, run_overlap)
    if args.json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
        return 0
    table = Table(title=f"{args.plan}: predicted vs measured ({len(lines)} steps, median after 2 warm-up)")
    table.add_column("quantity")
    table.add_column("predicted", justify="right")
    table.add_column("measured", justify="right")
    table.add_column("measured / predicted", justify="right")
    for k in KEYS + (("host_memory_bytes",) if "host_memory_bytes" in result["measured"] else ()):
        predicted, measured = result["predicted"][k], result["measured"][k]
        ratio = f"{measured / predicted:.2f}" if predicted else "-"
        table.add_row(k, _FORMATS[k](predicted), _FORMATS[k](measured), ratio)
    console = Console()
    console.print(table)
    console.print(
        breakdown_table(
            result["time"]["predicted"],
            result["time"]["measured"],
            "step time by part",
            f"measured: median after {WARMUP_STEPS} warm-up steps" + (f"; {note}" if note else ""),
        )
    )
    return 0
