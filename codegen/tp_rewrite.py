"""Megatron tensor parallelism as a rewrite of the exported ATen graph.

Every tp rank runs the same generated code on its own weight shards. ``build_tp_rewrite`` takes
the decisions of ``passes.tensor_parallel.tp_analysis`` (which values are sharded, which matmuls are column or row
parallel, where replicated values enter a sharded region: the states and rules are explained
there, and the cost pass prices the same decisions) for the plan's tp degree ``t`` and returns
``rewrite(g, lg)``, which applies them to each layer's freshly built ``fx.Graph`` before
``codegen.lower`` prints it:

* A replicated tensor that requires grad and enters a sharded op (the input of a column-parallel
  matmul, a norm weight, a broadcast scale) passes through ``copy_to_tp`` (identity forward,
  all-reduce of the gradient backward): each rank's gradient covers only its shard.
* Views, reshapes, unflattens and expands in a sharded region get their size argument along the
  sharded dim divided by ``t`` (hidden -> hidden/t, heads -> heads/t, kv heads -> kv_heads/t,
  ffn -> ffn/t); the split of a fused projection (GPT-2's ``c_attn``) gets its sizes divided,
  and the slices that cut one (Phi-3's ``qkv_proj``) their bounds.
* Replicated k / v holding every query head (grouped-query attention whose key/value heads tp
  does not divide: their projections stay replicated) pass through ``scatter_to_tp`` along the
  heads: each rank keeps its query heads' share, and the gradients are gathered back; so does a
  constant added to sharded values (MPT's per-head ALiBi bias).
* A row-parallel matmul becomes ``runtime.tensor_parallel.row_parallel_linear`` (or
  ``reduce_from_tp`` of the matmul, then the bias): the replicated bias is added once. A sum or
  mean over the whole sharded dim becomes ``reduce_from_tp`` of this rank's sum (a mean then
  divided by the full size).
* The token embedding becomes ``vocab_parallel_embedding(ids, W_r, vocab_start)`` with
  ``vocab_start = tp_rank() * V_r`` computed at run time; ``aten.cross_entropy_loss`` over
  vocab-sharded logits becomes ``vocab_parallel_cross_entropy``. A vocabulary ``t`` does not
  divide is padded to ``ceil(V / t) * t`` rows.

Sequence parallelism (plan.json ``sequence_parallel``; the analysis' ``sp_*`` decisions, explained
in ``passes.tensor_parallel.tp_analysis``, "Sequence parallelism") rewrites on top of that:

* The input of a column-parallel matmul that is sequence-sharded passes through
  ``all_gather_seq`` instead of ``copy_to_tp`` (one gather per value, shared by q, k and v).
* A row-parallel matmul becomes the matmul, ``reduce_scatter_seq`` along the sequence and the bias
  (through ``copy_to_tp``: each rank adds it to its positions only); the token embedding gets
  ``sequence_dim`` (a reduce-scatter instead of the all-reduce).
* Replicated tensors requiring grad used on sequence shards (norm weights and biases) pass through
  ``copy_to_tp``; replicated full-length ones (a position embedding) through ``scatter_to_tp``
  along their sequence dim; size arguments along the sequence of views and expands become ``S/t``.
* What a pipeline stage sends or receives is ``S/t`` positions long (``sequence_sharded``).

With either, the linears that share a column-parallel input become one
``column_parallel_linears`` call (the collective fused with them, so the runtime can overlap it:
``runtime.tensor_parallel.overlapped``), and a row-parallel ``linear`` before a reduce-scatter one
``linear_reduce_scatter_seq``.

A model SP cannot split (``sp_blocked``) or a sequence ``t`` does not divide is a ``TPRewriteError``.
With ``sequence_parallel`` false none of this happens: the code is that of plain tp.

Divisibility is checked here, for the concrete ``t``: the heads, the kv heads (``t`` divides
them, or is a multiple of them: each kv head is then replicated on ``t / kv`` ranks), the output features
of every column-parallel matmul (the vocabulary excepted), every reshape that splits the sharded
dim (``reshape_shard``) and the parts of a fused projection, which also needs the runtime to load
``qkv`` shards (probed once). An indivisible size or a conflict no replicated matmul avoids is a
``TPRewriteError`` naming the node, its module, source line and the model's dims: never silently
wrong math.

Parameter shapes: the sharded parameters of ``gm`` (which lives on meta) are replaced by meta
parameters of the *shard* shape, so ``codegen.lower`` writes shard shapes into each generated
``__init__`` and the manifest records them. ``shard_info`` maps every sharded original FQN to
``{"dim", "kind", "size"[, "padded"][, "parts"]}``, the manifest form of
``runtime.tensor_parallel.sharding.TensorShard``, which cuts each rank's piece of the original weights and joins
the pieces back.
"""

