"""A plan's pipeline schedule, trained end to end, against one process (fp32, gloo).

Interleaved 1F1B over model chunks (pp2 v2: 4 blocks = 6 layer-table rows in 4 chunks; hf:gpt2,
whose tied embedding and LM head sit in chunk 0 on rank 0 and chunk 3 on rank 1; a model whose
four blocks all hold one linear, so that each rank runs two chunks reading it; and the built-in
GPT at dp2 with ZeRO-1 and ZeRO-3) and ZB-H1 with its split B/W (pp2 with recompute, pp2 x tp2, pp2 x dp2
with ZeRO-3) are compiled as `planner train` compiles them and run by the trainer
(``runtime.training.trainer.train_worker``); their per-step losses and final parameters (the consolidated
checkpoint) must match plain torch AdamW on the whole global batch. To stay cheap, one spawn per
world size runs all its plans in turn. The 2-process spawn also resumes the interleaved run's
checkpoint (saved per chunk) under a 1F1B plan with one chunk per rank, which must continue the
same trajectory.
"""

from __future__ import annotations

import pytest
import torch

from planner.plan import Plan
from runtime.data_parallel.tied_weights import tied_stage_sets
from runtime.stages.compiled_stages import read_manifest
from tests.e2e.batched import Run, options, run_result, train_together
from tests.helpers import TINY_GPT, make_plan, read_metrics, reference_run

STEPS = 3
RESUMED = 5  # the resumed run continues to this step
GPT4 = dict(TINY_GPT, layers=4)  # 6 layer-table rows
HF4 = {"layers": 4, "hidden": 32, "heads": 4, "vocab": 96, "seq_len": 16}  # hf:gpt2, tied LM head
SHARED = "tests/fixtures/user_models.py:shared_blocks"  # 4 blocks holding one linear: rows 1-4 read it
SIZES = {"gpt": GPT4, "hf:gpt2": HF4, SHARED: {"layers": 4}}
ALIASES = {"inner.transformer.wte.weight"}  # hf:gpt2's tied weight, stored once as inner.lm_head.weight
CHUNKS = [[0, 1], [2, 2], [3, 3], [4, 5]]  # pp2 x v2, in model order: chunk c on rank c % 2
# Constant learning rate (min_lr = lr): a resumed run with more steps follows the same schedule.
# Adam's eps 1e-6 as in tests/e2e/test_train_matrix.py (rounding is not what is compared).
SETTINGS = dict(lr=1e-3, min_lr=1e-3, eps=1e-6)

CASES = {  # name -> (world, plan decisions)
    "interleaved-pp2-v2": (2, dict(spec="hf:gpt2", pp=2, schedule="interleaved", v=2)),
    # a weight every block reads: each rank runs two of its readers, and sums their copies first
    "interleaved-pp2-v2-shared": (2, dict(spec=SHARED, pp=2, schedule="interleaved", v=2)),
    "zb-pp2-ckpt": (2, dict(pp=2, schedule="zero-bubble", checkpoint=(1, 3))),
    "interleaved-pp2-v2-dp2-zero1": (4, dict(pp=2, dp=2, zero=1, schedule="interleaved", v=2)),
    "zb-pp2-tp2": (4, dict(pp=2, tp=2, schedule="zero-bubble")),
    "zb-pp2-dp2-zero3": (4, dict(pp=2, dp=2, zero=3, schedule="zero-bubble")),
    "interleaved-pp2-v2-dp2-zero3": (4, dict(pp=2, dp=2, zero=3, schedule="interleaved", v=2)),
    # --overlap off: the same runs, every collective waited where it is issued (must be identical)
    "interleaved-pp2-v2-dp2-zero1-off": (4, dict(pp=2, dp=2, zero=1, schedule="interleaved", v=2)),
    "zb-pp2-dp2-zero3-off": (4, dict(pp=2, dp=2, zero=3, schedule="zero-bubble")),
}


