"""The layer table: per-layer costs, symbolic in micro-batch size ``b`` and sequence length ``s``.

This is the planner's input. Row 0 is everything before the first block (``pre``), rows 1..L are
the blocks, row L+1 everything after (``post``). Every cost is for one micro-batch of ``b``
sequences of length ``s``, the whole layer, tensor-parallel degree 1; the ``*_tp`` fields are the
parts of the same quantities that divide by tp under Megatron sharding (so per-device cost at
degree t is ``x - x_tp + x_tp / t``).

``table_from_traced(traced)`` runs every pass (``passes.analyze``) over a traced graph
(``passes.graph.TracedGraph``, from ``planner.frontend.trace``) and sums node costs per layer. Zoo
models are traced with 2 blocks: the first traced block stands for blocks 1..L-1 and the second
for block L (only the last block's outgoing boundary differs). Full traces (file factories) group
blocks by signature and compute each group's costs once.

``LayerTable.numeric(b, s)`` substitutes numbers (one ``lambdify`` of the distinct expressions,
cached), ``to_json``/``from_json`` round-trip the table so a plan can be re-planned for another
batch or sequence length without tracing.

Besides the summed costs, each row lists the matrix products of its forward and backward by
shape (``fwd_gemms`` / ``bwd_gemms``, ``GEMM_FIELDS``): ``Gemm(m, n, k, batch, count, tp_dim)``,
``count`` identical products of ``batch`` ``m x k`` by ``k x n`` matrices, ``tp_dim`` the dim
tensor parallelism divides (``m``, ``n``, ``k``, ``batch``) or None (see
``passes.autograd_costs`` for what is listed, ``passes.tp_analysis.gemm_tp_dim`` for the dims).
Their FLOPs, ``2 m n k batch count`` summed, are the row's ``fwd_flops`` / ``bwd_flops`` but for
work the replay prices with no shape (convolutions...), and the ones with a ``tp_dim`` are the
matmul part of ``fwd_flops_tp`` / ``bwd_flops_tp``. ``cost_models.gemm_cost`` prices them by
shape. ``numeric`` gives them as tuples of ``Gemm`` with float sizes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from typing import Any, NamedTuple

import sympy
import torch.fx as fx

from passes.analyze import analyze
from passes.common import B, PassError, S, dtype_name, iter_tensors
from passes.graph import TracedGraph
from passes.inputs import infer_inputs
from passes.layers import layer_io, layer_names, layer_signatures
from passes.model_facts import merge_graph_facts

__all__ = ["Gemm", "LayerCosts", "LayerTable", "table_from_traced",
           "EXPR_FIELDS", "INT_FIELDS", "GEMM_FIELDS", "GEMM_TP_DIMS"]

EXPR_FIELDS = ("fwd_flops", "bwd_flops", "fwd_flops_tp", "bwd_flops_tp", "saved_bytes",
               "saved_bytes_tp", "input_bytes", "boundary_bytes", "tp_allreduce_bytes",
               "tp_allreduce_bwd_bytes", "fwd_bytes", "bwd_bytes", "fwd_bytes_tp", "bwd_bytes_tp",
               "peak_act_bytes", "peak_act_bytes_tp", "tp_loss_fwd_bytes", "tp_loss_bwd_bytes")
INT_FIELDS = ("param_count", "param_count_tp", "param_bytes", "buffer_bytes", "num_ops",
              "tp_allreduce_calls", "tp_allreduce_bwd_calls", "largest_param", "largest_param_tp")
GEMM_FIELDS = ("fwd_gemms", "bwd_gemms")
GEMM_TP_DIMS = (None, "m", "n", "k", "batch")
_ZERO = sympy.Integer(0)


class Gemm(NamedTuple):
    """``count`` identical products of ``batch`` ``m x k`` by ``k x n`` matrices in one pass of a
    layer (sympy sizes in ``b`` and ``s`` in the table, floats from ``LayerTable.numeric``)."""

    m: Any
    n: Any
    k: Any
    batch: Any
    count: int = 1
    tp_dim: str | None = None
    """The dim tensor parallelism divides (``m``, ``n``, ``k``, ``batch``), or None."""

    @property
    def flops(self) -> Any:
        """FLOPs of all ``count`` products at tp = 1: ``2 m n k batch count``."""
        return 2 * self.m * self.n * self.k * self.batch * self.count


def _merge_gemms(calls) -> list[Gemm]:
    """``(m, n, k, batch, tp_dim)`` tuples -> ``Gemm`` rows, identical ones merged by count (in
    order of first appearance)."""
    counts: dict[tuple, int] = {}
    for c in calls:
        counts[c] = counts.get(c, 0) + 1
    return [Gemm(m, n, k, batch, count, tp_dim) for (m, n, k, batch, tp_dim), count in counts.items()]


@dataclass
class LayerCosts:
    """Costs of one layer for one micro-batch (b sequences of length s) at tp = 1."""

    index: int
    """Row in the table: 0 = pre, 1..L = blocks, L+1 = post."""
    name: str
    """Module path (``embed``, ``blocks.3``, ``head``)."""
    kind: str
    """``pre`` | ``block`` | ``post``."""
    fwd_flops: sympy.Expr = _ZERO
    """Forward FLOPs (matmul-class work, FlopCounterMode convention)."""
    bwd_flops: sympy.Expr = _ZERO
    """Backward FLOPs (gradients of inputs and weights)."""
    fwd_flops_tp: sympy.Expr = _ZERO
    """The part of ``fwd_flops`` that divides by tp."""
    bwd_flops_tp: sympy.Expr = _ZERO
    """The part of ``bwd_flops`` that divides by tp."""
    fwd_bytes: sympy.Expr = _ZERO
    """Bytes read + written by the forward's memory-bound ops (everything but matmul-class
    work and views): the bandwidth term of the roofline."""
    bwd_bytes: sympy.Expr = _ZERO
    """Bytes read + written by the backward's memory-bound ops."""
    fwd_bytes_tp: sympy.Expr = _ZERO
    """The part of ``fwd_bytes`` that divides by tp (ops on sharded activations)."""
    bwd_bytes_tp: sympy.Expr = _ZERO
    """The part of ``bwd_bytes`` that divides by tp."""
    peak_act_bytes: sympy.Expr = _ZERO
    """Largest single activation the layer's forward makes that tp does not shard (a ``Max``
    of polynomials): its gradient, and the gradient computed from it, are what the layer's
    backward holds at once on top of the saved activations (``cost_models.memory``)."""
    peak_act_bytes_tp: sympy.Expr = _ZERO
    """Largest single activation held in tp shards (its full size; per device divide by tp)."""
    tp_loss_fwd_bytes: sympy.Expr = _ZERO
    """What the forward's memory-bound bytes change by when tp > 1 and the runtime's
    vocab-parallel cross-entropy replaces the traced loss (full size: per device divide by tp;
    may be negative)."""
    tp_loss_bwd_bytes: sympy.Expr = _ZERO
    """The same for the backward."""
    saved_bytes: sympy.Expr = _ZERO
    """Activations autograd keeps for backward (each storage once per layer; no weights)."""
    saved_bytes_tp: sympy.Expr = _ZERO
    """The part of ``saved_bytes`` held in tp shards."""
    input_bytes: sympy.Expr = _ZERO
    """What the layer receives (kept instead of ``saved_bytes`` when the layer recomputes)."""
    boundary_bytes: sympy.Expr = _ZERO
    """What crosses the cut after this layer (pipeline send size); 0 for the last row."""
    boundary: list = field(default_factory=list)
    """The tensors crossing that cut: ``[(shape exprs, dtype name), ...]``."""
    tp_allreduce_bytes: sympy.Expr = _ZERO
    """Bytes all-reduced over tp per forward (row-parallel outputs, vocab-parallel embedding
    and loss); summed over the model the backward all-reduces the same amount."""
    tp_allreduce_bwd_bytes: sympy.Expr = _ZERO
    """Bytes all-reduced over tp in this layer's backward (inputs of column-parallel matmuls)."""
    param_count: int = 0
    """Parameters owned by the layer (a tied weight belongs to its first user's layer)."""
    param_count_tp: int = 0
    """Of those, the ones sharded by tp."""
    param_bytes: int = 0
    """Bytes of those parameters in the traced dtype."""
    buffer_bytes: int = 0
    """Bytes of buffers and lifted constants."""
    num_ops: int = 0
    """Operator calls in the layer's forward (each costs a fixed dispatch overhead)."""
    tp_allreduce_calls: int = 0
    """All-reduces over tp in one forward (each a point where the tp ranks wait for each other)."""
    tp_allreduce_bwd_calls: int = 0
    """All-reduces over tp in one backward."""
    largest_param: int = 0
    """Elements of the largest weight tp does not shard that the layer reads (a tied weight
    counts in every layer that reads it): backward creates its gradient afresh before adding it
    to the gradient buffer, a transient of that size (``cost_models.memory``)."""
    largest_param_tp: int = 0
    """Likewise, of the largest weight tp shards (whole; a device holds ``1 / tp`` of it)."""
    fwd_gemms: list = field(default_factory=list)
    """The forward's matrix products by shape, ``Gemm`` rows (module doc)."""
    bwd_gemms: list = field(default_factory=list)
    """The backward's matrix products by shape, ``Gemm`` rows."""
    signature: str = ""
    """Digest of the layer's ops, shapes and weights: identical blocks share it."""

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"index": self.index, "name": self.name, "kind": self.kind}
        for f in EXPR_FIELDS:
            d[f] = str(getattr(self, f))
        for f in INT_FIELDS:
            d[f] = int(getattr(self, f))
        d["boundary"] = [[[str(e) for e in shape], dt] for shape, dt in self.boundary]
        for f in GEMM_FIELDS:
            d[f] = [[str(g.m), str(g.n), str(g.k), str(g.batch), int(g.count), g.tp_dim]
                    for g in getattr(self, f)]
        d["signature"] = self.signature
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LayerCosts":
        loc = {"b": B, "s": S}
        kw = {f: sympy.sympify(d[f], locals=loc) for f in EXPR_FIELDS if f in d}
        kw.update({f: int(d[f]) for f in INT_FIELDS if f in d})
        boundary = [(tuple(sympy.sympify(e, locals=loc) for e in shape), dt)
                    for shape, dt in d.get("boundary", [])]
        for f in GEMM_FIELDS:  # absent in a table written before they existed: no shapes
            kw[f] = [Gemm(*(sympy.sympify(e, locals=loc) for e in g[:4]), int(g[4]), g[5])
                     for g in d.get(f, [])]
        return cls(index=int(d["index"]), name=d["name"], kind=d["kind"], boundary=boundary,
                   signature=d.get("signature", ""), **kw)


