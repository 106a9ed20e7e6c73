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

import argparse
import json
import os
import sys
from dataclasses import dataclass

from rich import box
from rich.console import Console, JustifyMethod
from rich.table import Table

from cost_models.run_cost import run_cost
from planner.commands.plan_command import (
    check_cost_flags,
    compression_warmup,
    layer_table_for,
    plan_from_request,
    request_from_args,
    with_cost,
)
from planner.errors import UserError
from planner.plan import NO_OFFLOAD, Plan, save_plan
from planner.search.request import PlanRequest
from planner.search.search_errors import NoFeasiblePlan, SearchError
from planner.units import format_count
from runtime.contract.choices import ScheduleName

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
        plan = self.plan
        if plan is None or not plan.predicted.step_time_s:
            return 0.0
        return plan.global_batch * plan.seq_len / plan.predicted.step_time_s


@dataclass
class _Planned:
    """A size of the sweep that has a plan, with the plan and its cost (what the table and the
    plot read)."""

    gpus: int
    plan: Plan
    cost: dict
    tokens_per_s: float


def _planned(rows: list[SweepRow]) -> list[_Planned]:
    return [
        _Planned(row.gpus, row.plan, row.cost, row.tokens_per_s)
        for row in rows
        if row.plan is not None and row.cost is not None
    ]


def _reason(error: Exception) -> str:
    """The first sentence of a search error: what a table cell has room for."""
    text = str(error).strip()
    cut = text.find(". ")
    return text if cut < 0 else text[: cut + 1]


def sweep(args: argparse.Namespace, counts: list[int]) -> list[SweepRow]:
    """Plan every device count of ``counts`` for the request in ``args`` (see the module docstring)."""
    requests: dict[int, PlanRequest] = {}
    errors: dict[int, str] = {}
    for n in counts:
        try:
            requests[n] = request_from_args(args, gpus=n)
        except SearchError as error:  # pins this size cannot honour
            errors[n] = _reason(error)
    if not requests:
        raise UserError(
            "no cluster size of the sweep can be planned: "
            + " ".join(f"{n} GPUs: {reason}" for n, reason in errors.items())
        )
    table = layer_table_for(next(iter(requests.values())))
    rows = []
    for n in counts:
        if n in errors:
            rows.append(SweepRow(gpus=n, error=errors[n]))
            continue
        try:
            solution, _hw = plan_from_request(requests[n], table)
        except (NoFeasiblePlan, SearchError) as error:
            rows.append(SweepRow(gpus=n, error=_reason(error)))
            continue
        rows.append(_priced_row(n, solution.plan, args))
    return rows


def _priced_row(gpus: int, plan: Plan, args: argparse.Namespace) -> SweepRow:
    """The row of a size with a plan: its cost for ``--tokens``, else per ``COST_BASIS_TOKENS``."""
    price = getattr(args, "price_per_gpu_hour", None)
    plan = with_cost(plan, getattr(args, "tokens", None), price)
    predicted = plan.predicted
    cost = predicted.cost or run_cost(
        COST_BASIS_TOKENS,
        plan.global_batch * plan.seq_len,
        predicted.step_time_s,
        predicted.time,
        gpus,
        price,
        warmup=compression_warmup(plan),
    )
    return SweepRow(gpus=gpus, plan=plan, cost=cost)


def sweep_paths(out: str, counts: list[int]) -> dict[int, str]:
    """Where each size's plan goes: ``plan.json`` -> ``plan-64gpus.json`` ..."""
    stem, ext = os.path.splitext(out)
    return {n: f"{stem}-{n}gpus{ext or '.json'}" for n in counts}


_SCHEDULE_MARKS = {ScheduleName.ONE_F_ONE_B: "", ScheduleName.INTERLEAVED: " iv{v}", ScheduleName.ZERO_BUBBLE: " zb"}


