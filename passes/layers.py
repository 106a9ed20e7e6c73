"""Which layer each node belongs to, block signatures, and what crosses each layer boundary.

Layer ids follow the layer table: 0 = everything before the first block (embeddings, masks,
rotary tables), 1..L = the blocks in order, L+1 = everything after the last block (final norm,
head, loss). A node is in block j when its ``nn_module_stack`` (recorded by ``torch.export``)
contains the block's module path. Nodes outside every block take 0 before the first block node,
L+1 after the last, and the current block in between (code between blocks runs on that stage).
Parameters and buffers take the layer of their first user (a tied embedding/head weight lands in
layer 0); user inputs take the pseudo-layer -1 ("data"): every layer that reads them receives them.

Writes ``node.meta["layer"]`` (int) and ``node.meta["module_path"]`` (innermost module, '' at the
root). ``layer_signatures`` hashes each layer's op sequence, output shapes/dtypes, parameter shapes
and internal wiring: identical blocks share a signature. ``layer_io`` lists, per layer, the tensors
it receives (``inputs``) and the tensors crossing the boundary after it (``boundary``: produced in
layers <= i, used in layers > i, i.e. what a pipeline stage ending at i sends).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.fx as fx

from passes.common import PassError, has_tensor, is_meta_only, iter_tensors, need

__all__ = ["assign_layers", "layer_signatures", "layer_io", "LayerIO", "layer_names", "is_size", "DATA"]

DATA = -1
"""Pseudo-layer of the user's inputs (token ids, labels): supplied by the data loader."""

_PASS = "assign_layers"


def _block_of(node: fx.Node, block_index: dict[str, int]) -> int | None:
    stack = node.meta.get("nn_module_stack") or {}
    for path, _typ in stack.values():
        if not isinstance(path, str):
            continue
        parts = path.split(".")
        for cut in range(len(parts), 0, -1):
            j = block_index.get(".".join(parts[:cut]))
            if j is not None:
                return j
    return None


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    paths = [p for p, _t in stack.values() if isinstance(p, str) and not p.startswith("_empty")]
    return paths[-1] if paths else ""


def assign_layers(gm: fx.GraphModule, block_paths: list[str], roles: dict[str, str]) -> fx.GraphModule:
    """Write ``meta['layer']`` and ``meta['module_path']`` on every node (see module doc)."""
    block_index = {p: j for j, p in enumerate(block_paths)}
    n_blocks = len(block_paths)
    post = n_blocks + 1
    nodes = list(gm.graph.nodes)
    in_block = {n: _block_of(n, block_index) for n in nodes if n.op == "call_function"}
    last_block_pos = max((i for i, n in enumerate(nodes) if in_block.get(n) is not None), default=-1)
    current = 0
    for i, n in enumerate(nodes):
        n.meta["module_path"] = _module_path(n)
        if n.op == "placeholder":
            continue  # decided from the users below
        if n.op == "output":
            n.meta["layer"] = post
            continue
        j = in_block.get(n)
        if j is not None:
            current = j + 1
            n.meta["layer"] = current
        elif i > last_block_pos and n_blocks:
            n.meta["layer"] = post
        else:
            n.meta["layer"] = current
    for n in nodes:
        if n.op != "placeholder":
            continue
        role = roles.get(n.name)
        if role is None:
            raise PassError(
                _PASS,
                n,
                "placeholder has no role (param/buffer/constant/input); pass Traced.roles from planner.frontend.trace.",
            )
        if role == "input":
            n.meta["layer"] = DATA
            continue
        users = [u.meta["layer"] for u in n.users if not is_meta_only(u)]
        n.meta["layer"] = min(users) if users else 0
    return gm


def _fmt(x) -> str:
    if isinstance(x, torch.SymInt):
        return str(x.node.expr)
    return str(x)


