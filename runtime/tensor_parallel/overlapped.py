"""Tensor-parallel collectives overlapped with the matmuls around them (``--overlap``'s ``tp``).

Helpers of :mod:`runtime.tensor_parallel` (its ``column_parallel_linears`` and
``linear_reduce_scatter_seq`` call them when :func:`overlap_enabled`): each fuses a parallel linear
with the collective at its edge into one autograd function, so the collective can be launched
asynchronously (``runtime.distributed.comm``, ``async_op=True``: its bytes are counted, the launch
blocks nothing, and its ``comm.wait`` counts in ``tp_comm``) and waited only after independent work.
The numbers are those of the synchronous path; only the order of the work changes.

* Column parallel without sequence parallelism (Megatron's "async grad all-reduce", Narayanan et
  al. 2021 / Megatron-LM ``LinearWithGradAccumulationAndAsyncCommunication``): backward computes
  the input gradient ``dx = sum_i dy_i W_i`` of every linear that shares the input, launches its
  all-reduce, computes the weight and bias gradients ``dW_i = dy_i^T x`` while it runs, then waits.
  The forward communicates nothing.
* Column parallel under sequence parallelism: the forward all-gather of the positions is split in
  ``k`` pieces (:func:`pieces`), all launched at once; the product of this rank's own positions is
  computed while they arrive, then each piece's products as it lands (torchtitan's async TP and
  Megatron-Core's ``--tp-comm-overlap`` pipeline the same all-gather -> matmul, Wang et al. 2022).
  Only this rank's positions are saved for backward (``s b h / t`` bytes, not the gathered
  ``s b h``: Korthikanti et al. 2022, Sec. 4.2.2), so backward launches their all-gather again
  (one collective), computes ``dx`` while it travels (the input gradient needs no input), launches
  the reduce-scatter of ``dx``, then waits for the gather and computes the weight gradients beside
  the reduce-scatter (Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication`` orders it
  the same way). One all-gather more per backward than the plain conjugate pair: ``(n - 1)/n`` of
  the gathered input's bytes. A split backward (zero bubble) sends it once too: ``B`` wants no
  weight gradient and gathers nothing; ``W`` gathers the positions (nothing to hide it under but the
  weight-gradient products that follow) and only the shard waits between them. With overlap off
  the same function waits each collective where it is issued (the forward's gather in one piece).
* Row parallel under sequence parallelism: the forward computes, piece by piece, the partial
  output rows every rank keeps a slice of and launches each piece's reduce-scatter before computing
  the next (the decomposed matmul -> reduce-scatter). Backward gathers ``dy`` in pieces the same
  way, computing ``dx`` and the weight gradient of this rank's positions first, then of each piece
  as it lands.

Piece ``p`` of ``k`` holds, of every rank's ``s_r`` positions, the ``s_r / k`` starting at
``p s_r / k``: one collective over the whole group per piece, so the bytes are exactly those of the
single collective it replaces (``(n - 1)/n`` of the gathered size, summed over the pieces). Work is
done in the sequence-major layout (``movedim(dim, 0)``), where a rank's positions are a contiguous
block of rows and a linear acts row by row.

The same code runs on NCCL (async collectives on the communication stream); the fused
symmetric-memory kernels of ``torch.distributed._symmetric_memory`` are CUDA-only and not used
(ARCHITECTURE.md, known gaps).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from runtime.distributed import comm

__all__ = [
    "set_overlap",
    "overlap_enabled",
    "pieces",
    "ColumnLinears",
    "LinearReduceScatter",
]

_ENABLED = [True]


def set_overlap(enabled: bool) -> None:
    """Switch the overlapped tensor-parallel functions on (the default) or off (each collective
    issued in line and waited at once: the plain conjugate functions of ``collectives``)."""
    _ENABLED[0] = bool(enabled)


def overlap_enabled() -> bool:
    """Whether tensor-parallel collectives overlap the matmuls around them (:func:`set_overlap`)."""
    return _ENABLED[0]


def pieces(rows: int, n: int) -> int:
    """How many pieces a rank's ``rows`` positions are sent in over ``n`` ranks: ``n`` when it
    divides them (the tp chunks), otherwise one (a single asynchronous collective)."""
    return n if rows >= n and rows % n == 0 else 1


def _launch_gathers(xm: torch.Tensor, n: int, group: Any) -> list[tuple[torch.Tensor, Any]]:
    """Launch the all-gather of each piece of this rank's rows ``xm`` (sequence-major); returns
    ``(buffer, handle)`` per piece, the buffer holding rank ``j``'s piece at rows ``j * sub``."""
    k = pieces(xm.shape[0], n)
    sub = xm.shape[0] // k
    launched = []
    for p in range(k):
        src = xm[p * sub : (p + 1) * sub].contiguous()
        buf = xm.new_empty((n * sub,) + tuple(xm.shape[1:]))
        launched.append((buf, comm.all_gather_into(buf, src, group=group, async_op=True)))
    return launched


