"""What ``planner plan`` prints: the chosen strategy, its memory and time, and the runners-up.

:func:`render_plan` draws rich tables from a :class:`planner.plan.Plan` (and the hardware
profile for the capacity and peak FLOP/s). Everything shown comes from plan.json's fields, so a
plan loaded from disk renders the same way; given the search's :class:`planner.search.solve.Solution`
it adds a per-stage memory/time column, the solver's counts and why the stages are compiled or not. The one-line "why it lost" of each
runner-up is written by the search (``planner.search.alternatives``) and stored in plan.json.
"""

from __future__ import annotations

import os

from rich.console import Console
from rich.table import Table

from cost_models.comm_cost import axis_placement
from cost_models.hardware import HardwareProfile, ProfileError
from cost_models.run_cost import scale_cost
from planner.plan import TIME_LABELS
from planner.search.solve import Solution
from planner.units import compress_ranges, format_bytes, format_count, format_rate, format_seconds

__all__ = ["render_plan", "rank_layout"]


def rank_layout(
    dp: int, tp: int, pp: int, gpus_per_node: int, link: str = "the intra-node link"
) -> list[tuple[str, str]]:
    """How the mesh ``rank = (pp_i * dp + dp_i) * tp + tp_i`` sits on nodes of ``gpus_per_node``;
    ``link`` names what connects the devices of one node (NVLink on a GPU node, shared memory
    between the processes of a CPU host)."""
    rows = [("mesh", f"rank = (pp_i x {dp} + dp_i) x {tp} + tp_i; node = rank // {gpus_per_node}")]
    for axis, stride, n in (("tp", 1, tp), ("dp", tp, dp), ("pp", dp * tp, pp)):
        if n == 1:
            rows.append((f"{axis.upper()} groups", f"none ({axis}=1)"))
            continue
        pl = axis_placement(axis, dp, tp, pp, gpus_per_node)
        where = (
            f"inside one node ({link})" if pl.nodes == 1 else f"spans {pl.nodes} nodes ({pl.ranks_per_node} per node)"
        )
        rows.append((f"{axis.upper()} groups", f"{n} ranks, stride {stride}: {where}"))
    width = dp * tp
    for k in range(min(pp, 8)):
        a, b = k * width, (k + 1) * width - 1
        na, nb = a // gpus_per_node, b // gpus_per_node
        ranks = f"rank {a}" if a == b else f"ranks {a}-{b}"
        rows.append((f"stage {k}", f"{ranks} on node{'s' if nb > na else ''} {na if na == nb else f'{na}-{nb}'}"))
    if pp > 8:
        rows.append(("...", f"{pp - 8} more stages, {width} ranks each"))
    return rows


def _peak(hw: HardwareProfile | None, dtype: str) -> float | None:
    try:
        return hw.peak(dtype) if hw is not None else None
    except ProfileError:  # a profile without this dtype's peak
        return None


def _money_or_hours(cost: dict) -> str:
    return f"{cost['money']:,.0f}" if cost.get("money") is not None else f"{cost['gpu_hours']:,.0f} GPU-h"


def _render_cost(plan, cost: dict, console: Console) -> None:
    """The run's length and bill (``predicted.cost``), and which part of the step it pays for."""
    priced = cost.get("money") is not None
    ct = Table(title=f"Cost of the run ({format_count(cost['tokens'])} tokens)", title_justify="left")
    ct.add_column("part")
    ct.add_column("money" if priced else "GPU-hours", justify="right")
    ct.add_column("share", justify="right")
    total = cost["money"] if priced else cost["gpu_hours"]
    for k, label in TIME_LABELS.items():
        v = cost["by_part"].get(k, 0.0)
        ct.add_row(label, f"{v:,.0f}" if priced else f"{v:,.1f}", f"{v / total:.1%}" if total else "-")
    steps = cost.get("steps")
    ct.add_row("[bold]run[/bold]", f"[bold]{total:,.0f}[/bold]", "100.0%")
    ct.add_row("steps", f"{steps:,}" if steps is not None else "-", "")
    ct.add_row("days", f"{cost['days']:,.2f}", f"on {plan.hardware.gpus} devices")
    ct.add_row("GPU-hours", f"{cost['gpu_hours']:,.0f}", "")
    console.print(ct)


