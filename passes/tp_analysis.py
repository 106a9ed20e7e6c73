"""Megatron tensor parallelism: the one analysis of which values, matmuls and weights shard.

Both the cost pass (``passes.tensor_parallel``: what divides by tp, what is all-reduced) and code
generation (``codegen.tp_rewrite``: what the generated code does on each rank) read the decisions
of ``analyze_tensor_parallel``, so the cost model prices the program that codegen writes. The
analysis works on either form of an exported graph: the lifted ``ExportedProgram.graph_module``
(parameters are placeholders whose role is ``param``, sizes symbolic, read through their hint) or
``ExportedProgram.module()`` (parameters are ``get_attr`` nodes, static sizes). It does not depend
on the tp degree ``t`` unless given one (then a reshape into heads ``t`` does not divide keeps its
region replicated); whether ``t`` divides the sizes of the sharded regions (heads, kv heads, ffn,
the fused parts) is checked by codegen on top of it.

States
------
Each tensor value is *replicated* (every rank holds all of it) or *sharded* along one dim ``d``
(a ``Shard``): rank ``r`` holds the contiguous block ``[r * n/t, (r + 1) * n/t)`` of the ``n``
entries of ``d``. The state records the full size of ``d`` and the column-parallel matmuls that
started the region (its *origins*).

Rules (the walk is in graph order)
----------------------------------
* ``linear(x, W, b)`` / ``addmm(b, x, W)`` / ``mm`` / ``matmul`` with a 2-d parameter weight and a
  replicated activation is **column parallel**: ``W`` (and ``b``) keep this rank's output
  features, the output is sharded along its last dim, FLOPs divide. Its input *enters* the
  sharded region (``copy_to_tp``: identity forward, all-reduce of the input gradient backward,
  once per input tensor).
* A weighted matmul whose activation is sharded along the contraction dim is **row parallel**:
  ``W`` keeps this rank's input features, the partial outputs are all-reduced, the result is
  replicated and a bias is added once, after the all-reduce.
* The token embedding (a parameter table of ``V`` rows indexed by data) is **vocab parallel**:
  each rank looks up its rows and the output is all-reduced (replicated). Other tables
  (positions, token types) stay replicated. ``V`` is the model's vocabulary, or else the rows of
  the first data-indexed table.
* ``cross_entropy_loss`` over 2-d logits sharded along the classes is the **vocab-parallel loss**
  (per-row maxima, sum-exps and target logits all-reduced; the full logits never exist).
* Views, reshapes, flatten/unflatten, expands, transposes, permutes, (un)squeezes, slices, splits,
  cat/stack, dropout, casts, elementwise ops, softmax and reductions over other dims, norms over
  other dims and matmuls of activations sharded on one batch dim keep the sharding; the sharded
  dim is tracked through each. A reshape that merges or splits the sharded dim is exact only when
  that dim *leads* its group of merged dims (each rank's block of the group is contiguous).
* SDPA (and its kernel variants) on q, k and v all sharded by heads is per head; GQA keeps its
  ratio. k / v may also be replicated with one head (broadcast) or with every query head (GQA's
  repeated key/value heads when their projections stayed replicated, e.g. one kv head at tp 2):
  each rank then keeps its query heads' share (``scatter``). A mask with a per-head dim cannot
  be used.
* A weighted matmul may read a transpose of a 2-d parameter (Falcon's ``x @ W.T``): it is column
  or row parallel on the parameter.
* A fused projection split along its sharded features (GPT-2's ``c_attn`` -> q, k, v) keeps each
  part sharded; its weight is laid out ``[q_r; k_r; v_r]`` per rank (shard kind ``qkv``).
* A replicated tensor that requires grad and enters a sharded op (a norm weight, a broadcast
  scale, a learnable mask, a column-parallel input) is recorded in ``enter``: each rank's
  gradient for it covers only its shard.

Anything else a sharded value meets (a norm, softmax or reduction over the sharded dim, an
elementwise op with a full tensor, an op not in the tables, a layer boundary, the graph output,
a weight read both sharded and replicated) is a *conflict* (``TPConflict``): the column-parallel
matmuls and vocab-parallel embeddings that started the region are made replicated and the walk
restarts. That is how BERT's MLM transform (``dense -> gelu -> LayerNorm``) stays replicated while
its decoder is vocab parallel. Each restart bans at least one more matmul, so this terminates; a
conflict no ban can avoid is raised.

Each sharded parameter gets a ``WeightShard`` (kind ``column``, ``row``, ``heads``, ``vocab`` or
``qkv``, the dim and its full size): the tp-free part of ``runtime.sharding.TensorShard``.

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

Sequence parallelism
--------------------
Megatron's sequence parallelism (SP, Korthikanti et al. 2022) also splits the *replicated*
activations between the parallel regions (norms, residual adds, dropout) along the sequence: rank
``r`` holds positions ``[r * S/t, (r + 1) * S/t)`` (a ``SeqShard``). The walk (``_SeqWalk``) runs
on the tp decisions, which it does not change, and fills the ``sp_*`` fields of ``TPDecisions``:

* The sequence is the last dim of the token ids the vocabulary embedding reads (``[b, s]``: dim 1);
  a value whose leading dims are the ids' shape (``[b, s, h]``) is laid out by token.
* *Sources*: a row-parallel matmul or the vocabulary-parallel embedding with such an output
  reduce-scatters along the sequence instead of all-reducing (``reduce_scatter``); a row-parallel
  bias is then added to this rank's positions only.
* *Sinks*: the activation of a column-parallel matmul (the LM head too) is all-gathered along the
  sequence, replacing ``copy_to_tp`` (``all_gather``; its backward reduce-scatters the gradient).
* In between, a sequence shard passes token-wise ops: elementwise ops, dropout and casts, norms,
  softmax and reductions over other dims, views that keep the sequence dim whole (their size
  argument along it becomes ``S/t``), transposes, slices, splits and cats along other dims, and
  matmuls with a replicated 2-d weight (kept replicated by tp: each rank multiplies its tokens).
* A replicated tensor that meets a sequence shard in such an op is either full along the aligned
  sequence dim (a position embedding ``[s, h]``): each rank keeps its positions (``split``,
  ``scatter_to_tp``; no forward communication, its gradient all-gathered) -- or broadcast along it
  (a norm weight, a bias): if it requires grad, each rank's gradient covers only its tokens and is
  all-reduced (``grad_all_reduce``, ``copy_to_tp``).

Anything else a sequence shard meets (attention, an op over the sequence dim, a reshape merging
the sequence with the batch, a tp-sharded op other than a column-parallel matmul, an op not in
the tables, the graph output) is a conflict: the sources that started that shard go back to
all-reducing (``sp_replicated``) and the walk restarts, as the tp walk does with its matmuls. When
no source is left, ``sp_blocked`` says why (naming the node). Sequence shards may cross layers and
pipeline stages (what a stage sends is then ``S/t`` positions long).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from passes.common import has_tensor, hint, is_meta_only
from passes.op_class import op_name

__all__ = [
    "PASSTHROUGH",
    "SPLITS",
    "SeqComm",
    "SeqShard",
    "VIEWS",
    "WEIGHTED_MATMULS",
    "Shard",
    "TPConflict",
    "TPDecisions",
    "WeightShard",
    "analyze_tensor_parallel",
    "flat_args",
    "gemm_tp_dim",
    "matmul_operands",
    "node_arg",
    "reshape_dim",
    "reshape_groups",
]

WEIGHTED_MATMULS = {"linear", "addmm", "mm", "matmul"}
"""Ops that may multiply by a parameter weight (column / row parallel)."""
PASSTHROUGH = {"dropout", "native_dropout", "to", "_to_copy", "contiguous", "alias", "detach",
               "clone", "type_as", "lift_fresh_copy"}
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
ATTENTION = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu"}
NORMS = {"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm"}
SOFTMAX = {"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"}
REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "var", "std",
              "var_mean", "std_mean", "logsumexp", "prod", "all", "any", "norm",
              "linalg_vector_norm"}
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
    """How a parameter is sharded: the tp-free part of ``runtime.sharding.TensorShard``."""

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


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _shape(n) -> list[int]:
    v = _val(n)
    return [hint(d) for d in v.shape] if isinstance(v, torch.Tensor) else []


def _is_tensor(n) -> bool:
    return isinstance(n, fx.Node) and isinstance(_val(n), torch.Tensor)


def node_arg(n: fx.Node, name: str, default=None):
    """Argument ``name`` of an ATen op node, given positionally or by keyword."""
    schema = getattr(n.target, "_schema", None)
    for i, a in enumerate(schema.arguments if schema is not None else ()):
        if a.name == name and i < len(n.args):
            return n.args[i]
    return n.kwargs.get(name, default)


def matmul_operands(n: fx.Node) -> tuple:
    """``(activation, weight, bias)`` of a ``WEIGHTED_MATMULS`` node (bias None if absent)."""
    name, a = op_name(n), n.args
    if name == "linear":
        return a[0], a[1], node_arg(n, "bias")
    if name == "addmm":
        return a[1], a[2], a[0]
    return a[0], a[1], None


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
    a, b = operands
    if a != b and a in _FACTOR_DIMS and b in _FACTOR_DIMS:
        (shared,) = set(_FACTOR_DIMS[a]) & set(_FACTOR_DIMS[b])
        if want == shared:
            return "k"
        return "m" if want in _FACTOR_DIMS[a] else "n"
    return "n" if role == "col" else "k"


def flat_args(n: fx.Node) -> list:
    """Positional then keyword arguments, lists flattened, as ``(path, value)`` pairs."""
    out = []
    for i, a in enumerate(n.args):
        if isinstance(a, (list, tuple)):
            out += [((i, j), x) for j, x in enumerate(a)]
        else:
            out.append(((i, None), a))
    for k, a in n.kwargs.items():
        out.append(((k, None), a))
    return out


def reshape_groups(src: list[int], dst: list[int], d: int):
    """The groups of non-unit dims with equal products, ``(src dims, dst dims)``, that hold
    dim ``d`` of ``src`` after a reshape to ``dst``; None if there is none."""
    si = [k for k, v in enumerate(src) if v != 1]
    di = [k for k, v in enumerate(dst) if v != 1]
    i = j = 0
    while i < len(si) and j < len(di):
        gi, gj = [si[i]], [di[j]]
        pi, pj = src[si[i]], dst[di[j]]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj and i < len(si):
                gi.append(si[i]); pi *= src[si[i]]; i += 1
            elif pj < pi and j < len(di):
                gj.append(di[j]); pj *= dst[di[j]]; j += 1
            else:
                return None
        if d in gi:
            return gi, gj
    return None


def reshape_dim(src: list[int], dst: list[int], d: int) -> int | None:
    """Where a tensor sharded along ``d`` is sharded after a reshape ``src -> dst``: the leading
    dim of its group in ``dst``. None if ``d`` does not lead its group (its shards would
    interleave with a dim before it)."""
    g = reshape_groups(src, dst, d)
    return g[1][0] if g is not None and g[0][0] == d else None


def _reads_data(n: fx.Node, data: set) -> bool:
    """Does ``n`` read a tensor derived from a graph input (not just its sizes)?"""
    return any(a in data and has_tensor(_val(a)) for a in n.all_input_nodes)


def _states(s) -> list:
    return s if isinstance(s, list) else [s]


def _norm(k, nd: int) -> int:
    return int(k) % nd if nd else int(k)


def _dims(dims, nd: int) -> list[int] | None:
    if dims is None:
        return None
    return [_norm(k, nd) for k in (dims if isinstance(dims, (list, tuple)) else [dims])]


def _moved_dim(n: fx.Node, name: str, d: int) -> int | None:
    """Where dim ``d`` of a ``LAYOUT`` op's input is in its output; None for a squeeze that could
    drop it (a rank's shard may hold a single entry, which must not be squeezed away)."""
    x = n.args[0]
    nd = len(_shape(x))
    if name == "t":
        return 1 - d if nd == 2 else d
    if name == "numpy_T":
        return nd - 1 - d
    if name == "transpose":
        i, j = _norm(n.args[1], nd), _norm(n.args[2], nd)
        return j if d == i else i if d == j else d
    if name == "permute":
        return [_norm(p, nd) for p in n.args[1]].index(d)
    if name == "unsqueeze":
        k = _norm(n.args[1], nd + 1)
        return d + 1 if k <= d else d
    dims = _dims(node_arg(n, "dim"), nd)  # squeeze
    if dims is None or d in dims:
        return None
    return reshape_groups(_shape(x), _shape(n), d)[1][0]


class _Walk:
    """One walk over the graph with the matmuls / embeddings of ``banned`` kept replicated."""

    def __init__(self, gm: fx.GraphModule, params: dict, inputs: set, layer_of: Callable,
                 vocab: int | None, banned: set[str], tp: int | None = None):
        self.gm, self.layer_of, self.vocab, self.banned, self.tp = gm, layer_of, vocab, banned, tp
        self.pviews: dict[fx.Node, fx.Node] = {}  # transpose of a 2-d parameter -> the parameter
        self.params, self.inputs = params, inputs
        self.out = TPDecisions(params=params, vocab=vocab)
        self.rg: dict[fx.Node, bool] = {}
        self.data: set[fx.Node] = set()
        self.tags: dict[str, set] = {}  # origin name -> {"heads", "loss", ("parts", sizes)}
        self.uses: dict[str, list] = {}  # param key -> [(user, (kind, dim, size) | None)]
        self.col_out: dict[str, int] = {}  # column-parallel matmul -> its output features

    # ------------------------------------------------------------------ helpers
    def st(self, a):
        return self.out.state.get(a) if isinstance(a, fx.Node) else None

    def conflict(self, n, why, *args):
        shards = [e for a in args for e in _states(self.st(a)) if isinstance(e, Shard)]
        raise TPConflict(frozenset().union(*[e.origins for e in shards]), n, why)

    def set(self, n, s, role=None):
        self.out.state[n] = s
        sharded = any(isinstance(e, Shard) for e in _states(s))
        self.out.role[n] = role or ("sharded" if sharded else "replicated")
        if not sharded:
            return
        for u in n.users:
            if u.op == "output":
                self.conflict(u, "a sharded tensor is an output of the model", n)
            if u.op == "call_function" and not is_meta_only(u) and \
                    self.layer_of(u) != self.layer_of(n):
                self.conflict(u, f"a sharded tensor crosses from layer {self.layer_of(n)} into layer "
                              f"{self.layer_of(u)}", n)

    def tag(self, s: Shard, t):
        """Note what the region of ``s`` turned out to be (heads, loss, fused parts)."""
        for o in s.origins:
            self.tags.setdefault(o, set()).add(t)

    def use(self, p: fx.Node, user: fx.Node, spec):
        self.uses.setdefault(self.params[p], []).append((user, spec))
        if spec is not None:
            self.out.shards_params.setdefault(user, []).append(self.params[p])

    def entering(self, n) -> list:
        """Argument paths of replicated tensors needing grad that enter this sharded op."""
        return [p for p, a in flat_args(n)
                if _is_tensor(a) and self.st(a) is None and self.rg.get(a, False)]

    # ------------------------------------------------------------------ the walk
    def run(self) -> TPDecisions:
        for n in self.gm.graph.nodes:
            if n.op in ("placeholder", "get_attr"):
                if n in self.inputs:
                    self.data.add(n)
                self.rg[n] = n in self.params
                self.set(n, None)
            elif n.op == "call_function":
                ins = n.all_input_nodes
                if _reads_data(n, self.data):
                    self.data.add(n)
                vals = _val(n) if isinstance(_val(n), (list, tuple)) else [_val(n)]
                floats = any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in vals)
                self.rg[n] = floats and any(self.rg.get(a, False) for a in ins)
                if is_meta_only(n):
                    self.set(n, None)
                else:
                    self.visit(n, op_name(n))
            else:
                self.set(n, None)
        self.check_params()
        return self.out

    def visit(self, n: fx.Node, name: str):
        if name == "getitem":
            s = self.st(n.args[0])
            return self.set(n, s[n.args[1]] if isinstance(s, list) else None)
        if name in WEIGHT_VIEWS and n.args[0] in self.params and len(_shape(n.args[0])) == 2 \
                and all(op_name(u) in WEIGHTED_MATMULS for u in n.users):
            self.pviews[n] = n.args[0]  # its use is recorded by the matmul that reads it
            return self.set(n, None)
        if name in WEIGHTED_MATMULS and self.matmul(n, name):
            return
        if name == "embedding":
            return self.embedding(n)
        sharded = [a for a in n.all_input_nodes if isinstance(self.st(a), Shard)]
        for a in n.all_input_nodes:
            a = self.pviews.get(a, a)
            if a in self.params and not isinstance(self.st(a), Shard):
                self.use(a, n, None)  # read whole: a replicated use
        if not sharded:
            return self.set(n, None)
        handler = _HANDLERS.get(name)
        if handler is None and torch.Tag.pointwise in getattr(n.target, "tags", ()):
            handler = "pointwise"
        if handler is None:
            self.conflict(n, f"{name} is not known to be safe on a tensor-parallel shard", *sharded)
        getattr(self, handler)(n, name)

    # ------------------------------------------------------------------ weights
    def matmul(self, n, name) -> bool:
        """Column- or row-parallel weighted matmul; False if the weight is not a parameter."""
        x, w, b = matmul_operands(n)
        out_dim, in_dim = (0, 1) if name == "linear" else (1, 0)  # linear's W is [out, in]
        if name == "addmm" and any(k in n.kwargs for k in ("beta", "alpha")):
            return False
        if w in self.pviews:  # x @ W.T: the parameter is [out, in] like linear's
            w, (out_dim, in_dim) = self.pviews[w], (in_dim, out_dim)
        if not (isinstance(w, fx.Node) and w in self.params) or x in self.params \
                or len(_shape(w)) != 2 or not _is_tensor(x):
            return False
        if b is not None and not (isinstance(b, fx.Node) and b in self.params):
            return False
        s = self.st(x)
        if s is None:
            out = _shape(w)[out_dim]
            col = n.name not in self.banned
            self.use(w, n, ("col", out_dim, out) if col else None)
            if b is not None:
                self.use(b, n, ("col", 0, out) if col else None)
            if not col:
                self.set(n, None)
                return True
            self.col_out[n.name] = out
            self.out.enter[n] = [(1 if name == "addmm" else 0, None)]
            self.set(n, Shard(len(_shape(n)) - 1, out, frozenset([n.name])), "col")
            return True
        if not isinstance(s, Shard):
            return False
        if s.dim != len(_shape(x)) - 1:
            self.conflict(n, "matmul input sharded along a non-contraction dim", x)
        if s.size != _shape(w)[in_dim]:
            self.conflict(n, "matmul contraction does not match the sharded features", x)
        self.use(w, n, ("row", in_dim, s.size))
        if b is not None:
            self.use(b, n, None)
        self.set(n, None, "row")
        return True

    def embedding(self, n):
        w, ids = n.args[0], n.args[1]
        if isinstance(self.st(ids), Shard):
            self.conflict(n, "embedding indices are sharded", ids)
        is_param = isinstance(w, fx.Node) and w in self.params
        ok = (is_param and ids in self.data and _shape(w) and _shape(w)[0] == self.vocab
              and n.name not in self.banned and not node_arg(n, "scale_grad_by_freq", False)
              and not node_arg(n, "sparse", False))
        if is_param:
            self.use(w, n, ("vocab", 0, self.vocab) if ok else None)
        self.set(n, None, "vocab_embedding" if ok else None)

    def check_params(self):
        """Every use of a sharded parameter must read the same shard; else undo its users."""
        for key, uses in self.uses.items():
            sharding = [u for u, spec in uses if spec is not None]
            if not sharding:
                continue
            kinds = {(s[1], s[2]) if s is not None else None for _, s in uses}
            if len(kinds) > 1:
                raise TPConflict(frozenset(u.name for u in sharding), sharding[0],
                                 f"the weight {key} is used both sharded and replicated (or sharded "
                                 "two ways)")

    def weight_shards(self) -> dict:
        """Parameter key -> ``WeightShard`` (call after a successful walk)."""
        out = {}
        for key, uses in self.uses.items():
            specs = [(u, s) for u, s in uses if s is not None]
            if not specs:
                continue
            tags = set().union(*[self.tags.get(u.name, set()) for u, _ in specs])
            kind, dim, size = specs[0][1]
            parts = [t[1] for t in tags if isinstance(t, tuple) and t[0] == "parts"]
            if kind == "row":
                out[key] = WeightShard("row", dim, size)
            elif kind == "vocab" or (size == self.vocab and "loss" in tags):
                out[key] = WeightShard("vocab", dim, size)
            elif parts:
                out[key] = WeightShard("qkv", dim, size, tuple(min(parts)))
            else:
                out[key] = WeightShard("heads" if "heads" in tags else "column", dim, size)
        return out

    # ------------------------------------------------------------------ handlers
    def attention(self, n, name):
        """Per-head attention: q sharded by heads; k and v sharded alike, or replicated with one
        (broadcast) head, or replicated with every query head, of which each rank keeps its share
        (grouped-query attention whose key/value projections tp cannot split)."""
        q, k, v = n.args[:3]
        sq = self.st(q)
        hd = len(_shape(q)) - 3
        if not (isinstance(sq, Shard) and sq.dim == hd):
            self.conflict(n, "attention needs q sharded by heads", q, k, v)
        heads = _shape(q)[hd]
        scatter, origins = [], set(sq.origins)
        for i, x in ((1, k), (2, v)):
            s = self.st(x)
            if isinstance(s, Shard):
                if s.dim != hd or s.size not in (sq.size,) and not node_arg(n, "enable_gqa", False):
                    self.conflict(n, f"attention needs {'kv'[i - 1]} sharded by heads like q", x)
                origins |= s.origins
            elif _shape(x)[hd] == sq.size and sq.size > 1:  # every query head, repeated: keep ours
                scatter.append(((i, None), hd))
            elif _shape(x)[hd] != 1:
                self.conflict(n, f"attention with q sharded by heads reads a replicated {'kv'[i - 1]} "
                              f"of {_shape(x)[hd]} heads (q has {sq.size})", q)
        for _, mask in flat_args(n):
            if not _is_tensor(mask) or mask in (q, k, v):
                continue
            ms = _shape(mask)
            off = len(_shape(q)) - len(ms)
            if isinstance(self.st(mask), Shard) or (hd - off >= 0 and ms[hd - off] != 1):
                self.conflict(n, "the attention mask has a per-head dim", q, k, v, mask)
        for x in (q, k, v):
            if isinstance(self.st(x), Shard):
                self.tag(self.st(x), "heads")
        if scatter:
            self.out.scatter[n] = scatter
        self.out.enter[n] = [p for p in self.entering(n) if p not in [sc[0] for sc in scatter]]
        out = Shard(hd, sq.size, frozenset(origins))
        if isinstance(_val(n), torch.Tensor):
            return self.set(n, out)
        # the kernels' log-sum-exp [b, heads, s] is per head too
        self.set(n, [out] + [out if isinstance(o, torch.Tensor) and o.dim() == len(_shape(q)) - 1
                             and hint(o.shape[hd]) == heads else None for o in _val(n)[1:]])

    def loss(self, n, name):
        logits, target = n.args[0], n.args[1]
        s = self.st(logits)
        if not isinstance(s, Shard) or isinstance(self.st(target), Shard) or \
                len(_shape(logits)) != 2 or s.dim != 1:
            self.conflict(n, "cross-entropy needs 2-d logits sharded along the classes", logits)
        if node_arg(n, "weight") is not None or node_arg(n, "label_smoothing", 0.0) != 0.0:
            self.conflict(n, "class weights / label smoothing are not supported by the vocab-parallel "
                          "cross-entropy", logits)
        self.tag(s, "loss")
        self.set(n, None, "vocab_loss")

    def view(self, n, name):
        """view / reshape / flatten / unflatten: see ``reshape_dim``."""
        x = n.args[0]
        s = self.st(x)
        src, dst = _shape(x), _shape(n)
        g = reshape_groups(src, dst, s.dim)
        if g is None or g[0][0] != s.dim:
            self.conflict(n, "the reshape interleaves the sharded dim with a dim before it", x)
        d_out = g[1][0]
        if self.tp and len(g[1]) > 1 and dst[d_out] % self.tp:
            self.conflict(n, f"the reshape splits the sharded size {src[s.dim]} into "
                          f"{' x '.join(str(dst[k]) for k in g[1])}, and tp={self.tp} does not "
                          f"divide {dst[d_out]} (e.g. the key/value heads)", x)
        self.set(n, Shard(d_out, dst[d_out], s.origins))

    def layout(self, n, name):
        x = n.args[0]
        s = self.st(x)
        d = _moved_dim(n, name, s.dim)
        if d is None:
            self.conflict(n, "squeeze could drop the sharded dim (one entry per rank)", x)
        self.set(n, s.at(d))

    def expand(self, n, name):
        x = n.args[0]
        s = self.st(x)
        self.set(n, s.at(s.dim + len(_shape(n)) - len(_shape(x))))

    def slice(self, n, name):
        x = n.args[0]
        s = self.st(x)
        nd = len(_shape(x))
        dim = _norm(node_arg(n, "dim", 0), nd)
        if dim == s.dim and not (name != "select" and _shape(n)[dim] == _shape(x)[dim]):
            self.conflict(n, "slicing along the sharded dim", x)
        self.set(n, s.at(s.dim - 1 if (name == "select" and dim < s.dim) else s.dim))

    def split(self, n, name):
        x = n.args[0]
        s = self.st(x)
        nd = len(_shape(x))
        dim = _norm(node_arg(n, "dim", 0), nd)
        vals = _val(n)
        if dim != s.dim:
            out = s.at(s.dim - 1 if (name == "unbind" and dim < s.dim) else s.dim)
            return self.set(n, [out for _ in vals])
        # A fused projection split along its features: Megatron layout [q_r; k_r; v_r].
        if name == "unbind" or any(self.col_out.get(o) != s.size for o in s.origins):
            self.conflict(n, "a split of the sharded dim that is not the output features of the "
                          "projection that produced it", x)
        pieces = tuple(hint(v.shape[dim]) for v in vals)
        self.tag(s, ("parts", pieces))
        self.set(n, [Shard(dim, p, s.origins) for p in pieces])

    def cat(self, n, name):
        parts = n.args[0]
        nd = len(_shape(n))
        dim = _norm(node_arg(n, "dim", 0), nd)
        ss = [self.st(p) for p in parts]
        f = ss[0]
        alike = all(isinstance(s, Shard) and (s.dim, s.size) == (f.dim, f.size) for s in ss)
        if not alike or (name == "cat" and dim == f.dim):
            self.conflict(n, f"{name} of tensors not all sharded alike, or along the sharded dim",
                          *parts)
        d = f.dim + 1 if (name == "stack" and dim <= f.dim) else f.dim
        self.set(n, Shard(d, f.size, frozenset().union(*[s.origins for s in ss])))

    def act_matmul(self, n, name):
        a, b = n.args[0], n.args[1]
        sa, sb = self.st(a), self.st(b)
        nd = len(_shape(n))
        ok = isinstance(sa, Shard) and isinstance(sb, Shard) and len(_shape(a)) == nd == len(_shape(b)) \
            and sa.dim == sb.dim and sa.dim < nd - 2 and sa.size == sb.size
        if not ok:
            self.conflict(n, "matmul of activations needs both operands sharded on one batch dim", a, b)
        self.set(n, Shard(sa.dim, sa.size, sa.origins | sb.origins))

    def softmax(self, n, name):
        x = n.args[0]
        s = self.st(x)
        if _norm(n.args[1], len(_shape(x))) == s.dim:
            self.conflict(n, "softmax over the sharded dim", x)
        self.set(n, s)

    def reduce(self, n, name):
        x = n.args[0]
        s = self.st(x)
        nd = len(_shape(x))
        dims = _dims(node_arg(n, "dim"), nd)
        if not dims:
            self.conflict(n, "reduction over every dim of a sharded tensor", x)
        if s.dim in dims or any(isinstance(self.st(a), Shard) for a in n.all_input_nodes if a is not x):
            self.conflict(n, "reduction over the sharded dim", x)
        keep = node_arg(n, "keepdim", False)
        out = s.at(s.dim if keep else s.dim - sum(1 for k in dims if k < s.dim))
        self.set(n, out if isinstance(_val(n), torch.Tensor) else [out for _ in _val(n)])

    def scan(self, n, name):
        """Shape-preserving ops along given dims (cumsum, flip, roll): fine unless along d."""
        x = n.args[0]
        s = self.st(x)
        dims = _dims(node_arg(n, "dims" if name in ("flip", "roll") else "dim"), len(_shape(x)))
        if not dims or s.dim in dims:
            self.conflict(n, "scan along the sharded dim", x)
        self.set(n, s if isinstance(_val(n), torch.Tensor) else [s for _ in _val(n)])

    def norm(self, n, name):
        x = n.args[0]
        s = self.st(x)
        normed = len(n.args[1])
        if s.dim >= len(_shape(x)) - normed or any(isinstance(self.st(a), Shard)
                                                   for a in n.all_input_nodes if a is not x):
            self.conflict(n, "normalization over the sharded dim", x)
        self.out.enter[n] = self.entering(n)
        # native kernels' per-row statistics are sharded along the same rows
        self.set(n, s if isinstance(_val(n), torch.Tensor) else [s for _ in _val(n)])

    def passthrough(self, n, name):
        s = self.st(n.args[0])  # type_as(x, other) reads only other's dtype
        self.set(n, s if isinstance(_val(n), torch.Tensor) or s is None else [s for _ in _val(n)])

    def pointwise(self, n, name):
        nd = len(_shape(n))
        found = None
        for _, a in flat_args(n):
            s = self.st(a)
            if isinstance(s, Shard):
                key = (s.dim + nd - len(_shape(a)), s.size)
                if found is not None and found[0] != key:
                    self.conflict(n, "elementwise op mixes differently sharded tensors", *n.all_input_nodes)
                found = (key, (found[1] if found else frozenset()) | s.origins)
        (d, size), origins = found
        for _, a in flat_args(n):
            if _is_tensor(a) and not isinstance(self.st(a), Shard):
                k = d - (nd - len(_shape(a)))
                if k >= 0 and _shape(a)[k] != 1:
                    self.conflict(n, "elementwise op combines a sharded tensor with a full one "
                                  f"({a.name}, shape {_shape(a)})", *n.all_input_nodes)
        self.out.enter[n] = self.entering(n)
        out = Shard(d, size, origins)
        self.set(n, out if isinstance(_val(n), torch.Tensor) else [out for _ in _val(n)])


