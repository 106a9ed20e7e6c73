"""Routed-expert regions of a mixture-of-experts graph: what expert parallelism cuts and moves.

transformers' MoE layers (Mixtral, Qwen2/3-MoE, DeepSeek-V3, GPT-OSS; ``integrations/moe.py``)
export their routed experts as one block of ATen ops per layer::

    topk(router scores, k) -> ids;  sort(ids.flatten()) -> (sorted ids, perm)
    rows    = x[perm // k]                       # each token copied once per chosen expert
    counts  = histc(sorted ids, E, 0, E - 1)     # tokens per expert
    offsets = cumsum(counts, 0)
    h = grouped_mm(rows, W1[E, ...], offsets)    # transformers::grouped_mm_fallback or
    h = act(h) ...                               #   aten::_grouped_mm
    y = grouped_mm(h, W2[E, ...], offsets)       # the last product
    ... y * routing weights, inverse permutation, sum over k

Expert parallelism keeps ``E / ep`` experts per rank and sends every row to the rank holding its
expert (all-to-all) before the first product, and back after the last. That is exact only if
everything between the first and the last product works row by row on the products' rows: each
row's result may depend on its own row and on the expert weights, never on another row nor on a
tensor laid out in the pre-dispatch order. One such tensor is allowed because it can be rebuilt
after the dispatch: an ``[E, ...]`` parameter gathered by the sorted expert ids (GPT-OSS adds a
per-expert bias ``b[sorted ids]`` after each product). The region lists those gathers
(``ExpertRegion.gathers``) and its parameters among the experts'; the rewrite gathers this rank's
slice by each dispatched row's local expert instead. ``find_expert_regions`` finds one
``ExpertRegion`` per grouped-product layer and checks exactly that; a region it cannot read or
that fails the check carries a ``reason`` (the planner then keeps that layer's experts
replicated and reports why). Code generation (``codegen.expert_rewrite``) rewrites the regions
whose ``reason`` is None.

The pass works on both forms of an export: the analysis graph (parameters are placeholders; pass
``roles`` and ``fqns`` from the trace) and the trainable ``ep.module()`` (parameters are
``get_attr`` nodes named by FQN). It reads only the graph and ``meta["val"]``; it writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx

from passes.op_class import op_name

__all__ = ["ExpertRegion", "find_expert_regions", "GROUPED_PRODUCTS", "is_grouped_product"]

GROUPED_PRODUCTS = {"grouped_mm_fallback", "_grouped_mm"}
"""Op names of a grouped expert product: ``(rows [S, K], weights [E, K, N], offsets [E])``."""

_WEIGHT_PATH = {"transpose", "permute", "to", "_to_copy", "view", "reshape", "contiguous", "clone", "alias", "t"}
"""Ops between an expert parameter ``[E, ...]`` and a product's weight operand (layout, dtype)."""
_CASTS = {"to", "_to_copy", "type_as", "clone", "contiguous", "alias"}
"""Ops that keep a tensor's values (walked through to find the ``cumsum`` / ``histc`` / ``topk``)."""
_ROW_WISE = {
    # elementwise (any operand broadcast from a parameter or a constant is fine: checked apart)
    "silu", "gelu", "relu", "sigmoid", "tanh", "exp", "neg", "abs", "sqrt", "rsqrt", "square",
    "mul", "mul_", "add", "add_", "sub", "sub_", "div", "div_", "pow", "clamp", "clamp_min", "clamp_max",
    "minimum", "maximum", "where", "erf", "softplus", "glu", "silu_", "gelu_", "relu_",
    # layout and dtype, along dims other than the rows (checked apart: dim 0 keeps its size)
    "to", "_to_copy", "type_as", "clone", "contiguous", "alias", "detach", "view", "reshape",
    "_unsafe_view", "unsqueeze", "squeeze", "chunk", "split", "split_with_sizes", "slice",
    "narrow", "cat", "getitem", "dropout", "native_dropout", "_assert_tensor_metadata",
}  # fmt: skip
"""Ops that may sit between two grouped products: each output row depends on its own row only
(when dim 0 keeps the rows' size, which the check also requires)."""


