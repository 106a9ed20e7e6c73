"""A layer-table miss imports the tracer first and freezes what the imports made, not the trace.

``build_layer_table`` hands the objects of the tracing stack's imports (torch.export, sympy,
transformers) to ``gc.freeze`` so that no later collection walks them; the trace's own objects
must stay collectable, or every miss in a long-lived process would leak its graph. Each check
runs in a fresh interpreter: the freeze happens only when a miss imports something new.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.dist  # each check runs in a fresh interpreter

_MISS = """
import gc, json, sys, weakref
import planner.frontend.trace as trace
import planner.frontend.model_analysis as analyze
from planner.frontend.model_analysis import build_layer_table
analyze.FREEZE_IMPORTS = True  # as the command line sets it

traces = []
trace_model = trace.trace_model
def keep_a_weakref(*args, **kwargs):
    traced = trace_model(*args, **kwargs)
    traces.append(weakref.ref(traced.exported))
    return traced
trace.trace_model = keep_a_weakref

table = build_layer_table("gpt", batch=1, seq_len=16, dtype="fp32", layers=3, hidden=32, heads=2, vocab=64)
frozen = gc.get_freeze_count()
gc.collect()
print(json.dumps({"enabled": gc.isenabled(), "frozen": frozen, "trace_freed": traces[0]() is None,
                  "rows": len(table.layers)}))
"""

_IMPORTS = """
import json, sys
from planner.frontend.trace import import_tracer
import_tracer("gpt")
gpt = sorted(m for m in ("torch._dynamo", "transformers") if m in sys.modules)
import_tracer("hf:llama")
print(json.dumps({"gpt": gpt, "llama": "transformers.models.llama.modeling_llama" in sys.modules}))
"""


def _run(code: str) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT, "PLANNER_CACHE": "off"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_miss_freezes_the_imports_and_frees_the_trace():
    got = _run(_MISS)
    assert got["rows"] == 5
    assert got["enabled"], "the collector must be running again after the miss"
    assert got["frozen"] > 100_000, "the tracing stack's imports were not frozen"
    assert got["trace_freed"], "the trace was frozen with the imports: every miss would leak it"


def test_import_tracer_imports_transformers_only_for_hf_models():
    got = _run(_IMPORTS)
    assert got["gpt"] == ["torch._dynamo"]
    assert got["llama"]
