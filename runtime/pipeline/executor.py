"""The pipeline executor: one rank walks its list of :class:`~runtime.contract.schedule_ir.Action` s.

Stage module interface (``x`` = tensors received from the previous stage, ``e`` = this stage's
own inputs for the micro-batch, the ``microbatches[i]`` tuple)::

    first stage   forward(*e)        -> tensor or tuple of tensors   (data inputs)
    middle stage  forward(*x, *e)    -> tensor or tuple of tensors   (e usually empty)
    last stage    forward(*x, *e)    -> scalar loss                  (e = labels, ...)

A single stage (``num_stages == 1``) is both: ``forward(*e) -> loss``. What crosses a boundary is
a tuple of tensors described by the receiver's ``recv_meta`` (shape, dtype, requires_grad).
Integer tensors (masks, positions) travel forward only; float tensors marked ``requires_grad``
get their gradient sent back.

Actions: ``F`` forward, ``B`` backward (input gradients only when the list has ``W`` actions),
``W`` weight gradients. Semantics (the ones :func:`runtime.contract.schedule_ir.simulate` models):
``SEND_*`` posts ``isend`` and moves on; ``RECV_*`` posts ``irecv`` for every tensor of the
message and waits. Outstanding sends are waited for after the last action. All traffic goes
through :mod:`runtime.distributed.comm` and is counted (a send counts its bytes, a receive nothing); the time
blocked waiting for a neighbour is the ``pp_bubble`` part of the step's measured breakdown
(:mod:`runtime.timing`), as the pipeline group is registered for it.

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

Model chunks. With ``virtual_stages = v > 1`` (interleaved schedules) a rank holds ``v`` chunk
modules, its local chunks ``0 .. v - 1`` = model chunks ``s, s + p, ...``, each with its own
``recv_meta``; ``microbatches[i]`` is then a sequence of ``v`` input tuples, one per local chunk.
Every action names its chunk, so the rank keeps its state per (chunk, micro-batch). Chunk ``c``
sends to rank ``(c + 1) % p``: ``prev_rank`` and ``next_rank`` are then needed on every rank. The
pre-flight table has a row per model chunk.

Split backward (schedules with ``W`` actions, :func:`runtime.contract.schedule_ir.zero_bubble_h1`). ``B``
computes only the gradients of the chunk's received inputs, ``W`` the weight gradients, without
running any part of backward twice (the approach of torch.distributed.pipelining's
``stage_backward_input`` / ``stage_backward_weight``): the autograd graph splits into the nodes on
a path from the outputs to an input (``B`` runs them) and the rest, which lead only to weights.
A node of the first set with an edge into the second (e.g. a linear layer's ``AddmmBackward``,
whose ``mat1`` gradient is ``B``'s work and ``mat2`` gradient ``W``'s) is a *frontier* node: ``B``
records the gradient flowing into it (a node pre-hook) and keeps the graph (``retain_graph``);
``W`` restarts autograd at the frontier edges with those gradients, restricted to the weights
(``inputs=``), so each frontier node computes only its weight-side outputs. Restarting at two
frontier nodes of which one reaches the other through ``B``'s nodes would count the lower one
twice, so ``W`` makes one call per group of weights that share frontier nodes (a linear layer's
weight and bias, a LayerNorm's); a weight used twice along one path (its group's frontier nodes
nested) gets its gradient computed in ``B`` and only accumulated at ``W``. ``W``'s calls are
ordinary ``torch.autograd.backward`` s: gradients *accumulate* into ``.grad`` and
post-accumulate hooks (the ZeRO engine's) fire at ``W``. With a ``backward_scope`` (the ZeRO
engine, :class:`BackwardScope`) each ``B`` and each ``W`` runs inside one of its backward passes,
so that one ``W``'s per-group calls are one pass that reduces each gradient once (as 1F1B's
backward does), and before each ``W`` call the scope's ``prepare_weights`` gathers ZeRO-3's
released weights. A chunk without inputs that need
gradients (the first) has nothing for ``B``: its whole backward runs at ``W``. Memory: ``B``
keeps the chunk's graph, so a micro-batch holds its activations until its ``W``, all but
what only the chunk's outputs reach (a loss's log-probabilities): ``B`` drops the outputs, and
no local of the executor may outlive its action (``_forward``). Non-reentrant
activation checkpointing works: each backward call is its own graph task, so a checkpointed
region is recomputed in ``B`` and again in ``W`` (one more forward of those layers than a full
backward needs).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.distributed as dist
from torch.autograd.graph import GradientEdge, get_gradient_edge

from runtime.contract.schedule_ir import (
    RECV_ACT,
    RECV_GRAD,
    SEND_ACT,
    SEND_GRAD,
    Action,
    B,
    F,
    ScheduleError,
    W,
    validate_rank,
)
from runtime.distributed import comm
from runtime.distributed.mesh import get_mesh

__all__ = [
    "TensorMeta",
    "PipelineError",
    "PipelineStage",
    "run_pipeline",
    "META_ROW",
    "WeightWork",
    "backward_input",
    "backward_weight",
    "BackwardScope",
]

_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
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
        return f"{tuple(self.shape)} {str(self.dtype).replace('torch.', '')}" + (
            " (grad)" if self.requires_grad else ""
        )


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


# ---------------------------------------------------------------------- split backward (B / W)


@dataclass
class WeightWork:
    """What ``B`` leaves for ``W``: one autograd call per group of weights."""

    calls: list[tuple[list[GradientEdge], list[torch.Tensor | None], list[torch.Tensor]]]
    """Per group: root edges (frontier nodes, outputs that reach no input, or a weight's own
    ``AccumulateGrad`` for a gradient ``B`` had to compute), their gradients, the weights."""


def _node(t: torch.Tensor):
    """A tensor's autograd node: its ``grad_fn``, or a leaf's ``AccumulateGrad``."""
    return t.grad_fn if t.grad_fn is not None else get_gradient_edge(t).node


def _graph(roots: list, targets: set) -> tuple[dict, dict]:
    """Every node reachable from ``roots``: does it reach a node of ``targets`` (the inputs)?
    And each node's parents (reverse edges). Iterative post-order: graphs are thousands deep."""
    reach: dict = {}
    parents: dict = {n: [] for n in roots}
    stack = [(n, False) for n in roots]
    while stack:
        n, expanded = stack.pop()
        nxt = [f for f, _ in n.next_functions if f is not None]
        if expanded:
            reach[n] = n in targets or any(reach[f] for f in nxt)
            continue
        if n in reach:
            continue
        reach[n] = False  # visiting (a DAG: every child completes before this node's expansion)
        stack.append((n, True))
        for f in nxt:
            parents.setdefault(f, []).append(n)
            if f not in reach:
                stack.append((f, False))
    return reach, parents


