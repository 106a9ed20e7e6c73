"""GPU evidence in one short run: calibrate a CUDA device, then predicted vs measured steps.

Three phases, so that the GPU machine (lent for minutes, with no ``pulp`` and another torch
build) only measures::

    python benchmarks/gpu_evidence.py prepare --out .gpu        # here: plan PLANS on --hardware h200
    python benchmarks/gpu_evidence.py run --plans .gpu --out $OUT   # there: calibrate, validate each
    python benchmarks/gpu_evidence.py report --plans .gpu --results DIR   # here: the table

``prepare`` plans each of ``PLANS`` for one device on the datasheet profile and writes the plans.
``run`` calls ``planner calibrate --device cuda`` (the profile, ``h200-calibrated.json``), then
``planner validate PLAN --nproc 1 --steps STEPS --json`` for each plan, each a subprocess with its
own time limit, so one failure costs only its row; everything lands in ``evidence.json`` and
``log.txt``. ``report`` re-prices each plan's strategy on the calibrated profile (the plan's own
degrees, ZeRO stage, micro-batch and recompute pinned) and prints predicted (datasheet and
calibrated) against measured step time and peak memory. On a CPU (``--device cpu``) the same
script runs end to end on the ``cpu`` profile with tiny models, which is how it is tested.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: name -> planning flags (one device each). Sized for an H200: each trains a few steps in well
#: under a minute, and together they span small and large products, one and several micro-batches.
#: Built-in GPTs: the GPU machine's torch (2.11) exports HF Llama's rotary embedding with an
#: autocast region as a submodule, which the compiler (written against torch 2.13) does not lower.
PLANS: dict[str, list[str]] = {
    "gpt2-124m": ["--model", "gpt2", "--global-batch", "16", "--seq-len", "1024"],
    "gpt2-xl": ["--model", "gpt2-xl", "--global-batch", "8", "--seq-len", "1024"],
    "gpt-1.3b": [
        *("--model", "gpt", "--layers", "24", "--hidden", "2048", "--heads", "16", "--vocab", "50257"),
        *("--global-batch", "8", "--seq-len", "2048"),
    ],
    "gpt-2.7b-4k": [
        *("--model", "gpt", "--layers", "32", "--hidden", "2560", "--heads", "32", "--vocab", "50257"),
        *("--global-batch", "8", "--seq-len", "4096"),
    ],
}

#: The same four shapes shrunk for the CPU rehearsal.
CPU_PLANS: dict[str, list[str]] = {
    "gpt-tiny": ["--model", "gpt", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "512"]
    + ["--global-batch", "4", "--seq-len", "64"],
    "llama-tiny": ["--model", "hf:llama", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2"]
    + ["--ffn", "128", "--vocab", "512", "--global-batch", "4", "--seq-len", "64"],
}

PROFILE = "h200-calibrated.json"


def _planner(*args: str, timeout: float, log) -> subprocess.CompletedProcess:
    """``python -m planner ARGS`` from the repository root, its output appended to ``log``."""
    started = time.perf_counter()
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "planner", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        done = subprocess.CompletedProcess(
            e.cmd, 124, e.stdout or "", (e.stderr or "") + f"\ntimed out after {timeout} s"
        )
    log.write(f"$ planner {' '.join(args)}  [{time.perf_counter() - started:.1f} s, exit {done.returncode}]\n")
    log.write(str(done.stderr)[-4000:] + "\n")
    log.flush()
    return done


def prepare(out: str, device: str) -> None:
    """Plan each request for one device (datasheet profile) into ``out``."""
    os.makedirs(out, exist_ok=True)
    plans, hardware = (PLANS, "h200") if device == "cuda" else (CPU_PLANS, "cpu")
    with open(os.path.join(out, "prepare.log"), "w") as log:
        for name, flags in plans.items():
            path = os.path.join(out, f"{name}.json")
            done = _planner("plan", *flags, "--gpus", "1", "--hardware", hardware, "--out", path, timeout=300, log=log)
            if done.returncode:
                raise SystemExit(f"planning {name} failed:\n{done.stderr[-2000:]}")
            print(f"planned {name} -> {path}")


def run(plans_dir: str, out: str, device: str, steps: int, limits: tuple[float, float] = (270.0, 75.0)) -> dict:
    """Calibrate, then validate every plan of ``plans_dir``; ``evidence.json`` under ``out`` is
    rewritten after each, so a run cut short still returns what it measured. ``limits``: seconds
    for the calibration and for each validation."""
    os.makedirs(out, exist_ok=True)
    evidence: dict[str, Any] = {"device": device, "plans": {}}

    def save() -> None:
        with open(os.path.join(out, "evidence.json"), "w") as f:
            json.dump(evidence, f, indent=2)

    with open(os.path.join(out, "log.txt"), "w") as log:
        profile = os.path.join(out, PROFILE)
        calibrate = ["calibrate", "--device", device, "--out", profile] + (["--quick"] if device == "cpu" else [])
        done = _planner(*calibrate, timeout=limits[0], log=log)
        evidence["calibrate"] = {"exit": done.returncode, "profile": PROFILE if done.returncode == 0 else None}
        save()
        for name in sorted(n[:-5] for n in os.listdir(plans_dir) if n.endswith(".json")):
            path = os.path.join(plans_dir, f"{name}.json")
            done = _planner(
                "validate", path, "--nproc", "1", "--steps", str(steps), "--json", timeout=limits[1], log=log
            )
            row: dict[str, Any] = {"exit": done.returncode}
            if done.returncode == 0:
                row.update(json.loads(done.stdout))
            else:
                row["error"] = str(done.stderr)[-1500:]
            evidence["plans"][name] = row
            save()
            print(f"{name}: exit {done.returncode}", flush=True)
    return evidence


def _repriced(plan_path: str, profile: str) -> dict:
    """The plan's strategy priced on ``profile``: planned again with its decisions pinned."""
    from planner.commands.plan_command import plan_from_request
    from planner.plan import load_plan
    from planner.search.request import PlanRequest

    plan = load_plan(plan_path)
    record = dict(plan.request or {})
    record.update(
        hardware=profile,
        dp=plan.dp,
        tp=plan.tp,
        pp=plan.pp,
        zero_stage=plan.zero_stage,
        micro_batch=plan.micro_batch_size,
        checkpoint="all" if plan.checkpoint_layers else ("selective" if plan.selective_layers else "none"),
        compile="on" if plan.compile else "off",
    )
    solution, _ = plan_from_request(PlanRequest.from_record(record))
    return {"step_time_s": solution.plan.predicted.step_time_s, "time": dict(solution.plan.predicted.time)}


