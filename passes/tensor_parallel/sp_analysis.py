"""Megatron's sequence parallelism over the tensor-parallel decisions (``passes.tensor_parallel.tp_analysis``).

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

``sequence_parallel`` fills the ``sp_*`` fields of ``TPDecisions``; ``analyze_tensor_parallel``
calls it, so its readers (the cost pass, codegen) get both analyses at once.
"""

from __future__ import annotations

from typing import Any, NoReturn, cast

import torch
from torch import fx

from passes.common import hint, is_meta_only
from passes.op_class import op_name
from passes.tensor_parallel.tp_common import (
    CATS,
    LAYOUT,
    NORMS,
    PASSTHROUGH,
    REDUCTIONS,
    SCANS,
    SLICES,
    SOFTMAX,
    SPLITS,
    VIEWS,
    WEIGHTED_MATMULS,
    SeqComm,
    SeqShard,
    TPConflict,
    TPDecisions,
    dims_of,
    flat_args,
    is_tensor_node,
    matmul_operands,
    moved_dim,
    node_arg,
    norm_dim,
    reads_data,
    reshape_groups,
    shape_of,
    states_of,
    value_of,
)

__all__ = ["sequence_parallel"]


def _describe(n: fx.Node) -> str:
    """``node 'x' (op) in module 'a.b'`` for SP's messages."""
    stack = n.meta.get("nn_module_stack") or {}
    mod = list(stack.values())[-1][0] if stack else ""
    return f"node {n.name!r} ({n.target})" + (f" in module {mod!r}" if mod else "")


def _nbytes(n: fx.Node):
    """The bytes of ``n``'s value: ``meta['out_bytes']`` if the shapes pass ran, else concrete."""
    if "out_bytes" in n.meta:
        return n.meta["out_bytes"]
    v = value_of(n)
    return hint(v.numel()) * v.element_size() if isinstance(v, torch.Tensor) else 0


def _path_of(n: fx.Node, value) -> tuple | None:
    """The first argument path of ``n`` that holds ``value``."""
    return next((p for p, a in flat_args(n) if a is value), None)


