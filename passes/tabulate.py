"""From an analyzed graph to its layer table: node costs summed per layer.

``table_from_traced(traced)`` runs every pass (``passes.analyze``) over a traced graph
(``passes.graph.TracedGraph``, from ``planner.frontend.trace``) and sums node costs per layer
into a ``passes.layer_table.LayerTable``. Zoo models are traced with 2 blocks: the first traced
block stands for blocks 1..L-1 and the second for block L (only the last block's outgoing boundary
differs). Full traces (file factories) group blocks by signature and compute each group's costs
once. Weights read by several rows (a tied embedding and head) are recorded as ``tied``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import sympy
import torch.fx as fx

from passes.analyze import analyze
from passes.attention import SDPA, annotate_attention, attention_core
from passes.common import B, dtype_name, iter_tensors
from passes.graph import TracedGraph
from passes.inputs import infer_inputs
from passes.layer_table import EXPR_FIELDS, GEMM_FIELDS, INT_FIELDS, Gemm, LayerCosts, LayerTable
from passes.layers import layer_io, layer_names, layer_signatures
from passes.model_facts import merge_graph_facts
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


def _graph_layer_costs(traced, gm: fx.GraphModule) -> list[LayerCosts]:
    """Sum the analyzed graph's node costs per traced layer."""
    nb = len(traced.block_paths)
    n = nb + 2
    names = layer_names(gm, nb, traced.block_paths, traced.container)
    sigs = layer_signatures(gm, nb)
    rows = [
        LayerCosts(
            index=i, name=names[i], kind="pre" if i == 0 else ("post" if i == n - 1 else "block"), signature=sigs[i]
        )
        for i in range(n)
    ]
    acc: list[dict[str, Any]] = [{f: _ZERO for f in EXPR_FIELDS} for _ in range(n)]
    ints: list[dict[str, int]] = [{f: 0 for f in INT_FIELDS} for _ in range(n)]
    gemms: list[dict[str, list]] = [{f: [] for f in GEMM_FIELDS} for _ in range(n)]
    core = _attention_cores(gm)
    for node in gm.graph.nodes:
        lay = node.meta["layer"]
        if not 0 <= lay < n:
            continue
        m = node.meta
        tp = m["tp"]
        a = acc[lay]
        if node.op == "placeholder":
            if "param_count" in m:
                ints[lay]["param_count"] += m["param_count"]
                ints[lay]["param_bytes"] += m["param_bytes"]
                if tp.role == "sharded":
                    ints[lay]["param_count_tp"] += m["param_count"]
            elif "buffer_bytes" in m:
                ints[lay]["buffer_bytes"] += m["buffer_bytes"]
            a["sp_grad_all_reduce_bytes"] += tp.sp_grad_all_reduce
            continue
        if node.op == "call_function" and any(True for _ in iter_tensors(m.get("val"))):
            ints[lay]["num_ops"] += 1  # tensor ops only: shape arithmetic of a dynamic trace is free
        a["fwd_flops"] += m["fwd_flops"]
        a["bwd_flops"] += m["bwd_flops"]
        a["fwd_bytes"] += m["fwd_bytes"]
        a["bwd_bytes"] += m["bwd_bytes"]
        mine = {}
        for f in ("fwd_gemms", "bwd_gemms"):
            dims = getattr(tp, f[:3] + "_gemm_dims", None) or []
            mine[f] = [(g.m, g.n, g.k, g.batch, dims[i] if i < len(dims) else None) for i, g in enumerate(m.get(f, ()))]
            gemms[lay][f] += mine[f]
        if node in core:  # what selective recompute runs again
            a["core_fwd_flops"] += m["fwd_flops"]
            a["core_fwd_bytes"] += m["fwd_bytes"]
            if tp.divides:
                a["core_fwd_flops_tp"] += m["fwd_flops"]
                a["core_fwd_bytes_tp"] += m["fwd_bytes"]
            if any(True for _ in iter_tensors(m.get("val"))):
                ints[lay]["core_num_ops"] += 1
            gemms[lay]["core_gemms"] += mine["fwd_gemms"]
        if node.op == "call_function" and m.get("out_bytes"):
            key = "peak_act_bytes_tp" if tp.divides else "peak_act_bytes"
            a[key] = sympy.Max(a[key], m["out_bytes"])
        if tp.divides:
            a["fwd_flops_tp"] += m["fwd_flops"]
            a["bwd_flops_tp"] += m["bwd_flops"]
            a["fwd_bytes_tp"] += m["fwd_bytes"]
            a["bwd_bytes_tp"] += m["bwd_bytes"]
        a["saved_bytes"] += m["saved_bytes"]
        a["saved_bytes_tp"] += tp.saved_bytes_tp
        a["saved_bytes_sp"] += tp.saved_bytes_sp
        if tp.sp:
            a["fwd_bytes_sp"] += m["fwd_bytes"]
            a["bwd_bytes_sp"] += m["bwd_bytes"]
        a["sp_reduce_scatter_bytes"] += tp.sp_reduce_scatter
        a["sp_all_gather_bytes"] += tp.sp_all_gather
        a["sp_grad_all_reduce_bytes"] += tp.sp_grad_all_reduce
        a["sp_split_bytes"] += tp.sp_split
        ints[lay]["sp_reduce_scatter_calls"] += int(tp.sp_reduce_scatter != 0)
        ints[lay]["sp_all_gather_calls"] += int(tp.sp_all_gather != 0)
        a["tp_allreduce_bytes"] += tp.allreduce_fwd
        a["tp_allreduce_bwd_bytes"] += tp.allreduce_bwd
        a["tp_loss_fwd_bytes"] += tp.loss_fwd_bytes
        a["tp_loss_bwd_bytes"] += tp.loss_bwd_bytes
        ints[lay]["tp_allreduce_calls"] += tp.fwd_calls
        ints[lay]["tp_allreduce_bwd_calls"] += int(tp.allreduce_bwd != 0)
    for node in gm.graph.nodes:  # every layer that reads a weight computes a gradient of it
        if node.op == "placeholder" and "param_count" in node.meta:
            key = "largest_param_tp" if node.meta["tp"].role == "sharded" else "largest_param"
            for lay in {u.meta.get("layer", -1) for u in node.users} | {node.meta["layer"]}:
                if 0 <= lay < n:
                    ints[lay][key] = max(ints[lay][key], int(node.meta["param_count"]))
    for lay, (freed, freed_tp) in _core_saved(gm, core, n).items():
        acc[lay]["core_saved_bytes"] += freed
        acc[lay]["core_saved_bytes_tp"] += freed_tp
    for prefix, per_layer in (("tail_saved_bytes", tail_saved(gm, n)), ("frontier_out_bytes", frontier_outputs(gm, n))):
        for lay, parts in per_layer.items():
            for f, v in zip((prefix, prefix + "_tp", prefix + "_sp"), parts):
                acc[lay][f] += v
    for i, io in enumerate(layer_io(gm, nb)):
        acc[i]["input_bytes"] = sum((x.meta["out_bytes"] for x in io.inputs), _ZERO)
        acc[i]["boundary_bytes"] = sum((x.meta["out_bytes"] for x in io.boundary), _ZERO)
        acc[i]["input_bytes_sp"] = sum((x.meta["out_bytes"] for x in io.inputs if _seq(x)), _ZERO)
        acc[i]["boundary_bytes_sp"] = sum((x.meta["out_bytes"] for x in io.boundary if _seq(x)), _ZERO)
        rows[i].boundary = [(tuple(x.meta["shape"]), dtype_name(x.meta["dtype"])) for x in io.boundary]
    for i, row in enumerate(rows):
        for f, v in acc[i].items():
            setattr(row, f, sympy.expand(v))
        for f, v in ints[i].items():
            setattr(row, f, v)
        for f, v in gemms[i].items():
            setattr(row, f, _merge_gemms(v))
    return rows


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


