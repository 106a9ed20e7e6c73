"""The pipeline executor: one rank walks its list of :class:`~runtime.contract.schedule_ir.Action` s.

Stage module interface (``x`` = tensors received from the previous stage, ``e`` = this stage's
own inputs for the micro-batch, the ``microbatches[i]`` tuple)::

    first stage   forward(*e)        -> tensor or tuple of tensors   (data inputs)
    middle stage  forward(*x, *e)    -> tensor or tuple of tensors   (e usually empty)
    last stage    forward(*x, *e)    -> scalar loss                  (e = labels, ...)

A single stage (``num_stages == 1``) is both: ``forward(*e) -> loss``. What crosses a boundary is
a tuple of tensors described by the receiver's ``recv_meta`` (:mod:`runtime.pipeline.boundary`).

Actions: ``F`` forward, ``B`` backward (input gradients only when the list has ``W`` actions,
:mod:`runtime.pipeline.backward_split`), ``W`` weight gradients. Sends and receives follow the
semantics :func:`runtime.contract.schedule_ir.simulate` models (:mod:`runtime.pipeline.transport`).

Math. With ``m`` micro-batches and per-micro-batch losses ``l_i`` the step's loss is
``L = (1/m) sum_i l_i``. The last stage backpropagates ``loss_scale * l_i / m``; every other stage
calls ``torch.autograd.backward(outputs_i, grad_outputs_i)`` with the gradient received for its
outputs, which by the chain rule accumulates ``loss_scale * dL/dθ`` into each parameter's
``.grad`` across the ``m`` backwards (no zeroing here; the data-parallel layer reduces them after).

Pre-flight (:mod:`runtime.pipeline.preflight`). Before the first send, all stages exchange one
small all-reduce, so that a refused run raises :class:`PipelineError` on *every* rank instead of
leaving a neighbour blocked in a receive, and each stage learns its successor's ``recv_meta``.

The mean loss is computed on the last stage and broadcast over the pipeline group, so every stage
(and rank 0, which logs) returns the same Python float.

Model chunks. With ``virtual_stages = v > 1`` (interleaved schedules) a rank holds ``v`` chunk
modules (:class:`StagePlacement`), each with its own ``recv_meta``; ``microbatches[i]`` is then a
sequence of ``v`` input tuples, one per local chunk. Every action names its chunk, so the rank
keeps its state per (chunk, micro-batch) (:class:`StepState`). The pre-flight table has a row per
model chunk.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, cast

import torch

from runtime.contract.schedule_ir import RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, Action, B, F, W
from runtime.distributed import comm
from runtime.distributed.mesh import Mesh, get_mesh
from runtime.pipeline import preflight
from runtime.pipeline.backward_split import BackwardScope, WeightWork, backward_input, backward_weight
from runtime.pipeline.boundary import PipelineError, TensorMeta, as_meta, as_tuple, check_outputs, describe
from runtime.pipeline.placement import StagePlacement
from runtime.pipeline.preflight import MAX_DIMS, MAX_TENSORS, META_ROW
from runtime.pipeline.transport import PostedRecv, ReceiveAhead, StageTransport

__all__ = [
    "TensorMeta",
    "PipelineError",
    "PipelineStage",
    "StagePlacement",
    "StepState",
    "run_pipeline",
    "META_ROW",
    "MAX_TENSORS",
    "MAX_DIMS",
    "WeightWork",
    "backward_input",
    "backward_weight",
    "BackwardScope",
]

#: A (local chunk, micro-batch) pair: the key of every per-micro-batch state.
Key = tuple[int, int]


@dataclass
class StepState:
    """What one step keeps per (local chunk, micro-batch) between its actions. Each entry is
    dropped by the action that consumes it, so that a micro-batch's memory lives no longer than
    the schedule needs it."""

    inputs: dict[Key, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    """Received activations (``RECV_ACT`` to ``B``)."""
    outputs: dict[Key, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    """Outputs of ``F`` (to ``SEND_ACT`` and ``B``); the last chunk's scaled loss."""
    out_grads: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    """Received gradients of the outputs (``RECV_GRAD`` to ``B``)."""
    in_grads: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    """Gradients of the received inputs (``B`` to ``SEND_GRAD``)."""
    weight_work: dict[Key, WeightWork] = field(default_factory=dict)
    """What a split ``B`` left for its ``W``."""
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    """Each micro-batch's unscaled loss (last chunk only)."""


