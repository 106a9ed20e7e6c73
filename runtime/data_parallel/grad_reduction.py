"""Gradient buckets and their reductions, in flight while backward runs (``ZeroEngine``'s "Gradients").

A *bucket* is a list of consecutive groups in backward order. Stages 0/1 all-reduce a bucket's
slice of the one stage-wide gradient buffer (sum, then divide by dp); stages 2/3 reduce-scatter
it, each group's full gradient buffer then freed and this rank's shard added (divided by dp) to
the group's fp32 accumulator. A bucket of several groups is laid out rank-major in a staging
buffer (``[g1 shard r | g2 shard r]`` for each ``r``), one collective for all.

Stages 0/1 reduce once per step; a backward after that reduction (more backwards than announced)
is still right: the buffer then holds ``avg + g_r`` and its reduction gives ``(dp avg + sum g_r) / dp``.
Stages 2/3 reduce-scatter on every backward outside ``no_sync()`` (inside it full gradients
accumulate and are reduce-scattered later), so gradients cost ``4 P / dp`` plus the layers in flight.

Expert groups (``FlatGroup.expert``: routed expert weights under expert parallelism) are reduced
over their own process group, the ``dp / ep`` ranks holding the same experts (``FlatGroup.comm_group``),
and still divided by dp: every rank's loss is its share of the global mean and the expert's
all-to-all backward has already brought the gradients of the ``ep`` ranks it serves, so the sum
over the expert-data-parallel group divided by dp is the gradient of the global mean. A bucket
holds groups of one kind only.

Buckets launch strictly in bucket order, so every rank issues the same collectives in the same
order; at most ``runtime.contract.limits.REDUCTIONS_IN_FLIGHT`` reductions are pending at once
(launching another first finishes the oldest), which bounds the gradient buffers alive together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from runtime.contract.limits import FIRST_BUCKET_BYTES, REDUCTIONS_IN_FLIGHT
from runtime.data_parallel.engine_config import ShardingConfig
from runtime.data_parallel.flat_shards import FlatGroup
from runtime.distributed import comm

__all__ = ["FIRST_BUCKET_BYTES", "GradientReducer", "make_buckets", "shard_accumulator", "drop_full_grad"]


def make_buckets(
    groups: list[FlatGroup], stage: int, dtype: torch.dtype, bucket_bytes: int, group_root: list[int]
) -> list[list[int]]:
    """Consecutive groups in backward order, each bucket at most ``bucket_bytes`` (a group larger
    than that is a bucket of its own) and within one root. The first bucket is capped at 1 MiB, as
    DDP does, so the first reduction starts early in backward and overlaps the rest of it.

    Stages 2 and 3 reduce-scatter each group (layer) on its own, as FSDP does per module: merging
    would copy the merged groups' gradients into one more staging buffer, and the point of
    sharding gradients is to hold as few full ones as possible."""
    if stage >= 2:
        return [[group.index] for group in reversed(groups)]
    element_bytes = torch.empty((), dtype=dtype).element_size()
    buckets: list[list[int]] = []
    current: list[int] = []
    size, cap = 0, min(bucket_bytes, FIRST_BUCKET_BYTES)
    for group in reversed(groups):
        group_bytes = group.padded * element_bytes
        other_kind = groups[current[0]].expert != group.expert if current else False
        if current and (size + group_bytes > cap or group_root[group.index] != group_root[current[0]] or other_kind):
            buckets.append(current)
            current, size, cap = [], 0, bucket_bytes
        current.append(group.index)
        size += group_bytes
    if current:
        buckets.append(current)
    return buckets


def shard_accumulator(group: FlatGroup, device: torch.device) -> torch.Tensor:
    """The fp32 gradient-shard accumulator of ``group`` (stage 2/3), allocated on first use."""
    if group.grad_shard is None:
        group.grad_shard = torch.zeros(group.shard, dtype=torch.float32, device=device)
    return group.grad_shard


def drop_full_grad(group: FlatGroup) -> None:
    """Release ``group``'s full gradient buffer and its parameters' ``.grad`` views."""
    group.grad_full = None
    for entry in group.entries:
        entry.param.grad = None


@dataclass
class _Pending:
    """A reduction launched and not yet finished."""

    work: Any
    """The collective's handle."""
    result: torch.Tensor
    """All-reduce: the reduced slice of the gradient buffer; reduce-scatter: this rank's output."""
    groups: list[FlatGroup]
    """The bucket's groups."""
    columns: list[int] = field(default_factory=list)
    """Reduce-scatter: each group's offset in ``result`` (empty for an all-reduce)."""
    source: torch.Tensor | None = None
    """Reduce-scatter: its input (kept alive until the collective ends)."""


