"""What ``planner plan`` prints: the chosen strategy, its memory and time, and the runners-up.

:func:`render_plan` draws rich tables from a :class:`planner.plan.Plan` (and the hardware
profile for the capacity and peak FLOP/s). Everything shown comes from plan.json's fields, so a
plan loaded from disk renders the same way; a plan fresh from
:func:`planner.search.ilp.plan_strategy` also carries per-stage costs (``plan.evaluation``) and search
statistics (``plan.search``), which add a per-stage memory/time column and the solver's counts.

:func:`alternative_reason` writes the one-line "why it lost" of each alternative: how much slower
it is and the part of the step time (compute, recompute, TP all-reduces, pipeline bubble, DP/ZeRO
traffic, optimizer) that grew the most, with the decision responsible for it.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["render_plan", "alternative_reason", "rank_layout", "format_seconds", "format_bytes",
           "format_count", "format_rate", "compress_ranges", "TIME_LABELS"]

TIME_LABELS = {
    "compute": "compute (forward + backward)",
    "recompute": "recompute (checkpointed layers)",
    "tp_comm": "TP all-reduces",
    "pp_bubble": "pipeline bubble + stage transfers",
    "dp_comm": "DP / ZeRO communication",
    "optimizer": "optimizer step",
}


def format_seconds(x: float) -> str:
    """``0.0123`` -> ``12.3 ms``; ``2.5`` -> ``2.50 s``; ``0`` -> ``0``."""
    if x == 0:
        return "0"
    if x < 1e-3:
        return f"{x * 1e6:.1f} us"
    if x < 1.0:
        return f"{x * 1e3:.1f} ms"
    return f"{x:.2f} s"


def format_count(x: float) -> str:
    """``1.75e11`` -> ``175 B``; ``1.37e5`` -> ``137 K`` (decimal: parameters, FLOP/s)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.0f}"


def format_rate(flops: float) -> str:
    """FLOP/s in the largest unit that keeps the figure above 1: ``3.1e14`` -> ``310 TFLOP/s``."""
    for unit, scale in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if abs(flops) >= scale:
            return f"{flops / scale:.3g} {unit}"
    return f"{flops / 1e6:.3g} MFLOP/s"


