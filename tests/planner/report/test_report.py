"""What the user sees: the rich report, the Gantt/memory plot and the DeepSpeed export."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest
from rich.console import Console

from cost_models.hardware import load_hardware
from planner.plan import Plan, load_plan, save_plan
from planner.report.deepspeed import launcher_command, to_deepspeed
from planner.report.plot import plot_plan, stage_times
from planner.report.render import _chunk_names, rank_layout, render_plan
from planner.search.alternatives import alternative_reason
from planner.search.request import PlanRequest
from planner.search.solve import solve
from planner.units import compress_ranges, format_bytes, format_seconds
from tests.helpers import gpt_table

HW = load_hardware("a100-80gb", 8)


@pytest.fixture(scope="module")
def solution():
    table = gpt_table(layers=12, hidden=2048, heads=16, vocab=32000)
    req = PlanRequest(
        spec="gpt",
        gpus=32,
        gpus_per_node=8,
        hardware="a100-80gb",
        global_batch=128,
        seq_len=2048,
        pp=4,
        tp=2,
        sizes={"layers": 12},
    )
    return solve(req, table, HW)


@pytest.fixture(scope="module")
def plan(solution):
    return solution.plan


def _render(plan, solution=None) -> str:
    buf = io.StringIO()
    render_plan(plan, HW, Console(file=buf, width=220, color_system=None), solution)
    return buf.getvalue()


def test_report_shows_every_part(solution):
    plan = solution.plan
    out = _render(plan, solution)
    for text in (
        "dp=4  tp=2  pp=4",
        "ZeRO stage",
        f"{plan.num_micro_batches} micro-batches of {plan.micro_batch_size}",
        "Pipeline stages",
        "params",
        "grads",
        "optimizer",
        "activations",
        "capacity",
        "80.00 GiB",
        "compute (forward + backward)",
        "recompute",
        "TP collectives",
        "pipeline bubble",
        "DP / ZeRO communication",
        "optimizer step",
        "tokens / s",
        "TFLOP/s per device",
        "MFU",
        "Runners-up",
        "ILPs solved",
    ):
        assert text in out, text
    assert format_seconds(plan.predicted.step_time_s) in out
    for a in plan.alternatives:
        assert a.reason[:40] in out
    tokens = plan.global_batch * plan.seq_len / plan.predicted.step_time_s
    assert f"{tokens:,.0f}" in out


def test_a_narrow_terminal_numbers_the_runners_up_and_gives_their_reasons_below(solution):
    """At 80 columns a reason column would wrap each runner-up over a dozen lines: the table
    numbers them and each reason follows it on its own (wrapped) line, whole."""
    plan = solution.plan
    assert plan.alternatives
    buf = io.StringIO()
    render_plan(plan, HW, Console(file=buf, width=80, color_system=None), solution)
    out = buf.getvalue()
    below = out[out.index("Runners-up (why each lost: below)") :]
    header = next(line for line in below.splitlines() if "dp" in line and "step" in line)
    assert "# " in header and "reason" not in header
    flat = " ".join(below.split())
    for k, alt in enumerate(plan.alternatives, 1):
        assert f"{k}. {' '.join(alt.reason.split())}" in flat
    assert max(map(len, out.splitlines())) <= 80


def test_report_renders_a_plan_loaded_from_json(plan, tmp_path):
    path = tmp_path / "plan.json"
    save_plan(plan, str(path))
    loaded = load_plan(str(path))
    out = _render(loaded)
    assert "Pipeline stages" in out and "micro-step" not in out  # no per-stage costs on disk
    assert "ILPs solved" not in out and "candidates" in out


def test_rank_layout_maps_ranks_to_nodes():
    rows = dict(rank_layout(dp=4, tp=2, pp=4, gpus_per_node=8, link="NVLink"))
    assert rows["TP groups"] == "2 ranks, stride 1: inside one node (NVLink)"
    assert rows["DP groups"] == "4 ranks, stride 2: inside one node (NVLink)"
    assert rows["PP groups"].startswith("4 ranks, stride 8: spans 4 nodes")
    assert rows["stage 1"] == "ranks 8-15 on node 1"
    rows = dict(rank_layout(dp=16, tp=1, pp=1, gpus_per_node=8))
    assert rows["TP groups"] == "none (tp=1)" and rows["stage 0"] == "ranks 0-15 on nodes 0-1"
    rows = dict(rank_layout(dp=2, tp=2, pp=2, gpus_per_node=8, link="NVLink", cp=4))
    assert rows["mesh"] == "rank = ((pp_i x 2 + dp_i) x 4 + cp_i) x 2 + tp_i; node = rank // 8"
    assert rows["CP groups"] == "4 ranks, stride 2: inside one node (NVLink)"
    assert rows["DP groups"] == "2 ranks, stride 8: spans 2 nodes (1 per node)"
    assert rows["stage 1"] == "ranks 16-31 on nodes 2-3"


def test_report_names_the_link_of_a_cpu_node_not_nvlink(plan):
    out = io.StringIO()
    render_plan(plan, load_hardware("cpu", 8), Console(file=out, width=220, color_system=None))
    assert "NVLink" not in out.getvalue() and "inside one node (2 GB/s link)" in out.getvalue()


def test_alternative_reasons_name_the_part_that_grew(solution):
    best = solution.evaluation
    for alt in solution.search.alternatives(3):
        text = alternative_reason(best, alt)
        pct = (alt.step_time_s - best.step_time_s) / best.step_time_s
        assert text.startswith(f"{pct:.1%} slower") or text.startswith("ties")
    same = alternative_reason(best, best)
    assert same.startswith("ties on step time")


def test_formatting_helpers():
    assert compress_ranges([3, 1, 2, 7, 9, 8]) == "1-3, 7-9"
    assert format_seconds(0.0123) == "12.3 ms" and format_seconds(2.5) == "2.50 s" and format_seconds(0) == "0"
    assert format_bytes(3 * 2**30) == "3.00 GiB" and format_bytes(512) == "512 B"


def test_plot_writes_a_png_with_per_stage_times(solution, tmp_path):
    plan = solution.plan
    fwd, bwd, tail, exact = stage_times(plan, solution.evaluation)
    assert exact and len(fwd) == plan.pp
    for k, st in enumerate(solution.evaluation.stages):
        assert fwd[k] + bwd[k] == pytest.approx(st.micro_step_s)
    out = plot_plan(plan, str(tmp_path / "sub" / "plan.png"), hw=HW, evaluation=solution.evaluation)
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_from_a_loaded_plan_uses_totals(plan, tmp_path):
    loaded = Plan.from_dict(json.loads(plan.to_json()))
    fwd, bwd, tail, exact = stage_times(loaded)
    assert not exact and len(set(fwd)) == 1 and bwd[0] == pytest.approx(2 * fwd[0])
    m, p = loaded.num_micro_batches, loaded.pp
    assert (m + p - 1) * (fwd[0] + bwd[0]) + tail[0] == pytest.approx(loaded.predicted.step_time_s)
    plot_plan(loaded, str(tmp_path / "loaded.png"))
    assert (tmp_path / "loaded.png").stat().st_size > 1000


def test_deepspeed_config_matches_the_plan(plan):
    cfg = to_deepspeed(plan)
    assert cfg["train_batch_size"] == plan.global_batch
    assert cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * plan.dp == plan.global_batch
    assert cfg["gradient_accumulation_steps"] == plan.num_micro_batches
    assert cfg["zero_optimization"]["stage"] == plan.zero_stage
    assert cfg["bf16"]["enabled"] and not cfg["fp16"]["enabled"]
    assert cfg["pipeline"]["stages"] == plan.pp
    assert cfg["planner"]["stage_boundaries"] == plan.stages
    assert cfg["activation_checkpointing"]["number_checkpoints"] == len(plan.checkpoint_layers)
    assert any("Megatron-DeepSpeed" in w for w in cfg["planner"]["warnings"])  # tp = 2
    json.dumps(cfg)  # serializable


def test_deepspeed_flags_zero_with_pipeline_and_fp16(plan):
    p = dataclasses.replace(plan, zero_stage=3, dtype="fp16")
    cfg = to_deepspeed(p)
    assert cfg["fp16"]["enabled"] and cfg["fp16"]["initial_scale_power"] == 16 and not cfg["bf16"]["enabled"]
    assert any("ZeRO stage 0 or 1 only" in w for w in cfg["planner"]["warnings"])


def test_launcher_command(plan):
    cmd = launcher_command(plan, "out/ds_config.json")
    assert cmd == (
        "deepspeed --hostfile hostfile --num_nodes 4 --num_gpus 8 train.py --deepspeed "
        "--deepspeed_config out/ds_config.json --tensor-model-parallel-size 2 "
        "--pipeline-model-parallel-size 4"
    )
    one = dataclasses.replace(
        plan,
        hardware=dataclasses.replace(plan.hardware, gpus=4, gpus_per_node=8),
        dp=4,
        tp=1,
        pp=1,
        stages=[[0, 13]],
        num_micro_batches=32,
        micro_batch_size=1,
    )
    assert launcher_command(one) == (
        "deepspeed --num_nodes 1 --num_gpus 4 train.py --deepspeed --deepspeed_config ds_config.json"
    )


def test_deepspeed_export_of_context_parallelism(plan):
    """Ulysses is DeepSpeed's own sequence parallelism (a launch flag); ring and all-gather are not,
    and the warning names Megatron-Core's equivalent and the pin that makes a DeepSpeed plan."""
    ulysses = dataclasses.replace(
        plan,
        hardware=dataclasses.replace(plan.hardware, gpus=8, gpus_per_node=8),
        dp=1,
        tp=1,
        pp=1,
        stages=[[0, 13]],
        num_micro_batches=plan.global_batch,
        micro_batch_size=1,
        sequence_parallel=False,
        context_parallel={"degree": 8, "method": "ulysses"},
    )
    assert launcher_command(ulysses).endswith(
        "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --ds-sequence-parallel-size 8"
    )
    cfg = to_deepspeed(ulysses)
    assert cfg["planner"]["context_parallel"] == {"degree": 8, "method": "ulysses"}
    assert not any("context" in w or "sequences" in w for w in cfg["planner"]["warnings"])
    ring = dataclasses.replace(ulysses, context_parallel={"degree": 8, "method": "ring"})
    assert "--ds-sequence-parallel-size" not in launcher_command(ring)
    warning = next(w for w in to_deepspeed(ring)["planner"]["warnings"] if "cp=8" in w)
    assert "--context-parallel-size 8 --cp-comm-type p2p" in warning and "--cp-method ulysses" in warning


