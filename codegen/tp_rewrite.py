"""Megatron tensor parallelism as a rewrite of the exported ATen graph.

Every tp rank runs the same generated code on its own weight shards. ``build_tp_rewrite`` first
*analyzes* the whole exported graph (once, on meta) and decides, per node, what tensor parallelism
does to it; the returned ``rewrite(g, lg)`` then applies those decisions to each layer's freshly
built ``fx.Graph`` before ``codegen.lower`` prints it.

States
------
Each tensor value is *replicated* (every rank holds all of it) or *sharded* along one dim ``d``:
rank ``r`` holds the contiguous block ``[r * n/t, (r + 1) * n/t)`` of the ``n`` entries of ``d``
(``t`` = tp). A sharded value is recorded as ``(d, local, full)``; ``local * t == full`` except for
a vocabulary that ``t`` does not divide, which is padded to ``ceil(V / t) * t`` rows.

Rules (the walk is in graph order)
----------------------------------
* ``linear(x, W, b)`` / ``addmm(b, x, W)`` with a parameter weight and a replicated activation is
  **column parallel**: ``W`` keeps this rank's output features, ``b`` likewise, the output is
  sharded along its last dim. The input passes through ``copy_to_tp`` (identity forward,
  all-reduce of the gradient backward): each rank's ``dy_r W_r`` is only part of ``dx``.
* A matmul whose activation is sharded along the contraction dim is **row parallel**:
  ``y = reduce_from_tp(x_r W_r^T) + b`` (``runtime.tensor_parallel.row_parallel_linear``), the
  replicated bias added once, after the all-reduce. ``W`` keeps this rank's input features.
* Inside a sharded region, views, reshapes and expands get their size argument along the sharded
  dim divided by ``t`` (hidden -> hidden/t, heads -> heads/t, kv heads -> kv_heads/t, ffn ->
  ffn/t). A reshape that merges or splits the sharded dim is exact only when the sharded dim
  *leads* its group of merged dims (the rank's block of the flattened group is then contiguous)
  and ``t`` divides the leading dim on the other side; otherwise it is refused.
* Elementwise ops, dropout, casts, transposes, norms and reductions over other dims keep the
  sharding; SDPA on q, k and v sharded by heads is unchanged (GQA keeps its ratio because ``t``
  divides both head counts). Any *replicated* tensor that requires grad and enters a sharded op
  (a broadcast scale, a learnable mask, the input of a column-parallel matmul) goes through
  ``copy_to_tp``, because each rank's gradient for it covers only its shard.
* The token embedding (a parameter table with ``V`` rows indexed by data) is **vocab parallel**:
  ``vocab_parallel_embedding(ids, W_r, vocab_start)`` with ``vocab_start = tp_rank() * V_r``
  computed at run time. A column-parallel matmul with ``V`` outputs (the LM head) followed by
  ``aten.cross_entropy_loss`` becomes vocab-sharded logits and ``vocab_parallel_cross_entropy``;
  the full logits never exist on one rank.
* A fused projection split along its sharded features (GPT-2's ``c_attn`` -> q, k, v) needs the
  Megatron weight layout ``[q_r; k_r; v_r]``: its shard kind is ``"qkv"`` with the ``parts`` sizes;
  the split size is divided by ``t``. This needs runtime support for that kind (probed at
  compile time; a clear error otherwise).

Anything a sharded value meets that is not covered above (a norm or reduction over the sharded
dim, a residual add with a full tensor, a layer boundary, the graph output) is a *conflict*: the
column-parallel matmuls and vocab-parallel embeddings that started the region are made replicated
and the analysis restarts (a BERT MLM transform ``dense -> gelu -> LayerNorm`` stays replicated),
as in ``passes.tensor_parallel``. Once the regions are settled, a final pass checks that ``t``
divides every size of the regions that stay sharded (heads, kv heads, ffn, hidden). An unavoidable
conflict or an indivisible size is an error naming the node, its module, source line and the
model's dims: never silently wrong math.

Parameter shapes: the sharded parameters of ``gm`` (which lives on meta) are replaced by meta
parameters of the *shard* shape, so ``codegen.lower`` writes shard shapes into each generated
``__init__`` and the manifest records them. ``shard_info`` maps every sharded original FQN to
``{"dim", "kind", "size"[, "padded"][, "parts"]}``, the manifest form of
``runtime.sharding.TensorShard``, which cuts each rank's piece of the original weights and joins
the pieces back.
"""

from __future__ import annotations

import math
import operator
import os
import re
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx

from codegen.errors import TPRewriteError
from passes.common import source_line
from runtime import tensor_parallel as rtp
from runtime.sharding import TensorShard

__all__ = ["build_tp_rewrite", "TPRewriteError", "TPAnalysis", "Sharded", "analyze_tp", "reshape_shard",
           "local_size"]