_TIER = {"none": "device", "cpu": "host memory", "nvme": "NVMe"}
_ON_TIER = {"none": "on the device", "cpu": "in host memory", "nvme": "on NVMe"}


def _offload_text(plan) -> str:
    """One line: where the optimizer state and the parameters live."""
    o, q = plan.offload["optimizer"], plan.offload["params"]
    if o == q == "none":
        return "none (every state on the device)"
    parts = [
        f"optimizer state {_ON_TIER[o]}" + (" (AdamW on the host's cores)" if o != "none" else ""),
        f"parameters {_ON_TIER[q]}" + (" (fetched layer by layer ahead of use)" if q != "none" else ""),
    ]
    return "; ".join(parts)


def _render_placement(plan, hw: HardwareProfile | None, ev, console: Console) -> None:
    """Where each state lives (device / host / NVMe), per device and per node, and the host's and
    drives' capacity; per state kind when the search's evaluation is at hand."""
    ranks = max(1, min(plan.hardware.gpus_per_node, plan.hardware.gpus))
    pred = plan.predicted
    t = Table(
        title=f"Where the state lives ({ranks} device{'s share' if ranks > 1 else ' uses'} each node's host)",
        title_justify="left",
    )
    for col in ("state", "tier", "per device", "per node"):
        t.add_column(col, justify="left" if col in ("state", "tier") else "right")
    gathered = plan.offload["params"] != "none"
    t.add_row(
        "parameters" + (" (gathered layers in flight)" if gathered else ""),
        "device",
        format_bytes(pred.memory["params"]),
        "",
    )
    if plan.offload["optimizer"] == "none":
        t.add_row("optimizer state", "device", format_bytes(pred.memory["optimizer"]), "")
    off = ev.extra.get("offload_bytes") if ev is not None else None
    if off is not None:
        labels = {
            "optimizer": "optimizer (fp32 master, m, v; gradient accumulator)",
            "params": "parameter shards",
            "buffers": "pinned transfer buffers",
        }
        for tier in ("host", "nvme"):
            for kind, v in off[tier].items():
                if v:
                    t.add_row(
                        labels[kind],
                        "host memory" if tier == "host" else "NVMe",
                        format_bytes(v),
                        format_bytes(v * ranks),
                    )
    for tier, key, cap_field in (("host memory", "host", "host_memory_bytes"), ("NVMe", "nvme", "nvme_bytes")):
        v = pred.memory.get(key, 0)
        if not v:
            continue
        cap = getattr(hw, cap_field, None) if hw is not None else None
        t.add_row(
            f"[bold]total in {tier}[/bold]",
            tier,
            format_bytes(v / ranks),
            format_bytes(v) + (f" of {format_bytes(cap)} ({v / cap:.0%})" if cap else ""),
        )
    t.add_row("device peak (most loaded device)", "device", format_bytes(pred.memory["total"]), "")
    console.print(t)


_SCHEDULE_NAMES = {"1f1b": "1F1B", "interleaved": "interleaved 1F1B", "zero-bubble": "zero bubble (ZB-H1)"}


def schedule_text(plan, ev=None) -> str:
    """The pipeline schedule, its bubble and, with the search's evaluation, why: the predicted
    gain over the best plain 1F1B plan (``Evaluation.extra["plain_step_s"]``)."""
    name = _SCHEDULE_NAMES.get(plan.schedule, plan.schedule)
    if plan.virtual_stages > 1:
        name += f", v={plan.virtual_stages} model chunks per rank"
    text = f"{name}, bubble {plan.predicted.bubble_fraction:.1%}"
    plain = ev.extra.get("plain_step_s") if ev is not None else None
    step = plan.predicted.step_time_s
    if plain and plan.schedule != "1f1b":
        gain = plain - step
        how = "faster" if gain >= 0 else "slower"
        text += (
            f": predicted {format_seconds(abs(gain))} ({abs(gain) / plain:.1%}) per step {how} than the best "
            f"plain 1F1B plan ({format_seconds(plain)})"
        )
        if plan.schedule == "interleaved":
            text += f", for {plan.virtual_stages} times the pipeline sends"
        elif plan.schedule == "zero-bubble":
            text += ", weight gradients filling the bubble"
    return text


