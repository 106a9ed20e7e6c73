"""Weights tied across pipeline stages (hf:gpt2's embedding and LM head) train like one process.

Each stage that reads the tied weight holds a copy; the runtime sums the copies' gradients over
the tied group after backward. Losses and final parameters are compared (fp32, rtol 1e-5) with a
single process running plain torch AdamW; checkpoints store the tied weight once.
"""

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from planner.cli import main
from runtime.checkpointing.checkpoint_io import list_checkpoints, load_model_tensors, read_meta
from tests.helpers import make_plan, read_metrics, reference_run, write_plan

TINY_HF_GPT2 = {"layers": 2, "hidden": 32, "heads": 4, "vocab": 96, "seq_len": 16}
TIED = "inner.lm_head.weight"
ALIAS = "inner.transformer.wte.weight"
STEPS = 3
LR = 3e-4
CONST_LR = ("--lr", str(LR), "--min-lr", str(LR))
EPS = 1e-6  # as in test_train_matrix: keeps Adam from amplifying last-bit reduction differences


def train(tmp_path, plan, steps, name="run", ck=None, resume=False, extra=()):
    """Train ``plan`` with ``planner train`` (saving at the last step): (losses, checkpoint dir)."""
    path = write_plan(tmp_path / f"{name}.json", plan)
    metrics = tmp_path / f"{name}.jsonl"
    ck = ck or (tmp_path / f"{name}-ck")
    args = [
        "train",
        path,
        "--nproc",
        str(plan.dp * plan.tp * plan.pp),
        "--steps",
        str(steps),
        "--metrics",
        str(metrics),
        "--checkpoint-dir",
        str(ck),
        "--save-every",
        str(steps),
        "--compiled",
        str(tmp_path / f"{name}-compiled"),
        "--no-memory-tracking",
        "--timeout",
        "60",
        "--adam-eps",
        str(EPS),
        *extra,
    ]
    assert main(args + (["--resume"] if resume else [])) == 0
    return [m["loss"] for m in read_metrics(metrics)], str(ck)


def check_params(ck, ref_params):
    last = list_checkpoints(ck)[-1][1]
    params = load_model_tensors(last)
    assert ALIAS not in params and TIED in params  # the tied weight is stored once, by its FQN
    assert set(params) | {ALIAS} == set(ref_params)
    for name, p in params.items():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    return last


@pytest.mark.dist
def test_tied_weight_tp2xpp2_trains_like_one_process(tmp_path):
    """tp2 x pp2: the tied weight is vocab-parallel on both stages; each tp rank sums its shard."""
    plan = make_plan("hf:gpt2", TINY_HF_GPT2, tp=2, pp=2)
    losses, ck = train(tmp_path, plan, 2)
    ref_losses, ref_params = reference_run(plan, 2, eps=EPS)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    check_params(ck, ref_params)


@pytest.mark.dist
def test_tied_zero3_pipeline_resumes_from_pp1_checkpoint(tmp_path):
    """A pp1 checkpoint resumes under dp2 x pp2 with ZeRO 3 (both holders read the tied weight,
    whose fp32 gradient shards are summed over the tied group); losses and final weights match one
    uninterrupted process (a constant learning rate, so that the schedule does not depend on
    where the first run stopped); the dp2 x pp2 checkpoint stores the tied weight once."""
    one = make_plan("hf:gpt2", TINY_HF_GPT2)
    two = make_plan("hf:gpt2", TINY_HF_GPT2, dp=2, pp=2, zero=3, mbs=1)
    assert one.global_batch == two.global_batch
    ck = tmp_path / "ck"
    l1, _ = train(tmp_path, one, 1, "a", ck=ck, extra=CONST_LR)
    l2, _ = train(tmp_path, two, STEPS, "b", ck=ck, resume=True, extra=CONST_LR)
    ref_losses, ref_params = reference_run(one, STEPS, eps=EPS, min_lr=LR)
    torch.testing.assert_close(torch.tensor(l1 + l2), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    last = check_params(str(ck), ref_params)
    # Saved once: only the first holder (global rank 0: stage 0, dp 0) wrote it.
    md = FileSystemReader(last).read_metadata()
    files = {info.relative_path for idx, info in md.storage_data.items() if idx.fqn.endswith(TIED)}
    assert files and all(f.startswith("__0_") for f in files), files
    assert f"model/{TIED}" in read_meta(last)["tensors"]
