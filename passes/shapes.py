"""Shapes, dtypes and bytes of every value, and the parameter/buffer bytes of placeholders.

``annotate_shapes`` reads export's fake tensors (``node.meta["val"]``) and writes, per node:

- ``meta["shape"]``: tuple of sympy expressions in ``b``/``s`` (a list of tuples for nodes that
  return several tensors, e.g. ``split``),
- ``meta["dtype"]``: the torch dtype (a list for several outputs),
- ``meta["out_bytes"]``: numel x itemsize of the output(s) as a sympy expression.

``annotate_params`` writes on parameter/buffer/constant placeholders ``meta["fqn"]``,
(``meta["tied_to"]`` on the second name of a tied weight, which carries no sizes),
``meta["param_count"]``/``meta["param_bytes"]`` (parameters) or ``meta["buffer_bytes"]``
(buffers and lifted constants); these are plain ints: weights do not depend on b or s.
"""

from __future__ import annotations

import math

import sympy
import torch
import torch.fx as fx

from passes.common import PassError, hint, iter_tensors, tensor_nbytes, to_expr

__all__ = ["annotate_shapes", "annotate_params"]


def annotate_shapes(gm: fx.GraphModule, symbols: dict) -> fx.GraphModule:
    """Write ``shape``, ``dtype`` and ``out_bytes`` from ``meta['val']`` (see module doc)."""
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        if "val" not in n.meta:
            if n.op in ("placeholder", "call_function"):
                raise PassError(
                    "annotate_shapes",
                    n,
                    "export recorded no fake value (node.meta['val']); re-export the model with torch.export.",
                )
            continue
        val = n.meta["val"]
        tensors = list(iter_tensors(val))
        if isinstance(val, torch.Tensor):
            n.meta["shape"] = tuple(to_expr(d, symbols) for d in val.shape)
            n.meta["dtype"] = val.dtype
        elif tensors:
            n.meta["shape"] = [tuple(to_expr(d, symbols) for d in t.shape) for t in tensors]
            n.meta["dtype"] = [t.dtype for t in tensors]
        n.meta["out_bytes"] = sum((tensor_nbytes(t, symbols) for t in tensors), sympy.Integer(0))
    return gm


def annotate_params(
    gm: fx.GraphModule, roles: dict[str, str], fqns: dict[str, str], tied: dict[str, str] | None = None
) -> fx.GraphModule:
    """Write parameter/buffer sizes on placeholders (see module doc).

    ``tied`` maps a placeholder to an earlier one holding the same tensor; such an alias gets
    ``meta['tied_to']`` and no sizes, so a tied embedding/head weight is counted once.
    """
    tied = tied or {}
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        role = roles.get(n.name)
        if role in (None, "input"):
            continue
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue  # opaque objects (custom classes) carry no bytes
        if any(isinstance(d, torch.SymInt) for d in val.shape):
            raise PassError(
                "annotate_params",
                n,
                f"{role} {fqns.get(n.name, n.name)} has a "
                f"symbolic shape {tuple(val.shape)}; weights must not depend on the "
                f"batch or sequence length.",
            )
        n.meta["fqn"] = fqns.get(n.name, n.name)
        if n.name in tied:
            n.meta["tied_to"] = tied[n.name]
            continue
        numel = math.prod(hint(d) for d in val.shape)
        if role == "param":
            n.meta["param_count"] = numel
            n.meta["param_bytes"] = numel * val.dtype.itemsize
        else:
            n.meta["buffer_bytes"] = numel * val.dtype.itemsize
    return gm