@dataclass
class ExpertRegion:
    """One MoE layer's routed experts as the graph computes them.

    ``reason`` is None when expert parallelism can cut the region; otherwise it says why not
    (and the layer keeps every expert on every rank). The node fields are those of the graph
    that was scanned; ``params`` are FQNs (``...mlp.experts.gate_up_proj``), in product order.
    """

    products: list[fx.Node]
    """The grouped products, in graph order (at least one)."""
    rows: fx.Node | None = None
    """The first product's row input ``[S, K]``: tokens sorted by expert, ``top_k`` per token."""
    counts: fx.Node | None = None
    """The ``histc`` node: tokens per expert ``[E]``."""
    offsets: fx.Node | None = None
    """The ``cumsum`` node the products read: cumulative tokens per expert ``[E]``."""
    params: list[str] = field(default_factory=list)
    """FQNs of the ``[E, ...]`` expert weights the products read (and of the parameters ``gathers``
    read: a per-expert bias is cut with its experts)."""
    param_nodes: list[fx.Node] = field(default_factory=list)
    """The placeholder / ``get_attr`` node of each of ``params``."""
    experts: int = 0
    """E: ``histc``'s bins, equal to every expert weight's first dim."""
    top_k: int | None = None
    """Experts per token, from the router's ``topk`` (None when it cannot be read)."""
    module: str = ""
    """The experts' module path (the FQN prefix their weights share)."""
    gathers: list[fx.Node] = field(default_factory=list)
    """``index(P, [sorted ids])`` nodes that feed the ops between the products: an ``[E, ...]``
    parameter ``P`` (GPT-OSS's expert bias) read per row by the rows' expert ids."""
    reason: str | None = None
    """Why the region cannot be expert-parallel; None when it can."""

    @property
    def parallel(self) -> bool:
        """Whether expert parallelism may cut this region."""
        return self.reason is None


def is_grouped_product(node: fx.Node) -> bool:
    """Whether ``node`` is a grouped expert product (transformers' fallback or ``aten._grouped_mm``)."""
    return node.op == "call_function" and op_name(node) in GROUPED_PRODUCTS


