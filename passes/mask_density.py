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
* ``block-sparse`` with layout ``(block, local_blocks, global_blocks)`` (``runtime.sparse_attention``,
  written ``b, L, G``): causal, and a query in block ``i`` sees key block ``j`` when ``i - j < L``
  or ``j < G``. With ``n = s / b`` blocks: each diagonal block keeps ``b (b + 1) / 2`` pairs, and
  ``b^2`` each of the off-diagonal blocks: ``min(i, L - 1)`` local ones in block row ``i``, summing
  to ``m (m - 1) / 2 + (n - m)(L - 1)`` with ``m = min(n, L)``, and ``max(0, min(G, i - L + 1))``
  global ones, summing to ``g (g + 1) / 2 + (T - g) G`` with ``T = max(n - L, 0)``, ``g = min(G,
  T)``. A length that is not a whole number of blocks is counted query by query instead.

``kept_pairs`` and ``density`` take numbers or sympy expressions (the layer table is symbolic in
``s``; ``sympy.Min`` keeps the sliding case exact for every ``s``). ``tests/passes/test_mask.py``
checks both against a brute count over the mask matrix.

No torch here: the planner reads densities back from a cached layer table without tracing.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["MASK_KINDS", "kept_pairs", "density", "summarize"]

MASK_KINDS = ("full", "causal", "sliding", "block-sparse", "custom")
"""``custom``: a mask the pass could not name (priced full; its reason is recorded)."""


def _symbolic(x: Any) -> bool:
    """Whether ``x`` is a sympy expression (none exists before sympy is imported: the search's
    numeric sizes never import it)."""
    sympy = sys.modules.get("sympy")
    return sympy is not None and isinstance(x, sympy.Basic)


def _min(a: Any, b: Any) -> Any:
    if _symbolic(a) or _symbolic(b):
        import sympy

        return sympy.Min(a, b)
    return min(a, b)


def _max(a: Any, b: Any) -> Any:
    if _symbolic(a) or _symbolic(b):
        import sympy

        return sympy.Max(a, b)
    return max(a, b)


def _block_sparse_pairs(s: Any, layout: Any) -> Any:
    """Pairs a causal block-sparse layout keeps (module doc)."""
    if not layout or len(layout) != 3 or min(layout[0], layout[1]) < 1 or layout[2] < 0:
        raise ValueError(
            f"a block-sparse mask needs a layout (block >= 1, local_blocks >= 1, global_blocks >= 0), got {layout!r}"
        )
    block, local, glob = (int(x) for x in layout)
    symbolic = _symbolic(s)
    if not symbolic and int(s) % block:
        return _block_sparse_rows(int(s), block, local, glob)
    n = s / block if symbolic else int(s) // block
    half = _half() if symbolic else 0.5  # every halved product is even: exact either way
    m = _min(n, local)
    local_pairs = m * (m - 1) * half + (n - m) * (local - 1)
    tail = _max(n - local, 0)
    g = _min(glob, tail)
    global_pairs = g * (g + 1) * half + (tail - g) * glob
    pairs = n * block * (block + 1) * half + block * block * (local_pairs + global_pairs)
    return pairs if symbolic else int(pairs)


def _half() -> Any:
    import sympy

    return sympy.Rational(1, 2)


def _block_sparse_rows(s: int, block: int, local: int, glob: int) -> int:
    """The same count query by query, for a length that is not a whole number of blocks."""
    total = 0
    for query in range(s):
        first_local = max(0, (query // block - local + 1) * block)
        total += query - first_local + 1 + min(glob * block, first_local)
    return total


def kept_pairs(kind: str, s: Any, window: int | None = None, layout: Any = None) -> Any:
    """Query-key pairs the mask keeps in one head's ``s x s`` square (module doc); ``layout``:
    a block-sparse mask's ``(block, local_blocks, global_blocks)``."""
    if kind == "block-sparse":
        return _block_sparse_pairs(s, layout)
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


def density(kind: str, s: Any, window: int | None = None, layout: Any = None) -> Any:
    """Fraction of the ``s x s`` square the mask keeps (1 for ``full``)."""
    if _symbolic(s):
        import sympy

        if kind in ("full", "custom"):
            return sympy.Integer(1)
        return sympy.Rational(1, 1) * kept_pairs(kind, s, window, layout) / (s * s)
    if kind in ("full", "custom"):
        return 1
    return float(kept_pairs(kind, s, window, layout)) / float(s * s)


def summarize(facts: dict, s: int, heads: int, head_dim: int, sequences: int) -> dict:
    """plan.json's ``model.attention`` from the layer table's ``model["attention"]``
    (``passes.mask_kind.mask_facts``) at sequence length ``s``, for ``sequences`` sequences a step.

    ``mask`` / ``window``: the most common block's (``layout``: its block-sparse layout
    ``{block, local_blocks, global_blocks}``, only for that kind); ``density``: the mean over the blocks of what
    each block's mask keeps; ``per_layer`` (only when blocks differ): ``{mask, window, density}``
    per block; ``priced``: whether the planner charges the cores at their density (the kernel
    skips the masked pairs) rather than in full; ``reason``: why not; ``saved_flops``: the model
    FLOPs per step the masks leave out of the full square (forward 4 and backward 8 ``H D s^2``
    per block and sequence), priced or not.
    """
    blocks = facts.get("layers") or []
    per = [{"mask": k, "window": w, "density": float(density(k, s, w, _layout_of(rest)))} for k, w, *rest in blocks]
    mean = sum(p["density"] for p in per) / len(per) if per else 1.0
    out: dict[str, Any] = {
        "mask": facts.get("mask", "full"),
        "window": facts.get("window"),
        "density": mean,
        "priced": bool(facts.get("skips", False)),
        "reason": facts.get("reason", ""),
        "saved_flops": 12.0 * heads * head_dim * s * s * sum(1.0 - p["density"] for p in per) * sequences,
    }
    if facts.get("layout"):
        block, local, glob = facts["layout"]
        out["layout"] = {"block": block, "local_blocks": local, "global_blocks": glob}
    if len({(p["mask"], p["window"]) for p in per}) > 1:
        out["per_layer"] = per
    return out


def _layout_of(rest: list) -> Any:
    """A per-block entry's block-sparse layout (its fifth field; tables cached before it have four)."""
    return rest[2] if len(rest) > 2 else None
