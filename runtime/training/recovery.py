"""Recovery, measured: a heartbeat per step, and what a restart cost.

Rank 0 of a run with a checkpoint folder rewrites ``DIR/heartbeat.json`` after every step
(``write_heartbeat``: the steps done and the wall-clock time, atomically), and marks it finished
when the run ends normally. A run that resumes reads it first (``RecoveryClock.start``): when the
last run did not finish, its last heartbeat is the failure (the run died after that step and
before the next one's end); the failure time is that heartbeat's, and the last step completed
before the failure is its step. After the first step of the resumed run completes,
``RecoveryClock.measure`` gives

- ``recovery_s``: seconds from the failure to that first completed step (detection, the relaunch,
  re-planning and compiling if any, loading the checkpoint, and one step);
- ``steps_lost``: the last step completed before the failure minus the step resumed at (work
  done again).

Without a heartbeat (a folder written before heartbeats existed) the newest checkpoint's write
time stands for the failure and the steps lost are unknown (None). The times are wall-clock
(``time.time``): across nodes they assume synchronized clocks.

``kill_hook`` reads ``PLANNER_FAULT_KILL`` (``RANK:STEP``), the fault injection that works under
torchrun, where no Python hook can be passed in: that rank SIGKILLs itself before step index STEP,
on the first launch only (torchrun's ``TORCHELASTIC_RESTART_COUNT`` unset or 0), so the restarted
workers run on.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass
from typing import Callable

from runtime.checkpointing.background_writer import join_in_flight
from runtime.contract import environment

__all__ = ["HEARTBEAT_FILE", "write_heartbeat", "read_heartbeat", "RecoveryClock", "kill_hook", "describe_recovery"]

HEARTBEAT_FILE = "heartbeat.json"
"""The heartbeat's name inside the checkpoint folder."""


def write_heartbeat(directory: str, step: int, finished: bool = False) -> None:
    """Record that ``step`` steps are done now (``finished``: the run ended normally). Atomic: a
    reader sees the previous heartbeat or this one. A beat that cannot be written (a full disk)
    is skipped: the checkpoint that fills the disk says so (``CheckpointError``, the earlier
    checkpoints intact), where this write, beside a save in flight, would fail first and
    stop the run with a bare ``OSError``."""
    path = os.path.join(directory, HEARTBEAT_FILE)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        os.makedirs(directory, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as out:
            json.dump({"step": step, "time": time.time(), "finished": finished}, out)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)


def read_heartbeat(directory: str) -> dict | None:
    """The last heartbeat of ``directory`` (``step``, ``time``, ``finished``), None when absent or unreadable."""
    try:
        with open(os.path.join(directory, HEARTBEAT_FILE), encoding="utf-8") as f:
            beat = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(beat, dict) or not isinstance(beat.get("step"), int) or not isinstance(beat.get("time"), float):
        return None
    return beat


@dataclass
class RecoveryClock:
    """What a resumed run knows of the failure it recovers from (``start``); ``measure`` after its
    first completed step."""

    failure_time: float
    """Wall-clock time of the failure: the last heartbeat, or the newest checkpoint's write."""
    failed_after_step: int | None
    """The last step completed before the failure (None: unknown, no heartbeat)."""
    resumed_step: int
    """The step the run resumed at (the checkpoint's)."""

    @classmethod
    def start(cls, directory: str, resumed_step: int, checkpoint_path: str | None) -> "RecoveryClock | None":
        """The clock of a run resuming at ``resumed_step`` from ``directory``; None when the last
        run finished normally (nothing failed) or nothing at all is known of it."""
        beat = read_heartbeat(directory)
        if beat is not None:
            if beat.get("finished"):
                return None
            return cls(float(beat["time"]), int(beat["step"]), resumed_step)
        if checkpoint_path is None:
            return None
        written = os.path.join(checkpoint_path, "meta.json")
        return cls(os.path.getmtime(written), None, resumed_step) if os.path.exists(written) else None

    def measure(self, now: float | None = None) -> dict:
        """The recovery's fields (``recovery_s``, ``steps_lost``, ``failed_after_step``,
        ``resumed_step``), at ``now`` (default: the present), just after the first step completed."""
        now = time.time() if now is None else now
        lost = None if self.failed_after_step is None else max(0, self.failed_after_step - self.resumed_step)
        return {
            "recovery_s": round(now - self.failure_time, 3),
            "steps_lost": lost,
            "failed_after_step": self.failed_after_step,
            "resumed_step": self.resumed_step,
        }


def describe_recovery(fields: dict) -> str:
    """``recovered in 7.3 s (failure after step 5, resumed at step 4): 1 step(s) lost``."""
    lost = (
        "steps lost unknown (no heartbeat)" if fields["steps_lost"] is None else f"{fields['steps_lost']} step(s) lost"
    )
    after = "" if fields["failed_after_step"] is None else f"failure after step {fields['failed_after_step']}, "
    return f"recovered in {fields['recovery_s']:.1f} s ({after}resumed at step {fields['resumed_step']}): {lost}"


def kill_hook() -> Callable[[int, int], None] | None:
    """The ``PLANNER_FAULT_KILL`` step hook (module docstring), None when unset or on a restart."""
    value = environment.read(environment.FAULT_KILL)
    if not value or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return None
    try:
        rank_text, step_text = value.split(":")
        target_rank, target_step = int(rank_text), int(step_text)
    except ValueError:
        raise ValueError(f"{environment.FAULT_KILL.name} must be RANK:STEP (two integers), got {value!r}") from None

    def kill(rank: int, step: int) -> None:
        if rank == target_rank and step == target_step:
            join_in_flight()  # as KillAt does: the checkpoint of the step before is complete
            os.kill(os.getpid(), signal.SIGKILL)

    return kill
