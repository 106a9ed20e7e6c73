"""Where a step's time goes: the measured counterpart of plan.json's ``predicted.time``.

``PARTS`` are the keys of the breakdown, the same as ``predicted.time`` (``planner.plan.TIME_KEYS``;
a test keeps the two equal, so a part added to the prediction must be measured here too). Every
second of a step belongs to exactly one part:

- ``compute``: forward and backward of the stage's layers, and everything not inside another part
  (the residual: the step time minus the other parts);
- ``recompute``: a layer's forward run again inside backward (activation checkpointing), timed by
  the forward hooks ``time_recomputation`` puts on the stage's layers;
- ``tp_comm``, ``dp_comm``, ``pp_bubble``, ``ep_comm``: the time this rank was *blocked* in a collective of
  the tensor-parallel, data-parallel (and tied-weight), pipeline or expert-parallel group (``runtime.distributed.comm`` asks
  ``part_of(group)``; ``runtime.distributed.mesh`` registers the groups). Communication that overlaps compute
  is not blocking and counts where the overlapping work does. A pipeline rank blocked in a receive
  is waiting for its neighbour: the bubble and the transfer, as the prediction's ``pp_bubble``;
- ``optimizer``: ``ZeroEngine.step`` and ``zero_grad`` (the trainer wraps them), wherever the
  step runs: the CPU AdamW step when the optimizer state is offloaded (``runtime.data_parallel.offload_engine``);
- ``offload``: time blocked on offload transfers that did not overlap compute: device <-> host
  copies of gradients, masters and parameter shards, and waits for NVMe reads and writes
  (``runtime.data_parallel.offload_engine`` enters it around every such wait).

Attribution is exclusive: parts nest on a stack and only the innermost one runs its clock, so a
data-parallel all-gather inside the optimizer step counts once, in ``dp_comm``, and a
tensor-parallel all-reduce inside a recomputed forward once, in ``tp_comm``. The parts of a step
therefore sum to its time exactly.

On a GPU a wall clock around asynchronous work measures its launch, not the work. When the
trainer runs on CUDA it sets ``TIMER.sync = torch.cuda.synchronize``: every part boundary then
waits for the device, so work launched in one part is paid in that part. The cost: each boundary
(every blocking collective, every recomputed layer) drains the device queue, which removes the
overlap of host launches with device work there and slows the step by some launch latency per
boundary.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator, NamedTuple

import torch

__all__ = [
    "PARTS",
    "AXIS_PARTS",
    "Breakdown",
    "PartTimer",
    "TIMER",
    "part",
    "register_group",
    "forget_groups",
    "part_of",
    "time_recomputation",
]

#: The parts of a step, in plan.json ``predicted.time`` order; the one list the runtime measures.
PARTS: tuple[str, ...] = (
    "compute",
    "recompute",
    "tp_comm",
    "pp_bubble",
    "dp_comm",
    "optimizer",
    "offload",
    "ep_comm",
    "cp_comm",
)

#: The part whose clock runs when no other part is entered.
RESIDUAL = "compute"

#: The part each kind of process group's blocking collectives count in (``register_group``).
AXIS_PARTS: dict[str, str] = {
    "tp": "tp_comm",
    "dp": "dp_comm",
    "tied": "dp_comm",
    "pp": "pp_bubble",
    "ep": "ep_comm",
    "cp": "cp_comm",
}


class Breakdown(NamedTuple):
    """One step's time, ``seconds``, and its split over ``PARTS`` (``parts`` sums to it)."""

    seconds: float
    parts: dict[str, float]


