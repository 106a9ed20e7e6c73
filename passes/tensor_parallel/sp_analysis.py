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
    val = value_of(n)
    return hint(val.numel()) * val.element_size() if isinstance(val, torch.Tensor) else 0


def _path_of(n: fx.Node, value) -> tuple | None:
    """The first argument path of ``n`` that holds ``value``."""
    return next((path for path, arg in flat_args(n) if arg is value), None)


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
    def sp(self, value):
        return self.st.get(value) if isinstance(value, fx.Node) else None

    def conflict(self, n: fx.Node, why: str, *args: Any) -> NoReturn:
        shards = [e for arg in args for e in states_of(self.sp(arg)) if isinstance(e, SeqShard)]
        raise TPConflict(frozenset().union(*[e.origins for e in shards]), n, why)

    def set(self, n, state):
        self.st[n] = state
        if any(isinstance(e, SeqShard) for e in states_of(state)):
            for user in n.users:
                if user.op == "output":
                    self.conflict(user, "a sequence-sharded tensor is an output of the model", n)

    def act(self, n, path, kind, value, dim):
        """Argument ``path`` of ``n`` (holding ``value``) is gathered, split or copied."""
        self.args.setdefault(n.name, []).append((path, kind, dim))
        self.uses.setdefault((kind, value, dim), []).append(n.name)

    def partial(self, n, path, value):
        """A replicated tensor used on this rank's tokens: its gradient is partial if it has one."""
        if self.rg.get(value, False):
            self.act(n, path, "copy", value, None)

    def others(self, n, x):
        """Tensor inputs of ``n`` besides ``x`` must not be sequence-sharded; the replicated ones
        that require grad get partial gradients."""
        for path, arg in flat_args(n):
            if arg is x or not is_tensor_node(arg):
                continue
            if isinstance(self.sp(arg), SeqShard):
                self.conflict(n, f"{op_name(n)} reads a second sequence-sharded input", x, arg)
            self.partial(n, path, arg)

    def out(self, n, state):
        """Set ``s`` on every tensor output of ``n`` (the statistics of native norms too)."""
        self.set(n, state if not isinstance(value_of(n), (list, tuple)) else [state for _ in value_of(n)])

    # ------------------------------------------------------------------ the walk
    def run(self) -> _SeqWalk:
        for n in self.gm.graph.nodes:
            if n.op in ("placeholder", "get_attr"):
                self.rg[n] = n in self.params
            elif n.op == "call_function":
                vals = value_of(n) if isinstance(value_of(n), (list, tuple)) else [value_of(n)]
                floats = any(isinstance(val, torch.Tensor) and val.is_floating_point() for val in vals)
                self.rg[n] = floats and any(self.rg.get(arg, False) for arg in n.all_input_nodes)
                if not is_meta_only(n):
                    self.visit(n, op_name(n))
        return self

    def visit(self, n: fx.Node, name: str):
        if name == "getitem":
            state = self.sp(n.args[0])
            return self.set(n, state[cast(int, n.args[1])] if isinstance(state, list) else None)
        role = self.dec.role.get(n)
        if role == "col":  # the sink: all-gather the activation's positions
            x = matmul_operands(n)[0]
            if isinstance(self.sp(x), SeqShard):
                self.act(n, (1 if name == "addmm" else 0, None), "gather", x, self.sp(x).dim)
            return self.set(n, None)
        if role in ("row", "vocab_embedding"):
            return self.source(n, role)
        sharded = [arg for arg in n.all_input_nodes if isinstance(self.sp(arg), SeqShard)]
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
            bias = matmul_operands(n)[2]
            if isinstance(bias, fx.Node):
                self.partial(n, _path_of(n, bias), bias)
        self.sources.append(n)
        self.set(n, SeqShard(k - 1, frozenset([n.name])))

    # ------------------------------------------------------------------ handlers
    def tokenwise(self, n, name) -> bool:
        """A weighted matmul tp keeps replicated, on sequence shards: each rank multiplies its
        tokens; the weight's (and bias') gradient is partial."""
        x, weight, bias = matmul_operands(n)
        state = self.sp(x)
        if not isinstance(state, SeqShard) or not is_tensor_node(weight) or len(shape_of(weight)) != 2:
            return False
        if state.dim == len(shape_of(x)) - 1:
            self.conflict(n, "a matmul contracts over the sequence dim", x)
        self.others(n, x)
        self.set(n, state.at(state.dim + len(shape_of(n)) - len(shape_of(x))))
        return True

    def pointwise(self, n, name):
        ndim = len(shape_of(n))
        seq_dim, origins = None, frozenset()
        for _, arg in flat_args(n):
            state = self.sp(arg)
            if isinstance(state, SeqShard):
                k = state.dim + ndim - len(shape_of(arg))
                if seq_dim is not None and k != seq_dim:
                    self.conflict(
                        n, "elementwise op mixes tensors sharded along different sequence dims", *n.all_input_nodes
                    )
                seq_dim, origins = k, origins | state.origins
        for path, arg in flat_args(n):
            if not is_tensor_node(arg) or isinstance(self.sp(arg), SeqShard):
                continue
            k = seq_dim - (ndim - len(shape_of(arg)))
            if k < 0 or shape_of(arg)[k] == 1:
                self.partial(n, path, arg)  # broadcast along the sequence
            elif shape_of(arg)[k] == self.S:
                self.act(n, path, "split", arg, k)  # full length: keep this rank's positions
            else:
                self.conflict(
                    n,
                    f"elementwise op combines a sequence shard with {arg.name} of shape {shape_of(arg)}",
                    *n.all_input_nodes,
                )
        self.out(n, SeqShard(seq_dim, origins))

    def passthrough(self, n, name):
        state = self.sp(n.args[0])
        if not isinstance(state, SeqShard):  # type_as(full, shard) reads only the shard's dtype
            return self.set(n, None)
        self.out(n, state)

    def norm(self, n, name):
        x = n.args[0]
        state = self.sp(x)
        if not isinstance(state, SeqShard) or state.dim >= len(shape_of(x)) - len(n.args[1]):
            self.conflict(n, "normalization over the sequence dim", x)
        self.others(n, x)
        self.out(n, state)

    def reduce(self, n, name):
        x = n.args[0]
        state = self.sp(x)
        dims = dims_of(node_arg(n, "dim"), len(shape_of(x)))
        if not isinstance(state, SeqShard) or not dims or state.dim in dims:
            self.conflict(n, "reduction over the sequence dim", *n.all_input_nodes)
        self.others(n, x)
        keep = node_arg(n, "keepdim", False)
        self.out(n, state.at(state.dim if keep else state.dim - sum(1 for k in dims if k < state.dim)))

    def softmax(self, n, name):
        state = self.sp(n.args[0])
        if norm_dim(n.args[1], len(shape_of(n.args[0]))) == state.dim:
            self.conflict(n, "softmax over the sequence dim", n.args[0])
        self.set(n, state)

    def scan(self, n, name):
        x = n.args[0]
        state = self.sp(x)
        dims = dims_of(node_arg(n, "dims" if name in ("flip", "roll") else "dim"), len(shape_of(x)))
        if not isinstance(state, SeqShard) or not dims or state.dim in dims:
            self.conflict(n, "scan along the sequence dim", *n.all_input_nodes)
        self.others(n, x)
        self.out(n, state)

    def view(self, n, name):
        """A reshape must keep the sequence dim whole: its size argument there becomes ``S/t``."""
        x = n.args[0]
        state = self.sp(x)
        groups = reshape_groups(shape_of(x), shape_of(n), state.dim)
        if groups is None or groups[0] != [state.dim] or len(groups[1]) != 1:
            self.conflict(
                n,
                "the reshape merges or splits the sequence dim (e.g. flattens the tokens of the batch into one dim)",
                x,
            )
        self.set(n, state.at(groups[1][0]))

    def layout(self, n, name):
        state = self.sp(n.args[0])
        out_dim = moved_dim(n, name, state.dim)
        if out_dim is None:
            self.conflict(n, "squeeze could drop the sequence dim", n.args[0])
        self.set(n, state.at(out_dim))

    def expand(self, n, name):
        state = self.sp(n.args[0])
        self.set(n, state.at(state.dim + len(shape_of(n)) - len(shape_of(n.args[0]))))

    def slice(self, n, name):
        x = n.args[0]
        state = self.sp(x)
        dim = norm_dim(node_arg(n, "dim", 0), len(shape_of(x)))
        if dim == state.dim and not (name != "select" and shape_of(n)[dim] == shape_of(x)[dim]):
            self.conflict(n, "slicing along the sequence dim", x)
        self.set(n, state.at(state.dim - 1 if (name == "select" and dim < state.dim) else state.dim))

    def split(self, n, name):
        x = n.args[0]
        state = self.sp(x)
        dim = norm_dim(node_arg(n, "dim", 0), len(shape_of(x)))
        if dim == state.dim:
            self.conflict(n, "a split along the sequence dim", x)
        self.set(
            n, [state.at(state.dim - 1 if (name == "unbind" and dim < state.dim) else state.dim) for _ in value_of(n)]
        )

    def cat(self, n, name):
        parts = n.args[0]
        dim = norm_dim(node_arg(n, "dim", 0), len(shape_of(n)))
        states = [self.sp(part) for part in parts]
        f = states[0]
        if not all(isinstance(x, SeqShard) and x.dim == f.dim for x in states) or (name == "cat" and dim == f.dim):
            self.conflict(n, f"{name} of tensors not all sequence-sharded alike, or along the sequence", *parts)
        out_dim = f.dim + 1 if (name == "stack" and dim <= f.dim) else f.dim
        self.set(n, SeqShard(out_dim, frozenset().union(*[x.origins for x in states])))

    def finish(self, out: TPDecisions) -> None:
        """Write this (successful) walk into ``out``'s ``sp_*`` fields."""
        out.sp_sharded = {
            n.name: (
                state.dim
                if isinstance(state, SeqShard)
                else [e.dim if isinstance(e, SeqShard) else None for e in state]
            )
            for n, state in self.st.items()
            if any(isinstance(e, SeqShard) for e in states_of(state))
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
                    tuple(user.name for user in n.users),
                    self.rg.get(n, False),
                ),
            )
            for n in self.sources
        ]
        for (kind, value, dim), users in self.uses.items():
            kind = {"gather": "all_gather", "copy": "grad_all_reduce"}.get(kind, kind)
            comms.append(
                (
                    value,
                    SeqComm(
                        kind, value.name, dim, _nbytes(value), tuple(dict.fromkeys(users)), self.rg.get(value, False)
                    ),
                )
            )
        order = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        out.sp_comms = [comm for _, comm in sorted(comms, key=lambda e: (order[e[0]], e[1].kind))]


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
            why.update({origin: c for origin in new})
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