def render_plan(
    plan, hw: HardwareProfile | None, console: Console | None = None, solution: Solution | None = None
) -> None:
    """Print the plan as rich tables on ``console`` (a new one on stdout when ``None``); with the
    search's ``solution``, per-stage costs and the solver's counts too."""
    console = console or Console()
    ev = solution.evaluation if solution is not None else None
    search = solution.search if solution is not None else None
    names = plan.model.layer_names or [str(i) for i in range(plan.model.layers + 2)]
    cap = hw.memory_bytes if hw is not None else None
    pred = plan.predicted

    head = Table(title=f"Plan for {plan.model.spec}", show_header=False, title_justify="left")
    head.add_column(style="bold")
    head.add_column()
    head.add_row(
        "model", f"{format_count(plan.model.params)} parameters, {plan.model.layers} blocks (+ embedding and head)"
    )
    nodes = -(-plan.hardware.gpus // plan.hardware.gpus_per_node)
    kind = plan.hardware.name
    if hw is not None and kind.endswith(".json") and hw.name:  # a profile file: its own name, and where
        kind = f"{hw.name} from {os.path.basename(kind)}"
    head.add_row(
        "cluster",
        f"{plan.hardware.gpus} x {kind} ("
        + (f"{nodes} nodes of {plan.hardware.gpus_per_node})" if nodes > 1 else "1 node)"),
    )
    head.add_row("batch", f"{plan.global_batch} sequences x {plan.seq_len} tokens, {plan.dtype}")
    head.add_row("degrees", f"dp={plan.dp}  tp={plan.tp}  pp={plan.pp}")
    zero_txt = {
        0: "0 (replicated)",
        1: "1 (optimizer state sharded)",
        2: "2 (+ gradients sharded)",
        3: "3 (+ parameters sharded)",
    }[plan.zero_stage]
    head.add_row("ZeRO stage", zero_txt)
    head.add_row("offload", _offload_text(plan))
    m = plan.num_micro_batches
    head.add_row(
        "micro-batching", f"{m} micro-batch{'es' if m != 1 else ''} of {plan.micro_batch_size} per data-parallel rank"
    )
    if plan.pp > 1:
        head.add_row("schedule", schedule_text(plan, ev))
    if plan.tp > 1:
        head.add_row(
            "sequence parallel",
            "on: norms, residuals and dropout on seq_len / tp positions per rank, "
            "reduce-scatter + all-gather at the tensor-parallel regions' ends"
            if plan.sequence_parallel
            else "off",
        )
    choice = solution.compile if solution is not None else None
    head.add_row("compiled stages", choice.reason() if choice is not None else ("on" if plan.compile else "off"))
    link = f"{hw.intra_node_bandwidth / 1e9:.3g} GB/s link" if hw is not None else "the intra-node link"
    for k, v in rank_layout(plan.dp, plan.tp, plan.pp, plan.hardware.gpus_per_node, link):
        head.add_row(k, v)
    console.print(head)

    st = Table(title="Pipeline stages", title_justify="left")
    for col in ("stage", "layers", "rows", "recomputed"):
        st.add_column(col)
    if ev is not None:
        st.add_column("micro-step", justify="right")
        st.add_column("memory / device", justify="right")
    ck, sel = set(plan.checkpoint_layers), set(plan.selective_layers)
    chunked = plan.virtual_stages > 1
    for k, (a, b) in enumerate(plan.stages):
        rec = [i for i in range(a, b + 1) if i in ck]
        part = [i for i in range(a, b + 1) if i in sel]
        label = f"{k % plan.pp} (chunk {k})" if chunked else str(k)
        recomputed = "; ".join(
            ([f"{len(rec)}: {compress_ranges(rec)}"] if rec else [])
            + ([f"attention core of {len(part)}: {compress_ranges(part)}"] if part else [])
        )
        row = [label, f"{names[a]} .. {names[b]}" if b > a else names[a], f"{a}-{b} ({b - a + 1})", recomputed or "-"]
        if ev is not None and len(ev.stages) == plan.pp:
            if k < plan.pp:  # per pipeline rank: all its chunks (the rank's first chunk's row)
                sc = ev.stages[k]
                row += [format_seconds(sc.micro_step_s), format_bytes(sc.memory["total"])]
            else:
                row += ["", ""]
        st.add_row(*row)
    console.print(st)

    mem = Table(title="Memory per device (most loaded device)", title_justify="left")
    mem.add_column("kind")
    mem.add_column("bytes", justify="right")
    mem.add_column("of capacity", justify="right")
    for k in ("params", "grads", "optimizer", "activations", "total"):
        v = pred.memory[k]
        mem.add_row(k, format_bytes(v), f"{v / cap:.1%}" if cap else "-")
    if cap:
        mem.add_row("capacity", format_bytes(cap), "100.0%")
    console.print(mem)
    if any(v != "none" for v in plan.offload.values()):
        _render_placement(plan, hw, ev, console)

    tt = Table(title="Predicted step time", title_justify="left")
    tt.add_column("part")
    tt.add_column("time", justify="right")
    tt.add_column("share", justify="right")
    for k, label in TIME_LABELS.items():
        v = pred.time[k]
        tt.add_row(label, format_seconds(v), f"{v / pred.step_time_s:.1%}" if pred.step_time_s else "-")
    tt.add_row("[bold]step[/bold]", f"[bold]{format_seconds(pred.step_time_s)}[/bold]", "100.0%")
    tokens = plan.global_batch * plan.seq_len / pred.step_time_s if pred.step_time_s else 0.0
    tt.add_row("tokens / s", f"{tokens:,.0f}", "")
    tt.add_row("TFLOP/s per device", f"{pred.tflops_per_device:.3g}", format_rate(pred.tflops_per_device * 1e12))
    peak = _peak(hw, plan.dtype)
    tt.add_row("MFU", f"{pred.mfu:.1%}", f"of {format_rate(peak)}" if peak else "")
    tt.add_row("bytes sent / device / step", format_bytes(pred.comm_bytes_per_device), "")
    console.print(tt)

    cost = pred.cost
    if cost is not None:
        _render_cost(plan, cost, console)

    if plan.alternatives:
        at = Table(title="Runners-up (why each lost)", title_justify="left")
        offloads = any(v != "none" for a in plan.alternatives + [plan] for v in a.offload.values())
        cols = (
            ["dp", "tp", "pp", "ZeRO", "micro-batch"]
            + (["offload opt/params"] if offloads else [])
            + ["step"]
            + (["run cost"] if cost else [])
            + ["reason"]
        )
        for col in cols:
            at.add_column(col)
        for a in plan.alternatives:
            row = (
                [str(a.dp), str(a.tp), str(a.pp), str(a.zero_stage), str(a.micro_batch_size)]
                + ([f"{a.offload['optimizer']}/{a.offload['params']}"] if offloads else [])
                + [format_seconds(a.step_time_s)]
            )
            if cost:
                alt = scale_cost(cost, a.step_time_s, pred.step_time_s)
                row.append(_money_or_hours(alt))
            at.add_row(*row, a.reason)
        console.print(at)

    line = (
        f"solver {plan.solver.name}: {plan.solver.status}, {plan.solver.candidates} candidates "
        f"in {plan.solver.seconds:.2f} s"
    )
    if search is not None:
        line += (
            f" ({search.solved} ILPs solved, {search.pruned_time} pruned by the time bound, "
            f"{search.pruned_memory} by the memory bound)"
        )
    console.print(line)
    for note in search.notes if search is not None else []:
        console.print(f"note: {note}")
