"""What ``planner plan`` prints: the chosen strategy, its memory and time, and the runners-up.

:func:`render_plan` draws rich tables from a :class:`planner.plan.Plan` (and the hardware
profile for the capacity and peak FLOP/s). Everything shown comes from plan.json's fields, so a
plan loaded from disk renders the same way; given the search's :class:`planner.search.solve.Solution`
it adds a per-stage memory/time column, the solver's counts and why the stages are compiled or not. The one-line "why it lost" of each
runner-up is written by the search (``planner.search.alternatives``) and stored in plan.json.
"""

from __future__ import annotations

import os
import re

from rich.console import Console
from rich.table import Table

from cost_models.comm_cost import axis_placement
from cost_models.hardware import HardwareProfile, ProfileError
from cost_models.run_cost import SECONDS_PER_DAY, scale_cost
from cost_models.strategy import Evaluation
from planner.plan import TIME_LABELS
from planner.search.expert_search import ExpertSummary
from planner.search.ilp import SearchResult
from planner.search.solve import CompileChoice, Solution
from planner.units import compress_ranges, format_bytes, format_count, format_rate, format_seconds
from runtime.contract.choices import OffloadTier, ScheduleName

__all__ = ["render_plan", "rank_layout"]


def rank_layout(
    dp: int, tp: int, pp: int, gpus_per_node: int, link: str = "the intra-node link", cp: int = 1
) -> list[tuple[str, str]]:
    """How the mesh ``rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i`` sits on nodes of
    ``gpus_per_node`` (``runtime.contract.rank_layout``; without context parallelism, ``cp = 1``,
    the cp terms drop); ``link`` names what connects the devices of one node (NVLink on a GPU
    node, shared memory between the processes of a CPU host)."""
    if cp == 1:
        formula = f"rank = (pp_i x {dp} + dp_i) x {tp} + tp_i"
    else:
        formula = f"rank = ((pp_i x {dp} + dp_i) x {cp} + cp_i) x {tp} + tp_i"
    rows = [("mesh", f"{formula}; node = rank // {gpus_per_node}")]
    axes = [("tp", 1, tp)] + ([("cp", tp, cp)] if cp > 1 else []) + [("dp", tp * cp, dp), ("pp", dp * cp * tp, pp)]
    for axis, stride, size in axes:
        if size == 1:
            rows.append((f"{axis.upper()} groups", f"none ({axis}=1)"))
            continue
        placement = axis_placement(axis, dp, tp, pp, gpus_per_node, cp)
        where = (
            f"inside one node ({link})"
            if placement.nodes == 1
            else f"spans {placement.nodes} nodes ({placement.ranks_per_node} per node)"
        )
        rows.append((f"{axis.upper()} groups", f"{size} ranks, stride {stride}: {where}"))
    width = dp * cp * tp
    for k in range(min(pp, 8)):
        first_rank, last_rank = k * width, (k + 1) * width - 1
        first_node, last_node = first_rank // gpus_per_node, last_rank // gpus_per_node
        ranks = f"rank {first_rank}" if first_rank == last_rank else f"ranks {first_rank}-{last_rank}"
        nodes = first_node if first_node == last_node else f"{first_node}-{last_node}"
        rows.append(
            (
                f"stage {k}",
                f"{ranks} on node{'s' if last_node > first_node else ''} {nodes}",
            )
        )
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
    table = Table(title=f"Cost of the run ({format_count(cost['tokens'])} tokens)", title_justify="left")
    table.add_column("part")
    table.add_column("money" if priced else "GPU-hours", justify="right")
    table.add_column("share", justify="right")
    total = cost["money"] if priced else cost["gpu_hours"]
    for part, label in TIME_LABELS.items():
        amount = cost["by_part"].get(part, 0.0)
        table.add_row(
            label, f"{amount:,.0f}" if priced else f"{amount:,.1f}", f"{amount / total:.1%}" if total else "-"
        )
    steps = cost.get("steps")
    table.add_row("[bold]run[/bold]", f"[bold]{total:,.0f}[/bold]", "100.0%")
    table.add_row("steps", f"{steps:,}" if steps is not None else "-", "")
    table.add_row("days", f"{cost['days']:,.2f}", f"on {plan.hardware.gpus} devices")
    table.add_row("GPU-hours", f"{cost['gpu_hours']:,.0f}", "")
    console.print(table)


