"""Heartbeats, the recovery clock, the environment's kill hook and the data checksum."""

from __future__ import annotations

import os
import time

import pytest
import torch

from runtime.contract import environment
from runtime.training.data import CHECKSUM_MODULUS, SyntheticTokens, batch_checksum
from runtime.training.recovery import RecoveryClock, describe_recovery, kill_hook, read_heartbeat, write_heartbeat


def test_the_last_heartbeat_of_an_unfinished_run_is_the_failure(tmp_path):
    directory = str(tmp_path)
    assert RecoveryClock.start(directory, 0, None) is None
    write_heartbeat(directory, 6)
    beat = read_heartbeat(directory)
    assert beat is not None and beat["step"] == 6 and not beat["finished"]
    clock = RecoveryClock.start(directory, 4, None)
    assert clock is not None
    fields = clock.measure(now=beat["time"] + 2.5)
    assert fields == {"recovery_s": 2.5, "steps_lost": 2, "failed_after_step": 6, "resumed_step": 4}
    assert describe_recovery(fields) == "recovered in 2.5 s (failure after step 6, resumed at step 4): 2 step(s) lost"
    write_heartbeat(directory, 8, finished=True)  # a run that ended normally failed nowhere
    assert RecoveryClock.start(directory, 8, None) is None


def test_without_heartbeat_the_checkpoint_write_time_stands_for_the_failure(tmp_path):
    checkpoint = tmp_path / "step-000004"
    checkpoint.mkdir()
    (checkpoint / "meta.json").write_text("{}")
    written = time.time() - 10
    os.utime(checkpoint / "meta.json", (written, written))
    clock = RecoveryClock.start(str(tmp_path), 4, str(checkpoint))
    assert clock is not None
    fields = clock.measure()
    assert fields["steps_lost"] is None and 9 < fields["recovery_s"] < 60
    assert "steps lost unknown" in describe_recovery(fields)


def test_a_heartbeat_that_cannot_be_written_is_skipped(tmp_path, monkeypatch):
    """A full disk fails the beat beside a checkpoint save in flight: the save reports it (its
    CheckpointError), the beat neither raises nor leaves its temporary file."""
    write_heartbeat(str(tmp_path), 3)
    real_dump = __import__("json").dump

    def full(obj, out, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("runtime.training.recovery.json.dump", full)
    write_heartbeat(str(tmp_path), 4)  # no exception
    monkeypatch.setattr("runtime.training.recovery.json.dump", real_dump)
    assert read_heartbeat(str(tmp_path))["step"] == 3  # the previous beat stands
    assert not [name for name in os.listdir(tmp_path) if ".tmp" in name]
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    write_heartbeat(str(blocked / "ck"), 1)  # not a directory: skipped too


def test_kill_hook_reads_rank_and_step_and_spares_restarts(monkeypatch):
    monkeypatch.delenv(environment.FAULT_KILL.name, raising=False)
    assert kill_hook() is None
    monkeypatch.setenv(environment.FAULT_KILL.name, "1:3")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert kill_hook() is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    hook = kill_hook()
    assert hook is not None
    hook(0, 3)  # another rank, another step: nothing happens
    hook(1, 2)
    monkeypatch.setenv(environment.FAULT_KILL.name, "three")
    with pytest.raises(ValueError, match="RANK:STEP"):
        kill_hook()


def test_checksums_of_rank_slices_add_up_to_the_global_batch():
    data = SyntheticTokens(vocab=50, seq_len=12, seed=3)
    whole, _ = data.rows(5, 0, 8, 8)
    parts = [batch_checksum(data.rows(5, lo, lo + 2, 8)[0], lo) for lo in range(0, 8, 2)]
    assert sum(parts) % CHECKSUM_MODULUS == batch_checksum(whole, 0)
    assert batch_checksum(data.rows(6, 0, 8, 8)[0], 0) != batch_checksum(whole, 0)
    swapped = torch.cat([whole[1:2], whole[0:1], whole[2:]])  # the same samples in another order
    assert batch_checksum(swapped, 0) != batch_checksum(whole, 0)


def test_a_failed_save_says_which_checkpoints_it_left(tmp_path):
    """A failed save names the latest checkpoint that survives, or says there is none (it said
    'the earlier checkpoints are intact' when no checkpoint had been saved)."""
    from runtime.checkpointing.checkpoint_io import earlier

    assert earlier(str(tmp_path / "missing")) == "no earlier checkpoint was saved in it"
    (tmp_path / "afile").write_text("x")
    assert earlier(str(tmp_path / "afile")) == "no earlier checkpoint was saved in it"
    for step in (4, 8):
        folder = tmp_path / "ckpt" / f"step-{step:06d}"
        folder.mkdir(parents=True)
        (folder / "meta.json").write_text("{}")
    assert earlier(str(tmp_path / "ckpt")) == "the earlier checkpoints are intact (the latest: step 8)"
