"""The cost pass of tensor parallelism: which work, weights and activations divide by tp.

Which matmuls are column or row parallel, which weights and activations are sharded and where
the sharded regions end is decided by ``passes.tensor_parallel.tp_analysis`` (its docstring has the states and
rules), the same analysis code generation rewrites the graph from. This pass prices those
decisions per node:

- **column-parallel** matmul: FLOPs and the output divide by tp; backward all-reduces the
  gradient of its input (once per input tensor: q/k/v reading the same normed activation share
  one all-reduce).
- **row-parallel** matmul: FLOPs divide; the partial outputs are all-reduced (forward all-reduce
  of the output's bytes); its bias is replicated.
- **vocab-parallel embedding**: its table is split by rows and the output is all-reduced.
- **vocab-parallel loss** (cross-entropy over vocab-sharded logits): each rank works on its slice
  and all-reduces per-row maxima, sum-exps and target logits (3 fp32 numbers per row); the
  runtime's loss moves different bytes than the traced one (``vocab_loss_bytes``).
- every other node on a sharded value: FLOPs and saved tensors divide.
- each matrix product a dividing node runs (``meta['fwd_gemms']`` / ``['bwd_gemms']``) gets the
  dim tp divides (``TPInfo.fwd_gemm_dims`` / ``bwd_gemm_dims``, from
  ``passes.tensor_parallel.tp_analysis.gemm_tp_dim``): the out features of a column-parallel product, the in
  features of a row-parallel one, the batch (b x heads) of attention's.

When the analysis cannot split the model at all (a conflict no replicated matmul avoids, or
every matmul kept replicated), every node is priced replicated and the node that stopped it
carries the reason (``TPInfo.blocked``, read by ``tp_blocked``): the search then plans without
tensor parallelism instead of failing.

Writes ``node.meta["tp"]`` (a ``TPInfo``) on every node. Needs ``out_bytes``/``shape``
(annotate_shapes), ``saved`` and ``fwd_gemms``/``bwd_gemms`` (annotate_costs) and ``layer``
(assign_layers: a sharded value never crosses a layer boundary).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch import fx

from passes.common import arg_node, need, source_line
from passes.tensor_parallel.tp_analysis import (
    Shard,
    TPConflict,
    TPDecisions,
    analyze_tensor_parallel,
    gemm_tp_dim,
    matmul_operands,
)

__all__ = ["TPInfo", "propagate_tensor_parallel", "tp_blocked", "tp_replicated", "tp_sizes", "vocab_loss_bytes"]

_PASS = "propagate_tensor_parallel"
_ZERO = sympy.Integer(0)


@dataclass
class TPInfo:
    """What tensor parallelism does to one node."""

    role: str
    """col | row | vocab_embedding | vocab_loss | partial (a reduction all-reduced) | sharded |
    replicated (placeholders: sharded or replicated weights, replicated data)."""
    shard_dim: Any = None
    """Output state: None (replicated) or the sharded dim; a list for multi-output nodes."""
    divides: bool = False
    """The node's forward and backward FLOPs divide by tp."""
    saved_bytes_tp: sympy.Expr = _ZERO
    """The part of ``meta['saved_bytes']`` held in tp shards."""
    allreduce_fwd: sympy.Expr = _ZERO
    """Bytes all-reduced over the tp group in the forward pass."""
    allreduce_bwd: sympy.Expr = _ZERO
    """Bytes all-reduced over the tp group in the backward pass."""
    allreduce_fwd_calls: int | None = None
    """All-reduce calls those forward bytes take (``None``: one if there are any)."""
    loss_fwd_bytes: sympy.Expr = _ZERO
    """For the vocab-parallel loss: memory-bound bytes the runtime's loss moves in its forward
    *minus* what the traced loss moves (full size; per device divide by tp). Charged only when
    tp > 1, where the runtime replaces the traced op (``runtime.tensor_parallel``)."""
    loss_bwd_bytes: sympy.Expr = _ZERO
    """The same for the backward."""

    @property
    def fwd_calls(self) -> int:
        """All-reduce calls of the forward pass."""
        if self.allreduce_fwd_calls is not None:
            return self.allreduce_fwd_calls
        return int(self.allreduce_fwd != 0)

    sharded_params: list[str] = field(default_factory=list)
    """Names of the parameter placeholders this node shards (matmul weights, biases...)."""
    blocked: str = ""
    """On the node that keeps tensor parallelism from splitting anything: why (else empty)."""
    replicated: str = ""
    """On a matmul or embedding the analysis kept whole while others split: why, naming the node
    where its region conflicted (else empty)."""
    must_divide: int = 0
    """A column-parallel matmul's output features (its vocabulary excepted, which is padded):
    the size tp must divide (0 elsewhere)."""
    fwd_gemm_dims: list = field(default_factory=list)
    """Per entry of ``meta['fwd_gemms']``: the dim of that product tp divides (``m``, ``n``,
    ``k``, ``batch``) or None (empty: none divides)."""
    bwd_gemm_dims: list = field(default_factory=list)
    """The same for ``meta['bwd_gemms']``."""
    # ---- under sequence parallelism (``passes.tensor_parallel.sp_analysis``)
    sp: bool = False
    """The node's output is sequence-sharded under SP (each tp rank holds ``s / tp`` positions)."""
    saved_bytes_sp: sympy.Expr = _ZERO
    """The part of ``meta['saved_bytes']`` SP shards along the sequence (beyond ``saved_bytes_tp``)."""
    sp_reduce_scatter: sympy.Expr = _ZERO
    """Bytes (whole tensor) SP reduce-scatters here in the forward instead of all-reducing them
    (all-gathered in the backward)."""
    sp_all_gather: sympy.Expr = _ZERO
    """Bytes (whole tensor) SP all-gathers here in the forward before column-parallel matmuls
    (reduce-scattered in the backward instead of all-reduced, and all-gathered once more in the
    backward for the weight gradients: only this rank's positions are saved)."""
    sp_grad_all_reduce: sympy.Expr = _ZERO
    """Gradient bytes of replicated weights used on sequence shards, all-reduced in the backward."""
    sp_split: sympy.Expr = _ZERO
    """Bytes (whole tensor) of a replicated full-length value each rank takes its positions of (a
    position embedding): nothing in the forward, its gradient all-gathered in the backward."""