_ON_TIER = {OffloadTier.NONE: "on the device", OffloadTier.CPU: "in host memory", OffloadTier.NVME: "on NVMe"}


def _offload_text(plan) -> str:
    """One line: where the optimizer state and the parameters live."""
    optimizer_tier, params_tier = plan.offload["optimizer"], plan.offload["params"]
    if optimizer_tier == params_tier == OffloadTier.NONE:
        return "none (every state on the device)"
    parts = [
        f"optimizer state {_ON_TIER[optimizer_tier]}"
        + (" (AdamW on the host's cores)" if optimizer_tier != OffloadTier.NONE else ""),
        f"parameters {_ON_TIER[params_tier]}"
        + (" (fetched layer by layer ahead of use)" if params_tier != OffloadTier.NONE else ""),
    ]
    return "; ".join(parts)


def _render_placement(plan, hw: HardwareProfile | None, evaluation, console: Console) -> None:
    """Where each state lives (device / host / NVMe), per device and per node, and the host's and
    drives' capacity; per state kind when the search's evaluation is at hand."""
    ranks = max(1, min(plan.hardware.gpus_per_node, plan.hardware.gpus))
    pred = plan.predicted
    table = Table(
        title=f"Where the state lives ({ranks} device{'s share' if ranks > 1 else ' uses'} each node's host)",
        title_justify="left",
    )
    for column in ("state", "tier", "per device", "per node"):
        table.add_column(column, justify="left" if column in ("state", "tier") else "right")
    gathered = plan.offload["params"] != OffloadTier.NONE
    table.add_row(
        "parameters" + (" (gathered layers in flight)" if gathered else ""),
        "device",
        format_bytes(pred.memory["params"]),
        "",
    )
    if plan.offload["optimizer"] == OffloadTier.NONE:
        table.add_row("optimizer state", "device", format_bytes(pred.memory["optimizer"]), "")
    offloaded = evaluation.extra.get("offload_bytes") if evaluation is not None else None
    if offloaded is not None:
        on_nvme = plan.offload["optimizer"] == OffloadTier.NVME  # the host keeps only the accumulator
        labels = {
            ("host", "optimizer"): (
                "gradient accumulator (fp32)" if on_nvme else "optimizer (fp32 master, m, v; gradient accumulator)"
            ),
            ("nvme", "optimizer"): "optimizer (fp32 master, m, v)",
            ("host", "params"): "parameter shards",
            ("nvme", "params"): "parameter shards",
            ("host", "buffers"): "pinned transfer buffers",
        }
        for tier in ("host", "nvme"):
            for kind, size in offloaded[tier].items():
                if size:
                    table.add_row(
                        labels[(tier, kind)],
                        "host memory" if tier == "host" else "NVMe",
                        format_bytes(size),
                        format_bytes(size * ranks),
                    )
    for tier, key, cap_field in (("host memory", "host", "host_memory_bytes"), ("NVMe", "nvme", "nvme_bytes")):
        size = pred.memory.get(key, 0)
        if not size:
            continue
        capacity = getattr(hw, cap_field, None) if hw is not None else None
        table.add_row(
            f"[bold]total in {tier}[/bold]",
            tier,
            format_bytes(size / ranks),
            format_bytes(size) + (f" of {format_bytes(capacity)} ({size / capacity:.0%})" if capacity else ""),
        )
    table.add_row("device peak (most loaded device)", "device", format_bytes(pred.memory["total"]), "")
    console.print(table)


