"""Expert parallelism end to end: tiny mixtures of experts trained over gloo ranks like one process.

Tiny Mixtral, Qwen2-MoE (routed experts plus a gated shared expert) and DeepSeek-V3 (multi-head
latent attention, a dense first layer, shared and grouped-routed experts), each a model directory
holding only ``config.json`` (``hf:PATH``), compiled with ``expert_parallel`` set and trained
dropless at ep2 (dp2), ep2 x pp2, ep2 x tp2 and ep4 (dp4), and Qwen3-MoE at ep2 and ep4; ZeRO 1
and 3 at ep2; recompute at ep2; the zero-bubble and interleaved schedules at ep2 x pp2; capacity
mode (DeepSeek: tokens over capacity dropped and counted); a checkpoint written at ep2 resumed at
ep1; GPT-OSS (a bias per expert, gathered by expert id) at ep2. Every
case's per-step losses and final parameters match a single process training the HF model with
torch AdamW on the whole global batch (``tests.helpers.reference_run``) at rtol 1e-5.

One spawn per world size (``tests.e2e.batched``): the cases of 2 ranks, then those of 4.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch

from planner.frontend.zoo import ModelSizes, build_model
from planner.plan import Plan
from runtime.training.data import open_data
from runtime.training.events import read_lines
from tests.e2e.batched import Run, options, run_result, train_together
from tests.e2e.test_train_matrix import EPS
from tests.helpers import make_plan, read_metrics, reference_run
from tests.moe_configs import moe_configs

tf = pytest.importorskip("transformers")

SEQ, MBS, STEPS = 8, 2, 3
COMMON = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    vocab_size=96,
)
_BUILD = moe_configs(tf, {**COMMON, "num_key_value_heads": 2})
ARCHS = {
    "mixtral": (_BUILD["mixtral"], dict(layers=[1, 2], experts=4, top_k=2, shared_experts=0)),
    "qwen2_moe": (_BUILD["qwen2_moe"], dict(layers=[1, 2], experts=4, top_k=2, shared_experts=1)),
    "deepseek_v3": (_BUILD["deepseek_v3"], dict(layers=[2], experts=4, top_k=2, shared_experts=1)),
}
QWEN3 = (_BUILD["qwen3_moe"], dict(layers=[1, 2], experts=8, top_k=3, shared_experts=0))
"""Qwen3-MoE (8 experts, top 3, q/k norms), trained at ep2 and ep4 only."""
GPT_OSS = (_BUILD["gpt_oss"], dict(layers=[1, 2], experts=4, top_k=2, shared_experts=0))
"""GPT-OSS (4 experts, top 2, a bias per expert gathered by expert id between its products, cut
with the experts), trained at ep2."""
CONFIGS = {**ARCHS, "qwen3_moe": QWEN3, "gpt_oss": GPT_OSS}
"""Each model's config and the ``model.moe`` facts the planner would fill."""
LAYOUTS = {
    "ep2": dict(dp=2, ep=2),
    "ep2xpp2": dict(dp=2, pp=2, ep=2),
    "ep2xtp2": dict(dp=2, tp=2, ep=2),
    "ep4": dict(dp=4, ep=4),
}
SCHEDULES = {
    "zero-bubble": dict(schedule="zero-bubble"),
    "interleaved": dict(schedule="interleaved", virtual_stages=2, stages=[[0, 0], [1, 1], [2, 2], [3, 3]]),
}
"""Other pipeline schedules at ep2 x pp2: B and W apart (the all-to-alls' backward in B), and two
model chunks per rank (one routed block each)."""
CAPACITY = 0.5
RESUMED_STEPS = STEPS + 2
SETTINGS = dict(eps=EPS, min_lr=3e-4)
"""Every run's settings: a constant learning rate (``min_lr = lr``), so that a run resumed for more
steps follows the schedule of the run it resumes (a cosine schedule depends on the step count)."""


def _model_dir(root, arch: str) -> str:
    path = os.path.join(root, arch)
    if not os.path.exists(path):
        CONFIGS[arch][0]().save_pretrained(path)
    return f"hf:{path}"


def _plan(
    spec: str, arch: str, *, dp: int, ep: int, pp: int = 1, tp: int = 1, zero: int = 0, capacity=None, checkpoint=()
):
    """A hand-pinned plan (``tests.helpers.make_plan``) with the MoE fields the planner fills."""
    plan = make_plan(
        spec, {"layers": 2, "seq_len": SEQ}, mbs=MBS, m=pp, dp=dp, pp=pp, tp=tp, zero=zero, checkpoint=checkpoint
    )
    plan.model.moe = {**CONFIGS[arch][1], "capacity_factor": capacity}
    return dataclasses.replace(plan, expert_parallel=ep)


