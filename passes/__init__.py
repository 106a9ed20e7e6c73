"""Analysis passes over the exported ATen graph (see each module's docstring).

Order (each pass checks the ``node.meta`` keys it needs):

1. ``passes.layers.assign_layers``            -> ``layer``, ``module_path``
2. ``passes.shapes.annotate_shapes``          -> ``shape``, ``dtype``, ``out_bytes``
3. ``passes.shapes.annotate_params``          -> ``fqn``, ``param_count``, ``param_bytes``, ``buffer_bytes``
4. ``passes.op_class.classify_ops``           -> ``op_class``
5. ``passes.autograd_costs.annotate_costs``   -> ``fwd_flops``, ``bwd_flops``, ``saved``, ``saved_bytes``,
                                                 ``requires_grad``
6. ``passes.tensor_parallel.tp_costs.propagate_tensor_parallel`` -> ``tp``

``passes.analyze.analyze(traced)`` runs them all on a ``passes.graph.TracedGraph``;
``passes.tabulate.table_from_traced`` analyzes and sums per layer. Tracing is the front end's
(``planner.frontend``): the passes receive a graph and never build a model.

This file exports nothing: callers import each name from the module that defines it, so a
file's imports show what it depends on. It imports nothing either: a re-plan from the
layer-table cache reads tables through ``passes.layer_table`` and ``passes.core`` without torch,
and ``import passes.layer_table`` runs this file first.
"""