_SCHEDULE_NAMES = {
    ScheduleName.ONE_F_ONE_B: "1F1B",
    ScheduleName.INTERLEAVED: "interleaved 1F1B",
    ScheduleName.ZERO_BUBBLE: "zero bubble (ZB-H1)",
}


def schedule_text(plan, evaluation: Evaluation | None = None) -> str:
    """The pipeline schedule, its bubble and, with the search's evaluation, why: the predicted
    gain over the best plain 1F1B plan (``Evaluation.extra["plain_step_s"]``)."""
    name = _SCHEDULE_NAMES.get(plan.schedule, plan.schedule)
    if plan.virtual_stages > 1:
        name += f", v={plan.virtual_stages} model chunks per rank"
    text = f"{name}, bubble {plan.predicted.bubble_fraction:.1%}" + _transfers_text(plan, evaluation)
    plain = evaluation.extra.get("plain_step_s") if evaluation is not None else None
    step = plan.predicted.step_time_s
    if plain and plan.schedule != ScheduleName.ONE_F_ONE_B:
        gain = plain - step
        how = "faster" if gain >= 0 else "slower"
        text += (
            f": predicted {format_seconds(abs(gain))} ({abs(gain) / plain:.1%}) per step {how} than the best "
            f"plain 1F1B plan ({format_seconds(plain)})"
        )
        if plan.schedule == ScheduleName.INTERLEAVED:
            text += f", for {plan.virtual_stages} times the pipeline sends"
        elif plan.schedule == ScheduleName.ZERO_BUBBLE:
            text += ", weight gradients filling the bubble"
    return text


def _transfers_text(plan, evaluation: Evaluation | None) -> str:
    """``, stage transfers X per step (...)`` when the slowest stage's sends are a visible share of
    the "pipeline bubble + stage transfers" part: that part is then mostly the pipeline's own
    activations and gradients on a slow link, not idle time (the bubble above counts idle time)."""
    if evaluation is None or plan.pp < 2 or not evaluation.stages:
        return ""
    stage = evaluation.stages[evaluation.bottleneck_stage]
    sends = plan.num_micro_batches * stage.p2p_s
    part = plan.predicted.time.get("pp_bubble", 0.0)
    if part <= 0 or sends < 0.1 * part:
        return ""
    return (
        f", stage transfers {format_seconds(sends)} per step ({plan.num_micro_batches} micro-batches x "
        f"{format_seconds(stage.p2p_s)} of sends on the slowest stage; {sends / part:.0%} of the bubble + transfers part)"
    )


def render_plan(
    plan, hw: HardwareProfile | None, console: Console | None = None, solution: Solution | None = None
) -> None:
    """Print the plan as rich tables on ``console`` (a new one on stdout when ``None``); with the
    search's ``solution``, per-stage costs and the solver's counts too."""
    console = console or Console()
    evaluation = solution.evaluation if solution is not None else None
    search = solution.search if solution is not None else None
    choice = solution.compile if solution is not None else None
    head = _head_table(plan, hw, evaluation, choice)
    line = _compression_line(plan, solution)
    if line is not None:
        head.add_row("DP compression", line)
    console.print(head)
    console.print(_stages_table(plan, evaluation))
    console.print(_memory_table(plan, hw))
    if any(tier != OffloadTier.NONE for tier in plan.offload.values()):
        _render_placement(plan, hw, evaluation, console)
    console.print(_time_table(plan, hw, solution.experts if solution is not None else None))
    if plan.predicted.compression is not None:
        console.print(_compression_table(plan))
    cost = plan.predicted.cost
    if cost is not None:
        _render_cost(plan, cost, console)
    if plan.alternatives:
        # on a narrow terminal a reason column would wrap each runner-up over a dozen lines
        inline = console.width >= WIDE_REPORT
        console.print(_runners_up_table(plan, cost, inline))
        for k, alt in enumerate([] if inline else plan.alternatives, 1):
            console.print(f"{k}. {alt.reason}", markup=False, highlight=False)
    _render_solver(plan, search, console)