def vocab_loss_bytes(logits: Any, element_size: int) -> tuple[Any, Any]:
    """Memory-bound bytes ``(forward, backward)`` of ``runtime.tensor_parallel``'s vocab-parallel
    cross-entropy over ``logits`` elements (all shards together) of ``element_size`` bytes.

    Forward, in fp32 ``z``: ``amax`` reads z, ``z - m`` reads and writes, ``exp`` reads and writes,
    the row sum reads, the in-place division by the sum reads and writes: 8 passes (the target
    gather is one element per row), after ``logits.float()`` (a read and an fp32 write unless
    the logits are fp32). Backward: the clone of the saved softmax and the in-place scaling, 2
    passes each (the one-hot subtraction touches one element per row), then the cast back to the
    logits' dtype unless fp32. ``tests/runtime/test_tensor_parallel.py`` counts the runtime's bytes."""
    f32 = 4 * logits
    cast = 0 if element_size == 4 else (element_size + 4) * logits
    return 8 * f32 + cast, 4 * f32 + cast


def _rows(x: fx.Node, row_dim: int) -> sympy.Expr:
    """Number of rows of ``x`` when dim ``d`` is the row length (product of the other dims)."""
    shape = need(x, "shape", _PASS, "annotate_shapes")
    return sympy.expand(sympy.Mul(*[e for k, e in enumerate(shape) if k != row_dim]))


def _shard_dims(state) -> Any:
    """A node's state as ``TPInfo.shard_dim``: None, the sharded dim, or a list of those."""
    if isinstance(state, list):
        return [s.dim if isinstance(s, Shard) else None for s in state]
    return state.dim if isinstance(state, Shard) else None


