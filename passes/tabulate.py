"""From an analyzed graph to its layer table: node costs summed per layer.

``table_from_traced(traced)`` runs every pass (``passes.analyze``) over a traced graph
(``passes.graph.TracedGraph``, from ``planner.frontend.trace``) and sums node costs per layer
into a ``passes.layer_table.LayerTable``. Zoo models are traced with 2 blocks: the first traced
block stands for blocks 1..L-1 and the second for block L (only the last block's outgoing boundary
differs). Full traces (file factories) group blocks by signature and compute each group's costs
once. Weights read by several rows (a tied embedding and head) are recorded as ``tied``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable, NamedTuple

import sympy
import torch.fx as fx

from passes.analyze import analyze
from passes.attention import SDPA, annotate_attention, attention_core
from passes.common import B, dtype_name, iter_tensors
from passes.graph import TracedGraph
from passes.inputs import infer_inputs
from passes.layer_table import EXPR_FIELDS, GEMM_FIELDS, INT_FIELDS, Gemm, LayerCosts, LayerTable
from passes.layers import layer_io, layer_names, layer_signatures
from passes.mask_kind import mask_facts
from passes.model_facts import merge_graph_facts
from passes.moe import MOE_META, MoeLayer, annotate_moe, moe_summary, replicated_reason
from passes.op_class import op_name
from passes.split_backward import frontier_outputs, tail_saved

__all__ = ["table_from_traced"]

_ZERO = sympy.Integer(0)


def _merge_gemms(calls) -> list[Gemm]:
    """``(m, n, k, batch, tp_dim)`` tuples -> ``Gemm`` rows, identical ones merged by count (in
    order of first appearance)."""
    counts: dict[tuple, int] = {}
    for c in calls:
        counts[c] = counts.get(c, 0) + 1
    return [Gemm(m, n, k, batch, count, tp_dim) for (m, n, k, batch, tp_dim), count in counts.items()]


def _tied_weights(traced, gm: fx.GraphModule) -> list[dict[str, Any]]:
    """Weights whose readers lie in more than one row: ``{"weight", "layers": [first, last],
    "params", "params_tp"}`` in traced row numbers (aliases of one tensor count as one weight;
    ``params`` is its element count, ``params_tp`` the part tensor parallelism shards)."""
    n = len(traced.block_paths) + 2
    rows: dict[str, set[int]] = {}
    sizes: dict[str, tuple[int, int]] = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder" or traced.roles.get(node.name) != "param":
            continue
        canon = traced.tied.get(node.name, node.name)
        rows.setdefault(canon, set()).update(u.meta["layer"] for u in node.users if 0 <= u.meta.get("layer", -1) < n)
        if "param_count" in node.meta:
            count = int(node.meta["param_count"])
            tp = node.meta.get("tp")
            sizes[canon] = (count, count if tp is not None and tp.role == "sharded" else 0)
    return [
        {
            "weight": traced.fqns.get(name, name),
            "layers": [min(ls), max(ls)],
            "params": sizes.get(name, (0, 0))[0],
            "params_tp": sizes.get(name, (0, 0))[1],
        }
        for name, ls in rows.items()
        if len(ls) > 1
    ]


class _Split(NamedTuple):
    """The names of one quantity's three ``LayerCosts`` fields: the whole, the part tensor
    parallelism shards, and the part sequence parallelism shards."""

    total: str
    tp: str
    sp: str


_TAIL_SAVED = _Split("tail_saved_bytes", "tail_saved_bytes_tp", "tail_saved_bytes_sp")
"""What a zero-bubble ``B`` keeps for ``W`` (``passes.split_backward.tail_saved``)."""
_FRONTIER_OUT = _Split("frontier_out_bytes", "frontier_out_bytes_tp", "frontier_out_bytes_sp")
"""The frontier outputs whose gradients ``B`` records (``passes.split_backward.frontier_outputs``)."""

_GEMM_DIMS = (("fwd_gemms", "fwd_gemm_dims"), ("bwd_gemms", "bwd_gemm_dims"))
"""Each pass's GEMM list in ``node.meta`` and, in its ``TPInfo``, the dims tp divides."""