_ZERO_TEXT = {
    0: "0 (replicated)",
    1: "1 (optimizer state sharded)",
    2: "2 (+ gradients sharded)",
    3: "3 (+ parameters sharded)",
}


def _head_table(plan, hw: HardwareProfile | None, evaluation: Evaluation | None, choice: CompileChoice | None) -> Table:
    """The strategy in words: model, cluster, batch, degrees, ZeRO, offload, micro-batching,
    schedule, sequence parallelism, compilation and where the ranks sit."""
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
    head.add_row(
        "degrees",
        f"dp={plan.dp}  tp={plan.tp}  pp={plan.pp}"
        + (f"  ep={plan.expert_parallel}" if plan.model.moe else "")
        + (f"  cp={plan.cp}" if plan.cp > 1 else ""),
    )
    if plan.cp > 1:
        head.add_row("context parallel", context_text(plan))
    if plan.model.moe:
        head.add_row("experts", experts_text(plan))
    head.add_row("ZeRO stage", _ZERO_TEXT[plan.zero_stage])
    head.add_row("offload", _offload_text(plan))
    micro_batches = plan.num_micro_batches
    head.add_row(
        "micro-batching",
        f"{micro_batches} micro-batch{'es' if micro_batches != 1 else ''} of {plan.micro_batch_size} "
        "per data-parallel rank",
    )
    if plan.pp > 1:
        head.add_row("schedule", schedule_text(plan, evaluation))
    if plan.tp > 1:
        head.add_row(
            "sequence parallel",
            "on: norms, residuals and dropout on seq_len / tp positions per rank, "
            "reduce-scatter + all-gather at the tensor-parallel regions' ends"
            if plan.sequence_parallel
            else "off",
        )
    head.add_row("compiled stages", choice.reason() if choice is not None else ("on" if plan.compile else "off"))
    link = f"{hw.intra_node_bandwidth / 1e9:.3g} GB/s link" if hw is not None else "the intra-node link"
    for label, text in rank_layout(plan.dp, plan.tp, plan.pp, plan.hardware.gpus_per_node, link, plan.cp):
        head.add_row(label, text)
    return head


_CONTEXT_METHOD_TEXT = {
    "ring": "key/value blocks passed round the group, each transfer beside a block's attention",
    "all-gather": "keys and values all-gathered whole once per layer, their gradients reduce-scattered",
    "ulysses": "heads exchanged for positions by four all-to-alls per layer (each rank attends with heads / cp)",
}


def context_text(plan) -> str:
    """The context-parallel split in words: the chunks each rank holds and how attention is exchanged."""
    cp, method = plan.cp, plan.context_parallel["method"]
    return (
        f"cp={cp}, {method}: each rank holds chunks i and {2 * cp - 1}-i of {2 * cp} of every sequence "
        f"({plan.seq_len // cp:,} positions); {_CONTEXT_METHOD_TEXT[method]}; gradients and ZeRO over "
        f"dp x cp = {plan.dp * cp} ranks"
    )


