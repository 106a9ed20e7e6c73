"""Expert parallelism in compiled code: each routed-expert region dispatches its rows to the ranks
holding their experts and combines the products' rows back.

``passes.expert_regions`` finds one region per MoE layer: the rows sorted by expert, the ``histc``
counting them, the ``cumsum`` offsets and the grouped products reading ``[E, ...]`` expert weights.
When the plan cuts the experts (``expert_parallel > 1``) or caps their load
(``model.moe.capacity_factor``), every region is rewritten so that (and, for the metrics' expert
load, every readable region of a mixture of experts planned at ep 1)::

    dispatch = runtime.moe.dispatch(rows, counts, E, capacity_factor)
    local_rows, local_offsets, routing = dispatch[0], dispatch[1], dispatch[2]
    h = grouped_mm(local_rows, W1, local_offsets)      # W1: this rank's E/ep experts at run time
    ...                                                # row-wise, as the pass checked; a bias
                                                       # b[sorted ids] (GPT-OSS) becomes
                                                       # b[runtime.moe.local_expert_ids(local_offsets)]
    y = grouped_mm(h, W2, local_offsets)
    combine = runtime.moe.combine(y, routing)          # y's users read this instead

The expert weights keep their full ``[E, ...]`` shape in the manifest, marked ``"expert": true``:
the runtime keeps rows ``[r E/ep, (r+1) E/ep)`` of them on expert-parallel rank ``r`` and joins
them again in checkpoints, so a checkpoint resumes at any ep degree. Regions the pass refuses, or
a plan whose model has no region, cannot be cut: codegen says so and what to change rather than
train something the plan did not price.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from codegen.codegen_errors import CodegenError
from codegen.lower import CODEGEN_NAME
from passes.expert_regions import ExpertRegion, find_expert_regions
from runtime import moe

__all__ = ["ExpertRewrite", "rewrite_experts"]

_CARRIED_META = ("layer", "nn_module_stack", "stack_trace", "source_fn_stack", "op_class")
"""Keys a node inserted by the rewrite takes from the first product (the layer it belongs to)."""


@dataclass
class ExpertRewrite:
    """What the rewrite did, for the manifest."""

    degree: int
    """``plan.expert_parallel``."""
    experts: int
    """E: experts of every routed layer."""
    capacity_factor: float | None
    """``model.moe.capacity_factor`` (None: dropless)."""
    params: dict[str, list[int]] = field(default_factory=dict)
    """FQN of each routed expert weight -> its full ``[E, ...]`` shape (the manifest's; the
    generated ``__init__`` allocates this rank's ``E / ep`` rows, which the runtime loads)."""

    def manifest(self) -> dict:
        """The manifest's ``expert_parallel`` entry."""
        return {"degree": self.degree, "experts": self.experts, "capacity_factor": self.capacity_factor}


def rewrite_experts(gm: fx.GraphModule, plan) -> ExpertRewrite | None:
    """Rewrite ``gm``'s routed-expert regions for ``plan``; None when nothing is rewritten.

    Expert parallelism or a capacity factor needs every region rewritten (or the plan refused).
    A mixture of experts planned with experts replicated and dropless (``model.moe`` set, ep 1)
    has its readable regions rewritten too, the dispatch then moving nothing: it counts the tokens
    each expert gets for the metrics' ``expert_load`` (a region the pass refuses runs as traced).
    Under ``plan.compile`` the dispatch and combine are graph breaks of the compiled layers
    (``runtime.stages.compile_layers.prepare``): their row counts are known only at run time.
    """
    facts = plan.model.moe or {}
    capacity = facts.get("capacity_factor")
    required = plan.expert_parallel > 1 or capacity is not None
    if not required and not facts:
        return None
    regions = find_expert_regions(gm)
    if required:
        _check_plan(plan, regions, capacity)
    regions = [region for region in regions if region.parallel]
    if not regions:
        return None
    done = ExpertRewrite(plan.expert_parallel, regions[0].experts, capacity)
    for region in regions:
        _rewrite_region(gm.graph, region, capacity)
        for fqn in region.params:
            done.params[fqn] = _keep_local_rows(gm, fqn, plan.expert_parallel)
    gm.graph.lint()
    gm.recompile()
    return done


def _check_plan(plan, regions: list[ExpertRegion], capacity: float | None) -> None:
    """Refuse what the rewrite cannot honour, saying what to change."""
    what = f"expert_parallel={plan.expert_parallel}" if plan.expert_parallel > 1 else f"capacity_factor={capacity}"
    undo = "plan with --ep 1" + (" and no --moe-capacity-factor" if capacity is not None else "")
    if not regions:
        raise CodegenError(
            f"the plan asks for {what} but the model has no routed-expert layer the compiler can read "
            f"(grouped expert products over [E, ...] weights, as transformers' MoE layers export); {undo}"
        )
    refused = [r for r in regions if not r.parallel]
    if refused:
        raise CodegenError(
            f"the plan asks for {what} but the experts of {refused[0].module or refused[0].products[0].name} "
            f"cannot be dispatched: {refused[0].reason}; {undo} (experts replicated)"
        )
    counts = sorted({r.experts for r in regions})
    if len(counts) > 1:
        raise CodegenError(
            f"routed layers have different expert counts {counts}: one expert_parallel degree cannot cut them; {undo}"
        )
    if counts[0] % plan.expert_parallel:
        raise CodegenError(
            f"expert_parallel={plan.expert_parallel} does not divide the model's {counts[0]} experts; "
            "plan with an --ep that divides it"
        )


def _keep_local_rows(gm: fx.GraphModule, fqn: str, ep: int) -> list[int]:
    """Give ``gm``'s meta expert weight ``fqn`` one rank's ``E / ep`` rows (what the generated
    ``__init__`` allocates); return its full shape."""
    mod_path, _, attr = fqn.rpartition(".")
    mod = gm.get_submodule(mod_path) if mod_path else gm
    tensor = getattr(mod, attr)
    full = [int(size) for size in tensor.shape]
    if ep > 1:
        local = torch.empty([full[0] // ep, *full[1:]], dtype=tensor.dtype, device="meta")
        if attr in mod._parameters:
            mod._parameters[attr] = torch.nn.Parameter(local, requires_grad=tensor.requires_grad)
        else:
            mod._buffers[attr] = local
    return full


def _carried(node: fx.Node) -> dict:
    return {key: node.meta[key] for key in _CARRIED_META if key in node.meta}


def _rewrite_region(graph: fx.Graph, region: ExpertRegion, capacity: float | None) -> None:
    """Dispatch before the first product, local rows and offsets into every product, combine after
    the last (its users read the combined rows, in the original order)."""
    first, last = region.products[0], region.products[-1]
    meta = _carried(first)
    with graph.inserting_before(first):
        sent = graph.call_function(
            moe.dispatch, (region.rows, region.counts, region.experts), {"capacity_factor": capacity}
        )
        local_rows = graph.call_function(operator.getitem, (sent, 0))
        local_offsets = graph.call_function(operator.getitem, (sent, 1))
        routing = graph.call_function(operator.getitem, (sent, 2))
    names = ("dispatched", "local_rows", "local_offsets", "routing")
    for node, name in zip((sent, local_rows, local_offsets, routing), names):
        node.meta.update(meta)
        node.meta[CODEGEN_NAME] = name
    _gather_locally(graph, region, local_offsets, meta)
    for product in region.products:
        args = list(product.args)
        if args[0] is region.rows:
            args[0] = local_rows
        if len(args) > 2 and args[2] is region.offsets:
            args[2] = local_offsets
        product.args = tuple(args)
        if product.kwargs.get("offs") is region.offsets:
            product.kwargs = {**product.kwargs, "offs": local_offsets}
    with graph.inserting_after(last):
        back = graph.call_function(moe.combine, (last, routing))
    back.meta.update(meta)
    back.meta[CODEGEN_NAME] = "combined"
    if "val" in last.meta:  # the combined rows have the shape the last product had before
        back.meta["val"] = last.meta["val"]
    last.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)


def _gather_locally(graph: fx.Graph, region: ExpertRegion, local_offsets: fx.Node, meta: dict) -> None:
    """Each per-expert parameter the region gathers by the sorted expert ids (``region.gathers``)
    gathered instead by the dispatched rows' local experts, from this rank's slice of it."""
    if not region.gathers:
        return
    with graph.inserting_after(local_offsets):
        local_ids = graph.call_function(moe.local_expert_ids, (local_offsets,))
    local_ids.meta.update(meta)
    local_ids.meta[CODEGEN_NAME] = "local_expert_ids"
    after = local_ids
    for gather in region.gathers:
        with graph.inserting_after(after):
            local = graph.call_function(gather.target, (gather.args[0], [local_ids]))  # type: ignore[arg-type]
        local.meta.update(meta)
        local.meta[CODEGEN_NAME] = "local_" + str(getattr(gather.args[0], "target", gather.args[0])).rsplit(".", 1)[-1]
        if "val" in gather.meta:
            local.meta["val"] = gather.meta["val"]
        gather.replace_all_uses_with(local)
        graph.erase_node(gather)
        after = local