def report(plans_dir: str, results: str) -> None:
    """Predicted (datasheet, calibrated) vs measured step time and memory, one row per plan."""
    with open(os.path.join(results, "evidence.json")) as f:
        evidence = json.load(f)
    profile = os.path.join(results, PROFILE) if evidence["calibrate"]["profile"] else None
    print(
        f"{'plan':<14} {'measured':>10} {'datasheet':>10} {'ratio':>6} {'calibrated':>10} {'ratio':>6} {'mem meas/pred':>14}"
    )
    for name, row in evidence["plans"].items():
        if row["exit"]:
            print(f"{name:<14} failed: {row.get('error', '')[-200:]!r}")
            continue
        measured, predicted = row["measured"], row["predicted"]
        calibrated = _repriced(os.path.join(plans_dir, f"{name}.json"), profile) if profile else None
        cal = calibrated["step_time_s"] if calibrated else float("nan")
        print(
            f"{name:<14} {measured['step_time_s']:>9.4f}s {predicted['step_time_s']:>9.4f}s "
            f"{predicted['step_time_s'] / measured['step_time_s']:>6.2f} {cal:>9.4f}s {cal / measured['step_time_s']:>6.2f} "
            f"{measured['peak_memory_bytes'] / max(predicted['peak_memory_bytes'], 1):>14.3f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=("prepare", "run", "report"))
    parser.add_argument("--plans", default=os.path.join(ROOT, ".gpu"))
    parser.add_argument("--out", default=os.path.join(ROOT, ".gpu"))
    parser.add_argument("--results", default=None)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    if args.phase == "prepare":
        prepare(args.out, args.device)
    elif args.phase == "run":
        run(args.plans, args.out, args.device, args.steps)
    else:
        report(args.plans, args.results or args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