_HANDLERS = {
    **{k: "attention" for k in ATTENTION}, **{k: "loss" for k in LOSSES},
    **{k: "view" for k in VIEWS}, **{k: "layout" for k in LAYOUT}, "expand": "expand",
    **{k: "slice" for k in SLICES}, **{k: "split" for k in SPLITS}, **{k: "cat" for k in CATS},
    **{k: "act_matmul" for k in ACT_MATMULS}, **{k: "softmax" for k in SOFTMAX},
    **{k: "reduce" for k in REDUCTIONS}, **{k: "scan" for k in SCANS},
    **{k: "norm" for k in NORMS}, **{k: "passthrough" for k in PASSTHROUGH},
}


# ============================================================================ sequence parallelism


def _describe(n: fx.Node) -> str:
    """``node 'x' (op) in module 'a.b'`` for SP's messages."""
    stack = n.meta.get("nn_module_stack") or {}
    mod = list(stack.values())[-1][0] if stack else ""
    return f"node {n.name!r} ({n.target})" + (f" in module {mod!r}" if mod else "")


def _nbytes(n: fx.Node):
    """The bytes of ``n``'s value: ``meta['out_bytes']`` if the shapes pass ran, else concrete."""
    if "out_bytes" in n.meta:
        return n.meta["out_bytes"]
    v = _val(n)
    return hint(v.numel()) * v.element_size() if isinstance(v, torch.Tensor) else 0


