"""What each input of a traced model means, read from the graph: the facts training data needs.

A model's example inputs fix their number, dtypes and shapes; the graph tells what they are for.
``infer_inputs(gm, names)`` follows every integer input forward through the ops that only move or
re-index integers (views, slices, pads, casts, copies) and records where it ends up:

* the indices of an ``embedding`` -> the input is **tokens**, and its vocabulary is the table's
  row count (the smallest table, if it feeds several);
* the target of a loss (``cross_entropy_loss``, ``nll_loss*``) -> **targets** when used in place
  (position ``i`` is the token to predict at ``i``, so the data feeds the next tokens), **labels**
  when the model shifts it itself first (a slice from index 1 along the sequence, as HF's
  ``labels=`` losses do: the data feeds the tokens again); the vocabulary is the loss's classes;
* both -> tokens (a model that computes its loss from its own input ids).

Inputs the graph does not explain fall back on the names the HF ecosystem uses
(``attention_mask`` -> ``ones``, ``token_type_ids`` -> ``zeros``, ``position_ids`` ->
``positions``); anything else gets role ``None`` and the planner asks the user (``--input``).

Roles (``INPUT_ROLES``) and how ``runtime.training.data.model_inputs`` fills them, for ``r`` rows of ``S`` tokens:
``tokens`` the token ids; ``labels`` the same ids (the model shifts them); ``targets`` the next
tokens; ``ones`` / ``zeros`` a constant of the input's shape; ``positions`` ``0..S-1`` per row.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass

import torch
import torch.fx as fx

from passes.common import B, S, hint, to_expr
from passes.op_class import op_name

__all__ = ["NAMED_ROLES", "InputFacts", "infer_inputs"]

NAMED_ROLES = {
    "attention_mask": "ones",
    "mask": "ones",
    "token_type_ids": "zeros",
    "position_ids": "positions",
    "input_ids": "tokens",
    "tokens": "tokens",
    "ids": "tokens",
    "targets": "targets",
}
"""Roles read from an input's name when the graph does not settle it."""

# Ops that carry an integer tensor's values to their output unchanged (maybe re-arranged).
_MOVES = {
    "view",
    "_unsafe_view",
    "reshape",
    "flatten",
    "unflatten",
    "slice",
    "select",
    "contiguous",
    "clone",
    "to",
    "_to_copy",
    "pad",
    "constant_pad_nd",
    "squeeze",
    "unsqueeze",
    "expand",
    "transpose",
    "permute",
    "t",
    "alias",
    "detach",
    "narrow",
    "lift_fresh_copy",
    "index_select",
    "cat",
    "split",
    "chunk",
    "getitem",
    "repeat",
    "masked_fill",
    "where",
}
_LOSSES = {"cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss2d", "nll_loss2d_forward", "nll_loss_nd"}


@dataclass
class InputFacts:
    """One input of the model, as the graph shows it."""

    name: str
    """The placeholder's name (the model's argument name)."""
    dtype: str
    """``int64``, ``float32`` ... (the example input's dtype)."""
    shape: list
    """Sizes: ``"b"`` (the batch), ``"s"`` (the sequence) or a number (symbolic traces name their
    sizes; a static one gives numbers, the first being the batch)."""
    role: str | None
    """One of ``INPUT_ROLES``, or ``None`` when neither the graph nor the name tells."""
    vocab: int = 0
    """For tokens/labels/targets: how many ids the graph can index (0 when unknown)."""
    why: str = ""
    """How the role was decided, for reports and errors."""

    def to_dict(self) -> dict:
        return asdict(self)


def _val(n: object) -> torch.Tensor | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _is_int(n: object) -> bool:
    v = _val(n)
    return v is not None and not v.is_floating_point() and not v.is_complex() and v.dtype != torch.bool


def _rows(n: object) -> int:
    v = _val(n)
    return hint(v.shape[0]) if v is not None and v.dim() >= 1 else 0


def _shifts(n: fx.Node) -> bool:
    """A slice that drops the first element along a non-batch dim (the next-token shift)."""
    if op_name(n) != "slice" or len(n.args) < 3:
        return False
    v = _val(n.args[0])
    dim = n.args[1] if len(n.args) > 1 else 0
    dim = dim + v.dim() if v is not None and isinstance(dim, int) and dim < 0 else dim
    return bool(dim != 0 and n.args[2] == 1)


def _follow(start: fx.Node) -> tuple[list[int], list[int], bool]:
    """Embedding tables, loss class counts and whether a shift came first on the way to a loss."""
    tables, classes, shifted = [], [], False
    seen, queue = {start}, deque([(start, False)])
    while queue:
        n, shift = queue.popleft()
        for u in n.users:
            name = op_name(u)
            if name in ("embedding", "embedding_bag") and len(u.args) > 1 and u.args[1] is n:
                tables.append(_rows(u.args[0]))
            elif name in _LOSSES and len(u.args) > 1 and u.args[1] is n:
                logits = _val(u.args[0])
                if logits is not None and logits.dim() >= 1:
                    classes.append(hint(logits.shape[1] if logits.dim() >= 2 else logits.shape[0]))
                shifted = shifted or shift
            elif (name in _MOVES or u.op == "call_function" and name == "getitem") and u not in seen and _is_int(u):
                seen.add(u)
                queue.append((u, shift or _shifts(u)))
    return tables, classes, shifted


def _size(x, symbols: dict | None):
    if symbols and isinstance(x, torch.SymInt):
        e = to_expr(x, symbols)
        return str(e) if e in (B, S) else hint(x)
    return hint(x)


def infer_inputs(gm: fx.GraphModule, names: list[str] | None = None, symbols: dict | None = None) -> list[InputFacts]:
    """Facts for the model's inputs: the placeholders named in ``names`` (the user inputs of a
    lifted export), or every placeholder of ``ExportedProgram.module()``'s graph when ``None``.
    ``symbols`` maps the trace's shape symbols to ``B``/``S`` (``TracedGraph.symbols``)."""
    out = []
    for n in gm.graph.nodes:
        if n.op != "placeholder" or (names is not None and n.name not in names):
            continue
        v = _val(n)
        dtype = str(v.dtype).removeprefix("torch.") if v is not None else "unknown"
        shape = [_size(d, symbols) for d in v.shape] if v is not None else []
        role, vocab, why = None, 0, ""
        if _is_int(n):
            tables, classes, shifted = _follow(n)
            if tables:
                role, vocab = "tokens", min(tables)
                why = f"indexes an embedding of {vocab} rows"
                if classes:
                    vocab = min(vocab, *classes)
                    why += " and is the target of the loss"
            elif classes:
                role, vocab = ("labels" if shifted else "targets"), min(classes)
                why = f"is the target of a loss over {vocab} classes" + (", shifted by the model" if shifted else "")
        if (
            role is None
            and n.name in NAMED_ROLES
            and (v is None or NAMED_ROLES[n.name] in ("ones", "zeros") or _is_int(n))
        ):
            role, why = NAMED_ROLES[n.name], f"named {n.name!r}"
        out.append(InputFacts(n.name, dtype, shape, role, vocab, why))
    return out