from __future__ import annotations

import operator
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import fx

from codegen.codegen_errors import TPRewriteError
from passes.common import source_line
from passes.op_class import op_name
from passes.tensor_parallel.tp_analysis import (
    SPLITS,
    VIEWS,
    Shard,
    TPConflict,
    TPDecisions,
    analyze_tensor_parallel,
    matmul_operands,
    node_arg,
    reshape_groups,
    slice_bounds,
)
from runtime import tensor_parallel as rtp
from runtime.tensor_parallel.sharding import TensorShard

__all__ = ["TPAnalysis", "analyze_tp", "build_tp_rewrite", "plan_tp_rewrite", "reshape_shard"]

aten = torch.ops.aten

_REDUCTIONS = {"mean": 1, "sum": 2, "none": 0}


@dataclass
class TPAnalysis:
    """What tensor parallelism at degree ``tp`` does to the exported graph."""

    tp: int
    decisions: TPDecisions | None = None
    """The shared analysis (``passes.tensor_parallel.tp_analysis``) this rewrite follows."""
    actions: dict = field(default_factory=dict)
    """Node name -> (kind, payload): col, row, size (a size argument), split, embed, loss."""
    enter: dict = field(default_factory=dict)
    """Node name -> argument paths (flat) of replicated tensors that enter a sharded op."""
    scatter: dict = field(default_factory=dict)
    """Node name -> ``[(argument path, dim)]`` of replicated k / v of which each rank keeps its
    query heads' share (``scatter_to_tp``)."""
    shard_info: dict = field(default_factory=dict)
    """Original FQN -> shard spec for the runtime."""
    replicated: dict = field(default_factory=dict)
    """Node name of a matmul/embedding made replicated -> why (the conflict that forced it)."""
    sequence_parallel: bool = False
    """Whether the rewrite applies sequence parallelism (the fields below are empty if not)."""
    sp_args: dict = field(default_factory=dict)
    """Node name -> ``[(argument path, gather | split | copy, dim)]`` (``TPDecisions.sp_args``)."""
    sp_reduce: dict = field(default_factory=dict)
    """Row-parallel matmul / token embedding name -> the sequence dim it reduce-scatters along."""
    sequence_sharded: dict = field(default_factory=dict)
    """Node name -> sequence dim of the values each rank holds ``S/t`` positions of."""


def _shape(n) -> list[int]:
    val = n.meta.get("val") if isinstance(n, fx.Node) else None
    return [int(size) for size in val.shape] if isinstance(val, torch.Tensor) else []


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _user_line(n: fx.Node) -> str:
    """``file:line`` of the innermost frame outside torch itself ('' if unknown)."""
    hits = [(f, line) for f, line in _FRAME.findall(n.meta.get("stack_trace") or "") if not f.startswith(_TORCH_DIR)]
    return f"{hits[-1][0]}:{hits[-1][1]}" if hits else source_line(n)


def _where(n: fx.Node) -> str:
    """``node 'x' (op) in module a.b, from file:line`` for error messages."""
    stack = n.meta.get("nn_module_stack") or {}
    mod = list(stack.values())[-1][0] if stack else ""
    src = _user_line(n)
    return f"node {n.name!r} ({n.target})" + (f" in module {mod!r}" if mod else "") + (f", from {src}" if src else "")


