"""Inline ``torch.no_grad()`` regions that ``torch.export`` kept as higher-order ops.

A model that computes part of its forward under ``with torch.no_grad():`` (PhiMoE's router builds
its sparse-mixer masks so) exports that part as ``torch.ops.higher_order.wrap_with_set_grad_enabled
(False, submod, *args)``: a call of a nested ``GraphModule`` held as a ``get_attr`` attribute of the
graph. Every later consumer of the graph (the passes, which expect ATen ops with tensor values,
and codegen, which prints each layer as a straight line of ATen calls and takes every
``get_attr`` for a weight) reads one flat graph, so ``inline_grad_regions(gm)`` copies each
region's ops in place of its call (keeping their ``node.meta``: the module path that places them
in a layer) and, for a region that disabled gradients, detaches each floating-point value it
returns: autograd then sees exactly what the model's ``no_grad`` gave it (values that carry no
gradient), and the forward computes the same numbers. A region that enabled gradients inside a
training forward (where they are on already) is inlined as it is.

A region that itself reads an attribute (a weight, a nested region) stays as traced: codegen then
refuses it by name (``codegen.lower``) instead of misreading it.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

__all__ = ["inline_grad_regions"]

_SET_GRAD = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)


def _fetch(gm: fx.GraphModule, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _float_tensor(n: fx.Node) -> bool:
    val = n.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _copy_region(graph: fx.Graph, sub: fx.GraphModule, args: tuple, detach: bool) -> list:
    """Copy ``sub``'s ops into ``graph`` (at its insertion point) reading ``args``; return what
    the region returns (each floating-point value detached when ``detach``)."""
    env: dict[fx.Node, Any] = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    for placeholder, arg in zip(placeholders, args):
        env[placeholder] = arg
    outs: list = []
    for n in sub.graph.nodes:
        if n.op == "call_function":
            env[n] = graph.node_copy(n, lambda arg: env[arg])
        elif n.op == "output":
            result = n.args[0]
            outs = list(result) if isinstance(result, (list, tuple)) else [result]
            outs = [fx.node.map_arg(out, lambda arg: env[arg]) for out in outs]
    if detach:
        for k, out in enumerate(outs):
            if isinstance(out, fx.Node) and _float_tensor(out):
                detached = graph.call_function(torch.ops.aten.detach.default, (out,))
                detached.meta = dict(out.meta)
                outs[k] = detached
    return outs


def _inlinable(gm: fx.GraphModule, node: fx.Node) -> bool:
    if _SET_GRAD is None or node.op != "call_function" or node.target is not _SET_GRAD:
        return False
    sub_node = node.args[1] if len(node.args) > 1 else None
    if not isinstance(sub_node, fx.Node) or sub_node.op != "get_attr":
        return False
    sub = _fetch(gm, str(sub_node.target))
    if not isinstance(sub, fx.GraphModule):
        return False
    ops = {n.op for n in sub.graph.nodes}
    getitems_only = all(user.op == "call_function" and user.target is operator.getitem for user in node.users)
    return ops <= {"placeholder", "call_function", "output"} and getitems_only


def inline_grad_regions(gm: fx.GraphModule) -> int:
    """Inline every ``wrap_with_set_grad_enabled`` region of ``gm`` (see the module docstring);
    return how many were inlined."""
    graph = gm.graph
    inlined = 0
    for node in list(graph.nodes):
        if not _inlinable(gm, node):
            continue
        enabled, sub_node, *args = node.args
        sub = _fetch(gm, str(sub_node.target))
        with graph.inserting_before(node):
            outs = _copy_region(graph, sub, tuple(args), detach=not enabled)
        for user in list(node.users):
            user.replace_all_uses_with(outs[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
        if not sub_node.users:
            graph.erase_node(sub_node)
            if not any(n.op == "get_attr" and n.target == sub_node.target for n in graph.nodes):
                gm.delete_submodule(str(sub_node.target))
        inlined += 1
    if inlined:
        graph.lint()
        gm.recompile()
    return inlined
