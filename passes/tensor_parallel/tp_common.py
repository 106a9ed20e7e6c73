"""The vocabulary the tensor-parallel analysis and its sequence-parallel walk share: the op
tables, the states of a value (``Shard``, ``SeqShard``), the decisions (``TPDecisions``, with
``WeightShard`` and ``SeqComm``), ``TPConflict``, and the shape helpers that follow a sharded dim
through views, transposes and reshapes. The rules are in ``passes.tensor_parallel.tp_analysis`` (tensor
parallelism) and ``passes.tensor_parallel.sp_analysis`` (sequence parallelism).

GEMM dims
---------
A node whose work divides runs products of smaller shapes, and a GPU's efficiency depends on
which dim shrank. ``gemm_tp_dim`` names it for each matrix product the cost replay recorded
(``passes.autograd_costs.GemmCall``, ``batch`` products of ``m x k`` by ``k x n``). A weighted
matmul's factors are the activation ``x`` (rows x in features), the weight ``w`` (in x out) and
the output gradient ``g`` (rows x out); a product's ``k`` is the dim its two factors share,
``m`` and ``n`` the others. Column parallel divides the *out* features, row parallel the *in*
features, wherever autograd put them::

    product              factors    column parallel    row parallel
    forward  y = x w     (x, w)     n                  k
    input grad  g wᵀ     (g, w)     k                  n
    weight grad  xᵀ g    (x, g)     n                  m
    (either backward product transposed, gᵀ x or w gᵀ: the same dims read in the other order)

Attention's products (SDPA's, or an eager ``q @ kᵀ`` / ``p @ v`` sharded by heads) divide their
``batch`` (b x heads). A product of a node that does not divide keeps its whole shape (None).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import fx

from passes.common import has_tensor, hint
from passes.op_class import op_name

__all__ = [
    "ACT_MATMULS",
    "ATTENTION",
    "CATS",
    "dims_of",
    "flat_args",
    "gemm_tp_dim",
    "is_tensor_node",
    "LAYOUT",
    "LOSSES",
    "matmul_operands",
    "moved_dim",
    "node_arg",
    "norm_dim",
    "NORMS",
    "PASSTHROUGH",
    "reads_data",
    "REDUCTIONS",
    "reshape_dim",
    "reshape_groups",
    "SCANS",
    "SeqComm",
    "SeqShard",
    "shape_of",
    "Shard",
    "SLICES",
    "slice_bounds",
    "SOFTMAX",
    "SPLITS",
    "states_of",
    "TPConflict",
    "TPDecisions",
    "value_of",
    "VIEWS",
    "WEIGHT_VIEWS",
    "WEIGHTED_MATMULS",
    "WeightShard",
]

WEIGHTED_MATMULS = {"linear", "addmm", "mm", "matmul"}
"""Ops that may multiply by a parameter weight (column / row parallel)."""
PASSTHROUGH = {
    "dropout",
    "native_dropout",
    "to",
    "_to_copy",
    "contiguous",
    "alias",
    "detach",
    "clone",
    "type_as",
    "lift_fresh_copy",
}
"""Ops whose outputs have their first input's sharding (other tensor args give only a dtype)."""
VIEWS = {"view", "_unsafe_view", "reshape", "flatten", "unflatten"}
"""Reshapes: the sharded dim follows ``reshape_dim``; size arguments are per-rank in codegen."""
LAYOUT = {"t", "numpy_T", "transpose", "permute", "unsqueeze", "squeeze"}
WEIGHT_VIEWS = {"t", "numpy_T", "transpose", "permute"}
"""Transposes of a 2-d parameter that a weighted matmul may read instead of the parameter
(Falcon's ``x @ W.T``): the matmul is column / row parallel on the parameter itself."""
SLICES = {"slice", "select", "narrow"}
SPLITS = {"split", "split_with_sizes", "chunk", "unbind"}
CATS = {"cat", "stack"}
ACT_MATMULS = {"matmul", "bmm"}
ATTENTION = {
    "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
}
NORMS = {"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm"}
SOFTMAX = {"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"}
REDUCTIONS = {
    "sum",
    "mean",
    "amax",
    "amin",
    "max",
    "min",
    "argmax",
    "argmin",
    "var",
    "std",
    "var_mean",
    "std_mean",
    "logsumexp",
    "prod",
    "all",
    "any",
    "norm",
    "linalg_vector_norm",
}
SCANS = {"cumsum", "cumprod", "logcumsumexp", "cummax", "cummin", "flip", "roll"}
LOSSES = {"cross_entropy_loss"}


