"""Run every analysis pass over a traced graph, in order (see ``passes/__init__.py``)."""

from __future__ import annotations

from passes.attention import annotate_attention
from passes.autograd_costs import annotate_costs
from passes.causal_rewrite import REWRITTEN, causal_at_length, probe_length, rewrite_causal
from passes.graph import TracedGraph
from passes.layers import assign_layers, layer_signatures
from passes.mask_kind import MaskInfo, annotate_masks, price_masks
from passes.op_class import classify_ops
from passes.shapes import annotate_params, annotate_shapes
from passes.tensor_parallel.tp_costs import propagate_tensor_parallel

__all__ = ["analyze"]


def _lower_causal_masks(gm, roles: dict[str, str], windows: list[int]) -> None:
    """Explicit masks probed causal become SDPA's ``is_causal`` (``passes.causal_rewrite``): the
    cores are then priced at the causal density, without the mask's ops or bytes. A static trace
    (fixed sizes: the probe's length cannot run) is read at its own length, for a model that
    states no window (as ``planner compile`` decides)."""

    def probed_causal(core, mask) -> bool:
        info = core.meta.get("mask")
        if info is not None and info.kind == "causal":
            return True
        q = core.args[0].meta.get("val")
        static = q is not None and isinstance(q.shape[-2], int)
        return static and not windows and causal_at_length(core, mask)

    for core in rewrite_causal(gm, roles, probed_causal):
        core.meta["mask"] = MaskInfo("causal", skips=True, reason=REWRITTEN)


def analyze(traced: TracedGraph):
    """Run every pass on ``traced.gm`` (a ``passes.graph.TracedGraph``) and return the graph.

    Blocks with identical signatures are replayed once (``annotate_costs``'s ``same_as``).
    """
    gm = traced.gm
    assign_layers(gm, traced.block_paths, traced.roles)
    annotate_shapes(gm, traced.symbols)
    annotate_params(gm, traced.roles, traced.fqns, traced.tied)
    classify_ops(gm)
    windows = [w for w in (traced.model_info or {}).get("attention_windows") or () if w]
    annotate_attention(gm)
    annotate_masks(gm, traced.roles, max(windows, default=None))
    if probe_length(windows) is not None:  # the probe saw every stated window as a band
        _lower_causal_masks(gm, traced.roles, windows)
    n_blocks = len(traced.block_paths)
    sigs = layer_signatures(gm, n_blocks)
    first: dict[str, int] = {}
    same_as = {}
    for lay in range(1, n_blocks + 1):
        rep = first.setdefault(sigs[lay], lay)
        if rep != lay:
            same_as[lay] = rep
    annotate_costs(gm, traced.roles, traced.symbols, same_as)
    price_masks(gm)  # a core whose kernel skips the masked pairs: its FLOPs at the mask's density
    propagate_tensor_parallel(gm, traced.roles)
    return gm