class PartTimer:
    """A per-process timer of a step's parts with exclusive attribution (see the module docstring).

    ``start()`` opens a step, ``enter(part)`` / ``exit()`` (or ``with timer.part(name)``) nest
    parts, ``stop()`` closes the step and returns its ``Breakdown``. Outside a step, entering a
    part does nothing, so collectives of set-up or checkpointing cost nothing here.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.sync: Callable[[], None] | None = None
        """Called before every clock reading (``torch.cuda.synchronize`` on a GPU: see the module
        docstring); None on CPU."""
        self._lock = threading.Lock()  # CUDA backward runs hooks on autograd's device threads
        self._active = False
        self._stack: list[str] = [RESIDUAL]
        self._totals = dict.fromkeys(PARTS, 0.0)
        self._start = self._mark = 0.0

    @property
    def active(self) -> bool:
        """Whether a step is being timed."""
        return self._active

    def _now(self) -> float:
        if self.sync is not None:
            self.sync()
        return self.clock()

    def _charge(self, now: float) -> None:
        """Give the time since the last boundary to the innermost part (lock held)."""
        self._totals[self._stack[-1]] += now - self._mark
        self._mark = now

    def start(self) -> None:
        """Open a step: every part at 0, the residual's clock running."""
        now = self._now()
        with self._lock:
            self._totals = dict.fromkeys(PARTS, 0.0)
            self._stack = [RESIDUAL]
            self._start = self._mark = now
            self._active = True

    def enter(self, name: str) -> bool:
        """Pause the current part and run ``name``'s clock; whether it was entered (False outside
        a step). Each entered part must be left with ``exit``."""
        if name not in self._totals:
            raise ValueError(f"unknown part {name!r}; the parts are {', '.join(PARTS)}")
        if not self._active:
            return False
        now = self._now()
        with self._lock:
            if not self._active:
                return False
            self._charge(now)
            self._stack.append(name)
        return True

    def exit(self) -> None:
        """Leave the innermost part; the enclosing one's clock runs again. A no-op after ``stop``
        (a part left open by an exception is closed by it)."""
        if not self._active:
            return
        now = self._now()
        with self._lock:
            if self._active and len(self._stack) > 1:
                self._charge(now)
                self._stack.pop()

    @contextlib.contextmanager
    def part(self, name: str | None) -> Iterator[None]:
        """Run the body in part ``name`` (None: in whatever part encloses it)."""
        entered = name is not None and self.enter(name)
        try:
            yield
        finally:
            if entered:
                self.exit()

    def stop(self) -> Breakdown:
        """Close the step (and any part still open); its time and parts."""
        now = self._now()
        with self._lock:
            if self._active:
                self._charge(now)
            self._active = False
            self._stack = [RESIDUAL]
            return Breakdown(now - self._start, dict(self._totals))


#: The process's timer; ``runtime.training.trainer.run_step`` starts and stops it around each step.
TIMER = PartTimer()


def part(name: str | None):
    """``TIMER.part(name)``: the body's time counts in part ``name`` (None: no part of its own)."""
    return TIMER.part(name)


# ---------------------------------------------------------------------- process groups -> parts

_GROUP_PARTS: dict[object, str] = {}


def register_group(group, axis: str) -> None:
    """Count blocking collectives over ``group`` in the part of ``axis`` (a key of ``AXIS_PARTS``)."""
    if axis not in AXIS_PARTS:
        raise ValueError(f"unknown axis {axis!r}; one of {', '.join(AXIS_PARTS)}")
    if group is not None:
        _GROUP_PARTS[group] = AXIS_PARTS[axis]


def forget_groups() -> None:
    """Drop every registration (a new mesh registers its own groups)."""
    _GROUP_PARTS.clear()


def part_of(group) -> str | None:
    """The part of a collective over ``group``; None for a group no mesh registered (its time
    stays in the enclosing part, ``compute`` at the top)."""
    if group is None:
        return None
    return _GROUP_PARTS.get(group)


# ---------------------------------------------------------------------- recomputation


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def time_recomputation(module: torch.nn.Module) -> list:
    """Count in ``recompute`` every forward of a child of ``module`` (a compiled stage's
    ``layer_<i>``) that runs inside backward: that is activation checkpointing rerunning a layer
    (``runtime.checkpoint``), the only way a layer's forward runs while autograd computes
    gradients. The hooks need nothing from the generated code. The post-hook runs even when the
    forward raises, because non-reentrant checkpointing stops a recomputation early by raising
    once it has what backward needs. The attention cores of a selectively recomputed layer
    (submodules marked ``SELECTIVE_RECOMPUTE``, ``codegen.selective``) are counted the same way.
    Returns the hook handles."""
    handles = []
    children = list(module.children())
    cores = [sub for child in children for sub in child.children() if getattr(sub, "SELECTIVE_RECOMPUTE", False)]
    for child in children + cores:
        entered: list[bool] = []

        def pre(_mod, _args, entered=entered) -> None:
            entered.append(_in_backward() and TIMER.enter("recompute"))

        def post(_mod, _args, _out, entered=entered) -> None:
            if entered and entered.pop():
                TIMER.exit()

        handles.append(child.register_forward_pre_hook(pre))
        handles.append(child.register_forward_hook(post, always_call=True))
    return handles