def _stages_table(plan, evaluation: Evaluation | None) -> Table:
    """One row per pipeline stage (per pipeline rank when interleaved, with the rank's model
    chunks): its layers, what they recompute and, with the search's evaluation, its micro-step and
    memory (both per rank)."""
    names = plan.model.layer_names or [str(i) for i in range(plan.model.layers + 2)]
    table = Table(title="Pipeline stages", title_justify="left")
    chunked = len(plan.stages) > plan.pp
    for column in ("stage", "layers", "rows of its chunks" if chunked else "rows", "recomputed"):
        # a narrow column folds the layer names rather than cutting them to "model.…"
        table.add_column(column, overflow="fold" if column == "layers" else "ellipsis")
    if evaluation is not None:
        table.add_column("micro-step", justify="right")
        table.add_column("memory / device", justify="right")
    checkpointed, selective = set(plan.checkpoint_layers), set(plan.selective_layers)
    per_rank = evaluation is not None and len(evaluation.stages) == plan.pp
    for rank in range(plan.pp):
        # interleaved: rank r runs chunks r, r + p, r + 2p, ... (the glossary's "model chunk")
        chunks = list(range(rank, len(plan.stages), plan.pp))
        spans = [plan.stages[chunk] for chunk in chunks]
        indices = [i for first, last in spans for i in range(first, last + 1)]
        whole = [i for i in indices if i in checkpointed]
        cores = [i for i in indices if i in selective]
        recomputed = "; ".join(
            ([f"{len(whole)}: {compress_ranges(whole)}"] if whole else [])
            + ([f"attention core of {len(cores)}: {compress_ranges(cores)}"] if cores else [])
        )
        layers = _chunk_names([f"{names[a]} .. {names[b]}" if b > a else names[a] for a, b in spans])
        rows = _abridged([f"{a}-{b}" if b > a else str(a) for a, b in spans], ", ") + f" ({len(indices)})"
        row = [str(rank), layers, rows, recomputed or "-"]
        if per_rank and evaluation is not None:
            stage_cost = evaluation.stages[rank]
            row += [format_seconds(stage_cost.micro_step_s), format_bytes(stage_cost.memory["total"])]
        elif evaluation is not None:
            row += ["", ""]
        table.add_row(*row)
    return table


def _chunk_names(items: list[str]) -> str:
    """A rank's chunk names, a run of numbered siblings written once: ``model.layers.0``,
    ``model.layers.16``, ``model.layers.32`` -> ``model.layers.{0, 16, 32}``, and ranges of them
    alike: ``model.layers.11 .. model.layers.16``, ``model.layers.23 .. model.layers.28`` ->
    ``model.layers.{11..16, 23..28}`` (abridged)."""
    groups: list[tuple[str, list[str], str]] = []  # (prefix, numbers, the first item as given)
    for item in items:
        span = re.fullmatch(r"([^ ]*?\.)(\d+) \.\. \1(\d+)", item)
        single = re.fullmatch(r"([^ ]*?\.)(\d+)", item)
        prefix, number = (
            (span[1], f"{span[2]}..{span[3]}") if span else (single[1], single[2]) if single else (item, "")
        )
        if number and groups and groups[-1][1] and groups[-1][0] == prefix:
            groups[-1][1].append(number)
        else:
            groups.append((prefix, [number] if number else [], item))
    return "; ".join(
        item if len(numbers) <= 1 else prefix + "{" + _abridged(numbers, ", ") + "}" for prefix, numbers, item in groups
    )


def _abridged(items: list[str], separator: str, keep: int = 4) -> str:
    """``items`` joined, at most ``keep`` of them shown: the first ones, an ellipsis, the last."""
    if len(items) <= keep:
        return separator.join(items)
    return separator.join(items[: keep - 1]) + f"{separator}…{separator}" + items[-1]


def _memory_table(plan, hw: HardwareProfile | None) -> Table:
    """Bytes per device on the most loaded device at its peak, by kind, against the capacity."""
    capacity = hw.memory_bytes if hw is not None else None
    memory = plan.predicted.memory
    caption = None
    if plan.zero_stage >= 2 and memory["grads"] == 0:  # a newcomer would read 0 B as a mistake
        caption = "grads 0 B: the peak comes before any layer's backward has made its ZeRO gradient shard."
    table = Table(
        title="Memory per device (most loaded, at peak)", title_justify="left", caption=caption, caption_justify="left"
    )
    table.add_column("kind")
    table.add_column("bytes", justify="right")
    table.add_column("of capacity", justify="right")
    for kind in ("params", "grads", "optimizer", "activations", "total"):
        size = memory[kind]
        table.add_row(kind, format_bytes(size), f"{size / capacity:.1%}" if capacity else "-")
    if capacity:
        table.add_row("capacity", format_bytes(capacity), "100.0%")
    return table