@dataclass(frozen=True)
class Shard:
    """A value sharded along ``dim``, whose full size there is ``size``."""

    dim: int
    size: int
    origins: frozenset = frozenset()
    """Names of the column-parallel matmuls that started this region."""

    def at(self, dim: int) -> Shard:
        """The same shard, now along ``dim`` (after a transpose, unsqueeze ...)."""
        return Shard(dim, self.size, self.origins)


@dataclass(frozen=True)
class WeightShard:
    """How a parameter is sharded: the tp-free part of ``runtime.tensor_parallel.sharding.TensorShard``."""

    kind: str
    """``column``, ``row``, ``heads``, ``vocab`` or ``qkv``."""
    dim: int
    size: int
    parts: tuple[int, ...] | None = None
    """``qkv`` only: the sizes of the fused parts along ``dim``."""


@dataclass(frozen=True)
class SeqShard:
    """Under sequence parallelism, a value of which each rank holds its positions: the block
    ``[r * S/t, (r + 1) * S/t)`` of dim ``dim`` (``S``: ``TPDecisions.sp_seq_len``)."""

    dim: int
    origins: frozenset = frozenset()
    """Names of the sources (row-parallel matmuls, the token embedding) that started it."""

    def at(self, dim: int) -> SeqShard:
        return SeqShard(dim, self.origins)


@dataclass(frozen=True)
class SeqComm:
    """One collective sequence parallelism adds or changes; sizes are of the full tensor."""

    kind: str
    """``reduce_scatter``: a source's output, in place of the forward all-reduce (backward: an
    all-gather of the gradient). ``all_gather``: a sequence shard entering column-parallel
    matmuls, in place of ``copy_to_tp`` (backward: a reduce-scatter of the gradient, in place of
    the all-reduce). ``split``: a replicated full-length tensor meeting sequence shards (a position
    embedding): no forward communication, its gradient all-gathered backward if ``grad``.
    ``grad_all_reduce``: a replicated tensor requiring grad (a norm weight, a row-parallel bias)
    used on sequence shards: its gradient is all-reduced backward (``copy_to_tp``)."""
    value: str
    """The node whose tensor is communicated (the gathered, scattered, split or reduced value)."""
    dim: int | None
    """Its sequence dim (None for ``grad_all_reduce``)."""
    nbytes: Any
    """Bytes of the whole tensor: ``meta['out_bytes']`` (symbolic in ``b``, ``s``) where the
    shapes pass wrote it, else the bytes of ``meta['val']``."""
    users: tuple = ()
    """The nodes that read it through this collective (``all_gather``: the column-parallel
    matmuls, one gather for all of them)."""
    grad: bool = True
    """Whether the value carries a gradient (the backward collective happens)."""


class TPConflict(Exception):
    """A sharded region reached an op it cannot pass; ``origins`` started that region."""

    def __init__(self, origins: frozenset, node: fx.Node, why: str):
        super().__init__(why)
        self.origins, self.node, self.why = origins, node, why


