"""Megatron tensor parallelism: the one analysis of which values, matmuls and weights shard.

Both the cost pass (``passes.tensor_parallel.tp_costs``: what divides by tp, what is all-reduced) and code
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
  once per input tensor). The weight may be a transpose of a 2-d parameter (Falcon's ``x @ W.T``).
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
  each rank then keeps its query heads' share (``scatter``). A per-head mask is a conflict.
* A fused projection split along its sharded features (GPT-2's ``c_attn`` -> q, k, v, or slices
  that cut it into consecutive parts: Phi-3's ``qkv_proj``) keeps each part sharded; its weight is
  laid out ``[q_r; k_r; v_r]`` per rank (shard kind ``qkv``).
* A constant (no gradient) as long as the sharded dim it lines up with (MPT's per-head ALiBi bias
  added to the scores) is cut the same way (``scatter``): each rank keeps its block; so is a
  per-feature weight read only there (a norm's scale), as a ``column`` shard.
* A sum or mean over the whole sharded dim (OLMo 2's RMS norm over all query features) is each
  rank's partial result all-reduced (``partial``): its output is replicated.
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
``qkv``, the dim and its full size): the tp-free part of ``runtime.tensor_parallel.sharding.TensorShard``.
Sequence parallelism (``passes.tensor_parallel.sp_analysis``) runs on these decisions and fills the ``sp_*``
fields; the op tables, states and shape helpers both walks use are in ``passes.tensor_parallel.tp_common``,
and so is the dim each divided matrix product shrinks (``gemm_tp_dim``, "GEMM dims").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, cast

import torch
from torch import fx

from passes.common import arg_node, hint, is_meta_only
from passes.op_class import op_name
from passes.tensor_parallel.sp_analysis import sequence_parallel
from passes.tensor_parallel.tp_common import (
    ACT_MATMULS,
    ATTENTION,
    CATS,
    LAYOUT,
    LOSSES,
    NORMS,
    PASSTHROUGH,
    REDUCTIONS,
    SCANS,
    SLICES,
    SOFTMAX,
    SPLITS,
    VIEWS,
    WEIGHT_VIEWS,
    WEIGHTED_MATMULS,
    SeqComm,
    SeqShard,
    Shard,
    TPConflict,
    TPDecisions,
    WeightShard,
    dims_of,
    flat_args,
    gemm_tp_dim,
    is_tensor_node,
    matmul_operands,
    moved_dim,
    node_arg,
    norm_dim,
    reads_data,
    reshape_dim,
    reshape_groups,
    shape_of,
    slice_bounds,
    states_of,
    value_of,
)

__all__ = [
    "analyze_tensor_parallel",
    "flat_args",
    "gemm_tp_dim",
    "matmul_operands",
    "node_arg",
    "PASSTHROUGH",
    "reshape_dim",
    "reshape_groups",
    "SeqComm",
    "SeqShard",
    "Shard",
    "slice_bounds",
    "SPLITS",
    "TPConflict",
    "TPDecisions",
    "VIEWS",
    "WEIGHTED_MATMULS",
    "WeightShard",
]


class _Walk:
    """One walk over the graph with the matmuls / embeddings of ``banned`` kept replicated."""

    def __init__(
        self,
        gm: fx.GraphModule,
        params: dict,
        inputs: set,
        layer_of: Callable,
        vocab: int | None,
        banned: set[str],
        tp: int | None = None,
    ):
        self.gm, self.layer_of, self.vocab, self.banned, self.tp = gm, layer_of, vocab, banned, tp
        self.pviews: dict[fx.Node, fx.Node] = {}  # transpose of a 2-d parameter -> the parameter
        self.params, self.inputs = params, inputs
        self.out = TPDecisions(params=params, vocab=vocab)
        self.rg: dict[fx.Node, bool] = {}
        self.data: set[fx.Node] = set()
        self.tags: dict[str, set] = {}  # origin name -> {"heads", "loss", ("parts", sizes)}
        self.uses: dict[str, list] = {}  # param key -> [(user, (kind, dim, size) | None)]
        self.row_origins: dict[str, frozenset] = {}
        """A row-parallel matmul's name -> the column-parallel matmuls whose shard it reads: what
        keeping replicated undoes its sharded use of its weight (it cannot be banned itself)."""
        self.col_out: dict[str, int] = {}  # column-parallel matmul -> its output features

    # ------------------------------------------------------------------ helpers
    def st(self, value):
        return self.out.state.get(value) if isinstance(value, fx.Node) else None

    def conflict(self, n: fx.Node, why: str, *args: Any) -> NoReturn:
        shards = [e for arg in args for e in states_of(self.st(arg)) if isinstance(e, Shard)]
        raise TPConflict(frozenset().union(*[e.origins for e in shards]), n, why)

    def set(self, n, state, role=None):
        self.out.state[n] = state
        sharded = any(isinstance(e, Shard) for e in states_of(state))
        self.out.role[n] = role or ("sharded" if sharded else "replicated")
        if not sharded:
            return
        for user in n.users:
            if user.op == "output":
                self.conflict(user, "a sharded tensor is an output of the model", n)
            if user.op == "call_function" and not is_meta_only(user) and self.layer_of(user) != self.layer_of(n):
                self.conflict(
                    user, f"a sharded tensor crosses from layer {self.layer_of(n)} into layer {self.layer_of(user)}", n
                )

    def tag(self, shard: Shard, what):
        """Note what the region of ``s`` turned out to be (heads, loss, fused parts)."""
        for origin in shard.origins:
            self.tags.setdefault(origin, set()).add(what)

    def use(self, param: fx.Node, user: fx.Node, spec):
        self.uses.setdefault(self.params[param], []).append((user, spec))
        if spec is not None:
            self.out.shards_params.setdefault(user, []).append(self.params[param])

    def entering(self, n) -> list:
        """Argument paths of replicated tensors needing grad that enter this sharded op."""
        return [
            path
            for path, arg in flat_args(n)
            if is_tensor_node(arg) and self.st(arg) is None and self.rg.get(arg, False)
        ]

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
                if reads_data(n, self.data):
                    self.data.add(n)
                vals = value_of(n) if isinstance(value_of(n), (list, tuple)) else [value_of(n)]
                floats = any(isinstance(val, torch.Tensor) and val.is_floating_point() for val in vals)
                self.rg[n] = floats and any(self.rg.get(arg, False) for arg in ins)
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
            state = self.st(n.args[0])
            return self.set(n, state[cast(int, n.args[1])] if isinstance(state, list) else None)
        if (
            name in WEIGHT_VIEWS
            and n.args[0] in self.params
            and len(shape_of(n.args[0])) == 2
            and all(op_name(user) in WEIGHTED_MATMULS for user in n.users)
        ):
            self.pviews[n] = arg_node(n, 0)  # its use is recorded by the matmul that reads it
            return self.set(n, None)
        if name in WEIGHTED_MATMULS and self.matmul(n, name):
            return
        if name == "embedding":
            return self.embedding(n)
        sharded = [arg for arg in n.all_input_nodes if isinstance(self.st(arg), Shard)]
        for arg in n.all_input_nodes:
            arg = self.pviews.get(arg, arg)
            if arg in self.params and not isinstance(self.st(arg), Shard):
                self.use(arg, n, None)  # read whole: a replicated use
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
        x, weight, bias = matmul_operands(n)
        out_dim, in_dim = (0, 1) if name == "linear" else (1, 0)  # linear's W is [out, in]
        if name == "addmm" and any(k in n.kwargs for k in ("beta", "alpha")):
            return False
        if weight in self.pviews:  # x @ W.T: the parameter is [out, in] like linear's
            weight, (out_dim, in_dim) = self.pviews[weight], (in_dim, out_dim)
        if (
            not (isinstance(weight, fx.Node) and weight in self.params)
            or x in self.params
            or len(shape_of(weight)) != 2
            or not is_tensor_node(x)
        ):
            return False
        if bias is not None and not (isinstance(bias, fx.Node) and bias in self.params):
            return False
        state = self.st(x)
        if state is None:
            out = shape_of(weight)[out_dim]
            col = n.name not in self.banned
            self.use(weight, n, ("col", out_dim, out) if col else None)
            if bias is not None:
                self.use(bias, n, ("col", 0, out) if col else None)
            if not col:
                self.set(n, None)
                return True
            self.col_out[n.name] = out
            self.out.enter[n] = [(1 if name == "addmm" else 0, None)]
            self.set(n, Shard(len(shape_of(n)) - 1, out, frozenset([n.name])), "col")
            return True
        if not isinstance(state, Shard):
            return False
        if state.dim != len(shape_of(x)) - 1:
            self.conflict(n, "matmul input sharded along a non-contraction dim", x)
        if state.size != shape_of(weight)[in_dim]:
            self.conflict(n, "matmul contraction does not match the sharded features", x)
        self.use(weight, n, ("row", in_dim, state.size))
        self.row_origins[n.name] = state.origins
        if bias is not None:
            self.use(bias, n, None)
        self.set(n, None, "row")
        return True

    def embedding(self, n):
        weight, ids = n.args[0], n.args[1]
        if isinstance(self.st(ids), Shard):
            self.conflict(n, "embedding indices are sharded", ids)
        is_param = isinstance(weight, fx.Node) and weight in self.params
        vocab_parallel = (
            is_param
            and ids in self.data
            and shape_of(weight)
            and shape_of(weight)[0] == self.vocab
            and n.name not in self.banned
            and not node_arg(n, "scale_grad_by_freq", False)
            and not node_arg(n, "sparse", False)
        )
        if is_param:
            self.use(weight, n, ("vocab", 0, self.vocab) if vocab_parallel else None)
        self.set(n, None, "vocab_embedding" if vocab_parallel else None)

    def check_params(self):
        """Every use of a sharded parameter must read the same shard; else undo its users."""
        for key, uses in self.uses.items():
            sharding = [user for user, spec in uses if spec is not None]
            if not sharding:
                continue
            kinds = {(use_spec[1], use_spec[2]) if use_spec is not None else None for _, use_spec in uses}
            if len(kinds) > 1:
                # undo a row-parallel use first (keep the region whose shard it reads replicated:
                # OPT's head behind its column-parallel projection, tied to the vocab-parallel
                # embedding, then splits the vocabulary as the embedding does), else every one
                rows = [self.row_origins[user.name] for user in sharding if user.name in self.row_origins]
                raise TPConflict(
                    frozenset().union(*rows) if rows else frozenset(user.name for user in sharding),
                    sharding[0],
                    f"the weight {key} is used both sharded and replicated (or sharded two ways)",
                )

    def weight_shards(self) -> dict:
        """Parameter key -> ``WeightShard`` (call after a successful walk)."""
        out = {}
        for key, uses in self.uses.items():
            specs = [(user, spec) for user, spec in uses if spec is not None]
            if not specs:
                continue
            tags = set().union(*[self.tags.get(user.name, set()) for user, _ in specs])
            kind, dim, size = specs[0][1]
            parts = [tag[1] for tag in tags if isinstance(tag, tuple) and tag[0] == "parts"]
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
        query, k, value = n.args[:3]
        q_state = self.st(query)
        head_dim = len(shape_of(query)) - 3
        if not (isinstance(q_state, Shard) and q_state.dim == head_dim):
            rows = self.rows_feeding(query)
            if rows:  # q was split and summed back (DeepSeek's low-rank q): keep that split replicated
                raise TPConflict(rows, n, "attention needs q sharded by heads, and a row-parallel matmul made it whole")
            self.conflict(n, "attention needs q sharded by heads", query, k, value)
        heads = shape_of(query)[head_dim]
        scatter, origins = [], set(q_state.origins)
        for i, x in ((1, k), (2, value)):
            state = self.st(x)
            if isinstance(state, Shard):
                if state.dim != head_dim or state.size not in (q_state.size,) and not node_arg(n, "enable_gqa", False):
                    self.conflict(n, f"attention needs {'kv'[i - 1]} sharded by heads like q", x)
                origins |= state.origins
            elif shape_of(x)[head_dim] == q_state.size and q_state.size > 1:  # every query head, repeated: keep ours
                scatter.append(((i, None), head_dim))
            elif shape_of(x)[head_dim] != 1:
                self.conflict(
                    n,
                    f"attention with q sharded by heads reads a replicated {'kv'[i - 1]} "
                    f"of {shape_of(x)[head_dim]} heads (q has {q_state.size})",
                    query,
                )
        for _, mask in flat_args(n):
            if not is_tensor_node(mask) or mask in (query, k, value):
                continue
            mask_shape = shape_of(mask)
            off = len(shape_of(query)) - len(mask_shape)
            if isinstance(self.st(mask), Shard) or (head_dim - off >= 0 and mask_shape[head_dim - off] != 1):
                self.conflict(n, "the attention mask has a per-head dim", query, k, value, mask)
        for x in (query, k, value):
            if isinstance(self.st(x), Shard):
                self.tag(self.st(x), "heads")
        if scatter:
            self.out.scatter[n] = scatter
        self.out.enter[n] = [path for path in self.entering(n) if path not in [entry[0] for entry in scatter]]
        out = Shard(head_dim, q_state.size, frozenset(origins))
        if isinstance(value_of(n), torch.Tensor):
            return self.set(n, out)
        # the kernels' log-sum-exp [b, heads, s] is per head too
        self.set(
            n,
            [out]
            + [
                out
                if isinstance(extra, torch.Tensor)
                and extra.dim() == len(shape_of(query)) - 1
                and hint(extra.shape[head_dim]) == heads
                else None
                for extra in value_of(n)[1:]
            ],
        )

    def rows_feeding(self, x: fx.Node) -> frozenset:
        """The column-parallel origins of the row-parallel matmuls whose (whole) outputs ``x`` is
        computed from within its layer, through replicated values only."""
        found: set[str] = set()
        seen, todo = {x}, [x]
        while todo:
            node = todo.pop()
            if self.out.role.get(node) == "row":
                found |= self.row_origins.get(node.name, frozenset())
                continue
            for arg in node.all_input_nodes:
                if arg not in seen and self.st(arg) is None and self.layer_of(arg) == self.layer_of(x):
                    seen.add(arg)
                    todo.append(arg)
        return frozenset(found - self.banned)

    def loss(self, n, name):
        logits, target = n.args[0], n.args[1]
        state = self.st(logits)
        if (
            not isinstance(state, Shard)
            or isinstance(self.st(target), Shard)
            or len(shape_of(logits)) != 2
            or state.dim != 1
        ):
            self.conflict(n, "cross-entropy needs 2-d logits sharded along the classes", logits)
        if node_arg(n, "weight") is not None or node_arg(n, "label_smoothing", 0.0) != 0.0:
            self.conflict(
                n, "class weights / label smoothing are not supported by the vocab-parallel cross-entropy", logits
            )
        self.tag(state, "loss")
        self.set(n, None, "vocab_loss")

    def view(self, n, name):
        """view / reshape / flatten / unflatten: see ``reshape_dim``."""
        x = n.args[0]
        state = self.st(x)
        src, dst = shape_of(x), shape_of(n)
        groups = reshape_groups(src, dst, state.dim)
        if groups is None or groups[0][0] != state.dim:
            self.conflict(n, "the reshape interleaves the sharded dim with a dim before it", x)
        d_out = groups[1][0]
        if self.tp and len(groups[1]) > 1 and dst[d_out] % self.tp:
            self.conflict(
                n,
                f"the reshape splits the sharded size {src[state.dim]} into "
                f"{' x '.join(str(dst[k]) for k in groups[1])}, and tp={self.tp} does not "
                f"divide {dst[d_out]} (e.g. the key/value heads)",
                x,
            )
        self.set(n, Shard(d_out, dst[d_out], state.origins))

    def layout(self, n, name):
        x = n.args[0]
        state = self.st(x)
        out_dim = moved_dim(n, name, state.dim)
        if out_dim is None:
            self.conflict(n, "squeeze could drop the sharded dim (one entry per rank)", x)
        self.set(n, state.at(out_dim))

    def expand(self, n, name):
        x = n.args[0]
        state = self.st(x)
        self.set(n, state.at(state.dim + len(shape_of(n)) - len(shape_of(x))))

    def new_empty(self, n, name):
        """A buffer shaped like a sharded tensor (DeepSeek's MLA builds its keys in one and fills
        it by slices): sharded alike when its size along the sharded dim is the whole one."""
        x = n.args[0]
        state = self.st(x)
        shape = shape_of(n)
        if len(shape) != len(shape_of(x)) or shape[state.dim] != state.size:
            self.conflict(n, "a new tensor sized unlike the sharded one it is made from", x)
        self.set(n, state)

    def broadcast_expand(self, arg: fx.Node, dim: int, size: int, origins: frozenset) -> bool:
        """Whether ``arg``, a replicated tensor meeting a shard along ``dim`` (its own), is a
        size-1 dim expanded to the shard's whole size and read only there (DeepSeek's MLA expands
        the one rotary key to every head): then it is expanded to the local heads instead, its
        replicated input entering the region (its gradient summed over the ranks)."""
        if op_name(arg) != "expand" or len(arg.users) != 1:
            return False
        source = arg.args[0]
        if not isinstance(source, fx.Node) or isinstance(self.st(source), Shard):
            return False
        lead = len(shape_of(arg)) - len(shape_of(source))
        if dim < lead or shape_of(source)[dim - lead] != 1:
            return False
        self.set(arg, Shard(dim, size, origins))
        self.out.enter[arg] = self.entering(arg)
        return True

    def per_head_parameter(self, arg: fx.Node, dim: int, shard: Shard) -> bool:
        """Whether ``arg``, a replicated tensor meeting ``shard`` along its ``dim``, is a 1-d
        parameter of that dim's whole size reached only through views and expands (attention
        sinks, one logit per head: GPT-OSS concatenates ``sinks.reshape(1, -1, 1, 1).expand(...)``
        to the scores, Granite-SWA subtracts ``sinks.view(1, -1, 1)`` from each head's log-sum):
        then the parameter is cut like the heads, each rank holding its heads' entries (their
        gradients included), and the views and expands are sized to the local heads."""
        if dim >= len(shape_of(arg)) or shape_of(arg)[dim] != shard.size:
            return False
        chain, node = [], arg
        while op_name(node) in ("view", "_unsafe_view", "reshape", "expand") and len(node.users) == 1:
            if shape_of(node).count(shard.size) != 1:  # where the heads are must be unambiguous
                return False
            chain.append(node)
            node = arg_node(node, 0)
        if not chain or node not in self.params or shape_of(node) != [shard.size] or len(node.users) != 1:
            return False
        self.uses[self.params[node]].remove((chain[-1], None))
        self.use(node, chain[-1], ("column", 0, shard.size))
        for link in chain:
            self.set(link, Shard(shape_of(link).index(shard.size), shard.size, shard.origins))
        return True

    def slice(self, n, name):
        x = n.args[0]
        state = self.st(x)
        ndim = len(shape_of(x))
        dim = norm_dim(node_arg(n, "dim", 0), ndim)
        if dim == state.dim and not (name != "select" and shape_of(n)[dim] == shape_of(x)[dim]):
            pieces = self.fused_slices(x, state) if name == "slice" else None
            if pieces is None:
                self.conflict(n, "slicing along the sharded dim", x)
            # one part of a fused projection cut by slices (Phi-3's qkv_proj): as a split of it
            self.tag(state, ("parts", tuple(end - start for start, end in pieces)))
            start, end = slice_bounds(n, state.size)
            return self.set(n, Shard(dim, end - start, state.origins))
        self.set(n, state.at(state.dim - 1 if (name == "select" and dim < state.dim) else state.dim))

    def fused_slices(self, x, state: Shard) -> list[tuple[int, int]] | None:
        """The ``[start, end)`` ranges of ``x``'s slices along its sharded dim when ``x`` is a
        column-parallel projection's output and those slices (unit steps, every user of ``x``)
        cut its features into consecutive parts, as a fused ``[q; k; v]`` split does; else None."""
        if any(self.col_out.get(origin) != state.size for origin in state.origins):
            return None
        ranges = []
        for user in x.users:
            if op_name(user) != "slice" or norm_dim(node_arg(user, "dim", 0), len(shape_of(x))) != state.dim:
                return None
            if node_arg(user, "step", 1) != 1:
                return None
            ranges.append(slice_bounds(user, state.size))
        ranges.sort()
        covered = 0
        for start, end in ranges:
            if start != covered or end <= start:
                return None
            covered = end
        return ranges if covered == state.size else None

    def split(self, n, name):
        x = n.args[0]
        state = self.st(x)
        ndim = len(shape_of(x))
        dim = norm_dim(node_arg(n, "dim", 0), ndim)
        vals = value_of(n)
        if dim != state.dim:
            out = state.at(state.dim - 1 if (name == "unbind" and dim < state.dim) else state.dim)
            return self.set(n, [out for _ in vals])
        # A fused projection split along its features: Megatron layout [q_r; k_r; v_r].
        if name == "unbind" or any(self.col_out.get(origin) != state.size for origin in state.origins):
            self.conflict(
                n, "a split of the sharded dim that is not the output features of the projection that produced it", x
            )
        pieces = tuple(hint(val.shape[dim]) for val in vals)
        self.tag(state, ("parts", pieces))
        self.set(n, [Shard(dim, piece, state.origins) for piece in pieces])

    def cat(self, n, name):
        parts = n.args[0]
        ndim = len(shape_of(n))
        dim = norm_dim(node_arg(n, "dim", 0), ndim)
        first = next(self.st(part) for part in parts if isinstance(self.st(part), Shard))
        for part in parts:
            if not isinstance(self.st(part), Shard) and dim != first.dim:
                self.per_head_parameter(part, first.dim, first)
        states = [self.st(part) for part in parts]
        f = states[0]
        alike = all(isinstance(state, Shard) and (state.dim, state.size) == (f.dim, f.size) for state in states)
        if not alike or (name == "cat" and dim == f.dim):
            self.conflict(n, f"{name} of tensors not all sharded alike, or along the sharded dim", *parts)
        out_dim = f.dim + 1 if (name == "stack" and dim <= f.dim) else f.dim
        self.set(n, Shard(out_dim, f.size, frozenset().union(*[state.origins for state in states])))

    def act_matmul(self, n, name):
        lhs, rhs = n.args[0], n.args[1]
        lhs_state, rhs_state = self.st(lhs), self.st(rhs)
        ndim = len(shape_of(n))
        aligned = (
            isinstance(lhs_state, Shard)
            and isinstance(rhs_state, Shard)
            and len(shape_of(lhs)) == ndim == len(shape_of(rhs))
            and lhs_state.dim == rhs_state.dim
            and lhs_state.dim < ndim - 2
            and lhs_state.size == rhs_state.size
        )
        if not aligned:
            self.conflict(n, "matmul of activations needs both operands sharded on one batch dim", lhs, rhs)
        self.set(n, Shard(lhs_state.dim, lhs_state.size, lhs_state.origins | rhs_state.origins))

    def softmax(self, n, name):
        x = n.args[0]
        state = self.st(x)
        if norm_dim(n.args[1], len(shape_of(x))) == state.dim:
            self.conflict(n, "softmax over the sharded dim", x)
        self.set(n, state)

    def reduce(self, n, name):
        if getattr(n.target, "_overloadname", "") == "other":  # min(x, y) / max(x, y): elementwise
            return self.pointwise(n, name)  # (Apertus' xIELU clamps with torch.min(x, eps))
        x = n.args[0]
        state = self.st(x)
        ndim = len(shape_of(x))
        dims = dims_of(node_arg(n, "dim"), ndim)
        if not dims:
            self.conflict(n, "reduction over every dim of a sharded tensor", x)
        others_sharded = any(isinstance(self.st(arg), Shard) for arg in n.all_input_nodes if arg is not x)
        if (
            dims == [state.dim]
            and name in ("sum", "mean")
            and not others_sharded
            and value_of(n).dtype.is_floating_point
        ):
            # over the whole sharded dim: each rank's partial result, all-reduced (an RMS norm's
            # mean of squares over every query feature, OLMo 2's)
            self.out.partial[n] = state.size
            return self.set(n, None, "partial")
        if state.dim in dims or others_sharded:
            self.conflict(n, "reduction over the sharded dim", x)
        keep = node_arg(n, "keepdim", False)
        out = state.at(state.dim if keep else state.dim - sum(1 for k in dims if k < state.dim))
        self.set(n, out if isinstance(value_of(n), torch.Tensor) else [out for _ in value_of(n)])

    def scan(self, n, name):
        """Shape-preserving ops along given dims (cumsum, flip, roll): fine unless along d."""
        x = n.args[0]
        state = self.st(x)
        dims = dims_of(node_arg(n, "dims" if name in ("flip", "roll") else "dim"), len(shape_of(x)))
        if not dims or state.dim in dims:
            self.conflict(n, "scan along the sharded dim", x)
        self.set(n, state if isinstance(value_of(n), torch.Tensor) else [state for _ in value_of(n)])

    def norm(self, n, name):
        x = n.args[0]
        state = self.st(x)
        normed = len(n.args[1])
        if state.dim >= len(shape_of(x)) - normed or any(
            isinstance(self.st(arg), Shard) for arg in n.all_input_nodes if arg is not x
        ):
            self.conflict(n, "normalization over the sharded dim", x)
        self.out.enter[n] = self.entering(n)
        # native kernels' per-row statistics are sharded along the same rows
        self.set(n, state if isinstance(value_of(n), torch.Tensor) else [state for _ in value_of(n)])

    def passthrough(self, n, name):
        state = self.st(n.args[0])  # type_as(x, other) reads only other's dtype
        self.set(n, state if isinstance(value_of(n), torch.Tensor) or state is None else [state for _ in value_of(n)])

    def pointwise(self, n, name):
        ndim = len(shape_of(n))
        found = None
        for _, arg in flat_args(n):
            state = self.st(arg)
            if isinstance(state, Shard):
                key = (state.dim + ndim - len(shape_of(arg)), state.size)
                if found is not None and found[0] != key:
                    self.conflict(n, "elementwise op mixes differently sharded tensors", *n.all_input_nodes)
                found = (key, (found[1] if found else frozenset()) | state.origins)
        (shard_dim, size), origins = found
        scatter, own = [], []
        for path, arg in flat_args(n):
            if is_tensor_node(arg) and not isinstance(self.st(arg), Shard):
                k = shard_dim - (ndim - len(shape_of(arg)))
                if k < 0 or shape_of(arg)[k] == 1:
                    continue
                if shape_of(arg)[k] == size and not self.rg.get(arg, False):
                    # a constant aligned with the sharded dim (MPT's per-head ALiBi bias added to
                    # the scores): each rank keeps its block, nothing to send either way
                    scatter.append((path, k))
                    continue
                if shape_of(arg)[k] == size and self.broadcast_expand(arg, k, size, origins):
                    continue
                if self.per_head_parameter(arg, k, Shard(k, size, origins)):
                    continue
                if shape_of(arg)[k] == size and arg in self.params and set(arg.users) == {n}:
                    # a per-feature weight read only here (a norm's scale over every query
                    # feature): each rank holds the block its shard multiplies, gradient included
                    self.uses[self.params[arg]].remove((n, None))
                    self.use(arg, n, ("column", k, size))
                    own.append(path)
                    continue
                self.conflict(
                    n,
                    f"elementwise op combines a sharded tensor with a full one ({arg.name}, shape {shape_of(arg)})",
                    *n.all_input_nodes,
                )
        if scatter:
            self.out.scatter[n] = scatter
        self.out.enter[n] = [path for path in self.entering(n) if path not in own]
        out = Shard(shard_dim, size, origins)
        self.set(n, out if isinstance(value_of(n), torch.Tensor) else [out for _ in value_of(n)])


_HANDLERS = {
    **{k: "attention" for k in ATTENTION},
    **{k: "loss" for k in LOSSES},
    **{k: "view" for k in VIEWS},
    **{k: "layout" for k in LAYOUT},
    "expand": "expand",
    "new_empty": "new_empty",
    "copy_": "pointwise",
    "copy": "pointwise",
    **{k: "slice" for k in SLICES},
    **{k: "split" for k in SPLITS},
    **{k: "cat" for k in CATS},
    **{k: "act_matmul" for k in ACT_MATMULS},
    **{k: "softmax" for k in SOFTMAX},
    **{k: "reduce" for k in REDUCTIONS},
    **{k: "scan" for k in SCANS},
    **{k: "norm" for k in NORMS},
    **{k: "passthrough" for k in PASSTHROUGH},
}


def _token_vocab(gm: fx.GraphModule, params: dict, inputs: set) -> int | None:
    """Rows of the first parameter table indexed by data (the token embedding), if any."""
    data = set(inputs)
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if reads_data(n, data):
            data.add(n)
        if op_name(n) == "embedding" and n.args[0] in params and n.args[1] in data:
            return shape_of(n.args[0])[0]
    return None


def analyze_tensor_parallel(
    gm: fx.GraphModule,
    *,
    roles: dict[str, str] | None = None,
    layer_of: Callable | None = None,
    vocab: int | None = None,
    tp: int | None = None,
) -> TPDecisions:
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
            why.update({origin: c for origin in new})
            banned |= new
            continue
        out.weights = walk.weight_shards()
        out.replicated = {k: why[k] for k in sorted(banned)}
        sequence_parallel(gm, out, params, inputs)
        return out
