"""Expert dispatch and combine over the expert-parallel group (what compiled MoE layers call).

A routed MoE layer, as transformers exports it, sorts its ``S = tokens x top_k`` token rows by
expert id and runs every expert's product on its block of rows (``grouped_mm`` with the blocks'
cumulative ends, ``offs``). Under expert parallelism (``runtime.distributed.mesh``: ``ep`` ranks of
one dp group share a layer's ``E`` experts, rank ``r`` holding experts ``[r E/ep, (r+1) E/ep)``)
those blocks live on other ranks. ``dispatch`` sends each block to the rank holding its expert and
returns the rows this rank's experts must process; ``combine`` sends the products back::

    local_rows, local_offsets, routing = dispatch(rows, counts, E, capacity_factor)
    out = grouped_mm(local_rows, local_weight, local_offsets)      # this rank's E/ep experts
    result = combine(out, routing)                                 # [S, h'] in rows' order

Exchange: the per-expert row counts first (one small all-to-all of ``E`` integers: each rank
learns how many rows every source sends each of its experts), then the rows with
``all_to_all_single`` and variable splits. Received rows arrive grouped by source rank (each
source's rows sorted by expert); they are reordered expert-major (every source's rows of local
expert 0, then of expert 1...) so that one grouped product covers them. Both exchanges are
autograd functions whose backward is the reverse exchange, so gradients of the input rows and of
the expert weights are those of the single-process computation: a row's gradient comes back from
the rank that used it, and each expert weight's gradient sums the rows of every source rank.

Capacity (``capacity_factor``, None: dropless, the default): an expert takes at most
``ceil(capacity_factor * S / E)`` rows from each source rank (``S`` the rows of that rank); rows
past it, in their sorted order, are not sent, and ``combine`` returns zeros for them (their
tokens keep only the residual path, as in GShard / Switch). Dropped rows are counted in
``runtime.moe.load_stats.LOAD`` with the tokens per expert.

With no process group, or ``ep == 1``, nothing is exchanged: capacity still applies, and without
drops the rows are returned as they are (no copy).

Bytes: each all-to-all counts what this rank sends to the other ranks
(``runtime.distributed.comm.all_to_all_variable``); blocked time is ``ep_comm``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from runtime.distributed import comm
from runtime.distributed.mesh import get_mesh
from runtime.moe.load_stats import LOAD

__all__ = ["Routing", "dispatch", "combine", "expert_slice", "local_expert_ids"]


@dataclass(frozen=True)
class Routing:
    """What ``combine`` needs to send a dispatch's rows back where they came from."""

    rows: int
    """``S``: rows of the dispatched input (the length of ``combine``'s output)."""
    keep: torch.Tensor | None
    """Indices (into the input rows) of the rows kept by capacity, in order; None: all kept."""
    group: object | None
    """The expert-parallel group exchanged over (None: no exchange)."""
    send_splits: tuple[int, ...] = ()
    """Rows this rank sent to each rank of the group."""
    recv_splits: tuple[int, ...] = ()
    """Rows this rank received from each rank of the group."""
    unorder: torch.Tensor | None = None
    """Permutation from expert-major (what ``dispatch`` returned) back to source-major (what
    arrived); None when they agree (one source)."""


class _Exchange(torch.autograd.Function):
    """All-to-all of rows with variable splits; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, recv_splits, send_splits, group):
        ctx.splits = (recv_splits, send_splits)
        ctx.group = group
        return _all_to_all(rows, recv_splits, send_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        recv_splits, send_splits = ctx.splits
        return _all_to_all(grad, send_splits, recv_splits, ctx.group), None, None, None


def _all_to_all(rows: torch.Tensor, recv_splits, send_splits, group) -> torch.Tensor:
    rows = rows.contiguous()
    out = rows.new_empty((sum(recv_splits),) + tuple(rows.shape[1:]))
    comm.all_to_all_variable(out, rows, list(recv_splits), list(send_splits), group)
    return out


def _runs(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The concatenation of ``arange(starts[i], starts[i] + lengths[i])`` over ``i`` (int64)."""
    total = int(lengths.sum())
    firsts = torch.cumsum(lengths, 0) - lengths
    within = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(firsts, lengths)
    return torch.repeat_interleave(starts, lengths) + within


def _as_counts(counts: torch.Tensor | list[int], num_experts: int, rows: int) -> list[int]:
    """``counts`` (histc's floats, ints, or a list) as Python ints, checked against the rows."""
    if isinstance(counts, torch.Tensor):
        values = counts.detach().to("cpu", torch.float64).round().to(torch.int64).tolist()
    else:
        values = [int(c) for c in counts]
    if len(values) != num_experts:
        raise ValueError(f"dispatch: {len(values)} expert counts for {num_experts} experts")
    if any(c < 0 for c in values) or sum(values) != rows:
        raise ValueError(f"dispatch: expert counts {values} do not add up to the {rows} rows given")
    return values


