"""Megatron tensor-parallel propagation: which work, weights and activations divide by tp.

Every tensor is either *replicated* (R: each of the tp ranks holds all of it) or *sharded* along
one dimension d (S(d): each rank holds 1/tp). Walking the graph in order:

- A matmul with a weight whose activation input is R is **column-parallel**: the weight (and its
  bias) is split along the output features, the output is S(last dim), FLOPs divide by tp.
  Backward all-reduces the gradient of its input (once per input tensor: q/k/v reading the same
  normed activation share one all-reduce).
- A matmul whose activation is S along the contraction dim is **row-parallel**: the weight is
  split along the input features, FLOPs divide, the partial outputs are all-reduced (forward
  all-reduce of the output's bytes) and the result is R; its bias is replicated (added after).
- The token embedding (indices derived from a user input) is **vocab-parallel**: its table is
  split by rows, each rank looks up its slice and the output is all-reduced to R. Other tables
  (positions, token types) stay replicated.
- Attention, activations, dropout, views and elementwise ops on S tensors stay S (the sharded
  dim is tracked through reshapes, transposes, splits and broadcasts); their FLOPs and saved
  tensors divide. A weight combined elementwise with an S tensor along d is sharded with it.
- Norms, residual adds and other ops on R tensors stay R.
- A cross-entropy (or log-softmax / NLL) over a vocab-sharded logit tensor is the
  **vocab-parallel loss**: each rank works on its slice and all-reduces per-row maxima,
  sum-exps and target logits (3 fp32 numbers per row).

If a sharded region reaches an op that needs the whole sharded dim (a norm over it, a reduction,
a slice of it, a residual add with a full tensor, the graph output), the column-parallel
matmuls that started the region are made replicated and propagation restarts; this is how
e.g. BERT's MLM transform (dense -> gelu -> LayerNorm) stays replicated while its decoder is
vocab-parallel.

Writes ``node.meta["tp"]`` (a ``TPInfo``) on every node. Needs ``out_bytes``/``shape``
(annotate_shapes) and ``saved`` (annotate_costs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.fx as fx

from passes.common import PassError, has_tensor, hint, is_meta_only, need
from passes.op_class import op_name

__all__ = ["propagate_tensor_parallel", "TPInfo", "vocab_loss_bytes"]

_PASS = "propagate_tensor_parallel"
_ZERO = sympy.Integer(0)


@dataclass
class TPInfo:
    """What tensor parallelism does to one node."""

    role: str
    """col | row | vocab_embedding | vocab_loss | sharded | replicated (placeholders: sharded
    or replicated weights, replicated data)."""
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


class _Conflict(Exception):
    def __init__(self, origins: frozenset, node: fx.Node, why: str):
        super().__init__(why)
        self.origins, self.node, self.why = origins, node, why


_PASSTHROUGH = {"contiguous", "clone", "to", "_to_copy", "alias", "detach", "dropout",
                "native_dropout", "type_as", "lift_fresh_copy", "_assert_tensor_metadata"}
_PARAM_VIEWS = {"t", "transpose", "permute", "view", "reshape", "_to_copy", "to", "alias",
                "detach", "contiguous", "clone", "expand", "unsqueeze", "squeeze", "_unsafe_view"}
_WEIGHTED_MATMUL = {"linear", "mm", "addmm", "matmul"}
_ACT_MATMUL = {"bmm", "matmul", "baddbmm"}
_ATTENTION = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
              "_scaled_dot_product_flash_attention_for_cpu"}
_NORMS = {"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm"}
_LOSSES = {"cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss2d",
           "nll_loss2d_forward", "nll_loss_nd"}
_SOFTMAX = {"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"}
_REDUCE = {"sum", "mean", "amax", "amin", "max", "min", "var", "std", "var_mean", "logsumexp",
           "argmax", "argmin", "norm", "linalg_vector_norm", "prod", "all", "any"}
_SCANS = {"cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "flip", "roll"}
_VIEWS = {"view", "_unsafe_view", "reshape", "flatten", "unflatten"}
_SPLITS = {"split", "split_with_sizes", "chunk", "tensor_split", "_unsafe_split"}
_INDEXING = {"index", "gather", "index_select", "scatter", "scatter_add", "index_put",
             "embedding_bag", "masked_select", "nonzero", "take"}
_NON_DATA = {"sym_size", "sym_stride", "sym_numel", "_assert_scalar", "_assert_tensor_metadata"}


def vocab_loss_bytes(logits: Any, element_size: int) -> tuple[Any, Any]:
    """Memory-bound bytes ``(forward, backward)`` of ``runtime.tensor_parallel``'s vocab-parallel
    cross-entropy over ``logits`` elements (all shards together) of ``element_size`` bytes.

    Forward, in fp32 ``z``: ``amax`` reads z, ``z - m`` reads and writes, ``exp`` reads and writes,
    the row sum reads, the in-place division by the sum reads and writes: 8 passes (the target
    gather is one element per row), after ``logits.float()`` (a read and an fp32 write unless
    the logits are fp32). Backward: the clone of the saved softmax and the in-place scaling, 2
    passes each (the one-hot subtraction touches one element per row), then the cast back to the
    logits' dtype unless fp32. ``tests/test_tensor_parallel.py`` counts the runtime's bytes."""
    f32 = 4 * logits
    cast = 0 if element_size == 4 else (element_size + 4) * logits
    return 8 * f32 + cast, 4 * f32 + cast


def _ndim(n) -> int:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v.dim() if isinstance(v, torch.Tensor) else 0


def _sizes(n: fx.Node) -> list[int]:
    v = n.meta.get("val")
    return [hint(d) for d in v.shape] if isinstance(v, torch.Tensor) else []


def _rows(x: fx.Node, d: int) -> sympy.Expr:
    """Number of rows of ``x`` when dim ``d`` is the row length (product of the other dims)."""
    shape = need(x, "shape", _PASS, "annotate_shapes")
    return sympy.expand(sympy.Mul(*[e for k, e in enumerate(shape) if k != d]))


def _norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _map_reshape(src: list[int], dst: list[int], d: int) -> int | None:
    """Where dim ``d`` of ``src`` lands after a reshape to ``dst`` (by grouping equal products);
    None if ``d`` is not the leading non-unit dim of its group (its shards would interleave)."""
    i = j = 0
    while i < len(src) or j < len(dst):
        gi, gj = [], []
        pi = pj = 1
        while i < len(src) and src[i] == 1 and i != d:
            i += 1
        while j < len(dst) and dst[j] == 1:
            j += 1
        if i >= len(src) and j >= len(dst):
            break
        if i < len(src):
            gi.append(i); pi *= src[i]; i += 1
        if j < len(dst):
            gj.append(j); pj *= dst[j]; j += 1
        while pi != pj:
            if pi < pj and i < len(src):
                gi.append(i); pi *= src[i]; i += 1
            elif pj < pi and j < len(dst):
                gj.append(j); pj *= dst[j]; j += 1
            else:
                return None
        if d in gi:
            lead_src = next((k for k in gi if src[k] != 1), gi[0])
            lead_dst = next((k for k in gj if dst[k] != 1), gj[0] if gj else None)
            return lead_dst if d == lead_src else None
    return None


class _Propagator:
    def __init__(self, gm: fx.GraphModule, roles: dict[str, str], banned: set[str]):
        self.gm, self.roles, self.banned = gm, roles, banned
        self.state: dict[fx.Node, Any] = {}
        self.origin: dict[fx.Node, frozenset] = {}
        self.info: dict[fx.Node, TPInfo] = {}
        self.param_of: dict[fx.Node, fx.Node] = {}
        self.data_dep: set[fx.Node] = set()
        self.bwd_reduced: set[fx.Node] = set()

    # ---- helpers
    def st(self, a):
        return self.state.get(a) if isinstance(a, fx.Node) else None

    def org(self, *nodes) -> frozenset:
        out = frozenset()
        for a in nodes:
            if isinstance(a, fx.Node):
                out |= self.origin.get(a, frozenset())
        return out

    def conflict(self, node, why, *args):
        raise _Conflict(self.org(*args), node, why)

    def set(self, node, role, state, origins=frozenset(), **kw):
        self.state[node] = state
        self.origin[node] = origins if state is not None else frozenset()
        divides = role in ("col", "row", "sharded", "vocab_loss")
        self.info[node] = TPInfo(role=role, shard_dim=state, divides=divides, **kw)

    def tensor_args(self, node):
        flat = []
        for a in list(node.args) + list(node.kwargs.values()):
            if isinstance(a, (list, tuple)):
                flat.extend(x for x in a if isinstance(x, fx.Node))
            elif isinstance(a, fx.Node):
                flat.append(a)
        return [a for a in flat if isinstance(a.meta.get("val"), torch.Tensor)]

    def sharded_args(self, node):
        return [a for a in self.tensor_args(node) if isinstance(self.st(a), int)]

    # ---- the walk
    def run(self):
        for n in self.gm.graph.nodes:
            if n.op == "placeholder":
                role = self.roles.get(n.name, "input")
                if role == "param":
                    self.param_of[n] = n
                if role == "input":
                    self.data_dep.add(n)
                self.set(n, "replicated", None)
                continue
            if n.op == "output":
                bad = [a for a in self.tensor_args(n) if self.st(a) is not None]
                if bad:
                    self.conflict(n, "a sharded tensor is a graph output", *bad)
                self.set(n, "replicated", None)
                continue
            if n.op != "call_function":
                self.set(n, "replicated", None)
                continue
            ins = self.tensor_args(n)
            if any(a in self.data_dep for a in ins):
                self.data_dep.add(n)
            name = op_name(n)
            if name in _PARAM_VIEWS and n.args and isinstance(n.args[0], fx.Node) \
                    and n.args[0] in self.param_of:
                self.param_of[n] = self.param_of[n.args[0]]
                self.set(n, "replicated", None)
                continue
            self.visit(n, name, ins)

    def visit(self, n: fx.Node, name: str, ins: list[fx.Node]):
        if name == "getitem":
            src, idx = n.args
            s = self.st(src)
            self.set(n, "sharded" if isinstance(s, list) and s[idx] is not None else "replicated",
                     s[idx] if isinstance(s, list) else None, self.org(src))
            return
        if name in _NON_DATA or is_meta_only(n) or not has_tensor(n.meta.get("val")):
            self.set(n, "replicated", None)
            return
        if name in _WEIGHTED_MATMUL and self._weighted_matmul(n, name):
            return
        if name == "embedding":
            return self._embedding(n)
        sharded = self.sharded_args(n)
        if not sharded:
            self.set(n, "replicated", None)
            return
        if name in _ATTENTION:
            return self._attention(n, sharded)
        if name in _ACT_MATMUL:
            return self._act_matmul(n, sharded)
        if name in _LOSSES:
            return self._loss(n, sharded)
        if name in _NORMS:
            return self._norm(n, sharded)
        if name in _SOFTMAX:
            return self._softmax(n, name, sharded)
        if name in _REDUCE:
            return self._reduce(n, sharded)
        if name in _SCANS:
            return self._scan(n, sharded)
        if name in _PASSTHROUGH:
            return self.set(n, "sharded", self.st(n.args[0]), self.org(n.args[0]))
        if name in _VIEWS or name in ("transpose", "t", "permute", "movedim", "unsqueeze",
                                      "squeeze", "expand", "expand_as", "slice", "select",
                                      "narrow", "repeat_interleave", "repeat"):
            return self._layout(n, name, sharded)
        if name in _SPLITS or name == "unbind":
            return self._split(n, name, sharded)
        if name in ("cat", "stack"):
            return self._cat(n, name, sharded)
        if name in _INDEXING:
            self.conflict(n, "indexing into a sharded tensor", *sharded)
        return self._pointwise(n, ins)

    # ---- handlers
    def _weighted_matmul(self, n, name) -> bool:
        a = list(n.args)
        if name == "linear":
            act, w, bias = a[0], a[1], (a[2] if len(a) > 2 else n.kwargs.get("bias"))
        elif name == "addmm":
            bias, act, w = a[0], a[1], a[2]
        else:
            act, w, bias = a[0], a[1], None
        if not (isinstance(w, fx.Node) and w in self.param_of) or act in self.param_of:
            return False
        wp = self.param_of[w]
        bp = self.param_of.get(bias) if isinstance(bias, fx.Node) else None
        s = self.st(act)
        if s is None:
            if n.name in self.banned:
                self.set(n, "replicated", None)
                return True
            bwd = _ZERO
            if act not in self.bwd_reduced:
                self.bwd_reduced.add(act)
                bwd = need(act, "out_bytes", _PASS, "annotate_shapes")
            self.set(n, "col", _ndim(n) - 1, frozenset([n.name]), allreduce_bwd=bwd,
                     sharded_params=[p.name for p in (wp, bp) if p is not None])
            return True
        if s == _ndim(act) - 1:
            self.set(n, "row", None, allreduce_fwd=need(n, "out_bytes", _PASS, "annotate_shapes"),
                     sharded_params=[wp.name])
            return True
        self.conflict(n, "matmul input sharded along a non-contraction dim", act)
        return True

    def _embedding(self, n):
        w, idx = n.args[0], n.args[1]
        if self.st(idx) is not None:
            self.conflict(n, "embedding indices are sharded", idx)
        if isinstance(w, fx.Node) and w in self.param_of and idx in self.data_dep:
            self.set(n, "vocab_embedding", None,
                     allreduce_fwd=need(n, "out_bytes", _PASS, "annotate_shapes"),
                     sharded_params=[self.param_of[w].name])
        else:
            self.set(n, "replicated", None)

    def _attention(self, n, sharded):
        q, k, v = n.args[:3]
        heads = {self.st(x) for x in (q, k, v)}
        if heads != {_ndim(q) - 3}:
            self.conflict(n, "attention inputs must all be sharded by heads", q, k, v)
        extra = [a for a in sharded if a not in (q, k, v)]
        if extra:
            self.conflict(n, "attention mask/bias is sharded", *extra)
        self.set(n, "sharded", _ndim(n) - 3 if not isinstance(n.meta.get("val"), tuple) else
                 [_ndim(q) - 3] + [None] * (len(n.meta["val"]) - 1), self.org(q, k, v))

    def _act_matmul(self, n, sharded):
        ins = [a for a in n.args[:3] if isinstance(a, fx.Node)]
        dims = {self.st(a) for a in ins[-2:]}
        nd = _ndim(n)
        if len(dims) == 1 and None not in dims and next(iter(dims)) < nd - 2:
            return self.set(n, "sharded", next(iter(dims)), self.org(*ins))
        self.conflict(n, "activation matmul needs both operands sharded on a batch dim", *ins)

    def _loss(self, n, sharded):
        logits = n.args[0]
        cls_dim = min(1, _ndim(logits) - 1)
        if sharded != [logits] or self.st(logits) != cls_dim:
            self.conflict(n, "loss inputs sharded other than along the classes", *sharded)
        ce = op_name(n) == "cross_entropy_loss"
        words = 3 if ce else 1  # max, sum-exp, target logit: one all-reduce each
        rows = _rows(logits, cls_dim)
        extra = {}
        if ce:  # the runtime's vocab-parallel cross-entropy replaces the traced one
            size = logits.meta["val"].element_size()
            full = rows * need(logits, "shape", _PASS, "annotate_shapes")[cls_dim]
            fwd, bwd = vocab_loss_bytes(full, size)
            extra = dict(loss_fwd_bytes=sympy.expand(fwd - n.meta.get("fwd_bytes", _ZERO)),
                         loss_bwd_bytes=sympy.expand(bwd - n.meta.get("bwd_bytes", _ZERO)))
        self.set(n, "vocab_loss", None, allreduce_fwd=rows * 4 * words,
                 allreduce_fwd_calls=words, **extra)

    def _norm(self, n, sharded):
        x = n.args[0]
        nd = _ndim(x)
        normed = len(n.args[1]) if len(n.args) > 1 and isinstance(n.args[1], (list, tuple)) else 1
        d = self.st(x)
        if sharded != [x] or d is None or d >= nd - normed:
            self.conflict(n, "normalization over a sharded dim", *sharded)
        val = n.meta["val"]
        state = d if isinstance(val, torch.Tensor) else [d] + [None] * (len(val) - 1)
        self.set(n, "sharded", state, self.org(x))

    def _softmax(self, n, name, sharded):
        x = n.args[0]
        d = self.st(x)
        dim = _norm_dim(n.args[1], _ndim(x))
        if dim != d:
            return self.set(n, "sharded", d, self.org(x))
        if "log" not in name:
            self.conflict(n, "softmax over a sharded dim", x)
        self.set(n, "vocab_loss", d, self.org(x), allreduce_fwd=_rows(x, d) * 4 * 2)

    def _reduce(self, n, sharded):
        x = n.args[0]
        d = self.st(x)
        nd = _ndim(x)
        dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        if dims is None or sharded != [x]:
            self.conflict(n, "reduction over all dims of a sharded tensor", *sharded)
        dims = [_norm_dim(int(k), nd) for k in (dims if isinstance(dims, (list, tuple))
                                                  else [dims])]
        if d in dims:
            self.conflict(n, "reduction over a sharded dim", x)
        keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
        out = d if keep else d - sum(1 for k in dims if k < d)
        val = n.meta["val"]
        state = out if isinstance(val, torch.Tensor) else [out] * len(val)
        self.set(n, "sharded", state, self.org(x))

    def _scan(self, n, sharded):
        """Shape-preserving ops along given dims (cumsum, flip, roll): fine unless along d."""
        x = n.args[0]
        d = self.st(x)
        dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dims", n.kwargs.get("dim"))
        dims = dims if isinstance(dims, (list, tuple)) else [dims]
        if sharded != [x] or any(k is None or _norm_dim(int(k), _ndim(x)) == d for k in dims):
            self.conflict(n, "scan along a sharded dim", *sharded)
        val = n.meta["val"]
        state = d if isinstance(val, torch.Tensor) else [d] * len(val)
        self.set(n, "sharded", state, self.org(x))

    def _layout(self, n, name, sharded):
        x = n.args[0]
        if sharded != [x]:
            self.conflict(n, f"{name} with a sharded size argument", *sharded)
        d, nd, out = self.st(x), _ndim(x), None
        a = n.args
        if name in _VIEWS:
            out = _map_reshape(_sizes(x), _sizes(n), d)
        elif name == "t":
            out = 1 - d if nd == 2 else d
        elif name == "transpose":
            i, j = _norm_dim(a[1], nd), _norm_dim(a[2], nd)
            out = j if d == i else i if d == j else d
        elif name == "permute":
            perm = [_norm_dim(p, nd) for p in a[1]]
            out = perm.index(d)
        elif name == "movedim":
            out = None
        elif name == "unsqueeze":
            k = _norm_dim(a[1], nd + 1)
            out = d + 1 if k <= d else d
        elif name == "squeeze":
            out = _map_reshape(_sizes(x), _sizes(n), d)
        elif name in ("expand", "expand_as", "repeat"):
            out = d + (_ndim(n) - nd)
        elif name in ("slice", "narrow", "select"):
            k = _norm_dim(a[1] if len(a) > 1 else 0, nd)
            if k == d:
                full = name == "slice" and (len(a) < 3 or a[2] in (0, None)) and \
                    (len(a) < 4 or a[3] is None or hint(a[3]) >= _sizes(x)[d])
                out = d if full else None
            else:
                out = d - 1 if (name == "select" and k < d) else d
        elif name == "repeat_interleave":
            out = d
        if out is None:
            self.conflict(n, f"{name} splits or slices the sharded dim", x)
        self.set(n, "sharded", out, self.org(x))

    def _split(self, n, name, sharded):
        x = n.args[0]
        d = self.st(x)
        nd = _ndim(x)
        dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)
        dim = _norm_dim(dim, nd)
        k = len(n.meta["val"])
        if name == "unbind":
            if dim == d:
                self.conflict(n, "unbind of the sharded dim", x)
            return self.set(n, "sharded", [d - (dim < d)] * k, self.org(x))
        # Splitting a fused projection along its sharded features (GPT-2's c_attn -> q, k, v):
        # Megatron lays the fused weight out so that each rank's slice holds its own heads.
        self.set(n, "sharded", [d] * k, self.org(x))

    def _cat(self, n, name, sharded):
        parts = n.args[0]
        states = {self.st(p) for p in parts}
        if len(states) != 1:
            self.conflict(n, f"{name} of sharded and replicated tensors", *parts)
        d = next(iter(states))
        dim = _norm_dim(n.args[1] if len(n.args) > 1 else 0, _ndim(n))
        out = d if name == "cat" else (d + 1 if dim <= d else d)
        self.set(n, "sharded", out, self.org(*parts))

    def _pointwise(self, n, ins):
        nd = _ndim(n)
        dims, owned = set(), []
        for a in ins:
            s = self.st(a)
            if isinstance(s, int):
                dims.add(s + nd - _ndim(a))
        if len(dims) != 1:
            self.conflict(n, "elementwise op mixes different sharded dims", *ins)
        d = next(iter(dims))
        for a in ins:
            if self.st(a) is not None:
                continue
            k = d - (nd - _ndim(a))
            if k < 0 or _sizes(a)[k] == 1:
                continue  # broadcast along the sharded dim: every rank uses all of it
            if a in self.param_of:
                owned.append(self.param_of[a].name)  # a weight sliced along with the shards
            else:
                self.conflict(n, "elementwise op combines a sharded tensor with a full one",
                              *ins)
        self.set(n, "sharded", d, self.org(*ins), sharded_params=owned)


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


def propagate_tensor_parallel(gm: fx.GraphModule, roles: dict[str, str]) -> fx.GraphModule:
    """Write ``meta['tp']`` on every node (see module doc)."""
    banned: set[str] = set()
    candidates = {n.name for n in gm.graph.nodes if op_name(n) in _WEIGHTED_MATMUL}
    while True:  # each retry bans at least one more column-parallel matmul: terminates
        prop = _Propagator(gm, roles, banned)
        try:
            prop.run()
            break
        except _Conflict as c:
            new = c.origins - banned
            if not new and banned >= candidates:
                raise PassError(_PASS, c.node, f"cannot place this op even with every matmul "
                                f"replicated ({c.why}).") from None
            banned |= new or candidates
    by_name = {n.name: n for n in gm.graph.nodes}
    sharded_params: set[str] = set()
    for n in gm.graph.nodes:
        sharded_params.update(prop.info[n].sharded_params)
    for n in gm.graph.nodes:
        info = prop.info[n]
        if n.op == "placeholder" and roles.get(n.name) == "param":
            info.role = "sharded" if n.name in sharded_params else "replicated"
        if n.op != "placeholder" and n.op != "output":
            info.saved_bytes_tp = _saved_tp(n, prop.info, by_name)
        n.meta["tp"] = info
    return gm
