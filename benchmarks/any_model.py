"""Which HF architectures plan, compile and train under which strategy: the table for a report.

For each tiny architecture of ``tests/fixtures/hf_archs.py`` (handed over as ``file.py:factory``,
the model computing its own loss) and each strategy, it plans with the strategy pinned, trains a
few steps with ``planner train --nproc N`` (gloo) and compares the losses and final parameters
with one process (``tests.helpers.reference_run``). A cell is ``ok``, ``differs`` (trained, not
equal) or the stage that failed with its first line of error.

    .venv/bin/python benchmarks/any_model.py [--archs llama,gemma] [--cases dp2-zero3,tp2,pp2,tp2xpp2]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script from anywhere: the tests' fixtures and helpers
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from cost_models.hardware import load_hardware  # noqa: E402
from planner.frontend.model_analysis import build_layer_table  # noqa: E402
from planner.search.request import PlanRequest  # noqa: E402
from planner.search.solve import solve  # noqa: E402
from tests.e2e.test_train_matrix import EPS, run_case  # noqa: E402
from tests.fixtures.hf_archs import ARCHS  # noqa: E402
from tests.helpers import TESTS, reference_run  # noqa: E402

SPEC = str(Path(TESTS) / "fixtures" / "hf_archs.py")
CASES = {"dp2-zero3": dict(dp=2, zero_stage=3), "tp2": dict(tp=2), "pp2": dict(pp=2), "tp2xpp2": dict(tp=2, pp=2)}


def _first_line(e: BaseException) -> str:
    return (f"{type(e).__name__}: {e}".splitlines() or [""])[0][:110]


def run_cell(table, arch: str, pins: dict, steps: int = 3, seq: int = 8) -> str:
    n = pins.get("dp", 1) * pins.get("tp", 1) * pins.get("pp", 1)
    req = PlanRequest(
        spec=f"{SPEC}:{arch}",
        gpus=n,
        gpus_per_node=n,
        hardware="cpu",
        global_batch=4,
        seq_len=seq,
        dtype="fp32",
        micro_batch=1 if pins.get("pp", 1) > 1 else None,
        **{"dp": 1, "tp": 1, "pp": 1, **pins},
    )
    try:
        plan = solve(req, table, load_hardware("cpu", gpus_per_node=n)).plan
    except Exception as e:
        return "plan: " + _first_line(e)
    with tempfile.TemporaryDirectory() as d:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                losses, params = run_case(Path(d), plan, steps=steps)
        except AssertionError:
            lines = [ln for ln in err.getvalue().splitlines() if "error" in ln.lower()]
            return "train: " + (lines[-1][:110] if lines else "failed")
        except Exception as e:
            return "train: " + _first_line(e)
    ref, ref_params = reference_run(plan, steps, eps=EPS)
    try:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6)
        for name, p in params.items():
            torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=1e-6)
    except AssertionError:
        return "differs"
    return "ok"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args(argv)
    cases = args.cases.split(",")
    print("| arch | " + " | ".join(cases) + " |")
    print("|---" * (len(cases) + 1) + "|")
    for arch in args.archs.split(","):
        try:
            table = build_layer_table(f"{SPEC}:{arch}", batch=1, seq_len=8, dtype="fp32")
            cells = [run_cell(table, arch, CASES[c]) for c in cases]
        except Exception as e:
            cells = ["trace: " + _first_line(e)] * len(cases)
        print(f"| {arch} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
