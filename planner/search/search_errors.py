"""Errors of the search: a request it cannot search, or a search that finds nothing that fits."""

from __future__ import annotations

from cost_models.strategy import Evaluation
from planner.errors import UserError

__all__ = ["SearchError", "NoFeasiblePlan"]


class SearchError(UserError):
    """The request is invalid (degrees, batch, pins, solver) or no strategy honours its pins; the
    message says which flag to change."""


class NoFeasiblePlan(SearchError):
    """No strategy fits in memory. The message gives the least memory per device any strategy
    needs, the part that dominates it, and what would make it fit; ``least`` is that strategy."""

    def __init__(self, message: str, least: Evaluation | None = None):
        super().__init__(message)
        self.least = least
