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

``Zero3Params`` holds these hooks and the gather/free of one group; ``runtime.zero.ZeroEngine``
derives from it and owns everything else (groups, buckets, the step). Its attributes used here:
``stage``, ``dtype``, ``dp``, ``dp_rank``, ``dp_group``, ``groups``, ``prefetch``, ``counters``,
``_off`` (the offload stores, which give each group's shard: ``runtime.offload``),
``_begin_backward`` (the engine's start of a backward pass) and the forward-order bookkeeping
``_fwd_order``, ``_fwd_seen``, ``_last_order``.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from runtime import comm
from runtime.optim import FREE, GATHERED, GATHERING, FlatGroup

__all__ = ["Zero3Params", "in_backward"]


def in_backward() -> bool:
    """True while autograd's engine runs a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


class Zero3Params:
    """The ZeRO-3 half of ``runtime.zero.ZeroEngine``: forward/backward hooks that gather each
    layer's parameters ahead of use (with prefetch) and free them after."""

    def _root_post_forward(self, module, args, out):
        if in_backward() or self.stage != 3:
            return
        if self._fwd_order:
            self._last_order = list(self._fwd_order)
        for g in self.groups:  # prefetched but not used in this forward
            self._free(g)

    def _pre_forward(self, groups: list[FlatGroup]) -> None:
        in_bwd = in_backward()
        for g in groups:
            self._gather(g)
            self._wait_gather(g)
            if not in_bwd and g.index not in self._fwd_seen:
                self._fwd_seen.add(g.index)
                self._fwd_order.append(g.index)
        if self.prefetch and not in_bwd:
            order = self._last_order or list(range(len(self.groups)))
            last = groups[-1].index
            if last in order:
                pos = order.index(last)
                if pos + 1 < len(order):
                    self._prefetch(self.groups[order[pos + 1]])

    def _post_forward(self, groups: list[FlatGroup], out) -> None:
        if in_backward():
            return  # recomputation inside backward: keep the parameters for the backward ops
        for g in groups:
            self._free(g)
        if torch.is_grad_enabled():
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda grad, gs=groups: self._backward_gather(gs))

    def _backward_gather(self, groups: list[FlatGroup]) -> None:
        self._begin_backward()
        for g in groups:
            self._gather(g)
            self._wait_gather(g)
            g.visited = True
        if self.prefetch:
            for gi in reversed(self._last_order or list(range(len(self.groups)))):
                g = self.groups[gi]
                if not g.visited:
                    self._prefetch(g)
                    break

    def _prefetch(self, g: FlatGroup) -> None:
        if g.state == FREE:
            self.counters["prefetches"] += 1
            self._gather(g, async_op=True)

    def _gather(self, g: FlatGroup, async_op: bool = False) -> None:
        """Materialize group ``g``'s full compute-dtype parameters (stage 3)."""
        if self.stage != 3 or g.state != FREE:
            return
        with torch.no_grad():
            g.full.untyped_storage().resize_(g.padded * g.full.element_size())
            shard = self._off.shard_source(g)
            if self.dp == 1:
                g.full.copy_(shard)
                g.state = GATHERED
                return
            if shard.dtype == self.dtype:
                src = g.gather_src = shard  # kept alive until the gather ends
            else:
                src = g.full[self.dp_rank * g.shard : (self.dp_rank + 1) * g.shard]
                src.copy_(shard)
            g.gather_work = comm.all_gather_into(g.full, src, self.dp_group, async_op=async_op)
        g.state = GATHERING if async_op else GATHERED
        if not async_op:
            g.gather_work = g.gather_src = None

    def _wait_gather(self, g: FlatGroup) -> None:
        if g.state == GATHERING:
            comm.wait(g.gather_work)
            g.gather_work, g.gather_src, g.state = None, None, GATHERED

    def _free(self, g: FlatGroup) -> None:
        if self.stage != 3 or g.state == FREE:
            return
        self._wait_gather(g)
        g.full.untyped_storage().resize_(0)
        g.state = FREE
