"""What the passes receive: a traced training forward and the facts needed to read it.

The passes never trace a model themselves (that is ``planner.frontend.trace``); they take any
object with the attributes of ``TracedGraph``. Keeping the contract here, as a protocol, lets the
front end evolve without the passes importing it.
"""

from __future__ import annotations

from typing import Any, Protocol

import sympy
import torch
import torch.fx as fx

__all__ = ["TracedGraph"]


class TracedGraph(Protocol):
    """One exported training forward (``forward(*inputs) -> loss``) in ATen IR."""

    gm: fx.GraphModule
    """Parameters, buffers and lifted constants are placeholders with fake values in
    ``node.meta["val"]``."""
    dtype: torch.dtype
    """Parameter/activation dtype of the trace."""
    layers: int
    """L: blocks in the full model (the layer table has L + 2 rows)."""
    block_paths: list[str]
    """Module paths of the blocks present in ``gm`` (e.g. ``['blocks.0', 'blocks.1']``)."""
    container: str
    """Path of the module holding the blocks (``'blocks'``, ``'inner.transformer.h'``)."""
    shallow: bool
    """True when ``gm`` holds fewer blocks than the model (the table replicates them)."""
    sources: list[int] | None
    """Of a shallow trace, the traced block (0-based) standing for each of the model's blocks;
    None: the first traced block stands for blocks 1..L-1, the last for block L."""
    roles: dict[str, str]
    """Placeholder name -> ``param`` | ``buffer`` | ``constant`` | ``input``."""
    fqns: dict[str, str]
    """Placeholder name -> FQN in the traced module."""
    tied: dict[str, str]
    """Placeholder name -> the earlier placeholder holding the same tensor (tied weights: export
    lists e.g. GPT-2's ``wte`` and ``lm_head`` weights separately)."""
    symbols: dict[sympy.Symbol, sympy.Symbol]
    """The trace's shape symbols -> ``passes.common.B`` / ``S``."""
    fixed: dict[str, int]
    """Dimensions the trace kept constant, with their value (``{}`` when fully symbolic)."""
    dynamic: bool
    """Whether symbolic sizes were requested (False: a trace at fixed sizes on purpose)."""
    model_info: dict[str, Any]
    """spec, layers, hidden, heads, kv_heads, vocab, seq_len and the size overrides."""
    notes: list[str]
    """What the tracer decided (fallbacks, specializations), for reports."""