def reshape_shard(src: list[int], dst: list[int], dim: int, tp: int, padded: bool = False, strict: bool = True):
    """Where a tensor sharded along ``d`` is sharded after ``reshape(src -> dst)``.

    Returns ``(d_out, local_out)``: each rank's block of the reshaped tensor is its block of
    ``dst[d_out]`` (``local_out`` entries) with every other dim whole. That holds when ``d`` leads
    its group of merged/split dims, since rank ``r``'s block of the flattened group is then the
    contiguous ``[r * P/tp, (r + 1) * P/tp)`` of the group's product ``P``, which in ``dst`` is a
    block of its leading dim iff ``tp`` divides that dim. Returns None when ``d`` does not lead
    its group (the shards would interleave) or a padded dim would be merged; raises ValueError when
    ``tp`` does not divide the new leading dim (e.g. 3 heads over 2 ranks) unless not ``strict``.
    """
    groups = reshape_groups(src, dst, dim)
    if groups is None or groups[0][0] != dim:
        return None
    src_group, dst_group = groups
    d_out = dst_group[0]
    if padded:
        return (d_out, None) if len(src_group) == 1 and len(dst_group) == 1 else None
    if dst[d_out] % tp and strict:
        raise ValueError(
            f"reshaping {src} -> {dst} splits the sharded size {src[dim]} into "
            f"{' x '.join(str(dst[k]) for k in dst_group)}, and tp={tp} does not divide "
            f"{dst[d_out]} (e.g. the number of attention heads)"
        )
    return d_out, dst[d_out] // tp


def _fused_supported() -> bool:
    """Does this runtime cut and join ``qkv`` shards (``[q_r; k_r; v_r]``)? Probed on 12 rows."""
    full, spec = torch.arange(12.0).view(12, 1), {"dim": 0, "kind": "qkv", "parts": [4, 4, 4], "size": 12}
    try:
        shard = TensorShard.from_dict(spec)
        assert shard is not None  # a non-empty spec always gives one
        pieces = [shard.cut(full, rank, 2) for rank in range(2)]
        return pieces[0].flatten().tolist() == [0, 1, 4, 5, 8, 9] and torch.equal(shard.join(pieces), full)
    except Exception:  # a runtime that does not know the kind
        return False


