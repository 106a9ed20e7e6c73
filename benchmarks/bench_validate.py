"""Does the cost model predict what the runtime does? ``planner validate`` over many plans.

Plain script (a few minutes on 2 shared cores)::

    .venv/bin/python benchmarks/bench_validate.py [--profile profile.json | --quick-calibrate]
        [--steps 6] [--plans dp2-z0,pp2-m4,...] [--repeats 1] [--json out.json] [--strict]

What it does
------------
1. Calibrates this machine once (``planner calibrate --nproc 2``), unless ``--profile`` names
   an existing hardware profile.
2. Plans one small built-in GPT (4 blocks x 256, 4 heads, vocab 8192, sequence 128, global batch
   16, fp32) for 2 local processes under each strategy of :data:`PLANS`, pinning every decision
   (``--dp --tp --pp --zero-stage --micro-batch --checkpoint``) so the plans really differ.
3. Runs ``planner validate plan.json --nproc 2 --steps K --json`` on each (the steps after two
   warm-up steps are timed; memory and bytes the max over ranks). With ``--repeats R`` each plan
   is validated R times, round-robin over the plans, and the measured step time is the *lower
   quartile* of all R x (K - 2) timed steps pooled (the memory and byte counts are deterministic),
   and so is each communication part's (``validate --json``'s ``step_parts``).

Why the lower quartile: on a shared machine another tenant slows every step for seconds at a time
(a 40-step run of one plan here alternates between spells of ~0.57 s and ~0.80 s steps, with no
steal time reported), and only ever slows it. The cost model describes the machine undisturbed,
and ``planner calibrate`` measures it so (the lower quartile of its repetitions, in rounds spread
over its budget); the benchmark reads the runs the same way. The median of the pooled steps is
printed beside it, so the effect of the choice is in plain view (and each part's median).

Figures
-------
Relative errors are ``|predicted - measured| / measured``. The summary reports the *median*
step-time error over the plans, the Spearman rank correlation between predicted and measured step
times (Pearson correlation of the ranks, ties given their average rank), the *worst* peak-memory
error and the worst comm-bytes error. Targets (issue 7): memory within 5%, Spearman >= 0.9,
median time error <= 15%. The script exits 0 whatever the figures unless ``--strict`` is given,
in which case a missed target exits 1; a plan that fails to plan or train always exits 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a plain script from anywhere

from planner.commands.calibrate import lower_quartile as quartile

PY = sys.executable

#: The model every plan trains (fp32, 2 local processes).
MODEL_ARGS = [
    "--model",
    "gpt",
    "--layers",
    "4",
    "--hidden",
    "256",
    "--heads",
    "4",
    "--vocab",
    "8192",
    "--seq-len",
    "128",
    "--global-batch",
    "16",
    "--dtype",
    "fp32",
    "--gpus",
    "2",
    "--gpus-per-node",
    "2",
]

#: name -> pinned decisions. Global batch 16 over dp ranks: micro-batch x micro-batches = 16 / dp.
PLANS: dict[str, dict] = {
    "dp2-z0": dict(dp=2, tp=1, pp=1, zero=0, mb=8, ckpt="none"),
    "dp2-z1": dict(dp=2, tp=1, pp=1, zero=1, mb=8, ckpt="none"),
    "dp2-z2": dict(dp=2, tp=1, pp=1, zero=2, mb=8, ckpt="none"),
    "dp2-z3": dict(dp=2, tp=1, pp=1, zero=3, mb=8, ckpt="none"),
    "dp2-z0-mb1": dict(dp=2, tp=1, pp=1, zero=0, mb=1, ckpt="none"),
    "dp2-z0-ckpt": dict(dp=2, tp=1, pp=1, zero=0, mb=8, ckpt="all"),
    "dp2-z2-mb2": dict(dp=2, tp=1, pp=1, zero=2, mb=2, ckpt="none"),
    "tp2": dict(dp=1, tp=2, pp=1, zero=0, mb=8, ckpt="none"),
    "tp2-ckpt": dict(dp=1, tp=2, pp=1, zero=0, mb=16, ckpt="all"),
    "pp2-m2": dict(dp=1, tp=1, pp=2, zero=0, mb=8, ckpt="none"),
    "pp2-m4": dict(dp=1, tp=1, pp=2, zero=0, mb=4, ckpt="none"),
}

#: The communication parts whose exposed seconds are compared (issue 26: within 25%).
PARTS = ("dp_comm", "tp_comm")
TARGET_PART = 0.25

TARGET_MEMORY = 0.05
TARGET_SPEARMAN = 0.9
TARGET_TIME = 0.15
KEYS = ("step_time_s", "peak_memory_bytes", "comm_bytes_per_device")


@dataclass
class Row:
    """One plan's predicted and measured figures."""

    name: str
    predicted: dict
    measured: dict
    times: list = field(default_factory=list)
    """Every timed step of every repeat."""
    parts: dict = field(default_factory=dict)
    """``{part: (predicted, measured)}`` seconds of the communication parts (:data:`PARTS`), the
    measured one the lower quartile of the part's per-step seconds pooled over the repeats."""
    part_medians: dict = field(default_factory=dict)
    """``{part: seconds}``: the median over the repeats of ``validate``'s per-part medians (printed beside)."""

    def part_error(self, part: str) -> float | None:
        """``|predicted - measured| / measured`` of a part, None when the plan has none of it."""
        predicted, measured = self.parts.get(part, (0.0, 0.0))
        if predicted <= 0 and measured <= 0:
            return None
        return abs(predicted - measured) / measured if measured else math.inf

    def error(self, key: str) -> float:
        """``|predicted - measured| / measured`` (absolute difference when measured is 0)."""
        p, m = float(self.predicted[key]), float(self.measured[key])
        return abs(p - m) / m if m else abs(p - m)