def _share_identical_blocks(rows: list[LayerCosts]) -> list[LayerCosts]:
    """Blocks with equal signatures get the first one's costs (positional fields kept)."""
    first: dict[str, LayerCosts] = {}
    out = []
    for r in rows:
        if r.kind == "block" and r.signature in first:
            rep = first[r.signature]
            r = replace(rep, **{f: getattr(r, f) for f in _POSITIONAL})
        elif r.kind == "block":
            first[r.signature] = r
        out.append(r)
    return out


def _expand(rows: list[LayerCosts], full_layers: int, container: str) -> list[LayerCosts]:
    """Replicate a shallow trace's blocks to L: traced block 1 -> blocks 1..L-1, the last traced
    block -> block L (its outgoing boundary is the one the head receives)."""
    pre, blocks, post = rows[0], rows[1:-1], rows[-1]
    out = [replace(pre, index=0)]
    for j in range(full_layers):
        src = blocks[-1] if j == full_layers - 1 else blocks[0]
        name = f"{container}.{j}" if container else src.name
        out.append(replace(src, index=j + 1, name=name))
    out.append(replace(post, index=full_layers + 1))
    return out


def table_from_traced(traced: TracedGraph, analyzed: bool = False) -> LayerTable:
    """Analyze a traced graph (unless ``analyzed``: the passes already ran on ``traced.gm``) and
    build its layer table."""
    gm = traced.gm if analyzed else analyze(traced)
    rows = _graph_layer_costs(traced, gm)
    tied = _tied_weights(traced, gm)
    if traced.shallow:
        last = len(rows) - 1  # traced rows -> full rows: the head moves, block 1 stands for 1..L-1
        full = {0: 0, last: traced.layers + 1, last - 1: traced.layers}
        for t in tied:
            t["layers"] = [full.get(i, i) for i in t["layers"]]
        rows = _expand(rows, traced.layers, traced.container)
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
    model["params"] = sum(r.param_count for r in rows)
    inputs = infer_inputs(gm, [n for n, r in traced.roles.items() if r == "input"], traced.symbols)
    model["inputs"] = [f.to_dict() for f in inputs]
    if not model.get("vocab"):  # a user's model: the vocabulary its token inputs index
        model["vocab"] = min(
            (f.vocab for f in inputs if f.role in ("tokens", "labels", "targets") and f.vocab), default=0
        )
    return LayerTable(layers=rows, dtype=dtype_name(traced.dtype), model=model, fixed=fixed, notes=notes, tied=tied)
