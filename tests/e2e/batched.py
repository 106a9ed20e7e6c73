"""Many training runs in few process launches: the suite's main cost is starting gloo ranks (a
fork, gloo's rendezvous, the model's imports: transformers alone is seconds), so the equivalence
matrices compile every case in the test process and train all cases of one world size in one
spawn, one after another (each run builds its own mesh and groups, as ``planner tune``'s trials
do). A failing run fails the spawn, naming the rank and the case it was training.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence

import torch

from planner.commands.compile import compile_plan
from planner.commands.train import original_state
from planner.plan import Plan
from runtime.checkpointing.checkpoint_io import list_checkpoints, load_model_tensors
from runtime.distributed.launch import launch_local
from runtime.training.train_config import TrainOptions
from runtime.training.trainer import train_worker
from tests.helpers import read_metrics

__all__ = ["Run", "options", "train_together", "run_result"]


@dataclasses.dataclass(frozen=True)
class Run:
    """One case: its plan, its folder (compiled stages, metrics, checkpoints) and its options;
    ``stages``: compiled stages elsewhere (a run resuming another's checkpoint under a new plan)."""

    name: str
    plan: Plan
    folder: str
    opts: TrainOptions
    stages: str | None = None

    @property
    def compiled(self) -> str:
        return self.stages or os.path.join(self.folder, "compiled")


def options(folder: str, steps: int, **settings) -> TrainOptions:
    """What ``planner train --steps N --metrics F --checkpoint-dir D --save-every N
    --no-memory-tracking --timeout 60`` sets, plus ``settings`` (``eps``, ``lr``, ``resume``,
    ``overlap``...): metrics and a checkpoint after the last step in ``folder``."""
    values = dict(
        steps=steps,
        metrics_path=os.path.join(folder, "m.jsonl"),
        checkpoint_dir=os.path.join(folder, "ck"),
        save_every=steps,
        track_memory=False,
        progress=False,
        timeout_s=60,
    )
    return TrainOptions(**{**values, **settings})


def _world(plan: Plan) -> int:
    return plan.dp * plan.cp * plan.tp * plan.pp


def _train_each(rank: int, world: int, runs: Sequence[Run]) -> None:
    for run in runs:
        plan = run.plan
        state = functools.partial(original_state, plan.model.spec, dict(plan.model.sizes), plan.seq_len, run.opts.seed)
        try:
            train_worker(rank, world, run.compiled, run.opts, state)
        except Exception as e:
            raise RuntimeError(f"case {run.name}: {type(e).__name__}: {e}") from e


def train_together(runs: Sequence[Run], *, compile_runs: bool = True, timeout_s: float = 600.0) -> None:
    """Compile every run (unless its stages are already there) and train them: one spawn per world
    size, in the order given (a resumed run follows the run whose checkpoint it reads)."""
    by_world: dict[int, list[Run]] = {}
    for run in runs:
        if compile_runs and not os.path.exists(os.path.join(run.compiled, "manifest.json")):
            compile_plan(run.plan, run.compiled)
        by_world.setdefault(_world(run.plan), []).append(run)
    for world, todo in by_world.items():
        launch_local(_train_each, world, (todo,), timeout_s=timeout_s, collective_timeout_s=60)


def run_result(folder: str, step: int | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A trained run's losses (every step in its metrics file) and its parameters after ``step``
    (default: its only checkpoint)."""
    losses = [row["loss"] for row in read_metrics(os.path.join(folder, "m.jsonl"))]
    checkpoints = dict(list_checkpoints(os.path.join(folder, "ck")))
    if step is None:
        ((step, _),) = checkpoints.items()
    return losses, load_model_tensors(checkpoints[step])