def ranks(xs: list[float]) -> list[float]:
    """1-based ranks of ``xs``; tied values share the average of the ranks they span."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return r


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rho: the Pearson correlation of the ranks of ``a`` and ``b`` (nan if constant)."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"spearman needs two equal-length lists of >= 2 values (got {len(a)}, {len(b)})")
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    return cov / (va * vb) ** 0.5 if va and vb else float("nan")


def _run(cmd: list[str], timeout: float) -> str:
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stderr[-3000:]}")
    return p.stdout


def calibrate(out: str, quick: bool) -> str:
    cmd = [PY, "-m", "planner", "calibrate", "--nproc", "2", "--out", out] + (["--quick"] if quick else [])
    _run(cmd, timeout=600)
    return out


def profile_line(path: str) -> str:
    """The profile's figures the communication parts move with (a fresh calibration of shared
    cores moves them; a run's errors are read beside them)."""
    with open(path) as f:
        prof = json.load(f)
    return (
        f"profile: sync_overhead {1e3 * (prof.get('sync_overhead_s') or 0.0):.2f} ms/call, "
        f"overlap_slowdown {prof.get('overlap_slowdown', 0.0):.3g}, "
        f"overlap_comm_rate {prof.get('overlap_comm_rate', 1.0):.3g}, "
        f"compute_efficiency {prof.get('compute_efficiency', 1.0):.3g}, "
        f"gemm_in_step_scale {(prof.get('calibration') or {}).get('gemm_in_step_scale', 1.0):.3g}"
    )


def plan_one(name: str, spec: dict, profile: str, workdir: str) -> str:
    """Write ``workdir/<name>.json`` for the pinned strategy ``spec``; returns its path."""
    out = os.path.join(workdir, f"{name}.json")
    cmd = [
        PY,
        "-m",
        "planner",
        "plan",
        *MODEL_ARGS,
        "--hardware",
        profile,
        "--dp",
        str(spec["dp"]),
        "--tp",
        str(spec["tp"]),
        "--pp",
        str(spec["pp"]),
        "--zero-stage",
        str(spec["zero"]),
        "--micro-batch",
        str(spec["mb"]),
        "--checkpoint",
        spec["ckpt"],
        # the plans are what their names say: no 1-bit Adam (the planner picks it for dp2 on a slow
        # link, and the timed steps would then run its full-precision warm-up)
        "--dp-compression",
        "none",
        "--out",
        out,
        "--json",
    ]
    _run(cmd, timeout=300)
    return out


def validate_one(plan: str, steps: int, timeout: float) -> dict:
    """``planner validate plan --nproc 2 --steps K --json``'s object."""
    out = _run(
        [
            PY,
            "-m",
            "planner",
            "validate",
            plan,
            "--nproc",
            "2",
            "--steps",
            str(steps),
            "--json",
            "--timeout",
            str(timeout),
        ],
        timeout=timeout + 60,
    )
    return json.loads(out)


