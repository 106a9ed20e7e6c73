"""Analysis passes over the exported ATen graph (see each module's docstring).

Order (each pass checks the ``node.meta`` keys it needs):

1. ``assign_layers``            -> ``layer``, ``module_path``
2. ``annotate_shapes``          -> ``shape``, ``dtype``, ``out_bytes``
3. ``annotate_params``          -> ``fqn``, ``param_count``, ``param_bytes``, ``buffer_bytes``
4. ``classify_ops``             -> ``op_class``
5. ``annotate_costs``           -> ``fwd_flops``, ``bwd_flops``, ``saved``, ``saved_bytes``,
                                   ``requires_grad``
6. ``propagate_tensor_parallel`` -> ``tp``

``analyze(traced)`` runs them all; ``passes.layer_table.build_layer_table`` is the entry point
that traces, analyzes and sums per layer.
"""

from passes.autograd_costs import annotate_costs, total_saved_bytes
from passes.layers import assign_layers, layer_io, layer_names, layer_signatures
from passes.op_class import classify_ops
from passes.shapes import annotate_params, annotate_shapes
from passes.tensor_parallel import propagate_tensor_parallel

__all__ = ["analyze", "assign_layers", "annotate_shapes", "annotate_params", "classify_ops",
           "annotate_costs", "propagate_tensor_parallel", "total_saved_bytes", "layer_io",
           "layer_names", "layer_signatures", "build_layer_table", "LayerTable", "LayerCosts"]


def analyze(traced):
    """Run every pass on ``traced.gm`` (a ``planner.trace.Traced``) and return the graph.

    Blocks with identical signatures are replayed once (``annotate_costs``'s ``same_as``).
    """
    gm = traced.gm
    assign_layers(gm, traced.block_paths, traced.roles)
    annotate_shapes(gm, traced.symbols)
    annotate_params(gm, traced.roles, traced.fqns, traced.tied)
    classify_ops(gm)
    n_blocks = len(traced.block_paths)
    sigs = layer_signatures(gm, n_blocks)
    first: dict[str, int] = {}
    same_as = {}
    for lay in range(1, n_blocks + 1):
        rep = first.setdefault(sigs[lay], lay)
        if rep != lay:
            same_as[lay] = rep
    annotate_costs(gm, traced.roles, traced.symbols, same_as)
    propagate_tensor_parallel(gm, traced.roles)
    return gm


def __getattr__(name):  # the layer table imports planner.trace lazily; keep `import passes` light
    if name in ("build_layer_table", "LayerTable", "LayerCosts", "table_from_traced"):
        from passes import layer_table

        return getattr(layer_table, name)
    raise AttributeError(name)