_FLOPS_AND_BYTES = (
    ("fwd_flops", "fwd_flops_tp"),
    ("bwd_flops", "bwd_flops_tp"),
    ("fwd_bytes", "fwd_bytes_tp"),
    ("bwd_bytes", "bwd_bytes_tp"),
)
"""A node's ``node.meta`` cost and the row field holding its tp-divisible part (the meta key is
also the row field of the whole)."""

_CORE_FWD = (("fwd_flops", "core_fwd_flops", "core_fwd_flops_tp"), ("fwd_bytes", "core_fwd_bytes", "core_fwd_bytes_tp"))
"""A node's forward cost, and the row fields of the attention cores' total and tp part."""

_SP_BYTES = (("fwd_bytes", "fwd_bytes_sp"), ("bwd_bytes", "bwd_bytes_sp"))
"""A node's cost, and the row field of the part sequence parallelism shards."""

_SP_COLLECTIVES = (
    ("sp_reduce_scatter", "sp_reduce_scatter_bytes", "sp_reduce_scatter_calls"),
    ("sp_all_gather", "sp_all_gather_bytes", "sp_all_gather_calls"),
)
"""``TPInfo`` bytes of a sequence-parallel collective, the row's bytes field and calls field."""


@dataclass
class _RowSums:
    """The running sums of one layer-table row, by ``LayerCosts`` field."""

    exprs: dict[str, Any] = field(default_factory=lambda: {name: _ZERO for name in EXPR_FIELDS})
    ints: dict[str, int] = field(default_factory=lambda: {name: 0 for name in INT_FIELDS})
    gemms: dict[str, list] = field(default_factory=lambda: {name: [] for name in GEMM_FIELDS})

    def add_placeholder(self, meta: dict[str, Any]) -> None:
        """A parameter's or buffer's sizes."""
        tp = meta["tp"]
        if "param_count" in meta:
            self.ints["param_count"] += meta["param_count"]
            self.ints["param_bytes"] += meta["param_bytes"]
            if tp.role == "sharded":
                self.ints["param_count_tp"] += meta["param_count"]
            if meta.get(MOE_META):  # a routed expert weight: what expert parallelism divides
                self.ints["expert_param_count"] += meta["param_count"]
                if tp.role == "sharded":
                    self.ints["expert_param_count_tp"] += meta["param_count"]
        elif "buffer_bytes" in meta:
            self.ints["buffer_bytes"] += meta["buffer_bytes"]
        self.exprs["sp_grad_all_reduce_bytes"] += tp.sp_grad_all_reduce

    def add_op(self, node: fx.Node, in_core: bool) -> None:
        """An operator's costs (``in_core``: it belongs to an attention core)."""
        meta = node.meta
        tp = meta["tp"]
        makes_tensors = any(True for _ in iter_tensors(meta.get("val")))
        if node.op == "call_function" and makes_tensors:
            self.ints["num_ops"] += 1  # tensor ops only: shape arithmetic of a dynamic trace is free
        for cost, _ in _FLOPS_AND_BYTES:
            self.exprs[cost] += meta[cost]
        by_pass = self._add_gemms(meta, tp)
        fwd_gemms = by_pass["fwd_gemms"]
        if meta.get(MOE_META):  # a grouped expert product: its products, listed apart too
            self.gemms["expert_fwd_gemms"] += fwd_gemms
            self.gemms["expert_bwd_gemms"] += by_pass["bwd_gemms"]
        if in_core:  # what selective recompute runs again
            self._add_core(meta, tp, makes_tensors, fwd_gemms)
        if node.op == "call_function" and meta.get("out_bytes"):
            peak = "peak_act_bytes_tp" if tp.divides else "peak_act_bytes"
            self.exprs[peak] = sympy.Max(self.exprs[peak], meta["out_bytes"])
        if tp.divides:
            for cost, tp_part in _FLOPS_AND_BYTES:
                self.exprs[tp_part] += meta[cost]
        self.exprs["saved_bytes"] += meta["saved_bytes"]
        self.exprs["saved_bytes_tp"] += tp.saved_bytes_tp
        self.exprs["saved_bytes_sp"] += tp.saved_bytes_sp
        if tp.sp:
            for cost, sp_part in _SP_BYTES:
                self.exprs[sp_part] += meta[cost]
        self._add_collectives(tp)

    def _add_gemms(self, meta: dict[str, Any], tp: Any) -> dict[str, list[tuple]]:
        """Append the node's GEMMs with the dim tp divides; return them by pass."""
        by_pass = {}
        for gemm_field, dims_field in _GEMM_DIMS:
            dims = getattr(tp, dims_field, None) or []
            by_pass[gemm_field] = [
                (g.m, g.n, g.k, g.batch, dims[i] if i < len(dims) else None)
                for i, g in enumerate(meta.get(gemm_field, ()))
            ]
            self.gemms[gemm_field] += by_pass[gemm_field]
        return by_pass

    def _add_core(self, meta: dict[str, Any], tp: Any, makes_tensors: bool, fwd_gemms: list[tuple]) -> None:
        """An attention-core node's forward, which selective recompute runs again."""
        for cost, core_total, core_tp in _CORE_FWD:
            self.exprs[core_total] += meta[cost]
            if tp.divides:
                self.exprs[core_tp] += meta[cost]
        if makes_tensors:
            self.ints["core_num_ops"] += 1
        self.gemms["core_gemms"] += fwd_gemms

    def _add_collectives(self, tp: Any) -> None:
        """The node's sequence- and tensor-parallel collectives."""
        for info_bytes, bytes_field, calls_field in _SP_COLLECTIVES:
            nbytes = getattr(tp, info_bytes)
            self.exprs[bytes_field] += nbytes
            self.ints[calls_field] += int(nbytes != 0)
        self.exprs["sp_grad_all_reduce_bytes"] += tp.sp_grad_all_reduce
        self.exprs["sp_split_bytes"] += tp.sp_split
        self.exprs["tp_allreduce_bytes"] += tp.allreduce_fwd
        self.exprs["tp_allreduce_bwd_bytes"] += tp.allreduce_bwd
        self.exprs["tp_loss_fwd_bytes"] += tp.loss_fwd_bytes
        self.exprs["tp_loss_bwd_bytes"] += tp.loss_bwd_bytes
        self.ints["tp_allreduce_calls"] += tp.fwd_calls
        self.ints["tp_allreduce_bwd_calls"] += int(tp.allreduce_bwd != 0)

    def add_split(self, names: _Split, parts: tuple[Any, Any, Any]) -> None:
        """Add ``(whole, tp part, sp part)`` to the three fields ``names`` gives."""
        for name, value in zip(names, parts):
            self.exprs[name] += value

    def write(self, row: LayerCosts) -> None:
        """Set the row's summed fields (expressions expanded, GEMMs merged)."""
        for name, expr in self.exprs.items():
            setattr(row, name, sympy.expand(expr))
        for name, count in self.ints.items():
            setattr(row, name, count)
        for name, calls in self.gemms.items():
            setattr(row, name, _merge_gemms(calls))


