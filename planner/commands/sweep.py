"""``planner plan --gpus 64,128,256,512``: plan each cluster size and compare them.

The infrastructure lead's question is not "what strategy for 256 GPUs" but "why 256": how much
faster each doubling trains and what it does to the bill. A sweep traces the model once (the
layer table does not depend on the cluster), searches every size with the same request, and
prints one table: the chosen strategy, tokens/s, MFU, scaling efficiency against the
smallest size that fits, and the run's days, GPU-hours and money (for ``--tokens N``; without
it, per billion tokens so the sizes still compare). A size nothing fits, or whose pins it cannot
honour, is a row that says why, not the end of the sweep.

Each plan is written beside ``--out`` with its size in the name (``plan-64gpus.json``); ``--json``
prints a list instead, one plan object per size (``{"gpus": N, "error": ...}`` for a size without
a plan); ``--plot`` draws days and cost against the device count.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

from rich import box
from rich.console import Console
from rich.table import Table

from cost_models.run_cost import run_cost
from planner.commands.plan_command import (
    check_cost_flags,
    layer_table_for,
    plan_from_request,
    request_from_args,
    with_cost,
)
from planner.errors import UserError
from planner.plan import Plan, save_plan
from planner.search.search_errors import NoFeasiblePlan, SearchError
from planner.units import format_count

__all__ = ["SweepRow", "sweep", "run_sweep", "sweep_paths", "plot_sweep", "COST_BASIS_TOKENS"]

#: Tokens the sweep prices when ``--tokens`` is not given: costs are shown per billion tokens.
COST_BASIS_TOKENS = 1e9


@dataclass
class SweepRow:
    """One cluster size of a sweep: its plan, or why it has none."""

    gpus: int
    plan: Plan | None = None
    error: str | None = None
    cost: dict | None = None
    """The run's cost (``cost_models.run_cost``) for ``--tokens``, or per ``COST_BASIS_TOKENS``."""

    @property
    def tokens_per_s(self) -> float:
        p = self.plan
        return p.global_batch * p.seq_len / p.predicted.step_time_s if p and p.predicted.step_time_s else 0.0


def _reason(e: Exception) -> str:
    """The first sentence of a search error: what a table cell has room for."""
    text = str(e).strip()
    cut = text.find(". ")
    return text if cut < 0 else text[: cut + 1]


def sweep(args, counts: list[int]) -> list[SweepRow]:
    """Plan every device count of ``counts`` for the request in ``args`` (see the module docstring)."""
    requests, errors = {}, {}
    for n in counts:
        try:
            requests[n] = request_from_args(args, gpus=n)
        except SearchError as e:  # pins this size cannot honour
            errors[n] = _reason(e)
    if not requests:
        raise UserError(
            "no cluster size of the sweep can be planned: " + " ".join(f"{n} GPUs: {e}" for n, e in errors.items())
        )
    table = layer_table_for(next(iter(requests.values())))
    tokens = getattr(args, "tokens", None)
    price = getattr(args, "price_per_gpu_hour", None)
    rows = []
    for n in counts:
        if n in errors:
            rows.append(SweepRow(gpus=n, error=errors[n]))
            continue
        try:
            solution, _hw = plan_from_request(requests[n], table)
        except (NoFeasiblePlan, SearchError) as e:
            rows.append(SweepRow(gpus=n, error=_reason(e)))
            continue
        plan = with_cost(solution.plan, tokens, price)
        p = plan.predicted
        cost = p.cost or run_cost(COST_BASIS_TOKENS, plan.global_batch * plan.seq_len, p.step_time_s, p.time, n, price)
        rows.append(SweepRow(gpus=n, plan=plan, cost=cost))
    return rows


def sweep_paths(out: str, counts: list[int]) -> dict[int, str]:
    """Where each size's plan goes: ``plan.json`` -> ``plan-64gpus.json`` ..."""
    stem, ext = os.path.splitext(out)
    return {n: f"{stem}-{n}gpus{ext or '.json'}" for n in counts}


_SCHEDULE_MARKS = {"1f1b": "", "interleaved": " iv{v}", "zero-bubble": " zb"}


def _strategy(plan: Plan) -> str:
    """``dp8 tp4 pp8 Z1 192x1 iv6 sp rc4 sel8 C off:cpu/nvme``: degrees, ZeRO stage, micro-batches x
    size, the pipeline schedule (interleaved v, zero bubble), sequence parallelism, layers
    recomputed whole and selectively, compiled stages, offload (optimizer/parameters) when any."""
    ck, sel = len(plan.checkpoint_layers), len(plan.selective_layers)
    off = plan.offload
    return (
        f"dp{plan.dp} tp{plan.tp} pp{plan.pp} Z{plan.zero_stage} {plan.num_micro_batches}x"
        f"{plan.micro_batch_size}"
        + _SCHEDULE_MARKS[plan.schedule].format(v=plan.virtual_stages)
        + (" sp" if plan.sequence_parallel else "")
        + (f" rc{ck}" if ck else "")
        + (f" sel{sel}" if sel else "")
        + (" C" if plan.compile else "")
        + (f" off:{off['optimizer']}/{off['params']}" if off != {"optimizer": "none", "params": "none"} else "")
    )