class PipelineStage:
    """One rank's stage: its module(s), place in the pipeline and what each chunk receives.

    ``placement`` says where the rank sits and whom it talks to (:class:`StagePlacement`). With
    ``virtual_stages = v > 1``, ``module`` is the sequence of the rank's ``v`` chunk modules in
    model order and ``recv_meta`` the sequence of their ``v`` receive metadata (``()`` for model
    chunk 0); ``self.module`` is then an ``nn.ModuleList`` of them. ``backward_scope`` (e.g. the
    ZeRO engine over these modules, :class:`BackwardScope`) wraps each ``B`` and each ``W``: a
    ``W`` and its per-group autograd calls are one backward pass of the engine, a split ``B`` one
    that accumulates nothing. ``tp_group``: this rank's tensor-parallel group, over which a message
    marked ``split`` is gathered (:mod:`runtime.pipeline.transport`; ``from_mesh`` passes the mesh's).
    """

    def __init__(
        self,
        module: torch.nn.Module | Sequence[torch.nn.Module],
        placement: StagePlacement,
        *,
        recv_meta: Sequence[Any] = (),
        device: torch.device | str | None = None,
        backward_scope: BackwardScope | None = None,
        overlap: bool = True,
        tp_group: Any = None,
    ):
        chunks = placement.virtual_stages
        if chunks == 1:
            self.modules: list[torch.nn.Module] = [cast(torch.nn.Module, module)]
            metas = [recv_meta]
        else:
            if isinstance(module, torch.nn.Module) or len(module) != chunks:
                raise ValueError(f"virtual_stages={chunks}: pass a sequence of {chunks} chunk modules (model order)")
            if len(recv_meta) != chunks:
                raise ValueError(f"virtual_stages={chunks}: pass a sequence of {chunks} recv_meta, one per chunk")
            self.modules = list(module)
            metas = list(recv_meta)
            module = torch.nn.ModuleList(self.modules)
        self.module = cast(torch.nn.Module, module)
        self.placement = placement
        self.recv_metas = [tuple(as_meta(described) for described in chunk_metas) for chunk_metas in metas]
        _check_recv_metas(placement, self.recv_metas)
        placement.check_neighbours()
        if device is None:
            first_param = next(iter(self.module.parameters()), None)
            device = first_param.device if first_param is not None else torch.device("cpu")
        self.device = torch.device(device)
        self.transport = StageTransport(placement.pp_group, self.device, tp_group)
        self.backward_scope = backward_scope
        self.overlap = overlap
        """Receives posted one compute action ahead (``runtime.pipeline.transport.ReceiveAhead``);
        False (``--overlap off``): each posted where the list reaches it and waited at once."""
        self.send_metas: list[tuple[TensorMeta, ...] | None] = [None] * chunks
        """Each chunk's successor's ``recv_meta``, learned in the pre-flight exchange."""

    @classmethod
    def from_mesh(
        cls,
        module: torch.nn.Module | Sequence[torch.nn.Module],
        recv_meta: Sequence[Any] = (),
        mesh: Mesh | None = None,
        *,
        device: torch.device | str | None = None,
        virtual_stages: int = 1,
        backward_scope: BackwardScope | None = None,
        overlap: bool = True,
    ) -> "PipelineStage":
        """Build from :func:`runtime.distributed.mesh.get_mesh` (stage = this rank's pp index)."""
        placement = StagePlacement.from_mesh(mesh, virtual_stages)
        tp_group = (mesh or get_mesh()).tp_group
        return cls(
            module,
            placement,
            recv_meta=recv_meta,
            device=device,
            backward_scope=backward_scope,
            overlap=overlap,
            tp_group=tp_group,
        )

    @property
    def num_stages(self) -> int:
        return self.placement.num_stages

    @property
    def virtual_stages(self) -> int:
        return self.placement.virtual_stages

    @property
    def is_last(self) -> bool:
        return self.placement.is_last

    # ------------------------------------------------------------------ pre-flight and messages

    def _split_inputs(self, microbatches: Sequence[Any]) -> list[list[tuple]]:
        """``extras[i][j]``: local chunk ``j``'s own inputs for micro-batch ``i``."""
        chunks = self.virtual_stages
        if chunks == 1:
            return [[as_tuple(micro_batch)] for micro_batch in microbatches]
        extras = []
        for i, micro_batch in enumerate(microbatches):
            if (
                not isinstance(micro_batch, (tuple, list))
                or len(micro_batch) != chunks
                or not all(isinstance(inputs, (tuple, list)) for inputs in micro_batch)
            ):
                raise PipelineError(
                    f"micro-batch {i}: with {chunks} model chunks per rank give one tuple of inputs per chunk "
                    f"({chunks} tuples, () for a chunk without inputs), got {describe(micro_batch)}"
                )
            extras.append([tuple(inputs) for inputs in micro_batch])
        return extras

    def _preflight(self, actions: Sequence[Action], extras: list[list[tuple]]) -> None:
        """The pre-flight checks and exchange (:mod:`runtime.pipeline.preflight`)."""
        self.send_metas = preflight.exchange(self.placement, self.recv_metas, actions, extras, self.device)

    def _post_recv(self, action: Action) -> PostedRecv:
        """Post the receive of ``RECV_ACT`` / ``RECV_GRAD`` ``action``: its buffers and works."""
        if action.kind == RECV_ACT:
            return self.transport.post_recv(self.recv_metas[action.chunk], _neighbour(self.placement.prev_rank))
        sent = self.send_metas[action.chunk] or ()
        return self.transport.post_recv(
            [meta for meta in sent if meta.requires_grad], _neighbour(self.placement.next_rank)
        )

    def _isend(self, tensors: Sequence[torch.Tensor], destination: int | None, metas: Sequence[TensorMeta]) -> None:
        self.transport.isend(tensors, _neighbour(destination), metas)

    # ------------------------------------------------------------------ execution

    def run(self, actions: Sequence[Action], microbatches: Sequence[Any], *, loss_scale: float = 1.0) -> float:
        """Execute this rank's actions over ``microbatches``; return the mean loss (every stage).

        ``microbatches[i]`` is the tuple of this stage's own inputs for micro-batch ``i`` (first
        stage: the data inputs; last stage: the labels; middle stages: usually ``()``); with
        ``v > 1`` model chunks, a sequence of ``v`` such tuples, one per local chunk. A non-tuple
        is treated as a 1-tuple. Parameter gradients are *accumulated* into ``.grad`` as
        ``loss_scale * d(mean loss)/dθ``. If the list has ``W`` actions, ``B`` computes input
        gradients and ``W`` weight gradients (module docstring).
        """
        extras = self._split_inputs(microbatches)
        micro_batch_count = len(extras)
        self._preflight(actions, extras)
        split = any(action.kind == W for action in actions)
        state = StepState()
        self.transport.start()
        receives = ReceiveAhead(actions, self._post_recv, ahead=self.overlap)
        for index, action in enumerate(actions):
            receives.before(index)
            if action.kind in (RECV_ACT, RECV_GRAD):
                self._store_received(action, self.transport.wait_recv(receives.take(index)), state)
            else:
                self._act(action, split, extras, state, loss_scale / micro_batch_count)
        self.transport.finish()
        return self._mean_loss(state.losses, micro_batch_count)

    def _store_received(self, action: Action, buffers: list[torch.Tensor], state: StepState) -> None:
        key = (action.chunk, action.microbatch)
        if action.kind == RECV_ACT:
            metas = self.recv_metas[action.chunk]
            state.inputs[key] = tuple(
                buffer.requires_grad_(True) if meta.requires_grad else buffer for buffer, meta in zip(buffers, metas)
            )
        else:
            state.out_grads[key] = buffers

    def _act(self, action: Action, split: bool, extras: list[list[tuple]], state: StepState, scale: float) -> None:
        """One compute or send action."""
        key = (action.chunk, action.microbatch)
        if action.kind == F:
            received = state.inputs.get(key, ())
            self._forward(key, received, extras[action.microbatch][action.chunk], state, scale)
        elif action.kind == SEND_ACT:
            self._isend(state.outputs[key], self.placement.next_rank, self.send_metas[action.chunk] or ())
        elif action.kind == B:
            with self._scope(accumulates=not split):
                self._backward(key, split, state)
        elif action.kind == W:
            with self._scope(accumulates=True):
                backward_weight(state.weight_work.pop(key), self._prepare)
        elif action.kind == SEND_GRAD:
            wanted = [meta for meta in self.recv_metas[action.chunk] if meta.requires_grad]
            self._isend(state.in_grads.pop(key), self.placement.prev_rank, wanted)

    def _forward(self, key: Key, received: tuple, extra: tuple, state: StepState, scale: float) -> None:
        """``F`` of one (chunk, micro-batch): its outputs go to ``state.outputs`` (the last chunk's
        loss, scaled, with its value in ``state.losses``). A method so that no local outlives the
        action: under a split backward the loss's graph above the weight products (the
        log-probabilities) is freed when ``B`` drops the outputs, and a loop variable would keep it
        until the next ``F``."""
        chunk, micro_batch = key
        out = self.modules[chunk](*received, *extra)
        if self.placement.holds_last(chunk):
            if not isinstance(out, torch.Tensor) or out.numel() != 1:
                raise PipelineError(
                    f"the last stage must return a scalar loss, got "
                    f"{describe(out) if isinstance(out, torch.Tensor) else type(out).__name__}"
                )
            state.losses[micro_batch] = out.detach().reshape(())
            state.outputs[key] = (out.reshape(()) * scale,)
        else:
            outs = as_tuple(out)
            expected = self.send_metas[chunk]
            assert expected is not None
            placement = self.placement
            check_outputs(outs, expected, micro_batch, placement.chunk_name(chunk), placement.successor_name(chunk))
            state.outputs[key] = outs

    def _scope(self, accumulates: bool) -> contextlib.AbstractContextManager:
        scope = self.backward_scope
        return scope.backward_pass(accumulates=accumulates) if scope is not None else contextlib.nullcontext()

    @property
    def _prepare(self) -> Callable[[list[torch.Tensor], list[torch.Tensor]], None] | None:
        return self.backward_scope.prepare_weights if self.backward_scope is not None else None

    def _backward(self, key: Key, split: bool, state: StepState) -> None:
        """``B`` of one (chunk, micro-batch): the full backward, or with ``split`` the input
        gradients only (the rest is left in ``state.weight_work`` for ``W``)."""
        chunk = key[0]
        if self.placement.holds_last(chunk):
            outs: list[torch.Tensor] = list(state.outputs.pop(key))
            grads: list[torch.Tensor | None] = [None]
        else:
            sent = self.send_metas[chunk] or ()
            outs = [output for output, meta in zip(state.outputs.pop(key), sent) if meta.requires_grad]
            grads = list(state.out_grads.pop(key, []))
        received = state.inputs.pop(key, ())
        wanted = [x for x, meta in zip(received, self.recv_metas[chunk]) if meta.requires_grad]
        if split:
            input_grads, state.weight_work[key] = backward_input(outs, grads, wanted)
            if not self.placement.holds_first(chunk):
                state.in_grads[key] = input_grads
            return
        if outs:
            torch.autograd.backward(outs, grads)
        if not self.placement.holds_first(chunk):
            state.in_grads[key] = [x.grad if x.grad is not None else torch.zeros_like(x) for x in wanted]

    def _mean_loss(self, losses: dict[int, torch.Tensor], micro_batch_count: int) -> float:
        """Mean of the micro-batch losses, computed on the last stage and broadcast to all."""
        if self.is_last:
            value = (
                torch.stack([losses[i].to(torch.float64) for i in range(micro_batch_count)]).sum() / micro_batch_count
            )
        else:
            value = torch.zeros((), dtype=torch.float64)
        if self.num_stages > 1:
            value = value.to(self.device)
            last_rank = self.placement.last_rank
            assert last_rank is not None  # required with more than one stage (StagePlacement.check_neighbours)
            comm.broadcast(value, src=last_rank, group=self.placement.pp_group)
        return float(value.item())