def _empty_rows(traced: TracedGraph, gm: fx.GraphModule) -> list[LayerCosts]:
    """One row per traced layer, with its name, kind and signature and no costs yet."""
    block_count = len(traced.block_paths)
    row_count = block_count + 2
    names = layer_names(gm, block_count, traced.block_paths, traced.container)
    signatures = layer_signatures(gm, block_count)
    return [
        LayerCosts(
            index=i,
            name=names[i],
            kind="pre" if i == 0 else ("post" if i == row_count - 1 else "block"),
            signature=signatures[i],
        )
        for i in range(row_count)
    ]


def _sum_nodes(gm: fx.GraphModule, sums: list[_RowSums]) -> None:
    """Add every node's costs to its layer's sums."""
    row_count = len(sums)
    core = _attention_cores(gm)
    for node in gm.graph.nodes:
        layer = node.meta["layer"]
        if not 0 <= layer < row_count:
            continue
        if node.op == "placeholder":
            sums[layer].add_placeholder(node.meta)
        else:
            sums[layer].add_op(node, node in core)
    for node in gm.graph.nodes:  # every layer that reads a weight computes a gradient of it
        if node.op == "placeholder" and "param_count" in node.meta:
            largest = "largest_param_tp" if node.meta["tp"].role == "sharded" else "largest_param"
            for layer in {user.meta.get("layer", -1) for user in node.users} | {node.meta["layer"]}:
                if 0 <= layer < row_count:
                    ints = sums[layer].ints
                    ints[largest] = max(ints[largest], int(node.meta["param_count"]))
    for layer, (freed, freed_tp) in _core_saved(gm, core, row_count).items():
        sums[layer].exprs["core_saved_bytes"] += freed
        sums[layer].exprs["core_saved_bytes_tp"] += freed_tp
    for names, per_layer in (
        (_TAIL_SAVED, tail_saved(gm, row_count)),
        (_FRONTIER_OUT, frontier_outputs(gm, row_count)),
    ):
        for layer, parts in per_layer.items():
            sums[layer].add_split(names, parts)


