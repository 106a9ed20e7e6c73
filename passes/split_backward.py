"""What a split backward frees early: the saved activations of a layer's *tail*.

Zero-bubble schedules split a chunk's backward into ``B`` (input gradients) and ``W`` (weight
gradients, later). ``runtime.pipeline.executor`` keeps, from ``B`` to ``W``, the autograd nodes that
compute a weight's gradient (the *frontier*: a linear layer's ``mm``, a norm) and, through their
edges, every node upstream of them. A node upstream of none of them is held only by the chunk's
outputs, which ``B`` drops: its saved tensors are freed at ``B``. In a language model's head that
is the loss (cross-entropy's log-probabilities, as large as the logits); in a block ending in a
residual add it is nothing.

``tail_saved(gm, n)`` gives, per layer row, the saved bytes of such nodes relative to the row's
own weight products (full, tp-sharded part, sequence-sharded part, as ``saved_bytes`` and its
parts). It is what a chunk frees at ``B`` when the row is the chunk's last one; an earlier row's
tail feeds the next row's weights and stays. A storage another, kept node also saves is not
freed, so a tail node sharing one is left out whole (an error toward less freed).
"""

from __future__ import annotations

from typing import Any

import sympy
import torch.fx as fx

__all__ = ["tail_saved", "frontier_outputs"]

_ZERO = sympy.Integer(0)


def _weight_only(gm: fx.GraphModule) -> set[fx.Node]:
    """Trainable weights and the nodes computed from weights alone (a transpose, a cast)."""
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if "param_count" in node.meta:
                out.add(node)
        elif node.op == "call_function" and node.all_input_nodes and all(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def _frontier(gm: fx.GraphModule, weights: set[fx.Node]) -> list[fx.Node]:
    """The nodes that read a weight and something else (a product with a weight, a norm)."""
    return [
        x
        for x in gm.graph.nodes
        if x.op == "call_function" and x not in weights and any(a in weights for a in x.all_input_nodes)
    ]


def frontier_outputs(gm: fx.GraphModule, n: int) -> dict[int, tuple[Any, Any, Any]]:
    """Per layer row: ``(bytes, tp part, sp part)`` of the outputs of its frontier nodes, whose
    gradients ``B`` records for ``W`` (module docstring)."""
    out: dict[int, list] = {}
    for x in _frontier(gm, _weight_only(gm)):
        lay = x.meta.get("layer", -1)
        if not 0 <= lay < n:
            continue
        nbytes = x.meta.get("out_bytes", _ZERO)
        tp = x.meta.get("tp")
        acc = out.setdefault(lay, [_ZERO, _ZERO, _ZERO])
        acc[0] += nbytes
        if tp is None:
            continue
        if tp.shard_dim is not None and not isinstance(tp.shard_dim, list):  # a column product's shard
            acc[1] += nbytes
        elif tp.sp:
            acc[2] += nbytes
    return {lay: (v[0], v[1], v[2]) for lay, v in out.items()}


def tail_saved(gm: fx.GraphModule, n: int) -> dict[int, tuple[Any, Any, Any]]:
    """Per layer row ``0 <= lay < n``: ``(bytes, tp part, sp part)`` its tail saves (module
    docstring); rows without a tail are absent."""
    weights = _weight_only(gm)
    kept: set[fx.Node] = set()
    stack = _frontier(gm, weights)
    while stack:  # the frontier and everything of its row upstream of it
        x = stack.pop()
        if x in kept:
            continue
        kept.add(x)
        lay = x.meta.get("layer", -1)
        stack += [a for a in x.all_input_nodes if a.op == "call_function" and a.meta.get("layer", -1) == lay]
    savers: dict[Any, list[fx.Node]] = {}
    for x in gm.graph.nodes:
        for rec in x.meta.get("saved", ()):
            savers.setdefault(rec.key, []).append(x)
    out: dict[int, list] = {}
    for x in gm.graph.nodes:
        lay = x.meta.get("layer", -1)
        if x.op != "call_function" or x in kept or x in weights or not 0 <= lay < n or not x.meta.get("saved"):
            continue
        if any(s in kept for rec in x.meta["saved"] for s in savers[rec.key]):
            continue  # a storage a kept node also holds
        tp = x.meta.get("tp")
        acc = out.setdefault(lay, [_ZERO, _ZERO, _ZERO])
        acc[0] += x.meta.get("saved_bytes", _ZERO)
        if tp is not None:
            acc[1] += tp.saved_bytes_tp
            acc[2] += tp.saved_bytes_sp
    return {lay: (v[0], v[1], v[2]) for lay, v in out.items()}
