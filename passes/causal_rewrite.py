"""Lower an explicit causal mask to SDPA's ``is_causal=True`` and drop the ops that built it.

HF models (Llama, Mistral, Qwen2 ...) build their attention mask in the graph and hand it to
SDPA as a tensor, so the fused kernels compute every block (priced full) and the mask, ``b s^2``
elements, is saved for backward and sent across pipeline stages. ``rewrite_causal(gm, roles,
probe)`` rewrites every SDPA core whose mask is exactly the lower triangle:

* the core is SDPA with a mask tensor, its query and key lengths are the same (``is_causal``
  aligns the triangle top-left, which is HF's triangle only for a square);
* the mask is built only from the runtime's fixed data (inputs whose role is ``ones`` or
  ``positions``: the all-ones ``attention_mask``, ``position_ids`` ``0..s-1``) and from shapes
  (``sym_size``), never from token values, parameters or buffers, so it is the same matrix for
  every batch the runtime feeds;
* ``probe(mask)`` (``passes.mask_kind``) reads it as ``causal``: in the planner's symbolic trace
  the core's ``meta["mask"]``, probed at a length past the config's largest window (a window
  shows as a band, never as the triangle); in codegen's static export, the matrix at the
  exported length itself (a window ``w >= s`` *is* the triangle at that length).

The core then gets ``attn_mask=None, is_causal=True`` and every op that built only the mask is
erased (placeholders stay: the runtime still feeds them), so the layer table prices the core at
the causal density with no ``b s^2`` mask in its saved or boundary bytes, and the compiled stages
hold exactly that. Sliding-window masks stay explicit: SDPA has no window flag.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import fx

from passes.inputs import NAMED_ROLES
from passes.mask_kind import PROBE, PROBE_MAX, classify, probe_mask

__all__ = [
    "PROBE_LIMIT",
    "REWRITTEN",
    "by_verdicts",
    "causal_at_length",
    "causal_verdicts",
    "explicit_causal_mask",
    "probe_length",
    "rewrite_causal",
    "sdpa_cores",
]

REWRITTEN = "an explicit causal mask, lowered to SDPA's is_causal=True"
_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_ASSERT = torch.ops.aten._assert_tensor_metadata.default
_FIXED_ROLES = ("ones", "positions")
PROBE_LIMIT = 2**25
"""The most mask elements ``causal_at_length`` builds on the CPU (a static export at a longer
sequence keeps its explicit mask)."""


def _shape_only(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target in (torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default)


def _mask_sources_fixed(mask: fx.Node, roles: dict[str, str]) -> bool:
    """Whether ``mask`` reads no data but the runtime's fixed inputs (module doc); shapes are free."""
    todo, seen = [mask], set()
    while todo:
        x = todo.pop()
        if x in seen:
            continue
        seen.add(x)
        if x.op == "placeholder":
            if roles.get(x.name, "input") != "input" or NAMED_ROLES.get(x.name) not in _FIXED_ROLES:
                return False
        elif x.op != "call_function":
            return False
        elif not _shape_only(x):
            todo.extend(x.all_input_nodes)
    return True


def _same_length(q: fx.Node, k: fx.Node) -> bool:
    qv, kv = q.meta.get("val"), k.meta.get("val")
    if qv is None or kv is None or qv.dim() < 2 or kv.dim() < 2:
        return False
    return str(qv.shape[-2]) == str(kv.shape[-2])


def explicit_causal_mask(n: fx.Node, roles: dict[str, str]) -> fx.Node | None:
    """The mask node of SDPA core ``n`` when the rewrite may apply (every condition of the module
    doc but the probe), else None."""
    if n.op != "call_function" or n.target is not _SDPA:
        return None
    mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
    causal = n.args[5] if len(n.args) > 5 else n.kwargs.get("is_causal", False)
    dropout = n.args[4] if len(n.args) > 4 else n.kwargs.get("dropout_p", 0.0)
    if not isinstance(mask, fx.Node) or causal or dropout not in (0, 0.0):
        return None
    q, k = n.args[0], n.args[1]
    if not (isinstance(q, fx.Node) and isinstance(k, fx.Node) and _same_length(q, k)):
        return None
    return mask if _mask_sources_fixed(mask, roles) else None


