"""The front end's product: a model spec traced and analyzed into its layer table.

``build_layer_table`` is what ``planner plan`` and ``planner calibrate`` call: trace the model on
the meta device (``planner.frontend.trace``), run every pass and sum costs per layer
(``passes.layer_table``). Tracing costs seconds and a model is planned again and again, so the
table of a spec is kept in the user's cache folder and read back while nothing it depends on has
changed (``planner.frontend.cache``, which documents the key and ``PLANNER_CACHE=off``). A hit
imports no torch: the tracer and the passes are imported on a miss only.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
from typing import TYPE_CHECKING

from passes.layer_table import LayerTable
from planner.frontend import cache

if TYPE_CHECKING:
    from planner.frontend.bundle import ModelBundle

__all__ = ["build_layer_table"]


@contextlib.contextmanager
def _cyclic_gc_paused():
    """Pause Python's cyclic garbage collector while tracing and analyzing.

    Both allocate millions of small objects (fake tensors, symbolic sizes, sympy terms), which
    trigger a hundred collections, and each full one walks every object torch, sympy and
    transformers hold: a tenth of the trace's time. Cycles made meanwhile are few (the peak memory
    grows by a few percent at most: 388 -> 391 MB for LLaMA-3-8B, 361 -> 396 MB for a full trace
    of all 48 blocks of gpt2-xl) and the first collection after this frees them.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def build_layer_table(model: str | ModelBundle, *, batch: int | None = None, seq_len: int | None = None,
                      dtype=None, shallow: bool = True, dynamic: bool = True,
                      positions: int | None = None, **sizes) -> LayerTable:
    """Trace ``model`` (spec or ``ModelBundle``) and return its layer table, from the cache when
    this spec was analyzed before with the same arguments and code.

    ``sizes`` are the model size flags (layers, hidden, heads, kv_heads, ffn, vocab);
    ``positions`` the model's position table (the ``seq_len`` size of ``build_model``).
    """
    key = None
    if isinstance(model, str) and cache.cache_enabled():
        key = cache.table_key(model, dict(batch=batch, seq_len=seq_len, dtype=dtype, shallow=shallow,
                                          dynamic=dynamic, positions=positions, sizes=sizes))
        table = cache.load_table(key) if key is not None else None
        if table is not None:
            return table
    # Tracing needs torch (and transformers for HF models), whose imports are most of a re-plan's
    # time: they are imported here, on a miss, and never by a plan the cache answers.
    trace_model = importlib.import_module("planner.frontend.trace").trace_model
    table_from_traced = importlib.import_module("passes.tabulate").table_from_traced
    with _cyclic_gc_paused():
        traced = trace_model(model, batch=batch, seq_len=seq_len, dtype=dtype, shallow=shallow,
                             positions=positions, dynamic=dynamic, **sizes)
        table = table_from_traced(traced)
    if key is not None:
        cache.store_table(key, table)
    return table
