"""1-bit Adam against AdamW: bytes per step, step time and the loss curves, side by side.

Part 1 (measured, gloo): the built-in GPT on the learnable synthetic chain tokens, planned with
``planner plan --dp N --zero-stage 0`` twice, once with ``--dp-compression onebit-adam``, and
trained with ``planner train`` on ``N`` local processes from the same seed; the two runs
alternate ``--repeats`` times. It prints each step's loss and bytes sent of both, then the median
step time and bytes per step after the warm-up, their ratios, and the relative gap of the final
loss (the mean of the last ``--tail`` steps; negative when 1-bit Adam ends lower). Exit 1 if 1-bit
Adam's final loss is more than ``--loss-gap`` (3%) above AdamW's or the bytes after the warm-up are
not at least ``--min-bytes-ratio`` (10) times fewer.

Part 2 (planned): GPT 1.3B and 6.7B (GPT-3's shapes) on 4 and 16 nodes of an Ethernet profile,
``planner plan`` (fp16, as the 1-bit Adam paper trained on V100s) with ``--dp-compression none``
and ``onebit-adam`` pinned and free: the predicted step time, the data-parallel part and the bytes
each device sends per step (all parts: tensor-parallel traffic included).

``python benchmarks/bench_compression.py [--nproc 2] [--steps 60 --warmup 10] [--repeats 1]
[--ethernet v100-16gb-eth25,v100-32gb-eth100]``; importable as ``run_benchmark(BenchConfig())``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")

from benchmarks.bench_cli import bench_main  # noqa: E402
from planner.cli import main as planner_main  # noqa: E402
from runtime.training.events import step_lines  # noqa: E402

__all__ = ["BenchConfig", "run_benchmark", "plan_table", "format_report", "main"]

SIDES = ("none", "onebit-adam")
#: GPT-3's shapes (Brown et al. 2020, Table 2.1): layers, width, heads.
GPT_SHAPES = {"gpt-1.3b": (24, 2048, 16), "gpt-6.7b": (32, 4096, 32)}


@dataclass
class BenchConfig:
    """Sizes and measurement of one benchmark run."""

    nproc: int = 2
    steps: int = 60
    warmup: int = 10
    """1-bit Adam's full-precision steps (``--compression-warmup``)."""
    repeats: int = 1
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    vocab: int = 128
    seq_len: int = 32
    per_rank: int = 4
    lr: float = 3e-3
    tail: int = 5
    loss_gap: float = 0.03
    min_bytes_ratio: float = 10.0
    ethernet: str = "v100-16gb-eth25,v100-32gb-eth100"
    """Hardware profiles of part 2 (comma-separated; empty: skip part 2)."""


def _quiet(argv: list[str]) -> int:
    """``planner`` with its report swallowed (its exit status returned)."""
    with contextlib.redirect_stdout(io.StringIO()):
        return planner_main(argv)


def _plan(config: BenchConfig, side: str, out: str) -> None:
    argv = [
        "plan",
        *("--model", "gpt", "--layers", str(config.layers), "--hidden", str(config.hidden)),
        *("--heads", str(config.heads), "--vocab", str(config.vocab), "--seq-len", str(config.seq_len)),
        *("--gpus", str(config.nproc), "--gpus-per-node", str(config.nproc), "--hardware", "cpu"),
        *("--global-batch", str(config.per_rank * config.nproc), "--dtype", "fp32"),
        *("--dp", str(config.nproc), "--tp", "1", "--pp", "1", "--zero-stage", "0", "--micro-batch", "1"),
        *("--dp-compression", side, "--compile", "off", "--out", out),
    ]
    if _quiet(argv) != 0:
        raise RuntimeError(f"planner plan failed for {side}: {' '.join(argv)}")