@dataclass
class TPDecisions:
    """What tensor parallelism does to each node of a graph (see the module doc)."""

    state: dict = field(default_factory=dict)
    """Node -> ``Shard`` | None (replicated) | list of those (multi-output ops)."""
    role: dict = field(default_factory=dict)
    """Node -> col | row | vocab_embedding | vocab_loss | sharded | replicated."""
    params: dict = field(default_factory=dict)
    """Parameter node -> its key (placeholder name, or ``get_attr`` target: the FQN)."""
    weights: dict = field(default_factory=dict)
    """Parameter key -> ``WeightShard`` for every sharded parameter."""
    shards_params: dict = field(default_factory=dict)
    """Node -> keys of the parameters it reads sharded (a matmul's weight and bias ...)."""
    enter: dict = field(default_factory=dict)
    """Node -> argument paths ``(position or kwarg, index in a list or None)`` of the replicated
    tensors requiring grad that enter this sharded op."""
    scatter: dict = field(default_factory=dict)
    """Attention node -> ``[(argument path, dim)]``: replicated k / v with every query head
    (key/value heads repeated for grouped-query attention after their projections were kept
    replicated) of which each rank keeps its query heads' share (``scatter_to_tp``)."""
    replicated: dict = field(default_factory=dict)
    """Name of a matmul / embedding kept replicated -> the ``TPConflict`` that forced it."""
    partial: dict = field(default_factory=dict)
    """Sum or mean over the whole sharded dim (OLMo 2's norm over all query features) -> that
    dim's full size: each rank reduces its shard, the partial sums are all-reduced
    (``reduce_from_tp``), a mean divides by the full size; role ``partial``, output replicated."""
    vocab: int | None = None
    """The vocabulary the analysis used (given, or the rows of the token embedding)."""
    # ---- sequence parallelism (module doc, "Sequence parallelism"); never changes the fields above
    sp_seq_len: int | None = None
    """``S``, the sequence length SP splits (the last dim of the token ids); None if unknown."""
    sp_sharded: dict = field(default_factory=dict)
    """Node name -> its sequence dim (a list with None entries for multi-output ops) for every
    value sequence-sharded under SP: each rank holds ``S/t`` positions of it."""
    sp_comms: list = field(default_factory=list)
    """Every ``SeqComm`` of SP, in graph order: what the cost pass prices."""
    sp_args: dict = field(default_factory=dict)
    """Node name -> ``[(argument path, action, dim)]``, what codegen does to an argument:
    ``gather`` (``all_gather_seq``), ``split`` (``scatter_to_tp``) or ``copy`` (``copy_to_tp``)."""
    sp_replicated: dict = field(default_factory=dict)
    """Name of a row-parallel matmul / vocabulary embedding that keeps its all-reduce under SP ->
    the ``TPConflict`` that forced it (or why its output is not laid out by token)."""
    sp_blocked: str | None = None
    """Why SP cannot apply to this graph (it would shard nothing), naming the node; None if it can."""