def _out_bytes(nodes: Iterable[fx.Node]) -> Any:
    """Summed ``out_bytes`` of ``nodes``."""
    return sum((node.meta["out_bytes"] for node in nodes), _ZERO)


def _sum_boundaries(gm: fx.GraphModule, rows: list[LayerCosts], sums: list[_RowSums]) -> None:
    """What each layer receives and sends on (whole, and the sequence-sharded part)."""
    for i, layer_io_nodes in enumerate(layer_io(gm, len(rows) - 2)):
        exprs = sums[i].exprs
        exprs["input_bytes"] = _out_bytes(layer_io_nodes.inputs)
        exprs["boundary_bytes"] = _out_bytes(layer_io_nodes.boundary)
        exprs["input_bytes_sp"] = _out_bytes(x for x in layer_io_nodes.inputs if _seq(x))
        exprs["boundary_bytes_sp"] = _out_bytes(x for x in layer_io_nodes.boundary if _seq(x))
        rows[i].boundary = [(tuple(x.meta["shape"]), dtype_name(x.meta["dtype"])) for x in layer_io_nodes.boundary]


def _graph_layer_costs(traced: TracedGraph, gm: fx.GraphModule) -> list[LayerCosts]:
    """Sum the analyzed graph's node costs per traced layer."""
    rows = _empty_rows(traced, gm)
    sums = [_RowSums() for _ in rows]
    _sum_nodes(gm, sums)
    _sum_boundaries(gm, rows, sums)
    for row, row_sums in zip(rows, sums):
        row_sums.write(row)
    return rows


def _write_moe(rows: list[LayerCosts], moe_layers: dict[int, MoeLayer]) -> None:
    """Each MoE row's routed-expert facts (``passes.moe``)."""
    for layer, facts in moe_layers.items():
        if not 0 <= layer < len(rows):
            continue
        row = rows[layer]
        row.experts, row.top_k, row.moe_layers = facts.experts, facts.top_k, facts.moe_layers
        row.shared_experts = facts.shared_experts
        row.expert_dispatch_bytes = sympy.expand(facts.dispatch_bytes)
        row.expert_tokens = sympy.sympify(facts.tokens)


def _seq(x: fx.Node) -> bool:
    """``x`` is sequence-sharded under sequence parallelism."""
    tp = x.meta.get("tp")
    return bool(tp is not None and tp.sp)


def _attention_cores(gm: fx.GraphModule) -> set[fx.Node]:
    """Every node of every attention core of ``gm`` (``passes.attention.attention_core``)."""
    annotate_attention(gm)
    return {x for n in gm.graph.nodes for x in attention_core(n)}