def _weight_groups(reach: dict, parents: dict, in_nodes: set, w_roots: set) -> list[tuple[set, list]]:
    """Weights (leaves other than the inputs) grouped by the nodes where ``W`` must start: a
    weight's *entries* are the first nodes that reach an input (frontier nodes) or outputs that
    reach none, met walking up from it; weights that share an entry share a group."""
    groups: list[tuple[set, list]] = []
    for leaf in [n for n in reach if not n.next_functions and hasattr(n, "variable") and n not in in_nodes]:
        entries, seen, todo = set(), {leaf}, [leaf]
        while todo:
            n = todo.pop()
            if n in w_roots:
                entries.add(n)
            for par in parents.get(n, ()):
                if reach[par]:
                    entries.add(par)
                elif par not in seen:
                    seen.add(par)
                    todo.append(par)
        merged = [g for g in groups if g[0] & entries]
        for g in merged:
            groups.remove(g)
            entries |= g[0]
        groups.append((entries, [leaf] + [w for g in merged for w in g[1]]))
    return groups


def _nested(entries: set, reach: dict) -> bool:
    """Does an entry reach another one through nodes that reach an input? Restarting ``W`` at
    both would then count the lower one's gradient twice."""
    for e in entries:
        todo, seen = [f for f, _ in e.next_functions if f is not None and reach.get(f)], set()
        while todo:
            n = todo.pop()
            if n in entries:
                return True
            if n not in seen:
                seen.add(n)
                todo += [f for f, _ in n.next_functions if f is not None and reach.get(f)]
    return False


