"""Asynchronous checkpoints, snapshots and save errors, through ``planner train``.

Few launches, each checking several things (every launch costs seconds of CI): a kill of every
rank in the middle of a background write, synchronous and asynchronous saves giving the same
checkpoints and losses, a resume from a snapshot newer than the checkpoints, and a failed write
stopping the run or being trained through.
"""

from __future__ import annotations

import os

import torch

from runtime.checkpointing.checkpoint_io import list_checkpoints, load_model_tensors, read_meta
from runtime.contract import environment
from runtime.training.events import event_lines, read_lines, step_lines
from tests.e2e.fault_hooks import KillAt
from tests.e2e.test_checkpoint_resume import train
from tests.helpers import TINY_GPT, make_plan

FAULT = environment.CHECKPOINT_FAULT.name


def _after_last_resume(path) -> tuple[dict, list[dict]]:
    """The last ``resume`` event of a metrics file and the step lines after it."""
    lines = read_lines(str(path))
    index = max(i for i, line in enumerate(lines) if line.get("event") == "resume")
    return lines[index], step_lines(lines[index + 1 :])


def _same_tensors(path_a: str, path_b: str) -> None:
    a, b = load_model_tensors(path_a), load_model_tensors(path_b)
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        assert torch.equal(tensor, b[name]), name


def test_kill_during_async_write_resumes_from_the_previous_checkpoint(tmp_path, monkeypatch):
    plan = make_plan("gpt", dict(TINY_GPT), dp=2, zero=1)
    sync_dir, async_dir, snap_dir = (str(tmp_path / d) for d in ("sync", "async", "snap"))
    common = ("--save-every", "2", "--keep-last", "3")
    # The reference: synchronous saves, every step's state also staged as an in-memory snapshot.
    ref = tmp_path / "ref.jsonl"
    args = ("--checkpoint-dir", sync_dir, *common, "--async-checkpoint", "off", "--snapshot-every", "1")
    assert train(tmp_path, plan, 6, *args, "--metrics", str(ref)) == 0
    full = step_lines(read_lines(str(ref)))
    assert [m["step"] for m in full] == [1, 2, 3, 4, 5, 6]
    assert [m["checkpoint_s"] > 0 for m in full] == [True] * 6  # a save or a snapshot after every step
    # Every rank is SIGKILLed once its data of step 4 are written, before the folder is published.
    got = tmp_path / "async.jsonl"
    monkeypatch.setenv(FAULT, "kill:4")
    assert train(tmp_path, plan, 6, "--checkpoint-dir", async_dir, *common, "--metrics", str(got)) == 1
    monkeypatch.delenv(FAULT)
    assert [s for s, _ in list_checkpoints(async_dir)] == [2]
    assert ".tmp-step-000004" in os.listdir(async_dir)  # what the kill left: invisible to --resume
    assert train(tmp_path, plan, 6, "--checkpoint-dir", async_dir, *common, "--metrics", str(got), "--resume") == 0
    event, resumed = _after_last_resume(got)
    assert (event["step"], event["source"]) == (2, "checkpoint") and event["path"].endswith("step-000002")
    assert [m["step"] for m in resumed] == [3, 4, 5, 6]
    assert [m["loss"] for m in resumed] == [m["loss"] for m in full[2:]]  # bit-identical
    assert [m["checkpoint_s"] > 0 for m in resumed] == [False, True, False, True]
    # Asynchronous and synchronous saves hold the same state.
    assert [s for s, _ in list_checkpoints(async_dir)] == [2, 4, 6]
    assert not any(name.startswith(".tmp-") for name in os.listdir(async_dir))
    for (_, sync_path), (_, async_path) in zip(list_checkpoints(sync_dir), list_checkpoints(async_dir)):
        _same_tensors(sync_path, async_path)
        assert read_meta(sync_path)["optimizer_step"] == read_meta(async_path)["optimizer_step"]
    # Snapshots: stopped after step 5 (its snapshot written), the resume takes the snapshot, newer
    # than the checkpoint of step 4, and continues bit-identically.
    snap_metrics = tmp_path / "snap.jsonl"
    args = ("--checkpoint-dir", str(tmp_path / "ck"), *common, "--snapshot-every", "1", "--snapshot-dir", snap_dir)
    assert train(tmp_path, plan, 6, *args, "--metrics", str(snap_metrics), hook=KillAt(rank=0, step=5)) == 1
    assert [s for s, _ in list_checkpoints(snap_dir)] == [5]  # only the newest snapshot is kept
    assert train(tmp_path, plan, 6, *args, "--metrics", str(snap_metrics), "--resume") == 0
    event, resumed = _after_last_resume(snap_metrics)
    assert (event["step"], event["source"]) == (5, "snapshot")
    assert [m["loss"] for m in resumed] == [full[5]["loss"]]
    _same_tensors(list_checkpoints(sync_dir)[-1][1], list_checkpoints(str(tmp_path / "ck"))[-1][1])


def test_failed_write_stops_the_run_or_is_trained_through(tmp_path, monkeypatch, capfd):
    plan = make_plan("gpt", dict(TINY_GPT), dp=2)
    monkeypatch.setenv(FAULT, "fail:2:1")  # rank 1's write of step 2 fails (as a full disk would)
    stop_dir = str(tmp_path / "stop")
    rc = train(tmp_path, plan, 4, "--checkpoint-dir", stop_dir, "--save-every", "1", "--keep-last", "5")
    err = capfd.readouterr().err
    assert rc == 1
    assert "step-000002 failed (rank 1: OSError" in err and "no space left on device" in err, err
    assert "Traceback" not in err
    assert [s for s, _ in list_checkpoints(stop_dir)] == [1]  # the previous checkpoint stays
    metrics = tmp_path / "m.jsonl"
    go_dir = str(tmp_path / "go")
    # Trained through, here with in-line writes: the failure is seen at once, on both ranks.
    args = ("--checkpoint-dir", go_dir, "--save-every", "1", "--keep-last", "5", "--on-save-error", "continue")
    args += ("--async-checkpoint", "off")
    assert train(tmp_path, plan, 4, *args, "--metrics", str(metrics)) == 0
    err = capfd.readouterr().err
    assert err.count("save failed, training continues") == 1 and "step-000002" in err
    lines = read_lines(str(metrics))
    (event,) = event_lines(lines)
    assert event["event"] == "save_error" and "step-000002" in event["message"]
    assert [m["step"] for m in step_lines(lines)] == [1, 2, 3, 4]
    assert [s for s, _ in list_checkpoints(go_dir)] == [1, 3, 4]
    assert not any(name.startswith(".tmp-") for name in os.listdir(go_dir))