def schedule_plan(spec: str = "gpt", schedule: str = "1f1b", v: int = 1, **decisions) -> Plan:
    """A hand-made plan of a 4-block model (4 micro-batches of 1 per dp rank) with a schedule."""
    d = make_plan(spec, SIZES[spec], mbs=1, m=4, **decisions).to_dict()
    d.update(schedule=schedule, virtual_stages=v)
    if spec == SHARED:  # what `planner plan` reads from the graph: token ids and next-token targets
        d["model"]["inputs"] = [
            {"dtype": "int64", "name": name, "role": role, "shape": ["b", "s"], "vocab": 32}
            for name, role in (("ids", "tokens"), ("labels", "targets"))
        ]
    if v > 1:
        d["stages"] = CHUNKS
    return Plan.from_dict(d)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Compile every case, train them (one spawn per world size); per case its folder and plan."""
    root = tmp_path_factory.mktemp("schedule_training")
    runs = []
    for name, (_, kw) in CASES.items():
        folder = str(root / name)
        overlap = "off" if name.endswith("-off") else "on"
        runs.append(Run(name, schedule_plan(**kw), folder, options(folder, STEPS, overlap=overlap, **SETTINGS)))
    # the interleaved run's checkpoint, resumed under 1F1B with one chunk per rank
    resumed = options(str(root / "interleaved-pp2-v2"), RESUMED, resume=True, **SETTINGS)
    stages = str(root / "resume-1f1b" / "compiled")
    runs.append(Run("resume-1f1b", schedule_plan("hf:gpt2", pp=2), str(root / "interleaved-pp2-v2"), resumed, stages))
    train_together(runs, timeout_s=240)
    return root, {run.name: run.plan for run in runs}


def _check(losses, params, plan: Plan, steps: int, first: int = 0) -> None:
    ref_losses, ref_params = reference_run(plan, steps, **SETTINGS)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[first:]), rtol=1e-5, atol=1e-6)
    stored = {_first_name(name): p for name, p in params.items()}
    assert set(stored) == {_first_name(name) for name in ref_params} - ALIASES
    for name, p in stored.items():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _first_name(name: str) -> str:
    """One name for each of the shared linear's names: it is stored once, under one of its
    blocks' names, where the reference lists it under every block's."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blocks" and parts[2] == "shared":
        return f"blocks.0.shared.{parts[3]}"
    return name


def _result(folder, step: int):
    """The run's losses (every step in its metrics file) and its parameters after ``step``."""
    return run_result(str(folder), step)


@pytest.mark.dist
@pytest.mark.parametrize("case", list(CASES))
def test_schedule_trains_like_one_process(trained, case):
    root, plans = trained
    losses, params = _result(root / case, STEPS)
    _check(losses[:STEPS], params, plans[case], STEPS)


@pytest.mark.dist
@pytest.mark.parametrize("case", [name for name in CASES if name.endswith("-off")])
def test_overlap_off_trains_exactly_as_overlap_on(trained, case):
    """``--overlap off`` changes when collectives are waited, never what they compute: the same
    losses and parameters, bit for bit, and each step's time still splits into its parts."""
    root, _ = trained
    off_losses, off_params = _result(root / case, STEPS)
    on_losses, on_params = _result(root / case[: -len("-off")], STEPS)
    assert off_losses == on_losses
    assert off_params.keys() == on_params.keys()
    for name, p in on_params.items():
        assert torch.equal(off_params[name], p), name
    for line in read_metrics(root / case / "m.jsonl"):
        assert sum(line["time"].values()) == pytest.approx(line["step_time_s"], rel=1e-6)


@pytest.mark.dist
def test_interleaved_checkpoint_resumes_under_one_chunk_per_rank(trained):
    """Steps STEPS+1..RESUMED, run by a 1F1B plan from the checkpoint of the pp2 v2 run."""
    root, plans = trained
    losses, params = _result(root / "interleaved-pp2-v2", RESUMED)
    assert len(losses) == RESUMED  # the resumed run appended its steps to the same metrics file
    _check(losses[STEPS:], params, plans["resume-1f1b"], RESUMED, first=STEPS)


@pytest.mark.dist
def test_interleaved_plan_compiles_to_one_file_per_chunk(trained):
    """p * v = 4 chunk files in model order; the manifest says which rank runs which; the tied
    weight's holders are chunks 0 and 3 (ranks 0 and 1)."""
    root, _ = trained
    man = read_manifest(str(root / "interleaved-pp2-v2" / "compiled"))
    assert [st["file"] for st in man["stages"]] == [f"stage_{k}.py" for k in range(4)]
    assert [st["layers"] for st in man["stages"]] == [list(range(a, b + 1)) for a, b in CHUNKS]
    assert man["chunks_of_rank"] == [[0, 2], [1, 3]] and [st["pp_rank"] for st in man["stages"]] == [0, 1, 0, 1]
    assert tied_stage_sets(man) == [(0, 1)]
    assert {tuple(e["tied"]) for st in man["stages"] for e in st["params"].values() if e.get("tied")} == {(0, 3)}