def _short(v: float) -> str:
    """A figure for a narrow column: ``498,625`` -> ``499k``; small ones keep two decimals."""
    if abs(v) >= 1e4:
        return format_count(v).replace(" K", "k").replace(" M", "M").replace(" B", "B").replace(" T", "T")
    return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"


def render_sweep(rows: list[SweepRow], args, console: Console) -> None:
    """The comparison table, and which size is fastest and which is cheapest."""
    tokens = getattr(args, "tokens", None)
    price = getattr(args, "price_per_gpu_hour", None)
    per = "" if tokens else " / 1B tok"
    title = f"Cluster sizes for {args.model} ({args.hardware}, batch {args.global_batch} x {args.seq_len}" + (
        f", {format_count(tokens)} tokens)" if tokens else "; costs per billion tokens)"
    )
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    for col, just in (
        ("GPUs", "right"),
        ("strategy", "left"),
        ("tok/s", "right"),
        ("MFU", "right"),
        ("scaling", "right"),
        ("days", "right"),
        ("GPU-h", "right"),
    ):
        t.add_column(col, justify=just, no_wrap=col != "strategy", min_width=18 if col == "strategy" else None)
    if price is not None:
        t.add_column("money", justify="right", no_wrap=True)
    ok = [r for r in rows if r.plan is not None]
    base = ok[0] if ok else None
    for r in rows:
        if r.plan is None:
            t.add_row(str(r.gpus), f"[red]no plan[/red]: {r.error}", *[""] * (len(t.columns) - 2))
            continue
        eff = (r.tokens_per_s / r.gpus) / (base.tokens_per_s / base.gpus) if base and base.tokens_per_s else 0.0
        cells = [
            str(r.gpus),
            _strategy(r.plan),
            _short(r.tokens_per_s),
            f"{r.plan.predicted.mfu:.1%}",
            f"{eff:.0%}",
            _short(r.cost["days"]),
            _short(r.cost["gpu_hours"]),
        ]
        if price is not None:
            cells.append(_short(r.cost["money"]))
        t.add_row(*cells)
    console.print(t)
    console.print(
        "strategy: dp tp pp degrees, ZeRO stage, micro-batches x size, interleaved schedule with v "
        "chunks (ivV) or zero bubble (zb), sequence parallelism (sp), layers recomputed (rc) or their "
        "attention core only (sel), compiled stages (C), offload of optimizer/parameters (off:)."
        + ("" if tokens else " days, GPU-hours and money are per billion tokens (--tokens N for a run).")
    )
    if not ok:
        return
    fastest = min(ok, key=lambda r: r.cost["days"])
    cheapest = min(ok, key=lambda r: r.cost["gpu_hours"])
    console.print(
        f"fastest: {fastest.gpus} GPUs ({fastest.cost['days']:,.2f} days{per}); cheapest: "
        f"{cheapest.gpus} GPUs ({cheapest.cost['gpu_hours']:,.0f} GPU-hours{per}). Scaling is tokens/s "
        f"per device against {base.gpus} GPUs: below 100% each added device buys less than its share."
    )


def plot_sweep(rows: list[SweepRow], path: str, args) -> str:
    """Days and cost (money with a price, else GPU-hours) against the device count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    ok = [r for r in rows if r.plan is not None]
    per = "" if getattr(args, "tokens", None) else " per 1B tokens"
    money = getattr(args, "price_per_gpu_hour", None) is not None
    xs = [r.gpus for r in ok]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.plot(xs, [r.cost["days"] for r in ok], marker="o", color="#4C78A8")
    ax1.set_ylabel(f"days{per}")
    key = "money" if money else "gpu_hours"
    ax2.plot(xs, [r.cost[key] for r in ok], marker="o", color="#F58518")
    ax2.set_ylabel((f"cost at {args.price_per_gpu_hour:g} per GPU-hour" if money else "GPU-hours") + per)
    ax2.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _pos: _short(v)))
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("GPUs")
        ax.grid(alpha=0.3)
    for r in ok:
        ax1.annotate(
            f"dp{r.plan.dp} tp{r.plan.tp} pp{r.plan.pp}",
            (r.gpus, r.cost["days"]),
            fontsize=7,
            textcoords="offset points",
            xytext=(4, 4),
        )
    fig.suptitle(f"{args.model} on {args.hardware}: time and cost against cluster size")
    fig.tight_layout()
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_sweep(args) -> int:
    """``planner plan --gpus A,B,C ...``: plan each size, write each plan, print the comparison."""
    check_cost_flags(args)
    counts = sorted(args.gpus)
    rows = sweep(args, counts)
    if all(r.plan is None for r in rows):
        raise UserError(
            "no cluster size of the sweep has a plan: " + " ".join(f"{r.gpus} GPUs: {r.error}" for r in rows)
        )
    paths = sweep_paths(args.out, counts)
    for r in rows:
        if r.plan is not None:
            save_plan(r.plan, paths[r.gpus])
    if args.json:
        out = [r.plan.to_dict() if r.plan is not None else {"gpus": r.gpus, "error": r.error} for r in rows]
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
    else:
        console = Console()
        render_sweep(rows, args, console)
        written = [paths[r.gpus] for r in rows if r.plan is not None]
        if written:
            console.print(f"Wrote {', '.join(written)}.")
    if args.plot:
        plot_sweep(rows, args.plot, args)
        if not args.json:
            print(f"Wrote {args.plot}.")
    return 0
