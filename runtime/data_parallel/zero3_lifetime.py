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
weight-side kernels may read them, and a checkpointed layer recomputes its forward); each is freed
as soon as its last gradient of the pass arrives (``_on_grad``), as in an ordinary backward. So
``W`` holds at most the groups whose weights it is between, typically one layer's.

``Zero3Params`` holds these hooks and the gather/free of one group; ``runtime.data_parallel.zero_engine.ZeroEngine``
derives from it and owns everything else (groups, buckets, the step). Its attributes used here:
``stage``, ``dtype``, ``dp``, ``dp_rank``, ``dp_group``, ``groups``, ``prefetch``, ``counters``,
``_off`` (the offload stores, which give each group's shard: ``runtime.data_parallel.offload_engine``),
``_begin_backward`` (the engine's start of a backward pass), ``_group_root`` (each group's root)
and the forward-order bookkeeping ``_fwd_order``, ``_fwd_seen``, ``_orders``.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from runtime.data_parallel.flat_shards import FREE, GATHERED, GATHERING, FlatGroup, ZeroError
from runtime.distributed import comm

__all__ = ["Zero3Params", "in_backward", "group_roots"]


def in_backward() -> bool:
    """True while autograd's engine runs a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def group_roots(groups: list[FlatGroup], roots: list[str]) -> list[int]:
    """The root (index into ``roots``, module names; ``""`` is the whole module) of each group:
    the one whose subtree holds all its parameters."""
    out = []
    for g in groups:
        inside = [k for k, r in enumerate(roots) if not r or all(e.name.startswith(r + ".") for e in g.entries)]
        if not inside:
            raise ZeroError(
                f"parameter group {g.index} ({', '.join(g.names[:3])}) lies in none of the roots "
                f"{roots} (or spans several): group each root's parameters separately"
            )
        out.append(inside[0])
    return out


class Zero3Params:
    """The ZeRO-3 half of ``runtime.data_parallel.zero_engine.ZeroEngine``: forward/backward hooks that gather each
    layer's parameters ahead of use (with prefetch) and free them after."""

    def _order(self, root: int) -> list[int]:
        """Root ``root``'s groups in its last forward's order (index order before any)."""
        return self._orders.get(root) or [g.index for g in self.groups if self._group_root[g.index] == root]

    def _root_post_forward(self, root: int):
        if in_backward() or self.stage != 3:
            return
        if self._fwd_order:
            self._orders[root] = list(self._fwd_order)
        for g in self.groups:  # prefetched but not used in this forward
            if self._group_root[g.index] == root:
                self._free(g)

    def prepare_weights(self, weights) -> None:
        """Before an autograd call that computes the gradients of ``weights`` outside the
        backward that gathered them (a split schedule's ``W``): gather their groups (stage 3;
        module docstring). They are freed as their gradients complete, or when the pass ends."""
        if self.stage != 3:
            return
        ids = {id(w) for w in weights}
        for g in self.groups:
            if ids.intersection(g.by_id):
                self._gather(g)
                self._wait_gather(g)

    def _pre_forward(self, groups: list[FlatGroup]) -> None:
        in_bwd = in_backward()
        for g in groups:
            self._gather(g)
            self._wait_gather(g)
            if not in_bwd and g.index not in self._fwd_seen:
                self._fwd_seen.add(g.index)
                self._fwd_order.append(g.index)
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
            for gi in reversed(self._order(self._group_root[groups[-1].index])):
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