aten = torch.ops.aten

_IGNORED = {aten._assert_tensor_metadata.default}
_PASSTHROUGH = {"dropout", "to", "_to_copy", "contiguous", "alias", "detach", "clone", "type_as",
                "lift_fresh_copy"}
_REDUCTIONS = {"mean": 1, "sum": 2, "none": 0}
# Op (overload, or name) with a sharded input -> _Analyzer method; other ops must be pointwise.
_HANDLERS = {
    aten.scaled_dot_product_attention.default: "attention", aten.cross_entropy_loss.default: "loss",
    aten.view.default: "view", aten._unsafe_view.default: "view", aten.reshape.default: "view",
    aten.flatten.using_ints: "view", aten.unflatten.int: "view", aten.expand.default: "expand",
    aten.slice.Tensor: "slice", aten.select.int: "slice", aten.cat.default: "cat",
    aten.split.Tensor: "split", aten.split_with_sizes.default: "split", aten.chunk.default: "split",
    aten.matmul.default: "act_matmul", aten.bmm.default: "act_matmul",
    **{k: "layout" for k in ("transpose", "t", "permute", "unsqueeze", "squeeze")},
    **{k: "softmax" for k in ("softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax")},
    **{k: "reduce" for k in ("mean", "sum", "amax", "amin", "var", "std", "logsumexp")},
    "layer_norm": "norm", "rms_norm": "norm",
}


class _Conflict(Exception):
    """A sharded region reached an op it cannot pass; ``origins`` started that region."""

    def __init__(self, origins: frozenset, node: fx.Node, why: str):
        super().__init__(why)
        self.origins, self.node, self.why = origins, node, why


@dataclass(frozen=True)
class Sharded:
    """A value sharded along ``dim``: each rank holds ``local`` of the ``full`` entries."""

    dim: int
    local: int
    full: int
    origins: frozenset = frozenset()
    padded: bool = False
    """``local * tp > full``: a vocabulary padded up to a multiple of tp."""

    def at(self, dim: int) -> "Sharded":
        """The same shard, now along ``dim`` (after a transpose, unsqueeze ...)."""
        return Sharded(dim, self.local, self.full, self.origins, self.padded)


@dataclass
class TPAnalysis:
    """What tensor parallelism does to the exported graph."""

    tp: int
    state: dict = field(default_factory=dict)
    """Node -> ``Sharded`` | None (replicated) | list of those (multi-output ops)."""
    actions: dict = field(default_factory=dict)
    """Node name -> (kind, payload): col, row, size (a size argument), split, embed, loss."""
    enter: dict = field(default_factory=dict)
    """Node name -> argument positions (flat) of replicated tensors that enter a sharded op."""
    shard_info: dict = field(default_factory=dict)
    """Original FQN -> shard spec for the runtime."""
    replicated: dict = field(default_factory=dict)
    """Node name of a matmul/embedding made replicated -> why (the conflict that forced it)."""


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _shape(n) -> list[int]:
    v = _val(n)
    return [int(d) for d in v.shape] if isinstance(v, torch.Tensor) else []


def _is_tensor(n) -> bool:
    return isinstance(n, fx.Node) and isinstance(_val(n), torch.Tensor)


def _opname(n: fx.Node) -> str:
    t = n.target
    return getattr(t, "_opname", getattr(t, "__name__", str(t)))


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _user_line(n: fx.Node) -> str:
    """``file:line`` of the innermost frame outside torch itself ('' if unknown)."""
    hits = [(f, ln) for f, ln in _FRAME.findall(n.meta.get("stack_trace") or "")
            if not f.startswith(_TORCH_DIR)]
    return f"{hits[-1][0]}:{hits[-1][1]}" if hits else source_line(n)


def _where(n: fx.Node) -> str:
    """``node 'x' (op) in module a.b, from file:line`` for error messages."""
    stack = n.meta.get("nn_module_stack") or {}
    mod = list(stack.values())[-1][0] if stack else ""
    src = _user_line(n)
    return (f"node {n.name!r} ({n.target})" + (f" in module {mod!r}" if mod else "")
            + (f", from {src}" if src else ""))


def _flat_args(n: fx.Node) -> list:
    """Positional then keyword arguments, lists flattened, as (path, value) pairs."""
    out = []
    for i, a in enumerate(n.args):
        if isinstance(a, (list, tuple)):
            out += [((i, j), x) for j, x in enumerate(a)]
        else:
            out.append(((i, None), a))
    for k, a in n.kwargs.items():
        out.append(((k, None), a))
    return out


def _groups(src: list[int], dst: list[int], d: int):
    """Groups of non-unit dims with equal products, ``(src dims, dst dims)`` holding ``d``."""
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


