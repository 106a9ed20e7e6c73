"""Attention structure read from the graph: query heads, key/value heads and head size.

Tensor parallelism splits attention by heads, so it must know how many there are; a model given
as ``file.py:factory`` states none. This pass finds every attention core in an exported graph and
reads the counts from its operands' shapes:

* **SDPA** (``scaled_dot_product_attention`` and its kernel variants): ``q`` is ``[..., H, s, D]``
  and ``k`` ``[..., K, s', D]``. With ``enable_gqa`` ``K`` is the key/value head count itself.
  Otherwise a grouped-query model repeats its key/value heads before the call (HF's
  ``repeat_kv``: ``k[:, :, None].expand(b, K, H/K, s, D).reshape(b, H, s, D)``); walking back
  from ``k`` through views, copies and that ``expand`` gives ``K = H / repeats``. The runtime's
  block-sparse operator (``runtime.sparse_attention``) takes the same ``q, k, v`` and counts here.
* **eager attention**, the matmul-softmax-matmul pattern: ``softmax(q @ k^T [* scale, + mask])``
  (over the last dim) then ``@ v``, with ``q`` ``[b, H, s, D]`` read through the transpose,
  scales, masks, casts and dropout between them (Gemma 2's ``tanh`` soft-cap, gpt-oss's sink
  logits concatenated to the scores and sliced off the probabilities); ``K`` as above from
  ``k^T``'s source.

Writes ``node.meta["attention"]`` (an ``AttentionInfo``) on each attention core (the SDPA node,
or the eager pattern's ``softmax``); needs only ``meta["val"]`` (export's fake tensors).
``attention_facts`` summarizes them for the layer table's model facts.

``attention_core`` lists the nodes of one core, what selective recompute re-runs in backward
(Korthikanti et al. 2022): the SDPA node (and its tuple items), or every node on a path from
``q @ k^T`` to ``@ v`` (scale, mask, softmax, casts, dropout). Its inputs (q, k^T, v, the mask)
stay saved; what the core alone kept (scores, probabilities, dropout masks, a flash kernel's
output and log-sum-exp) is freed. The cost tables and code generation read the same list.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
from torch import fx

from passes.common import arg_node, hint
from passes.op_class import op_name

__all__ = ["AttentionInfo", "annotate_attention", "attention_facts", "attention_core"]

SDPA = {
    "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "block_sparse_attention",
}
_SOFTMAX = {"softmax", "_softmax", "_safe_softmax"}
_ACT_MATMUL = {"matmul", "bmm"}
_THROUGH = {
    "view",
    "_unsafe_view",
    "reshape",
    "unsqueeze",
    "clone",
    "contiguous",
    "_to_copy",
    "to",
    "alias",
    "slice",
    "expand",
    "type_as",
    "detach",
    "lift_fresh_copy",
}
"""Ops that keep a key/value tensor's heads (walked back through to find ``repeat_kv``)."""
_SCORES = {
    "mul",
    "div",
    "add",
    "sub",
    "masked_fill",
    "where",
    "_to_copy",
    "to",
    "type_as",
    "clone",
    "dropout",
    "native_dropout",
    "getitem",
    "tanh",  # Gemma 2's soft-capped logits: cap * tanh(scores / cap)
    "cat",  # gpt-oss's attention sinks: a learned logit per head joins the scores (first operand)
    "slice",  # ... and its probability is sliced off before ``@ v``
}
"""Ops between ``q @ k^T`` and the softmax or between the softmax and ``@ v``."""


@dataclass(frozen=True)
class AttentionInfo:
    """One attention core of the graph."""

    heads: int
    """Query heads ``H``."""
    kv_heads: int
    """Key/value heads ``K`` (``H`` without grouped-query attention; ``H`` divides by it)."""
    head_dim: int
    """Size ``D`` of one head (not always hidden / H: Gemma)."""
    pattern: str
    """``sdpa`` or ``eager`` (matmul-softmax-matmul)."""


def _shape(n) -> list[int]:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return [hint(d) for d in v.shape] if isinstance(v, torch.Tensor) else []


def _repeats(k: fx.Node) -> int:
    """How many times ``k``'s heads were repeated before attention (1 if not): the expansion of
    the ``expand`` met walking back through ``_THROUGH`` ops."""
    n, seen = k, 0
    while isinstance(n, fx.Node) and n.op == "call_function" and seen < 16:
        name = op_name(n)
        if name not in _THROUGH:
            return 1
        if name == "expand":
            src, dst = _shape(n.args[0]), _shape(n)
            src = [1] * (len(dst) - len(src)) + src
            return math.prod(d for s, d in zip(src, dst) if s == 1 and d > 1)
        n, seen = arg_node(n, 0), seen + 1
    return 1


def _kv_heads(k: fx.Node, heads: int, gqa: bool) -> int:
    kh = _shape(k)[-3]
    if gqa or kh != heads:
        return kh
    r = _repeats(k)
    return heads // r if r > 1 and heads % r == 0 else heads


