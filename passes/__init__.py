"""Analysis passes over the exported ATen graph (see each module's docstring).

Order (each pass checks the ``node.meta`` keys it needs):

1. ``assign_layers``            -> ``layer``, ``module_path``
2. ``annotate_shapes``          -> ``shape``, ``dtype``, ``out_bytes``
3. ``annotate_params``          -> ``fqn``, ``param_count``, ``param_bytes``, ``buffer_bytes``
4. ``classify_ops``             -> ``op_class``
5. ``annotate_costs``           -> ``fwd_flops``, ``bwd_flops``, ``saved``, ``saved_bytes``,
                                   ``requires_grad``
6. ``propagate_tensor_parallel`` -> ``tp``

``passes.analyze.analyze(traced)`` runs them all on a ``passes.graph.TracedGraph``;
``passes.tabulate.table_from_traced`` analyzes and sums per layer. Tracing is the front end's
(``planner.frontend``): the passes receive a graph and never build a model.

The names below are exported lazily (PEP 562): ``import passes.layer_table`` runs this file
first, and a re-plan from the layer-table cache reads tables without torch (``passes.core``), so
this file must not import the passes, which need torch, until one of them is asked for.
(``passes.analyze`` is the module, not its function ``analyze``: a submodule's name wins.)
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "annotate_costs": "passes.autograd_costs",
    "total_saved_bytes": "passes.autograd_costs",
    "PassError": "passes.core",
    "TracedGraph": "passes.graph",
    "LayerCosts": "passes.layer_table",
    "LayerTable": "passes.layer_table",
    "table_from_traced": "passes.tabulate",
    "assign_layers": "passes.layers",
    "layer_io": "passes.layers",
    "layer_names": "passes.layers",
    "layer_signatures": "passes.layers",
    "classify_ops": "passes.op_class",
    "annotate_params": "passes.shapes",
    "annotate_shapes": "passes.shapes",
    "propagate_tensor_parallel": "passes.tensor_parallel.tp_costs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'passes' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
