"""Analysis passes over the exported ATen graph (see each module's docstring).

Order (each pass checks the ``node.meta`` keys it needs):

1. ``assign_layers``            -> ``layer``, ``module_path``
2. ``annotate_shapes``          -> ``shape``, ``dtype``, ``out_bytes``
3. ``annotate_params``          -> ``fqn``, ``param_count``, ``param_bytes``, ``buffer_bytes``
4. ``classify_ops``             -> ``op_class``
5. ``annotate_costs``           -> ``fwd_flops``, ``bwd_flops``, ``saved``, ``saved_bytes``,
                                   ``requires_grad``
6. ``propagate_tensor_parallel`` -> ``tp``

``analyze(traced)`` (``passes.analyze``) runs them all on a ``passes.graph.TracedGraph``;
``passes.layer_table.table_from_traced`` analyzes and sums per layer. Tracing is the front end's
(``planner.frontend``): the passes receive a graph and never build a model.
"""

from passes.analyze import analyze
from passes.autograd_costs import annotate_costs, total_saved_bytes
from passes.common import PassError
from passes.graph import TracedGraph
from passes.layer_table import LayerCosts, LayerTable, table_from_traced
from passes.layers import assign_layers, layer_io, layer_names, layer_signatures
from passes.op_class import classify_ops
from passes.shapes import annotate_params, annotate_shapes
from passes.tensor_parallel import propagate_tensor_parallel

__all__ = ["analyze", "assign_layers", "annotate_shapes", "annotate_params", "classify_ops",
           "annotate_costs", "propagate_tensor_parallel", "total_saved_bytes", "layer_io",
           "layer_names", "layer_signatures", "LayerTable", "LayerCosts", "table_from_traced",
           "TracedGraph", "PassError"]
