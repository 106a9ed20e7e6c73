"""Elastic runs: ``planner train --elastic`` re-plans for the world it finds and resumes, locally
with ``--nproc`` changing and under torchrun's elastic agent with a rank SIGKILLed; the metrics
say what changed and what the recovery cost, and every sample is read once (by checksum)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import torch

from planner.cli import main
from planner.plan import load_plan
from runtime.contract import environment
from runtime.distributed.launch import free_port
from runtime.training.data import SyntheticTokens, batch_checksum
from runtime.training.events import event_lines, read_lines, step_lines
from tests.e2e.fault_hooks import KillAt, train_with_hook
from tests.helpers import reference_run

STEPS = 8
TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--vocab", "64", "--seq-len", "16"]


def _plan(tmp_path, gpus: int, dp: int) -> str:
    """``planner plan`` of the tiny GPT for ``gpus`` devices with ``--dp`` pinned (a pin the
    re-plan must drop): a plan.json with its request."""
    path = str(tmp_path / "plan.json")
    argv = ["plan", "--model", "gpt", *TINY, "--global-batch", "8", "--gpus", str(gpus), "--dp", str(dp)]
    assert main([*argv, "--hardware", "cpu", "--dtype", "fp32", "--out", path, "--json"]) == 0
    return path


def _train(plan: str, nproc: int, ck: str, metrics: str, hook=None, *extra: str) -> int:
    args = [plan, "--nproc", str(nproc), "--steps", str(STEPS), "--checkpoint-dir", ck, "--save-every", "2"]
    args += ["--metrics", metrics, "--no-memory-tracking", "--timeout", "60", "--resume", *extra]
    return main(["train", *args]) if hook is None else train_with_hook(args, hook)


def _expected_checksums(steps: int) -> list[int]:
    """What every plan of this model, seed and global batch reads at steps 1..steps: the
    checksum of rows 0..7 of each step's batch."""
    data = SyntheticTokens(vocab=64, seq_len=16, seed=0)
    return [batch_checksum(data.rows(step, 0, 8, 8)[0], 0) for step in range(steps)]


def test_elastic_two_ranks_killed_one_rank_then_two_again(tmp_path):
    plan_path = _plan(tmp_path, gpus=2, dp=2)
    ck, metrics = str(tmp_path / "ck"), str(tmp_path / "m.jsonl")
    # 2 ranks, killed before step index 3 (checkpoint at step 2, heartbeat at 3).
    assert _train(plan_path, 2, ck, metrics, KillAt(rank=1, step=3), "--elastic") == 1
    shutil.copytree(ck, tmp_path / "ck-fresh")
    # 1 rank: re-planned, resumed at step 2, killed before step index 5 (checkpoint at 4).
    assert _train(plan_path, 1, ck, metrics, KillAt(rank=0, step=5), "--elastic") == 1
    # 2 ranks again: the original plan fits, resumed at step 4 from the 1-rank checkpoint.
    assert _train(plan_path, 2, ck, metrics, None, "--elastic") == 0

    lines = read_lines(metrics)
    steps = step_lines(lines)
    assert [m["step"] for m in steps] == [1, 2, 3, 3, 4, 5, 5, 6, 7, 8]
    reference, _ = reference_run(load_plan(plan_path), STEPS)
    expected = _expected_checksums(STEPS)
    for m in steps:  # each step, whichever launch ran it, read that step's samples and matches one process
        assert m["data_checksum"] == expected[m["step"] - 1], m["step"]
        torch.testing.assert_close(m["loss"], reference[m["step"] - 1], rtol=1e-5, atol=1e-6)
    assert len(set(expected)) == STEPS  # so no step's samples were another's

    replan, recovery = event_lines(lines)
    assert replan["event"] == "replan" and replan["message"].startswith("re-planned for 1 rank(s): dp2 -> dp1")
    assert "resumed at step 2" in replan["message"] and "dropout" in replan["message"]
    assert (replan["old_world"], replan["new_world"], replan["step"]) == (2, 1, 2)
    assert replan["old"]["dp"] == 2 and replan["new"]["dp"] == 1
    assert replan["new"]["micro_batch_size"] * replan["new"]["num_micro_batches"] == 8
    assert replan["dropped_pins"] == ["--dp 2: data parallelism follows the world"]
    assert (replan["failed_after_step"], replan["steps_lost"]) == (3, 1) and replan["recovery_s"] > 0
    assert recovery["event"] == "resume" and (recovery["failed_after_step"], recovery["steps_lost"]) == (5, 1)
    assert recovery["source"] == "checkpoint" and recovery["message"].startswith("resumed at step 4 from checkpoint")
    assert recovery["resumed_step"] == 4 and recovery["recovery_s"] > 0

    # A fresh --resume of the same checkpoint under the re-planned plan gives the same losses.
    fresh = str(tmp_path / "fresh.jsonl")
    assert _train(replan["plan"], 1, str(tmp_path / "ck-fresh"), fresh, KillAt(rank=0, step=5)) == 1
    elastic = [m["loss"] for m in steps[3:6]]
    torch.testing.assert_close([m["loss"] for m in step_lines(read_lines(fresh))], elastic, rtol=1e-5, atol=0.0)


def test_torchrun_restarts_a_killed_rank_and_the_run_finishes(tmp_path):
    """Planned for 4 ranks, started on 2 under torchrun's elastic agent: rank 0 re-plans on every
    launch; rank 1 is SIGKILLed before step index 3 (``PLANNER_FAULT_KILL``, first launch only),
    the agent restarts both, and they resume from the snapshot of step 2 (the durable checkpoints
    come every 4 steps) and finish, with at most ``--snapshot-every`` steps lost."""
    plan_path = _plan(tmp_path, gpus=4, dp=4)
    ck, metrics = str(tmp_path / "ck"), str(tmp_path / "m.jsonl")
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes=1:1", "--nproc-per-node=2", "--max-restarts=1"),
        *("--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "-m", "planner", "train", plan_path),
        *("--elastic", "--checkpoint-dir", ck, "--save-every", "4", "--resume", "--steps", "6"),
        *("--snapshot-every", "2", "--snapshot-dir", str(tmp_path / "snapshots")),
        *("--metrics", metrics, "--no-memory-tracking", "--timeout", "60"),
    ]
    env = {**os.environ, environment.FAULT_KILL.name: "1:3"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = read_lines(metrics)
    assert [m["step"] for m in step_lines(lines)] == [1, 2, 3, 3, 4, 5, 6]
    first, restarted = event_lines(lines)
    assert first["event"] == restarted["event"] == "replan" and first["new_world"] == 2
    assert "steps_lost" not in first  # the first launch recovers from nothing
    assert restarted["resumed_step"] == 2 and restarted["steps_lost"] == 1  # at most --snapshot-every (2)
    assert restarted["source"] == "snapshot" and "resumed at step 2" in restarted["message"]
    assert "recovered in" in done.stdout and "re-planned for 2 rank(s)" in done.stdout