def _train(config: BenchConfig, plan: str, metrics: str) -> list[dict]:
    argv = [
        *("train", plan, "--nproc", str(config.nproc), "--steps", str(config.steps)),
        *("--metrics", metrics, "--lr", str(config.lr), "--min-lr", str(config.lr), "--no-memory-tracking"),
        *("--compression-warmup", str(config.warmup), "--timeout", "120"),
    ]
    if os.path.exists(metrics):
        os.remove(metrics)
    if _quiet(argv) != 0:
        raise RuntimeError(f"planner train failed: {' '.join(argv)}")
    with open(metrics, encoding="utf-8") as f:
        return step_lines(json.loads(line) for line in f if line.strip())


def measure(config: BenchConfig, log=print) -> dict:
    """Part 1: both sides trained ``repeats`` times, alternating."""
    runs: dict[str, list[list[dict]]] = {side: [] for side in SIDES}
    with tempfile.TemporaryDirectory(prefix="bench-compression-") as folder:
        plans = {side: os.path.join(folder, f"{side}.json") for side in SIDES}
        for side in SIDES:
            _plan(config, side, plans[side])
        for repeat in range(config.repeats):
            for side in SIDES if repeat % 2 == 0 else tuple(reversed(SIDES)):
                log(f"[bench] repeat {repeat + 1}/{config.repeats}: training {side}")
                runs[side].append(_train(config, plans[side], os.path.join(folder, f"{side}.jsonl")))
    after = slice(config.warmup, None)
    sides = {}
    for side, repeats in runs.items():
        first = repeats[0]
        sides[side] = dict(
            losses=[row["loss"] for row in first],
            bytes=[row["comm_bytes"] for row in first],
            median_step_s=statistics.median(row["step_time_s"] for rows in repeats for row in rows[after]),
            bytes_after_warmup=statistics.median(row["comm_bytes"] for row in first[after]),
            final_loss=statistics.fmean(row["loss"] for row in first[-config.tail :]),
        )
    adam, onebit = sides["none"], sides["onebit-adam"]
    return dict(
        sides=sides,
        bytes_ratio=adam["bytes_after_warmup"] / max(onebit["bytes_after_warmup"], 1.0),
        time_ratio=onebit["median_step_s"] / adam["median_step_s"],
        loss_gap=(onebit["final_loss"] - adam["final_loss"]) / adam["final_loss"],
    )


