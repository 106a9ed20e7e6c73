"""Fault injection for the training tests: step hooks that kill or hang one rank, and
``train_with_hook``, which runs ``planner train`` with one.

``runtime.training.trainer.train_worker`` calls its ``on_step_start(rank, step)`` hook on every rank before
each step (``step`` counts from 0: the steps already done); ``planner.commands.train.run_train``
passes one through to every rank. The hooks here are frozen dataclasses, so they pickle into the
spawned ranks (which import this module to unpickle them).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

from planner.cli import build_parser, user_errors
from planner.commands.train import run_train
from runtime.checkpointing.background_writer import join_in_flight
from runtime.training.trainer import StepHook

__all__ = ["KillAt", "HangAt", "RaiseAt", "train_with_hook"]


@dataclass(frozen=True)
class KillAt:
    """SIGKILL rank ``rank`` just before it runs step index ``step`` (after ``step`` steps, and any
    checkpoint saved at that step, are done: a background write in flight is joined first): a rank
    lost without any error report. ``PLANNER_CHECKPOINT_FAULT=kill:N`` kills in the middle of a write."""

    rank: int
    step: int

    def __call__(self, rank: int, step: int) -> None:
        if rank == self.rank and step == self.step:
            join_in_flight()
            os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class HangAt:
    """Rank ``rank`` stops answering (sleeps an hour) at step index ``step``: its peers wait in a
    collective until the collective timeout."""

    rank: int
    step: int

    def __call__(self, rank: int, step: int) -> None:
        if rank == self.rank and step == self.step:
            time.sleep(3600)


@dataclass(frozen=True)
class RaiseAt:
    """Rank ``rank`` raises at step index ``step``: a model or data error inside one rank."""

    rank: int
    step: int

    def __call__(self, rank: int, step: int) -> None:
        if rank == self.rank and step == self.step:
            raise RuntimeError(f"injected failure on rank {rank}")


def train_with_hook(argv: list[str], hook: StepHook) -> int:
    """``planner train *argv`` as ``planner.cli.main`` runs it (bad input: exit 2 and one line on
    stderr), with ``hook`` called on every rank before every step."""
    args = build_parser().parse_args(["train", *argv])
    try:
        return run_train(args, on_step_start=hook)
    except user_errors() as e:
        print(f"planner train: error: {e}", file=sys.stderr)
        return 2
