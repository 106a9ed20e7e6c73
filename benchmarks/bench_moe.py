"""What expert parallelism buys: ep2 vs experts replicated, on 2 local gloo ranks.

Plain script (a minute or two on 2 shared cores)::

    .venv/bin/python benchmarks/bench_moe.py [--steps 6 --warmup 2] [--hidden 128 --ffn 512
        --experts 8 --top-k 2 --seq-len 128 --global-batch 8] [--json out.json]

A Mixtral-shaped model built from ``transformers.MixtralConfig`` (2 blocks; defaults: hidden 128,
expert ffn 512, 8 experts, top 2: the experts hold ~90% of the parameters) is planned by the
planner's own search for 2 CPU ranks with ``dp 2`` pinned, once with ``--ep 1`` (every rank holds
every expert) and once with ``--ep 2`` (each rank holds 4), compiled, and trained ``--steps`` steps
on 2 gloo processes, one side after the other, as ``planner train`` runs it. For each side:

- the step time: the median of ``step_time_s`` over the steps after ``--warmup``;
- the peak memory per rank: ``peak_memory_bytes`` of the metrics (live tensors, max over ranks);
- the bytes one rank sends per step, measured by the runtime's counters (``runtime.distributed.comm``)
  by kind: ``all_to_all`` (the expert dispatch and combine, forward and backward, and the per-expert
  count exchange) and the rest (gradient reductions), next to the planner's predictions
  (``predicted.comm_bytes_per_device``; the all-to-all part from the plan's expert summary,
  ``planner.search.expert_search.ExpertSummary.all_to_all_bytes``).

The planner prices the all-to-all at a balanced router (``--moe-imbalance 1.0``): every rank
sends ``(ep-1)/ep`` of its rows. The measured bytes follow the router's actual choices, so their
ratio to the prediction is the share of rows that crossed ranks over ``(ep-1)/ep``, printed as
such; the row-count exchange (``E`` integers per routed layer and micro-batch) is counted apart.
Exit status 1 when the two sides' losses differ (expert parallelism must not change the math) or
ep2 does not hold fewer expert bytes per rank.

Kept out of CI: a script, not a test (no pytest wrapper).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.bench_cli import bench_main  # noqa: E402

__all__ = ["BenchConfig", "run_benchmark", "format_report", "passed", "main"]


@dataclass
class BenchConfig:
    steps: int = 6
    """Training steps per side (the first ``warmup`` are not timed)."""
    warmup: int = 2
    """Steps left out of the step-time median."""
    hidden: int = 128
    ffn: int = 512
    """Each expert's intermediate size."""
    experts: int = 8
    top_k: int = 2
    seq_len: int = 128
    global_batch: int = 8
    timeout: int = 600
    """Seconds one side's training may take."""


def _model_dir(root: str, config: BenchConfig) -> str:
    import transformers as tf

    path = os.path.join(root, "mixtral")
    tf.MixtralConfig(
        hidden_size=config.hidden,
        intermediate_size=config.ffn,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=config.experts,
        num_experts_per_tok=config.top_k,
        vocab_size=512,
        max_position_embeddings=config.seq_len,
    ).save_pretrained(path)
    return f"hf:{path}"


def _plan(spec: str, config: BenchConfig, ep: int):
    """The planner's plan for 2 CPU ranks with dp 2 and ``ep`` pinned: (plan, predicted all-to-all bytes)."""
    from cost_models.hardware import load_hardware
    from planner.frontend.model_analysis import build_layer_table
    from planner.search.request import PlanRequest
    from planner.search.solve import solve

    request = PlanRequest(
        spec=spec,
        gpus=2,
        gpus_per_node=2,
        hardware="cpu",
        global_batch=config.global_batch,
        seq_len=config.seq_len,
        dtype="fp32",
        dp=2,
        tp=1,
        pp=1,
        zero_stage=0,
        ep=ep,
        micro_batch=config.global_batch // 2,
    )
    table = build_layer_table(spec, batch=1, seq_len=config.seq_len, dtype="fp32")
    solution = solve(request, table, load_hardware("cpu", gpus_per_node=2))
    summary = solution.experts
    return solution.plan, (summary.all_to_all_bytes if summary is not None else 0.0)


