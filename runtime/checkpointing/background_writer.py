"""Checkpoints written off the critical path: a thread writes what a step staged in host memory.

``checkpoint_io.stage`` runs in line with training (it is collective: the ZeRO shards are joined
over dp and the tensor-parallel pieces over tp on the training process groups) and leaves every
rank with a private host copy of its part. ``BackgroundWriter.submit`` hands that copy to a
thread, which runs ``checkpoint_io.write``: the DCP write into ``.tmp-step-N``, the agreement of
all ranks, rank 0's ``meta.json`` and the rename to ``step-N`` (the atomic marker: a folder
without it is invisible to ``--resume``), then retention.

Staging copies only this rank's own shard (no collective but the folder's creation), so a step
waits for a host copy; the join of the ZeRO shards over dp and of the tensor-parallel pieces over
tp runs in the thread too. Coordination: the thread's collectives (those joins, DCP's plan
exchange, the agreements, the gather of the tensor shapes) run on process groups of their own,
gloo groups with the members of the world and of the mesh's dp and tp groups, made by every rank
at set-up in the same order (``BackgroundWriter(...)`` is created by every rank of the run, or by
none; ``writer_groups``). The training collectives keep the training groups; two threads never
share one gloo group, whose messages would interleave. At most one write is in flight: ``wait`` (called before the next
save stages anything, and at the end of the run) joins it and returns its failure, the same
``CheckpointError`` on every rank, since the write's agreements are collective; the caller
decides what a failure does (``runtime.training.saving``).

A fault can be injected into the write (this thread's, or an in-line one) for tests and benchmarks: ``PLANNER_CHECKPOINT_FAULT``
(``runtime.contract.environment``) ``kill:N`` SIGKILLs every rank once its data of checkpoint
``N`` are written but before it is published (a kill in the middle of an asynchronous write);
``fail:N`` or ``fail:N:R`` makes the write of checkpoint ``N`` fail on every rank or on rank R
(as a full disk would: an ``OSError``, then the usual agreement).
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
import weakref
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from runtime.checkpointing.checkpoint_io import CheckpointError, JoinGroups, StagedCheckpoint, write
from runtime.contract import environment
from runtime.contract.rank_layout import axis_ranks

__all__ = ["BackgroundWriter", "fault_hook", "join_in_flight", "writer_groups"]

_WRITERS: weakref.WeakSet[BackgroundWriter] = weakref.WeakSet()
"""This process's writers, for ``join_in_flight``."""


def join_in_flight() -> None:
    """Block until every write in flight in this process has ended, leaving its outcome for the
    writer's ``wait``. For fault-injection hooks that stop a rank between steps
    (``tests/e2e/fault_hooks.py``): the save of the step before is then complete on disk, as a
    synchronous save would be."""
    for writer in list(_WRITERS):
        thread = writer._thread
        if thread is not None:
            thread.join()


def fault_hook(rank: int) -> Callable[[int], None] | None:
    """The write's fault-injection point for ``PLANNER_CHECKPOINT_FAULT`` on ``rank`` (module
    docstring); None when the variable is unset. A malformed value is a ``ValueError``."""
    value = environment.read(environment.CHECKPOINT_FAULT)
    if not value:
        return None
    parts = value.split(":")
    if parts[0] not in ("kill", "fail") or len(parts) not in (2, 3) or not all(p.isdigit() for p in parts[1:]):
        raise ValueError(
            f"{environment.CHECKPOINT_FAULT.name}={value!r}: expected kill:STEP, fail:STEP or fail:STEP:RANK"
        )
    kind, at_step = parts[0], int(parts[1])
    only_rank = int(parts[2]) if len(parts) == 3 else None

    def inject(step: int) -> None:
        if step != at_step or (only_rank is not None and only_rank != rank):
            return
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(errno.ENOSPC, f"injected fault ({environment.CHECKPOINT_FAULT.name}): no space left on device")

    return inject


def writer_groups(mesh, timeout_s: float) -> JoinGroups:
    """Gloo groups for the writer thread: the whole world, and a copy of each of the mesh's dp and
    tp groups (same members), this rank's returned. Collective: every rank creates every group, in
    the same order (``runtime.distributed.mesh.setup_mesh`` does the same for the training groups)."""
    if not dist.is_initialized():
        return JoinGroups()
    timeout = timedelta(seconds=timeout_s)
    rank = dist.get_rank()
    world = dist.new_group(backend="gloo", timeout=timeout)
    pp, dp, tp, cp = mesh.pp, mesh.dp, mesh.tp, mesh.cp
    mine = {}
    axes = {  # "dp": the ranks holding the same weights (dp * cp of them under context parallelism)
        "dp": axis_ranks("dp_cp", dp, tp, pp, cp),
        "tp": axis_ranks("tp", dp, tp, pp, cp),
    }
    for axis, member_lists in axes.items():
        if len(member_lists[0]) == 1:
            continue  # a one-rank axis: no gather
        for members in member_lists:
            group = dist.new_group(members, backend="gloo", timeout=timeout)
            if rank in members:
                mine[axis] = group
    return JoinGroups(world=world, dp=mine.get("dp"), tp=mine.get("tp"))


class BackgroundWriter:
    """At most one checkpoint write in flight, in a thread, coordinated on its own gloo group."""

    def __init__(self, rank: int, mesh, timeout_s: float):
        self.groups = writer_groups(mesh, timeout_s)  # every rank, in the same order (module docstring)
        self.fault = fault_hook(rank)
        self._thread: threading.Thread | None = None
        self._failure: CheckpointError | None = None
        _WRITERS.add(self)

    def submit(self, staged: StagedCheckpoint) -> None:
        """Write ``staged`` in the background. The previous write must have been waited for."""
        if self._thread is not None:
            raise RuntimeError("BackgroundWriter.submit: the previous write was not waited for")
        self._failure = None
        self._thread = threading.Thread(
            target=self._write, args=(staged,), name=f"checkpoint-writer-step-{staged.step}", daemon=True
        )
        self._thread.start()

    def _write(self, staged: StagedCheckpoint) -> None:
        try:
            write(staged, self.groups, after_data=self.fault)
        except CheckpointError as e:
            self._failure = e
        except Exception as e:  # noqa: BLE001 - reported like a failed write, never lost in the thread
            self._failure = CheckpointError(f"writing checkpoint {staged.final} failed ({type(e).__name__}: {e})")

    def wait(self) -> tuple[float, CheckpointError | None]:
        """Join the write in flight, if any: (seconds waited, its failure or None)."""
        if self._thread is None:
            return 0.0, None
        start = time.perf_counter()
        self._thread.join()
        self._thread = None
        failure, self._failure = self._failure, None
        return time.perf_counter() - start, failure