def backward_input(
    outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None], inputs: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], WeightWork]:
    """``B``: the gradients of ``inputs`` only; returns them and the work left for ``W``.

    ``outputs`` / ``grads`` are what ``torch.autograd.backward`` would take. The graph is kept
    for :func:`backward_weight`; see the module docstring for the frontier split. A group of
    weights whose entries are nested (a weight used in two places along one path) cannot be
    restarted without double counting: ``B`` computes its gradient and ``W`` accumulates it.
    """
    roots = [_node(o) for o in outputs]
    in_nodes = {_node(x) for x in inputs}
    reach, parents = _graph(roots, in_nodes)
    root_edge = {n: (get_gradient_edge(o), g) for o, g, n in zip(outputs, grads, roots) if not reach[n]}
    groups = _weight_groups(reach, parents, in_nodes, set(root_edge))
    eager = [g for g in groups if _nested(g[0], reach)]
    frontier = {e for g in groups if g not in eager for e in g[0] if e not in root_edge}
    captured: dict = {}

    def keep(node):
        def hook(grad_outputs):
            captured[node] = grad_outputs

        return hook

    b_pairs = [(o, g) for o, g, n in zip(outputs, grads, roots) if reach[n]]
    eager_w = [n.variable for g in eager for n in g[1]]
    dx: list = [None] * len(inputs)
    dw: Sequence = ()
    if b_pairs:
        handles = [n.register_prehook(keep(n)) for n in frontier]
        try:
            got = torch.autograd.grad(
                [o for o, _ in b_pairs],
                list(inputs) + eager_w,
                [g for _, g in b_pairs],
                retain_graph=True,
                allow_unused=True,
            )
        finally:
            for h in handles:
                h.remove()
        dx, dw = list(got[: len(inputs)]), got[len(inputs) :]
    calls = []
    for entries, leaves in groups:
        if (entries, leaves) in eager:
            pairs = [(GradientEdge(n, 0), d) for n, d in zip(leaves, dw[: len(leaves)]) if d is not None]
            dw = dw[len(leaves) :]
        else:
            pairs = [root_edge[e] for e in entries if e in root_edge]
            pairs += [
                (GradientEdge(e, k), g)
                for e in entries
                if e in captured
                for k, g in enumerate(captured[e])
                if g is not None
            ]
        if pairs:
            calls.append(([e for e, _ in pairs], [g for _, g in pairs], [n.variable for n in leaves]))
    dx = [d if d is not None else torch.zeros_like(x) for d, x in zip(dx, inputs)]
    return dx, WeightWork(calls)


def backward_weight(work: WeightWork, prepare: Callable[[list[torch.Tensor]], None] | None = None) -> None:
    """``W``: accumulate the weight gradients ``B`` left (ordinary backward calls, hooks fire).
    ``prepare(weights)`` runs before each call (a ZeRO-3 engine gathers those weights there)."""
    for roots, grads, weights in work.calls:
        if prepare is not None:
            prepare(weights)
        if any(w.numel() and not w.untyped_storage().nbytes() for w in weights):
            raise PipelineError(
                "a W action found a weight whose storage is released (ZeRO-3 keeps a layer's "
                "parameters only inside its forward and one backward pass, and B and W are separate "
                "passes): give the PipelineStage the ZeRO engine as its backward_scope, which gathers "
                "them before each W call"
            )
        torch.autograd.backward(roots, grads, inputs=weights)