def format_bytes(x: float) -> str:
    """Binary units: ``GiB`` above 1 GiB, else ``MiB`` / ``KiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def compress_ranges(indices) -> str:
    """``[1, 2, 3, 7]`` -> ``1-3, 7``."""
    idx = sorted(set(indices))
    out, i = [], 0
    while i < len(idx):
        j = i
        while j + 1 < len(idx) and idx[j + 1] == idx[j] + 1:
            j += 1
        out.append(str(idx[i]) if i == j else f"{idx[i]}-{idx[j]}")
        i = j + 1
    return ", ".join(out)


def _context(part: str, ev) -> str:
    c = ev.strategy.candidate
    if part == "pp_bubble":
        return f"pp={c.pp} with {c.num_micro_batches} micro-batches"
    if part == "tp_comm":
        return f"tp={c.tp}"
    if part == "dp_comm":
        return f"dp={c.dp}, ZeRO-{c.zero_stage}"
    if part == "optimizer":
        return f"ZeRO-{c.zero_stage} {'shards' if c.zero_stage else 'does not shard'} the AdamW step over dp={c.dp}"
    if part == "compute":
        if c.pp > 1:
            a, b = ev.stages[ev.bottleneck_stage].first, ev.stages[ev.bottleneck_stage].last
            return f"its slowest of {c.pp} stages holds rows {a}-{b}"
        return f"tp={c.tp}: work tensor parallelism does not split runs on every device"
    return ""


def alternative_reason(best, alt) -> str:
    """Why ``alt`` (an :class:`~cost_models.strategy.Evaluation`) lost to ``best``, in one line."""
    d = alt.step_time_s - best.step_time_s
    if d <= best.step_time_s * 1e-9:
        mb, ma = best.memory["total"], alt.memory["total"]
        more = "more" if ma > mb else "no less"
        return (f"ties on step time but needs {more} memory ({format_bytes(ma)} vs {format_bytes(mb)} "
                "per device)")
    deltas = {k: alt.time[k] - best.time[k] for k in TIME_LABELS}
    part = max(deltas, key=deltas.get)
    text = (f"{d / best.step_time_s:.1%} slower ({format_seconds(alt.step_time_s)}): "
            f"{TIME_LABELS[part]} {format_seconds(alt.time[part])} vs {format_seconds(best.time[part])}")
    if part == "recompute":
        n = len(alt.strategy.checkpoint)
        text += f" ({n} layer{'s' if n != 1 else ''} recomputed to fit in memory)"
    else:
        ctx = _context(part, alt)
        text += f" ({ctx})" if ctx else ""
    return text


def rank_layout(dp: int, tp: int, pp: int, gpus_per_node: int) -> list[tuple[str, str]]:
    """How the mesh ``rank = (pp_i * dp + dp_i) * tp + tp_i`` sits on nodes of ``gpus_per_node``."""
    from cost_models.comm import axis_placement

    rows = [("mesh", f"rank = (pp_i x {dp} + dp_i) x {tp} + tp_i; node = rank // {gpus_per_node}")]
    for axis, stride, n in (("tp", 1, tp), ("dp", tp, dp), ("pp", dp * tp, pp)):
        if n == 1:
            rows.append((f"{axis.upper()} groups", f"none ({axis}=1)"))
            continue
        pl = axis_placement(axis, dp, tp, pp, gpus_per_node)
        where = ("inside one node (NVLink)" if pl.nodes == 1
                 else f"spans {pl.nodes} nodes ({pl.ranks_per_node} per node)")
        rows.append((f"{axis.upper()} groups", f"{n} ranks, stride {stride}: {where}"))
    width = dp * tp
    for k in range(min(pp, 8)):
        a, b = k * width, (k + 1) * width - 1
        na, nb = a // gpus_per_node, b // gpus_per_node
        rows.append((f"stage {k}", f"ranks {a}-{b} on node{'s' if nb > na else ''} "
                     f"{na if na == nb else f'{na}-{nb}'}"))
    if pp > 8:
        rows.append(("...", f"{pp - 8} more stages, {width} ranks each"))
    return rows


def _peak(hw, dtype: str) -> float | None:
    try:
        return hw.peak(dtype)
    except Exception:
        return None


def render_plan(plan, hw: Any, console: Console | None = None) -> None:
    """Print the plan as rich tables on ``console`` (a new one on stdout when ``None``)."""
    console = console or Console()
    ev = getattr(plan, "evaluation", None)
    search = getattr(plan, "search", None)
    names = plan.model.layer_names or [str(i) for i in range(plan.model.layers + 2)]
    cap = getattr(hw, "memory_bytes", None)
    pred = plan.predicted

    head = Table(title=f"Plan for {plan.model.spec}", show_header=False, title_justify="left")
    head.add_column(style="bold")
    head.add_column()
    head.add_row("model", f"{format_count(plan.model.params)} parameters, {plan.model.layers} blocks "
                 f"(+ embedding and head)")
    nodes = -(-plan.hardware.gpus // plan.hardware.gpus_per_node)
    head.add_row("cluster", f"{plan.hardware.gpus} x {plan.hardware.name} ({nodes} node"
                 f"{'s' if nodes > 1 else ''} of {plan.hardware.gpus_per_node})")
    head.add_row("batch", f"{plan.global_batch} sequences x {plan.seq_len} tokens, {plan.dtype}")
    head.add_row("degrees", f"dp={plan.dp}  tp={plan.tp}  pp={plan.pp}")
    zero_txt = {0: "0 (replicated)", 1: "1 (optimizer state sharded)", 2: "2 (+ gradients sharded)",
                3: "3 (+ parameters sharded)"}[plan.zero_stage]
    head.add_row("ZeRO stage", zero_txt)
    head.add_row("micro-batching", f"{plan.num_micro_batches} micro-batches of {plan.micro_batch_size} "
                 f"per data-parallel rank (1F1B, bubble {pred.bubble_fraction:.1%})")
    for k, v in rank_layout(plan.dp, plan.tp, plan.pp, plan.hardware.gpus_per_node):
        head.add_row(k, v)
    console.print(head)

    st = Table(title="Pipeline stages", title_justify="left")
    for col in ("stage", "layers", "rows", "recomputed"):
        st.add_column(col)
    if ev is not None:
        st.add_column("micro-step", justify="right")
        st.add_column("memory / device", justify="right")
    ck = set(plan.checkpoint_layers)
    for k, (a, b) in enumerate(plan.stages):
        rec = [i for i in range(a, b + 1) if i in ck]
        row = [str(k), f"{names[a]} .. {names[b]}" if b > a else names[a], f"{a}-{b} ({b - a + 1})",
               f"{len(rec)}: {compress_ranges(rec)}" if rec else "-"]
        if ev is not None:
            sc = ev.stages[k]
            row += [format_seconds(sc.micro_step_s), format_bytes(sc.memory["total"])]
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

    if plan.alternatives:
        at = Table(title="Runners-up (why each lost)", title_justify="left")
        for col in ("dp", "tp", "pp", "ZeRO", "micro-batch", "step", "reason"):
            at.add_column(col)
        for a in plan.alternatives:
            at.add_row(str(a.dp), str(a.tp), str(a.pp), str(a.zero_stage), str(a.micro_batch_size),
                       format_seconds(a.step_time_s), a.reason)
        console.print(at)

    line = (f"solver {plan.solver.name}: {plan.solver.status}, {plan.solver.candidates} candidates "
            f"in {plan.solver.seconds:.2f} s")
    if search is not None:
        line += (f" ({search.solved} ILPs solved, {search.pruned_time} pruned by the time bound, "
                 f"{search.pruned_memory} by the memory bound)")
    console.print(line)
    for note in getattr(search, "notes", []):
        console.print(f"note: {note}")
