"""What the expert dispatch did in one step: tokens routed to each expert and tokens dropped.

``runtime.moe.dispatch`` records every call here (each routed layer of each micro-batch, forward
only: a recomputed forward under activation checkpointing runs inside backward and is not counted
again). The trainer reads the step's totals, reduces them over the ranks (``reduce_over``) and resets
them each step, for the metrics ``tokens_dropped`` (int, over the global batch) and
``expert_load`` (max / mean tokens per expert over the global batch and every routed layer: 1.0 is
perfectly balanced, ``E`` is every token on one expert).

Counts are the rows routed (a token picked by ``top_k`` experts is ``top_k`` rows), before any
capacity drops: the load is what the router asked for, and ``tokens_dropped`` what capacity refused.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["ExpertLoad", "LOAD", "expert_load", "reduce_over"]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@dataclass
class ExpertLoad:
    """Per-process running totals of one step (the trainer resets them)."""

    tokens_dropped: int = 0
    """Rows past their expert's capacity, summed over calls."""
    per_expert: dict[int, list[int]] = field(default_factory=dict)
    """Number of experts ``E`` -> rows routed to each of the ``E`` experts, summed over the calls of
    layers with ``E`` experts (layers with other expert counts are kept apart)."""
    calls: int = 0
    """Dispatches recorded."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, counts: list[int], dropped: int) -> None:
        """Add one dispatch: ``counts[e]`` rows routed to expert ``e``, ``dropped`` of them refused.
        Ignored inside backward (a recomputed forward)."""
        if _in_backward():
            return
        with self._lock:
            totals = self.per_expert.setdefault(len(counts), [0] * len(counts))
            for e, c in enumerate(counts):
                totals[e] += int(c)
            self.tokens_dropped += int(dropped)
            self.calls += 1

    def reset(self) -> None:
        with self._lock:
            self.tokens_dropped = 0
            self.per_expert = {}
            self.calls = 0

    @property
    def active(self) -> bool:
        """Whether anything was dispatched since the last reset."""
        return self.calls > 0

    def as_vector(self, sizes: list[int]) -> torch.Tensor:
        """``[calls, tokens_dropped, counts of the E=sizes[0] experts..., counts of E=sizes[1]...]``
        as float64 (a flat vector one all-reduce sums)."""
        values = [float(self.calls), float(self.tokens_dropped)]
        for size in sizes:
            values += [float(c) for c in self.per_expert.get(size, [0] * size)]
        return torch.tensor(values, dtype=torch.float64)


#: The process's accumulator; ``runtime.moe.dispatch`` writes it, the trainer reads and resets it.
LOAD = ExpertLoad()


def expert_load(per_expert: dict[int, list[int]] | dict[int, list[float]]) -> float:
    """max / mean of the tokens per expert, over every expert of every group (``E -> counts``);
    1.0 when nothing was routed."""
    counts = [float(c) for values in per_expert.values() for c in values]
    if not counts or sum(counts) == 0:
        return 1.0
    return max(counts) / (sum(counts) / len(counts))


def reduce_over(
    load: ExpertLoad, sizes: list[int], group=None, counted: bool = True, device: torch.device | None = None
) -> tuple[int, float | None]:
    """``(tokens_dropped, expert_load)`` summed over the ranks of ``group`` (the whole job by
    default; collective). ``sizes``: the expert counts of the model's routed layers, the same on
    every rank (a pipeline stage without routed layers contributes zeros). ``counted``: whether
    this rank's counts enter the sum: False on all but one rank of a tensor-parallel group, whose
    ranks route the same tokens. ``device``: where the all-reduce runs (the rank's device under
    NCCL). Outside ``runtime.distributed.comm``: metrics bookkeeping, not training traffic.
    ``expert_load`` is None when no rank dispatched anything (compiled code that routes without
    ``runtime.moe``, e.g. replicated dropless experts: there was nothing to count)."""
    sizes = sorted(set(int(s) for s in sizes))
    vector = load.as_vector(sizes).to(device or "cpu")
    if not counted:
        vector.zero_()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(vector, group=group)
    calls, dropped = float(vector[0]), int(round(float(vector[1])))
    per_expert, at = {}, 2
    for size in sizes:
        per_expert[size] = vector[at : at + size].cpu().tolist()
        at += size
    return dropped, (expert_load(per_expert) if calls > 0 else None)