def test_export_deepspeed_through_the_cli(plan, tmp_path, capsys):
    from planner.cli import main

    path = tmp_path / "plan.json"
    save_plan(plan, str(path))
    out = tmp_path / "ds.json"
    assert main(["export", "deepspeed", str(path), "--out", str(out)]) == 0
    cfg = json.loads(out.read_text())
    assert cfg["train_batch_size"] == plan.global_batch
    assert "deepspeed --hostfile hostfile" in capsys.readouterr().out


def test_report_says_how_much_each_part_hid(plan):
    hidden = plan.predicted.hidden
    assert hidden["dp_comm"] > 0 and hidden["tp_comm"] > 0  # dp 4 and tp 2, overlapped
    out = _render(plan)
    assert "hidden under compute" in out and "Priced with communication overlapped" in out
    assert f"{format_seconds(hidden['dp_comm'])} under forward and backward" in out
    assert f"{format_seconds(hidden['tp_comm'])} under the layers' matmuls" in out
    plain = dataclasses.replace(
        plan,
        overlap={"dp": False, "tp": False, "pp": False},
        predicted=dataclasses.replace(plan.predicted, hidden={"tp_comm": 0.0, "dp_comm": 0.0}),
    )
    out = _render(plain)
    assert "hidden under compute" not in out and "Priced with no overlap (train --overlap off)" in out
    assert "Priced with overlap of dp traffic only" in _render(
        dataclasses.replace(plan, overlap={"dp": True, "tp": False, "pp": False})
    )