def _worker(rank: int, world: int, compiled: str, opts, spec: str, sizes: dict, seq_len: int, out: str) -> None:
    """Train as ``planner train`` does, keeping each step's bytes by kind (the trainer resets the
    counters every step; this records them first)."""
    import functools

    from planner.commands.train import original_state
    from runtime.distributed import comm
    from runtime.training.trainer import train_worker

    steps: list[dict] = []
    reset = comm.STATS.reset

    def keep_then_reset() -> None:
        steps.append(dict(comm.STATS.bytes_by_kind))
        reset()

    comm.STATS.reset = keep_then_reset  # type: ignore[method-assign]
    try:
        train_worker(rank, world, compiled, opts, functools.partial(original_state, spec, sizes, seq_len, opts.seed))
    finally:
        comm.STATS.reset = reset  # type: ignore[method-assign]
    with open(os.path.join(out, f"bytes_rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(steps, f)


def _side(spec: str, config: BenchConfig, ep: int, folder: str, log) -> dict:
    from planner.commands.compile import compile_plan
    from runtime.distributed.launch import launch_local
    from runtime.training.events import read_lines, step_lines
    from runtime.training.train_config import TrainOptions

    plan, predicted_a2a = _plan(spec, config, ep)
    log(f"ep{ep}: planned {plan.dp=} {plan.expert_parallel=} micro-batch {plan.micro_batch_size}; training")
    compiled = os.path.join(folder, "compiled")
    manifest = compile_plan(plan, compiled)
    opts = TrainOptions(
        steps=config.steps, metrics_path=os.path.join(folder, "m.jsonl"), track_memory=True, progress=False
    )
    args = (compiled, opts, plan.model.spec, dict(plan.model.sizes), plan.seq_len, folder)
    launch_local(_worker, 2, args, timeout_s=config.timeout, collective_timeout_s=120)
    rows = step_lines(read_lines(os.path.join(folder, "m.jsonl")))
    timed = rows[config.warmup :] or rows
    per_rank = []
    for rank in range(2):
        with open(os.path.join(folder, f"bytes_rank{rank}.json"), encoding="utf-8") as f:
            per_rank.append(json.load(f))
    # the counters of a step are recorded at the next step's reset (the first reset: before step 1)
    steps_bytes = [s for s in per_rank[0] if s][-len(rows) :]
    a2a = [s.get("all_to_all", 0.0) for s in steps_bytes]
    rest = [sum(v for k, v in s.items() if k != "all_to_all") for s in steps_bytes]
    expert_bytes = sum(  # routed expert weights ([E, ...] in the manifest), fp32, E/ep of them here
        4 * _numel(e["shape"]) // ep for e in manifest["stages"][0]["params"].values() if ".experts." in e["fqn"]
    )
    return {
        "ep": ep,
        "losses": [row["loss"] for row in rows],
        "step_time_s": statistics.median(row["step_time_s"] for row in timed),
        "peak_memory_bytes": max(row["peak_memory_bytes"] for row in rows),
        "expert_bytes_per_rank": expert_bytes,
        "measured_all_to_all_bytes": statistics.median(a2a) if a2a else 0.0,
        "measured_other_bytes": statistics.median(rest) if rest else 0.0,
        "measured_comm_bytes": statistics.median(row["comm_bytes"] for row in rows),
        "predicted_all_to_all_bytes": predicted_a2a,
        "predicted_comm_bytes": plan.predicted.comm_bytes_per_device,
        "predicted_step_time_s": plan.predicted.step_time_s,
        "ep_comm_s": statistics.median(row["time"].get("ep_comm", 0.0) for row in timed),
        "expert_load": statistics.median(row.get("expert_load", 1.0) for row in rows),
    }


def _numel(shape) -> int:
    n = 1
    for size in shape:
        n *= int(size)
    return n


def run_benchmark(config: BenchConfig, log=print) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_moe_") as root:
        spec = _model_dir(root, config)
        sides = {}
        for ep in (1, 2):
            folder = os.path.join(root, f"ep{ep}")
            os.makedirs(folder)
            sides[f"ep{ep}"] = _side(spec, config, ep, folder, log)
    return {"config": vars(config), "sides": sides}


def format_report(result: dict) -> str:
    one, two = result["sides"]["ep1"], result["sides"]["ep2"]
    mib = 1 << 20
    lines = [
        "expert parallelism on 2 gloo ranks (dp 2): experts replicated (ep1) vs split (ep2)",
        f"{'':34}{'ep1':>14}{'ep2':>14}{'ep2/ep1':>10}",
    ]

    def row(name, key, scale=1.0, fmt="{:14.3f}"):
        a, b = one[key] / scale, two[key] / scale
        ratio = f"{b / a:10.2f}" if a else f"{'-':>10}"
        lines.append(f"{name:34}" + fmt.format(a) + fmt.format(b) + ratio)

    row("step time (s, median)", "step_time_s")
    row("peak memory per rank (MiB)", "peak_memory_bytes", mib)
    row("expert weights per rank (MiB)", "expert_bytes_per_rank", mib)
    row("all-to-all bytes/step (measured)", "measured_all_to_all_bytes", 1.0, "{:14.0f}")
    row("all-to-all bytes/step (predicted)", "predicted_all_to_all_bytes", 1.0, "{:14.0f}")
    row("other comm bytes/step (measured)", "measured_other_bytes", 1.0, "{:14.0f}")
    row("comm bytes/step (measured)", "measured_comm_bytes", 1.0, "{:14.0f}")
    row("comm bytes/step (predicted)", "predicted_comm_bytes", 1.0, "{:14.0f}")
    row("ep_comm time (s, median)", "ep_comm_s")
    row("expert load (max/mean)", "expert_load")
    if two["predicted_all_to_all_bytes"]:
        share = two["measured_all_to_all_bytes"] / two["predicted_all_to_all_bytes"]
        lines.append(
            f"measured / predicted all-to-all at ep2: {share:.3f} (the share of rows that crossed ranks "
            "over the balanced router's 1/2, plus the row-count exchange)"
        )
    lines.append(
        f"losses equal: {passed(result)} ({one['losses'][-1]:.6f} vs {two['losses'][-1]:.6f} at the last step)"
    )
    return "\n".join(lines)


def passed(result: dict) -> bool:
    one, two = result["sides"]["ep1"], result["sides"]["ep2"]
    same = all(abs(a - b) <= 1e-5 * max(1.0, abs(a)) for a, b in zip(one["losses"], two["losses"]))
    return same and two["expert_bytes_per_rank"] < one["expert_bytes_per_rank"]


def main(argv=None) -> int:
    return bench_main(argv, BenchConfig, __doc__, run_benchmark, format_report, passed)


if __name__ == "__main__":
    sys.exit(main())