class _SeqWalk:
    """One SP walk over the tp decisions ``dec``, with the sources in ``banned`` kept all-reducing."""

    def __init__(self, gm: fx.GraphModule, dec: TPDecisions, params: dict, tokens: list[int], banned: set[str]):
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

    def conflict(self, n: fx.Node, why: str, *args: Any) -> NoReturn:
        shards = [e for a in args for e in states_of(self.sp(a)) if isinstance(e, SeqShard)]
        raise TPConflict(frozenset().union(*[e.origins for e in shards]), n, why)

    def set(self, n, s):
        self.st[n] = s
        if any(isinstance(e, SeqShard) for e in states_of(s)):
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
            if a is x or not is_tensor_node(a):
                continue
            if isinstance(self.sp(a), SeqShard):
                self.conflict(n, f"{op_name(n)} reads a second sequence-sharded input", x, a)
            self.partial(n, path, a)

    def out(self, n, s):
        """Set ``s`` on every tensor output of ``n`` (the statistics of native norms too)."""
        self.set(n, s if not isinstance(value_of(n), (list, tuple)) else [s for _ in value_of(n)])

    # ------------------------------------------------------------------ the walk
    def run(self) -> _SeqWalk:
        for n in self.gm.graph.nodes:
            if n.op in ("placeholder", "get_attr"):
                self.rg[n] = n in self.params
            elif n.op == "call_function":
                vals = value_of(n) if isinstance(value_of(n), (list, tuple)) else [value_of(n)]
                floats = any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in vals)
                self.rg[n] = floats and any(self.rg.get(a, False) for a in n.all_input_nodes)
                if not is_meta_only(n):
                    self.visit(n, op_name(n))
        return self

    def visit(self, n: fx.Node, name: str):
        if name == "getitem":
            s = self.sp(n.args[0])
            return self.set(n, s[cast(int, n.args[1])] if isinstance(s, list) else None)
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
            self.conflict(
                n,
                "a sequence-sharded value enters a tensor-parallel op that is not a "
                "column-parallel matmul (it needs every position)",
                *sharded,
            )
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
        shape, k = shape_of(n), len(self.tokens)
        if n.name in self.banned:
            return self.set(n, None)
        if shape[:k] != self.tokens or len(shape) <= k:
            self.not_token[n.name] = TPConflict(
                frozenset(), n, f"its output {shape} is not laid out by token (the ids are {self.tokens})"
            )
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
        if not isinstance(s, SeqShard) or not is_tensor_node(w) or len(shape_of(w)) != 2:
            return False
        if s.dim == len(shape_of(x)) - 1:
            self.conflict(n, "a matmul contracts over the sequence dim", x)
        self.others(n, x)
        self.set(n, s.at(s.dim + len(shape_of(n)) - len(shape_of(x))))
        return True

    def pointwise(self, n, name):
        nd = len(shape_of(n))
        d, origins = None, frozenset()
        for _, a in flat_args(n):
            s = self.sp(a)
            if isinstance(s, SeqShard):
                k = s.dim + nd - len(shape_of(a))
                if d is not None and k != d:
                    self.conflict(
                        n, "elementwise op mixes tensors sharded along different sequence dims", *n.all_input_nodes
                    )
                d, origins = k, origins | s.origins
        for path, a in flat_args(n):
            if not is_tensor_node(a) or isinstance(self.sp(a), SeqShard):
                continue
            k = d - (nd - len(shape_of(a)))
            if k < 0 or shape_of(a)[k] == 1:
                self.partial(n, path, a)  # broadcast along the sequence
            elif shape_of(a)[k] == self.S:
                self.act(n, path, "split", a, k)  # full length: keep this rank's positions
            else:
                self.conflict(
                    n,
                    f"elementwise op combines a sequence shard with {a.name} of shape {shape_of(a)}",
                    *n.all_input_nodes,
                )
        self.out(n, SeqShard(d, origins))

    def passthrough(self, n, name):
        s = self.sp(n.args[0])
        if not isinstance(s, SeqShard):  # type_as(full, shard) reads only the shard's dtype
            return self.set(n, None)
        self.out(n, s)

    def norm(self, n, name):
        x = n.args[0]
        s = self.sp(x)
        if not isinstance(s, SeqShard) or s.dim >= len(shape_of(x)) - len(n.args[1]):
            self.conflict(n, "normalization over the sequence dim", x)
        self.others(n, x)
        self.out(n, s)

    def reduce(self, n, name):
        x = n.args[0]
        s = self.sp(x)
        dims = dims_of(node_arg(n, "dim"), len(shape_of(x)))
        if not isinstance(s, SeqShard) or not dims or s.dim in dims:
            self.conflict(n, "reduction over the sequence dim", *n.all_input_nodes)
        self.others(n, x)
        keep = node_arg(n, "keepdim", False)
        self.out(n, s.at(s.dim if keep else s.dim - sum(1 for k in dims if k < s.dim)))

    def softmax(self, n, name):
        s = self.sp(n.args[0])
        if norm_dim(n.args[1], len(shape_of(n.args[0]))) == s.dim:
            self.conflict(n, "softmax over the sequence dim", n.args[0])
        self.set(n, s)

    def scan(self, n, name):
        x = n.args[0]
        s = self.sp(x)
        dims = dims_of(node_arg(n, "dims" if name in ("flip", "roll") else "dim"), len(shape_of(x)))
        if not isinstance(s, SeqShard) or not dims or s.dim in dims:
            self.conflict(n, "scan along the sequence dim", *n.all_input_nodes)
        self.others(n, x)
        self.out(n, s)

    def view(self, n, name):
        """A reshape must keep the sequence dim whole: its size argument there becomes ``S/t``."""
        x = n.args[0]
        s = self.sp(x)
        g = reshape_groups(shape_of(x), shape_of(n), s.dim)
        if g is None or g[0] != [s.dim] or len(g[1]) != 1:
            self.conflict(
                n,
                "the reshape merges or splits the sequence dim (e.g. flattens the tokens of the batch into one dim)",
                x,
            )
        self.set(n, s.at(g[1][0]))

    def layout(self, n, name):
        s = self.sp(n.args[0])
        d = moved_dim(n, name, s.dim)
        if d is None:
            self.conflict(n, "squeeze could drop the sequence dim", n.args[0])
        self.set(n, s.at(d))

    def expand(self, n, name):
        s = self.sp(n.args[0])
        self.set(n, s.at(s.dim + len(shape_of(n)) - len(shape_of(n.args[0]))))

    def slice(self, n, name):
        x = n.args[0]
        s = self.sp(x)
        dim = norm_dim(node_arg(n, "dim", 0), len(shape_of(x)))
        if dim == s.dim and not (name != "select" and shape_of(n)[dim] == shape_of(x)[dim]):
            self.conflict(n, "slicing along the sequence dim", x)
        self.set(n, s.at(s.dim - 1 if (name == "select" and dim < s.dim) else s.dim))

    def split(self, n, name):
        x = n.args[0]
        s = self.sp(x)
        dim = norm_dim(node_arg(n, "dim", 0), len(shape_of(x)))
        if dim == s.dim:
            self.conflict(n, "a split along the sequence dim", x)
        self.set(n, [s.at(s.dim - 1 if (name == "unbind" and dim < s.dim) else s.dim) for _ in value_of(n)])

    def cat(self, n, name):
        parts = n.args[0]
        dim = norm_dim(node_arg(n, "dim", 0), len(shape_of(n)))
        ss = [self.sp(p) for p in parts]
        f = ss[0]
        if not all(isinstance(x, SeqShard) and x.dim == f.dim for x in ss) or (name == "cat" and dim == f.dim):
            self.conflict(n, f"{name} of tensors not all sequence-sharded alike, or along the sequence", *parts)
        d = f.dim + 1 if (name == "stack" and dim <= f.dim) else f.dim
        self.set(n, SeqShard(d, frozenset().union(*[x.origins for x in ss])))

    def finish(self, out: TPDecisions) -> None:
        """Write this (successful) walk into ``out``'s ``sp_*`` fields."""
        out.sp_sharded = {
            n.name: (s.dim if isinstance(s, SeqShard) else [e.dim if isinstance(e, SeqShard) else None for e in s])
            for n, s in self.st.items()
            if any(isinstance(e, SeqShard) for e in states_of(s))
        }
        out.sp_args = self.args
        comms = [
            (
                n,
                SeqComm(
                    "reduce_scatter",
                    n.name,
                    len(self.tokens) - 1,
                    _nbytes(n),
                    tuple(u.name for u in n.users),
                    self.rg.get(n, False),
                ),
            )
            for n in self.sources
        ]
        for (kind, a, dim), users in self.uses.items():
            kind = {"gather": "all_gather", "copy": "grad_all_reduce"}.get(kind, kind)
            comms.append(
                (a, SeqComm(kind, a.name, dim, _nbytes(a), tuple(dict.fromkeys(users)), self.rg.get(a, False)))
            )
        order = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        out.sp_comms = [c for _, c in sorted(comms, key=lambda e: (order[e[0]], e[1].kind))]