def _degrees(plan: Plan) -> str:
    """``dp8 cp2 tp4 pp2 ep8``: the mesh's degrees, whose product is the GPU count (cp and ep when above 1)."""
    cp = plan.context_parallel["degree"]
    return (
        f"dp{plan.dp}"
        + (f" cp{cp}" if cp > 1 else "")
        + f" tp{plan.tp} pp{plan.pp}"
        + (f" ep{plan.expert_parallel}" if plan.expert_parallel > 1 else "")
    )


def _strategy(plan: Plan) -> str:
    """``dp8 cp2 tp4 pp8 ep8 Z1 192x1 iv6 sp rc4 sel8 C off:cpu/nvme``: degrees (:func:`_degrees`),
    ZeRO stage, micro-batches x size, the pipeline schedule (interleaved v, zero bubble), sequence
    parallelism, layers recomputed whole and selectively, compiled stages, offload
    (optimizer/parameters) when any, 1-bit Adam (``1bit``)."""
    recomputed, selective = len(plan.checkpoint_layers), len(plan.selective_layers)
    offload = plan.offload
    return (
        f"{_degrees(plan)} Z{plan.zero_stage} {plan.num_micro_batches}x"
        f"{plan.micro_batch_size}"
        + _SCHEDULE_MARKS[ScheduleName(plan.schedule)].format(v=plan.virtual_stages)
        + (" sp" if plan.sequence_parallel else "")
        + (f" rc{recomputed}" if recomputed else "")
        + (f" sel{selective}" if selective else "")
        + (" C" if plan.compile else "")
        + (f" off:{offload['optimizer']}/{offload['params']}" if offload != NO_OFFLOAD else "")
        + (" 1bit" if plan.dp_compression != "none" else "")
    )


def _short(value: float) -> str:
    """A figure for a narrow column: ``498,625`` -> ``499k``; small ones keep two decimals."""
    if abs(value) >= 1e4:
        return format_count(value).replace(" K", "k").replace(" M", "M").replace(" B", "B").replace(" T", "T")
    return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"


#: The comparison table's columns (with a price, ``money`` follows).
_COLUMNS: tuple[tuple[str, JustifyMethod], ...] = (
    ("GPUs", "right"),
    ("strategy", "left"),
    ("tok/s", "right"),
    ("MFU", "right"),
    ("scaling", "right"),
    ("days", "right"),
    ("GPU-h", "right"),
)


def _sweep_table(rows: list[SweepRow], args: argparse.Namespace) -> Table:
    """One row per size: its strategy, speed, scaling against the smallest size with a plan, cost."""
    tokens = getattr(args, "tokens", None)
    price = getattr(args, "price_per_gpu_hour", None)
    title = f"Cluster sizes for {args.model} ({args.hardware}, batch {args.global_batch} x {args.seq_len}" + (
        f", {format_count(tokens)} tokens)" if tokens else "; costs per billion tokens)"
    )
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    for column, justify in _COLUMNS:
        table.add_column(
            column, justify=justify, no_wrap=column != "strategy", min_width=18 if column == "strategy" else None
        )
    if price is not None:
        table.add_column("money", justify="right", no_wrap=True)
    planned = _planned(rows)
    base = planned[0] if planned else None
    by_gpus = {row.gpus: row for row in planned}
    for row in rows:
        if row.gpus not in by_gpus:
            table.add_row(str(row.gpus), f"[red]no plan[/red]: {row.error}", *[""] * (len(table.columns) - 2))
            continue
        done = by_gpus[row.gpus]
        scaling = (
            (done.tokens_per_s / done.gpus) / (base.tokens_per_s / base.gpus) if base and base.tokens_per_s else 0.0
        )
        cells = [
            str(done.gpus),
            _strategy(done.plan),
            _short(done.tokens_per_s),
            f"{done.plan.predicted.mfu:.1%}",
            f"{scaling:.0%}",
            _short(done.cost["days"]),
            _short(done.cost["gpu_hours"]),
        ]
        if price is not None:
            cells.append(_short(done.cost["money"]))
        table.add_row(*cells)
    return table