def _cases(root) -> dict[str, Run]:
    """Every case of this file, in training order within a world size (the resume follows the run
    whose checkpoint it reads)."""
    runs = {}

    def add(name, plan, steps=STEPS, **settings):
        folder = os.path.join(root, name)
        runs[name] = Run(name, plan, folder, options(folder, steps, **SETTINGS, **settings))

    for arch in ARCHS:
        spec = _model_dir(os.path.join(root, "models"), arch)
        for layout, pins in LAYOUTS.items():
            add(f"{arch}-{layout}", _plan(spec, arch, **pins))
    qwen3 = _model_dir(os.path.join(root, "models"), "qwen3_moe")
    for layout in ("ep2", "ep4"):
        add(f"qwen3_moe-{layout}", _plan(qwen3, "qwen3_moe", **LAYOUTS[layout]))
    add("gpt_oss-ep2", _plan(_model_dir(os.path.join(root, "models"), "gpt_oss"), "gpt_oss", **LAYOUTS["ep2"]))
    spec = _model_dir(os.path.join(root, "models"), "mixtral")
    for zero in (1, 3):
        add(f"mixtral-ep2-zero{zero}", _plan(spec, "mixtral", dp=2, ep=2, zero=zero))
    add("mixtral-ep2-recompute", _plan(spec, "mixtral", dp=2, ep=2, checkpoint=(1, 2)))
    for schedule, layout in SCHEDULES.items():
        add(
            f"mixtral-ep2xpp2-{schedule}",
            Plan.from_dict({**_plan(spec, "mixtral", dp=2, pp=2, ep=2).to_dict(), **layout}),
        )
    deepseek = _model_dir(os.path.join(root, "models"), "deepseek_v3")
    add("deepseek-capacity", _plan(deepseek, "deepseek_v3", dp=2, ep=2, capacity=CAPACITY), steps=1)
    saved = runs["mixtral-ep2"].opts.checkpoint_dir
    add("mixtral-resume-ep1", _plan(spec, "mixtral", dp=2, ep=1), steps=RESUMED_STEPS, resume=True)
    runs["mixtral-resume-ep1"] = dataclasses.replace(
        runs["mixtral-resume-ep1"], opts=dataclasses.replace(runs["mixtral-resume-ep1"].opts, checkpoint_dir=saved)
    )
    return runs


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Run]:
    """Compile every case and train them: one spawn of 2 ranks, one of 4."""
    runs = _cases(str(tmp_path_factory.mktemp("moe")))
    train_together(list(runs.values()))
    return runs