def _loss_info(n: fx.Node) -> dict:
    """All-reduces and extra bytes of the vocab-parallel cross-entropy over 2-d logits."""
    logits = arg_node(n, 0)
    words = 3  # max, sum-exp, target logit: one all-reduce each
    rows = _rows(logits, 1)
    size = logits.meta["val"].element_size()
    full = rows * need(logits, "shape", _PASS, "annotate_shapes")[1]
    fwd, bwd = vocab_loss_bytes(full, size)
    # the runtime's vocab-parallel cross-entropy replaces the traced one
    return {
        "allreduce_fwd": rows * 4 * words,
        "allreduce_fwd_calls": words,
        "loss_fwd_bytes": sympy.expand(fwd - n.meta.get("fwd_bytes", _ZERO)),
        "loss_bwd_bytes": sympy.expand(bwd - n.meta.get("bwd_bytes", _ZERO)),
    }


def _node_info(n: fx.Node, dec: TPDecisions, reduced: set) -> TPInfo:
    """``TPInfo`` of one node from the analysis' decisions (``reduced``: inputs of the
    column-parallel matmuls seen so far, whose gradient is already all-reduced)."""
    role = dec.role[n]
    kw: dict = {"sharded_params": list(dec.shards_params.get(n, []))}
    if role == "col":
        keys = dec.shards_params.get(n, [])
        if keys and dec.weights[keys[0]].kind != "vocab":
            kw["must_divide"] = dec.state[n].size
        act = matmul_operands(n)[0]
        if act not in reduced:
            reduced.add(act)
            kw["allreduce_bwd"] = need(act, "out_bytes", _PASS, "annotate_shapes")
    elif role in ("row", "vocab_embedding"):
        kw["allreduce_fwd"] = need(n, "out_bytes", _PASS, "annotate_shapes")
    elif role == "vocab_loss":
        kw.update(_loss_info(n))
    elif role == "partial":  # each rank's partial sum, all-reduced
        kw["allreduce_fwd"] = need(n, "out_bytes", _PASS, "annotate_shapes")
    if n in dec.params:
        role = "sharded" if dec.params[n] in dec.weights else "replicated"
    divides = role in ("col", "row", "sharded", "vocab_loss", "partial") and n not in dec.params
    if divides:
        for gemms_key, dims_key in (("fwd_gemms", "fwd_gemm_dims"), ("bwd_gemms", "bwd_gemm_dims")):
            kw[dims_key] = [gemm_tp_dim(role, True, g.operands) for g in need(n, gemms_key, _PASS, "annotate_costs")]
    return TPInfo(role=role, shard_dim=_shard_dims(dec.state[n]), divides=divides, **kw)


def _saved_tp(n: fx.Node, info: dict[fx.Node, TPInfo], by_name: dict[str, fx.Node]) -> sympy.Expr:
    """Bytes of the node's charged saved tensors that live in tp shards: those made by a sharded
    node (kernel internals of a node that divides, e.g. attention's log-sum-exp, count as its
    shards unless they are scalars)."""
    total = _ZERO
    own = info[n]
    for rec in need(n, "saved", _PASS, "annotate_costs"):
        if not rec.counted:
            continue
        prod = by_name.get(rec.producer)
        if prod is None or prod is n:
            sharded = own.divides and not (rec.nbytes.is_Number and rec.nbytes <= 8)
        else:
            st = info[prod].shard_dim
            sharded = any(x is not None for x in st) if isinstance(st, list) else st is not None
        if sharded:
            total = total + rec.nbytes
    return total


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _where(n: fx.Node) -> str:
    """``node 'x' (op) in module 'a.b' at file:line`` (the innermost frame outside torch)."""
    frames = [f"{f}:{ln}" for f, ln in _FRAME.findall(n.meta.get("stack_trace") or "") if not f.startswith(_TORCH_DIR)]
    src = frames[-1] if frames else source_line(n)
    mod = _module_of(n)
    return f"node {n.name!r} ({n.target})" + (f" in module {mod!r}" if mod else "") + (f" at {src}" if src else "")


def _module_of(n: fx.Node) -> str:
    """The innermost module that ran ``n`` (its path), or ``''``."""
    stack = n.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def tp_sizes(gm: fx.GraphModule) -> dict[int, str]:
    """The sizes tp must divide (column-parallel output features) -> the first node with it."""
    out: dict[int, str] = {}
    for n in gm.graph.nodes:
        info = n.meta.get("tp")
        if isinstance(info, TPInfo) and info.must_divide:
            out.setdefault(int(info.must_divide), _where(n))
    return out