def _compression_line(plan, solution: Solution | None) -> str | None:
    """The head table's line on 1-bit Adam: only when it was chosen or pinned."""
    choice = solution.compression if solution is not None else None
    if choice is not None:
        return choice.reason()
    if plan.dp_compression != "none":
        return f"{plan.dp_compression} after {plan.compression_warmup:,} full-precision steps"
    return None


def _compression_table(plan) -> Table:
    """A compressed plan's exchange: DP traffic with and without it, the warm-up, its compute."""
    predicted, compression = plan.predicted, plan.predicted.compression
    table = Table(title="1-bit Adam (steady step after the warm-up)", title_justify="left")
    table.add_column("what")
    table.add_column("figure", justify="right")
    table.add_column("note")
    full, compressed = compression["warmup_comm_bytes_per_device"], predicted.comm_bytes_per_device
    exchange = compression["exchange_bytes_per_device"]
    table.add_row(
        "DP exchange / device / step",
        format_bytes(exchange),
        f"signs + scales; {format_bytes(full - compressed + exchange)} in full precision",
    )
    table.add_row("bytes sent / device / step", format_bytes(compressed), f"{format_bytes(full)} in full precision")
    table.add_row("exchange collectives", format_seconds(compression["exchange_s"]), "after backward, not overlapped")
    table.add_row(
        "compression compute",
        format_seconds(compression["compute_s"]),
        "memory-bound passes over the fp32 momentum (in the optimizer step)",
    )
    table.add_row("error buffers", format_bytes(compression["error_buffer_bytes"]), "in optimizer memory")
    table.add_row(
        "warm-up",
        f"{plan.compression_warmup:,} steps",
        f"full precision, {format_seconds(compression['warmup_step_time_s'])} per step (15% of the run: "
        "--tokens, else 1,000 steps; planner train --compression-warmup N changes it)",
    )
    return table


def _time_table(plan, hw: HardwareProfile | None, experts: ExpertSummary | None = None) -> Table:
    """The predicted step time by part, the throughput, MFU and bytes sent."""
    predicted = plan.predicted
    step = predicted.step_time_s
    table = Table(title="Predicted step time", title_justify="left")
    table.add_column("part")
    table.add_column("time", justify="right")
    table.add_column("share", justify="right")
    hidden = predicted.hidden
    if any(seconds > 0 for seconds in hidden.values()):
        table.add_column("hidden under compute (not in the step)", justify="right")
    for part, label in TIME_LABELS.items():
        seconds = predicted.time[part]
        row = [label, format_seconds(seconds), f"{seconds / step:.1%}" if step else "-"]
        if len(table.columns) > 3:
            row.append(_hidden_text(hidden.get(part, 0.0), part))
        table.add_row(*row)
    table.add_row("[bold]step[/bold]", f"[bold]{format_seconds(step)}[/bold]", "100.0%")
    tokens = plan.global_batch * plan.seq_len / step if step else 0.0
    table.add_row("tokens / s", f"{tokens:,.0f}", "")
    table.add_row(
        "TFLOP/s per device", f"{predicted.tflops_per_device:.3g}", format_rate(predicted.tflops_per_device * 1e12)
    )
    peak = _peak(hw, plan.dtype)
    table.add_row("MFU", f"{predicted.mfu:.1%}", f"of {format_rate(peak)}" if peak else "")
    table.add_row("bytes sent / device / step", format_bytes(predicted.comm_bytes_per_device), "")
    if plan.model.attention:
        table.add_row("attention", *attention_line(plan))
    for label, value, note in expert_rows(plan, experts):
        table.add_row(label, value, note)
    table.caption = _overlap_caption(plan.overlap)
    return table