def _remote_blocks(launched: list[tuple[torch.Tensor, Any]], rows: int, n: int, rank: int):
    """Wait for each piece in turn and yield ``(at, block)`` for every other rank's block of it:
    ``at`` its first row in the gathered (sequence-major) tensor of ``n * rows`` rows."""
    sub = rows // len(launched)
    for p, (buf, handle) in enumerate(launched):
        comm.wait(handle)
        for j in range(n):
            if j != rank:
                yield j * rows + p * sub, buf[j * sub : (j + 1) * sub]


def _wanted(ctx: Any, index: int) -> bool | None:
    """Whether this backward call must produce the gradient of input ``index``: it needs one and the
    engine runs its consumer in this call; None when the engine cannot tell (a leaf, such as a
    weight, inside ``torch.autograd.grad``), which callers treat as wanted. A split backward
    (``runtime.pipeline.backward_split``: ``B`` the input gradients by ``autograd.grad``, then ``W``
    restarting here for the weights) runs this node twice: ``W`` skips the input gradient and its
    collective, so nothing is communicated twice (``B`` may compute weight gradients it drops)."""
    if not ctx.needs_input_grad[index]:
        return False
    node = ctx.next_functions[ctx.edges[index]][0]
    if node is None:
        return False
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:  # "a leaf node was passed ... while running autograd.grad()"
        return None


def _edges(inputs: tuple) -> dict[int, int]:
    """Input index -> its slot in the node's ``next_functions`` (which lists the tensor inputs only)."""
    tensors = [i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor)]
    return {i: slot for slot, i in enumerate(tensors)}