_VIEWS = {
    "view",
    "_unsafe_view",
    "reshape",
    "transpose",
    "permute",
    "unsqueeze",
    "squeeze",
    "expand",
    "slice",
    "select",
    "alias",
    "t",
    "unflatten",
    "flatten",
    "split",
    "getitem",
    "contiguous",
    "detach",
}
"""Ops whose output may share its input's storage (walked back to find what holds the bytes)."""
_SAVES_OPERANDS = {"matmul", "bmm", "mm", "baddbmm"} | SDPA


def _core_saved(gm: fx.GraphModule, core: set[fx.Node], n: int) -> dict[int, tuple[Any, Any]]:
    """Per layer, the activation bytes (all, and the tp-sharded part) recomputing the attention
    cores frees: what only core nodes save and a core node made (its output; for a fused SDPA
    kernel also its internals, the log-sum-exp), less the cores' inputs no node saves, which the
    checkpoint then keeps (an attention mask shared by the layers counts in each: an estimate
    that errs toward less freed). Internals of a decomposed product (a copy made to reshape an
    operand) are left out: the runtime's kernels make them only for operands that need it."""
    names = {x.name: x for x in core}
    savers: dict[tuple[int, Any], list] = {}
    saved_storages: set = set()
    for node in gm.graph.nodes:
        lay = node.meta.get("layer", -1)
        for rec in node.meta.get("saved", ()):
            savers.setdefault((lay, rec.key), []).append((node, rec))
            saved_storages.add(rec.producer)
    out: dict[int, list] = {}

    def charge(lay, nbytes, node, sign):
        acc = out.setdefault(lay, [_ZERO, _ZERO])
        tp = node.meta.get("tp")
        acc[0] += sign * nbytes
        if tp is not None and tp.divides:
            acc[1] += sign * nbytes

    for (lay, _), recs in savers.items():
        rec = recs[0][1]
        producer = names.get(rec.producer)
        if not 0 <= lay < n or producer is None or any(x not in core for x, _ in recs):
            continue
        fused = "attention" in producer.meta and producer.meta["attention"].pattern == "sdpa"
        # the producer's output (another node saves it too, or it has the output's size), not
        # an internal copy the producer made for itself
        output = (
            any(x is not producer for x, _ in recs)
            or sympy.expand(rec.nbytes - producer.meta.get("out_bytes", _ZERO)) == 0
        )
        if fused or output:
            charge(lay, rec.nbytes, producer, 1)
    for x in core:  # inputs nobody saves: the checkpoint keeps them
        lay = x.meta.get("layer", -1)
        if not 0 <= lay < n or op_name(x) in _SAVES_OPERANDS:
            continue  # a product's operands are saved by it without recompute too
        for a in x.all_input_nodes:
            chain = [a]
            while chain[-1].op == "call_function" and op_name(chain[-1]) in _VIEWS and chain[-1].all_input_nodes:
                chain.append(chain[-1].all_input_nodes[0])  # a view keeps its base's storage
            if a not in core and a.op == "call_function" and not any(c.name in saved_storages for c in chain):
                charge(lay, a.meta.get("out_bytes", _ZERO), x, -1)
                saved_storages.add(a.name)  # once per input
    return {lay: (v[0], v[1]) for lay, v in out.items()}


_POSITIONAL = ("index", "name", "boundary", "boundary_bytes", "input_bytes")
#: The parameters a row owns: equal for blocks of equal signatures, but where blocks share a
#: weight (Zamba's attention block, read by every hybrid layer) only the first reader owns it.
_OWNED = ("param_count", "param_count_tp", "param_bytes", "expert_param_count", "expert_param_count_tp")


def _share_identical_blocks(rows: list[LayerCosts]) -> list[LayerCosts]:
    """Blocks with equal signatures get the first one's costs (positional fields and the
    parameters each owns kept)."""
    first: dict[str, LayerCosts] = {}
    out = []
    for r in rows:
        if r.kind == "block" and r.signature in first:
            rep = first[r.signature]
            r = replace(rep, **{f: getattr(r, f) for f in (*_POSITIONAL, *_OWNED)})
        elif r.kind == "block":
            first[r.signature] = r
        out.append(r)
    return out


