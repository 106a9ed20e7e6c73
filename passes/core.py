"""The torch-free core of ``passes``: what a layer table and its readers share.

A layer table, once analyzed, is read by the cost models, the search and the layer-table cache
without any graph in sight; a re-plan from the cache therefore never needs torch, whose import
alone is most of a re-plan's time. Everything those readers touch lives here or in
``passes.layer_table``, and neither imports torch:

- ``B`` / ``S``: the symbols of the micro-batch size and the sequence length that every cost
  expression is a polynomial in;
- ``PassError`` and ``source_line``: a pass's error names the node and the user's ``file:line``
  (read from ``node.meta``; no torch type is needed to do so);
"""

from __future__ import annotations

import re
from typing import Any

import sympy

__all__ = ["B", "S", "PassError", "source_line"]

B = sympy.Symbol("b", positive=True, integer=True)
"""Micro-batch size (sequences per micro-batch)."""
S = sympy.Symbol("s", positive=True, integer=True)
"""Sequence length."""


class PassError(ValueError):
    """A pass met a graph it cannot analyze, or a layer table was asked for what it cannot give;
    the message names the node and the source line where there is one."""

    def __init__(self, pass_name: str, node: Any | None, message: str):
        where = ""
        if not pass_name:  # a plain message (no pass, no node)
            super().__init__(message)
            return
        if node is not None:
            where = f" at node {node.name!r} ({node.target})"
            src = source_line(node)
            if src:
                where += f", from {src}"
        super().__init__(f"{pass_name}{where}: {message}")


_FILE_LINE = re.compile(r'File "([^"]+)", line (\d+)')


def source_line(node: Any) -> str:
    """``file:line`` of the innermost user frame that created an ``fx.Node`` ('' if unknown)."""
    trace = node.meta.get("stack_trace") or ""
    hits = _FILE_LINE.findall(trace)
    if not hits:
        return ""
    path, line = hits[-1]
    return f"{path}:{line}"