def render_sweep(rows: list[SweepRow], args: argparse.Namespace, console: Console) -> None:
    """The comparison table, and which size is fastest and which is cheapest."""
    tokens = getattr(args, "tokens", None)
    per = "" if tokens else " / 1B tok"
    console.print(_sweep_table(rows, args))
    console.print(
        "strategy: dp tp pp degrees, ZeRO stage, micro-batches x size, interleaved schedule with v "
        "chunks (ivV) or zero bubble (zb), sequence parallelism (sp), layers recomputed (rc) or their "
        "attention core only (sel), compiled stages (C), offload of optimizer/parameters (off:)."
        + ("" if tokens else " days, GPU-hours and money are per billion tokens (--tokens N for a run).")
    )
    planned = _planned(rows)
    if not planned:
        return
    fastest = min(planned, key=lambda done: done.cost["days"])
    cheapest = min(planned, key=lambda done: done.cost["gpu_hours"])
    console.print(
        f"fastest: {fastest.gpus} GPUs ({fastest.cost['days']:,.2f} days{per}); cheapest: "
        f"{cheapest.gpus} GPUs ({cheapest.cost['gpu_hours']:,.0f} GPU-hours{per}). Scaling is tokens/s "
        f"per device against {planned[0].gpus} GPUs: below 100% each added device buys less than its share."
    )


def plot_sweep(rows: list[SweepRow], path: str, args: argparse.Namespace) -> str:
    """Days and cost (money with a price, else GPU-hours) against the device count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    planned = _planned(rows)
    per = "" if getattr(args, "tokens", None) else " per 1B tokens"
    money = getattr(args, "price_per_gpu_hour", None) is not None
    sizes = [done.gpus for done in planned]
    fig, (days_axes, cost_axes) = plt.subplots(1, 2, figsize=(11, 4.2))
    days_axes.plot(sizes, [done.cost["days"] for done in planned], marker="o", color="#4C78A8")
    days_axes.set_ylabel(f"days{per}")
    key = "money" if money else "gpu_hours"
    cost_axes.plot(sizes, [done.cost[key] for done in planned], marker="o", color="#F58518")
    cost_axes.set_ylabel((f"cost at {args.price_per_gpu_hour:g} per GPU-hour" if money else "GPU-hours") + per)
    cost_axes.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _pos: _short(value)))
    for axes in (days_axes, cost_axes):
        axes.set_xscale("log", base=2)
        axes.set_xticks(sizes, [str(x) for x in sizes])
        axes.set_xlabel("GPUs")
        axes.grid(alpha=0.3)
    for done in planned:
        days_axes.annotate(
            _degrees(done.plan),
            (done.gpus, done.cost["days"]),
            fontsize=7,
            textcoords="offset points",
            xytext=(4, 4),
        )
    fig.suptitle(f"{args.model} on {args.hardware}: time and cost against cluster size")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_sweep(args: argparse.Namespace) -> int:
    """``planner plan --gpus A,B,C ...``: plan each size, write each plan, print the comparison."""
    check_cost_flags(args)
    counts = sorted(args.gpus)
    rows = sweep(args, counts)
    if all(row.plan is None for row in rows):
        raise UserError(
            "no cluster size of the sweep has a plan: " + " ".join(f"{row.gpus} GPUs: {row.error}" for row in rows)
        )
    paths = sweep_paths(args.out, counts)
    for row in rows:
        if row.plan is not None:
            save_plan(row.plan, paths[row.gpus])
    if args.json:
        out = [row.plan.to_dict() if row.plan is not None else {"gpus": row.gpus, "error": row.error} for row in rows]
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
    else:
        console = Console()
        render_sweep(rows, args, console)
        written = [paths[row.gpus] for row in rows if row.plan is not None]
        if written:
            console.print(f"Wrote {', '.join(written)}.")
    if args.plot:
        plot_sweep(rows, args.plot, args)
        if not args.json:
            print(f"Wrote {args.plot}.")
    return 0
