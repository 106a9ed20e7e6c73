"""Errors of the front end: a model that cannot be built or exported."""

from __future__ import annotations

from planner.errors import UserError

__all__ = ["ModelError", "first_sentence"]


class ModelError(UserError):
    """The model spec, its sizes, a user's factory or ``torch.export`` of the model failed; the
    message names the cause (the user's ``file:line`` where there is one) and what to change."""


def first_sentence(text: str, limit: int = 240) -> str:
    """The first line of a library's message, cut after its first sentence when that is long
    (a URL or the rest of a paragraph adds nothing to the error that quotes it), never mid-word."""
    line = (text.splitlines() or [""])[0].strip()
    if len(line) <= limit:
        return line
    for stop in (". ", "; "):
        k = line.find(stop)
        if 0 < k < limit:
            return line[: k + 1]
    cut = line[:limit].rsplit(" ", 1)[0]
    return cut + " ..."