def reshape_shard(src: list[int], dst: list[int], d: int, tp: int, padded: bool = False,
                  strict: bool = True):
    """Where a tensor sharded along ``d`` is sharded after ``reshape(src -> dst)``.

    Returns ``(d_out, local_out)``: each rank's block of the reshaped tensor is its block of
    ``dst[d_out]`` (``local_out`` entries) with every other dim whole. That holds when ``d`` leads
    its group of merged/split dims, since rank ``r``'s block of the flattened group is then the
    contiguous ``[r * P/tp, (r + 1) * P/tp)`` of the group's product ``P``, which in ``dst`` is a
    block of its leading dim iff ``tp`` divides that dim. Returns None when ``d`` does not lead
    its group (the shards would interleave) or a padded dim would be merged; raises ValueError when
    ``tp`` does not divide the new leading dim (e.g. 3 heads over 2 ranks) unless not ``strict``.
    """
    g = _groups(src, dst, d)
    if g is None or g[0][0] != d:
        return None
    gi, gj = g
    d_out = gj[0]
    if padded:
        return (d_out, None) if len(gi) == 1 and len(gj) == 1 else None
    if dst[d_out] % tp and strict:
        raise ValueError(f"reshaping {src} -> {dst} splits the sharded size {src[d]} into "
                         f"{' x '.join(str(dst[k]) for k in gj)}, and tp={tp} does not divide "
                         f"{dst[d_out]} (e.g. the number of attention heads)")
    return d_out, dst[d_out] // tp


