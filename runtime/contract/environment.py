"""Every ``PLANNER_*`` environment variable, declared once with its default and meaning.

Code reads a variable through ``read`` (never ``os.environ`` with a literal name), so this table is
the complete list; the README's "Environment variables" section is written from it and a test
checks that the two agree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = [
    "EnvVar",
    "VARIABLES",
    "CACHE",
    "CACHE_DIR",
    "SOLVER",
    "START_METHOD",
    "NUM_THREADS",
    "HOST_ALLOCATOR",
    "COMPILE_BACKEND",
    "DEBUG_MEMORY",
    "PROFILE",
    "FAULT_KILL",
    "CHECKPOINT_FAULT",
    "read",
    "is_off",
]


@dataclass(frozen=True)
class EnvVar:
    """One environment variable the project reads."""

    name: str
    """The variable, ``PLANNER_...``."""
    default: str
    """Its value when unset or empty."""
    doc: str
    """What it changes (one sentence, for the README)."""
    read_by: str
    """The module that reads it."""


CACHE = EnvVar(
    "PLANNER_CACHE",
    "on",
    "`off` (or `0`, `false`, `no`) turns the planner's caches (layer tables, schedule programs) off.",
    "planner.frontend.cache",
)
CACHE_DIR = EnvVar(
    "PLANNER_CACHE_DIR",
    "",
    "The planner's cache folder (default `$XDG_CACHE_HOME/planner`, else `~/.cache/planner`).",
    "planner.frontend.cache",
)
SOLVER = EnvVar(
    "PLANNER_SOLVER",
    "cbc",
    "The ILP solver: `cbc` (pulp's bundled CBC) or `highs` (needs `highspy`). Models whose blocks all cost "
    "the same (most transformers) are partitioned by counting, without a solver.",
    "planner.search.ilp",
)
START_METHOD = EnvVar(
    "PLANNER_START_METHOD",
    "",
    "How local ranks start: a multiprocessing start method (default `forkserver`, else `spawn`).",
    "runtime.distributed.launch",
)
NUM_THREADS = EnvVar(
    "PLANNER_NUM_THREADS",
    "",
    "Intra-op threads per local rank (default: the machine's cores shared by the ranks).",
    "runtime.distributed.launch",
)
HOST_ALLOCATOR = EnvVar(
    "PLANNER_HOST_ALLOCATOR",
    "",
    "`system` keeps glibc's default heap settings (by default a rank keeps its peak heap, "
    "so steady steps fault in no fresh pages).",
    "runtime.distributed.launch",
)
COMPILE_BACKEND = EnvVar(
    "PLANNER_COMPILE_BACKEND",
    "inductor",
    "The `torch.compile` backend of compiled stages (`aot_eager` skips code generation).",
    "runtime.stages.compile_layers",
)
DEBUG_MEMORY = EnvVar(
    "PLANNER_DEBUG_MEMORY",
    "",
    "Any value prints each tracked step's peak memory, the operator at the peak and the bytes "
    "live at the end (stderr).",
    "runtime.training.profiling",
)
PROFILE = EnvVar(
    "PLANNER_PROFILE",
    "",
    "A folder: one step of the run runs under `torch.profiler`, and each rank writes its operator "
    "table and a Chrome trace there.",
    "runtime.training.profiling",
)
CHECKPOINT_FAULT = EnvVar(
    "PLANNER_CHECKPOINT_FAULT",
    "",
    "Fault injection for tests: `kill:N` SIGKILLs every rank in the middle of writing checkpoint "
    "step N (data written, not yet published), `fail:N[:RANK]` makes that write fail (on one rank).",
    "runtime.checkpointing.background_writer",
)

FAULT_KILL = EnvVar(
    "PLANNER_FAULT_KILL",
    "",
    "Fault injection for tests: `RANK:STEP` makes that rank SIGKILL itself before step index STEP "
    "(once a checkpoint write in flight has ended), on a run's first launch only (not on torchrun's restarts).",
    "runtime.training.recovery",
)

VARIABLES: tuple[EnvVar, ...] = (
    CACHE,
    CACHE_DIR,
    SOLVER,
    START_METHOD,
    NUM_THREADS,
    HOST_ALLOCATOR,
    COMPILE_BACKEND,
    DEBUG_MEMORY,
    PROFILE,
    FAULT_KILL,
    CHECKPOINT_FAULT,
)
"""Every variable, in the README's order."""

_OFF = ("off", "0", "false", "no", "disable", "disabled")


def read(var: EnvVar) -> str:
    """The variable's value, stripped, or its default when unset or empty."""
    return os.environ.get(var.name, "").strip() or var.default


def is_off(var: EnvVar) -> bool:
    """True when the variable says off (``off``, ``0``, ``false``, ``no``, ``disable[d]``)."""
    return read(var).lower() in _OFF