def experts_text(plan) -> str:
    """The head's experts line: routed and shared experts, the expert-parallel split, the groups."""
    moe = plan.model.moe
    ep, experts = plan.expert_parallel, moe["experts"]
    routing = "dropless" if moe["capacity_factor"] is None else f"capacity factor {moe['capacity_factor']:g}"
    text = (
        f"{experts} routed (top-{moe['top_k']})"
        + (f" + {moe['shared_experts']} shared" if moe["shared_experts"] else "")
        + f" in {len(moe['layers'])} layers, {routing}; "
    )
    if ep == 1:
        return text + "ep=1: every rank holds every expert"
    return text + (
        f"ep={ep}: {experts // ep} expert{'s' if experts // ep != 1 else ''} per rank, tokens routed by all-to-all among {ep} ranks "
        f"{plan.tp} apart; expert gradients reduced over dp/ep = {plan.dp // ep} ranks"
    )


def expert_rows(plan, experts: ExpertSummary | None) -> list[tuple[str, str, str]]:
    """The time table's MoE rows: tokens per expert, all-to-all bytes, and what an imbalance of 1.2
    would cost (the last two with the search's figures)."""
    moe = plan.model.moe
    if not moe:
        return []
    if experts is None:
        tokens = plan.micro_batch_size * plan.seq_len * moe["top_k"] * plan.expert_parallel / moe["experts"]
        return [("tokens / expert / micro-batch", f"{tokens:,.0f}", "even routing")]
    rows = [
        (
            "tokens / expert / micro-batch",
            f"{experts.tokens_per_expert:,.0f}",
            f"imbalance {experts.imbalance:g}" if experts.imbalance != 1.0 else "even routing",
        ),
        (
            "all-to-all bytes / device / step",
            format_bytes(experts.all_to_all_bytes),
            format_seconds(experts.all_to_all_s),
        ),
    ]
    if experts.imbalanced_step_s is not None:
        extra = experts.imbalanced_step_s - experts.step_s
        rows.append(
            (
                "at imbalance 1.2",
                f"+{format_seconds(extra)}",
                f"+{extra / experts.step_s:.1%} per step" if experts.step_s else "",
            )
        )
    return rows


def attention_line(plan) -> tuple[str, str]:
    """The attention's mask and what it saves: ``(mask, window and density; seconds vs full)``.
    The seconds are the model FLOPs the mask leaves out (``model.attention.saved_flops``) at the
    step's own rate (``flops_per_step / step_time_s``): an estimate, exact for a step that is all
    compute."""
    attention = plan.model.attention
    kind, window = attention["mask"], attention.get("window")
    what = f"{kind}{f' window {window:,}' if window else ''}, density {attention['density']:.3g}"
    if len(attention.get("per_layer") or ()) > 0:
        what += " (mean of mixed blocks)"
    rate = plan.model.flops_per_step / plan.predicted.step_time_s if plan.predicted.step_time_s else 0.0
    seconds = attention.get("saved_flops", 0.0) / rate if rate else 0.0
    if kind == "full":
        return what, "the whole square"
    if attention.get("priced"):  # a reason here says how (an explicit causal mask lowered to is_causal)
        how = f" ({attention['reason']})" if attention.get("reason") else ""
        return what, f"saves {format_seconds(seconds)} per step vs full{how}"
    reason = attention.get("reason") or "the kernel computes the whole square"
    return what, f"priced full ({reason}); a kernel that skips would save {format_seconds(seconds)}"


#: Where each part's hidden communication runs (``cost_models.overlap_cost``).
_HIDDEN_UNDER = {
    "dp_comm": "under forward and backward",
    "tp_comm": "under the layers' matmuls",
    "recompute": "under the recomputed matmuls",
}


def _hidden_text(seconds: float, part: str) -> str:
    """``0.31 s under backward``: a part's communication hidden under compute (blank when none)."""
    if seconds <= 0:
        return ""
    return f"{format_seconds(seconds)} {_HIDDEN_UNDER.get(part, 'under compute')}"


