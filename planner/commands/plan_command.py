"""``planner plan``: from the request to the written plan (hardware, layer table, search, report).

The model is traced at micro-batch 1 with symbolic (b, s) costs, so the search substitutes each
candidate micro-batch size instead of tracing again.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from rich.console import Console

from cost_models.hardware import HardwareProfile, load_hardware
from cost_models.run_cost import run_cost
from planner.errors import UserError
from planner.frontend.model_analysis import build_layer_table
from planner.frontend.spec import PRESETS, parse_spec
from planner.plan import Plan, save_plan
from planner.report.plot import plot_plan
from planner.report.render import render_plan
from planner.search.request import PlanRequest
from planner.search.solve import Solution, solve
from runtime.training.train_config import cli_flags

__all__ = [
    "plan_from_request",
    "layer_table_for",
    "model_sizes_for",
    "request_from_args",
    "run_plan",
    "with_cost",
    "check_cost_flags",
    "compression_warmup",
    "SIZE_FLAGS",
]

SIZE_FLAGS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")
"""Model size flags of ``plan`` (``--kv-heads`` is ``kv_heads``)."""


def model_sizes_for(req: PlanRequest) -> dict:
    """Size overrides recorded in the plan: the user's flags, plus a longer position table when
    ``--seq-len`` exceeds what a built-in GPT preset was built for."""
    sizes = dict(req.sizes)
    kind, name = parse_spec(req.spec)
    if kind == "gpt":
        base = PRESETS[name].seq_len if "seq_len" not in sizes else sizes["seq_len"]
        if req.seq_len > base:
            sizes["seq_len"] = req.seq_len
    elif kind == "hf" and req.seq_len > 0:
        sizes.setdefault("seq_len", max(req.seq_len, sizes.get("seq_len", 0)) or req.seq_len)
    return sizes


def layer_table_for(req: PlanRequest):
    """The model's analysed layer table for ``req`` (traced at micro-batch 1 with symbolic sizes:
    it does not depend on the cluster, so a sweep over device counts builds it once). Records
    the size overrides the plan will carry in ``req.sizes``."""
    sizes = model_sizes_for(req)
    flags = dict(sizes)
    positions = flags.pop("seq_len", None)  # the model's position table, not the traced length
    table = build_layer_table(req.spec, batch=1, seq_len=req.seq_len, dtype=req.dtype, positions=positions, **flags)
    req.sizes = sizes
    return table


def plan_from_request(req: PlanRequest, table=None) -> tuple[Solution, HardwareProfile]:
    """The search's solution for a request and the hardware profile it used; every bad input is
    an error of the layer that found it (``ModelError``, ``ProfileError``, ``SearchError`` ...).
    ``table``: the model's layer table when the caller already has it (``layer_table_for``)."""
    hw = load_hardware(req.hardware, gpus_per_node=req.gpus_per_node or None)
    if not req.gpus_per_node:
        req.gpus_per_node = hw.gpus_per_node
    if table is None:
        table = layer_table_for(req)
    else:
        req.sizes = model_sizes_for(req)
    return solve(req, table, hw), hw


def with_cost(plan: Plan, tokens: float | None, price: float | None) -> Plan:
    """``plan`` with ``predicted.cost`` for a run of ``tokens`` tokens (unchanged without them)."""
    if tokens is None:
        return plan
    predicted = plan.predicted
    cost = run_cost(
        tokens,
        plan.global_batch * plan.seq_len,
        predicted.step_time_s,
        predicted.time,
        plan.hardware.gpus,
        price,
        warmup=compression_warmup(plan),
    )
    return replace(plan, predicted=replace(predicted, cost=cost))


def compression_warmup(plan: Plan) -> dict | None:
    """``run_cost``'s ``warmup`` of a compressed plan: its full-precision steps and their price."""
    compression = plan.predicted.compression
    if compression is None or not plan.compression_warmup:
        return None
    return {
        "steps": plan.compression_warmup,
        "step_time_s": compression["warmup_step_time_s"],
        "time": compression["warmup_time"],
    }


def check_cost_flags(args: argparse.Namespace) -> None:
    """A price without a token count prices nothing: say so instead of ignoring it."""
    if getattr(args, "price_per_gpu_hour", None) is not None and getattr(args, "tokens", None) is None:
        raise UserError(
            "--price-per-gpu-hour prices a run, and a run needs its length: add --tokens N "
            "(the tokens it trains on, e.g. --tokens 300e9)."
        )


def request_from_args(args: argparse.Namespace, gpus: int | None = None) -> PlanRequest:
    """The ``plan`` command's flags as a request for ``gpus`` devices (default: the one count
    ``--gpus`` gives; a sweep passes each of its counts). Each ``PlanRequest`` field with a flag
    takes the flag's value (``PlanFlag.setting``); a flag this command lacks keeps the default."""
    sizes = {k: getattr(args, k) for k in SIZE_FLAGS if getattr(args, k, None) is not None}
    if gpus is None:
        counts = args.gpus if isinstance(args.gpus, list) else [args.gpus]
        if len(counts) != 1:
            raise UserError(
                f"--gpus {','.join(map(str, counts))} lists several cluster sizes; this "
                "command plans one: give one count."
            )
        gpus = counts[0]
    settings = {
        setting.name: flag.setting(getattr(args, flag.dest))
        for setting, flag in cli_flags(PlanRequest)
        if setting.name != "gpus" and hasattr(args, flag.dest)
    }
    return PlanRequest(gpus=gpus, sizes=sizes, **settings)


def run_plan(args: argparse.Namespace) -> int:
    """``planner plan ...`` for one cluster size: search, write plan.json, print the report (or
    only the JSON). A list of sizes is ``planner.commands.sweep.run_sweep``."""
    check_cost_flags(args)
    solution, hw = plan_from_request(request_from_args(args))
    plan = with_cost(solution.plan, getattr(args, "tokens", None), getattr(args, "price_per_gpu_hour", None))
    solution = replace(solution, plan=plan)
    save_plan(plan, args.out)
    if args.json:
        sys.stdout.write(plan.to_json())
    else:
        console = Console()
        render_plan(plan, hw, console, solution)
        console.print(f"\nWrote [bold]{args.out}[/bold].")
    if args.plot:
        plot_plan(plan, args.plot, hw=hw, evaluation=solution.evaluation)
        if not args.json:
            print(f"Wrote {args.plot}.")
    return 0