class BackwardScope(Protocol):
    """What a pipeline stage tells about its backward work (``runtime.data_parallel.zero_engine.ZeroEngine`` is one)."""

    def backward_pass(self, accumulates: bool = True) -> contextlib.AbstractContextManager:
        """A context in which every autograd call is one backward pass of the caller's;
        ``accumulates=False`` for a ``B`` that leaves the weight gradients to ``W``."""

    def prepare_weights(self, weights: list[torch.Tensor]) -> None:
        """Called before each of ``W``'s autograd calls with the weights it computes."""


class PipelineStage:
    """One rank's stage: its module(s), place in the pipeline and what each chunk receives.

    ``prev_rank`` / ``next_rank`` are *global* ranks (``get_mesh().pp_ranks[s -/+ 1]``, modulo
    ``p`` with model chunks); ``pp_group`` is the pipeline process group (``None`` means the
    default group, allowed only when the whole world is this one pipeline). With
    ``virtual_stages = v > 1``, ``module`` is the sequence of the rank's ``v`` chunk modules in
    model order and ``recv_meta`` the sequence of their ``v`` receive metadata (``()`` for model
    chunk 0); ``self.module`` is then an ``nn.ModuleList`` of them. ``backward_scope`` (e.g. the
    ZeRO engine over these modules, :class:`BackwardScope`) wraps each ``B`` and each ``W``: a
    ``W`` and its per-group autograd calls are one backward pass of the engine, a split ``B`` one
    that accumulates nothing.
    """

    def __init__(
        self,
        module: torch.nn.Module | Sequence[torch.nn.Module],
        stage_index: int,
        num_stages: int,
        *,
        recv_meta: Sequence[Any] = (),
        prev_rank: int | None = None,
        next_rank: int | None = None,
        pp_group: Any = None,
        last_rank: int | None = None,
        device: torch.device | str | None = None,
        virtual_stages: int = 1,
        backward_scope: BackwardScope | None = None,
    ):
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index {stage_index} is outside 0..{num_stages - 1}")
        p, s, v = num_stages, stage_index, virtual_stages
        if v < 1:
            raise ValueError(f"virtual_stages must be >= 1, got {v}")
        if v > 1 and p < 2:
            raise ValueError(f"{v} model chunks need at least 2 pipeline ranks; use virtual_stages=1")
        if v == 1:
            self.modules = [module]
            metas = [recv_meta]
        else:
            if isinstance(module, torch.nn.Module) or len(module) != v:
                raise ValueError(f"virtual_stages={v}: pass a sequence of {v} chunk modules (model order)")
            if len(recv_meta) != v:
                raise ValueError(f"virtual_stages={v}: pass a sequence of {v} recv_meta, one per chunk")
            self.modules = list(module)
            metas = list(recv_meta)
            module = torch.nn.ModuleList(self.modules)
        self.module = module
        self.stage_index, self.num_stages, self.virtual_stages = s, p, v
        self.recv_metas = [tuple(_as_meta(m) for m in ms) for ms in metas]
        self.recv_meta = self.recv_metas[0]
        noun = "stage" if v == 1 else "model chunk"
        for j, ms in enumerate(self.recv_metas):
            c = j * p + s
            if c == 0 and ms:
                raise ValueError(f"the first {noun} receives nothing; pass recv_meta=()")
            if c > 0 and not ms:
                raise ValueError(f"{noun} {c} receives from {noun} {c - 1}: give its recv_meta")
        if num_stages > 1:
            if (s > 0 or v > 1) and prev_rank is None:
                raise ValueError(f"stage {s} needs prev_rank (global rank of stage {(s - 1) % p})")
            if (s < p - 1 or v > 1) and next_rank is None:
                raise ValueError(f"stage {s} needs next_rank (global rank of stage {(s + 1) % p})")
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
            prm = next(iter(module.parameters()), None)
            device = prm.device if prm is not None else torch.device("cpu")
        self.device = torch.device(device)
        self.backward_scope = backward_scope
        self.send_metas: list[tuple[TensorMeta, ...] | None] = [None] * v
        """Each chunk's successor's ``recv_meta``, learned in the pre-flight exchange."""
        self._pending: list = []

    @classmethod
    def from_mesh(cls, module, recv_meta: Sequence[Any] = (), mesh: Any = None, **kw) -> "PipelineStage":
        """Build from :func:`runtime.distributed.mesh.get_mesh` (stage = this rank's pp index)."""
        if mesh is None:
            mesh = get_mesh()
        s, p, ranks = mesh.pp_index, mesh.pp, mesh.pp_ranks
        wrap = kw.get("virtual_stages", 1) > 1
        return cls(
            module,
            s,
            p,
            recv_meta=recv_meta,
            prev_rank=ranks[(s - 1) % p] if s > 0 or wrap else None,
            next_rank=ranks[(s + 1) % p] if s < p - 1 or wrap else None,
            pp_group=mesh.pp_group,
            last_rank=ranks[-1],
            **kw,
        )

    @property
    def send_meta(self) -> tuple[TensorMeta, ...] | None:
        """The successor's ``recv_meta`` of local chunk 0 (the only chunk when ``v = 1``)."""
        return self.send_metas[0]

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def _chunk(self, j: int) -> int:
        return j * self.num_stages + self.stage_index

    def _first(self, j: int) -> bool:
        return self._chunk(j) == 0

    def _last(self, j: int) -> bool:
        return self._chunk(j) == self.num_stages * self.virtual_stages - 1

    def _name(self, j: int) -> str:
        return f"stage {self.stage_index}" if self.virtual_stages == 1 else f"model chunk {self._chunk(j)}"

    # ------------------------------------------------------------------ pre-flight

    def _split_inputs(self, microbatches: Sequence[Any]) -> list[list[tuple]]:
        """``extras[i][j]``: local chunk ``j``'s own inputs for micro-batch ``i``."""
        v = self.virtual_stages
        if v == 1:
            return [[_tupled(mb)] for mb in microbatches]
        out = []
        for i, mb in enumerate(microbatches):
            if not isinstance(mb, (tuple, list)) or len(mb) != v or not all(isinstance(e, (tuple, list)) for e in mb):
                raise PipelineError(
                    f"micro-batch {i}: with {v} model chunks per rank give one tuple of inputs per chunk "
                    f"({v} tuples, () for a chunk without inputs), got {_describe(mb)}"
                )
            out.append([tuple(e) for e in mb])
        return out

    def _local_check(self, actions: Sequence[Action], extras: list[list[tuple]]) -> tuple[int, int, int, str]:
        """This rank's own checks: ``(code, bad micro-batch, bad input, message)``."""
        m, p, s = len(extras), self.num_stages, self.stage_index
        if m == 0:
            return _NO_MB, -1, -1, "no micro-batches were given"
        if m < p:
            return (
                _FEW_MB,
                -1,
                -1,
                (
                    f"{m} micro-batch{'es' if m != 1 else ''} for {p} pipeline stages: a pipeline needs at least as many "
                    f"micro-batches as stages (use a smaller micro-batch size or fewer stages)"
                ),
            )
        flat = [tuple(t for chunk in e for t in chunk) for e in extras]
        ref = flat[0]
        for i, e in enumerate(flat[1:], start=1):
            if len(e) != len(ref) or [len(c) for c in extras[i]] != [len(c) for c in extras[0]]:
                return _SHAPES, i, -1, (f"micro-batch {i} has {len(e)} inputs but micro-batch 0 has {len(ref)}")
            for j, (a, b) in enumerate(zip(e, ref)):
                same = (
                    a.shape == b.shape and a.dtype == b.dtype
                    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                    else type(a) is type(b)
                )
                if not same:
                    return (
                        _SHAPES,
                        i,
                        j,
                        (
                            f"input {j} of micro-batch {i} is {_describe(a)} but micro-batch 0's is "
                            f"{_describe(b)}: every micro-batch must have the same shapes and dtypes "
                            f"(pad, or drop the last partial batch)"
                        ),
                    )
        if any(len(ms) > MAX_TENSORS or any(len(t.shape) > MAX_DIMS for t in ms) for ms in self.recv_metas):
            return _META, -1, -1, f"recv_meta has more than {MAX_TENSORS} tensors or {MAX_DIMS} dims"
        try:
            validate_rank(actions, s, p, m, self.virtual_stages)
        except ScheduleError as e:
            return _SCHEDULE, -1, -1, f"invalid action list: {e}"
        return _OK, -1, -1, ""

    def _encode(self, code: int, m: int, bad_mb: int, bad_in: int, metas: tuple[TensorMeta, ...]) -> list[int]:
        row = [code, m, bad_mb, bad_in, len(metas)] + [0] * (MAX_TENSORS * _SLOT)
        if code != _META:
            for k, t in enumerate(metas):
                o = _HEAD + k * _SLOT
                row[o : o + 3] = [_DTYPES.index(t.dtype), int(t.requires_grad), len(t.shape)]
                row[o + 3 : o + 3 + len(t.shape)] = list(t.shape)
        return row

    @staticmethod
    def _decode_meta(row: list[int]) -> tuple[TensorMeta, ...]:
        out = []
        for k in range(row[4]):
            o = _HEAD + k * _SLOT
            dt, rg, nd = row[o : o + 3]
            out.append(TensorMeta(tuple(row[o + 3 : o + 3 + nd]), _DTYPES[dt], bool(rg)))
        return tuple(out)

    def _preflight(self, actions: Sequence[Action], extras: list[list[tuple]]) -> None:
        """One all-reduce of a table with a row per model chunk; row ``c < p`` (local chunk 0)
        carries its rank's error code, every row its chunk's ``recv_meta``."""
        code, bad_mb, bad_in, msg = self._local_check(actions, extras)
        s, p, v, m = self.stage_index, self.num_stages, self.virtual_stages, len(extras)
        if p == 1:
            if code != _OK:
                raise PipelineError(f"pipeline stage 0: {msg}")
            return
        table = torch.zeros(p * v, META_ROW, dtype=torch.int64, device=self.device)
        for j in range(v):
            row = self._encode(code if j == 0 else _OK, m, bad_mb, bad_in, self.recv_metas[j])
            table[self._chunk(j)] = torch.tensor(row, dtype=torch.int64)
        comm.all_reduce(table, group=self.pp_group)
        rows = table.cpu().tolist()
        problems = []
        for t, row in enumerate(rows[:p]):
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
                problems.append(
                    f"stage {t}: "
                    + {
                        _SCHEDULE: "its action list is invalid",
                        _META: "its recv_meta is too large to exchange",
                        _NO_MB: "no micro-batches were given",
                    }[row[0]]
                )
        counts = {row[1] for row in rows[:p] if row[0] not in (_NO_MB,)}
        if not problems and len(counts) > 1:
            problems.append(
                "stages disagree on the number of micro-batches: "
                + ", ".join(f"stage {t} has {row[1]}" for t, row in enumerate(rows[:p]))
            )
        if problems:
            raise PipelineError("pipeline refused to start (nothing was sent):\n  " + "\n  ".join(problems))
        for j in range(v):
            if not self._last(j):
                self.send_metas[j] = self._decode_meta(rows[self._chunk(j) + 1])

    # ------------------------------------------------------------------ execution

    def _check_outputs(self, outs: tuple, i: int, j: int = 0) -> None:
        want = self.send_metas[j]
        assert want is not None
        me = self._name(j)
        nxt = f"stage {self.stage_index + 1}" if self.virtual_stages == 1 else f"model chunk {self._chunk(j) + 1}"
        if len(outs) != len(want):
            raise PipelineError(
                f"{me} returned {len(outs)} tensors for micro-batch {i} but {nxt} expects {len(want)} "
                f"({', '.join(map(str, want))}); fix its recv_meta or the split"
            )
        for k, (o, w) in enumerate(zip(outs, want)):
            if not isinstance(o, torch.Tensor):
                raise PipelineError(f"{me} output {k} is a {type(o).__name__}, not a tensor")
            if tuple(o.shape) != w.shape or o.dtype != w.dtype:
                raise PipelineError(
                    f"{me} output {k} for micro-batch {i} is {_describe(o)} but {nxt}'s recv_meta expects {w}; "
                    f"fix the recv_meta or the stage split"
                )
            has_grad = bool(o.requires_grad)
            if w.requires_grad and not has_grad:
                raise PipelineError(
                    f"{me} output {k} does not require grad but {nxt} will send a gradient for it "
                    f"(recv_meta requires_grad=True); set requires_grad=False there"
                )
            if has_grad and not w.requires_grad:
                raise PipelineError(
                    f"{me} output {k} requires grad but {nxt}'s recv_meta has requires_grad=False, so its "
                    f"gradient would be lost; mark it requires_grad=True"
                )

    def _post_recv(self, a: Action) -> tuple[list[torch.Tensor], list]:
        """Post the receive of ``RECV_ACT`` / ``RECV_GRAD`` action ``a``: its buffers and works."""
        if a.kind == RECV_ACT:
            metas, src = self.recv_metas[a.chunk], self.prev_rank
        else:
            metas, src = [t for t in self.send_metas[a.chunk] if t.requires_grad], self.next_rank
        bufs = [torch.empty(t.shape, dtype=t.dtype, device=self.device) for t in metas]
        return bufs, [comm.irecv(b, src, group=self.pp_group) for b in bufs]

    @staticmethod
    def _wait_recv(posted: tuple[list[torch.Tensor], list]) -> list[torch.Tensor]:
        bufs, works = posted
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
        stage: the data inputs; last stage: the labels; middle stages: usually ``()``); with
        ``v > 1`` model chunks, a sequence of ``v`` such tuples, one per local chunk. A non-tuple
        is treated as a 1-tuple. Parameter gradients are *accumulated* into ``.grad`` as
        ``loss_scale * d(mean loss)/dθ``. If the list has ``W`` actions, ``B`` computes input
        gradients and ``W`` weight gradients (module docstring).
        """
        extras = self._split_inputs(microbatches)
        m = len(extras)
        self._preflight(actions, extras)
        split = any(a.kind == W for a in actions)
        inputs: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        outputs: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        out_grads: dict[tuple[int, int], list[torch.Tensor]] = {}
        in_grads: dict[tuple[int, int], list[torch.Tensor]] = {}
        weight_work: dict[tuple[int, int], WeightWork] = {}
        losses: dict[int, torch.Tensor] = {}
        self._pending = []
        # Each receive is posted one compute action early: the message arrives while this rank
        # computes instead of after it (a peer's send of a large tensor completes only once the
        # receive is posted). Receives are still posted in list order, so each pair's messages
        # match as without it.
        recvs = [k for k, a in enumerate(actions) if a.kind in (RECV_ACT, RECV_GRAD)]
        posted: dict[int, tuple[list[torch.Tensor], list]] = {}
        ahead = 0  # recvs[ahead] is the first receive not yet reached
        for k, a in enumerate(actions):
            j, i = a.chunk, a.microbatch
            key = (j, i)
            while ahead < len(recvs) and recvs[ahead] <= k:
                ahead += 1
            if a.kind in (F, B, W) and ahead < len(recvs) and recvs[ahead] not in posted:
                posted[recvs[ahead]] = self._post_recv(actions[recvs[ahead]])
            if a.kind in (RECV_ACT, RECV_GRAD):
                bufs = self._wait_recv(posted.pop(k, None) or self._post_recv(a))
                if a.kind == RECV_ACT:
                    inputs[key] = tuple(
                        b.requires_grad_(True) if t.requires_grad else b for b, t in zip(bufs, self.recv_metas[j])
                    )
                else:
                    out_grads[key] = bufs
            elif a.kind == F:
                self._forward(key, inputs.get(key, ()), extras[i][j], outputs, losses, loss_scale / m)
            elif a.kind == SEND_ACT:
                self._isend(outputs[key], self.next_rank)
            elif a.kind == B:
                with self._scope(accumulates=not split):
                    self._backward(key, split, inputs, outputs, out_grads, in_grads, weight_work)
            elif a.kind == W:
                with self._scope(accumulates=True):
                    backward_weight(weight_work.pop(key), self._prepare)
            elif a.kind == SEND_GRAD:
                self._isend(in_grads.pop(key), self.prev_rank)
        for w, _ in self._pending:
            comm.wait(w)
        self._pending = []
        return self._mean_loss(losses, m)

    def _forward(self, key, received: tuple, extra: tuple, outputs: dict, losses: dict, scale: float) -> None:
        """``F`` of one (chunk, micro-batch): its outputs go to ``outputs`` (the last chunk's loss,
        scaled, with its value in ``losses``). A method so that no local outlives the action: under
        a split backward the loss's graph above the weight products (the log-probabilities) is
        freed when ``B`` drops the outputs, and a loop variable would keep it until the next ``F``."""
        j, i = key
        out = self.modules[j](*received, *extra)
        if self._last(j):
            if not isinstance(out, torch.Tensor) or out.numel() != 1:
                raise PipelineError(
                    f"the last stage must return a scalar loss, got "
                    f"{_describe(out) if isinstance(out, torch.Tensor) else type(out).__name__}"
                )
            losses[i] = out.detach().reshape(())
            outputs[key] = (out.reshape(()) * scale,)
        else:
            outs = _tupled(out)
            self._check_outputs(outs, i, j)
            outputs[key] = outs

    def _scope(self, accumulates: bool) -> contextlib.AbstractContextManager:
        bs = self.backward_scope
        return bs.backward_pass(accumulates=accumulates) if bs is not None else contextlib.nullcontext()

    @property
    def _prepare(self) -> Callable[[list[torch.Tensor]], None] | None:
        return self.backward_scope.prepare_weights if self.backward_scope is not None else None

    def _backward(self, key, split: bool, inputs, outputs, out_grads, in_grads, weight_work) -> None:
        """``B`` of one (chunk, micro-batch): the full backward, or with ``split`` the input
        gradients only (the rest is left in ``weight_work`` for ``W``)."""
        j = key[0]
        if self._last(j):
            outs, grads = list(outputs.pop(key)), [None]
        else:
            outs = [o for o, t in zip(outputs.pop(key), self.send_metas[j]) if t.requires_grad]
            grads = out_grads.pop(key, [])
        recvd = inputs.pop(key, ())
        wanted = [x for x, t in zip(recvd, self.recv_metas[j]) if t.requires_grad]
        if split:
            dx, weight_work[key] = backward_input(outs, grads, wanted)
            if not self._first(j):
                in_grads[key] = dx
            return
        if outs:
            torch.autograd.backward(outs, grads)
        if not self._first(j):
            in_grads[key] = [x.grad if x.grad is not None else torch.zeros_like(x) for x in wanted]

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
    virtual_stages: int = 1,
    backward_scope: BackwardScope | None = None,
) -> float:
    """Run one step of the pipeline on this rank; see :meth:`PipelineStage.run`.

    Returns the mean loss over micro-batches on every stage (broadcast from the last stage).
    """
    stage = PipelineStage(
        stage_module,
        stage_index,
        num_stages,
        recv_meta=recv_meta,
        prev_rank=prev_rank,
        next_rank=next_rank,
        pp_group=pp_group,
        last_rank=last_rank,
        device=device,
        virtual_stages=virtual_stages,
        backward_scope=backward_scope,
    )
    return stage.run(actions, microbatches, loss_scale=loss_scale)