def _erase_dead(graph: fx.Graph, roots: list[fx.Node]) -> int:
    """Erase the ``call_function`` nodes among ``roots`` and their inputs that nothing uses any more
    (but metadata assertions, erased with them)."""
    erased: set[fx.Node] = set()
    todo = list(roots)
    while todo:
        x = todo.pop()
        if x in erased or x.op != "call_function" or any(u.target is not _ASSERT for u in x.users):
            continue
        for check in list(x.users):  # a metadata assertion on a dead value goes with it
            inputs_of_check = [i for i in check.all_input_nodes if i is not x]
            graph.erase_node(check)
            erased.add(check)
            todo.extend(inputs_of_check)
        inputs = x.all_input_nodes
        graph.erase_node(x)
        erased.add(x)
        todo.extend(inputs)
    return len(erased)


def rewrite_causal(
    gm: fx.GraphModule, roles: dict[str, str], probe: Callable[[fx.Node, fx.Node], bool]
) -> list[fx.Node]:
    """Rewrite every SDPA core whose mask is causal (module doc); ``probe(core, mask)`` says whether
    the mask is the lower triangle. Returns the rewritten cores."""
    done: list[fx.Node] = []
    dead: list[fx.Node] = []
    verdicts: dict[fx.Node, bool] = {}  # one mask feeds every block's core
    for n in list(gm.graph.nodes):
        mask = explicit_causal_mask(n, roles)
        if mask is None:
            continue
        if mask not in verdicts:
            verdicts[mask] = probe(n, mask)
        if not verdicts[mask]:
            continue
        args = list(n.args[:3])
        kwargs = {k: v for k, v in n.kwargs.items() if k not in ("attn_mask", "dropout_p", "is_causal")}
        if len(n.args) > 6:
            kwargs.setdefault("scale", n.args[6])
        if len(n.args) > 7:
            kwargs.setdefault("enable_gqa", n.args[7])
        n.args, n.kwargs = tuple(args), {**kwargs, "is_causal": True}
        dead.append(mask)
        done.append(n)
    _erase_dead(gm.graph, dead)
    if done:
        gm.recompile()
    return done


def causal_at_length(core: fx.Node, mask: fx.Node) -> bool:
    """Whether a static graph's ``mask`` is the lower triangle at the core's exported length:
    the mask's own ops run on the CPU at that length (``passes.mask_kind.probe_mask``), up to
    ``PROBE_LIMIT`` elements."""
    val = mask.meta.get("val")
    q = core.args[0].meta.get("val") if isinstance(core.args[0], fx.Node) else None
    if val is None or q is None or q.dim() < 2:
        return False
    s = q.shape[-2]
    if not isinstance(s, int) or val.numel() > PROBE_LIMIT:
        return False
    kept = probe_mask(mask, {}, s)
    return not isinstance(kept, str) and classify(kept).kind == "causal"


def probe_length(windows: list[int]) -> int | None:
    """The sequence length the planner probes masks at, given the windows the config states
    (``passes.mask_kind``): past the largest, so a window shows as a band; None when that is
    beyond ``PROBE_MAX`` (then no mask is rewritten: a window could pass for the triangle)."""
    widest = max(windows, default=None)
    if widest is None:
        return PROBE
    return max(PROBE, widest + 8) if widest + 8 <= PROBE_MAX else None


def sdpa_cores(gm: fx.GraphModule) -> list[fx.Node]:
    """The graph's SDPA calls, in order."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _SDPA]


def causal_verdicts(gm: fx.GraphModule) -> list[bool]:
    """For a static graph (exported at a probe length): whether each SDPA core, in order, would be
    rewritten (``explicit_causal_mask`` and ``causal_at_length``)."""
    out = []
    for core in sdpa_cores(gm):
        mask = explicit_causal_mask(core, {})
        out.append(mask is not None and causal_at_length(core, mask))
    return out


def by_verdicts(gm: fx.GraphModule, verdicts: list[bool]) -> Callable[[fx.Node, fx.Node], bool]:
    """A ``rewrite_causal`` probe that answers from ``causal_verdicts`` of another export of the
    same model (one verdict per SDPA core, in order; none when the counts differ)."""
    cores = sdpa_cores(gm)
    index = {core: i for i, core in enumerate(cores)} if len(cores) == len(verdicts) else {}
    return lambda core, _mask: core in index and verdicts[index[core]]
