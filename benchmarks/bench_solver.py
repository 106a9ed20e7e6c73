"""Solver speed: seconds to plan against the number of layers (24..128) and devices (8..4096).

Plain script, not part of the test suite (it takes a minute)::

    .venv/bin/python benchmarks/bench_solver.py            # analytic GPT-3-width tables
    .venv/bin/python benchmarks/bench_solver.py --traced   # tables from torch.export (slower)
    .venv/bin/python benchmarks/bench_solver.py --solver highs --json

Model: GPT-3's width (hidden 12288, 96 heads, vocab 51200), sequence 2048, global batch 1536,
bf16 on a100-80gb nodes of 8, with the number of blocks varied. By default the layer table is
the closed-form one the tests use (``tests.helpers.gpt_table``), so the figures measure
the search and the ILPs, not tracing; ``--traced`` builds the real table through
``planner.frontend.model_analysis`` instead (only the table differs, and it is not timed).

Columns: ``plan_s`` is the whole of :func:`planner.search.solve.solve` (enumeration, candidate
costs, bounds, greedy seeds, ILPs, plan assembly; for an infeasible cluster, the exact least-
memory search behind the error message); ``ilp_s`` the part spent building and solving ILPs.
Target (issue 4): under 5 s for 96 layers on 1024 devices, near-linear growth in layers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

from cost_models.hardware import load_hardware  # noqa: E402
from planner.frontend.model_analysis import build_layer_table  # noqa: E402
from planner.search.request import PlanRequest  # noqa: E402
from planner.search.search_errors import NoFeasiblePlan  # noqa: E402
from planner.search.solve import solve  # noqa: E402
from tests.helpers import gpt_table  # noqa: E402

LAYERS = (24, 48, 96, 128)
GPUS = (8, 64, 256, 1024, 4096)
TARGET_S = 5.0


def table_for(layers: int, traced: bool):
    if traced:
        return build_layer_table("gpt3-175b", layers=layers, seq_len=2048, dtype="bf16")
    return gpt_table(layers=layers, hidden=12288, heads=96, vocab=51200)


def run_one(layers: int, gpus: int, table, solver: str) -> dict:
    hw = load_hardware("a100-80gb", 8)
    req = PlanRequest(
        spec="gpt3-175b",
        gpus=gpus,
        gpus_per_node=8,
        hardware="a100-80gb",
        global_batch=1536,
        seq_len=2048,
        sizes={"layers": layers},
    )
    t0 = time.perf_counter()
    row = {"layers": layers, "gpus": gpus, "solver": solver}
    try:
        solution = solve(req, table, hw, solver=solver)
        plan, s = solution.plan, solution.search
        row.update(
            plan_s=time.perf_counter() - t0,
            ilp_s=s.solver_seconds,
            candidates=s.enumerated,
            ilps=s.solved,
            pruned=s.pruned_time + s.pruned_memory,
            result=f"dp={plan.dp} tp={plan.tp} pp={plan.pp} z{plan.zero_stage} "
            f"mb={plan.micro_batch_size} step={plan.predicted.step_time_s:.2f}s",
        )
    except NoFeasiblePlan as e:
        least = e.least.memory["total"] / 2**30 if e.least else float("nan")
        row.update(
            plan_s=time.perf_counter() - t0,
            ilp_s=float("nan"),
            candidates=0,
            ilps=0,
            pruned=0,
            result=f"no feasible plan (needs {least:.0f} GiB/device)",
        )
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--solver", default="cbc", choices=("cbc", "highs"))
    ap.add_argument("--traced", action="store_true", help="trace the real model for the layer table")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    tables = {L: table_for(L, args.traced) for L in sorted(set(LAYERS) | {96})}
    rows = [run_one(L, 1024, tables[L], args.solver) for L in LAYERS]
    rows += [run_one(96, g, tables[96], args.solver) for g in GPUS if g != 1024]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'layers':>6} {'gpus':>5} {'plan_s':>7} {'ilp_s':>6} {'cands':>5} {'ILPs':>4} {'pruned':>6}  result")
        for r in rows:
            print(
                f"{r['layers']:>6} {r['gpus']:>5} {r['plan_s']:>7.2f} {r['ilp_s']:>6.2f} {r['candidates']:>5} "
                f"{r['ilps']:>4} {r['pruned']:>6}  {r['result']}"
            )
    target = next(r for r in rows if r["layers"] == 96 and r["gpus"] == 1024)
    ok = target["plan_s"] < TARGET_S
    print(
        f"96 layers on 1024 devices: {target['plan_s']:.2f} s ({'meets' if ok else 'MISSES'} the "
        f"{TARGET_S:.0f} s target)",
        file=sys.stderr,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
