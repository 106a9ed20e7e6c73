"""``planner plan`` from request to Plan: hardware, layer table, search.

The model is traced at micro-batch 1 with symbolic (b, s) costs, so the search substitutes each
candidate micro-batch size instead of tracing again.
"""

from __future__ import annotations

from planner.search.request import PlanRequest

__all__ = ["plan_from_request", "model_sizes_for"]


def model_sizes_for(req: PlanRequest) -> dict:
    """Size overrides recorded in the plan: the user's flags, plus a longer position table when
    ``--seq-len`` exceeds what a built-in GPT preset was built for."""
    from planner.frontend.gpt import PRESETS
    from planner.frontend.bundle import parse_spec

    sizes = dict(req.sizes)
    kind, name = parse_spec(req.spec)
    if kind == "gpt":
        base = PRESETS[name].seq_len if "seq_len" not in sizes else sizes["seq_len"]
        if req.seq_len > base:
            sizes["seq_len"] = req.seq_len
    elif kind == "hf" and req.seq_len > 0:
        sizes.setdefault("seq_len", max(req.seq_len, sizes.get("seq_len", 0)) or req.seq_len)
    return sizes


def plan_from_request(req: PlanRequest):
    """Return ``(Plan, HardwareProfile)`` for a request; every bad input is a ``UserError``."""
    from cost_models.hardware import load_hardware
    from planner.frontend.analyze import build_layer_table
    from planner.search.solve import plan_strategy

    hw = load_hardware(req.hardware, gpus_per_node=req.gpus_per_node or None)
    if not req.gpus_per_node:
        req.gpus_per_node = hw.gpus_per_node
    sizes = model_sizes_for(req)
    flags = dict(sizes)
    positions = flags.pop("seq_len", None)  # the model's position table, not the traced length
    table = build_layer_table(req.spec, batch=1, seq_len=req.seq_len, dtype=req.dtype,
                              positions=positions, **flags)
    req.sizes = sizes
    return plan_strategy(req, table, hw), hw
