"""Context-parallel plans for tests: the planner's own search with the degrees, the context-parallel
method and micro-batches of one sequence pinned (``planner plan --cp N --cp-method M``)."""

from __future__ import annotations

import functools

from cost_models.hardware import load_hardware
from planner.frontend.model_analysis import build_layer_table
from planner.plan import Plan
from planner.search.request import PlanRequest
from planner.search.solve import solve

__all__ = ["cp_plan"]


TRACE_SEQ = 256
"""The sequence length every model is traced at. A layer table's costs are symbolic in the batch
and the sequence (``planner.frontend.model_analysis``), so one trace per model serves the plans of
every length (a plan at 2048 from this table equals the one from a trace at 2048), and compile
exports each plan at its own length; each extra trace cost about 9 s of the suite."""


@functools.lru_cache(maxsize=None)
def _table(spec: str, sizes: tuple):
    return build_layer_table(spec, batch=1, seq_len=TRACE_SEQ, dtype="fp32", **dict(sizes))


def cp_plan(
    spec: str,
    *,
    cp: int,
    method: str,
    seq_len: int,
    global_batch: int,
    dp=1,
    tp=1,
    pp=1,
    zero_stage=None,
    sizes: dict | None = None,
) -> Plan:
    """A plan of ``dp * cp * tp * pp`` ranks with context parallelism ``cp`` over ``method``
    (micro-batches of one sequence); ``sizes``: the model's size flags (layers, hidden, ...)."""
    gpus = dp * cp * tp * pp
    request = PlanRequest(
        spec=spec,
        gpus=gpus,
        gpus_per_node=gpus,
        hardware="cpu",
        global_batch=global_batch,
        seq_len=seq_len,
        dtype="fp32",
        micro_batch=1,
        dp=dp,
        tp=tp,
        pp=pp,
        cp=cp,
        cp_method=method,
        zero_stage=zero_stage,
        sizes=dict(sizes or {}),
    )
    table = _table(spec, tuple(sorted((sizes or {}).items())))
    plan = solve(request, table, load_hardware("cpu", gpus_per_node=gpus)).plan
    assert plan.context_parallel == {"degree": cp, "method": method}, plan.context_parallel
    return plan
