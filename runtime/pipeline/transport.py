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
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from runtime.contract.schedule_ir import COMPUTE, RECV_ACT, RECV_GRAD, Action
from runtime.distributed import comm
from runtime.pipeline.boundary import TensorMeta

__all__ = ["PostedRecv", "StageTransport", "ReceiveAhead"]

#: A posted receive: its buffers and their works.
PostedRecv = tuple[list[torch.Tensor], list]


class StageTransport:
    """Point-to-point messages over the pipeline group, and the sends still in flight."""

    def __init__(self, pp_group: Any, device: torch.device):
        self.pp_group = pp_group
        """The pipeline process group (``None``: the default group)."""
        self.device = device
        """Where receive buffers are allocated."""
        self._pending: list = []

    def post_recv(self, metas: Sequence[TensorMeta], source: int) -> PostedRecv:
        """Post one ``irecv`` per tensor of a message from global rank ``source``."""
        buffers = [torch.empty(meta.shape, dtype=meta.dtype, device=self.device) for meta in metas]
        return buffers, [comm.irecv(buffer, source, group=self.pp_group) for buffer in buffers]

    @staticmethod
    def wait_recv(posted: PostedRecv) -> list[torch.Tensor]:
        """Wait for a posted receive; its buffers."""
        buffers, works = posted
        for work in works:
            comm.wait(work)
        return buffers

    def isend(self, tensors: Sequence[torch.Tensor], destination: int) -> None:
        """Post one ``isend`` per tensor to global rank ``destination`` and move on."""
        for tensor in tensors:
            buffer = tensor.detach().contiguous()
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