def test_a_single_stage_runner_ups_compute_names_what_differs():
    """A runner-up's compute is explained by what differs from the winner, never by the tp it
    shares with it (the fallback said 'tp=1: ... does not split' at tp=1 against tp=1)."""
    from types import SimpleNamespace

    from cost_models.strategy import Candidate
    from planner.search.alternatives import _compute_change

    def ev(cand):
        return SimpleNamespace(strategy=SimpleNamespace(candidate=cand))

    winner = Candidate(8, 2, 1, 1, 4, 2)
    wider = Candidate(4, 4, 1, 1, 4, 4)
    assert _compute_change(ev(winner), ev(wider)) == (
        "tp=4 vs 2: the work tensor parallelism does not split runs on every rank of a group"
    )
    assert _compute_change(ev(wider), ev(winner)) == "tp=2 vs 4"  # a narrower tp splits more, not less
    sharded = Candidate(8, 2, 1, 3, 8, 1)
    assert _compute_change(ev(winner), ev(sharded)) == "ZeRO-3 vs 1, micro-batch=8 vs 4"
    assert _compute_change(ev(winner), ev(winner)) == ""


def test_a_ranks_chunks_name_their_layers_once_per_run_of_siblings():
    """An interleaved rank's chunks, as the stage table names them: ranges of numbered siblings
    share their prefix and are abridged like the rows beside them; a lone range, or a chunk that
    spans two kinds of layer, keeps its names whole."""
    chunks = ["model.embed_tokens .. model.layers.4"] + [
        f"model.layers.{first} .. model.layers.{first + 5}" for first in range(11, 72, 12)
    ]
    assert (
        _chunk_names(chunks) == "model.embed_tokens .. model.layers.4; model.layers.{11..16, 23..28, 35..40, …, 71..76}"
    )
    assert _chunk_names(["model.layers.0", "model.layers.16", "model.layers.32", "lm_head"]) == (
        "model.layers.{0, 16, 32}; lm_head"
    )
    assert (
        _chunk_names(["model.layers.3 .. model.layers.5", "model.norm"])
        == "model.layers.3 .. model.layers.5; model.norm"
    )


def test_a_zero_2_peak_without_gradient_shards_says_why_grads_are_0(plan):
    """ZeRO 2/3 with one micro-batch peak before any backward made a gradient shard: the memory
    table says so beside its 0 B, and only then."""
    memory = dict(plan.predicted.memory, grads=0)
    sharded = dataclasses.replace(plan, zero_stage=2, predicted=dataclasses.replace(plan.predicted, memory=memory))
    assert "grads 0 B: the peak comes before" in _render(sharded)
    assert "the peak comes before" not in _render(dataclasses.replace(sharded, zero_stage=1))
    assert plan.predicted.memory["grads"] > 0 and "the peak comes before" not in _render(
        dataclasses.replace(plan, zero_stage=2)
    )