def find_expert_regions(
    gm: fx.GraphModule, *, roles: dict[str, str] | None = None, fqns: dict[str, str] | None = None
) -> list[ExpertRegion]:
    """Every routed-expert region of ``gm``, in graph order (one per set of grouped products
    sharing an ``offsets`` tensor: one per MoE layer).

    ``roles`` / ``fqns`` name the placeholders of an analysis graph (``TracedGraph.roles`` /
    ``.fqns``); without them a placeholder is a parameter, buffer or constant by export's name
    prefix (``p_``, ``b_``, ``c_``) and named by its node name.
    """
    state = _StateNodes(roles, fqns)
    groups: dict[object, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if is_grouped_product(node):
            offs = _offsets_arg(node)
            groups.setdefault(offs if offs is not None else node, []).append(node)
    return [_read_region(products, state) for products in groups.values()]


class _StateNodes:
    """Which nodes are model state (parameters, buffers, constants) and their FQNs."""

    def __init__(self, roles: dict[str, str] | None, fqns: dict[str, str] | None):
        self.roles, self.fqns = roles, fqns or {}

    def is_state(self, node: fx.Node) -> bool:
        if node.op == "get_attr":
            return True
        if node.op != "placeholder":
            return False
        if self.roles is not None:
            return self.roles.get(node.name) in ("param", "buffer", "constant")
        return node.name.startswith(("p_", "b_", "c_"))

    def fqn(self, node: fx.Node) -> str:
        if node.op == "get_attr":
            return str(node.target)
        return self.fqns.get(node.name, node.name)

    def is_const(self, node: fx.Node) -> bool:
        """State, or computed from state and nothing else (a transposed or cast weight)."""
        seen, stack = set(), [node]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n.op == "placeholder" and not self.is_state(n):
                return False
            stack.extend(n.all_input_nodes)
        return True


def _offsets_arg(product: fx.Node) -> fx.Node | None:
    offs = product.kwargs.get("offs", product.args[2] if len(product.args) > 2 else None)
    return offs if isinstance(offs, fx.Node) else None


def _through(node: fx.Node, ops: set[str]) -> fx.Node:
    """Walk back from ``node`` through single-input ``ops`` (first tensor argument)."""
    while node.op == "call_function" and op_name(node) in ops and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _read_region(products: list[fx.Node], state: _StateNodes) -> ExpertRegion:
    """Fill one region from its products, or say what could not be read."""
    region = ExpertRegion(products=products, rows=products[0].args[0] if products[0].args else None)  # type: ignore[arg-type]
    offsets = _offsets_arg(products[0])
    where = f"grouped product {products[0].name}"
    if offsets is None:
        region.reason = f"{where} has no offsets tensor (a batched product, not routed experts)"
        return region
    cumsum = _through(offsets, _CASTS)
    counts = _through(cumsum.args[0], _CASTS) if op_name(cumsum) == "cumsum" and cumsum.args else None  # type: ignore[arg-type]
    if counts is None or op_name(counts) != "histc":
        region.reason = f"{where}: its offsets ({offsets.name}) are not cumsum(histc(expert ids)): routing unreadable"
        return region
    region.offsets, region.counts = offsets, counts
    region.experts = int(counts.args[1]) if len(counts.args) > 1 else int(counts.kwargs.get("bins", 100))  # type: ignore[arg-type]
    region.top_k = _top_k(counts)
    region.reason = _read_params(region, state) or _check_between(region, state)
    return region


def _read_params(region: ExpertRegion, state: _StateNodes) -> str | None:
    """Each product's weight: an ``[E, ...]`` parameter reached through layout ops."""
    for product in region.products:
        weight = product.args[1] if len(product.args) > 1 else product.kwargs.get("mat_b")
        source = _through(weight, _WEIGHT_PATH) if isinstance(weight, fx.Node) else None
        if source is None or not state.is_state(source):
            return f"grouped product {product.name}: its weight is not an expert parameter (computed in the graph)"
        val = source.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() < 2 or int(val.shape[0]) != region.experts:
            shape = list(val.shape) if isinstance(val, torch.Tensor) else None
            return (
                f"grouped product {product.name}: weight {state.fqn(source)} of shape {shape} is not "
                f"[{region.experts}, ...] (one slice per expert counted by {region.counts.name})"  # type: ignore[union-attr]
            )
        if _offsets_arg(product) is not region.offsets:
            return f"grouped product {product.name} reads other offsets than {region.products[0].name}"
        if source not in region.param_nodes:
            region.param_nodes.append(source)
            region.params.append(state.fqn(source))
    prefix = region.params[0].rsplit(".", 1)[0] if "." in region.params[0] else ""
    region.module = prefix if all(p.startswith(prefix + ".") for p in region.params) else ""
    return None


def _top_k(counts: fx.Node) -> int | None:
    """``k`` of the router's ``topk`` whose ids ``histc`` counts (through the sort and flatten)."""
    node = counts.args[0] if counts.args else None
    for _ in range(12):
        if not isinstance(node, fx.Node) or node.op != "call_function":
            return None
        name = op_name(node)
        if name == "topk":
            k = node.args[1] if len(node.args) > 1 else node.kwargs.get("k")
            return int(k) if isinstance(k, int) else None
        if name not in _CASTS | {"getitem", "sort", "reshape", "view", "flatten", "_unsafe_view"}:
            return None
        node = node.args[0]
    return None


def _between(first: fx.Node, last: fx.Node) -> list[fx.Node]:
    """Nodes on a path from ``first`` to ``last`` (both excluded), in graph order."""
    after: set[fx.Node] = set()
    stack = list(first.users)
    while stack:
        n = stack.pop()
        if n not in after and n is not last:
            after.add(n)
            stack.extend(n.users)
    before: set[fx.Node] = set()
    stack = list(last.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in before and n in after:
            before.add(n)
            stack.extend(n.all_input_nodes)
    return [n for n in first.graph.nodes if n in before]


def _check_between(region: ExpertRegion, state: _StateNodes) -> str | None:
    """Everything between the first and the last product is row-wise on the products' rows."""
    products, rows = region.products, region.rows
    inside = set(_between(products[0], products[-1])) | set(products)
    n_rows = _rows_of(rows)
    for product in products[1:]:
        arg = product.args[0]
        if arg is not rows and arg not in inside:
            return f"grouped product {product.name} reads rows ({arg}) that are neither {rows} nor computed from the products"
    for node in _between(products[0], products[-1]):
        if is_grouped_product(node):
            continue
        name = op_name(node)
        if name not in _ROW_WISE:
            return f"{node.name} ({name}) between the expert products is not a row-wise op"
        for arg in node.all_input_nodes:
            if arg not in inside and arg is not rows and not state.is_const(arg):
                if _expert_gather(arg, region, state):
                    continue
                return (
                    f"{arg.name} feeds {node.name} between the expert products but is neither computed from "
                    f"them nor a parameter: a per-row tensor in the pre-dispatch order (e.g. a bias gathered "
                    f"by expert id) that expert parallelism would not move with its rows"
                )
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and (val.dim() == 0 or _rows_of(node) != n_rows):
            return f"{node.name} ({name}) between the expert products changes the row count"
    return None


def _expert_gather(node: fx.Node, region: ExpertRegion, state: _StateNodes) -> bool:
    """Whether ``node`` gathers an ``[E, ...]`` parameter by the rows' sorted expert ids (the ids
    ``histc`` counts); if so, it is recorded in ``region.gathers`` and its parameter among the
    experts'."""
    if node in region.gathers:
        return True
    if node.op != "call_function" or op_name(node) != "index" or len(node.args) < 2:
        return False
    source, indices = node.args[0], node.args[1]
    if not isinstance(source, fx.Node) or not state.is_state(source) or not isinstance(indices, (list, tuple)):
        return False
    if len(indices) != 1 or not isinstance(indices[0], fx.Node) or region.counts is None:
        return False
    val = source.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 1 or int(val.shape[0]) != region.experts:
        return False
    if _through(indices[0], _CASTS) is not _through(region.counts.args[0], _CASTS):  # type: ignore[arg-type]
        return False
    region.gathers.append(node)
    if source not in region.param_nodes:
        region.param_nodes.append(source)
        region.params.append(state.fqn(source))
    return True


def _rows_of(node: fx.Node | None) -> str | None:
    """Dim 0 of a node's value, as text (symbolic sizes compare without guards)."""
    val = node.meta.get("val") if node is not None else None
    return str(val.shape[0]) if isinstance(val, torch.Tensor) and val.dim() > 0 else None