def expert_slice(num_experts: int, ep: int, ep_index: int) -> slice:
    """The experts rank ``ep_index`` of an expert-parallel group of ``ep`` holds (dim 0 of an
    ``[E, ...]`` expert parameter)."""
    if ep < 1 or num_experts % ep:
        raise ValueError(f"{num_experts} experts cannot be split evenly over an expert-parallel group of {ep}")
    if not 0 <= ep_index < ep:
        raise ValueError(f"expert-parallel index {ep_index} outside a group of {ep}")
    local = num_experts // ep
    return slice(ep_index * local, (ep_index + 1) * local)


def _capacity(counts: list[int], rows: int, capacity_factor: float | None) -> list[int]:
    """Rows of each expert that are kept: all (dropless), or at most ``ceil(F * rows / E)``."""
    if capacity_factor is None:
        return list(counts)
    if not capacity_factor > 0:
        raise ValueError(f"dispatch: capacity_factor must be > 0 or None, got {capacity_factor!r}")
    cap = math.ceil(capacity_factor * rows / len(counts))
    return [min(c, cap) for c in counts]


def dispatch(
    rows: torch.Tensor, counts: torch.Tensor, num_experts: int, capacity_factor: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, Routing]:
    """Send each expert's rows to the rank holding it (see the module docstring).

    ``rows [S, h]``: token rows sorted by expert id (all ``num_experts`` experts); ``counts [E]``:
    rows per expert. Returns ``(local_rows [R, h], local_offsets, routing)``: the rows of this
    rank's ``E / ep`` experts from every source rank, grouped by expert; ``local_offsets`` their
    cumulative ends (int32, ``grouped_mm``'s ``offs``); ``routing`` for ``combine``."""
    total = rows.shape[0]
    values = _as_counts(counts, num_experts, total)
    kept = _capacity(values, total, capacity_factor)
    dropped = total - sum(kept)
    LOAD.record(values, dropped)
    keep = None
    if dropped:
        starts = torch.tensor([0] + values[:-1], dtype=torch.int64).cumsum(0)
        keep = _runs(starts, torch.tensor(kept, dtype=torch.int64)).to(rows.device)
        rows = rows.index_select(0, keep)
    mesh = get_mesh()
    group = mesh.ep_group if mesh.ep > 1 and dist.is_initialized() else None
    if group is None:
        offsets = torch.tensor(kept, dtype=torch.int64).cumsum(0).to(device=rows.device, dtype=torch.int32)
        return rows, offsets, Routing(total, keep, None)
    return _exchange(rows, kept, keep, total, group, mesh.ep)


def local_expert_ids(offsets: torch.Tensor) -> torch.Tensor:
    """This rank's expert (``0 .. E/ep - 1``) of each row ``dispatch`` delivered, from its
    ``local_offsets`` (the rows are grouped by expert): what a per-expert parameter gathered by
    expert id (GPT-OSS's bias) is gathered by after the dispatch."""
    ends = offsets.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    return torch.repeat_interleave(torch.arange(ends.numel(), device=ends.device), counts)


def _exchange(
    rows: torch.Tensor, kept: list[int], keep: torch.Tensor | None, total: int, group, ep: int
) -> tuple[torch.Tensor, torch.Tensor, Routing]:
    """The two all-to-alls of ``dispatch`` over ``group`` and the expert-major reordering."""
    num_experts = len(kept)
    if num_experts % ep:
        raise ValueError(f"dispatch: {num_experts} experts cannot be split over an expert-parallel group of {ep}")
    local = num_experts // ep
    send_splits = tuple(sum(kept[r * local : (r + 1) * local]) for r in range(ep))
    # 1. counts: rank j receives, from every source, the rows it sends each of j's experts
    wanted = torch.empty(num_experts, dtype=torch.int64, device=rows.device)
    comm.all_to_all_into(wanted, torch.tensor(kept, dtype=torch.int64, device=rows.device), group)
    matrix = wanted.cpu().view(ep, local)  # [source rank, local expert]
    recv_splits = tuple(int(x) for x in matrix.sum(1).tolist())
    # 2. the rows themselves, grouped by source rank
    arrived = _Exchange.apply(rows, recv_splits, send_splits, group)
    # 3. expert-major: every source's rows of local expert 0, then expert 1, ...
    flat = matrix.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view(ep, local)
    order = _runs(starts.t().reshape(-1), matrix.t().reshape(-1))
    unorder = None
    if ep > 1 and not torch.equal(order, torch.arange(order.numel())):
        unorder = torch.argsort(order).to(rows.device)
        arrived = arrived.index_select(0, order.to(rows.device))
    offsets = matrix.sum(0).cumsum(0).to(device=rows.device, dtype=torch.int32)
    return arrived, offsets, Routing(total, keep, group, send_splits, recv_splits, unorder)


def combine(out: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Send the local experts' output rows (``out [R, h']``, in ``dispatch``'s order) back and
    return ``[S, h']`` in the original order of the dispatched rows; rows dropped by capacity are zeros."""
    if routing.group is not None:
        if routing.unorder is not None:
            out = out.index_select(0, routing.unorder)
        out = _Exchange.apply(out, routing.send_splits, routing.recv_splits, routing.group)
    if routing.keep is None:
        return out
    full = out.new_zeros((routing.rows,) + tuple(out.shape[1:]))
    return full.index_copy(0, routing.keep, out)