def summarize(rows: list[Row]) -> dict:
    """Median time error, Spearman of step times, worst memory and comm errors (with plan names).

    ``measured["step_time_s"]`` of each row is what the figures judge (the benchmark puts the
    lower quartile of the pooled steps there); the ``*_median`` figures redo the time ones with
    the median of ``times``, and ``median_step_spread`` is how far a plan's steps scatter.
    """
    t_err = [r.error("step_time_s") for r in rows]
    mem = max(rows, key=lambda r: r.error("peak_memory_bytes"))
    com = max(rows, key=lambda r: r.error("comm_bytes_per_device"))
    pred = [r.predicted["step_time_s"] for r in rows]
    rho = spearman(pred, [r.measured["step_time_s"] for r in rows])
    s = {
        "plans": len(rows),
        "median_time_error": statistics.median(t_err),
        "spearman_time": rho,
        "worst_memory_error": mem.error("peak_memory_bytes"),
        "worst_memory_plan": mem.name,
        "worst_comm_error": com.error("comm_bytes_per_device"),
        "worst_comm_plan": com.name,
    }
    part_errors = [(r.part_error(part), f"{r.name} {part}") for r in rows for part in PARTS]
    worst = max(((e, where) for e, where in part_errors if e is not None), default=(0.0, "-"))
    s["worst_part_error"], s["worst_part"] = worst
    s["parts_within_target"] = sum(1 for e, _ in part_errors if e is not None and e <= TARGET_PART)
    s["parts_compared"] = sum(1 for e, _ in part_errors if e is not None)
    s["targets_met"] = bool(
        s["worst_memory_error"] <= TARGET_MEMORY and rho >= TARGET_SPEARMAN and s["median_time_error"] <= TARGET_TIME
    )
    med = [statistics.median(r.times or [r.measured["step_time_s"]]) for r in rows]
    s["spearman_time_median"] = spearman(pred, med)
    s["median_time_error_median"] = statistics.median(abs(p - m) / m for p, m in zip(pred, med))
    s["median_step_spread"] = statistics.median(
        (max(r.times) - min(r.times)) / statistics.median(r.times) for r in rows if r.times
    )
    return s


