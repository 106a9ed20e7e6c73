"""The mask of each attention core, read from the graph, and what the kernel makes of it.

``annotate_masks(gm, roles, window)`` writes ``node.meta["mask"]`` (a ``MaskInfo``) on every attention
core ``passes.attention`` found (it needs ``meta["attention"]`` and ``meta["shape"]``):

* **SDPA with ``is_causal=True``** and no mask tensor (the built-in GPT, most hand-written
  models): ``causal``, and the kernel skips the masked half (flash and efficient kernels walk
  only the blocks on or below the diagonal), so the core is *priced* at the mask's density.
* **a mask tensor** (SDPA's ``attn_mask``, or the eager pattern's ``add`` / ``masked_fill`` /
  ``where`` operand): what the tensor keeps is found by *running* the ops that build it on real
  CPU tensors at a probe length (input ids zeros, ``attention_mask`` ones, ``position_ids``
  ``0..s-1``: the data the runtime feeds), then naming it: all kept -> ``full``; the lower
  triangle -> ``causal``; a band ``i - w < j <= i`` -> ``sliding`` (window ``w``); else
  ``custom``. A mask that reads a parameter or buffer, or whose ops fail on CPU, is ``custom``
  with its reason. The probe length is 64, or the model's largest window plus 8 (up to 4104)
  when the config states windows, so that a window shows as a band.
* HF models exported with SDPA (``transformers`` materializes the mask under tracing: a causal
  mask, intersected with a document mask from ``position_ids``, and a band for sliding-window
  layers) land in the second case. SDPA's kernels compute every block of an explicit mask, and
  eager attention computes the whole square, so these cores are priced *full*
  (``skips=False``): the record keeps the mask and its density, the report says what a kernel
  that skips would save.

``mask_facts`` gathers the cores' masks per block for the layer table's ``model["attention"]``;
the config's windows (``model_info["attention_windows"]``: one entry per block, the window or
None) name windows larger than the probe there: a block whose probe shows the lower triangle and
whose config states window ``w`` is ``sliding`` with ``w``.

``price_masks(gm)`` then scales, on each core whose kernel skips, the node's FLOPs and its
listed products (their ``batch``) by the density (``passes.mask_density``): the core's time and
the model FLOPs follow it. Memory is unchanged: the fused kernels keep no score matrix either way.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, cast

import sympy
import torch
from torch import fx

from passes.common import S
from passes.inputs import NAMED_ROLES
from passes.mask_density import density
from passes.op_class import op_name

__all__ = ["PROBE", "PROBE_MAX", "MaskInfo", "annotate_masks", "classify", "mask_facts", "price_masks", "probe_mask"]

PROBE = 64
PROBE_MAX = 4104
_MASK_OPS = {"add", "masked_fill", "where"}
_EXPLICIT = "an explicit mask tensor, whose every block SDPA's kernels compute"


@dataclass(frozen=True)
class MaskInfo:
    """The mask of one attention core."""

    kind: str
    """``full`` | ``causal`` | ``sliding`` | ``block-sparse`` | ``custom``
    (``passes.mask_density.MASK_KINDS``)."""
    window: int | None = None
    """The sliding window ``w`` (None for other kinds)."""
    skips: bool = False
    """The kernel skips what the mask drops, so the core is priced at the mask's density."""
    reason: str = ""
    """Why a core is priced full (empty when ``skips``, or for a full mask)."""
    layout: tuple[int, int, int] | None = None
    """A block-sparse core's ``(block, local_blocks, global_blocks)`` (None for other kinds)."""

    def density(self, s: Any) -> Any:
        """The fraction of the square the mask keeps at sequence length ``s``."""
        return density(self.kind, s, self.window, self.layout)

    def priced_density(self, s: Any) -> Any:
        """The fraction of the full core's work the planner charges."""
        return self.density(s) if self.skips else density("full", s)


def _sdpa_mask(n: fx.Node) -> tuple[Any, bool]:
    """``(attn_mask, is_causal)`` of an SDPA node."""
    mask = n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
    causal = n.args[5] if len(n.args) > 5 else n.kwargs.get("is_causal", False)
    return mask, bool(causal)


def _reaches_matmul(n: Any) -> bool:
    """Whether an activation matmul lies within 16 ops before ``n`` (the scores' path)."""
    todo, seen = [n], 0
    while todo and seen < 64:
        x = todo.pop()
        seen += 1
        if not isinstance(x, fx.Node) or x.op != "call_function":
            continue
        if op_name(x) in ("matmul", "bmm"):
            return True
        todo.extend(x.all_input_nodes)
    return False