def is_size(n: fx.Node) -> bool:
    """A node of size arithmetic (a symbolic or plain integer, float or bool, no tensor): export
    computes each such expression once and reuses it, so the first block that needs it holds the
    node and the next reads it from there; blocks are compared without them (by expression)."""
    return isinstance(n.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def _val_sig(val) -> str:
    parts = []
    for t in iter_tensors(val):
        parts.append(f"{str(t.dtype)[6:]}[{','.join(_fmt(d) for d in t.shape)}]")
    if not parts and val is not None and not isinstance(val, torch.Tensor):
        parts.append(type(val).__name__)
    return "|".join(parts)


def layer_signatures(gm: fx.GraphModule, n_blocks: int) -> list[str]:
    """One hex digest per layer (0..n_blocks+1) of its ops, shapes, parameters and wiring.

    A node contributes its target, output shapes/dtypes and arguments; an argument produced in the
    same layer is written as its position within the layer, one from elsewhere as ``ext`` plus its
    shape (a parameter as ``param`` plus its shape), a size expression (``is_size``) and a constant
    as themselves. Two blocks with equal digests run the same computation on the same shapes with
    same-shaped weights.
    """
    per_layer: list[list[fx.Node]] = [[] for _ in range(n_blocks + 2)]
    for n in gm.graph.nodes:
        lay = need(n, "layer", "layer_signatures", "assign_layers")
        if n.op == "call_function" and 0 <= lay <= n_blocks + 1 and not is_size(n):
            per_layer[lay].append(n)
    out = []
    for nodes in per_layer:
        pos = {n: i for i, n in enumerate(nodes)}
        h = hashlib.sha1()

        def arg(value):
            if isinstance(value, fx.Node):
                if is_size(value):  # by its expression, wherever export computed it first
                    return _fmt(value.meta.get("val"))
                if value in pos:
                    return f"%{pos[value]}"
                kind = "param" if value.op == "placeholder" and value.meta.get("layer", 0) >= 0 else "ext"
                return f"{kind}:{_val_sig(value.meta.get('val'))}"
            if isinstance(value, (list, tuple)):
                return "(" + ",".join(arg(x) for x in value) + ")"
            if isinstance(value, dict):
                return "{" + ",".join(f"{k}={arg(v)}" for k, v in sorted(value.items())) + "}"
            return _fmt(value)

        for n in nodes:
            h.update(f"{n.target}({arg(n.args)};{arg(n.kwargs)})->{_val_sig(n.meta.get('val'))}\n".encode())
        out.append(h.hexdigest()[:16])
    return out


@dataclass
class LayerIO:
    """Tensors entering and leaving one layer (lists of graph nodes, in graph order)."""

    inputs: list[fx.Node]
    """Tensors produced outside the layer (earlier layers or the data) that it reads."""
    boundary: list[fx.Node]
    """Tensors produced in layers <= i that layers > i read: what crosses the cut after i."""


def _is_activation(n: fx.Node) -> bool:
    if n.op == "placeholder":
        return n.meta.get("layer") == DATA
    return n.op == "call_function" and has_tensor(n.meta.get("val"))


def layer_io(gm: fx.GraphModule, n_blocks: int) -> list[LayerIO]:
    """Inputs and outgoing boundary of every layer 0..n_blocks+1 (see ``LayerIO``).

    Only tensor values count, parameters and buffers do not (each stage holds its own), and users
    that only read metadata (``sym_size``, asserts) are ignored. User inputs are never part of a
    boundary (the data loader hands them to whichever stage needs them) but are inputs.
    """
    n_layers = n_blocks + 2
    ios = [LayerIO([], []) for _ in range(n_layers)]
    for n in gm.graph.nodes:
        if not _is_activation(n):
            continue
        src = need(n, "layer", "layer_io", "assign_layers")
        user_layers = sorted(
            {need(u, "layer", "layer_io", "assign_layers") for u in n.users if not is_meta_only(u) and u.op != "output"}
        )
        if not user_layers:
            continue
        for lay in user_layers:
            if lay != src and 0 <= lay < n_layers:
                ios[lay].inputs.append(n)
        if src == DATA:
            continue
        last = user_layers[-1]
        for i in range(max(src, 0), min(last, n_layers - 1)):
            ios[i].boundary.append(n)
    return ios


_NAMED_CLASSES = ("matmul", "embedding", "norm", "attention")


def layer_names(gm: fx.GraphModule, n_blocks: int, block_paths: list[str], container: str | None = None) -> list[str]:
    """Display names: the blocks' module paths; for pre/post the module shared by their
    matmul/embedding/norm nodes (``embed``, ``head``, ``inner.cls.predictions``) unless that is
    an ancestor of the blocks' ``container`` (uninformative), else those modules joined by '+'
    (``inner.lm_head+inner.transformer.ln_f``). ``container`` defaults to the blocks' parent.
    """
    if container is None:
        container = block_paths[0].rpartition(".")[0] if block_paths else ""
    paths: list[set[str]] = [set() for _ in range(n_blocks + 2)]
    weighted: list[set[str]] = [set() for _ in range(n_blocks + 2)]
    for n in gm.graph.nodes:
        lay = n.meta.get("layer")
        if n.op == "call_function" and lay in (0, n_blocks + 1):
            p = n.meta.get("module_path", "")
            if p:
                paths[lay].add(p)
                if need(n, "op_class", "layer_names", "classify_ops") in _NAMED_CLASSES:
                    weighted[lay].add(p)
    for i in (0, n_blocks + 1):
        if weighted[i]:
            paths[i] = weighted[i]
    names = []
    for i in range(n_blocks + 2):
        if 1 <= i <= n_blocks:
            names.append(block_paths[i - 1])
            continue
        ps = sorted(paths[i])
        minimal = [p for p in ps if not any(q != p and p.startswith(q + ".") for q in ps)]
        common = _common_prefix(minimal)
        if len(minimal) > 1 and common and not (container + ".").startswith(common + "."):
            names.append(common)
        else:
            names.append("+".join(minimal) if minimal else ("pre" if i == 0 else "post"))
    return names


def _common_prefix(paths: list[str]) -> str:
    """Longest dotted prefix shared by all paths ('' if none)."""
    if not paths:
        return ""
    parts = [p.split(".") for p in paths]
    out = []
    for group in zip(*parts):
        if len(set(group)) != 1:
            break
        out.append(group[0])
    return ".".join(out)