def _weight_grad(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``dy^T x`` over every leading dim (the weight gradient of ``y = x W^T``)."""
    return dy.reshape(-1, dy.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))


def _gradient_buffer(ctx: Any, index: int, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``weight.grad``, taken from the weight, when the weight-gradient product may accumulate
    straight into it (:func:`_accumulated_weight_grad`): the engine will accumulate this call's
    gradient into ``.grad`` (a plain backward or a split backward's ``W``, not ``autograd.grad``),
    the buffer exists with the weight's layout and the product's dtype, no graph of the gradient
    is being built, and no hook of the weight's (``register_hook``, which would see the sum instead
    of this call's gradient) waits for it. None otherwise."""
    grad = weight.grad
    if (
        grad is None
        or torch.is_grad_enabled()
        or getattr(weight, "_backward_hooks", None)
        or grad.dtype != dtype
        or grad.shape != weight.shape
        or grad.stride() != weight.stride()
        or _wanted(ctx, index) is not True
    ):
        return None
    weight.grad = None
    return grad


def _accumulated_weight_grad(ctx: Any, index: int, weight: torch.Tensor, dy: torch.Tensor, x: torch.Tensor):
    """The weight gradient ``dy^T x`` of input ``index`` (Megatron-LM's gradient-accumulation
    fusion): with a gradient buffer already on the weight (the ZeRO engine's flat-buffer views, or
    a previous backward's), the product is added into it by the GEMM itself (``addmm_``, one pass)
    instead of written to a new tensor that autograd then adds (read both, write one: three passes
    of the gradient's bytes per micro-batch). The weight's ``.grad`` is cleared and the buffer
    returned as this call's gradient, so autograd's accumulation takes it as is (no copy: the
    post-accumulate hooks, the ZeRO engine's, fire as before and find their view); a weight whose
    gradient has other terms (tied weights) gets them added by autograd as usual. Without a buffer
    (the first backward, ZeRO 2/3 before its group's first gradient), the plain product."""
    buffer = _gradient_buffer(ctx, index, weight, dy.dtype)
    if buffer is None:
        return _weight_grad(dy, x)
    return buffer.addmm_(dy.reshape(-1, dy.shape[-1]).t(), x.reshape(-1, x.shape[-1]))


class ColumnLinears(torch.autograd.Function):
    """``y_i = x W_i^T + b_i`` for linears sharing one input that enters the tensor-parallel region:
    replicated (``dim`` None; the input gradient all-reduced) or this rank's positions along ``dim``
    (gathered beside the local product; the input gradient reduce-scattered). Under sequence
    parallelism only this rank's positions are saved: backward gathers them again beside the
    input-gradient product (module docstring). Overlap off (:func:`set_overlap`, read at the
    forward) waits every collective where it is issued."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int | None, group: Any, count: int, *params: Any):
        weights: tuple[torch.Tensor, ...] = params[:count]
        biases: tuple[torch.Tensor | None, ...] = params[count:]
        ctx.set_materialize_grads(False)
        ctx.dim, ctx.group, ctx.count, ctx.overlap = dim, group, count, overlap_enabled()
        ctx.edges = _edges((x, dim, group, count, *params))
        ctx.save_for_backward(x, *weights)  # this rank's positions only, under sequence parallelism
        if dim is None:
            return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))
        dim = ctx.dim = dim % x.dim()
        xm = x.movedim(dim, 0)
        if not ctx.overlap:
            full = _gather_rows(xm, group, async_op=False)[0]
            return tuple(F.linear(full, w, b).movedim(0, dim).contiguous() for w, b in zip(weights, biases))
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        rows = xm.shape[0]
        launched = _launch_gathers(xm, n, group)
        outs = [xm.new_empty((n * rows,) + tuple(xm.shape[1:-1]) + (w.shape[0],)) for w in weights]
        for out, w, b in zip(outs, weights, biases):  # this rank's positions while the pieces travel
            out[rank * rows : (rank + 1) * rows] = F.linear(xm, w, b)
        for at, block in _remote_blocks(launched, rows, n, rank):
            for out, w, b in zip(outs, weights, biases):
                out[at : at + block.shape[0]] = F.linear(block, w, b)
        return tuple(out.movedim(0, dim).contiguous() for out in outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        x, *weights = ctx.saved_tensors
        dim, group, count = ctx.dim, ctx.group, ctx.count
        if dim is not None:  # sequence-major, as the gathered input
            grads = tuple(None if g is None else g.movedim(dim, 0) for g in grads)
        used = [(i, g) for i, g in enumerate(grads) if g is not None]
        want_dx = _wanted(ctx, 0) is not False and bool(used)
        want_w = {i: _wanted(ctx, 4 + i) for i, _ in used}
        full, gathering = x, None
        if dim is not None and any(w is not False for w in want_w.values()):
            # the weight gradients need every rank's positions: gather them again
            full, gathering = _gather_rows(x.movedim(dim, 0), group, async_op=ctx.overlap)
        dx, reducing = _input_grad(ctx, used, weights) if want_dx else (None, None)
        comm.wait(gathering)  # launched before the input gradient, which needs no gathered input
        dws: list[torch.Tensor | None] = [None] * count
        dbs: list[torch.Tensor | None] = [None] * count
        for i, g in used:  # beside the input gradient's collective in flight
            if want_w[i] is not False:
                dws[i] = _accumulated_weight_grad(ctx, 4 + i, weights[i], g, full)
            if _wanted(ctx, 4 + count + i) is not False:
                dbs[i] = g.reshape(-1, g.shape[-1]).sum(0)
        comm.wait(reducing)
        if dx is not None and dim is not None:
            dx = dx.movedim(0, dim)
        return (dx, None, None, None, *dws, *dbs)


def _gather_rows(xm: torch.Tensor, group: Any, async_op: bool) -> tuple[torch.Tensor, Any]:
    """Every rank's rows ``xm`` (sequence-major) in rank order, as one all-gather: the buffer and
    the handle to wait (None when waited here, ``async_op`` False)."""
    n = dist.get_world_size(group)
    buf = xm.new_empty((n * xm.shape[0],) + tuple(xm.shape[1:]))
    handle = comm.all_gather_into(buf, xm.contiguous(), group=group, async_op=async_op)
    return buf, (handle if async_op else None)


def _input_grad(ctx: Any, used: list, weights: list) -> tuple[torch.Tensor, Any]:
    """``dx = sum_i dy_i W_i`` with its collective launched (all-reduce, or reduce-scatter of the
    positions under sequence parallelism; waited here when overlap is off): ``(dx, handle)``, ``dx``
    this rank's result once the handle is waited."""
    dx = used[0][1].matmul(weights[used[0][0]])
    for i, g in used[1:]:
        dx.add_(g.matmul(weights[i]))
    if ctx.dim is None:
        return dx, comm.all_reduce(dx, group=ctx.group, async_op=True)
    full = dx
    dx = full.new_empty((full.shape[0] // dist.get_world_size(ctx.group),) + tuple(full.shape[1:]))
    handle = comm.reduce_scatter_into(dx, full, group=ctx.group, async_op=ctx.overlap)
    return dx, (handle if ctx.overlap else None)


class LinearReduceScatter(torch.autograd.Function):
    """``y_r = chunk_r(sum_r' x_r' W_r'^T)`` along ``dim``: a row-parallel product reduce-scattered
    along the sequence, each piece's reduction launched before the next piece is computed."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        dim = dim % x.dim()
        n = dist.get_world_size(group)
        xm = x.movedim(dim, 0)
        if xm.shape[0] % n:
            raise ValueError(
                f"cannot reduce-scatter dim {dim} of size {xm.shape[0]} over {n} tensor-parallel "
                f"ranks: {xm.shape[0]} is not divisible by {n}"
            )
        rows = xm.shape[0] // n
        k = pieces(rows, n)
        sub = rows // k
        in_flight, kept = [], []
        for p in range(k):
            partial = xm.new_empty((n * sub,) + tuple(xm.shape[1:-1]) + (weight.shape[0],))
            for j in range(n):  # the rows of piece p that rank j keeps
                start = j * rows + p * sub
                torch.matmul(xm[start : start + sub], weight.t(), out=partial[j * sub : (j + 1) * sub])
            mine = partial.new_empty((sub,) + tuple(partial.shape[1:]))
            in_flight.append((partial, comm.reduce_scatter_into(mine, partial, group=group, async_op=True)))
            kept.append(mine)
        for _, handle in in_flight:
            comm.wait(handle)
        ctx.save_for_backward(x, weight)
        ctx.dim, ctx.group, ctx.edges = dim, group, {0: 0, 1: 1}
        return torch.cat(kept, 0).movedim(0, dim).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        dim, group = ctx.dim, ctx.group
        want_x, maybe_w = _wanted(ctx, 0) is not False, _wanted(ctx, 1)
        want_w = maybe_w is not False
        xm = x.movedim(dim, 0)
        if not want_x:  # a split backward's ``W`` after its ``B``, which kept the gathered gradient
            gathered = getattr(ctx, "gathered", None)
            ctx.gathered = None
            if gathered is not None or not want_w:
                dw = _accumulated_weight_grad(ctx, 1, weight, gathered, xm) if gathered is not None and want_w else None
                return None, dw, None, None
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        gm = grad.movedim(dim, 0)
        rows = gm.shape[0]
        launched = _launch_gathers(gm, n, group)
        dxm = xm.new_empty(xm.shape) if want_x else None
        # the weight gradient sums the pieces in fp32; an fp32 weight's straight into its buffer
        acc = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
        buffer = _gradient_buffer(ctx, 1, weight, acc) if want_w and acc == weight.dtype else None
        if buffer is None and want_w:
            buffer = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        dw = buffer
        later = ctx.needs_input_grad[1] and maybe_w is not True  # a split backward's ``B``: keep dy for ``W``
        gathered = gm.new_empty((n * rows,) + tuple(gm.shape[1:])) if later else None
        # this rank's positions while the pieces travel, then every other rank's as each piece lands
        for at, block in _blocks_local_first((rank * rows, gm), launched, rows, n, rank):
            if dxm is not None:
                dxm[at : at + block.shape[0]] = block.matmul(weight)
            if dw is not None and block.dtype == acc:  # the piece's product added by the GEMM
                dw.addmm_(
                    block.reshape(-1, block.shape[-1]).t(), xm[at : at + block.shape[0]].reshape(-1, xm.shape[-1])
                )
            elif dw is not None:
                dw += _weight_grad(block, xm[at : at + block.shape[0]]).to(acc)
            if gathered is not None:
                gathered[at : at + block.shape[0]] = block
        ctx.gathered = gathered
        dx = dxm.movedim(0, dim) if dxm is not None else None
        return dx, (dw.to(weight.dtype) if dw is not None else None), None, None


def _blocks_local_first(local, launched, rows: int, n: int, rank: int):
    """This rank's own block first, then every other rank's blocks piece by piece as they land."""
    yield local
    yield from _remote_blocks(launched, rows, n, rank)
