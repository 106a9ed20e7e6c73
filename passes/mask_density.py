"""How much of the attention square a mask keeps: the density of each mask kind, exact in ``s``.

An attention core over ``s`` queries and ``s`` keys computes ``s^2`` scores per head when it
attends to everything (``full``). The masks planned here keep fewer (query ``i`` and key ``j``
counted from 0):

* ``causal``: ``j <= i``. Query ``i`` sees ``i + 1`` keys: ``s (s + 1) / 2`` pairs, density
  ``(s + 1) / (2 s)``.
* ``sliding`` with window ``w``: ``i - w < j <= i`` (HF's ``sliding_window`` convention: the
  query and the ``w - 1`` keys before it). Query ``i`` sees ``min(i + 1, w)`` keys; with
  ``m = min(s, w)`` the first ``m`` queries see ``1 .. m`` keys and the other ``s - m`` see ``w``:
  ``m (m + 1) / 2 + (s - m) w`` pairs (causal when ``w >= s``).
* ``full``: ``s^2`` pairs.

``kept_pairs`` and ``density`` take numbers or sympy expressions (the layer table is symbolic in
``s``; ``sympy.Min`` keeps the sliding case exact for every ``s``). ``tests/passes/test_mask.py``
checks both against a brute count over the mask matrix.

No torch here: the planner reads densities back from a cached layer table without tracing.
"""

from __future__ import annotations

from typing import Any

import sympy

__all__ = ["MASK_KINDS", "kept_pairs", "density", "summarize"]

MASK_KINDS = ("full", "causal", "sliding", "custom")
"""``custom``: a mask the pass could not name (priced full; its reason is recorded)."""


def _min(a: Any, b: Any) -> Any:
    if isinstance(a, sympy.Basic) or isinstance(b, sympy.Basic):
        return sympy.Min(a, b)
    return min(a, b)


def kept_pairs(kind: str, s: Any, window: int | None = None) -> Any:
    """Query-key pairs the mask keeps in one head's ``s x s`` square (module doc)."""
    if kind == "causal":
        return s * (s + 1) / 2
    if kind == "sliding":
        if window is None or window < 1:
            raise ValueError(f"a sliding mask needs a window >= 1, got {window!r}")
        m = _min(s, window)
        return m * (m + 1) / 2 + (s - m) * window
    if kind in ("full", "custom"):
        return s * s
    raise ValueError(f"unknown mask kind {kind!r}; expected one of {', '.join(MASK_KINDS)}")


def density(kind: str, s: Any, window: int | None = None) -> Any:
    """Fraction of the ``s x s`` square the mask keeps (1 for ``full``)."""
    if kind in ("full", "custom"):
        return 1 if not isinstance(s, sympy.Basic) else sympy.Integer(1)
    if isinstance(s, sympy.Basic):
        return sympy.Rational(1, 1) * kept_pairs(kind, s, window) / (s * s)
    return float(kept_pairs(kind, s, window)) / float(s * s)


def summarize(facts: dict, s: int, heads: int, head_dim: int, sequences: int) -> dict:
    """plan.json's ``model.attention`` from the layer table's ``model["attention"]``
    (``passes.mask_kind.mask_facts``) at sequence length ``s``, for ``sequences`` sequences a step.

    ``mask`` / ``window``: the most common block's; ``density``: the mean over the blocks of what
    each block's mask keeps; ``per_layer`` (only when blocks differ): ``{mask, window, density}``
    per block; ``priced``: whether the planner charges the cores at their density (the kernel
    skips the masked pairs) rather than in full; ``reason``: why not; ``saved_flops``: the model
    FLOPs per step the masks leave out of the full square (forward 4 and backward 8 ``H D s^2``
    per block and sequence), priced or not.
    """
    blocks = facts.get("layers") or []
    per = [{"mask": k, "window": w, "density": float(density(k, s, w))} for k, w, *_ in blocks]
    mean = sum(p["density"] for p in per) / len(per) if per else 1.0
    out: dict[str, Any] = {
        "mask": facts.get("mask", "full"),
        "window": facts.get("window"),
        "density": mean,
        "priced": bool(facts.get("skips", False)),
        "reason": facts.get("reason", ""),
        "saved_flops": 12.0 * heads * head_dim * s * s * sum(1.0 - p["density"] for p in per) * sequences,
    }
    if len({(p["mask"], p["window"]) for p in per}) > 1:
        out["per_layer"] = per
    return out