class GradientReducer:
    """The buckets of one engine, which of them this backward pass launched, and the reductions in
    flight. ``on_reduced(group)`` runs when a group's reduction completed. ``dp``: the
    data-parallel degree, which every reduced gradient is divided by; each bucket is reduced over
    its groups' ``comm_group``."""

    def __init__(
        self,
        groups: list[FlatGroup],
        group_root: list[int],
        dp: int,
        sharding: ShardingConfig,
        device: torch.device,
        flat_grad: torch.Tensor | None,
        on_reduced: Callable[[FlatGroup], None],
    ):
        self.groups, self.group_root, self.dp = groups, group_root, dp
        self.stage, self.dtype, self.device = sharding.zero_stage, sharding.param_dtype, device
        self.flat_grad = flat_grad  # stages 0/1: the stage-wide gradient buffer the groups' views share
        self.on_reduced = on_reduced
        self.buckets = make_buckets(groups, self.stage, self.dtype, sharding.bucket_bytes, group_root)
        self.launched: set[int] = set()  # buckets launched in this backward pass
        self.local_only = False  # 1-bit Adam's compressed steps: stages 0/1 keep their own gradients
        self.inflight: list[_Pending] = []

    def launch(self, only_ready: bool, root: int | None = None) -> int:
        """Launch the buckets not yet launched in this pass, in bucket order (``root``: only that
        root's; ``only_ready``: up to the first whose groups are not all complete); the number of
        reductions launched (buckets holding unreduced gradients)."""
        launched = 0
        for index, ids in enumerate(self.buckets):
            if index in self.launched or root is not None and self.group_root[ids[0]] != root:
                continue
            bucket = [self.groups[i] for i in ids]
            if only_ready and not all(group.ready for group in bucket):
                break
            self.launched.add(index)
            if any(group.dirty for group in bucket):
                launched += 1
                self._reduce(bucket)
        self.poll()
        return launched

    def _reduce(self, bucket: list[FlatGroup]) -> None:
        """Launch the reduction of one bucket (async); ``_finish`` handles its completion."""
        for group in bucket:
            group.dirty = False
        if self.stage < 2 and self.local_only:
            for group in bucket:
                self.on_reduced(group)
        elif self.stage < 2:
            self._all_reduce(bucket)
        elif bucket[0].ways == 1:  # one rank holds these (dp 1, or experts with ep == dp)
            with torch.no_grad():
                for group in bucket:
                    if group.grad_full is not None:
                        shard_accumulator(group, self.device).add_(group.grad_full, alpha=1.0 / self.dp)
                    drop_full_grad(group)
                    self.on_reduced(group)
        else:
            self._reduce_scatter(bucket)

    def _all_reduce(self, bucket: list[FlatGroup]) -> None:
        start = min(group.base for group in bucket)
        end = max(group.base + group.padded for group in bucket)
        assert self.flat_grad is not None  # stages 0/1 keep one
        reduced = self.flat_grad[start:end]
        if bucket[0].ways == 1:  # one rank holds these (dp 1, or experts with ep == dp)
            if self.dp > 1:
                with torch.no_grad():
                    reduced.div_(self.dp)
            for group in bucket:
                self.on_reduced(group)
            return
        work = comm.all_reduce(reduced, bucket[0].comm_group, async_op=True)
        self.inflight.append(_Pending(work, reduced, bucket))
        self.poll()

    def _reduce_scatter(self, bucket: list[FlatGroup]) -> None:
        ways = bucket[0].ways
        if len(bucket) == 1 and bucket[0].grad_full is not None:
            source, columns = bucket[0].grad_full, [0]
        else:
            total = sum(group.shard for group in bucket)
            staging = torch.zeros(ways, total, dtype=self.dtype, device=self.device)
            columns, column = [], 0
            for group in bucket:
                if group.grad_full is not None:
                    staging[:, column : column + group.shard].copy_(group.grad_full.view(ways, group.shard))
                drop_full_grad(group)
                columns.append(column)
                column += group.shard
            source = staging.view(-1)
        out = torch.empty(source.numel() // ways, dtype=self.dtype, device=self.device)
        work = comm.reduce_scatter_into(out, source, bucket[0].comm_group, async_op=True)
        self.inflight.append(_Pending(work, out, bucket, columns, source))
        self.poll()

    def _finish(self, pending: _Pending) -> None:
        comm.wait(pending.work)
        with torch.no_grad():
            if pending.source is None:
                pending.result.div_(self.dp)
                for group in pending.groups:
                    self.on_reduced(group)
                return
            for group, column in zip(pending.groups, pending.columns):
                shard_accumulator(group, self.device).add_(
                    pending.result[column : column + group.shard], alpha=1.0 / self.dp
                )
                if len(pending.groups) == 1 and group.grad_full is pending.source:
                    drop_full_grad(group)
                self.on_reduced(group)

    def poll(self, max_inflight: int = REDUCTIONS_IN_FLIGHT) -> None:
        """Finish completed reductions in order; bound the ones in flight (and their memory)."""
        while self.inflight and (len(self.inflight) > max_inflight or self.inflight[0].work.is_completed()):
            self._finish(self.inflight.pop(0))

    def settle(self, group: FlatGroup) -> None:
        """Finish the reductions in flight up to the one of ``group`` (if any): a gradient about to
        accumulate into its buffer must not race a collective still reading it."""
        while any(group in pending.groups for pending in self.inflight):
            self._finish(self.inflight.pop(0))

    def drain(self) -> None:
        """Finish every reduction in flight."""
        while self.inflight:
            self._finish(self.inflight.pop(0))