def _eager_mask(softmax: fx.Node) -> fx.Node | None:
    """The mask operand between ``q @ k^T`` and the softmax: the argument of an ``add`` /
    ``masked_fill`` / ``where`` on the scores' path that does not come from the scores."""
    n = softmax.args[0]
    for _ in range(16):
        if not isinstance(n, fx.Node) or n.op != "call_function" or op_name(n) in ("matmul", "bmm"):
            return None
        # a list operand's nodes too (gpt-oss concatenates its sink logits to the masked scores)
        flat = [item for arg in n.args for item in (arg if isinstance(arg, (list, tuple)) else [arg])]
        nodes = [a for a in flat if isinstance(a, fx.Node)]
        path = [a for a in nodes if _reaches_matmul(a)]
        rest = [a for a in nodes if not _reaches_matmul(a)]
        if op_name(n) in _MASK_OPS and len(path) == 1 and rest:
            return rest[0]
        n = path[0] if path else None
    return None


def _input_value(p: fx.Node, s: int) -> torch.Tensor:
    """The value the runtime feeds input ``p`` at batch 1 and sequence ``s``."""
    val = p.meta["val"]
    shape = [1 if i == 0 else s for i in range(val.dim())]
    role = NAMED_ROLES.get(p.name)
    if role == "ones":
        return torch.ones(shape, dtype=val.dtype)
    if role == "positions":
        return torch.arange(s).expand(shape).to(val.dtype).contiguous()
    return torch.zeros(shape, dtype=val.dtype)


def probe_mask(mask: fx.Node, roles: dict[str, str], s: int) -> torch.Tensor | str:
    """The ``[s, s]`` boolean matrix (True = attended) the graph's ``mask`` holds at sequence
    length ``s``, or why it cannot be read."""
    seen: dict[fx.Node, None] = {}
    todo = [mask]
    while todo:
        x = todo.pop()
        if x in seen:
            continue
        seen[x] = None
        todo.extend(x.all_input_nodes)
    for x in seen:
        if x.op == "placeholder" and roles.get(x.name, "input") != "input":
            return f"the mask reads {roles[x.name]} {x.name!r}"
        if x.op not in ("placeholder", "call_function"):
            return f"the mask is built by {x.op} {x.name!r}"
    order = {x: i for i, x in enumerate(mask.graph.nodes)}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for x in sorted(seen, key=order.__getitem__):
        env[x] = graph.node_copy(x, env.__getitem__)
        if "device" in x.kwargs:  # traced on the meta device: build the probe's tensors on the CPU
            env[x].kwargs = {**env[x].kwargs, "device": torch.device("cpu")}
    graph.output(env[mask])
    placeholders = [x for x in sorted(seen, key=order.__getitem__) if x.op == "placeholder"]
    try:
        value = fx.GraphModule(torch.nn.Module(), graph)(*[_input_value(p, s) for p in placeholders])
    except Exception as e:  # any failure: the mask stays unread, priced full
        return f"its ops did not run on CPU ({type(e).__name__})"
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or tuple(value.shape[-2:]) != (s, s):
        return "it is not an s x s matrix"
    value = value[(0,) * (value.dim() - 2)]
    if value.dtype == torch.bool:
        return value
    return value > torch.finfo(value.dtype).min / 2 if value.is_floating_point() else value != 0


def classify(kept: torch.Tensor) -> MaskInfo:
    """Name the mask a ``[s, s]`` boolean matrix shows (module doc)."""
    s = kept.shape[0]
    ones = torch.ones(s, s, dtype=torch.bool)
    if bool(kept.all()):
        return MaskInfo("full")
    w = int(kept[-1].sum())
    band = ones.tril() & ~ones.tril(-w)
    if torch.equal(kept, ones.tril()):
        return MaskInfo("causal", reason=_EXPLICIT)
    if 0 < w < s and torch.equal(kept, band):
        return MaskInfo("sliding", w, reason=_EXPLICIT)
    share = float(kept.sum()) / (s * s)
    return MaskInfo("custom", reason=f"the mask matches no known pattern at s={s} (keeps {share:.2f})")