class _Planner:
    """Turn the shared decisions into this tp degree's rewrite actions, checking divisibility."""

    def __init__(
        self,
        gm: fx.GraphModule,
        dec: TPDecisions,
        tp: int,
        dims: dict,
        fused_ok: bool | None,
        sequence_parallel: bool = False,
    ):
        self.gm, self.dec, self.tp, self.dims, self.fused_ok = gm, dec, tp, dims, fused_ok
        self.a = TPAnalysis(tp, dec, sequence_parallel=sequence_parallel)
        # the LM heads whose logits feed the vocab-parallel loss: tp need not divide them
        self.vocab_heads = {
            n.name
            for n, keys in dec.shards_params.items()
            if dec.role[n] == "col" and dec.weights[keys[0]].kind == "vocab"
        }

    def fail(self, n, why, hint="Choose a tp that divides these sizes."):
        raise TPRewriteError(
            f"tensor parallelism (tp={self.tp}) at {_where(n)}: {why} (model dims: {self.dims}). {hint}"
        )

    def padded(self, shard: Shard) -> bool:
        """Is ``s`` a vocabulary (of LM-head logits) that tp does not divide, padded per rank?"""
        return shard.size % self.tp != 0 and shard.size == self.dec.vocab and shard.origins <= self.vocab_heads

    def local(self, shard: Shard) -> int:
        """Entries of the sharded dim one rank holds (a vocabulary is padded)."""
        return rtp.padded_vocab_size(shard.size, self.tp) // self.tp if self.padded(shard) else shard.size // self.tp

    def run(self) -> TPAnalysis:
        dec, analysis = self.dec, self.a
        for n in self.gm.graph.nodes:
            if n.op != "call_function":
                continue
            role, name = dec.role[n], op_name(n)
            if role == "col":
                state = dec.state[n]
                if state.size % self.tp and not self.padded(state):
                    self.fail(
                        n,
                        f"this column-parallel matmul has {state.size} output features, which tp={self.tp} does not divide",
                    )
                analysis.actions[n.name] = ("col", n.target)
            elif role == "row":
                if self.padded(dec.state[matmul_operands(n)[0]]):
                    self.fail(
                        n,
                        f"the padded vocabulary ({dec.vocab} entries, which tp={self.tp} "
                        "does not divide) is the input of a row-parallel matmul",
                    )
                analysis.actions[n.name] = ("row", n.target)
            elif role == "vocab_embedding":
                analysis.actions[n.name] = (
                    "embed",
                    (rtp.padded_vocab_size(cast(int, dec.vocab), self.tp) // self.tp, node_arg(n, "padding_idx", -1)),
                )
            elif role == "partial":
                analysis.actions[n.name] = ("partial", (name, dec.partial[n]))
            elif role == "vocab_loss":
                state = dec.state[n.args[0]]
                red = {code: k for k, code in _REDUCTIONS.items()}[node_arg(n, "reduction", 1)]
                analysis.actions[n.name] = (
                    "loss",
                    (self.local(state), state.size, red, node_arg(n, "ignore_index", -100)),
                )
            elif n.args and isinstance(dec.state.get(n.args[0]), Shard):
                if name in VIEWS:
                    self.view(n)
                elif name in ("expand", "new_empty"):
                    state = dec.state[n]
                    analysis.actions[n.name] = ("size", (1, state.dim, self.local(state)))
                elif name in SPLITS and node_arg(n, "dim", 0) % len(_shape(n.args[0])) == dec.state[n.args[0]].dim:
                    self.split(n)
                elif name == "slice" and node_arg(n, "dim", 0) % len(_shape(n.args[0])) == dec.state[n.args[0]].dim:
                    self.fused_slice(n)
            elif name in ("expand", "view", "_unsafe_view", "reshape") and isinstance(dec.state.get(n), Shard):
                # a broadcast to the local heads, or a per-head parameter's view (attention sinks)
                state = dec.state[n]
                analysis.actions[n.name] = ("size", (1, state.dim, self.local(state)))
        analysis.enter = {n.name: paths for n, paths in dec.enter.items()}
        analysis.scatter = {n.name: scatter for n, scatter in dec.scatter.items()}
        if analysis.sequence_parallel:
            self.sequence_parallel()
        return analysis

    def sequence_parallel(self):
        """The SP decisions for this ``t``: divisibility, and the views' sizes along the sequence."""
        dec, analysis, degree = self.dec, self.a, self.tp
        if dec.sp_blocked:
            raise TPRewriteError(
                f"sequence parallelism (tp={degree}) cannot split this model: {dec.sp_blocked}. "
                "Set sequence_parallel to false in the plan (planner plan "
                "--sequence-parallel off)."
            )
        if dec.sp_seq_len % degree:
            raise TPRewriteError(
                f"sequence parallelism (tp={degree}): the sequence length {dec.sp_seq_len} is not "
                f"a multiple of tp={degree}; choose a sequence length tp divides."
            )
        local = dec.sp_seq_len // degree
        for n in self.gm.graph.nodes:
            seq_dim = dec.sp_sharded.get(n.name)
            if isinstance(seq_dim, int) and op_name(n) in ("view", "_unsafe_view", "reshape", "expand"):
                analysis.actions[n.name] = ("size", (1, seq_dim, local))
        analysis.sp_args = dict(dec.sp_args)
        analysis.sp_reduce = {comm.value: comm.dim for comm in dec.sp_comms if comm.kind == "reduce_scatter"}
        analysis.sequence_sharded = dict(dec.sp_sharded)

    def view(self, n):
        """view / reshape / flatten / unflatten: rewrite the size list along the sharded dim."""
        x = n.args[0]
        state, out = self.dec.state[x], self.dec.state[n]
        try:
            if reshape_shard(_shape(x), _shape(n), state.dim, self.tp, self.padded(state)) is None:
                self.fail(
                    n,
                    f"the reshape merges the padded vocabulary ({state.size} entries, which "
                    f"tp={self.tp} does not divide) with other dims",
                )
        except ValueError as e:
            self.fail(n, str(e))
        if op_name(n) == "unflatten":
            dim = n.args[1] % len(_shape(x))
            if dim <= out.dim < dim + len(n.args[2]):
                self.a.actions[n.name] = ("size", (2, out.dim - dim, self.local(out)))
        elif op_name(n) != "flatten":
            self.a.actions[n.name] = ("size", (1, out.dim, self.local(out)))

    def split(self, n):
        """A fused projection split along its sharded features: Megatron layout [q_r; k_r; v_r]."""
        state = self.dec.state[n.args[0]]
        pieces = [piece.size for piece in self.dec.state[n]]
        if any(piece % self.tp for piece in pieces):
            self.fail(
                n,
                f"the fused projection splits {state.size} features into {pieces}, which tp={self.tp} does not divide",
            )
        if self.fused_ok is None:  # probed only if the graph has a fused projection
            self.fused_ok = _fused_supported()
        if not self.fused_ok:
            self.fail(
                n,
                "this fused projection (e.g. GPT-2's c_attn, split into q, k, v) needs the "
                "runtime to load 'qkv' shards (runtime.tensor_parallel.sharding.TensorShard with a 'parts' "
                "list); this runtime does not",
                hint="Use tp=1 for this model, or a runtime that supports 'qkv' shards.",
            )
        if op_name(n) != "chunk":
            arg = n.args[1]
            new = arg // self.tp if isinstance(arg, int) else [piece // self.tp for piece in arg]
            self.a.actions[n.name] = ("split", (1, new))

    def fused_slice(self, n):
        """A part of a fused projection cut by a slice (Phi-3's ``qkv[..., :q]``): the same layout
        as :meth:`split`, the bounds divided (each rank's parts are ``[q_r; k_r; v_r]``)."""
        state = self.dec.state[n.args[0]]
        pieces = [end - start for start, end in sorted(slice_bounds(user, state.size) for user in n.args[0].users)]
        if any(piece % self.tp for piece in pieces):
            self.fail(
                n,
                f"the fused projection slices {state.size} features into {pieces}, which tp={self.tp} does not divide",
            )
        if self.fused_ok is None:
            self.fused_ok = _fused_supported()
        if not self.fused_ok:
            self.fail(n, "this fused projection needs the runtime to load 'qkv' shards; this runtime does not")
        start, end = slice_bounds(n, state.size)
        self.a.actions[n.name] = ("slice", (start // self.tp, end // self.tp))


def _spec(weight, tp: int) -> dict:
    """The manifest form of a parameter's ``WeightShard`` at degree ``tp``."""
    padded = rtp.padded_vocab_size(weight.size, tp) if weight.kind == "vocab" else None
    return TensorShard(weight.dim, weight.kind, weight.size, padded, weight.parts).to_dict()


def analyze_tp(
    gm: fx.GraphModule,
    layer_of: Callable,
    tp: int,
    *,
    vocab=None,
    dims=None,
    fused_ok: bool | None = None,
    sequence_parallel: bool = False,
) -> TPAnalysis:
    """The rewrite of ``gm`` for degree ``tp`` (see the module doc), with sequence parallelism if
    ``sequence_parallel``; raises ``TPRewriteError``."""
    try:
        # key/value heads tp is a multiple of: their projections stay replicated (a reshape into
        # heads tp does not divide is then a conflict of the analysis, not an error here)
        kv_heads = (dims or {}).get("kv_heads")
        replicate_kv = bool(kv_heads and kv_heads % tp != 0 and tp % kv_heads == 0)
        dec = analyze_tensor_parallel(gm, layer_of=layer_of, vocab=vocab or None, tp=tp if replicate_kv else None)
    except TPConflict as conflict:
        where = _where(conflict.node) if conflict.node.op != "output" else "the model output"
        raise TPRewriteError(
            f"tensor parallelism (tp={tp}) at {where}: {conflict.why}, and no "
            "column-parallel matmul can be kept replicated to avoid it. "
            "Use tp=1 for this model or restructure this op."
        ) from None
    analysis = _Planner(gm, dec, tp, dims or {}, fused_ok, sequence_parallel).run()
    analysis.replicated = {k: f"{conflict.why} at {_where(conflict.node)}" for k, conflict in dec.replicated.items()}
    analysis.shard_info = {key: _spec(weight, tp) for key, weight in dec.weights.items()}
    return analysis


# ---------------------------------------------------------------------- applying the decisions


def _get_path(n: fx.Node, path):
    i, j = path
    return n.kwargs[i] if isinstance(i, str) else (n.args[i] if j is None else n.args[i][j])


def _set_path(n: fx.Node, path, value) -> None:
    i, j = path
    if isinstance(i, str):
        n.kwargs = {**n.kwargs, i: value}
        return
    args = list(n.args)
    if j is not None:
        value = type(args[i])(value if k == j else x for k, x in enumerate(args[i]))
    args[i] = value
    n.args = tuple(args)


class _LayerRewriter:
    """Apply a ``TPAnalysis`` to one layer's ``fx.Graph`` (see ``codegen.lower``)."""

    def __init__(self, analysis: TPAnalysis):
        self.an = analysis
        self.replicated: dict[str, str] = analysis.replicated
        """Matmuls/embeddings kept replicated -> why (``build_tp_rewrite``)."""
        self.sequence_sharded: dict = analysis.sequence_sharded
        """Values each rank holds ``S/t`` positions of -> their sequence dim."""
        self.sp_replicated: dict[str, str] = {}
        """Row-parallel matmuls / embedding that keep their all-reduce under sequence parallelism -> why."""

    def __call__(self, graph: fx.Graph, layer) -> None:
        new_nodes = [n for n in graph.nodes if n.op == "call_function"]
        if len(new_nodes) != len(layer.nodes) or any(
            new_node.target != orig_node.target for new_node, orig_node in zip(new_nodes, layer.nodes)
        ):
            raise TPRewriteError(
                f"layer {layer.name!r}: its graph does not match the analyzed one; "
                "the tensor-parallel rewrite must run before other rewrites"
            )
        copies: dict[fx.Node, fx.Node] = {}
        starts: dict[int, fx.Node] = {}
        sp_made: dict[tuple, fx.Node] = {}  # (action, value) -> its all_gather_seq / scatter_to_tp

        def copy_of(x: fx.Node, before: fx.Node) -> fx.Node:
            if x not in copies:
                with graph.inserting_before(before):
                    copies[x] = graph.call_function(rtp.copy_to_tp, (x,))
            return copies[x]

        def sp_of(kind: str, x: fx.Node, dim, before: fx.Node) -> fx.Node:
            """``x`` gathered (``all_gather_seq``), split (``scatter_to_tp``) or copied for SP."""
            if kind == "copy":
                return copy_of(x, before)
            if (kind, x) not in sp_made:
                fn = rtp.all_gather_seq if kind == "gather" else rtp.scatter_to_tp
                with graph.inserting_before(before):
                    sp_made[kind, x] = graph.call_function(fn, (x, dim))
            return sp_made[kind, x]

        def vocab_start(per: int, before: fx.Node) -> fx.Node:
            if per not in starts:
                with graph.inserting_before(before):
                    rank = graph.call_function(rtp.tp_rank, ())
                    starts[per] = graph.create_node("call_function", operator.mul, (rank, per), name="vocab_start")
            return starts[per]

        for new, orig in zip(new_nodes, layer.nodes):
            sp_actions = self.an.sp_args.get(orig.name, ())
            gathered = {path for path, kind, _ in sp_actions if kind == "gather"}
            for path in self.an.enter.get(orig.name, ()):
                if path in gathered:  # SP: the all-gather replaces copy_to_tp
                    continue
                x = _get_path(new, path)
                _set_path(new, path, copy_of(x, new))
            for path, kind, dim in sp_actions:
                _set_path(new, path, sp_of(kind, _get_path(new, path), dim, new))
            for path, dim in self.an.scatter.get(orig.name, ()):
                with graph.inserting_before(new):
                    _set_path(new, path, graph.call_function(rtp.scatter_to_tp, (_get_path(new, path), dim)))
            if new.target is aten.dropout.default:  # on a shard: each rank its block of one mask
                dim = self._shard_dim(orig)
                if dim is not None:
                    with graph.inserting_before(new):
                        out = graph.call_function(rtp.sharded_dropout, (*new.args, dim))
                    new.replace_all_uses_with(out)
                    graph.erase_node(new)
                    continue
            act = self.an.actions.get(orig.name)
            if act is None:
                continue
            kind, payload = act
            if kind == "size":  # a view/reshape/expand/unflatten size list: the shard's size
                pos, idx, local = payload
                if new.args[pos][idx] != -1:
                    _set_path(new, (pos, idx), local)
            elif kind == "split":
                _set_path(new, (payload[0], None), payload[1])
            elif kind == "slice":  # aten.slice(x, dim, start, end[, step]): this rank's bounds
                new.args = (new.args[0], node_arg(new, "dim", 0), *payload, *new.args[4:])
            elif kind in ("row", "embed", "loss", "partial"):
                with graph.inserting_before(new):
                    out = self._replacement(
                        graph, new, kind, payload, vocab_start, rtp, self.an.sp_reduce.get(orig.name)
                    )
                new.replace_all_uses_with(out)
                graph.erase_node(new)
        _fuse_column_linears(graph)

    def _shard_dim(self, orig: fx.Node) -> int | None:
        """The dim along which this rank holds a block of ``orig``'s input: its tp shard, or its
        sequence under sequence parallelism; None when the input is whole on every rank."""
        x = cast(fx.Node, orig.args[0])
        state = self.an.decisions.state.get(x) if self.an.decisions is not None else None
        if isinstance(state, Shard):
            return state.dim
        seq_dim = (self.an.sequence_sharded or {}).get(x.name)
        return seq_dim if isinstance(seq_dim, int) else None

    @staticmethod
    def _replacement(graph: fx.Graph, new: fx.Node, kind: str, payload, vocab_start, rtp, seq=None) -> fx.Node:
        """The nodes that replace a row-parallel matmul, the token embedding, the loss or a partial
        reduction (``seq``: the sequence dim a row-parallel matmul or the embedding reduce-scatters
        along under SP)."""
        call = graph.call_function
        if kind == "partial":  # this rank's sum, all-reduced (a mean then divided by the full size)
            name, full = payload
            dtype = {"dtype": new.kwargs["dtype"]} if new.kwargs.get("dtype") is not None else {}
            reduced = (new.args[0], node_arg(new, "dim"), node_arg(new, "keepdim", False))
            out = call(rtp.reduce_from_tp, (call(aten.sum.dim_IntList, reduced, dtype),))
            return call(aten.div.Tensor, (out, full)) if name == "mean" else out
        if kind == "row" and seq is not None:  # SP: the bias (through copy_to_tp) after the scatter
            x, weight, bias = matmul_operands(new)
            if payload is aten.linear.default:  # one call: overlaps its pieces' reduce-scatters
                out = call(rtp.linear_reduce_scatter_seq, (x, weight, seq))
            else:
                product = aten.mm.default if payload is aten.addmm.default else payload
                out = call(rtp.reduce_scatter_seq, (call(product, (x, weight)), seq))
            return out if bias is None else call(aten.add.Tensor, (out, bias))
        if kind == "row":
            x, weight, bias = matmul_operands(new)
            if payload is aten.linear.default:
                return call(rtp.row_parallel_linear, (x, weight) if bias is None else (x, weight, bias))
            # addmm(b, x, W), mm(x, W) or matmul(x, W): Conv1D layout, W is [in, out]
            product = aten.mm.default if payload is aten.addmm.default else payload
            out = call(rtp.reduce_from_tp, (call(product, (x, weight)),))
            return out if bias is None else call(aten.add.Tensor, (out, bias))
        if kind == "embed":
            per, pad = payload
            weight, ids = new.args[0], new.args[1]
            out = call(
                rtp.vocab_parallel_embedding,
                (ids, weight, vocab_start(per, new)),
                {} if seq is None else {"sequence_dim": seq},
            )
            if isinstance(pad, int) and pad >= 0:  # padding_idx: its row gets no gradient
                is_pad = call(aten.unsqueeze.default, (call(aten.eq.Scalar, (ids, pad)), -1))
                if seq is not None:  # SP: this rank's positions
                    is_pad = call(rtp.scatter_to_tp, (is_pad, seq))
                out = call(aten.where.self, (is_pad, call(aten.detach.default, (out,)), out))
            return out
        local, full, red, ignore = payload
        return call(
            rtp.vocab_parallel_cross_entropy,
            tuple(new.args[:2]),
            {"vocab_start": vocab_start(local, new), "ignore_index": ignore, "vocab_size": full, "reduction": red},
        )


def _fuse_column_linears(graph: fx.Graph) -> None:
    """Each ``copy_to_tp(x)`` / ``all_gather_seq(x, dim)`` whose every use is the input of an
    ``aten.linear`` becomes one ``column_parallel_linears(x, weights, biases[, sequence_dim])``
    call, and the linears the items of its result (same names), so the runtime can overlap the
    collective with the matmuls (``runtime.tensor_parallel.overlapped``). The weights and biases
    are parameters read where first used: their reads move up to the fused call."""
    entries = (rtp.copy_to_tp, rtp.all_gather_seq)
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in entries]:
        users = list(node.users)
        if not users or any(not _plain_linear_of(u, node) for u in users):
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        first = min(users, key=order.__getitem__)
        users.sort(key=order.__getitem__)
        operands = [a for u in users for a in u.args[1:] if isinstance(a, fx.Node)]
        if any(order[a] > order[first] and a.op != "get_attr" for a in operands):
            continue  # a weight computed after the first linear: leave the plain form
        for a in operands:
            if order[a] > order[first]:
                first.prepend(a)
        weights = [u.args[1] for u in users]
        biases = [u.args[2] if len(u.args) > 2 else None for u in users]
        kwargs = {} if node.target is rtp.copy_to_tp else {"sequence_dim": node.args[1]}
        with graph.inserting_before(first):
            fused = graph.call_function(rtp.column_parallel_linears, (node.args[0], weights, biases), kwargs)
        for i, u in enumerate(users):
            u.target, u.args, u.kwargs = operator.getitem, (fused, i), {}
        graph.erase_node(node)


def _plain_linear_of(user: fx.Node, x: fx.Node) -> bool:
    """Whether ``user`` is ``aten.linear(x, weight[, bias])`` with ``x`` its input only."""
    return (
        user.target is aten.linear.default
        and not user.kwargs
        and user.args[0] is x
        and x not in user.args[1:]
        and 2 <= len(user.args) <= 3
    )


def _reshard_params(gm: fx.GraphModule, shard_info: dict, tp: int) -> None:
    """Replace each sharded meta parameter of ``gm`` by one of its shard's shape."""
    for fqn, spec in shard_info.items():
        mod_path, _, attr = fqn.rpartition(".")
        mod = gm.get_submodule(mod_path) if mod_path else gm
        tensor = getattr(mod, attr)
        shape = list(tensor.shape)
        shard = TensorShard.from_dict(spec)
        assert shard is not None  # shard_info holds only sharded tensors
        shape[spec["dim"]] = shard.local_size(tp)
        new = torch.empty(shape, dtype=tensor.dtype, device="meta")
        if isinstance(tensor, torch.nn.Parameter):
            new = torch.nn.Parameter(new, requires_grad=tensor.requires_grad)
        store: dict[str, Any] = mod._parameters if attr in mod._parameters else mod._buffers
        store[attr] = new


def build_tp_rewrite(gm: fx.GraphModule, layer_of: Callable, plan, vocab: int, dims: dict):
    """Analyze ``gm`` for ``plan.tp`` and return ``(rewrite, shard_info)``.

    ``rewrite(g, lg)`` rewrites one layer's graph in place (called by ``codegen.lower``);
    ``shard_info`` is ``{original FQN: shard spec}``. As a side effect the sharded parameters of
    ``gm`` (on meta) take their shard shapes, which the generated ``__init__`` and the manifest use.
    ``rewrite.replicated`` lists the matmuls/embeddings kept replicated, and why. With the plan's
    ``sequence_parallel``, ``rewrite.sequence_sharded`` maps the values each rank holds ``S/t``
    positions of to their sequence dim, and ``rewrite.sp_replicated`` lists the row-parallel
    matmuls / embedding that keep their all-reduce, and why.
    """
    tp = int(plan.tp)
    heads, kv_heads = dims.get("heads"), dims.get("kv_heads")
    if heads and heads % tp:
        raise TPRewriteError(
            f"tp={tp} does not divide the model's {heads} attention heads (model "
            f"dims: {dims}); choose a tp that divides the heads."
        )
    if kv_heads and kv_heads % tp and tp % kv_heads:
        raise TPRewriteError(
            f"tp={tp} neither divides the model's {kv_heads} key/value heads nor is a "
            f"multiple of them (model dims: {dims}); choose a tp that divides the "
            "key/value heads, or a multiple of them that divides the heads."
        )
    sequence_parallel = bool(getattr(plan, "sequence_parallel", False))
    analysis = analyze_tp(gm, layer_of, tp, vocab=vocab, dims=dims, sequence_parallel=sequence_parallel)
    _reshard_params(gm, analysis.shard_info, tp)
    rewrite = _LayerRewriter(analysis)
    kept = analysis.decisions.sp_replicated if sequence_parallel and analysis.decisions is not None else {}
    rewrite.sp_replicated = {k: f"{conflict.why} at {_where(conflict.node)}" for k, conflict in kept.items()}
    return rewrite, analysis.shard_info


def plan_tp_rewrite(gm: fx.GraphModule, layer_of: Callable, plan, vocab: int, dims: dict):
    """``(rewrite, shard_info)`` for ``plan.tp`` (see ``build_tp_rewrite``); ``(None, {})`` at tp 1."""
    if plan.tp == 1:
        return None, {}
    return build_tp_rewrite(gm, layer_of, plan, vocab, dims)
