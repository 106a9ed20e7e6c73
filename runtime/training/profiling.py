"""What the trainer measures around each step besides time: peak memory and operator profiles.

``StepProbes`` wraps one training step (``around``) and reports the step's peak memory after it
(``peak_after``):

- **peak memory** (``TrainOptions.track_memory``): a ``runtime.training.memtrack.MemoryTracker`` of the
  rank's live tensors, entered for the step. With ``TrainOptions.memory_steps = N`` only the
  first N steps of the run are tracked (the tracker slows every operator down) and later steps
  report the largest peak seen; otherwise each step reports its own peak.
  ``PLANNER_DEBUG_MEMORY=1`` prints, per tracked step, the peak, the operator at which it
  occurred and the bytes live at the end (stderr).
- **operator profile** (``PLANNER_PROFILE=DIR``): step ``PROFILE_STEP`` of the run runs under
  ``torch.profiler``; each rank writes its operator table (by self time) and a Chrome trace to
  ``DIR/rank<r>-step<s>.txt`` and ``.json``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable, Iterable, Iterator

import torch

from runtime.contract import environment
from runtime.training.memtrack import MemoryTracker

__all__ = ["PROFILE_STEP", "StepProbes", "start_profiler", "write_profile"]

#: The step (counted from the run's first) that ``PLANNER_PROFILE=DIR`` profiles: the first after
#: two warm-up steps, as ``planner validate`` times them.
PROFILE_STEP = 2


def start_profiler(index: int):
    """A running ``torch.profiler`` for the run's step ``index`` when ``PLANNER_PROFILE`` asks for
    it, else None."""
    if not environment.read(environment.PROFILE) or index != PROFILE_STEP:
        return None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=activities)
    prof.__enter__()
    return prof


def write_profile(prof, rank: int, step: int) -> None:
    """Stop ``prof``; write this rank's operator table (by self time) and a Chrome trace."""
    prof.__exit__(None, None, None)
    out = environment.read(environment.PROFILE)
    os.makedirs(out, exist_ok=True)
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    with open(os.path.join(out, f"rank{rank}-step{step}.txt"), "w", encoding="utf-8") as f:
        f.write(prof.key_averages().table(sort_by=key, row_limit=50))
    prof.export_chrome_trace(os.path.join(out, f"rank{rank}-step{step}.json"))


class StepProbes:
    """Peak-memory tracking and the ``PLANNER_PROFILE`` profiler around one rank's steps."""

    def __init__(
        self,
        rank: int,
        device: torch.device,
        track_memory: bool,
        memory_steps: int | None,
        resident: Iterable[torch.Tensor],
        host: Iterable[torch.Tensor] = (),
    ):
        """``resident``: the tensors alive before the first step (parameters, optimizer state),
        counted in every peak. ``host``: host-tier tensors of an offloaded run, never counted
        (``peak_memory_bytes`` is device memory). ``memory_steps``: see
        ``TrainOptions.memory_steps``."""
        self.rank = rank
        self.memory_steps = memory_steps
        self.tracker: MemoryTracker | None = None
        if track_memory:
            self.tracker = MemoryTracker(device=device)
            self.tracker.exclude(list(host))
            self.tracker.track_existing(list(resident))
        self.last_peak = 0
        """The peak reported for the latest step (0 until a step is tracked)."""

    def tracks(self, index: int) -> bool:
        """Whether the run's step ``index`` (0: the first step of this run) is memory-tracked."""
        return self.tracker is not None and (self.memory_steps is None or index < self.memory_steps)

    @contextlib.contextmanager
    def around(self, index: int, step: int, settle: Callable[[], None] | None = None) -> Iterator[None]:
        """Run the body (the run's step ``index``, global step ``step``, 0-based) under the tracker
        and the profiler that apply to it. ``settle`` waits for the collectives the body left in
        flight (ZeRO 1/2's parameter gathers for the next forward): called before a profiler
        stops, since the profiler's callbacks on a collective launched under it do not outlive
        it (waiting after the stop crashed the rank, about one profiled run in fifteen)."""
        tracker = self.tracker if self.tracks(index) else None
        if tracker is not None:
            tracker.reset_peak()
            tracker.__enter__()
        prof = start_profiler(index)
        try:
            yield
        finally:
            if prof is not None:
                if settle is not None:
                    settle()
                write_profile(prof, self.rank, step + 1)
            if tracker is not None:
                tracker.__exit__(None, None, None)

    def peak_after(self, index: int, step: int) -> int:
        """The peak live bytes to report for the step just run (see the module docstring)."""
        tracked = self.tracker
        if tracked is None or not self.tracks(index):
            return self.last_peak
        self.last_peak = (
            max(self.last_peak, tracked.peak_bytes) if self.memory_steps is not None else tracked.peak_bytes
        )
        if environment.read(environment.DEBUG_MEMORY):
            print(
                f"[planner] rank {self.rank} step {step + 1}: peak {tracked.peak_bytes / 2**20:.2f} MiB after "
                f"{tracked.peak_op or '(step start)'}; {tracked.current_bytes / 2**20:.2f} MiB live at the end",
                file=sys.stderr,
                flush=True,
            )
        return self.last_peak