def _neighbour(rank: int | None) -> int:
    """A neighbour's global rank, which :meth:`StagePlacement.check_neighbours` made sure is given
    wherever the schedule talks to it."""
    assert rank is not None, "a pipeline message to or from a stage without that neighbour"
    return rank


def _check_recv_metas(placement: StagePlacement, recv_metas: list[tuple[TensorMeta, ...]]) -> None:
    """Model chunk 0 receives nothing; every other chunk receives something."""
    noun = "stage" if placement.virtual_stages == 1 else "model chunk"
    for j, chunk_metas in enumerate(recv_metas):
        chunk = placement.model_chunk(j)
        if chunk == 0 and chunk_metas:
            raise ValueError(f"the first {noun} receives nothing; pass recv_meta=()")
        if chunk > 0 and not chunk_metas:
            raise ValueError(f"{noun} {chunk} receives from {noun} {chunk - 1}: give its recv_meta")


def run_pipeline(
    stage_module: torch.nn.Module,
    actions: Sequence[Action],
    microbatches: Sequence[Any],
    placement: StagePlacement,
    *,
    recv_meta: Sequence[Any] = (),
    loss_scale: float = 1.0,
    device: torch.device | str | None = None,
    backward_scope: BackwardScope | None = None,
) -> float:
    """Run one step of the pipeline on this rank; see :meth:`PipelineStage.run`.

    Returns the mean loss over micro-batches on every stage (broadcast from the last stage).
    """
    stage = PipelineStage(stage_module, placement, recv_meta=recv_meta, device=device, backward_scope=backward_scope)
    return stage.run(actions, microbatches, loss_scale=loss_scale)