def block_sources(traced: TracedGraph) -> list[int]:
    """The traced block (0-based) standing for each of the model's ``L`` blocks: the trace's own
    mapping, or for a shallow trace of alike blocks the first for blocks 1..L-1 and the last for
    block L (its outgoing boundary is the one the head receives); each itself when every block
    was traced."""
    if traced.sources is not None:
        return list(traced.sources)
    if not traced.shallow:
        return list(range(traced.layers))
    return [0] * (traced.layers - 1) + [len(traced.block_paths) - 1]


def _expand(rows: list[LayerCosts], sources: list[int], container: str) -> list[LayerCosts]:
    """Replicate a shallow trace's blocks to L: block ``j`` of the model is traced block
    ``sources[j]`` (:func:`block_sources`)."""
    pre, blocks, post = rows[0], rows[1:-1], rows[-1]
    full_layers = len(sources)
    out = [replace(pre, index=0)]
    for j in range(full_layers):
        src = blocks[sources[j]]
        name = f"{container}.{j}" if container else src.name
        out.append(replace(src, index=j + 1, name=name))
    out.append(replace(post, index=full_layers + 1))
    return out


def table_from_traced(traced: TracedGraph, analyzed: bool = False) -> LayerTable:
    """Analyze a traced graph (unless ``analyzed``: the passes already ran on ``traced.gm``) and
    build its layer table."""
    gm = traced.gm if analyzed else analyze(traced)
    moe_layers, moe_reasons = annotate_moe(gm, traced.roles, traced.fqns)
    looped = replicated_reason(gm, bool(moe_layers) or bool(moe_reasons))
    rows = _graph_layer_costs(traced, gm)
    _write_moe(rows, moe_layers)
    tied = _tied_weights(traced, gm)
    if traced.shallow:
        last = len(rows) - 1  # traced rows -> full rows: the head moves, block 1 stands for 1..L-1
        full = {0: 0, last: traced.layers + 1, last - 1: traced.layers}
        for t in tied:
            t["layers"] = [full.get(i, i) for i in t["layers"]]
        rows = _expand(rows, block_sources(traced), traced.container)
    else:
        rows = _share_identical_blocks(rows)
    fixed = dict(traced.fixed)
    notes = list(traced.notes)
    if "b" in fixed and traced.dynamic:
        # The model pinned the batch size: scale activation costs linearly from the traced batch.
        b0 = fixed.pop("b")
        notes.append(f"batch size fixed at {b0} by the model; costs scaled linearly in b")
        for r in rows:
            for f in EXPR_FIELDS:
                setattr(r, f, sympy.expand(getattr(r, f) * B / b0))
            for f in GEMM_FIELDS:  # b / b0 times the traced products
                setattr(r, f, [g._replace(batch=sympy.expand(g.batch * B / b0)) for g in getattr(r, f)])
    model = dict(traced.model_info)
    notes += merge_graph_facts(gm, model)  # heads, kv_heads, head_dim, tp_blocked: from the graph
    attention = mask_facts(gm, block_sources(traced), model.get("attention_windows"))
    if attention:
        model["attention"] = attention
    moe = moe_summary(rows, moe_reasons + ([looped] if looped else []))
    if moe:
        model["moe"] = moe
    model["params"] = sum(r.param_count for r in rows)
    inputs = infer_inputs(gm, [n for n, r in traced.roles.items() if r == "input"], traced.symbols)
    model["inputs"] = [f.to_dict() for f in inputs]
    if not model.get("vocab"):  # a user's model: the vocabulary its token inputs index
        model["vocab"] = min(
            (f.vocab for f in inputs if f.role in ("tokens", "labels", "targets") and f.vocab), default=0
        )
    return LayerTable(layers=rows, dtype=dtype_name(traced.dtype), model=model, fixed=fixed, notes=notes, tied=tied)