def tp_replicated(gm: fx.GraphModule) -> dict[str, str]:
    """The modules whose matmuls stay whole on every rank while tensor parallelism splits others
    (blocks' numbers read ``*``: ``transformer.h.*.self_attention.query_key_value``) -> why the
    first of them did."""
    out: dict[str, str] = {}
    for n in gm.graph.nodes:
        info = n.meta.get("tp")
        if isinstance(info, TPInfo) and info.replicated:
            out.setdefault(re.sub(r"\.\d+\.", ".*.", _module_of(n) or n.name), info.replicated)
    return out


def tp_blocked(gm: fx.GraphModule) -> str:
    """Why tensor parallelism splits nothing in ``gm`` (naming the node), or ``''``."""
    for n in gm.graph.nodes:
        info = n.meta.get("tp")
        if isinstance(info, TPInfo) and info.blocked:
            return info.blocked
    return ""


def _all_replicated(gm: fx.GraphModule, node: fx.Node, why: str) -> fx.GraphModule:
    for n in gm.graph.nodes:
        n.meta["tp"] = TPInfo(role="replicated", blocked=why if n is node else "")
    return gm


def _sequence_parallel(gm: fx.GraphModule, dec: TPDecisions, info: dict[fx.Node, TPInfo]) -> None:
    """Price sequence parallelism's decisions on each node (``TPInfo.sp*``): which outputs and
    saved tensors it shards along the sequence and the collectives it adds or changes, charged to
    the node whose value they move. The cost model applies them only to plans that use SP."""
    if dec.sp_blocked is not None or not dec.sp_sharded:
        return
    by_name = {n.name: n for n in gm.graph.nodes}
    seq = set(dec.sp_sharded)
    # a column-parallel matmul reads the all-gathered (whole-sequence) copy of its input but saves
    # only this rank's positions (``runtime.tensor_parallel.overlapped.ColumnLinears`` gathers them
    # again in backward, ``sp_all_gather``): its saved input shrinks like every other sequence shard
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        own = info[n]
        own.sp = n.name in seq and not own.divides
        extra = _ZERO
        for rec in n.meta.get("saved", ()):
            prod = by_name.get(rec.producer)
            if rec.counted and prod is not None and rec.producer in seq and not info[prod].divides:
                extra = extra + rec.nbytes
        own.saved_bytes_sp = extra
    for c in dec.sp_comms:
        node = by_name.get(c.value)
        if node is None:
            continue
        nbytes = sympy.sympify(c.nbytes)
        if c.kind == "reduce_scatter":
            info[node].sp_reduce_scatter += nbytes
        elif c.kind == "all_gather":
            info[node].sp_all_gather += nbytes
        elif c.kind == "grad_all_reduce" and c.grad:
            info[node].sp_grad_all_reduce += nbytes
        elif c.kind == "split" and c.grad:
            info[node].sp_split += nbytes


def propagate_tensor_parallel(gm: fx.GraphModule, roles: dict[str, str]) -> fx.GraphModule:
    """Write ``meta['tp']`` on every node (see module doc)."""
    try:
        decisions = analyze_tensor_parallel(gm, roles=roles)
    except TPConflict as conflict:
        return _all_replicated(
            gm,
            conflict.node,
            f"{conflict.why} at {_where(conflict.node)}, and keeping every matmul replicated does not avoid it",
        )
    if not decisions.weights and decisions.replicated:  # every matmul had to stay replicated
        first = next(iter(decisions.replicated.values()))
        return _all_replicated(gm, first.node, f"no matmul can be split: {first.why} at {_where(first.node)}")
    reduced: set[fx.Node] = set()
    info = {n: _node_info(n, decisions, reduced) for n in gm.graph.nodes}
    by_name = {n.name: n for n in gm.graph.nodes}
    for name, why in decisions.replicated.items():
        if name in by_name:
            info[by_name[name]].replicated = f"{why.why} at {_where(why.node)}"
    for n in gm.graph.nodes:
        if n.op != "placeholder" and n.op != "output":
            info[n].saved_bytes_tp = _saved_tp(n, info, by_name)
    _sequence_parallel(gm, decisions, info)
    for n in gm.graph.nodes:
        n.meta["tp"] = info[n]
    return gm