def _path_of(n: fx.Node, value) -> tuple | None:
    """The first argument path of ``n`` that holds ``value``."""
    return next((p for p, a in flat_args(n) if a is value), None)


class _SeqWalk:
    """One SP walk over the tp decisions ``dec``, with the sources in ``banned`` kept all-reducing."""

    def __init__(self, gm: fx.GraphModule, dec: TPDecisions, params: dict, tokens: list[int],
                 banned: set[str]):
        self.gm, self.dec, self.params, self.banned = gm, dec, params, banned
        self.tokens, self.S = tokens, tokens[-1]
        self.st: dict[fx.Node, Any] = {}
        self.rg: dict[fx.Node, bool] = {}
        self.args: dict[str, list] = {}
        self.uses: dict[tuple, list] = {}  # (kind, value node, dim) -> names of the users
        self.sources: list[fx.Node] = []
        self.not_token: dict[str, TPConflict] = {}  # sources whose output is not laid out by token

    # ------------------------------------------------------------------ helpers
    def sp(self, a):
        return self.st.get(a) if isinstance(a, fx.Node) else None

    def conflict(self, n, why, *args):
        shards = [e for a in args for e in _states(self.sp(a)) if isinstance(e, SeqShard)]
        raise TPConflict(frozenset().union(*[e.origins for e in shards]), n, why)

    def set(self, n, s):
        self.st[n] = s
        if any(isinstance(e, SeqShard) for e in _states(s)):
            for u in n.users:
                if u.op == "output":
                    self.conflict(u, "a sequence-sharded tensor is an output of the model", n)

    def act(self, n, path, kind, value, dim):
        """Argument ``path`` of ``n`` (holding ``value``) is gathered, split or copied."""
        self.args.setdefault(n.name, []).append((path, kind, dim))
        self.uses.setdefault((kind, value, dim), []).append(n.name)

    def partial(self, n, path, a):
        """A replicated tensor used on this rank's tokens: its gradient is partial if it has one."""
        if self.rg.get(a, False):
            self.act(n, path, "copy", a, None)

    def others(self, n, x):
        """Tensor inputs of ``n`` besides ``x`` must not be sequence-sharded; the replicated ones
        that require grad get partial gradients."""
        for path, a in flat_args(n):
            if a is x or not _is_tensor(a):
                continue
            if isinstance(self.sp(a), SeqShard):
                self.conflict(n, f"{op_name(n)} reads a second sequence-sharded input", x, a)
            self.partial(n, path, a)

    def out(self, n, s):
        """Set ``s`` on every tensor output of ``n`` (the statistics of native norms too)."""
        self.set(n, s if not isinstance(_val(n), (list, tuple)) else [s for _ in _val(n)])

    # ------------------------------------------------------------------ the walk
    def run(self) -> _SeqWalk:
        for n in self.gm.graph.nodes:
            if n.op in ("placeholder", "get_attr"):
                self.rg[n] = n in self.params
            elif n.op == "call_function":
                vals = _val(n) if isinstance(_val(n), (list, tuple)) else [_val(n)]
                floats = any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in vals)
                self.rg[n] = floats and any(self.rg.get(a, False) for a in n.all_input_nodes)
                if not is_meta_only(n):
                    self.visit(n, op_name(n))
        return self

    def visit(self, n: fx.Node, name: str):
        if name == "getitem":
            s = self.sp(n.args[0])
            return self.set(n, s[n.args[1]] if isinstance(s, list) else None)
        role = self.dec.role.get(n)
        if role == "col":  # the sink: all-gather the activation's positions
            x = matmul_operands(n)[0]
            if isinstance(self.sp(x), SeqShard):
                self.act(n, (1 if name == "addmm" else 0, None), "gather", x, self.sp(x).dim)
            return self.set(n, None)
        if role in ("row", "vocab_embedding"):
            return self.source(n, role)
        sharded = [a for a in n.all_input_nodes if isinstance(self.sp(a), SeqShard)]
        if not sharded:
            return self.set(n, None)
        if role != "replicated":
            self.conflict(n, "a sequence-sharded value enters a tensor-parallel op that is not a "
                          "column-parallel matmul (it needs every position)", *sharded)
        if name in WEIGHTED_MATMULS and self.tokenwise(n, name):
            return
        handler = _SP_HANDLERS.get(name)
        if handler is None and torch.Tag.pointwise in getattr(n.target, "tags", ()):
            handler = "pointwise"
        if handler is None:
            self.conflict(n, f"{name} is not known to be safe on a sequence shard", *sharded)
        getattr(self, handler)(n, name)

    def source(self, n: fx.Node, role: str):
        """A row-parallel matmul or the vocabulary embedding: reduce-scatter if laid out by token."""
        shape, k = _shape(n), len(self.tokens)
        if n.name in self.banned:
            return self.set(n, None)
        if shape[:k] != self.tokens or len(shape) <= k:
            self.not_token[n.name] = TPConflict(frozenset(), n, f"its output {shape} is not laid out "
                                                f"by token (the ids are {self.tokens})")
            return self.set(n, None)
        if role == "row":
            b = matmul_operands(n)[2]
            if isinstance(b, fx.Node):
                self.partial(n, _path_of(n, b), b)
        self.sources.append(n)
        self.set(n, SeqShard(k - 1, frozenset([n.name])))

    # ------------------------------------------------------------------ handlers
    def tokenwise(self, n, name) -> bool:
        """A weighted matmul tp keeps replicated, on sequence shards: each rank multiplies its
        tokens; the weight's (and bias') gradient is partial."""
        x, w, b = matmul_operands(n)
        s = self.sp(x)
        if not isinstance(s, SeqShard) or not _is_tensor(w) or len(_shape(w)) != 2:
            return False
        if s.dim == len(_shape(x)) - 1:
            self.conflict(n, "a matmul contracts over the sequence dim", x)
        self.others(n, x)
        self.set(n, s.at(s.dim + len(_shape(n)) - len(_shape(x))))
        return True

    def pointwise(self, n, name):
        nd = len(_shape(n))
        d, origins = None, frozenset()
        for _, a in flat_args(n):
            s = self.sp(a)
            if isinstance(s, SeqShard):
                k = s.dim + nd - len(_shape(a))
                if d is not None and k != d:
                    self.conflict(n, "elementwise op mixes tensors sharded along different sequence dims",
                                  *n.all_input_nodes)
                d, origins = k, origins | s.origins
        for path, a in flat_args(n):
            if not _is_tensor(a) or isinstance(self.sp(a), SeqShard):
                continue
            k = d - (nd - len(_shape(a)))
            if k < 0 or _shape(a)[k] == 1:
                self.partial(n, path, a)  # broadcast along the sequence
            elif _shape(a)[k] == self.S:
                self.act(n, path, "split", a, k)  # full length: keep this rank's positions
            else:
                self.conflict(n, f"elementwise op combines a sequence shard with {a.name} of shape "
                              f"{_shape(a)}", *n.all_input_nodes)
        self.out(n, SeqShard(d, origins))

    def passthrough(self, n, name):
        s = self.sp(n.args[0])
        if not isinstance(s, SeqShard):  # type_as(full, shard) reads only the shard's dtype
            return self.set(n, None)
        self.out(n, s)

    def norm(self, n, name):
        x = n.args[0]
        s = self.sp(x)
        if not isinstance(s, SeqShard) or s.dim >= len(_shape(x)) - len(n.args[1]):
            self.conflict(n, "normalization over the sequence dim", x)
        self.others(n, x)
        self.out(n, s)

    def reduce(self, n, name):
        x = n.args[0]
        s = self.sp(x)
        dims = _dims(node_arg(n, "dim"), len(_shape(x)))
        if not isinstance(s, SeqShard) or not dims or s.dim in dims:
            self.conflict(n, "reduction over the sequence dim", *n.all_input_nodes)
        self.others(n, x)
        keep = node_arg(n, "keepdim", False)
        self.out(n, s.at(s.dim if keep else s.dim - sum(1 for k in dims if k < s.dim)))

    def softmax(self, n, name):
        s = self.sp(n.args[0])
        if _norm(n.args[1], len(_shape(n.args[0]))) == s.dim:
            self.conflict(n, "softmax over the sequence dim", n.args[0])
        self.set(n, s)

    def scan(self, n, name):
        x = n.args[0]
        s = self.sp(x)
        dims = _dims(node_arg(n, "dims" if name in ("flip", "roll") else "dim"), len(_shape(x)))
        if not isinstance(s, SeqShard) or not dims or s.dim in dims:
            self.conflict(n, "scan along the sequence dim", *n.all_input_nodes)
        self.others(n, x)
        self.out(n, s)

    def view(self, n, name):
        """A reshape must keep the sequence dim whole: its size argument there becomes ``S/t``."""
        x = n.args[0]
        s = self.sp(x)
        g = reshape_groups(_shape(x), _shape(n), s.dim)
        if g is None or g[0] != [s.dim] or len(g[1]) != 1:
            self.conflict(n, "the reshape merges or splits the sequence dim (e.g. flattens the tokens "
                          "of the batch into one dim)", x)
        self.set(n, s.at(g[1][0]))

    def layout(self, n, name):
        s = self.sp(n.args[0])
        d = _moved_dim(n, name, s.dim)
        if d is None:
            self.conflict(n, "squeeze could drop the sequence dim", n.args[0])
        self.set(n, s.at(d))

    def expand(self, n, name):
        s = self.sp(n.args[0])
        self.set(n, s.at(s.dim + len(_shape(n)) - len(_shape(n.args[0]))))

    def slice(self, n, name):
        x = n.args[0]
        s = self.sp(x)
        dim = _norm(node_arg(n, "dim", 0), len(_shape(x)))
        if dim == s.dim and not (name != "select" and _shape(n)[dim] == _shape(x)[dim]):
            self.conflict(n, "slicing along the sequence dim", x)
        self.set(n, s.at(s.dim - 1 if (name == "select" and dim < s.dim) else s.dim))

    def split(self, n, name):
        x = n.args[0]
        s = self.sp(x)
        dim = _norm(node_arg(n, "dim", 0), len(_shape(x)))
        if dim == s.dim:
            self.conflict(n, "a split along the sequence dim", x)
        self.set(n, [s.at(s.dim - 1 if (name == "unbind" and dim < s.dim) else s.dim) for _ in _val(n)])

    def cat(self, n, name):
        parts = n.args[0]
        dim = _norm(node_arg(n, "dim", 0), len(_shape(n)))
        ss = [self.sp(p) for p in parts]
        f = ss[0]
        if not all(isinstance(x, SeqShard) and x.dim == f.dim for x in ss) or \
                (name == "cat" and dim == f.dim):
            self.conflict(n, f"{name} of tensors not all sequence-sharded alike, or along the sequence",
                          *parts)
        d = f.dim + 1 if (name == "stack" and dim <= f.dim) else f.dim
        self.set(n, SeqShard(d, frozenset().union(*[x.origins for x in ss])))

    def finish(self, out: TPDecisions) -> None:
        """Write this (successful) walk into ``out``'s ``sp_*`` fields."""
        out.sp_sharded = {n.name: (s.dim if isinstance(s, SeqShard) else
                                   [e.dim if isinstance(e, SeqShard) else None for e in s])
                          for n, s in self.st.items()
                          if any(isinstance(e, SeqShard) for e in _states(s))}
        out.sp_args = self.args
        comms = [(n, SeqComm("reduce_scatter", n.name, len(self.tokens) - 1, _nbytes(n),
                             tuple(u.name for u in n.users), self.rg.get(n, False)))
                 for n in self.sources]
        for (kind, a, dim), users in self.uses.items():
            kind = {"gather": "all_gather", "copy": "grad_all_reduce"}.get(kind, kind)
            comms.append((a, SeqComm(kind, a.name, dim, _nbytes(a), tuple(dict.fromkeys(users)),
                                     self.rg.get(a, False))))
        order = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        out.sp_comms = [c for _, c in sorted(comms, key=lambda e: (order[e[0]], e[1].kind))]


