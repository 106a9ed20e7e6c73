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

import sympy

from passes.pass_error import PassError, source_line

__all__ = ["B", "S", "PassError", "source_line"]

B = sympy.Symbol("b", positive=True, integer=True)
"""Micro-batch size (sequences per micro-batch)."""
S = sympy.Symbol("s", positive=True, integer=True)
"""Sequence length."""
