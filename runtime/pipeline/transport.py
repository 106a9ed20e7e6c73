"""A stage's messages: receives posted ahead of need, sends left in flight.

``SEND_*`` posts ``isend`` and moves on; ``RECV_*`` posts ``irecv`` for every tensor of the
message and waits. Outstanding sends are waited for after the last action. With overlap on
(``runtime.contract.overlap``'s ``pp``, the default) each receive is posted one compute action
ahead (``ReceiveAhead``), so the transfer runs under that compute and the wait at the ``RECV``
finds it done; with overlap off each receive is posted where the list reaches it and waited at
once, so the whole transfer is on the compute path. Sends are asynchronous either way: that is
the semantics the schedules are validated and deadlock-simulated under
(``runtime.contract.schedule_ir``), and a send completes only once its receive is posted (gloo,
NCCL), so waiting for a send before the next action would deadlock a schedule whose peer posts
that receive after its own next compute. A send costs its sender nothing but the launch; what it
costs the pipeline is paid by the receiver's wait. All traffic goes
through :mod:`runtime.distributed.comm` and is counted (a send counts its bytes, a receive
nothing); the time blocked waiting for a neighbour is the ``pp_bubble`` part of the step's
measured breakdown (:mod:`runtime.timing`), as the pipeline group is registered for it.

Split messages (Megatron-LM's scatter/gather, Narayanan et al. 2021, section 4.1). Without
sequence parallelism the ``tp`` ranks of a stage hold the same activation, and the ``tp`` ranks
of the next stage need it whole: a tensor whose :class:`TensorMeta` says ``split`` (and whose
size ``tp`` divides) leaves each sender as its ``1 / tp`` slice of the flattened tensor, and the
receivers all-gather the slices over their tensor-parallel group once the receive is done. The
link between stages, the network when they sit on two nodes, carries ``1 / tp`` of the bytes; the
group's own links the rest. A rank sends ``S / tp`` and gathers ``(tp - 1) / tp x S``: the bytes
it counts are those of a whole send. The gather waits in ``pp_bubble``, as the receive does.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from runtime import timing
from runtime.contract.schedule_ir import COMPUTE, RECV_ACT, RECV_GRAD, Action
from runtime.distributed import comm
from runtime.pipeline.boundary import TensorMeta

__all__ = ["PostedRecv", "StageTransport", "ReceiveAhead"]


class PostedRecv(NamedTuple):
    """A posted receive: what arrives (a tensor, or this rank's slice of a split one), the works,
    and the whole tensors the split slices are gathered into (``None`` where not split)."""

    buffers: list[torch.Tensor]
    works: list
    gathered: list[torch.Tensor | None]


class StageTransport:
    """Point-to-point messages over the pipeline group, and the sends still in flight."""

    def __init__(self, pp_group: Any, device: torch.device, tp_group: Any = None):
        self.pp_group = pp_group
        """The pipeline process group (``None``: the default group)."""
        self.device = device
        """Where receive buffers are allocated."""
        self.tp_group = tp_group
        """This rank's tensor-parallel group, over which split messages are gathered (``None``:
        nothing is split)."""
        self.tp = comm.group_size(tp_group) if tp_group is not None else 1
        self.tp_index = dist.get_rank(tp_group) if self.tp > 1 else 0
        self._pending: list = []

    def _splits(self, meta: TensorMeta) -> bool:
        """Whether ``meta``'s tensor travels as ``1 / tp`` slices (module docstring)."""
        return meta.split and self.tp > 1 and math.prod(meta.shape) % self.tp == 0

    def post_recv(self, metas: Sequence[TensorMeta], source: int) -> PostedRecv:
        """Post one ``irecv`` per tensor of a message from global rank ``source``."""
        gathered = [
            torch.empty(meta.shape, dtype=meta.dtype, device=self.device) if self._splits(meta) else None
            for meta in metas
        ]
        buffers = [
            torch.empty(math.prod(meta.shape) // self.tp, dtype=meta.dtype, device=self.device)
            if whole is not None
            else torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
            for meta, whole in zip(metas, gathered)
        ]
        return PostedRecv(buffers, [comm.irecv(buffer, source, group=self.pp_group) for buffer in buffers], gathered)

    def wait_recv(self, posted: PostedRecv) -> list[torch.Tensor]:
        """Wait for a posted receive (and gather its split tensors); the tensors."""
        for work in posted.works:
            comm.wait(work)
        received = []
        for buffer, whole in zip(posted.buffers, posted.gathered):
            if whole is not None:
                comm.all_gather_into(whole.view(-1), buffer, group=self.tp_group, part=timing.AXIS_PARTS["pp"])
            received.append(buffer if whole is None else whole)
        return received

    def isend(self, tensors: Sequence[torch.Tensor], destination: int, metas: Sequence[TensorMeta]) -> None:
        """Post one ``isend`` per tensor to global rank ``destination`` and move on (a split one
        as this rank's slice)."""
        for tensor, meta in zip(tensors, metas, strict=True):
            buffer = tensor.detach().contiguous()
            if self._splits(meta):
                size = buffer.numel() // self.tp
                buffer = buffer.view(-1).narrow(0, self.tp_index * size, size)
            self._pending.append((comm.isend(buffer, destination, group=self.pp_group), buffer))
        # Release buffers whose sends completed (the receiver has taken them).
        self._pending = [
            (work, buffer) for work, buffer in self._pending if work is not None and not work.is_completed()
        ]

    def start(self) -> None:
        """Forget any sends of an earlier step."""
        self._pending = []

    def finish(self) -> None:
        """Wait for every send still in flight."""
        for work, _ in self._pending:
            comm.wait(work)
        self._pending = []


class ReceiveAhead:
    """Posts each receive one compute action early: the message arrives while this rank computes
    instead of after it (a peer's send of a large tensor completes only once the receive is
    posted). Receives are still posted in list order, so each pair's messages match as without it."""

    def __init__(self, actions: Sequence[Action], post: Callable[[Action], PostedRecv], ahead: bool = True):
        self._actions = actions
        self._ahead_on = ahead  # False: nothing is posted ahead (``take`` posts each receive)
        self._post = post
        self._receives = [k for k, action in enumerate(actions) if action.kind in (RECV_ACT, RECV_GRAD)]
        self._posted: dict[int, PostedRecv] = {}
        self._ahead = 0  # self._receives[self._ahead] is the first receive not yet reached

    def before(self, index: int) -> None:
        """Called before action ``index``: if it computes, post the next receive not yet posted."""
        if not self._ahead_on:
            return
        receives = self._receives
        while self._ahead < len(receives) and receives[self._ahead] <= index:
            self._ahead += 1
        if self._actions[index].kind in COMPUTE and self._ahead < len(receives):
            upcoming = receives[self._ahead]
            if upcoming not in self._posted:
                self._posted[upcoming] = self._post(self._actions[upcoming])

    def take(self, index: int) -> PostedRecv:
        """The receive of action ``index``: the one posted ahead, or one posted now."""
        return self._posted.pop(index, None) or self._post(self._actions[index])