def value_of(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def shape_of(n) -> list[int]:
    val = value_of(n)
    return [hint(size) for size in val.shape] if isinstance(val, torch.Tensor) else []


def is_tensor_node(n) -> bool:
    return isinstance(n, fx.Node) and isinstance(value_of(n), torch.Tensor)


def node_arg(n: fx.Node, name: str, default=None):
    """Argument ``name`` of an ATen op node, given positionally or by keyword."""
    schema = getattr(n.target, "_schema", None)
    for i, schema_arg in enumerate(schema.arguments if schema is not None else ()):
        if schema_arg.name == name and i < len(n.args):
            return n.args[i]
    return n.kwargs.get(name, default)


def matmul_operands(n: fx.Node) -> tuple:
    """``(activation, weight, bias)`` of a ``WEIGHTED_MATMULS`` node (bias None if absent)."""
    name, args = op_name(n), n.args
    if name == "linear":
        return args[0], args[1], node_arg(n, "bias")
    if name == "addmm":
        return args[1], args[2], args[0]
    return args[0], args[1], None


_FACTOR_DIMS = {"x": ("rows", "in"), "w": ("in", "out"), "g": ("rows", "out")}
"""The two logical dims of a weighted matmul's factors (see "GEMM dims" in the module doc)."""


def gemm_tp_dim(role: str, divides: bool, operands: tuple[str, str]) -> str | None:
    """The dim (``m``, ``n``, ``k`` or ``batch``) of one matrix product of a node whose
    tensor-parallel role is ``role`` that tp divides, or None (module doc, "GEMM dims").
    ``operands`` says what the ``m x k`` and ``k x n`` factors are (``GemmCall.operands``:
    ``x``, ``w``, ``g``). A weighted matmul's product whose factors are not told apart keeps the
    forward product's dim (``n`` column parallel, ``k`` row parallel): its FLOPs still divide."""
    if not divides:
        return None
    if role not in ("col", "row"):
        return "batch"  # attention and matmuls of activations: sharded by heads, a batch dim
    want = "out" if role == "col" else "in"
    lhs, rhs = operands
    if lhs != rhs and lhs in _FACTOR_DIMS and rhs in _FACTOR_DIMS:
        (shared,) = set(_FACTOR_DIMS[lhs]) & set(_FACTOR_DIMS[rhs])
        if want == shared:
            return "k"
        return "m" if want in _FACTOR_DIMS[lhs] else "n"
    return "n" if role == "col" else "k"


def flat_args(n: fx.Node) -> list:
    """Positional then keyword arguments, lists flattened, as ``(path, value)`` pairs."""
    out: list[tuple[tuple[Any, Any], Any]] = []
    for i, arg in enumerate(n.args):
        if isinstance(arg, (list, tuple)):
            out += [((i, j), x) for j, x in enumerate(arg)]
        else:
            out.append(((i, None), arg))
    for k, arg in n.kwargs.items():
        out.append(((k, None), arg))
    return out


def reshape_groups(src: list[int], dst: list[int], dim: int):
    """The groups of non-unit dims with equal products, ``(src dims, dst dims)``, that hold
    dim ``d`` of ``src`` after a reshape to ``dst``; None if there is none."""
    src_dims = [k for k, size in enumerate(src) if size != 1]
    dst_dims = [k for k, size in enumerate(dst) if size != 1]
    i = j = 0
    while i < len(src_dims) and j < len(dst_dims):
        src_group, dst_group = [src_dims[i]], [dst_dims[j]]
        src_size, dst_size = src[src_dims[i]], dst[dst_dims[j]]
        i, j = i + 1, j + 1
        while src_size != dst_size:
            if src_size < dst_size and i < len(src_dims):
                src_group.append(src_dims[i])
                src_size *= src[src_dims[i]]
                i += 1
            elif dst_size < src_size and j < len(dst_dims):
                dst_group.append(dst_dims[j])
                dst_size *= dst[dst_dims[j]]
                j += 1
            else:
                return None
        if dim in src_group:
            return src_group, dst_group
    return None


def reshape_dim(src: list[int], dst: list[int], dim: int) -> int | None:
    """Where a tensor sharded along ``d`` is sharded after a reshape ``src -> dst``: the leading
    dim of its group in ``dst``. None if ``d`` does not lead its group (its shards would
    interleave with a dim before it)."""
    groups = reshape_groups(src, dst, dim)
    return groups[1][0] if groups is not None and groups[0][0] == dim else None


def slice_bounds(n: fx.Node, size: int) -> tuple[int, int]:
    """``[start, end)`` of an ``aten.slice`` node along its dim of ``size`` entries (negative and
    open bounds resolved, as Python slices read them)."""
    start, end = node_arg(n, "start", None), node_arg(n, "end", None)
    low, high, _ = slice(hint(start) if start is not None else None, hint(end) if end is not None else None).indices(
        size
    )
    return low, max(low, high)


def reads_data(n: fx.Node, data: set) -> bool:
    """Does ``n`` read a tensor derived from a graph input (not just its sizes)?"""
    return any(arg in data and has_tensor(value_of(arg)) for arg in n.all_input_nodes)


def states_of(state) -> list:
    return state if isinstance(state, list) else [state]


def norm_dim(k, ndim: int) -> int:
    return int(k) % ndim if ndim else int(k)


def dims_of(dims, ndim: int) -> list[int] | None:
    if dims is None:
        return None
    return [norm_dim(k, ndim) for k in (dims if isinstance(dims, (list, tuple)) else [dims])]


def moved_dim(n: fx.Node, name: str, dim: int) -> int | None:
    """Where dim ``d`` of a ``LAYOUT`` op's input is in its output; None for a squeeze that could
    drop it (a rank's shard may hold a single entry, which must not be squeezed away)."""
    x = n.args[0]
    ndim = len(shape_of(x))
    if name == "t":
        return 1 - dim if ndim == 2 else dim
    if name == "numpy_T":
        return ndim - 1 - dim
    if name == "transpose":
        i, j = norm_dim(n.args[1], ndim), norm_dim(n.args[2], ndim)
        return j if dim == i else i if dim == j else dim
    if name == "permute":
        return [norm_dim(perm_dim, ndim) for perm_dim in cast(list, n.args[1])].index(dim)
    if name == "unsqueeze":
        k = norm_dim(n.args[1], ndim + 1)
        return dim + 1 if k <= dim else dim
    dims = dims_of(node_arg(n, "dim"), ndim)  # squeeze
    if dims is None or dim in dims:
        return None
    return reshape_groups(shape_of(x), shape_of(n), dim)[1][0]