def _check(run: Run, steps: int = STEPS, first_step: int = 0) -> None:
    losses, params = run_result(run.folder, STEPS) if first_step == 0 else _resumed_result(run)
    ref_losses, ref_params = reference_run(run.plan, steps, **SETTINGS)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[first_step:]), rtol=1e-5, atol=1e-6)
    assert set(params) <= set(ref_params) and any(".experts." in name for name in params)
    with open(os.path.join(run.compiled, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    ep = run.plan.expert_parallel
    assert manifest.get("expert_parallel", {"degree": 1})["degree"] == ep
    # the metrics are rank 0's: tokens travelled if that rank's stage holds routed experts
    routed = any(entry.get("expert") for entry in manifest["stages"][0]["params"].values())
    rows = read_metrics(os.path.join(run.folder, "m.jsonl"))
    if ep > 1 and routed:
        assert all(row["time"]["ep_comm"] > 0 for row in rows)
    elif ep == 1:
        assert all(row["time"]["ep_comm"] == 0 for row in rows)
    for name, p in params.items():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _resumed_result(run: Run):
    """A resumed run's losses (its metrics: the steps after the checkpoint) and its last checkpoint."""
    from runtime.checkpointing.checkpoint_io import list_checkpoints, load_model_tensors

    losses = [row["loss"] for row in read_metrics(os.path.join(run.folder, "m.jsonl"))]
    step, path = max(list_checkpoints(run.opts.checkpoint_dir))
    assert step == RESUMED_STEPS
    (event,) = [row for row in read_lines(os.path.join(run.folder, "m.jsonl")) if row.get("event") == "resume"]
    assert event["step"] == STEPS and event["path"].endswith(f"step-{STEPS:06d}")
    return losses, load_model_tensors(path)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_expert_parallel_trains_like_one_process(trained, arch, layout):
    """Dropless routing over ep ranks: the same losses and parameters as one process."""
    _check(trained[f"{arch}-{layout}"])


@pytest.mark.parametrize("layout", ["ep2", "ep4"])
def test_qwen3_moe_trains_like_one_process(trained, layout):
    _check(trained[f"qwen3_moe-{layout}"])


def test_gpt_oss_trains_like_one_process_with_its_bias_cut_with_the_experts(trained):
    _check(trained["gpt_oss-ep2"])


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_expert_parallel_under_other_pipeline_schedules(trained, schedule):
    _check(trained[f"mixtral-ep2xpp2-{schedule}"])


@pytest.mark.parametrize("zero", [1, 3])
def test_expert_parallel_with_zero(trained, zero):
    """Expert weights sharded over the expert-data-parallel group, the rest over dp."""
    _check(trained[f"mixtral-ep2-zero{zero}"])


def test_recomputed_moe_layers_dispatch_again_in_backward(trained):
    """Both blocks recomputed in backward (activation checkpointing): their dispatch and combine
    run again there, over the same ranks in the same order; the training and the routing are
    those of the run without recompute."""
    run = trained["mixtral-ep2-recompute"]
    assert run.plan.checkpoint_layers == [1, 2]
    _check(run)
    plain = read_metrics(os.path.join(trained["mixtral-ep2"].folder, "m.jsonl"))
    again = read_metrics(os.path.join(run.folder, "m.jsonl"))
    assert [row["expert_load"] for row in again] == [row["expert_load"] for row in plain]


def test_dropless_routing_reports_no_drops_and_the_load(trained):
    rows = read_metrics(os.path.join(trained["mixtral-ep2"].folder, "m.jsonl"))
    assert [row["tokens_dropped"] for row in rows] == [0] * STEPS
    assert all(1.0 <= row["expert_load"] <= 4.0 for row in rows)


def _hand_count(run: Run) -> tuple[int, float]:
    """Rows the first step drops at ``CAPACITY`` and its expert load (max / mean rows per expert),
    counted from the expert ids the HF model's router hands its experts: each dp rank dispatches
    its own micro-batch, each expert keeping ``ceil(F * rows / E)`` of that rank's rows. DeepSeek's
    only routed layer follows a dense one, so its routing does not depend on earlier drops."""
    plan = run.plan
    bundle = build_model(plan.model.spec, ModelSizes(**plan.model.sizes), seed=run.opts.seed)
    data = open_data(None, bundle.vocab, plan.seq_len, run.opts.seed)
    ids, _ = data.rows(0, 0, plan.global_batch, plan.global_batch)
    chosen: list[torch.Tensor] = []
    experts = [m for name, m in bundle.model.named_modules() if name.endswith("mlp.experts")]
    assert len(experts) == 1
    hook = experts[0].register_forward_pre_hook(lambda module, args: chosen.append(args[1].flatten()))
    for rank in range(plan.dp):
        with torch.no_grad():
            bundle.model.inner(input_ids=ids[rank * MBS : (rank + 1) * MBS])
    hook.remove()
    dropped, per_expert = 0, torch.zeros(4, dtype=torch.int64)
    for rows in chosen:
        counts = torch.bincount(rows, minlength=4)
        dropped += int((counts - math.ceil(CAPACITY * rows.numel() / 4)).clamp(min=0).sum())
        per_expert += counts
    return dropped, float(per_expert.max() / per_expert.float().mean())


def test_capacity_drops_and_counts_what_a_hand_count_says(trained):
    """``tokens_dropped`` and ``expert_load`` of the first step equal a count made from the
    router's own logits (the experts' capacity applied per source rank, as GShard does)."""
    run = trained["deepseek-capacity"]
    (row,) = read_metrics(os.path.join(run.folder, "m.jsonl"))
    dropped, load = _hand_count(run)
    assert dropped > 0
    assert row["tokens_dropped"] == dropped
    assert row["expert_load"] == pytest.approx(load, rel=1e-9)


def test_checkpoint_at_ep2_resumes_at_ep1(trained):
    """Experts saved once as full [E, ...] tensors at ep2 load whole at ep1: the resumed steps
    continue the single-process run."""
    _check(trained["mixtral-resume-ep1"], steps=RESUMED_STEPS, first_step=STEPS)