def _overlap_caption(overlap: dict) -> str:
    """What the price assumed the run overlaps (plan.json ``overlap``)."""
    on = [kind for kind, enabled in overlap.items() if enabled]
    if not on:
        return "Priced with no overlap (train --overlap off): every collective waited where it is issued."
    if len(on) == len(overlap):
        return (
            "Priced with communication overlapped with compute (train --overlap on): each part is its "
            "exposed time; plan --overlap off prices a run without."
        )
    return f"Priced with overlap of {', '.join(on)} traffic only."


WIDE_REPORT = 120
"""Console columns from which the runners-up table holds its reasons (else numbered lines below it)."""


def _runners_up_table(plan, cost: dict | None, inline: bool = True) -> Table:
    """The runners-up, each with its step (and run cost) and, ``inline``, why it lost (else
    numbered, for the reasons printed below the table)."""
    table = Table(title="Runners-up (why each lost" + ("" if inline else ": below") + ")", title_justify="left")
    offloads = any(tier != OffloadTier.NONE for alt in plan.alternatives + [plan] for tier in alt.offload.values())
    compresses = any(alt.dp_compression != "none" for alt in plan.alternatives + [plan])
    scheduled = any(alt.schedule != "1f1b" for alt in plan.alternatives + [plan])
    contexts = any(alt.context_parallel["degree"] > 1 for alt in plan.alternatives + [plan])
    columns = (
        ([] if inline else ["#"])
        + ["dp", "tp", "pp"]
        + (["ep"] if plan.model.moe else [])
        + (["cp"] if contexts else [])
        + ["ZeRO", "micro-batch"]
        + (["schedule"] if scheduled else [])
        + (["offload opt/params"] if offloads else [])
        + (["DP exchange"] if compresses else [])
        + ["step"]
        + (["run cost"] if cost else [])
        + (["reason"] if inline else [])
    )
    for column in columns:
        table.add_column(column)
    for k, alt in enumerate(plan.alternatives, 1):
        row = (
            ([] if inline else [str(k)])
            + [str(alt.dp), str(alt.tp), str(alt.pp)]
            + ([str(alt.expert_parallel)] if plan.model.moe else [])
            + ([_short_context(alt.context_parallel)] if contexts else [])
            + [str(alt.zero_stage), str(alt.micro_batch_size)]
            + ([_short_schedule(alt.schedule, alt.virtual_stages)] if scheduled else [])
            + ([f"{alt.offload['optimizer']}/{alt.offload['params']}"] if offloads else [])
            + (["1-bit Adam" if alt.dp_compression != "none" else "full precision"] if compresses else [])
            + [format_seconds(alt.step_time_s)]
        )
        if cost:  # against the winner's mean step over the run (its warm-up included)
            mean_step = cost["days"] * SECONDS_PER_DAY / cost["steps"] if cost.get("steps") else None
            row.append(_money_or_hours(scale_cost(cost, alt.step_time_s, mean_step or plan.predicted.step_time_s)))
        table.add_row(*row, *([alt.reason] if inline else []))
    return table


def _short_context(context: dict) -> str:
    """A runner-up's context parallelism in a narrow column: ``1``, ``2 ring``, ``4 all-gather``."""
    return "1" if context["degree"] == 1 else f"{context['degree']} {context['method']}"


def _short_schedule(schedule: str, virtual_stages: int) -> str:
    """A runner-up's schedule in a narrow column: ``1F1B``, ``interleaved v=4``, ``zero bubble``."""
    if schedule == "interleaved":
        return f"interleaved v={virtual_stages}"
    return "zero bubble" if schedule == "zero-bubble" else "1F1B"


def _render_solver(plan, search: SearchResult | None, console: Console) -> None:
    """The solver's line (with the search's counts when at hand) and the search's notes."""
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
