"""Mixture-of-experts facts for pricing: per layer-table row, what expert parallelism changes.

``passes.expert_regions.find_expert_regions`` finds each MoE layer's routed experts (the grouped
products, their ``[E, ...]`` weights, ``E`` and ``top_k``). This pass turns the regions that
expert parallelism can cut into what ``cost_models.expert_cost`` prices, and marks the nodes the
layer table sums apart (``passes.tabulate``):

- ``node.meta["moe_expert"] = True`` on each routed expert weight (a placeholder: its parameters
  are the row's ``expert_param_count``, what ep divides) and on each grouped product (its listed
  products, ``fwd_gemms`` / ``bwd_gemms`` from ``passes.autograd_costs``, are the row's
  ``expert_fwd_gemms`` / ``expert_bwd_gemms``). The products' FLOPs stay in the row's FLOPs at the
  even share of tokens, as ``passes.autograd_costs`` counted them: the expert fields only say which
  part pricing may scale;
- per row (``MoeLayer``): ``experts``, ``top_k``, ``moe_layers``, ``expert_dispatch_bytes`` (the
  routed rows' bytes, the first product's row input: ``tokens x top_k x hidden x`` element size,
  what one dispatch moves in all), ``expert_tokens`` (rows per expert at the even share: the rows
  dim of the first forward product as listed) and ``shared_experts``.

Shared experts are counted from module names, as transformers names them: a ``shared_expert``
module (Qwen2-MoE) is one always-on expert; a ``shared_experts`` module (DeepSeek-V2/V3, one MLP
whose width is ``n_shared_experts`` routed experts') counts its parameters over one routed
expert's. They are dense work and priced as such (replicated, dp-sharded state).

A layer whose region carries a ``reason`` (``ExpertRegion.reason``: routing it cannot read, a
per-row tensor laid out before the dispatch; GPT-OSS's per-expert bias is not one, it is cut with
the experts) keeps its experts replicated; so does a model whose experts are a
``ModuleList`` of MLPs run in a python loop over data-dependent indices (no grouped products:
``replicated_reason``). ``moe_summary`` says why in the table's ``model["moe"]["reason"]``, which
the planner reports.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx as fx

from passes.expert_regions import ExpertRegion, find_expert_regions
from passes.op_class import op_name

__all__ = ["MOE_META", "MoeLayer", "annotate_moe", "moe_summary", "replicated_reason"]

MOE_META = "moe_expert"
"""``node.meta`` key this pass owns: True on routed expert weights and grouped products."""

_LOOPED_EXPERT = re.compile(r"(^|\.)experts\.\d+(\.|$)")
_SHARED = re.compile(r"^(.*?\.?(shared_experts?))\.")


@dataclass
class MoeLayer:
    """One layer-table row's routed experts (several MoE layers in one row add up)."""

    layer: int
    experts: int
    top_k: int
    moe_layers: int = 0
    dispatch_bytes: Any = sympy.Integer(0)
    tokens: Any = sympy.Integer(0)
    shared_experts: int = 0
    routed_params: int = 0
    """Parameters of the row's routed experts (to count shared experts in routed-expert units)."""


def _layer_of(region: ExpertRegion) -> int:
    return int(region.products[0].meta.get("layer", -1))


def annotate_moe(
    gm: fx.GraphModule, roles: dict[str, str], fqns: dict[str, str]
) -> tuple[dict[int, MoeLayer], list[str]]:
    """Mark the routed experts of ``gm`` (module docstring) and return, per layer-table row, its
    ``MoeLayer``, and the reasons of the regions left replicated."""
    by_layer: dict[int, MoeLayer] = {}
    reasons: list[str] = []
    for region in find_expert_regions(gm, roles=roles, fqns=fqns):
        top_k = region.top_k
        if region.reason is None and not top_k:
            region.reason = "the router's top-k could not be read"
        if region.reason is not None or not top_k:
            reasons.append(f"{region.module or 'experts'}: {region.reason}")
            continue
        layer = _layer_of(region)
        facts = by_layer.setdefault(layer, MoeLayer(layer, region.experts, int(top_k)))
        if (facts.experts, facts.top_k) != (region.experts, region.top_k):
            reasons.append(f"{region.module}: MoE layers of one block disagree on experts or top_k")
            continue
        for node in list(region.products) + list(region.param_nodes):
            node.meta[MOE_META] = True
        facts.moe_layers += 1
        rows = region.rows if region.rows is not None else region.products[0].args[0]
        assert isinstance(rows, fx.Node), f"grouped product {region.products[0].name} has no row input node"
        facts.dispatch_bytes = facts.dispatch_bytes + rows.meta.get("out_bytes", 0)
        first = (region.products[0].meta.get("fwd_gemms") or [None])[0]
        facts.tokens = first.m if first is not None else rows.meta["shape"][0] / region.experts
        facts.routed_params += sum(int(node.meta.get("param_count", 0)) for node in region.param_nodes)
    _count_shared(gm, by_layer, roles, fqns)
    return by_layer, reasons


