"""Counted collectives over torch.distributed.

Every collective the runtime issues goes through this module so that the bytes one device sends
are counted with the project's ring convention (see ``ring_bytes``):

- all-reduce: ``2 (n - 1) / n x size``
- all-gather, reduce-scatter and all-to-all: ``(n - 1) / n x full (gathered) size``
- broadcast: ``(n - 1) / n x size`` (pipelined ring)
- point-to-point send: ``size`` (a receive sends nothing)

``size`` is in bytes. A group of one rank sends nothing and the call is skipped entirely.
Async calls return a ``Pending`` handle (``None`` for a skipped call); ``wait(work)`` accepts both.

Every blocking call and every ``wait`` is timed twice: in ``STATS.wait_s`` (all communication
the step did not hide) and, for the step's time breakdown, in the part of ``runtime.timing`` its
process group belongs to (``timing.part_of``: tensor-parallel groups count in ``tp_comm``,
data-parallel and tied-weight groups in ``dp_comm``, the pipeline group in ``pp_bubble``). An
asynchronous launch enters no part: it does not block, and on a GPU entering a part synchronizes
the device, which would undo the overlap the launch is for. A handle remembers its group's part,
so its ``wait`` counts there.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from runtime import timing
from runtime.contract.collective_bytes import all_to_all_bytes, ring_bytes

__all__ = [
    "CommStats",
    "Pending",
    "STATS",
    "group_size",
    "all_reduce",
    "all_gather_into",
    "reduce_scatter_into",
    "all_to_all_into",
    "all_to_all_variable",
    "broadcast",
    "send",
    "recv",
    "isend",
    "irecv",
    "wait",
    "CollectiveError",
]


@dataclass
class CommStats:
    """Running totals of bytes sent by this process, by collective kind."""

    bytes_by_kind: Counter = field(default_factory=Counter)
    calls_by_kind: Counter = field(default_factory=Counter)
    wait_s: float = 0.0
    """Seconds this process spent blocked in collectives (a blocking call, or ``wait`` on an
    asynchronous one): communication the step did not hide behind compute."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, kind: str, size_bytes: int, n: int) -> None:
        with self._lock:
            self.bytes_by_kind[kind] += ring_bytes(kind, size_bytes, n)
            self.calls_by_kind[kind] += 1

    def add_sent(self, kind: str, sent_bytes: int) -> None:
        """Count one call of ``kind`` that sends exactly ``sent_bytes`` to other ranks."""
        with self._lock:
            self.bytes_by_kind[kind] += int(sent_bytes)
            self.calls_by_kind[kind] += 1

    @property
    def total(self) -> float:
        return float(sum(self.bytes_by_kind.values()))

    def reset(self) -> None:
        with self._lock:
            self.bytes_by_kind.clear()
            self.calls_by_kind.clear()
            self.wait_s = 0.0


#: Process-wide counter; the trainer resets it each step.
STATS = CommStats()


class CollectiveError(RuntimeError):
    """A collective failed or timed out: a peer died or stopped answering."""


def _describe_group(group) -> str:
    if not dist.is_initialized():
        return "no group"
    try:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    except (RuntimeError, ValueError):
        return "its group"
    return f"ranks {ranks}"


class Pending:
    """An asynchronous collective in flight: torch's ``Work`` and the part of the step's time
    breakdown that waiting for it counts in (``runtime.timing``)."""

    __slots__ = ("work", "part")

    def __init__(self, work, part: str | None):
        self.work = work
        self.part = part

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> None:
        """``runtime.distributed.comm.wait(self)``: timed and reported like every wait."""
        wait(self)


def _guard(kind: str, size: int, group, fn, blocking: bool = True, part: str | None = None):
    """Run one collective; turn a backend failure into a message naming it and its peers.

    A ``blocking`` call's time counts in the breakdown part of ``group`` (or ``part``, when
    given); an asynchronous launch returns a ``Pending`` handle that remembers that part."""
    part = part or timing.part_of(group)
    with timing.part(part if blocking else None):
        started = time.perf_counter()
        try:
            return fn() if blocking else Pending(fn(), part)
        except RuntimeError as e:
            this_rank = dist.get_rank() if dist.is_initialized() else 0
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CollectiveError(
                f"rank {this_rank}: {kind} of {size} bytes over {_describe_group(group)} failed -- a peer died or "
                f"stopped answering within the timeout ({first})"
            ) from None
        finally:
            STATS.wait_s += time.perf_counter() - started


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def group_size(group=None) -> int:
    if not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (deprecated aliases remain).
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce(tensor: torch.Tensor, group=None, op=dist.ReduceOp.SUM, async_op: bool = False):
    n = group_size(group)
    if n == 1:
        return None
    STATS.add("all_reduce", _nbytes(tensor), n)
    return _guard(
        "all_reduce",
        _nbytes(tensor),
        group,
        lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op),
        not async_op,
    )


