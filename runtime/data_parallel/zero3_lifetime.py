"""ZeRO-3 parameter lifetime: each layer's parameters exist in full only while the layer runs.

A group's full buffer is materialized by an all-gather just before use and released after by
resizing its storage to 0 bytes (the parameter views, and any view autograd saved, keep pointing
at the same storage, which the next gather refills). Each group hooks the deepest module whose
subtree holds all its parameters (the children, if that is a container such as ``ModuleList``):

- forward pre-hook: gather (waiting for a prefetch), then prefetch the next group in the order
  the previous forward used; forward post-hook: free, and hook the outputs so that the group is
  gathered again when backward reaches them (and the group backward reaches next is prefetched);
- once all its parameters have their gradient the group is freed again.

The contract: a group's parameters are used only inside the forward of its module(s). Groups whose
parameters share no module below the root are hooked on the root and stay gathered during the
whole forward or backward. Activation checkpointing must be non-reentrant (the recomputation runs
inside backward, where nothing is freed).

Roots. An engine over a pipeline rank's model chunks has one root per chunk (``ZeroEngine``'s
``roots``): each root's forward records its own order of groups, and prefetches stay inside the
root being run (the next chunk to run is the schedule's business, not the engine's).

Split backward (``runtime.pipeline.executor``: ``B`` computes input gradients, ``W`` weight gradients
later, each inside ``ZeroEngine.backward_pass``). ``B`` gathers each group through the output
hooks as an ordinary backward does, but no gradient completes a group there, so its groups stay
gathered until ``B``'s pass ends (at most the chunk's parameters, for the length of one ``B``) and
are then freed: a group whose ``W`` is pending is *not* held gathered between ``B`` and ``W``
(between passes a ZeRO-3 rank holds only shards, whatever the schedule keeps pending). Before each
of ``W``'s autograd calls ``prepare_weights`` gathers the groups of that call's weights (autograd's
weight-side kernels may read them, and a checkpointed layer recomputes its forward) and, with
prefetch, starts the gathers of the next call's groups, so the next layer's gather runs under this
call's products as in forward and backward; each is freed as soon as its last gradient of the pass
arrives (``_on_grad``), as in an ordinary backward. So ``W`` holds at most the groups whose weights
it is between and the next call's, typically two layers'.

Prefetch is on with ``ShardingConfig.prefetch`` and ``ShardingConfig.overlap`` (``--overlap off``:
every gather is issued where it is needed and waited at once).

``Zero3Params`` holds these hooks and the gather/free of one group; ``runtime.data_parallel.zero_engine.ZeroEngine``
derives from it and owns everything else (groups, buckets, the step). Its attributes used here:
``stage``, ``dtype``, ``dp``, ``dp_rank``, ``dp_group``, ``groups``, ``prefetch``, ``counters``,
``_off`` (the offload stores, which give each group's shard: ``runtime.data_parallel.offload_engine``),
``_begin_backward`` (the engine's start of a backward pass), ``_group_root`` (each group's root)
and the forward-order bookkeeping ``_fwd_order``, ``_fwd_seen``, ``_orders``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten

from runtime.data_parallel.flat_shards import FREE, GATHERED, GATHERING, FlatGroup, ZeroError
from runtime.distributed import comm

if TYPE_CHECKING:
    from runtime.data_parallel.offload_engine import Offload

__all__ = ["Zero3Params", "in_backward", "group_roots"]


def in_backward() -> bool:
    """True while autograd's engine runs a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def group_roots(groups: list[FlatGroup], roots: list[str]) -> list[int]:
    """The root (index into ``roots``, module names; ``""`` is the whole module) of each group:
    the one whose subtree holds all its parameters."""
    out = []
    for group in groups:
        inside = [
            k for k, root in enumerate(roots) if not root or all(e.name.startswith(root + ".") for e in group.entries)
        ]
        if not inside:
            raise ZeroError(
                f"parameter group {group.index} ({', '.join(group.names[:3])}) lies in none of the roots "
                f"{roots} (or spans several): group each root's parameters separately"
            )
        out.append(inside[0])
    return out