def _count_shared(
    gm: fx.GraphModule, by_layer: dict[int, MoeLayer], roles: dict[str, str], fqns: dict[str, str]
) -> None:
    """Shared experts per MoE row, from the always-on modules' names and sizes (module docstring)."""
    modules: dict[tuple[int, str, str], int] = {}
    for node in gm.graph.nodes:
        if node.op != "placeholder" or roles.get(node.name) != "param":
            continue
        match = _SHARED.match(fqns.get(node.name, ""))
        layer = int(node.meta.get("layer", -1))
        if match and layer in by_layer:
            key = (layer, match.group(1), match.group(2))
            modules[key] = modules.get(key, 0) + int(node.meta.get("param_count", 0))
    for (layer, _path, kind), params in modules.items():
        facts = by_layer[layer]
        per_expert = facts.routed_params / max(facts.experts, 1)
        count = 1 if kind == "shared_expert" or not per_expert else max(1, round(params / per_expert))
        facts.shared_experts += count


def replicated_reason(gm: fx.GraphModule, regions_found: bool) -> str | None:
    """Why a model that looks like a mixture of experts has no region to shard: experts as a
    ``ModuleList`` of MLPs (``experts.0``, ``experts.1``...) run in a python loop (transformers 4.x
    picked each expert's tokens by data-dependent indices; a graph that exports runs every expert
    on its tokens one by one), which has no grouped product to cut."""
    if regions_found:
        return None
    for node in gm.graph.nodes:
        path = node.meta.get("module_path") or ""
        if _LOOPED_EXPERT.search(path):
            return (
                f"the experts ({path.rsplit('.experts.', 1)[0]}.experts) are a ModuleList of MLPs the graph runs one "
                "by one (a python loop), not grouped expert products: the planner cannot route their tokens "
                "between ranks, so every rank holds every expert"
            )
        experts = _dense_experts(node)
        if experts:
            return (
                f"the experts ({path or node.name}) run every token through all {experts} of them (a batched "
                f"product of the tokens repeated {experts} times, the router's scores zeroing the unchosen ones, "
                "as transformers' Llama-4 layer does): the plan prices that work, and the planner cannot route "
                "their tokens between ranks, so every rank holds every expert"
            )
    return None


_DENSE_PATH = {"view", "reshape", "_unsafe_view", "mul", "to", "_to_copy", "contiguous", "clone"}
"""Ops between a repeat of the tokens and the batched expert product that computes them all."""


def _dense_experts(node: fx.Node) -> int:
    """E when ``node`` is a ``bmm`` of an ``[E, ...]`` weight by the tokens repeated E times (every
    expert computing every token); else 0."""
    if node.op != "call_function" or op_name(node) != "bmm" or len(node.args) < 2:
        return 0
    tokens, weight = node.args[0], node.args[1]
    val = weight.meta.get("val") if isinstance(weight, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() != 3 or not isinstance(tokens, fx.Node):
        return 0
    experts = val.shape[0]
    if not isinstance(experts, int) or experts < 2:
        return 0
    stack, seen = [tokens], set()
    while stack:
        current = stack.pop()
        if current in seen or current.op != "call_function":
            continue
        seen.add(current)
        name = op_name(current)
        if name == "repeat" and len(current.args) > 1 and list(current.args[1])[:1] == [experts]:  # type: ignore[arg-type]
            return experts
        if name in _DENSE_PATH:
            stack.extend(arg for arg in current.args if isinstance(arg, fx.Node))
    return 0


def moe_summary(rows: list[Any], reasons: list[str]) -> dict[str, Any]:
    """The table's ``model["moe"]``: the rows with routed experts, ``experts``, ``top_k`` and
    ``shared_experts`` (of the first MoE row; plan.json ``model.moe``), and ``reason`` when some
    layers stay replicated; ``{}`` for a dense model."""
    moe_rows = [row for row in rows if getattr(row, "experts", 0)]
    out: dict[str, Any] = {}
    if moe_rows:
        first = moe_rows[0]
        out = {
            "layers": [int(row.index) for row in moe_rows],
            "experts": int(first.experts),
            "top_k": int(first.top_k),
            "shared_experts": int(first.shared_experts),
        }
    if reasons:
        out["reason"] = "; ".join(dict.fromkeys(reasons))
    return out
