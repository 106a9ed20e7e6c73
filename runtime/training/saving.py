"""When a run saves, how, and what a failed save does: checkpoints, snapshots and save errors.

After each step the trainer calls ``Saver.after_step``; it returns the seconds the step waited
for checkpointing (the metrics' ``checkpoint_s``):

- a **checkpoint** every ``save_every`` steps and at the last step, into ``checkpoint_dir``
  (``keep_last`` complete ones kept);
- a **snapshot** every ``snapshot_every`` steps (when no checkpoint is due at that step): the
  staged state is kept in host memory, replacing the previous snapshot, and, with
  ``snapshot_dir``, written there in the checkpoint format (only the newest complete one kept).
  ``--resume`` takes the newest complete one of both folders. An in-memory snapshot lives only as
  long as the process: nothing in this runtime restarts in-process, so only a snapshot written to
  ``snapshot_dir`` helps after a failure; the in-memory copy is what such a restart would read.

Either save first waits for the write in flight (at most one), then stages this rank's state in
host memory (``checkpoint_io.stage``: a copy, and the folder's creation, collective) and, with
``async_checkpoint`` on, hands it to the ``runtime.checkpointing.background_writer`` thread,
which joins the shards and writes; off, it joins and writes in line. The last step also waits for
its write, so a finished run has its last checkpoint on disk.

A failed save (a folder that cannot be created, a write that fails on any rank) is the same
``CheckpointError`` on every rank, because staging and writing agree collectively; a background
failure surfaces at the next save or at the end. ``on_save_error`` ``stop`` raises it (the run
exits 1 naming the folder and the cause), ``continue`` logs it on rank 0 (a ``save_error`` event
line, one line on stderr) and trains on. Either way the earlier checkpoints stay.
"""

from __future__ import annotations

import os
import sys
import time

from runtime.checkpointing import checkpoint_io
from runtime.checkpointing.background_writer import BackgroundWriter, fault_hook
from runtime.checkpointing.checkpoint_io import CheckpointError, JoinGroups, StagedCheckpoint
from runtime.contract.choices import Toggle
from runtime.training.events import write_event
from runtime.training.train_config import TrainOptions

__all__ = ["Saver", "resume_point", "describe"]


def resume_point(opts: TrainOptions) -> tuple[int, str, str] | None:
    """The newest complete checkpoint or snapshot a ``--resume`` continues from, as (step, path,
    source: ``checkpoint`` or ``snapshot``); None when there is none."""
    return checkpoint_io.newest({"checkpoint": opts.checkpoint_dir, "snapshot": opts.snapshot_dir})


class Saver:
    """One rank's saving policy (module docstring); every rank makes the same calls."""

    def __init__(self, opts: TrainOptions, engine, manifest: dict, mesh, rank: int, schedule: dict):
        self.opts, self.engine, self.manifest, self.mesh, self.rank = opts, engine, manifest, mesh, rank
        self.schedule = schedule
        wants_writes = bool(opts.checkpoint_dir and opts.save_every) or bool(opts.snapshot_dir and opts.snapshot_every)
        self.writer = (
            BackgroundWriter(rank, mesh, opts.timeout_s)
            if wants_writes and opts.async_checkpoint == Toggle.ON
            else None
        )
        self.fault = fault_hook(rank)
        """The write's fault-injection point (``PLANNER_CHECKPOINT_FAULT``), for in-line writes too."""
        self.snapshot: StagedCheckpoint | None = None
        """The newest snapshot (or checkpoint) staged in host memory: this rank's part of the state."""

    def _due(self, done: int) -> tuple[str, int] | None:
        """(folder, keep) of the save due after ``done`` steps: "" for a snapshot kept in memory."""
        opts = self.opts
        if opts.checkpoint_dir and opts.save_every and (done % opts.save_every == 0 or done == opts.steps):
            return opts.checkpoint_dir, opts.keep_last
        if opts.snapshot_every and done % opts.snapshot_every == 0:
            return opts.snapshot_dir or "", 1
        return None

    def after_step(self, step: int) -> float:
        """Save what is due after step ``step`` (0-based); the seconds this waited for checkpointing."""
        done = step + 1
        due = self._due(done)
        if due is None:
            return 0.0
        start = time.perf_counter()
        self._settle(self._wait())
        directory, keep = due
        try:
            staged = checkpoint_io.stage(
                directory, done, self.engine, self.manifest, self.mesh, keep_last=keep, schedule=self.schedule
            )
            if self.opts.snapshot_every:
                self.snapshot = staged
            if directory and self.writer is not None:
                self.writer.submit(staged)
            elif directory:
                checkpoint_io.write(staged, JoinGroups(dp=self.mesh.dp_cp_group, tp=self.mesh.tp_group), self.fault)
        except CheckpointError as e:
            self._settle(e)
        if done == self.opts.steps:  # the run's end: its last save must be on disk
            self._settle(self._wait())
        return time.perf_counter() - start

    def finish(self) -> float:
        """Wait for the write in flight (a run that ends between saves); the seconds waited."""
        start = time.perf_counter()
        self._settle(self._wait())
        return time.perf_counter() - start

    def _wait(self) -> CheckpointError | None:
        if self.writer is None:
            return None
        return self.writer.wait()[1]

    def _settle(self, failure: CheckpointError | None) -> None:
        """A failed save: raise it (``stop``) or log it on rank 0 and go on (``continue``)."""
        if failure is None:
            return
        if self.opts.on_save_error == "stop":
            raise failure
        if self.rank == 0:
            write_event(self.opts.metrics_path, "save_error", str(failure))
            print(f"planner train: save failed, training continues: {failure}", file=sys.stderr, flush=True)


def describe(point: tuple[int, str, str]) -> str:
    """``checkpoint step-000120``: what a resume continues from, for messages."""
    step, path, source = point
    return f"{source} {os.path.basename(path)}"
