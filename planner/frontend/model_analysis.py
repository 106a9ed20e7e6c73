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
import sys
from typing import TYPE_CHECKING

from planner.frontend import cache

if TYPE_CHECKING:
    from passes.compiled_table import CompiledTable
    from passes.layer_table import LayerTable
    from planner.frontend.bundle import ModelBundle

__all__ = ["build_layer_table"]


@contextlib.contextmanager
def _cyclic_gc_paused():
    """Pause Python's cyclic garbage collector while importing the tracer, tracing and analyzing.

    They allocate millions of small objects (the imports' modules and functions; the trace's fake
    tensors, symbolic sizes, sympy terms), which trigger a hundred collections, and each full one
    walks every object torch, sympy and transformers hold: a tenth of the trace's time. Cycles
    made meanwhile are few (the peak memory grows by a few percent at most: 388 -> 391 MB for
    LLaMA-3-8B, 361 -> 396 MB for a full trace of all 48 blocks of gpt2-xl) and the first
    collection after this frees them.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


#: Whether a cache miss freezes the objects its imports left (``_freeze_imports``). Off by
#: default: freezing keeps every object alive then, garbage in the older generations included,
#: which a long-lived process (a test run, a notebook) would pay for in memory. The command line,
#: one plan per process, turns it on (``planner.cli._run``).
FREEZE_IMPORTS = False


def _freeze_imports() -> None:
    """Collect the young generation once, then move every object the collector tracks into its
    permanent generation (``gc.freeze``), where no later collection walks it.

    Called right after the tracing stack was imported: torch's export machinery, sympy and
    transformers leave about 500,000 objects (modules, classes, functions) that live as long as
    the process. Left in the young generations, the first collection after the pause walks them
    all and moves them on to be walked again by the older generations' collections. Frozen, collections
    see only the trace's own objects, whose cycles they still free. Collecting first is what keeps
    that true: the imports leave some garbage cycles, and one of them holds a frame object
    (``torch.fx.wrap`` looks at its caller's frame) whose chain of callers reaches up to
    ``build_layer_table``; frozen alive, those frames would keep whatever the trace leaves in
    their variables for good (``tests/planner/frontend/test_import_freeze.py``).
    """
    gc.collect(0)  # the paused imports' objects are all young
    gc.freeze()


def build_layer_table(
    model: str | ModelBundle,
    *,
    batch: int | None = None,
    seq_len: int | None = None,
    dtype=None,
    shallow: bool = True,
    dynamic: bool = True,
    positions: int | None = None,
    **sizes,
) -> LayerTable | CompiledTable:
    """Trace ``model`` (spec or ``ModelBundle``) and return its layer table, from the cache when
    this spec was analyzed before with the same arguments and code: then its compiled numeric
    form (``passes.compiled_table``), which imports no sympy and loads the symbolic table only
    for a caller that reads an expression.

    ``sizes`` are the model size flags (layers, hidden, heads, kv_heads, ffn, vocab);
    ``positions`` the model's position table (the ``seq_len`` size of ``build_model``).
    """
    options = dict(batch=batch, seq_len=seq_len, dtype=dtype, shallow=shallow, dynamic=dynamic, positions=positions)
    key = None
    if isinstance(model, str) and cache.cache_enabled():
        key = cache.table_key(model, dict(options, sizes=sizes))
    if key is None:
        return _traced(model, options, sizes)

    def traced_and_stored() -> LayerTable:
        table = _traced(model, options, sizes)
        cache.store_table(key, table)
        return table

    cached = cache.load_table(key, rebuild=traced_and_stored)
    return cached if cached is not None else traced_and_stored()


def _traced(model: str | ModelBundle, options: dict, sizes: dict) -> LayerTable:
    """The layer table of ``model`` traced now (``build_layer_table``'s arguments)."""
    with _cyclic_gc_paused():
        # Tracing needs torch (and transformers for HF models), whose imports are most of a
        # re-plan's time: they are imported here, on a miss, and never by a plan the cache answers.
        modules = len(sys.modules)
        trace = importlib.import_module("planner.frontend.trace")
        table_from_traced = importlib.import_module("passes.tabulate").table_from_traced
        trace.import_tracer(model)
        if FREEZE_IMPORTS and len(sys.modules) > modules:
            _freeze_imports()
        traced = trace.trace_model(model, **options, **sizes)
        return table_from_traced(traced)