def print_table(rows: list[Row], summary: dict) -> None:
    mib = 2.0**20
    head = (
        f"{'plan':<13} {'time pred':>9} {'meas':>8} {'err':>6}  {'mem pred MiB':>12} {'meas':>8} {'err':>6}"
        f"  {'comm pred MiB':>13} {'meas':>9} {'err':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        p, m = r.predicted, r.measured
        print(
            f"{r.name:<13} {p['step_time_s']:9.3f} {m['step_time_s']:8.3f} {r.error('step_time_s'):6.1%}  "
            f"{p['peak_memory_bytes'] / mib:12.2f} {m['peak_memory_bytes'] / mib:8.2f} "
            f"{r.error('peak_memory_bytes'):6.2%}  {p['comm_bytes_per_device'] / mib:13.4f} "
            f"{m['comm_bytes_per_device'] / mib:9.4f} {r.error('comm_bytes_per_device'):7.4%}"
        )
    print(f"\n{'plan':<13} {'part':<8} {'pred ms':>8} {'meas ms':>8} {'err':>7} {'median ms':>10}")
    for r in rows:
        for part in PARTS:
            error = r.part_error(part)
            if error is not None:
                predicted, measured = r.parts[part]
                median = r.part_medians.get(part, measured)
                print(
                    f"{r.name:<13} {part:<8} {predicted * 1e3:8.1f} {measured * 1e3:8.1f} {error:7.1%} {median * 1e3:10.1f}"
                )
    s = summary
    print(
        f"communication parts within {TARGET_PART:.0%} of measured: {s['parts_within_target']} of "
        f"{s['parts_compared']} (worst {s['worst_part_error']:.0%}, {s['worst_part']})"
    )
    print(
        f"\nSUMMARY plans={s['plans']} median_time_error={s['median_time_error']:.1%} (target <= "
        f"{TARGET_TIME:.0%}) spearman={s['spearman_time']:.3f} (target >= {TARGET_SPEARMAN}) "
        f"worst_memory_error={s['worst_memory_error']:.2%} [{s['worst_memory_plan']}] (target <= "
        f"{TARGET_MEMORY:.0%}) worst_comm_error={s['worst_comm_error']:.4%} [{s['worst_comm_plan']}] "
        f"targets_met={s['targets_met']}"
    )
    print(
        f"MEDIAN of the pooled steps instead of the lower quartile: spearman={s['spearman_time_median']:.3f} "
        f"median_time_error={s['median_time_error_median']:.1%}; NOISE median (max - min) / median of a "
        f"plan's steps: {s['median_step_spread']:.0%}"
    )


def _measured_part(results: list[dict], part: str) -> float:
    """A part's measured seconds: the lower quartile of its per-step seconds pooled over the
    repeats, as the step time is read (a busy spell of the shared machine lengthens a rank's
    compute, and the other rank's wait for it at the next collective, and never shortens them)."""
    steps = [float(step.get(part, 0.0)) for r in results for step in r.get("step_parts", [])]
    if not steps:  # a validate without per-step parts: the median of its medians
        return statistics.median(float(r["time"]["measured"].get(part, 0.0)) for r in results)
    return quartile(steps)


def run_benchmark(
    profile: str | None,
    plans: list[str],
    steps: int,
    repeats: int,
    quick: bool,
    timeout: float,
    workdir: str,
    log=print,
) -> tuple[list[Row], dict]:
    """Calibrate (unless ``profile``), plan, validate; returns the rows and the summary."""
    if profile is None:
        t0 = time.perf_counter()
        profile = calibrate(os.path.join(workdir, "profile.json"), quick)
        log(f"calibrated {profile} in {time.perf_counter() - t0:.0f} s")
    log(profile_line(profile))
    paths = {name: plan_one(name, PLANS[name], profile, workdir) for name in plans}
    # Repeats go round-robin over the plans, so a busy spell of the shared machine slows several
    # plans a little rather than one plan a lot (that would scramble the rank correlation).
    results: dict[str, list[dict]] = {name: [] for name in plans}
    for rep in range(repeats):
        for name in plans:
            res = validate_one(paths[name], steps, timeout)
            results[name].append(res)
            log(
                f"[{rep + 1}/{repeats}] {name}: predicted {res['predicted']['step_time_s']:.3f} s, "
                f"measured {res['measured']['step_time_s']:.3f} s"
            )
    rows: list[Row] = []
    for name in plans:
        times = [t for r in results[name] for t in r["step_times_s"]]
        first = results[name][0]
        parts = {
            part: (float(first["time"]["predicted"].get(part, 0.0)), _measured_part(results[name], part))
            for part in PARTS
        }
        medians = {
            part: statistics.median(float(r["time"]["measured"].get(part, 0.0)) for r in results[name])
            for part in PARTS
        }
        measured = dict(first["measured"], step_time_s=quartile(times))
        rows.append(Row(name, first["predicted"], measured, times, parts, medians))
    return rows, summarize(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--profile", default=None, help="hardware profile JSON (default: calibrate now)")
    ap.add_argument("--quick-calibrate", action="store_true", help="calibrate with --quick")
    ap.add_argument("--steps", type=int, default=6, help="steps per validate run (first 2 are warm-up)")
    ap.add_argument("--repeats", type=int, default=1, help="validate runs per plan (steps pooled)")
    ap.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated subset of {', '.join(PLANS)}")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per validate run")
    ap.add_argument("--workdir", default=None, help="keep plans and the profile here (default: a temp dir)")
    ap.add_argument("--json", default=None, metavar="OUT.json", help="also write rows and summary here")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    a = ap.parse_args(argv)
    names = [n.strip() for n in a.plans.split(",") if n.strip()]
    unknown = [n for n in names if n not in PLANS]
    if unknown:
        ap.error(f"unknown plan(s) {', '.join(unknown)}; choose from {', '.join(PLANS)}")
    if a.steps < 3:
        ap.error("--steps must be >= 3 (validate drops the first two steps as warm-up)")
    with tempfile.TemporaryDirectory(prefix="bench-validate-") as tmp:
        workdir = a.workdir or tmp
        os.makedirs(workdir, exist_ok=True)
        try:
            rows, summary = run_benchmark(
                a.profile,
                names,
                a.steps,
                a.repeats,
                a.quick_calibrate,
                a.timeout,
                workdir,
                log=lambda s: print(s, file=sys.stderr, flush=True),
            )
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"bench_validate: {e}", file=sys.stderr)
            return 2
    print_table(rows, summary)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump({"rows": [r.__dict__ for r in rows], "summary": summary}, f, indent=2)
    return 1 if a.strict and not summary["targets_met"] else 0


try:
    import pytest
except ImportError:  # pragma: no cover - the script runs without pytest
    pytest = None

if pytest is not None:

    @pytest.mark.slow
    def test_bench_validate_targets(tmp_path):
        """The whole benchmark (minutes): memory within 5% and bytes exact on every plan."""
        rows, s = run_benchmark(None, list(PLANS), 6, 1, True, 300.0, str(tmp_path), log=lambda s: None)
        assert s["worst_memory_error"] <= TARGET_MEMORY, s
        assert s["worst_comm_error"] <= 1e-6, s


if __name__ == "__main__":
    sys.exit(main())