def _read(n: fx.Node, roles: dict[str, str], window: int | None, probes: dict) -> MaskInfo:
    info = n.meta["attention"]
    if op_name(n) == "block_sparse_attention":  # runtime.sparse_attention: the layout is in its arguments
        block, local, glob = (int(cast(int, n.args[i])) for i in (3, 4, 5))
        return MaskInfo("block-sparse", skips=True, layout=(block, local, glob))
    if info.pattern == "sdpa":
        mask, causal = _sdpa_mask(n)
        if mask is None:
            return MaskInfo("causal", skips=True) if causal else MaskInfo("full")
    else:
        mask = _eager_mask(n)
        if mask is None:
            return MaskInfo("full", reason="eager attention without a mask")
    if not isinstance(mask, fx.Node):
        return MaskInfo("custom", reason="the mask is not a graph value")
    s = PROBE if window is None else max(PROBE, min(window + 8, PROBE_MAX))
    key = (mask, s)
    if key not in probes:
        probes[key] = probe_mask(mask, roles, s)
    kept = probes[key]
    if isinstance(kept, str):
        return MaskInfo("custom", reason=f"mask not read: {kept}")
    found = classify(kept)
    if info.pattern == "eager":
        return replace(found, reason="eager attention computes the whole square")
    return found


def annotate_masks(gm: fx.GraphModule, roles: dict[str, str], window: int | None = None) -> fx.GraphModule:
    """Write ``meta["mask"]`` on every attention core (module doc); ``window`` is the largest
    window the model's config states (it sizes the probe)."""
    probes: dict = {}
    for n in gm.graph.nodes:
        if "attention" in n.meta:
            n.meta["mask"] = _read(n, roles, window, probes)
    return gm


def price_masks(gm: fx.GraphModule) -> fx.GraphModule:
    """Scale the FLOPs and listed products of every core whose kernel skips the masked work by
    the mask's density (module doc). Needs ``fwd_flops``/``bwd_flops``/``fwd_gemms``/``bwd_gemms``."""
    for n in gm.graph.nodes:
        mask = n.meta.get("mask")
        if mask is None or not mask.skips or mask.kind in ("full", "custom"):
            continue
        query = n.args[0]  # the core's own query length: S in a symbolic trace, a number in a static one
        s = query.meta["shape"][-2] if isinstance(query, fx.Node) and "shape" in query.meta else S
        d = sympy.nsimplify(mask.density(sympy.sympify(s)))
        for key in ("fwd_flops", "bwd_flops"):
            n.meta[key] = sympy.expand(n.meta[key] * d)
        for key in ("fwd_gemms", "bwd_gemms"):
            n.meta[key] = [replace(g, batch=g.batch * d) for g in n.meta.get(key, ())]
    return gm


def _dominant(entries: list[list]) -> list:
    """The most common ``[kind, window, skips, reason, layout]`` (the first one on a tie)."""
    keys = [(e[0], e[1], e[2], tuple(e[4] or ())) for e in entries]
    best = max(keys, key=lambda k: (keys.count(k), -keys.index(k)))
    return entries[keys.index(best)]


def mask_facts(gm: fx.GraphModule, sources: list[int], windows: list | None) -> dict:
    """The layer table's ``model["attention"]``: ``{"mask", "window", "skips", "reason", "layout",
    "layers": [[kind, window, skips, reason, layout] per block 1..L]}`` (``{}`` without
    attention; ``layout`` is a block-sparse core's ``[block, local_blocks, global_blocks]``, else None).

    Block ``j`` of the model is traced block ``sources[j]`` (``passes.tabulate.block_sources``:
    a shallow trace's blocks stand for several). ``windows`` (the config's window per block, None
    where a block has none) names windows larger than the probe: a block whose graph mask is
    causal and whose config states ``w`` is ``sliding`` ``w``.
    """
    layers = len(sources)
    traced: dict[int, MaskInfo] = {}
    for n in gm.graph.nodes:
        if "mask" in n.meta and n.meta.get("layer", 0) >= 1:
            traced.setdefault(n.meta["layer"], n.meta["mask"])
    if not traced:
        return {}
    rows = sorted(traced)
    per_block = []
    for block in range(1, layers + 1):
        row = min(rows, key=lambda r: abs(r - 1 - sources[block - 1]))  # its traced block's, or the nearest
        info = traced[row]
        window = windows[block - 1] if windows and len(windows) == layers else None
        if window is not None and info.kind == "causal":
            info = replace(info, kind="sliding", window=int(window))
        layout = list(info.layout) if info.layout else None
        per_block.append([info.kind, info.window, info.skips, info.reason, layout])
    kind, window, skips, reason, layout = _dominant(per_block)
    return {"mask": kind, "window": window, "skips": skips, "reason": reason, "layout": layout, "layers": per_block}
