"""Checkpoints: bit-identical resume, resume under another plan, faults and bad input."""

import os
import subprocess
import time

import numpy as np
import pytest
import torch

from planner.cli import main
from runtime.checkpointing.checkpoint_io import list_checkpoints, load_model_tensors
from tests.e2e.fault_hooks import HangAt, KillAt, RaiseAt, train_with_hook
from tests.helpers import TINY_GPT, make_plan, read_metrics, reference_run, write_plan


def train(tmp_path, plan, steps, *extra, name="plan.json", hook=None):
    """``planner train`` of ``plan`` for ``steps``; ``hook``: a step hook of ``tests.e2e.fault_hooks``."""
    path = write_plan(tmp_path / name, plan)
    args = [
        path,
        "--nproc",
        str(plan.dp * plan.tp * plan.pp),
        "--steps",
        str(steps),
        "--compiled",
        str(tmp_path / (name + ".compiled")),
        "--no-memory-tracking",
        "--timeout",
        "60",
        *extra,
    ]
    return main(["train", *args]) if hook is None else train_with_hook(args, hook)


def test_resume_is_bit_identical(tmp_path):
    plan = make_plan("gpt", dict(TINY_GPT), dp=2, zero=2)
    a = tmp_path / "a"
    a.mkdir()
    assert train(a, plan, 6, "--metrics", str(a / "m.jsonl")) == 0
    b = tmp_path / "b"
    b.mkdir()
    ck = str(b / "ck")
    # The same 6-step run (same LR schedule), killed after step 3 was saved, then resumed.
    assert (
        train(
            b,
            plan,
            6,
            "--metrics",
            str(b / "m.jsonl"),
            "--checkpoint-dir",
            ck,
            "--save-every",
            "3",
            hook=KillAt(rank=0, step=3),
        )
        == 1
    )
    assert (
        train(b, plan, 6, "--metrics", str(b / "m.jsonl"), "--checkpoint-dir", ck, "--save-every", "3", "--resume") == 0
    )
    full = [m["loss"] for m in read_metrics(a / "m.jsonl")]
    resumed = read_metrics(b / "m.jsonl")
    assert [m["step"] for m in resumed] == [1, 2, 3, 4, 5, 6]
    assert [m["loss"] for m in resumed] == full  # exact, not approximately
    assert [s for s, _ in list_checkpoints(ck)] == [3, 6]


def test_resume_under_another_plan_reshards(tmp_path):
    first = make_plan("gpt", dict(TINY_GPT), dp=2, zero=3)
    ck = str(tmp_path / "ck")
    # Stop the 5-step run after step 3 was saved.
    assert (
        train(
            tmp_path, first, 5, "--checkpoint-dir", ck, "--save-every", "3", name="p1.json", hook=KillAt(rank=1, step=3)
        )
        == 1
    )
    # Same global batch (8), now two pipeline stages with ZeRO-1 inside each.
    second = make_plan("gpt", dict(TINY_GPT), pp=2, mbs=2, m=4)
    assert second.global_batch == first.global_batch
    assert (
        train(
            tmp_path,
            second,
            5,
            "--checkpoint-dir",
            ck,
            "--save-every",
            "5",
            "--resume",
            "--metrics",
            str(tmp_path / "m.jsonl"),
            name="p2.json",
        )
        == 0
    )
    losses = [m["loss"] for m in read_metrics(tmp_path / "m.jsonl")]
    ref_losses, ref_params = reference_run(first, 5)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[3:]), rtol=1e-5, atol=1e-6)
    final = load_model_tensors(list_checkpoints(ck)[-1][1])
    for n, p in ref_params.items():
        torch.testing.assert_close(final[n], p, rtol=1e-5, atol=1e-6)


def test_killed_rank_fails_fast_and_checkpoint_survives(tmp_path, capsys):
    plan = make_plan("gpt", dict(TINY_GPT), dp=2, zero=1)
    ck = str(tmp_path / "ck")
    t0 = time.monotonic()
    rc = train(tmp_path, plan, 8, "--checkpoint-dir", ck, "--save-every", "2", hook=KillAt(rank=1, step=4))
    elapsed = time.monotonic() - t0
    err = capsys.readouterr().err
    assert rc == 1
    assert "rank 1" in err and "SIGKILL" in err
    assert "Terminating process" not in err  # torch's log of the peers it stops: the error says enough
    assert elapsed < 60
    assert [s for s, _ in list_checkpoints(ck)] == [2, 4]
    assert train(tmp_path, plan, 6, "--checkpoint-dir", ck, "--save-every", "2", "--resume") == 0
    assert [s for s, _ in list_checkpoints(ck)] == [4, 6]


def test_rank_that_raises_is_one_clear_error(tmp_path, capfd):
    """The failing rank's exception, once, without torch's log of the peers it stops (written by
    a logging handler bound to the process's stderr: captured at the file descriptor)."""
    plan = make_plan("gpt", dict(TINY_GPT), dp=2)
    assert train(tmp_path, plan, 4, hook=RaiseAt(rank=0, step=1)) == 1
    err = capfd.readouterr().err
    assert "rank 0 failed: RuntimeError: injected failure on rank 0" in err
    assert "Terminating process" not in err and "Traceback" not in err