def _back(n, allowed: set):
    """Walk back from ``n`` through ``allowed`` ops (first tensor argument; a ``cat``'s first
    tensor) to the first other node."""
    seen = 0
    while isinstance(n, fx.Node) and n.op == "call_function" and op_name(n) in allowed and seen < 16:
        first = n.args[0] if n.args else None
        if op_name(n) == "cat" and isinstance(first, (list, tuple)):
            n = next((a for a in first if isinstance(a, fx.Node)), None)
        else:
            n = next((a for a in n.args if isinstance(a, fx.Node)), None)
        seen += 1
    return n


def _forward(n: fx.Node, allowed: set):
    """The first user of ``n`` (through ``allowed`` single-user ops) that is an activation matmul
    reading it as its left operand."""
    for _ in range(16):
        mm = [u for u in n.users if op_name(u) in _ACT_MATMUL and u.args[0] is n]
        if mm:
            return mm[0]
        nxt = [u for u in n.users if op_name(u) in allowed]
        if len(nxt) != 1:
            return None
        n = nxt[0]
    return None


def _sdpa(n: fx.Node) -> AttentionInfo | None:
    q, k = arg_node(n, 0), arg_node(n, 1)
    sq, sk = _shape(q), _shape(k)
    if len(sq) < 3 or len(sk) < 3:
        return None
    gqa = bool(n.kwargs.get("enable_gqa", False))
    return AttentionInfo(sq[-3], _kv_heads(k, sq[-3], gqa), sq[-1], "sdpa")


def _eager(n: fx.Node) -> AttentionInfo | None:
    """``n`` is a softmax: is it the middle of ``softmax(q @ k^T ...) @ v`` over 4-d heads?"""
    x = arg_node(n, 0)
    nd = len(_shape(x))
    if nd != 4 or int(cast(int, n.args[1])) % nd != nd - 1:
        return None
    scores = _back(x, _SCORES)
    if not (isinstance(scores, fx.Node) and op_name(scores) in _ACT_MATMUL) or _forward(n, _SCORES) is None:
        return None
    q, kt = arg_node(scores, 0), arg_node(scores, 1)
    sq = _shape(q)
    if len(sq) != 4 or len(_shape(kt)) != 4:
        return None
    k = arg_node(kt, 0) if op_name(kt) in ("transpose", "permute") else kt
    return AttentionInfo(sq[1], _kv_heads(k, sq[1], False) if len(_shape(k)) == 4 else sq[1], sq[-1], "eager")


def attention_core(n: fx.Node) -> list[fx.Node]:
    """The nodes of the attention core annotated on ``n`` (``meta['attention']``), in graph
    order; ``[]`` when ``n`` is not one. See the module doc."""
    info = n.meta.get("attention")
    if info is None:
        return []
    if info.pattern == "sdpa":
        return [n] + [u for u in n.users if op_name(u) == "getitem"]
    start, end = _back(n.args[0], _SCORES), _forward(n, _SCORES)
    if not (isinstance(start, fx.Node) and isinstance(end, fx.Node)):
        return []
    after: set[fx.Node] = set()
    todo = [start]
    while todo:  # everything computed from the scores, up to the @ v
        x = todo.pop()
        if x in after:
            continue
        after.add(x)
        if x is not end:
            todo.extend(x.users)
    core: set[fx.Node] = set()
    todo = [end]
    while todo:  # ... that the @ v reads (a path from the scores to it)
        x = todo.pop()
        if x in core or x not in after:
            continue
        core.add(x)
        todo.extend(a for a in x.all_input_nodes)
    order = {x: i for i, x in enumerate(n.graph.nodes)}
    return sorted(core, key=order.__getitem__)


def annotate_attention(gm: fx.GraphModule | fx.Graph) -> fx.GraphModule | fx.Graph:
    """Write ``meta['attention']`` on every attention core of ``gm`` (a graph module or a bare
    graph; see the module doc)."""
    for n in gm.nodes if isinstance(gm, fx.Graph) else gm.graph.nodes:
        if n.op != "call_function":
            continue
        name = op_name(n)
        info = _sdpa(n) if name in SDPA else _eager(n) if name in _SOFTMAX else None
        if info is not None:
            n.meta["attention"] = info
    return gm


def attention_facts(gm: fx.GraphModule) -> dict:
    """``{"heads", "kv_heads", "head_dim", "attention_nodes"}`` of the graph's attention cores
    (annotating them first if needed); ``{}`` when it has none. When the cores disagree (a hybrid
    model), ``heads`` and ``kv_heads`` are the greatest common divisors (what tp must divide),
    ``head_dim`` the first core's, and ``mixed`` names the core that differs."""
    found = [n for n in gm.graph.nodes if "attention" in n.meta]
    if not found:
        annotate_attention(gm)
        found = [n for n in gm.graph.nodes if "attention" in n.meta]
    if not found:
        return {}
    infos = [n.meta["attention"] for n in found]
    first = infos[0]
    out = {
        "heads": math.gcd(*[i.heads for i in infos]),
        "kv_heads": math.gcd(*[i.kv_heads for i in infos]),
        "head_dim": first.head_dim,
        "attention_nodes": len(found),
    }
    other = next(
        (
            n
            for n, i in zip(found, infos)
            if (i.heads, i.kv_heads, i.head_dim) != (first.heads, first.kv_heads, first.head_dim)
        ),
        None,
    )
    if other is not None:
        out["mixed"] = other.name
    return out
