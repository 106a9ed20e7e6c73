"""Selective recompute in generated code: a layer's attention cores become checkpointed submodules.

A layer in the plan's ``selective_layers`` keeps every activation but those its attention cores
alone hold (``passes.attention.attention_core``: ``q k^T``, scale, mask, softmax, dropout, ``@ v``,
or one SDPA call). ``extract_attention_cores`` cuts each core out of the layer's ``fx.Graph``
(after the tensor-parallel rewrite, so the core sees this rank's heads) into a graph of its own,
and puts in its place::

    attention_core_0 = self.attention_core_0
    checkpoint = runtime.checkpoint(attention_core_0, q, k_t, v, mask)
    getitem = checkpoint[0]

``codegen.lower`` prints each core graph as a small ``torch.nn.Module`` class (``AttentionCore``,
identical cores sharing it) that the layer holds as ``self.attention_core_<j>``; the core has no
weights. ``runtime.checkpoint`` keeps the core's inputs, drops its internals and runs the core
again in backward, which ``runtime.timing`` counts as ``recompute`` (the cores are marked
``SELECTIVE_RECOMPUTE``).
"""

from __future__ import annotations

import operator

import torch.fx as fx

import runtime
from codegen.codegen_errors import LoweringError
from passes.attention import annotate_attention, attention_core
from runtime import context_parallel

__all__ = ["CoreGraph", "extract_attention_cores", "CORE_ATTR"]

CORE_ATTR = "attention_core_{}"
"""Attribute name of the ``j``-th attention core of a layer."""


class CoreGraph:
    """One attention core cut out of a layer: its graph and its attribute on the layer."""

    def __init__(self, attr: str, graph: fx.Graph):
        self.attr, self.graph = attr, graph


def _core_sets(graph: fx.Graph) -> list[list[fx.Node]]:
    annotate_attention(graph)
    cores, taken = [], set()
    for n in graph.nodes:
        # a context-parallel core (codegen.context_rewrite) is one call, as SDPA is
        core = [n] if n.target is context_parallel.attention else attention_core(n)
        nodes = [x for x in core if x not in taken]
        if nodes:
            cores.append(nodes)
            taken.update(nodes)
    return cores


def extract_attention_cores(graph: fx.Graph, where: str) -> list[CoreGraph]:
    """Replace each attention core of ``g`` by a ``runtime.checkpoint`` call of a submodule; return
    the cores' graphs. ``where`` names the layer in the error raised when it has no core."""
    cores = _core_sets(graph)
    if not cores:
        raise LoweringError(
            f"{where} is listed in selective_layers but has no attention core "
            "(q k^T -> softmax -> @ v, or scaled_dot_product_attention) to recompute; "
            "recompute it whole (checkpoint_layers) or not at all"
        )
    out = []
    for j, nodes in enumerate(cores):
        inside = set(nodes)
        inputs: list[fx.Node] = []
        for x in nodes:
            for arg in x.all_input_nodes:
                if arg not in inside and arg not in inputs:
                    inputs.append(arg)
        results = [x for x in nodes if any(user not in inside for user in x.users)]
        core_graph = fx.Graph()
        env = {arg: core_graph.placeholder(arg.name) for arg in inputs}
        for x in nodes:
            env[x] = core_graph.node_copy(x, lambda arg: env[arg])
        core_graph.output(tuple(env[result] for result in results) if len(results) != 1 else env[results[0]])
        attr = CORE_ATTR.format(j)
        order = {x: i for i, x in enumerate(graph.nodes)}
        users = [user for result in results for user in result.users if user not in inside]
        after = max((order[arg] for arg in inputs), default=-1)
        if users and after >= min(order[user] for user in users):
            raise LoweringError(
                f"{where}: an input of its attention core is computed after the core's "
                "output is used, so the core cannot be recomputed as one call; "
                "recompute the layer whole (checkpoint_layers) instead"
            )
        first = next(x for x in graph.nodes if order[x] > after and (x in inside or x in users or x.op == "output"))
        with graph.inserting_before(first):
            fn = graph.get_attr(attr)
            call = graph.call_function(runtime.checkpoint, (fn, *inputs))
            outs = (
                [call]
                if len(results) == 1
                else [graph.call_function(operator.getitem, (call, i)) for i in range(len(results))]
            )
        for result, replacement in zip(results, outs):
            result.replace_all_uses_with(replacement, delete_user_cb=lambda user: user not in inside)
        for x in reversed(nodes):
            graph.erase_node(x)
        out.append(CoreGraph(attr, core_graph))
    return out
