"""Context-parallel plans for tests, until ``planner plan --cp`` exists: the equivalent data-parallel
plan (``dp * cp`` ranks, the real search) with ``cp`` of its dp ranks turned into one
context-parallel group: ``dp`` divided by ``cp``, the micro-batches multiplied by ``cp`` (so
``global_batch == dp * micro_batch_size * num_micro_batches`` still holds) and plan.json's
``context_parallel`` set."""

from __future__ import annotations

import functools

from cost_models.hardware import load_hardware
from planner.frontend.model_analysis import build_layer_table
from planner.plan import Plan
from planner.search.request import PlanRequest
from planner.search.solve import solve

__all__ = ["cp_plan"]


@functools.lru_cache(maxsize=None)
def _table(spec: str, seq_len: int, sizes: tuple):
    return build_layer_table(spec, batch=1, seq_len=seq_len, dtype="fp32", **dict(sizes))


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
        dp=dp * cp,
        tp=tp,
        pp=pp,
        zero_stage=zero_stage,
        sizes=dict(sizes or {}),
    )
    planned = solve(
        request, _table(spec, seq_len, tuple(sorted((sizes or {}).items()))), load_hardware("cpu", gpus_per_node=gpus)
    ).plan.to_dict()
    planned.pop("alternatives", None)
    planned["dp"] = dp
    planned["num_micro_batches"] *= cp
    planned["context_parallel"] = {"degree": cp, "method": method}
    return Plan.from_dict(planned)
