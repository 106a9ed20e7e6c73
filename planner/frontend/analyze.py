"""The front end's product: a model spec traced and analyzed into its layer table.

``build_layer_table`` is what ``planner plan`` and ``planner calibrate`` call: trace the model on
the meta device (``planner.frontend.trace``), run every pass and sum costs per layer
(``passes.layer_table``).
"""

from __future__ import annotations

from passes.layer_table import LayerTable, table_from_traced
from planner.frontend.bundle import ModelBundle
from planner.frontend.trace import trace_model

__all__ = ["build_layer_table"]


def build_layer_table(model: str | ModelBundle, *, batch: int | None = None, seq_len: int | None = None,
                      dtype=None, shallow: bool = True, dynamic: bool = True,
                      positions: int | None = None, **sizes) -> LayerTable:
    """Trace ``model`` (spec or ``ModelBundle``) and return its layer table.

    ``sizes`` are the model size flags (layers, hidden, heads, kv_heads, ffn, vocab);
    ``positions`` the model's position table (the ``seq_len`` size of ``build_model``).
    """
    traced = trace_model(model, batch=batch, seq_len=seq_len, dtype=dtype, shallow=shallow, positions=positions,
                         dynamic=dynamic, **sizes)
    return table_from_traced(traced)