def test_checkpoint_from_another_model_is_refused(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    assert train(tmp_path, make_plan("gpt", dict(TINY_GPT), dp=2), 2, "--checkpoint-dir", ck, "--save-every", "2") == 0
    other = make_plan("gpt", dict(TINY_GPT, hidden=64), dp=2)
    assert train(tmp_path, other, 4, "--checkpoint-dir", ck, "--resume", name="other.json") == 2
    err = capsys.readouterr().err
    assert "is from model 'gpt'" in err and "Traceback" not in err


def test_corrupt_checkpoint_is_a_clear_error(tmp_path, capsys):
    plan = make_plan("gpt", dict(TINY_GPT), dp=2)
    ck = str(tmp_path / "ck")
    assert train(tmp_path, plan, 2, "--checkpoint-dir", ck, "--save-every", "2") == 0
    ((_, path),) = list_checkpoints(ck)
    shard = next(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".distcp"))
    with open(shard, "r+b") as f:
        f.truncate(16)
    assert train(tmp_path, plan, 4, "--checkpoint-dir", ck, "--resume") == 1
    err = capsys.readouterr().err
    assert "corrupt or incomplete" in err
    assert "Traceback" not in err


def test_missing_data_file(tmp_path, capsys):
    plan = make_plan("gpt", dict(TINY_GPT), dp=2)
    assert train(tmp_path, plan, 2, "--data", str(tmp_path / "nope.bin")) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize(
    "ids, message",
    [
        (np.random.rand(600).astype(np.float32), "holds float32 values, not token ids"),
        (-np.ones(600, dtype=np.int64), "contains token id -1, outside the model's vocabulary 0..63"),
        (np.full(600, 5000, dtype=np.int64), "contains token id 5000, outside the model's vocabulary 0..63"),
    ],
)
def test_bad_token_file_fails_before_training(tmp_path, capsys, ids, message):
    """Wrong data is a one-line error (exit 2) before any process starts, not a crash inside one."""
    path = tmp_path / "tokens.npy"
    np.save(path, ids)
    plan = make_plan("gpt", dict(TINY_GPT), dp=2)
    assert train(tmp_path, plan, 2, "--data", str(path)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and "SIGTERM" not in err


def test_resume_says_when_done_or_rescheduled(tmp_path, capsys):
    plan = make_plan("gpt", dict(TINY_GPT), dp=2)
    ck = str(tmp_path / "ck")
    assert train(tmp_path, plan, 2, "--checkpoint-dir", ck, "--save-every", "2") == 0
    capsys.readouterr()
    # Already there: nothing runs, and it says so.
    assert train(tmp_path, plan, 2, "--checkpoint-dir", ck, "--resume") == 0
    assert "already at or past --steps 2; nothing to train" in capsys.readouterr().err
    # Extending the run stretches the cosine schedule: say that the losses will not be the old run's.
    assert train(tmp_path, plan, 3, "--checkpoint-dir", ck, "--resume") == 0
    assert "schedule differs from the checkpointed run's (steps 2 -> 3)" in capsys.readouterr().err


def test_text_data_file_trains(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    plan = make_plan("gpt", dict(TINY_GPT, vocab=256), dp=2)
    assert train(tmp_path, plan, 2, "--data", str(text), "--metrics", str(tmp_path / "m.jsonl")) == 0
    ref, _ = reference_run(plan, 2, data_path=str(text))
    got = [m["loss"] for m in read_metrics(tmp_path / "m.jsonl")]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=1e-6)


def test_full_disk_keeps_previous_checkpoint(tmp_path, capsys):
    disk = tmp_path / "small"
    disk.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=480k", "tmpfs", str(disk)], capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root): " + r.stderr.decode().strip())
    try:
        plan = make_plan("gpt", dict(TINY_GPT, layers=1, hidden=16, vocab=32), dp=2)
        ck = str(disk / "ck")
        # One checkpoint of this model takes ~190 KB on disk: the third save runs out of space.
        rc = train(tmp_path, plan, 6, "--checkpoint-dir", ck, "--save-every", "1", "--keep-last", "3")
        err = capsys.readouterr().err
        assert rc == 1
        assert "saving checkpoint" in err or "publishing checkpoint" in err
        kept = list_checkpoints(ck)
        assert kept, "the checkpoints written before the disk filled must survive"
        load_model_tensors(kept[-1][1])  # still loadable
        assert not any(n.startswith(".tmp-") for n in os.listdir(ck))
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_rank_that_stops_answering_fails_the_run_within_the_timeout(tmp_path, capsys):
    plan = make_plan("gpt", dict(TINY_GPT), dp=2)
    path = write_plan(tmp_path / "plan.json", plan)
    t0 = time.monotonic()
    rc = train_with_hook(
        [
            path,
            "--nproc",
            "2",
            "--steps",
            "4",
            "--timeout",
            "5",
            "--compiled",
            str(tmp_path / "c"),
            "--no-memory-tracking",
        ],
        HangAt(rank=1, step=2),
    )
    elapsed = time.monotonic() - t0
    err = capsys.readouterr().err
    assert rc == 1
    assert "rank 0" in err and "over ranks [0, 1]" in err and "stopped answering" in err
    assert elapsed < 45