def plan_table(profiles: list[str]) -> list[dict]:
    """Part 2: predicted step, data-parallel time and bytes with and without compression."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-compression-plans-") as folder:
        for profile in profiles:
            for model, (layers, hidden, heads) in GPT_SHAPES.items():
                for nodes in (4, 16):
                    for pin in ("none", "onebit-adam", None):
                        out = os.path.join(folder, "plan.json")
                        argv = [
                            *("plan", "--model", "gpt", "--layers", str(layers), "--hidden", str(hidden)),
                            *("--heads", str(heads), "--vocab", "50257", "--seq-len", "2048", "--dtype", "fp16"),
                            *("--gpus", str(8 * nodes), "--hardware", profile, "--global-batch", "512"),
                            *("--out", out),
                            *(("--dp-compression", pin) if pin else ()),
                        ]
                        if _quiet(argv) != 0:
                            rows.append(dict(profile=profile, model=model, nodes=nodes, pin=pin, error=True))
                            continue
                        with open(out, encoding="utf-8") as f:
                            plan = json.load(f)
                        predicted = plan["predicted"]
                        rows.append(
                            dict(
                                profile=profile,
                                model=model,
                                nodes=nodes,
                                pin=pin or "free",
                                chosen=plan.get("dp_compression", "none"),
                                layout=f"dp{plan['dp']} tp{plan['tp']} pp{plan['pp']} z{plan['zero_stage']}",
                                step_s=predicted["step_time_s"],
                                dp_s=predicted["time"].get("dp_comm", 0.0),
                                bytes=predicted["comm_bytes_per_device"],
                            )
                        )
    return rows


def run_benchmark(config: BenchConfig, log=print) -> dict:
    result = dict(config=asdict(config), measured=measure(config, log))
    profiles = [name for name in config.ethernet.split(",") if name]
    result["plans"] = plan_table(profiles) if profiles else []
    return result


def format_report(result: dict) -> str:
    config, measured = result["config"], result["measured"]
    adam, onebit = measured["sides"]["none"], measured["sides"]["onebit-adam"]
    lines = [
        f"GPT {config['layers']} x {config['hidden']} on {config['nproc']} gloo ranks, "
        f"{config['per_rank']} sequences of {config['seq_len']} per rank, chain tokens, lr {config['lr']}; "
        f"1-bit Adam warm-up {config['warmup']} steps",
        f"{'step':>5s} {'AdamW loss':>11s} {'1-bit loss':>11s} {'AdamW KiB':>10s} {'1-bit KiB':>10s}",
    ]
    for step, (loss_a, loss_b, bytes_a, bytes_b) in enumerate(
        zip(adam["losses"], onebit["losses"], adam["bytes"], onebit["bytes"]), start=1
    ):
        lines.append(f"{step:5d} {loss_a:11.4f} {loss_b:11.4f} {bytes_a / 1024:10.1f} {bytes_b / 1024:10.1f}")
    lines += [
        f"after the warm-up: bytes/step AdamW {adam['bytes_after_warmup'] / 1024:.1f} KiB, 1-bit "
        f"{onebit['bytes_after_warmup'] / 1024:.1f} KiB: {measured['bytes_ratio']:.1f}x fewer "
        f"(target >= {config['min_bytes_ratio']:.0f}x)",
        f"median step after the warm-up: AdamW {adam['median_step_s'] * 1e3:.1f} ms, 1-bit "
        f"{onebit['median_step_s'] * 1e3:.1f} ms (ratio {measured['time_ratio']:.2f})",
        f"final loss (last {config['tail']} steps): AdamW {adam['final_loss']:.4f}, 1-bit {onebit['final_loss']:.4f}: "
        f"1-bit - AdamW {100 * measured['loss_gap']:+.2f}% of AdamW's (target <= +{100 * config['loss_gap']:.0f}%)",
    ]
    if result["plans"]:
        lines += [
            "",
            f"{'profile':20s} {'model':9s} {'nodes':>5s} {'pin':12s} {'chosen':12s} {'layout':18s} "
            f"{'step s':>8s} {'dp s':>8s} {'sent GiB':>8s}",
        ]
        for row in result["plans"]:
            if row.get("error"):
                lines.append(f"{row['profile']:20s} {row['model']:9s} {row['nodes']:5d} {str(row['pin']):12s} refused")
                continue
            lines.append(
                f"{row['profile']:20s} {row['model']:9s} {row['nodes']:5d} {row['pin']:12s} {row['chosen']:12s} "
                f"{row['layout']:18s} {row['step_s']:8.3f} {row['dp_s']:8.3f} {row['bytes'] / 2**30:8.2f}"
            )
    return "\n".join(lines)


def passed(result: dict) -> bool:
    config, measured = result["config"], result["measured"]
    return measured["loss_gap"] <= config["loss_gap"] and measured["bytes_ratio"] >= config["min_bytes_ratio"]


def main(argv=None) -> int:
    return bench_main(argv, BenchConfig, __doc__, run_benchmark, format_report, passed)


try:
    import pytest
except ImportError:  # the script itself does not need pytest
    pytest = None

if pytest is not None:

    @pytest.mark.slow
    @pytest.mark.dist
    def test_benchmark_runs_and_meets_its_targets():
        """A short run: 1-bit Adam sends 10x fewer bytes and its loss stays within 3% of AdamW's."""
        result = run_benchmark(BenchConfig(steps=30, warmup=6, ethernet=""), log=lambda line: None)
        print(format_report(result))
        assert passed(result), result["measured"]


if __name__ == "__main__":
    sys.exit(main())
