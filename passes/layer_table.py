"""The layer table: per-layer costs, symbolic in micro-batch size ``b`` and sequence length ``s``.

This is the planner's input. Row 0 is everything before the first block (``pre``), rows 1..L are
the blocks, row L+1 everything after (``post``). Every cost is for one micro-batch of ``b``
sequences of length ``s``, the whole layer, tensor-parallel degree 1; the ``*_tp`` fields are the
parts of the same quantities that divide by tp under Megatron sharding (so per-device cost at
degree t is ``x - x_tp + x_tp / t``).

``passes.tabulate.table_from_traced(traced)`` builds it: every pass over a traced graph, node
costs summed per layer. This module is the schema only and imports no torch (``passes.core``
says why: a re-plan from the layer-table cache reads tables without tracing anything).

``LayerTable.numeric(b, s)`` substitutes numbers (one ``lambdify`` of the distinct expressions,
cached), ``to_json``/``from_json`` round-trip the table so a plan can be re-planned for another
batch or sequence length without tracing.

Besides the summed costs, each row lists the matrix products of its forward and backward by
shape (``fwd_gemms`` / ``bwd_gemms``, ``GEMM_FIELDS``): ``Gemm(m, n, k, batch, count, tp_dim)``,
``count`` identical products of ``batch`` ``m x k`` by ``k x n`` matrices, ``tp_dim`` the dim
tensor parallelism divides (``m``, ``n``, ``k``, ``batch``) or None (see
``passes.autograd_costs`` for what is listed, ``passes.tensor_parallel.tp_analysis.gemm_tp_dim`` for the dims).
Their FLOPs, ``2 m n k batch count`` summed, are the row's ``fwd_flops`` / ``bwd_flops`` but for
work the replay prices with no shape (convolutions...), and the ones with a ``tp_dim`` are the
matmul part of ``fwd_flops_tp`` / ``bwd_flops_tp``. ``cost_models.gemm_cost`` prices them by
shape. ``numeric`` gives them as tuples of ``Gemm`` with float sizes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

import sympy

from passes.compiled_table import check_fixed, evaluate_rows, row_shapes
from passes.core import B, PassError, S
from passes.table_fields import EXPR_FIELDS, GEMM_FIELDS, GEMM_TP_DIMS, INT_FIELDS, Gemm

__all__ = ["Gemm", "LayerCosts", "LayerTable", "EXPR_FIELDS", "INT_FIELDS", "GEMM_FIELDS", "GEMM_TP_DIMS"]

_ZERO = sympy.Integer(0)


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
    """Forward FLOPs (matmul-class work, FlopCounterMode convention; an attention core whose kernel
    skips its mask's dropped pairs at the mask's density, ``passes.mask_kind``)."""
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
    core_fwd_flops: sympy.Expr = _ZERO
    """Forward FLOPs of the layer's attention cores (``passes.attention.attention_core``: what
    selective recompute runs again in backward); 0 for a layer without attention."""
    core_fwd_flops_tp: sympy.Expr = _ZERO
    """The part of ``core_fwd_flops`` that divides by tp."""
    core_fwd_bytes: sympy.Expr = _ZERO
    """Memory-bound bytes of the attention cores' forward."""
    core_fwd_bytes_tp: sympy.Expr = _ZERO
    """The part of ``core_fwd_bytes`` that divides by tp."""
    core_saved_bytes: sympy.Expr = _ZERO
    """Of ``saved_bytes``, what only the attention cores keep (scores, probabilities, dropout
    masks, a fused kernel's output and log-sum-exp): what selective recompute frees. The cores'
    inputs (q, k, v, masks) stay saved."""
    core_saved_bytes_tp: sympy.Expr = _ZERO
    """The part of ``core_saved_bytes`` held in tp shards."""
    core_num_ops: int = 0
    """Operator calls of the attention cores' forward."""
    core_gemms: list = field(default_factory=list)
    """The attention cores' forward matrix products by shape, ``Gemm`` rows."""
    saved_bytes_sp: sympy.Expr = _ZERO
    """Of ``saved_bytes``, what sequence parallelism shards along the sequence (the replicated
    activations between the tensor-parallel regions: norms, residual adds, dropout); 0 when SP
    cannot apply to the model (``passes.tensor_parallel.tp_analysis``: ``sp_blocked``)."""
    fwd_bytes_sp: sympy.Expr = _ZERO
    """Of ``fwd_bytes``, what the ops on sequence shards move (divided by tp under SP)."""
    bwd_bytes_sp: sympy.Expr = _ZERO
    """The same for ``bwd_bytes``."""
    input_bytes_sp: sympy.Expr = _ZERO
    """Of ``input_bytes``, the sequence-sharded inputs."""
    boundary_bytes_sp: sympy.Expr = _ZERO
    """Of ``boundary_bytes``, the sequence-sharded values (a pipeline send of ``s / tp`` positions)."""
    sp_reduce_scatter_bytes: sympy.Expr = _ZERO
    """Bytes (whole tensors) SP reduce-scatters in one forward in place of all-reducing them
    (row-parallel outputs, the embedding); the backward all-gathers their gradients."""
    sp_all_gather_bytes: sympy.Expr = _ZERO
    """Bytes (whole tensors) SP all-gathers in one forward before column-parallel matmuls; the
    backward reduce-scatters their gradients in place of all-reducing them."""
    sp_grad_all_reduce_bytes: sympy.Expr = _ZERO
    """Gradient bytes of replicated weights used on sequence shards (norm weights, row-parallel
    biases), all-reduced over tp in each backward under SP."""
    sp_split_bytes: sympy.Expr = _ZERO
    """Bytes (whole tensors) of replicated full-length values each rank keeps its positions of under
    SP (a position embedding): their gradients are all-gathered in the backward."""
    tail_saved_bytes: sympy.Expr = _ZERO
    """Of ``saved_bytes``, what the nodes upstream of none of the layer's weight products keep (a
    language model's loss: the log-probabilities): a split backward (zero bubble) frees it at
    ``B`` when the layer ends its chunk (``passes.split_backward``)."""
    tail_saved_bytes_tp: sympy.Expr = _ZERO
    """The part of ``tail_saved_bytes`` held in tp shards."""
    tail_saved_bytes_sp: sympy.Expr = _ZERO
    """The part of ``tail_saved_bytes`` sequence parallelism shards."""
    frontier_out_bytes: sympy.Expr = _ZERO
    """Outputs of the layer's nodes that read a weight and an activation (products with a weight,
    norms): a split backward keeps their gradients from ``B`` to ``W`` (``passes.split_backward``)."""
    frontier_out_bytes_tp: sympy.Expr = _ZERO
    """The part of ``frontier_out_bytes`` held in tp shards (column-parallel outputs)."""
    frontier_out_bytes_sp: sympy.Expr = _ZERO
    """The part of ``frontier_out_bytes`` sequence parallelism shards."""
    sp_reduce_scatter_calls: int = 0
    """Reduce-scatters of one forward under SP."""
    sp_all_gather_calls: int = 0
    """All-gathers of one forward under SP."""
    expert_dispatch_bytes: sympy.Expr = _ZERO
    """Bytes of the token rows the row's mixture-of-experts layers route to their routed experts in
    one forward (``tokens x top_k x hidden x`` the activation's element size, summed over the
    layers): what one all-to-all dispatch moves in all, and one combine back (``passes.moe``)."""
    expert_tokens: sympy.Expr = _ZERO
    """Token rows each routed expert multiplies in one micro-batch with the tokens shared evenly
    (``b s top_k / experts``): the rows dim of the listed expert products (``expert_*_gemms``)."""
    expert_param_count: int = 0
    """Of ``param_count``, the routed experts' parameters (the ``[experts, ...]`` weights):
    what expert parallelism divides."""
    expert_param_count_tp: int = 0
    """Of ``expert_param_count``, the ones tensor parallelism shards."""
    experts: int = 0
    """Routed experts of each mixture-of-experts layer of the row (0: a dense row)."""
    top_k: int = 0
    """Routed experts each token goes to."""
    shared_experts: int = 0
    """Always-on expert MLPs of each mixture-of-experts layer (Qwen2-MoE's ``shared_expert``,
    DeepSeek's ``shared_experts``), priced as the dense work they are."""
    moe_layers: int = 0
    """Mixture-of-experts layers in the row (each a dispatch and a combine per pass)."""
    expert_fwd_gemms: list = field(default_factory=list)
    """Of ``fwd_gemms``, the routed experts' products (listed at the even share of tokens):
    expert parallelism re-prices them at the tokens each local expert gets (``cost_models.expert_cost``)."""
    expert_bwd_gemms: list = field(default_factory=list)
    """Of ``bwd_gemms``, the routed experts' products."""
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
            d[f] = [[str(g.m), str(g.n), str(g.k), str(g.batch), int(g.count), g.tp_dim] for g in getattr(self, f)]
        d["signature"] = self.signature
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LayerCosts":
        loc = {"b": B, "s": S}
        kw = {f: sympy.sympify(data[f], locals=loc) for f in EXPR_FIELDS if f in data}
        kw.update({f: int(data[f]) for f in INT_FIELDS if f in data})
        boundary = [(tuple(sympy.sympify(e, locals=loc) for e in shape), dt) for shape, dt in data.get("boundary", [])]
        for f in GEMM_FIELDS:  # absent in a table written before they existed: no shapes
            kw[f] = [
                Gemm._make([*(sympy.sympify(e, locals=loc) for e in g[:4]), int(g[4]), g[5]]) for g in data.get(f, [])
            ]
        return cls(
            index=int(data["index"]),
            name=data["name"],
            kind=data["kind"],
            boundary=boundary,
            signature=data.get("signature", ""),
            **kw,
        )


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
    """Tracing decisions worth reporting."""
    tied: list[dict[str, Any]] = field(default_factory=list)
    """Weights read by more than one row, ``{"weight": fqn, "layers": [first, last]}`` (a tied
    embedding and head: ``[0, L + 1]``). A pipeline cut between those rows puts a copy of the
    weight in each stage that reads it, their gradients summed (``cost_models.tied_cost``)."""

    def __post_init__(self) -> None:
        self._fn: tuple[Any, list] | None = None
        self._cache: dict[tuple[int, int], list[dict[str, float]]] = {}

    def __getstate__(self) -> dict[str, Any]:
        # the compiled function is generated code that pickle cannot find by name: compiled again
        return {**self.__dict__, "_fn": None}

    def _compile(self) -> tuple[Any, list]:
        """One ``lambdify`` of the table's distinct expressions, and where each field reads them."""
        uniq: dict[sympy.Expr, int] = {}
        index: list[tuple[list[int], dict[str, list]]] = []

        def slot(lay: LayerCosts, f: str, e: Any) -> int:
            stray = sympy.sympify(e).free_symbols - {self.b, self.s}
            if stray:  # a size the trace could not name (e.g. data-dependent), not b or s
                raise PassError(
                    "",
                    None,
                    (
                        f"Layer {lay.name!r}: its {f} depends on a size the trace could not relate to the batch or "
                        f"the sequence ({', '.join(sorted(map(str, stray)))}), so the planner cannot price it. "
                        "Make the model's shapes follow its inputs' sizes (no sizes read from tensor values)."
                    ),
                )
            return uniq.setdefault(e, len(uniq))

        for lay in self.layers:
            row = [slot(lay, f, getattr(lay, f)) for f in EXPR_FIELDS]
            gemms = {
                f: [(tuple(slot(lay, f, x) for x in g[:4]), g.count, g.tp_dim) for g in getattr(lay, f)]
                for f in GEMM_FIELDS
            }
            index.append((row, gemms))
        exprs = list(uniq)
        fn = sympy.lambdify((self.b, self.s), exprs, modules="math")
        self._fn = (fn, index)
        return self._fn

    def numeric(self, b: int, s: int) -> list[dict[str, Any]]:
        """Every field of every layer as numbers at micro-batch ``b``, sequence length ``s``
        (``GEMM_FIELDS``: tuples of ``Gemm`` with float sizes)."""
        check_fixed(self.fixed, b, s)
        key = (int(b), int(s))
        if key not in self._cache:
            fn, index = self._fn if self._fn is not None else self._compile()
            self._cache[key] = evaluate_rows(fn, index, self._integers(), *key)
        return [dict(row) for row in self._cache[key]]

    def shapes(self) -> list[int]:
        """Per layer, the number of its shape (``passes.compiled_table.row_shapes``): layers of one
        shape have equal numbers at every ``(b, s)``."""
        _fn, index = self._fn if self._fn is not None else self._compile()
        return row_shapes(index, self._integers())

    def numeric_at(self, b: int, s: int, positions: list[int]) -> list[dict[str, Any]]:
        """``numeric(b, s)`` of the layers at ``positions`` only."""
        check_fixed(self.fixed, b, s)
        fn, index = self._fn if self._fn is not None else self._compile()
        return evaluate_rows(fn, index, self._integers(), int(b), int(s), positions)

    def _integers(self) -> list[dict[str, int]]:
        return [{name: getattr(lay, name) for name in INT_FIELDS} for lay in self.layers]

    def nonzero_fields(self) -> frozenset[str]:
        """The ``EXPR_FIELDS`` that are not identically zero in some row (what a model has at
        all: ``saved_bytes_sp`` for sequence parallelism, ``expert_tokens`` for experts)."""
        return frozenset(name for name in EXPR_FIELDS if any(getattr(lay, name) != 0 for lay in self.layers))

    def total(self, field_name: str, b: int, s: int) -> float:
        """Sum of one field over all layers at (b, s)."""
        if field_name not in EXPR_FIELDS + INT_FIELDS:
            raise KeyError(f"unknown layer-table field {field_name!r}")
        self.numeric(b, s)
        return sum(row[field_name] for row in self._cache[(int(b), int(s))])

    def to_json(self) -> str:
        return json.dumps(
            {
                "schema_version": 1,
                "dtype": self.dtype,
                "model": self.model,
                "fixed": self.fixed,
                "notes": self.notes,
                "tied": self.tied,
                "layers": [lay.to_dict() for lay in self.layers],
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> "LayerTable":
        d = json.loads(text)
        return cls(
            layers=[LayerCosts.from_dict(x) for x in d["layers"]],
            dtype=d["dtype"],
            model=d.get("model", {}),
            fixed=d.get("fixed", {}),
            notes=d.get("notes", []),
            tied=d.get("tied", []),
        )


def _check_fields():  # keep EXPR_FIELDS/INT_FIELDS in step with the dataclass
    names = {f.name for f in fields(LayerCosts)}
    missing = [f for f in EXPR_FIELDS + INT_FIELDS + GEMM_FIELDS if f not in names]
    assert not missing, missing


_check_fields()