_SP_HANDLERS = {
    **{k: "view" for k in VIEWS}, **{k: "layout" for k in LAYOUT}, "expand": "expand",
    **{k: "slice" for k in SLICES}, **{k: "split" for k in SPLITS}, **{k: "cat" for k in CATS},
    **{k: "softmax" for k in SOFTMAX}, **{k: "reduce" for k in REDUCTIONS},
    **{k: "scan" for k in SCANS}, **{k: "norm" for k in NORMS},
    **{k: "passthrough" for k in PASSTHROUGH},
}
"""What a sequence shard may pass (attention, losses and matmuls of activations may not)."""


def _token_layout(gm: fx.GraphModule, params: dict, inputs: set, vocab: int | None) -> list[int] | None:
    """The shape of the token ids the vocabulary embedding reads (``[b, s]``), if any."""
    data = set(inputs)
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if _reads_data(n, data):
            data.add(n)
        if op_name(n) == "embedding" and n.args[0] in params and n.args[1] in data \
                and _shape(n.args[0])[:1] == [vocab]:
            return _shape(n.args[1]) or None
    return None


def _sequence_parallel(gm: fx.GraphModule, out: TPDecisions, params: dict, inputs: set) -> None:
    """Fill the ``sp_*`` fields of ``out`` (module doc, "Sequence parallelism"). Never raises: a
    model SP cannot split gets ``sp_blocked``."""
    tokens = _token_layout(gm, params, inputs, out.vocab)
    if tokens is None:
        out.sp_blocked = ("sequence parallelism takes the sequence dim from the token ids a "
                          "vocabulary embedding reads, and this model has no such embedding")
        return
    banned: set[str] = set()
    why: dict[str, TPConflict] = {}
    while True:  # each retry bans at least one more source: terminates
        walk = _SeqWalk(gm, out, params, tokens, banned)
        try:
            walk.run()
            break
        except TPConflict as c:
            new = c.origins - banned
            if not new:  # not expected: a conflict always involves a shard of a live source
                out.sp_blocked = f"{c.why} at {_describe(c.node)}"
                return
            why.update({o: c for o in new})
            banned |= new
    out.sp_seq_len = tokens[-1]
    out.sp_replicated = {**walk.not_token, **{k: why[k] for k in sorted(banned)}}
    if not walk.sources:
        first = next(iter(why.values()), None) or next(iter(walk.not_token.values()), None)
        out.sp_blocked = ("no row-parallel matmul or vocabulary embedding can reduce-scatter along the "
                          "sequence" + (f": {first.why} at {_describe(first.node)}" if first else ""))
        return
    walk.finish(out)


