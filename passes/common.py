"""Shared helpers for the analysis passes: symbolic sizes, source lines, meta-key checks.

Every pass reads ``node.meta`` keys written by earlier passes and writes only its own. This module
holds what they share:

- ``to_expr``: turn an int / ``torch.SymInt`` from export's fake tensors into a plain sympy
  expression in the planner's symbols ``b`` (micro-batch size) and ``s`` (sequence length).
  torch's shape environment uses its own symbols (``s72``...) and its own integer functions
  (``FloorDiv``, ``CeilToInt``...); the traced graph carries a map from the former to ours, and the
  latter are rewritten to standard sympy (``floor``, ``ceiling``) so expressions survive JSON and
  ``sympy.lambdify``.
- ``source_line`` / ``PassError`` (from ``passes.core``, the torch-free part): errors name the
  graph node and the user's ``file:line``.
- ``need``: a pass asks for the meta keys it depends on and gets a clear error if a pass is missing.
"""

from __future__ import annotations

from typing import Any, Iterable, cast

import sympy
import torch
import torch.fx as fx
import torch.utils._sympy.functions as tsf

from passes.core import B, PassError, S, source_line

__all__ = [
    "B",
    "S",
    "PassError",
    "to_expr",
    "sanitize",
    "source_line",
    "need",
    "iter_tensors",
    "has_tensor",
    "dtype_bytes",
    "dtype_name",
    "tensor_nbytes",
    "META_ONLY",
    "is_meta_only",
    "hint",
    "arg_node",
]


def arg_node(node: fx.Node, index: int) -> fx.Node:
    """``node.args[index]`` where the op's schema makes it a tensor, so a graph value (fx types
    every argument as any ``Argument``; this names the assumption once)."""
    return cast(fx.Node, node.args[index])


def need(node: fx.Node, key: str, pass_name: str, producer: str) -> Any:
    """Return ``node.meta[key]`` or raise naming the pass that should have written it."""
    try:
        return node.meta[key]
    except KeyError:
        raise PassError(
            pass_name,
            node,
            f"node.meta[{key!r}] is missing; run {producer} first (passes.analyze runs every pass in order).",
        ) from None


def sanitize(expr: sympy.Expr) -> sympy.Expr:
    """Rewrite torch's integer sympy functions into standard sympy ones.

    ``FloorDiv(a, b) -> floor(a / b)``, ``CeilDiv``/``CeilToInt`` -> ``ceiling``,
    ``IntTrueDiv``/``CleanDiv`` -> ``a / b``, ``PythonMod``/``Mod`` -> ``Mod``, ``Max``/``Min`` ->
    sympy's. The results are exact for the positive sizes that occur in shapes.
    """
    if not isinstance(expr, sympy.Basic) or expr.is_Atom:
        return expr
    repl = {
        tsf.FloorDiv: lambda num, den: sympy.floor(num / den),
        tsf.CeilDiv: lambda num, den: sympy.ceiling(num / den),
        tsf.CeilToInt: lambda x: sympy.ceiling(x),
        tsf.FloorToInt: lambda x: sympy.floor(x),
        tsf.IntTrueDiv: lambda num, den: num / den,
        tsf.FloatTrueDiv: lambda num, den: num / den,
        tsf.CleanDiv: lambda num, den: num / den,
        tsf.PythonMod: lambda num, den: sympy.Mod(num, den),
        tsf.Mod: lambda num, den: sympy.Mod(num, den),
        tsf.Max: lambda *args: sympy.Max(*args),
        tsf.Min: lambda *args: sympy.Min(*args),
        tsf.PowByNatural: lambda base, exponent: base**exponent,
        tsf.ToFloat: lambda x: x,
        tsf.TruncToInt: lambda x: sympy.floor(x),
    }
    for cls, fn in repl.items():
        if expr.has(cls):
            expr = expr.replace(lambda e, kind=cls: isinstance(e, kind), lambda e, f=fn: f(*e.args))
    return expr


def to_expr(x: Any, symbols: dict) -> sympy.Expr:
    """An int, ``torch.SymInt`` or sympy expression as an expanded sympy polynomial in ``b``/``s``.

    ``symbols`` maps the shape environment's symbols to ours; unmapped symbols are left as they
    are (a caller that cannot accept them checks ``free_symbols``).
    """
    if isinstance(x, (torch.SymInt, torch.SymFloat)):
        e = x.node.expr
    elif isinstance(x, bool):
        return sympy.Integer(int(x))
    elif isinstance(x, int):
        return sympy.Integer(x)
    elif isinstance(x, float):
        return sympy.Float(x)
    elif isinstance(x, sympy.Basic):
        e = x
    else:
        raise TypeError(f"cannot turn {type(x).__name__} into a size expression")
    if e.is_Integer:
        return e
    return sympy.expand(sanitize(e.xreplace(symbols)))


def hint(x: Any) -> int:
    """The example value of a size (without adding a guard to the shape environment)."""
    if isinstance(x, torch.SymInt):
        h = x.node.hint
        if h is None:
            h = x.node.shape_env.size_hint(x.node.expr)
        return int(h)
    return int(x)


def iter_tensors(val: Any) -> Iterable[torch.Tensor]:
    """The tensors in a node's value (a tensor, or a tuple/list of them and other things)."""
    if isinstance(val, torch.Tensor):
        yield val
    elif isinstance(val, (list, tuple)):
        for v in val:
            yield from iter_tensors(v)


def has_tensor(val: Any) -> bool:
    """True if a node's value is or contains a tensor."""
    return next(iter(iter_tensors(val)), None) is not None


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return dtype.itemsize


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``'bfloat16'``."""
    return str(dtype).replace("torch.", "")


def tensor_nbytes(tensor: torch.Tensor, symbols: dict) -> sympy.Expr:
    """Bytes of a dense copy of ``tensor`` (numel x itemsize): what sending it would move."""
    n = sympy.Integer(tensor.dtype.itemsize)
    for d in tensor.shape:
        n = n * to_expr(d, symbols)
    return n


# Ops that only read metadata (sizes, asserts): they neither move data nor make a consumer
# depend on a tensor's contents, so boundary and liveness analyses ignore them as users.
META_ONLY = {
    "aten.sym_size.int",
    "aten.sym_stride.int",
    "aten.sym_numel.default",
    "aten.sym_storage_offset.default",
    "aten._assert_tensor_metadata.default",
    "aten._assert_scalar.default",
    "aten.sym_constrain_range_for_size.default",
    "aten._assert_async.msg",
}


def is_meta_only(node: fx.Node) -> bool:
    """True for nodes that only inspect metadata (see ``META_ONLY``)."""
    return node.op == "call_function" and str(node.target) in META_ONLY
