"""Tensor-parallel rewriting of the exported graph (Megatron-style).

``plan_tp_rewrite`` returns a per-layer graph rewrite and, for every original parameter that tp
shards, how (``{"dim", "kind", "padded"}``), which the runtime uses to cut each rank's piece out
of the original weights. With ``tp == 1`` nothing is rewritten.
"""

from __future__ import annotations

from codegen.tp_rewrite import build_tp_rewrite

__all__ = ["plan_tp_rewrite"]


def plan_tp_rewrite(gm, layer_of, names, plan, vocab: int, dims: dict):
    """``(rewrite, shard_info)`` for ``plan.tp``; ``(None, {})`` at tp 1."""
    if plan.tp == 1:
        return None, {}
    return build_tp_rewrite(gm, layer_of, names, plan, vocab, dims)