def all_gather_into(
    output: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = False, part: str | None = None
):
    """Gather equal ``shard``s of every rank into ``output`` (rank-major, flat). ``part``: the part
    of the step's time breakdown its wait counts in, when not its group's."""
    n = group_size(group)
    if n == 1:
        if output.data_ptr() != shard.data_ptr():
            output.copy_(shard.view_as(output))
        return None
    STATS.add("all_gather", _nbytes(output), n)
    return _guard(
        "all_gather",
        _nbytes(output),
        group,
        lambda: _ALL_GATHER(output, shard, group=group, async_op=async_op),
        not async_op,
        part,
    )


def reduce_scatter_into(
    shard: torch.Tensor, full: torch.Tensor, group=None, op=dist.ReduceOp.SUM, async_op: bool = False
):
    """Sum ``full`` over ranks and keep this rank's equal slice in ``shard``."""
    n = group_size(group)
    if n == 1:
        if shard.data_ptr() != full.data_ptr():
            shard.copy_(full.view_as(shard))
        return None
    STATS.add("reduce_scatter", _nbytes(full), n)
    return _guard(
        "reduce_scatter",
        _nbytes(full),
        group,
        lambda: _REDUCE_SCATTER(shard, full, op=op, group=group, async_op=async_op),
        not async_op,
    )


def all_to_all_into(output: torch.Tensor, source: torch.Tensor, group=None, async_op: bool = False):
    """Rank ``j`` receives chunk ``j`` of every rank's ``source`` (equal chunks), rank-major in ``output``."""
    n = group_size(group)
    if n == 1:
        if output.data_ptr() != source.data_ptr():
            output.copy_(source.view_as(output))
        return None
    STATS.add("all_to_all", _nbytes(source), n)
    return _guard(
        "all_to_all",
        _nbytes(source),
        group,
        lambda: dist.all_to_all_single(output, source, group=group, async_op=async_op),
        not async_op,
    )


def all_to_all_variable(
    output: torch.Tensor, source: torch.Tensor, output_splits: list[int], input_splits: list[int], group=None
) -> None:
    """Blocking all-to-all with variable splits along dim 0: rows ``input_splits[j]`` of ``source``
    go to rank ``j`` of ``group``; ``output`` receives ``output_splits[i]`` rows from rank ``i``,
    rank-major. Counts the bytes this rank sends to the other ranks (its own chunk is a local copy)."""
    n = group_size(group)
    if len(input_splits) != n or len(output_splits) != n:
        raise ValueError(f"all-to-all over {n} ranks needs {n} splits each way, got {input_splits} and {output_splits}")
    if n == 1:
        if output.data_ptr() != source.data_ptr():
            output.copy_(source.view_as(output))
        return
    row_bytes = math.prod(source.shape[1:]) * source.element_size()
    sent = all_to_all_bytes([rows * row_bytes for rows in input_splits], dist.get_rank(group))
    STATS.add_sent("all_to_all", sent)
    _guard(
        "all_to_all",
        int(sent),
        group,
        lambda: dist.all_to_all_single(
            output, source, output_split_sizes=list(output_splits), input_split_sizes=list(input_splits), group=group
        ),
    )


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    n = group_size(group)
    if n == 1:
        return None
    STATS.add("broadcast", _nbytes(tensor), n)
    return _guard(
        "broadcast",
        _nbytes(tensor),
        group,
        lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op),
        not async_op,
    )


def send(tensor: torch.Tensor, dst: int, group=None) -> None:
    STATS.add("send", _nbytes(tensor), 2)
    _guard(f"send to rank {dst}", _nbytes(tensor), group, lambda: dist.send(tensor, dst=dst, group=group))


def recv(tensor: torch.Tensor, src: int, group=None) -> None:
    STATS.add("recv", _nbytes(tensor), 2)
    _guard(f"receive from rank {src}", _nbytes(tensor), group, lambda: dist.recv(tensor, src=src, group=group))


def isend(tensor: torch.Tensor, dst: int, group=None) -> Pending:
    STATS.add("send", _nbytes(tensor), 2)
    return Pending(dist.isend(tensor, dst=dst, group=group), timing.part_of(group))


def irecv(tensor: torch.Tensor, src: int, group=None) -> Pending:
    STATS.add("recv", _nbytes(tensor), 2)
    return Pending(dist.irecv(tensor, src=src, group=group), timing.part_of(group))


def wait(work) -> None:
    """Wait for an async handle (a ``Pending``, or torch's own ``Work``, whose wait counts in no
    part of its own); ``None`` (a skipped collective) is a no-op."""
    if work is None:
        return
    if isinstance(work, Pending):
        _guard("asynchronous collective", 0, None, work.work.wait, part=work.part)
    else:
        _guard("asynchronous collective", 0, None, work.wait)
