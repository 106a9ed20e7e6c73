"""The pipeline executor: one rank walks its list of :class:`~runtime.schedule.Action` s.

Stage module interface (``x`` = tensors received from the previous stage, ``e`` = this stage's
own inputs for the micro-batch, the ``microbatches[i]`` tuple)::

    first stage   forward(*e)        -> tensor or tuple of tensors   (data inputs)
    middle stage  forward(*x, *e)    -> tensor or tuple of tensors   (e usually empty)
    last stage    forward(*x, *e)    -> scalar loss                  (e = labels, ...)

A single stage (``num_stages == 1``) is both: ``forward(*e) -> loss``. What crosses a boundary is
a tuple of tensors described by the receiver's ``recv_meta`` (shape, dtype, requires_grad).
Integer tensors (masks, positions) travel forward only; float tensors marked ``requires_grad``
get their gradient sent back.

Semantics (the ones :func:`runtime.schedule.simulate` models): ``SEND_*`` posts ``isend`` and
moves on; ``RECV_*`` posts ``irecv`` for every tensor of the message and waits. Outstanding sends
are waited for after the last action. All traffic goes through :mod:`runtime.comm` and is counted
(a send counts its bytes, a receive nothing); the time blocked waiting for a neighbour is the
``pp_bubble`` part of the step's measured breakdown (:mod:`runtime.timing`), as the pipeline group
is registered for it.

Math. With ``m`` micro-batches and per-micro-batch losses ``l_i`` the step's loss is
``L = (1/m) sum_i l_i``. The last stage backpropagates ``loss_scale * l_i / m``; every other stage
calls ``torch.autograd.backward(outputs_i, grad_outputs_i)`` with the gradient received for its
outputs, which by the chain rule accumulates ``loss_scale * dL/dθ`` into each parameter's
``.grad`` across the ``m`` backwards (no zeroing here; the data-parallel layer reduces them after).

Pre-flight. Before the first send, all stages of the pipeline exchange one small all-reduce (a
row per stage: error code, micro-batch count, offending micro-batch/input, and the stage's
``recv_meta``). Fewer micro-batches than stages, micro-batch inputs whose shapes or dtypes differ,
a malformed action list, or stages that disagree on the micro-batch count then raise
:class:`PipelineError` on *every* rank instead of leaving a neighbour blocked in a receive. Each
stage also learns its successor's ``recv_meta`` and checks every output against it before
sending it.

The mean loss is computed on the last stage and broadcast over the pipeline group, so every stage
(and rank 0, which logs) returns the same Python float.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from runtime import comm
from runtime.mesh import get_mesh
from runtime.schedule import RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, Action, B, F, ScheduleError, validate_rank

__all__ = ["TensorMeta", "PipelineError", "PipelineStage", "run_pipeline", "META_ROW"]

_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool,
)
#: Width limits of the pre-flight encoding of a ``recv_meta``.
MAX_TENSORS = 8
MAX_DIMS = 6
_HEAD = 5  # code, num_microbatches, bad micro-batch, bad input, number of received tensors
_SLOT = 3 + MAX_DIMS  # dtype code, requires_grad, ndim, dims
META_ROW = _HEAD + MAX_TENSORS * _SLOT

# pre-flight error codes
_OK, _FEW_MB, _SHAPES, _SCHEDULE, _META, _NO_MB = 0, 1, 2, 3, 4, 5


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one tensor that crosses a stage boundary."""

    shape: tuple[int, ...]
    """Full shape of the tensor for one micro-batch."""
    dtype: torch.dtype
    """Element type; integer and bool tensors never carry gradients."""
    requires_grad: bool | None = None
    """Whether the receiver sends a gradient back; defaults to ``dtype.is_floating_point``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype} cannot cross a pipeline boundary; use one of {_DTYPES}")
        if self.requires_grad is None:
            object.__setattr__(self, "requires_grad", self.dtype.is_floating_point)
        if self.requires_grad and not self.dtype.is_floating_point:
            raise ValueError(f"a {self.dtype} tensor cannot require grad; set requires_grad=False")

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorMeta":
        return cls(tuple(t.shape), t.dtype, bool(t.requires_grad and t.dtype.is_floating_point))

    def __str__(self) -> str:
        return f"{tuple(self.shape)} {str(self.dtype).replace('torch.', '')}" + (" (grad)" if self.requires_grad else "")


def _as_meta(m: Any) -> TensorMeta:
    if isinstance(m, TensorMeta):
        return m
    if isinstance(m, torch.Tensor):
        return TensorMeta.of(m)
    return TensorMeta(*m)


class PipelineError(ValueError):
    """A pipeline run was refused or failed in a way the user must fix (message says how)."""


def _tupled(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{tuple(x.shape)} {str(x.dtype).replace('torch.', '')}"
    return type(x).__name__


class PipelineStage:
    """One rank's stage: its module, place in the pipeline and what it receives.

    ``prev_rank`` / ``next_rank`` are *global* ranks (``get_mesh().pp_ranks[s -/+ 1]``);
    ``pp_group`` is the pipeline process group (``None`` means the default group, allowed only
    when the whole world is this one pipeline).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        stage_index: int,
        num_stages: int,
        *,
        recv_meta: Sequence[Any] = (),
        prev_rank: int | None = None,
        next_rank: int | None = None,
        pp_group: Any = None,
        last_rank: int | None = None,
        device: torch.device | str | None = None,
    ):
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index {stage_index} is outside 0..{num_stages - 1}")
        self.module = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.recv_meta = tuple(_as_meta(m) for m in recv_meta)
        if stage_index == 0 and self.recv_meta:
            raise ValueError("the first stage receives nothing; pass recv_meta=()")
        if stage_index > 0 and not self.recv_meta:
            raise ValueError(f"stage {stage_index} receives from stage {stage_index - 1}: give its recv_meta")
        if num_stages > 1:
            if stage_index > 0 and prev_rank is None:
                raise ValueError(f"stage {stage_index} needs prev_rank (global rank of stage {stage_index - 1})")
            if stage_index < num_stages - 1 and next_rank is None:
                raise ValueError(f"stage {stage_index} needs next_rank (global rank of stage {stage_index + 1})")
            if last_rank is None:
                raise ValueError("last_rank (global rank of the last stage, which broadcasts the loss) is required")
            if pp_group is None and dist.is_initialized() and dist.get_world_size() != num_stages:
                raise ValueError(
                    f"pp_group is None but the world has {dist.get_world_size()} ranks for {num_stages} "
                    "stages: pass the pipeline group (get_mesh().pp_group)"
                )
        self.prev_rank, self.next_rank, self.last_rank = prev_rank, next_rank, last_rank
        self.pp_group = pp_group
        if device is None:
            p = next(iter(module.parameters()), None)
            device = p.device if p is not None else torch.device("cpu")
        self.device = torch.device(device)
        self.send_meta: tuple[TensorMeta, ...] | None = None
        """The successor's ``recv_meta``, learned in the pre-flight exchange."""
        self._pending: list = []

    @classmethod
    def from_mesh(cls, module: torch.nn.Module, recv_meta: Sequence[Any] = (), mesh: Any = None, **kw) -> "PipelineStage":
        """Build from :func:`runtime.mesh.get_mesh` (stage = this rank's pp index)."""
        if mesh is None:
            mesh = get_mesh()
        s, p, ranks = mesh.pp_index, mesh.pp, mesh.pp_ranks
        return cls(
            module, s, p, recv_meta=recv_meta,
            prev_rank=ranks[s - 1] if s > 0 else None,
            next_rank=ranks[s + 1] if s < p - 1 else None,
            pp_group=mesh.pp_group, last_rank=ranks[-1], **kw,
        )

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    # ------------------------------------------------------------------ pre-flight

    def _local_check(self, actions: Sequence[Action], extras: list[tuple]) -> tuple[int, int, int, str]:
        """This rank's own checks: ``(code, bad micro-batch, bad input, message)``."""
        m, p, s = len(extras), self.num_stages, self.stage_index
        if m == 0:
            return _NO_MB, -1, -1, "no micro-batches were given"
        if m < p:
            return _FEW_MB, -1, -1, (
                f"{m} micro-batch{'es' if m != 1 else ''} for {p} pipeline stages: a pipeline needs at least as many "
                f"micro-batches as stages (use a smaller micro-batch size or fewer stages)"
            )
        ref = extras[0]
        for i, e in enumerate(extras[1:], start=1):
            if len(e) != len(ref):
                return _SHAPES, i, -1, (
                    f"micro-batch {i} has {len(e)} inputs but micro-batch 0 has {len(ref)}"
                )
            for j, (a, b) in enumerate(zip(e, ref)):
                same = (
                    a.shape == b.shape and a.dtype == b.dtype
                    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                    else type(a) is type(b)
                )
                if not same:
                    return _SHAPES, i, j, (
                        f"input {j} of micro-batch {i} is {_describe(a)} but micro-batch 0's is "
                        f"{_describe(b)}: every micro-batch must have the same shapes and dtypes "
                        f"(pad, or drop the last partial batch)"
                    )
        if len(self.recv_meta) > MAX_TENSORS or any(len(t.shape) > MAX_DIMS for t in self.recv_meta):
            return _META, -1, -1, f"recv_meta has more than {MAX_TENSORS} tensors or {MAX_DIMS} dims"
        try:
            validate_rank(actions, s, p, m)
        except ScheduleError as e:
            return _SCHEDULE, -1, -1, f"invalid action list: {e}"
        return _OK, -1, -1, ""

    def _encode(self, code: int, m: int, bad_mb: int, bad_in: int) -> list[int]:
        row = [code, m, bad_mb, bad_in, len(self.recv_meta)] + [0] * (MAX_TENSORS * _SLOT)
        if code != _META:
            for k, t in enumerate(self.recv_meta):
                o = _HEAD + k * _SLOT
                row[o:o + 3] = [_DTYPES.index(t.dtype), int(t.requires_grad), len(t.shape)]
                row[o + 3:o + 3 + len(t.shape)] = list(t.shape)
        return row

    @staticmethod
    def _decode_meta(row: list[int]) -> tuple[TensorMeta, ...]:
        out = []
        for k in range(row[4]):
            o = _HEAD + k * _SLOT
            dt, rg, nd = row[o:o + 3]
            out.append(TensorMeta(tuple(row[o + 3:o + 3 + nd]), _DTYPES[dt], bool(rg)))
        return tuple(out)

    def _preflight(self, actions: Sequence[Action], extras: list[tuple]) -> None:
        code, bad_mb, bad_in, msg = self._local_check(actions, extras)
        s, p, m = self.stage_index, self.num_stages, len(extras)
        if p == 1:
            if code != _OK:
                raise PipelineError(f"pipeline stage 0: {msg}")
            return
        table = torch.zeros(p, META_ROW, dtype=torch.int64, device=self.device)
        table[s] = torch.tensor(self._encode(code, m, bad_mb, bad_in), dtype=torch.int64)
        comm.all_reduce(table, group=self.pp_group)
        rows = table.cpu().tolist()
        problems = []
        for t, row in enumerate(rows):
            if t == s and code != _OK:
                problems.append(f"stage {s} (this rank): {msg}")
            elif row[0] == _FEW_MB:
                problems.append(
                    f"stage {t}: {row[1]} micro-batch{'es' if row[1] != 1 else ''} for {p} stages (need at least {p})"
                )
            elif row[0] == _SHAPES:
                problems.append(
                    f"stage {t}: input {row[3]} of micro-batch {row[2]} differs in shape or dtype from micro-batch 0"
                )
            elif row[0] != _OK:
                problems.append(f"stage {t}: " + {
                    _SCHEDULE: "its action list is invalid",
                    _META: "its recv_meta is too large to exchange",
                    _NO_MB: "no micro-batches were given",
                }[row[0]])
        counts = {row[1] for row in rows if row[0] not in (_NO_MB,)}
        if not problems and len(counts) > 1:
            problems.append(
                "stages disagree on the number of micro-batches: "
                + ", ".join(f"stage {t} has {row[1]}" for t, row in enumerate(rows))
            )
        if problems:
            raise PipelineError(
                "pipeline refused to start (nothing was sent):\n  " + "\n  ".join(problems)
            )
        if not self.is_last:
            self.send_meta = self._decode_meta(rows[s + 1])

    # ------------------------------------------------------------------ execution

    def _check_outputs(self, outs: tuple, i: int) -> None:
        want = self.send_meta
        assert want is not None
        nxt = self.stage_index + 1
        if len(outs) != len(want):
            raise PipelineError(
                f"stage {self.stage_index} returned {len(outs)} tensors for micro-batch {i} but stage "
                f"{nxt} expects {len(want)} ({', '.join(map(str, want))}); fix its recv_meta or the split"
            )
        for j, (o, w) in enumerate(zip(outs, want)):
            if not isinstance(o, torch.Tensor):
                raise PipelineError(f"stage {self.stage_index} output {j} is a {type(o).__name__}, not a tensor")
            if tuple(o.shape) != w.shape or o.dtype != w.dtype:
                raise PipelineError(
                    f"stage {self.stage_index} output {j} for micro-batch {i} is {_describe(o)} but stage "
                    f"{nxt}'s recv_meta expects {w}; fix the recv_meta or the stage split"
                )
            has_grad = bool(o.requires_grad)
            if w.requires_grad and not has_grad:
                raise PipelineError(
                    f"stage {self.stage_index} output {j} does not require grad but stage {nxt} will send "
                    f"a gradient for it (recv_meta requires_grad=True); set requires_grad=False there"
                )
            if has_grad and not w.requires_grad:
                raise PipelineError(
                    f"stage {self.stage_index} output {j} requires grad but stage {nxt}'s recv_meta has "
                    f"requires_grad=False, so its gradient would be lost; mark it requires_grad=True"
                )

    def _recv(self, metas: Sequence[TensorMeta], src: int) -> list[torch.Tensor]:
        bufs = [torch.empty(t.shape, dtype=t.dtype, device=self.device) for t in metas]
        works = [comm.irecv(b, src, group=self.pp_group) for b in bufs]
        for w in works:
            comm.wait(w)
        return bufs

    def _isend(self, tensors: Sequence[torch.Tensor], dst: int) -> None:
        for t in tensors:
            buf = t.detach().contiguous()
            self._pending.append((comm.isend(buf, dst, group=self.pp_group), buf))
        # Release buffers whose sends completed (the receiver has taken them).
        self._pending = [(w, b) for w, b in self._pending if w is not None and not w.is_completed()]

    def run(self, actions: Sequence[Action], microbatches: Sequence[Any], *, loss_scale: float = 1.0) -> float:
        """Execute this rank's actions over ``microbatches``; return the mean loss (every stage).

        ``microbatches[i]`` is the tuple of this stage's own inputs for micro-batch ``i`` (first
        stage: the data inputs; last stage: the labels; middle stages: usually ``()``). A
        non-tuple is treated as a 1-tuple. Parameter gradients are *accumulated* into ``.grad``
        as ``loss_scale * d(mean loss)/dθ``.
        """
        extras = [_tupled(mb) for mb in microbatches]
        m = len(extras)
        self._preflight(actions, extras)
        inputs: dict[int, tuple[torch.Tensor, ...]] = {}
        outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        out_grads: dict[int, list[torch.Tensor]] = {}
        in_grads: dict[int, list[torch.Tensor]] = {}
        losses: dict[int, torch.Tensor] = {}
        scaled: dict[int, torch.Tensor] = {}
        self._pending = []
        for a in actions:
            i = a.microbatch
            if a.kind == RECV_ACT:
                bufs = self._recv(self.recv_meta, self.prev_rank)
                inputs[i] = tuple(b.requires_grad_(True) if t.requires_grad else b for b, t in zip(bufs, self.recv_meta))
            elif a.kind == F:
                out = self.module(*inputs.get(i, ()), *extras[i])
                if self.is_last:
                    if not isinstance(out, torch.Tensor) or out.numel() != 1:
                        raise PipelineError(
                            f"the last stage must return a scalar loss, got "
                            f"{_describe(out) if isinstance(out, torch.Tensor) else type(out).__name__}"
                        )
                    losses[i] = out.detach().reshape(())
                    scaled[i] = out.reshape(()) * (loss_scale / m)
                else:
                    outs = _tupled(out)
                    self._check_outputs(outs, i)
                    outputs[i] = outs
            elif a.kind == SEND_ACT:
                self._isend(outputs[i], self.next_rank)
            elif a.kind == RECV_GRAD:
                out_grads[i] = self._recv([t for t in self.send_meta if t.requires_grad], self.next_rank)
            elif a.kind == B:
                if self.is_last:
                    torch.autograd.backward(scaled.pop(i))
                else:
                    outs = [o for o, t in zip(outputs.pop(i), self.send_meta) if t.requires_grad]
                    grads = out_grads.pop(i, [])
                    if outs:
                        torch.autograd.backward(outs, grads)
                if not self.is_first:
                    recvd = inputs.pop(i)
                    in_grads[i] = [
                        x.grad if x.grad is not None else torch.zeros_like(x)
                        for x, t in zip(recvd, self.recv_meta) if t.requires_grad
                    ]
            elif a.kind == SEND_GRAD:
                self._isend(in_grads.pop(i), self.prev_rank)
        for w, _ in self._pending:
            comm.wait(w)
        self._pending = []
        return self._mean_loss(losses, m)

    def _mean_loss(self, losses: dict[int, torch.Tensor], m: int) -> float:
        """Mean of the micro-batch losses, computed on the last stage and broadcast to all."""
        if self.is_last:
            value = torch.stack([losses[i].to(torch.float64) for i in range(m)]).sum() / m
        else:
            value = torch.zeros((), dtype=torch.float64)
        if self.num_stages > 1:
            value = value.to(self.device)
            comm.broadcast(value, src=self.last_rank, group=self.pp_group)
        return float(value.item())


def run_pipeline(
    stage_module: torch.nn.Module,
    actions: Sequence[Action],
    microbatches: Sequence[Any],
    *,
    stage_index: int,
    num_stages: int,
    recv_meta: Sequence[Any] = (),
    prev_rank: int | None = None,
    next_rank: int | None = None,
    last_rank: int | None = None,
    pp_group: Any = None,
    loss_scale: float = 1.0,
    device: torch.device | str | None = None,
) -> float:
    """Run one step of the pipeline on this rank; see :meth:`PipelineStage.run`.

    Returns the mean loss over micro-batches on every stage (broadcast from the last stage).
    """
    stage = PipelineStage(
        stage_module, stage_index, num_stages, recv_meta=recv_meta, prev_rank=prev_rank,
        next_rank=next_rank, pp_group=pp_group, last_rank=last_rank, device=device,
    )
    return stage.run(actions, microbatches, loss_scale=loss_scale)