class Zero3Params:
    """The ZeRO-3 half of ``runtime.data_parallel.zero_engine.ZeroEngine``: forward/backward hooks that gather each
    layer's parameters ahead of use (with prefetch) and free them after."""

    # Set by ``ZeroEngine`` (the module docstring lists them).
    stage: int
    dtype: torch.dtype
    dp: int
    dp_rank: int
    dp_group: Any
    groups: list[FlatGroup]
    prefetch: bool
    counters: dict[str, int]
    _off: Offload
    _group_root: list[int]
    _fwd_order: list[int]
    _fwd_seen: set[int]
    _orders: dict[int, list[int]]

    def _begin_backward(self) -> None:
        """The engine's start of a backward pass."""
        raise NotImplementedError

    def _order(self, root: int) -> list[int]:
        """Root ``root``'s groups in its last forward's order (index order before any)."""
        return self._orders.get(root) or [group.index for group in self.groups if self._group_root[group.index] == root]

    def _root_post_forward(self, root: int):
        if in_backward() or self.stage != 3:
            return
        if self._fwd_order:
            self._orders[root] = list(self._fwd_order)
        for group in self.groups:  # prefetched but not used in this forward
            if self._group_root[group.index] == root:
                self._free(group)

    def prepare_weights(self, weights, upcoming=()) -> None:
        """Before an autograd call that computes the gradients of ``weights`` outside the
        backward that gathered them (a split schedule's ``W``): gather their groups (stage 3;
        module docstring), then, with prefetch, start the gathers of the groups of ``upcoming``
        (the weights of the next call) so that they arrive while this call computes. They are
        freed as their gradients complete, or when the pass ends."""
        if self.stage != 3:
            return
        for group in self._groups_of(weights):
            self._gather(group)
            self._wait_gather(group)
        if self.prefetch:
            for group in self._groups_of(upcoming):
                self._prefetch(group)

    def _groups_of(self, weights) -> list[FlatGroup]:
        """The groups that hold any of ``weights``, in group order."""
        ids = {id(weight) for weight in weights}
        return [group for group in self.groups if ids.intersection(group.by_id)] if ids else []

    def _pre_forward(self, groups: list[FlatGroup]) -> None:
        in_bwd = in_backward()
        for group in groups:
            self._gather(group)
            self._wait_gather(group)
            if not in_bwd and group.index not in self._fwd_seen:
                self._fwd_seen.add(group.index)
                self._fwd_order.append(group.index)
        if self.prefetch and not in_bwd:
            last = groups[-1].index
            order = self._order(self._group_root[last])
            if last in order:
                pos = order.index(last)
                if pos + 1 < len(order):
                    self._prefetch(self.groups[order[pos + 1]])

    def _post_forward(self, groups: list[FlatGroup], out) -> None:
        if in_backward():
            return  # recomputation inside backward: keep the parameters for the backward ops
        for group in groups:
            self._free(group)
        if torch.is_grad_enabled():
            for output in tree_flatten(out)[0]:
                if isinstance(output, torch.Tensor) and output.requires_grad:
                    output.register_hook(lambda grad, groups=groups: self._backward_gather(groups))

    def _backward_gather(self, groups: list[FlatGroup]) -> None:
        self._begin_backward()
        for group in groups:
            self._gather(group)
            self._wait_gather(group)
            group.visited = True
        if self.prefetch:
            for group_index in reversed(self._order(self._group_root[groups[-1].index])):
                group = self.groups[group_index]
                if not group.visited:
                    self._prefetch(group)
                    break

    def _prefetch(self, group: FlatGroup) -> None:
        if group.state == FREE:
            self.counters["prefetches"] += 1
            self._gather(group, async_op=True)

    def _gather(self, group: FlatGroup, async_op: bool = False) -> None:
        """Materialize ``group``'s full compute-dtype parameters (stage 3)."""
        full = group.full
        if self.stage != 3 or group.state != FREE or full is None:
            return
        with torch.no_grad():
            full.untyped_storage().resize_(group.padded * full.element_size())
            shard = self._off.shard_source(group)
            if group.ways == 1:
                full.copy_(shard)
                group.state = GATHERED
                return
            if shard.dtype == self.dtype:
                source = group.gather_src = shard  # kept alive until the gather ends
            else:
                source = full[group.way * group.shard : (group.way + 1) * group.shard]
                source.copy_(shard)
            group.gather_work = comm.all_gather_into(full, source, group.comm_group, async_op=async_op)
        group.state = GATHERING if async_op else GATHERED
        if not async_op:
            group.gather_work = group.gather_src = None

    def _wait_gather(self, group: FlatGroup) -> None:
        if group.state == GATHERING:
            comm.wait(group.gather_work)
            group.gather_work, group.gather_src, group.state = None, None, GATHERED

    def _free(self, group: FlatGroup) -> None:
        if self.stage != 3 or group.state == FREE:
            return
        self._wait_gather(group)
        if group.full is not None:
            group.full.untyped_storage().resize_(0)
        group.state = FREE