class _Analyzer:
    def __init__(self, gm: fx.GraphModule, layer_of: Callable, ctx: dict, banned: set[str],
                 strict: bool):
        self.gm, self.layer_of, self.ctx, self.banned = gm, layer_of, ctx, banned
        self.strict = strict
        self.tp = ctx["tp"]
        self.a = TPAnalysis(self.tp)
        self.params: dict[fx.Node, str] = {}
        self.trainable = {name for name, _ in gm.named_parameters(remove_duplicate=False)}
        self.rg: dict[fx.Node, bool] = {}
        self.data: set[fx.Node] = set()
        self.tags: dict[str, set] = {}  # origin node name -> {"heads", "loss", ("parts", ...)}
        self.param_uses: dict[str, list] = {}  # fqn -> [(user name, spec | None)]
        self.col_out: dict[str, int] = {}  # column-parallel matmul -> its output features

    # ------------------------------------------------------------------ helpers
    def st(self, a):
        return self.a.state.get(a) if isinstance(a, fx.Node) else None

    def conflict(self, n, why, *args):
        states = [e for x in args for e in (self.st(x) if isinstance(self.st(x), list) else [self.st(x)])]
        raise _Conflict(frozenset().union(*[e.origins for e in states if isinstance(e, Sharded)]), n, why)

    def fail(self, n, why, hint="Choose a tp that divides these sizes."):
        """A size tp does not divide: an error in the strict pass (the region stays sharded)."""
        if self.strict:
            raise TPRewriteError(f"tensor parallelism (tp={self.tp}) at {_where(n)}: {why} "
                                 f"(model dims: {self.ctx['dims']}). {hint}")

    def set(self, n, s):
        self.a.state[n] = s
        if not any(isinstance(e, Sharded) for e in (s if isinstance(s, list) else [s])):
            return
        for u in n.users:
            if u.op == "output":
                self.conflict(u, "a sharded tensor is an output of the model", n)
            if u.op == "call_function" and u.target not in _IGNORED and \
                    self.layer_of(u) != self.layer_of(n):
                self.conflict(u, f"a sharded tensor crosses from layer {self.layer_of(n)} into layer "
                              f"{self.layer_of(u)}", n)

    def tag(self, s: Sharded, t):
        """Note what the region of ``s`` turned out to be (heads, loss, fused parts)."""
        for o in s.origins:
            self.tags.setdefault(o, set()).add(t)

    def use(self, p: fx.Node, user: fx.Node, spec):
        self.param_uses.setdefault(self.params[p], []).append((user.name, spec))

    def shard_of(self, n, full: int, dim: int, origins=frozenset(), allow_pad=False) -> Sharded:
        if full % self.tp and not allow_pad:
            self.fail(n, f"this column-parallel matmul has {full} output features, which "
                      f"tp={self.tp} does not divide")
        return Sharded(dim, math.ceil(full / self.tp), full, origins, bool(full % self.tp and allow_pad))

    # ------------------------------------------------------------------ the walk
    def run(self) -> TPAnalysis:
        for n in self.gm.graph.nodes:
            if n.op == "get_attr":
                self.params[n] = n.target
                self.rg[n] = n.target in self.trainable
                self.set(n, None)
            elif n.op == "placeholder":
                self.data.add(n)
                self.rg[n] = False
                self.set(n, None)
            elif n.op == "call_function":
                ins = n.all_input_nodes
                if any(a in self.data for a in ins):
                    self.data.add(n)
                vals = _val(n) if isinstance(_val(n), (list, tuple)) else [_val(n)]
                floats = any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in vals)
                self.rg[n] = floats and any(self.rg.get(a, False) for a in ins)
                if n.target in _IGNORED:
                    self.set(n, None)
                    continue
                self.visit(n)
            else:
                self.set(n, None)
        self.check_params()
        return self.a

    def visit(self, n: fx.Node):
        name = _opname(n)
        t = n.target
        if t is operator.getitem:
            s = self.st(n.args[0])
            return self.set(n, s[n.args[1]] if isinstance(s, list) else None)
        if t in (aten.linear.default, aten.addmm.default, aten.mm.default) and self.matmul(n):
            return
        if t is aten.embedding.default:
            return self.embedding(n)
        sharded = [a for a in n.all_input_nodes if isinstance(self.st(a), Sharded)]
        if not sharded:
            # Params read by something that is not a sharded-weight use: replicated use.
            for a in n.all_input_nodes:
                if a in self.params:
                    self.use(a, n, None)
            return self.set(n, None)
        for a in n.all_input_nodes:
            if a in self.params and not isinstance(self.st(a), Sharded):
                self.use(a, n, None)
        handler = _HANDLERS.get(t) or _HANDLERS.get(name)
        if handler is None and (name in _PASSTHROUGH or torch.Tag.pointwise in getattr(t, "tags", ())):
            handler = "pointwise"
        if handler is None or (handler == "reduce" and len(n.args) < 2):
            self.conflict(n, f"{name} is not known to be safe on a tensor-parallel shard", *sharded)
        getattr(self, handler)(n)

    # ------------------------------------------------------------------ handlers
    def matmul(self, n) -> bool:
        """Column- or row-parallel weighted matmul; False if the weight is not a parameter."""
        t = n.target
        if t is aten.linear.default:
            x, w = n.args[0], n.args[1]
            b = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
            out_dim, in_dim = 0, 1
        elif t is aten.addmm.default:
            b, x, w = n.args[0], n.args[1], n.args[2]
            if any(k in n.kwargs for k in ("beta", "alpha")):
                return False
            out_dim, in_dim = 1, 0
        else:
            x, w, b = n.args[0], n.args[1], None
            out_dim, in_dim = 1, 0
        if not (isinstance(w, fx.Node) and w in self.params) or x in self.params \
                or len(_shape(w)) != 2:
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
            self.a.actions[n.name] = ("col", t)
            self.col_out[n.name] = out
            self.a.enter[n.name] = [(1 if t is aten.addmm.default else 0, None)]
            self.set(n, self.shard_of(n, out, len(_shape(n)) - 1, frozenset([n.name]),
                                      allow_pad=(out == self.ctx.get("vocab"))))
            return True
        if not isinstance(s, Sharded):
            return False
        if s.dim != len(_shape(x)) - 1 or s.padded:
            self.conflict(n, "matmul input sharded along a non-contraction dim", x)
        if s.full != _shape(w)[in_dim]:
            self.conflict(n, "matmul contraction does not match the sharded features", x)
        self.a.actions[n.name] = ("row", t)
        self.use(w, n, ("row", in_dim, s.full))
        if b is not None:
            self.use(b, n, None)
        self.set(n, None)
        return True

    def embedding(self, n):
        w, ids = n.args[0], n.args[1]
        opts = dict(zip(("padding_idx", "scale_grad_by_freq", "sparse"), n.args[2:]))
        opts.update(n.kwargs)
        if isinstance(self.st(ids), Sharded):
            self.conflict(n, "embedding indices are sharded", ids)
        vocab = self.ctx.get("vocab")
        ok = (isinstance(w, fx.Node) and w in self.params and ids in self.data
              and _shape(w) and _shape(w)[0] == vocab and n.name not in self.banned
              and not opts.get("scale_grad_by_freq", False) and not opts.get("sparse", False))
        if isinstance(w, fx.Node) and w in self.params:
            self.use(w, n, ("vocab", 0, vocab) if ok else None)
        if ok:
            self.a.actions[n.name] = ("embed", (math.ceil(vocab / self.tp), opts.get("padding_idx", -1)))
        self.set(n, None)

    def attention(self, n):
        q, k, v = n.args[:3]
        ss = [self.st(x) for x in (q, k, v)]
        hd = len(_shape(q)) - 3
        if not all(isinstance(s, Sharded) and s.dim == hd and not s.padded for s in ss):
            self.conflict(n, "attention needs q, k and v all sharded by heads", q, k, v)
        mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
        if isinstance(mask, fx.Node):
            ms = _shape(mask)
            off = len(_shape(n)) - len(ms)
            if isinstance(self.st(mask), Sharded) or (hd - off >= 0 and ms[hd - off] != 1):
                self.conflict(n, "the attention mask has a per-head dim", q, mask)
        for s in ss:
            self.tag(s, "heads")
        self.a.enter[n.name] = self.entering(n)
        self.set(n, Sharded(hd, ss[0].local, ss[0].full, frozenset().union(*[s.origins for s in ss])))

    def loss(self, n):
        logits, target = n.args[0], n.args[1]
        s = self.st(logits)
        extra = dict(zip(("weight", "reduction", "ignore_index", "label_smoothing"), n.args[2:]))
        extra.update(n.kwargs)
        if not isinstance(s, Sharded) or isinstance(self.st(target), Sharded) or \
                len(_shape(logits)) != 2 or s.dim != 1:
            self.conflict(n, "cross-entropy needs 2-d logits sharded along the classes", logits)
        if extra.get("weight") is not None or extra.get("label_smoothing", 0.0) != 0.0:
            self.conflict(n, "class weights / label smoothing are not supported by the vocab-parallel "
                          "cross-entropy", logits)
        red = {v: k for k, v in _REDUCTIONS.items()}[extra.get("reduction", 1)]
        self.tag(s, "loss")
        self.a.actions[n.name] = ("loss", (s.local, s.full, red, extra.get("ignore_index", -100)))
        self.set(n, None)

    def view(self, n):
        """view / reshape / flatten / unflatten: see ``reshape_shard``; rewrite the size list."""
        x = n.args[0]
        s = self.st(x)
        src, dst = _shape(x), _shape(n)
        try:
            m = reshape_shard(src, dst, s.dim, self.tp, s.padded)
        except ValueError as e:
            self.fail(n, str(e))
            m = reshape_shard(src, dst, s.dim, self.tp, s.padded, strict=False)
        if m is None:
            self.conflict(n, "the reshape interleaves the sharded dim with a dim before it"
                          + (" (or reshapes the padded vocabulary)" if s.padded else ""), x)
        d_out, local = m
        out = s.at(d_out) if s.padded else Sharded(d_out, local, dst[d_out], s.origins)
        if n.target is aten.unflatten.int:
            dim = n.args[1] % len(src)
            if dim <= d_out < dim + len(n.args[2]):
                self.a.actions[n.name] = ("size", (2, d_out - dim, out.local))
        elif n.target is not aten.flatten.using_ints:
            self.a.actions[n.name] = ("size", (1, d_out, out.local))
        self.set(n, out)

    def layout(self, n):
        name = _opname(n)
        x = n.args[0]
        s = self.st(x)
        nd = len(_shape(x))
        d = s.dim
        if name == "t":
            d = 1 - d if nd == 2 else d
        elif name == "transpose":
            i, j = n.args[1] % nd, n.args[2] % nd
            d = j if d == i else i if d == j else d
        elif name == "permute":
            d = [p % nd for p in n.args[1]].index(d)
        elif name == "unsqueeze":
            k = n.args[1] % (nd + 1)
            d = d + 1 if k <= d else d
        else:  # squeeze: a shard of one entry (size > 1 when traced) must not be squeezed away
            dims = n.args[1] if len(n.args) > 1 else range(nd)
            if s.local == 1 and s.dim in [k % nd for k in (dims if not isinstance(dims, int) else [dims])]:
                self.conflict(n, "squeeze would drop the sharded dim (one entry per rank)", x)
            d = _groups(_shape(x), _shape(n), s.dim)[1][0]
        self.set(n, s.at(d))

    def expand(self, n):
        x = n.args[0]
        s = self.st(x)
        d = s.dim + len(_shape(n)) - len(_shape(x))
        self.a.actions[n.name] = ("size", (1, d, s.local))
        self.set(n, s.at(d))

    def slice(self, n):
        x = n.args[0]
        s = self.st(x)
        nd = len(_shape(x))
        dim = (n.args[1] if len(n.args) > 1 else 0) % nd
        if dim == s.dim and not (n.target is aten.slice.Tensor and _shape(n)[dim] == _shape(x)[dim]):
            self.conflict(n, "slicing along the sharded dim", x)
        self.set(n, s.at(s.dim - 1 if (n.target is aten.select.int and dim < s.dim) else s.dim))

    def split(self, n):
        x = n.args[0]
        s = self.st(x)
        nd = len(_shape(x))
        dim = (n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)) % nd
        pieces = [int(v.shape[dim]) for v in _val(n)]
        if dim != s.dim:
            return self.set(n, [s for _ in pieces])
        # A fused projection split along its features: Megatron layout [q_r; k_r; v_r].
        if s.padded or any(p % self.tp for p in pieces):
            self.fail(n, f"the fused projection splits {s.full} features into {pieces}, which "
                      f"tp={self.tp} does not divide")
        if any(self.col_out.get(o) != s.full for o in s.origins):
            self.conflict(n, "a split of the sharded dim that is not the output features of the "
                          "projection that produced it", x)
        if not self.ctx["fused_ok"]():
            self.fail(n, "this fused projection (e.g. GPT-2's c_attn, split into q, k, v) needs the "
                      "runtime to load 'qkv' shards (runtime.compiled._shard and "
                      "runtime.checkpoint_io._join_tp with a 'parts' list); this runtime does not",
                      hint="Use tp=1 for this model, or a runtime that supports 'qkv' shards.")
        self.tag(s, ("parts", tuple(pieces)))
        if n.target is not aten.chunk.default:
            arg = n.args[1]
            new = arg // self.tp if isinstance(arg, int) else [p // self.tp for p in arg]
            self.a.actions[n.name] = ("split", (1, new))
        self.set(n, [Sharded(dim, p // self.tp, p, s.origins) for p in pieces])

    def cat(self, n):
        parts = n.args[0]
        nd = len(_shape(n))
        dim = (n.args[1] if len(n.args) > 1 else 0) % nd
        ss = [self.st(p) for p in parts]
        f = ss[0]
        if dim == f.dim or not all(isinstance(s, Sharded) and (s.dim, s.local, s.full) == (f.dim, f.local, f.full)
                                   for s in ss):
            self.conflict(n, "cat of tensors not all sharded alike, or along the sharded dim", *parts)
        self.set(n, Sharded(f.dim, f.local, f.full, frozenset().union(*[s.origins for s in ss]), f.padded))

    def act_matmul(self, n):
        a, b = n.args[0], n.args[1]
        sa, sb = self.st(a), self.st(b)
        nd = len(_shape(n))
        ok = isinstance(sa, Sharded) and isinstance(sb, Sharded) and len(_shape(a)) == nd == len(_shape(b)) \
            and sa.dim == sb.dim and sa.dim < nd - 2 and (sa.local, sa.full) == (sb.local, sb.full)
        if not ok:
            self.conflict(n, "matmul of activations needs both operands sharded on one batch dim", a, b)
        self.set(n, Sharded(sa.dim, sa.local, sa.full, sa.origins | sb.origins))

    def softmax(self, n):
        x = n.args[0]
        s = self.st(x)
        if n.args[1] % len(_shape(x)) == s.dim:
            self.conflict(n, "softmax over the sharded dim", x)
        self.set(n, s)

    def reduce(self, n):
        x = n.args[0]
        s = self.st(x)
        nd = len(_shape(x))
        dims = n.args[1]
        if dims is None:
            self.conflict(n, "reduction over every dim of a sharded tensor", x)
        dims = [k % nd for k in (dims if isinstance(dims, (list, tuple)) else [dims])]
        if not dims or s.dim in dims or any(isinstance(self.st(a), Sharded) for a in n.args[2:]):
            self.conflict(n, "reduction over the sharded dim", x)
        keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
        d = s.dim if keep else s.dim - sum(1 for k in dims if k < s.dim)
        self.set(n, s.at(d))

    def norm(self, n):
        x = n.args[0]
        s = self.st(x)
        normed = len(n.args[1])
        if s.dim >= len(_shape(x)) - normed or any(isinstance(self.st(a), Sharded) for a in n.args[1:]):
            self.conflict(n, "normalization over the sharded dim", x)
        self.a.enter[n.name] = self.entering(n)
        self.set(n, s if isinstance(_val(n), torch.Tensor) else [s] + [None] * (len(_val(n)) - 1))

    def pointwise(self, n):
        nd = len(_shape(n))
        found = None
        for _, a in _flat_args(n):
            s = self.st(a)
            if isinstance(s, Sharded):
                d = s.dim + nd - len(_shape(a))
                key = (d, s.local, s.full)
                if found is not None and found[:3] != key:
                    self.conflict(n, "elementwise op mixes differently sharded tensors", *n.all_input_nodes)
                found = key + ((found[3] if found else frozenset()) | s.origins, s.padded)
        d = found[0]
        for _, a in _flat_args(n):
            if _is_tensor(a) and not isinstance(self.st(a), Sharded):
                k = d - (nd - len(_shape(a)))
                if k >= 0 and _shape(a)[k] != 1:
                    self.conflict(n, "elementwise op combines a sharded tensor with a full one "
                                  f"({a.name}, shape {_shape(a)})", *n.all_input_nodes)
        self.a.enter[n.name] = self.entering(n)
        self.set(n, Sharded(*found))

    def entering(self, n) -> list:
        """Argument paths of replicated tensors needing grad that enter this sharded op."""
        return [p for p, a in _flat_args(n)
                if _is_tensor(a) and self.st(a) is None and self.rg.get(a, False)]

    # ------------------------------------------------------------------ parameters
    def check_params(self):
        """Every use of a sharded parameter must read the same shard; else undo its users."""
        for fqn, uses in self.param_uses.items():
            specs = {spec for _, spec in uses}
            sharding = [u for u, spec in uses if spec is not None]
            if not sharding:
                continue
            kinds = {(s[1], s[2]) if s is not None else None for s in specs}
            if len(kinds) > 1:
                node = next(x for x in self.gm.graph.nodes if x.name == sharding[0])
                raise _Conflict(frozenset(sharding), node,
                                f"the weight {fqn} is used both sharded and replicated (or sharded "
                                "two ways)")


def _spec(kind_tag: str, dim: int, size: int, tp: int, tags: set, vocab) -> dict:
    parts = [t[1] for t in tags if isinstance(t, tuple) and t[0] == "parts"]
    if kind_tag == "row":
        return {"dim": dim, "kind": "row", "size": size}
    if kind_tag == "vocab" or (size == vocab and "loss" in tags):
        return {"dim": dim, "kind": "vocab", "padded": math.ceil(size / tp) * tp, "size": size}
    if parts:
        return {"dim": dim, "kind": "qkv", "parts": list(min(parts)), "size": size}
    return {"dim": dim, "kind": "heads" if "heads" in tags else "column", "size": size}


def _fused_supported() -> bool:
    """Does this runtime cut and join ``qkv`` shards (``[q_r; k_r; v_r]``)? Probed on 12 rows."""
    full, spec = torch.arange(12.0).view(12, 1), {"dim": 0, "kind": "qkv", "parts": [4, 4, 4], "size": 12}
    try:
        shard = TensorShard.from_dict(spec)
        pieces = [shard.cut(full, r, 2) for r in range(2)]
        return pieces[0].flatten().tolist() == [0, 1, 4, 5, 8, 9] and torch.equal(shard.join(pieces), full)
    except Exception:  # a runtime that does not know the kind
        return False


def analyze_tp(gm: fx.GraphModule, layer_of: Callable, tp: int, *, vocab=None, dims=None,
               fused_ok: bool | None = None) -> TPAnalysis:
    """Decide the tensor-parallel role of every node (see the module doc); raises on failure."""
    probe: dict = {}

    def fused_supported() -> bool:  # probed only if the graph has a fused projection
        if "ok" not in probe:
            probe["ok"] = _fused_supported() if fused_ok is None else bool(fused_ok)
        return probe["ok"]

    ctx = {"tp": tp, "vocab": vocab, "dims": dims or {}, "fused_ok": fused_supported}
    banned: set[str] = set()
    why: dict[str, str] = {}
    limit = sum(1 for n in gm.graph.nodes if n.op == "call_function") + 1
    for _ in range(limit):
        an = _Analyzer(gm, layer_of, ctx, banned, strict=False)
        try:
            an.run()
            # Regions settled: check every size of the regions that stay sharded.
            an = _Analyzer(gm, layer_of, ctx, banned, strict=True)
            a = an.run()
        except _Conflict as c:
            new = c.origins - banned
            if not new:
                where = _where(c.node) if c.node.op != "output" else "the model output"
                raise TPRewriteError(f"tensor parallelism (tp={tp}) at {where}: {c.why}, and no "
                                     "column-parallel matmul can be kept replicated to avoid it. "
                                     "Use tp=1 for this model or restructure this op.") from None
            for o in new:
                why[o] = f"{c.why} at {_where(c.node)}"
            banned |= new
            continue
        a.replicated = {k: why[k] for k in sorted(banned)}
        for fqn, uses in an.param_uses.items():
            specs = [(u, s) for u, s in uses if s is not None]
            if specs:
                tags = set().union(*[an.tags.get(u, set()) for u, _ in specs])
                a.shard_info[fqn] = _spec(*specs[0][1], tp, tags, vocab)
        return a
    raise TPRewriteError("tensor-parallel analysis did not converge")  # pragma: no cover


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

    def __call__(self, g: fx.Graph, lg) -> None:
        new_nodes = [n for n in g.nodes if n.op == "call_function"]
        if len(new_nodes) != len(lg.nodes) or any(a.target != b.target for a, b in zip(new_nodes, lg.nodes)):
            raise TPRewriteError(f"layer {lg.name!r}: its graph does not match the analyzed one; "
                                 "the tensor-parallel rewrite must run before other rewrites")
        copies: dict[fx.Node, fx.Node] = {}
        starts: dict[int, fx.Node] = {}

        def copy_of(x: fx.Node, before: fx.Node) -> fx.Node:
            if x not in copies:
                with g.inserting_before(before):
                    copies[x] = g.call_function(rtp.copy_to_tp, (x,))
            return copies[x]

        def vocab_start(per: int, before: fx.Node) -> fx.Node:
            if per not in starts:
                with g.inserting_before(before):
                    r = g.call_function(rtp.tp_rank, ())
                    starts[per] = g.create_node("call_function", operator.mul, (r, per), name="vocab_start")
            return starts[per]

        for new, orig in zip(new_nodes, lg.nodes):
            for path in self.an.enter.get(orig.name, ()):
                x = _get_path(new, path)
                _set_path(new, path, copy_of(x, new))
            act = self.an.actions.get(orig.name)
            if act is None:
                continue
            kind, p = act
            if kind == "size":  # a view/reshape/expand/unflatten size list: the shard's size
                pos, idx, local = p
                if new.args[pos][idx] != -1:
                    _set_path(new, (pos, idx), local)
            elif kind == "split":
                _set_path(new, (p[0], None), p[1])
            elif kind in ("row", "embed", "loss"):
                with g.inserting_before(new):
                    out = self._replacement(g, new, kind, p, vocab_start, rtp)
                new.replace_all_uses_with(out)
                g.erase_node(new)

    @staticmethod
    def _replacement(g: fx.Graph, new: fx.Node, kind: str, p, vocab_start, rtp) -> fx.Node:
        """The nodes that replace a row-parallel matmul, the token embedding or the loss."""
        call = g.call_function
        if kind == "row" and p is aten.linear.default:
            x, w = new.args[0], new.args[1]
            b = new.args[2] if len(new.args) > 2 else new.kwargs.get("bias")
            return call(rtp.row_parallel_linear, (x, w) if b is None else (x, w, b))
        if kind == "row":  # addmm(b, x, W) or mm(x, W): Conv1D layout, W is [in, out]
            b, (x, w) = (new.args[0], new.args[1:3]) if p is aten.addmm.default else (None, new.args[:2])
            out = call(rtp.reduce_from_tp, (call(aten.mm.default, (x, w)),))
            return out if b is None else call(aten.add.Tensor, (out, b))
        if kind == "embed":
            per, pad = p
            w, ids = new.args[0], new.args[1]
            out = call(rtp.vocab_parallel_embedding, (ids, w, vocab_start(per, new)))
            if isinstance(pad, int) and pad >= 0:  # padding_idx: its row gets no gradient
                is_pad = call(aten.unsqueeze.default, (call(aten.eq.Scalar, (ids, pad)), -1))
                out = call(aten.where.self, (is_pad, call(aten.detach.default, (out,)), out))
            return out
        local, full, red, ignore = p
        return call(rtp.vocab_parallel_cross_entropy, tuple(new.args[:2]),
                    {"vocab_start": vocab_start(local, new), "ignore_index": ignore,
                     "vocab_size": full, "reduction": red})


def local_size(spec: dict, tp: int) -> int:
    """Entries of the sharded dim one rank holds."""
    return spec.get("padded", spec["size"]) // tp


def _reshard_params(gm: fx.GraphModule, shard_info: dict, tp: int) -> None:
    """Replace each sharded meta parameter of ``gm`` by one of its shard's shape."""
    for fqn, spec in shard_info.items():
        mod_path, _, attr = fqn.rpartition(".")
        mod = gm.get_submodule(mod_path) if mod_path else gm
        t = getattr(mod, attr)
        shape = list(t.shape)
        shape[spec["dim"]] = local_size(spec, tp)
        new = torch.empty(shape, dtype=t.dtype, device="meta")
        if isinstance(t, torch.nn.Parameter):
            new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
        (mod._parameters if attr in mod._parameters else mod._buffers)[attr] = new


def build_tp_rewrite(gm: fx.GraphModule, layer_of: Callable, names: list[str], plan, vocab: int, dims: dict):
    """Analyze ``gm`` for ``plan.tp`` and return ``(rewrite, shard_info)``.

    ``rewrite(g, lg)`` rewrites one layer's graph in place (called by ``codegen.lower``);
    ``shard_info`` is ``{original FQN: shard spec}``. As a side effect the sharded parameters of
    ``gm`` (on meta) take their shard shapes, which the generated ``__init__`` and the manifest use.
    ``rewrite.replicated`` lists the matmuls/embeddings kept replicated, and why.
    """
    tp = int(plan.tp)
    for key, what in (("heads", "attention heads"), ("kv_heads", "key/value heads")):
        v = dims.get(key)
        if v and v % tp:
            raise TPRewriteError(f"tp={tp} does not divide the model's {v} {what} (model dims: "
                                 f"{dims}); choose a tp that divides heads and kv_heads.")
    analysis = analyze_tp(gm, layer_of, tp, vocab=vocab, dims=dims)
    _reshard_params(gm, analysis.shard_info, tp)
    rewrite = _LayerRewriter(analysis)
    rewrite.replicated = analysis.replicated
    return rewrite, analysis.shard_info