@dataclass
class LayerTable:
    """Per-layer costs of one model; numbers come from ``numeric(b, s)``."""

    layers: list[LayerCosts]
    """Rows 0..L+1 (pre, blocks, post)."""
    b: sympy.Symbol = B
    """Symbol of the micro-batch size in every expression."""
    s: sympy.Symbol = S
    """Symbol of the sequence length in every expression."""
    dtype: str = "float32"
    """Parameter/activation dtype the costs were traced in."""
    model: dict[str, Any] = field(default_factory=dict)
    """spec, params, layers, hidden, heads, kv_heads, vocab (plus seq_len, sizes)."""
    fixed: dict[str, int] = field(default_factory=dict)
    """Dimensions that are not symbolic (the model forced them): ``{'s': 128}``."""
    notes: list[str] = field(default_factory=list)
    tied: list[dict[str, Any]] = field(default_factory=list)
    """Weights read by more than one row, ``{"weight": fqn, "layers": [first, last]}`` (a tied
    embedding and head: ``[0, L + 1]``). A pipeline cut between those rows would need the weight
    in two stages, which the runtime does not do; the planner keeps such rows in one stage."""
    """Tracing decisions worth reporting."""

    def __post_init__(self):
        self._fn = None
        self._cache: dict[tuple[int, int], list[dict[str, float]]] = {}

    def _compile(self):
        uniq: dict[sympy.Expr, int] = {}
        index = []

        def slot(lay: LayerCosts, f: str, e: Any) -> int:
            stray = sympy.sympify(e).free_symbols - {self.b, self.s}
            if stray:  # a size the trace could not name (e.g. data-dependent), not b or s
                raise PassError("", None, (
                    f"Layer {lay.name!r}: its {f} depends on a size the trace could not relate to the batch or "
                    f"the sequence ({', '.join(sorted(map(str, stray)))}), so the planner cannot price it. "
                    "Make the model's shapes follow its inputs' sizes (no sizes read from tensor values)."))
            return uniq.setdefault(e, len(uniq))

        for lay in self.layers:
            row = [slot(lay, f, getattr(lay, f)) for f in EXPR_FIELDS]
            gemms = {f: [(tuple(slot(lay, f, x) for x in g[:4]), g.count, g.tp_dim) for g in getattr(lay, f)]
                     for f in GEMM_FIELDS}
            index.append((row, gemms))
        exprs = list(uniq)
        fn = sympy.lambdify((self.b, self.s), exprs, modules="math")
        self._fn = (fn, index)

    def numeric(self, b: int, s: int) -> list[dict[str, Any]]:
        """Every field of every layer as numbers at micro-batch ``b``, sequence length ``s``
        (``GEMM_FIELDS``: tuples of ``Gemm`` with float sizes)."""
        for name, v in (("s", s), ("b", b)):
            if name in self.fixed and int(v) != self.fixed[name]:
                what = "sequence length" if name == "s" else "micro-batch size"
                raise PassError("", None, f"This model's costs were traced at a fixed {what} "
                                f"{self.fixed[name]}; re-trace at {v} (the model or the trace "
                                f"pinned it), or make the model shape-generic.")
        key = (int(b), int(s))
        if key in self._cache:
            return [dict(row) for row in self._cache[key]]
        if self._fn is None:
            self._compile()
        fn, index = self._fn
        vals = [float(v) for v in fn(*key)]
        out = []
        for lay, (row, gemms) in zip(self.layers, index):
            d: dict[str, Any] = {f: vals[i] for f, i in zip(EXPR_FIELDS, row)}
            d.update({f: float(getattr(lay, f)) for f in INT_FIELDS})
            for f, entries in gemms.items():
                d[f] = tuple(Gemm(*(vals[i] for i in dims), count, tp_dim) for dims, count, tp_dim in entries)
            out.append(d)
        self._cache[key] = out
        return [dict(row) for row in out]

    def total(self, field_name: str, b: int, s: int) -> float:
        """Sum of one field over all layers at (b, s)."""
        if field_name not in EXPR_FIELDS + INT_FIELDS:
            raise KeyError(f"unknown layer-table field {field_name!r}")
        self.numeric(b, s)
        return sum(row[field_name] for row in self._cache[(int(b), int(s))])

    def to_json(self) -> str:
        return json.dumps({"schema_version": 1, "dtype": self.dtype, "model": self.model,
                           "fixed": self.fixed, "notes": self.notes, "tied": self.tied,
                           "layers": [lay.to_dict() for lay in self.layers]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "LayerTable":
        d = json.loads(text)
        return cls(layers=[LayerCosts.from_dict(x) for x in d["layers"]], dtype=d["dtype"],
                   model=d.get("model", {}), fixed=d.get("fixed", {}), notes=d.get("notes", []),
                   tied=d.get("tied", []))


# --------------------------------------------------------------------------------------------


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
        rows.setdefault(canon, set()).update(
            u.meta["layer"] for u in node.users if 0 <= u.meta.get("layer", -1) < n)
        if "param_count" in node.meta:
            count = int(node.meta["param_count"])
            tp = node.meta.get("tp")
            sizes[canon] = (count, count if tp is not None and tp.role == "sharded" else 0)
    return [{"weight": traced.fqns.get(name, name), "layers": [min(ls), max(ls)],
             "params": sizes.get(name, (0, 0))[0], "params_tp": sizes.get(name, (0, 0))[1]}
            for name, ls in rows.items() if len(ls) > 1]


def _graph_layer_costs(traced, gm: fx.GraphModule) -> list[LayerCosts]:
    """Sum the analyzed graph's node costs per traced layer."""
    nb = len(traced.block_paths)
    n = nb + 2
    names = layer_names(gm, nb, traced.block_paths, traced.container)
    sigs = layer_signatures(gm, nb)
    rows = [LayerCosts(index=i, name=names[i],
                       kind="pre" if i == 0 else ("post" if i == n - 1 else "block"),
                       signature=sigs[i]) for i in range(n)]
    acc: list[dict[str, Any]] = [{f: _ZERO for f in EXPR_FIELDS} for _ in range(n)]
    ints: list[dict[str, int]] = [{f: 0 for f in INT_FIELDS} for _ in range(n)]
    gemms: list[dict[str, list]] = [{f: [] for f in GEMM_FIELDS} for _ in range(n)]
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
            continue
        if node.op == "call_function" and any(True for _ in iter_tensors(m.get("val"))):
            ints[lay]["num_ops"] += 1  # tensor ops only: shape arithmetic of a dynamic trace is free
        a["fwd_flops"] += m["fwd_flops"]
        a["bwd_flops"] += m["bwd_flops"]
        a["fwd_bytes"] += m["fwd_bytes"]
        a["bwd_bytes"] += m["bwd_bytes"]
        for f in GEMM_FIELDS:
            dims = getattr(tp, f[:3] + "_gemm_dims", None) or []
            gemms[lay][f] += [(g.m, g.n, g.k, g.batch, dims[i] if i < len(dims) else None)
                              for i, g in enumerate(m.get(f, ()))]
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
    for i, io in enumerate(layer_io(gm, nb)):
        acc[i]["input_bytes"] = sum((x.meta["out_bytes"] for x in io.inputs), _ZERO)
        acc[i]["boundary_bytes"] = sum((x.meta["out_bytes"] for x in io.boundary), _ZERO)
        rows[i].boundary = [(tuple(x.meta["shape"]), dtype_name(x.meta["dtype"]))
                            for x in io.boundary]
    for i, row in enumerate(rows):
        for f, v in acc[i].items():
            setattr(row, f, sympy.expand(v))
        for f, v in ints[i].items():
            setattr(row, f, v)
        for f, v in gemms[i].items():
            setattr(row, f, _merge_gemms(v))
    return rows


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
        model["vocab"] = min((f.vocab for f in inputs if f.role in ("tokens", "labels", "targets") and f.vocab),
                             default=0)
    return LayerTable(layers=rows, dtype=dtype_name(traced.dtype), model=model, fixed=fixed,
                      notes=notes, tied=tied)


def _check_fields():  # keep EXPR_FIELDS/INT_FIELDS in step with the dataclass
    names = {f.name for f in fields(LayerCosts)}
    missing = [f for f in EXPR_FIELDS + INT_FIELDS + GEMM_FIELDS if f not in names]
    assert not missing, missing


_check_fields()
