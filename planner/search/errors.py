"""Errors of the search: a request it cannot search, or a search that finds nothing that fits."""

from __future__ import annotations

from planner.errors import UserError

__all__ = ["SearchError"]


class SearchError(UserError):
    """The request is invalid (degrees, batch, pins, solver) or no strategy honours its pins; the
    message says which flag to change."""