_SP_HANDLERS = {
    **{k: "view" for k in VIEWS},
    **{k: "layout" for k in LAYOUT},
    "expand": "expand",
    **{k: "slice" for k in SLICES},
    **{k: "split" for k in SPLITS},
    **{k: "cat" for k in CATS},
    **{k: "softmax" for k in SOFTMAX},
    **{k: "reduce" for k in REDUCTIONS},
    **{k: "scan" for k in SCANS},
    **{k: "norm" for k in NORMS},
    **{k: "passthrough" for k in PASSTHROUGH},
}
"""What a sequence shard may pass (attention, losses and matmuls of activations may not)."""


def _token_layout(gm: fx.GraphModule, params: dict, inputs: set, vocab: int | None) -> list[int] | None:
    """The shape of the token ids the vocabulary embedding reads (``[b, s]``), if any."""
    data = set(inputs)
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if reads_data(n, data):
            data.add(n)
        if (
            op_name(n) == "embedding"
            and n.args[0] in params
            and n.args[1] in data
            and shape_of(n.args[0])[:1] == [vocab]
        ):
            return shape_of(n.args[1]) or None
    return None


def sequence_parallel(gm: fx.GraphModule, out: TPDecisions, params: dict, inputs: set) -> None:
    """Fill the ``sp_*`` fields of ``out`` (module doc, "Sequence parallelism"). Never raises: a
    model SP cannot split gets ``sp_blocked``."""
    tokens = _token_layout(gm, params, inputs, out.vocab)
    if tokens is None:
        out.sp_blocked = (
            "sequence parallelism takes the sequence dim from the token ids a "
            "vocabulary embedding reads, and this model has no such embedding"
        )
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
        out.sp_blocked = "no row-parallel matmul or vocabulary embedding can reduce-scatter along the sequence" + (
            f": {first.why} at {_describe(first.node)}" if first else ""
        )
        return
    walk.finish(out)