def _token_vocab(gm: fx.GraphModule, params: dict, inputs: set) -> int | None:
    """Rows of the first parameter table indexed by data (the token embedding), if any."""
    data = set(inputs)
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if _reads_data(n, data):
            data.add(n)
        if op_name(n) == "embedding" and n.args[0] in params and n.args[1] in data:
            return _shape(n.args[0])[0]
    return None


def analyze_tensor_parallel(gm: fx.GraphModule, *, roles: dict[str, str] | None = None,
                            layer_of: Callable | None = None, vocab: int | None = None,
                            tp: int | None = None) -> TPDecisions:
    """Decide the tensor-parallel role of every node of ``gm`` (see the module doc).

    ``roles`` gives each placeholder's role (``param``, ``buffer``, ``constant``, ``input``) in
    a lifted graph; without it every placeholder is an input and the parameters are the
    ``get_attr`` nodes of ``gm``'s parameters. ``layer_of`` is a node's layer-table row (default
    ``meta['layer']``); ``vocab`` the vocabulary (default: the token embedding's rows). With
    ``tp``, a reshape that splits the sharded dim into a leading size ``tp`` does not divide (2 key
    /value heads over 4 ranks) is a conflict too, so that region stays replicated. Raises
    ``TPConflict`` when no choice of replicated matmuls avoids a conflict.
    """
    layer_of = layer_of or (lambda n: n.meta.get("layer"))
    trainable = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
    params, inputs = {}, set()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            role = (roles or {}).get(n.name, "input")
            if role == "param":
                params[n] = n.name
            elif role == "input":
                inputs.add(n)
        elif n.op == "get_attr" and n.target in trainable:
            params[n] = n.target
    vocab = vocab or _token_vocab(gm, params, inputs)
    banned: set[str] = set()
    why: dict[str, TPConflict] = {}
    while True:  # each retry bans at least one more matmul or embedding: terminates
        walk = _Walk(gm, params, inputs, layer_of, vocab, banned, tp)
        try:
            out = walk.run()
        except TPConflict as c:
            new = c.origins - banned
            if not new:
                raise
            why.update({o: c for o in new})
            banned |= new
            continue
        out.weights = walk.weight_shards()
        out.replicated = {k: why[k] for k in sorted(banned)}
        _sequence_parallel(gm, out, params, inputs)
        return out
