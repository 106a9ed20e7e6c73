"""Errors of the front end: a model that cannot be built or exported."""

from __future__ import annotations

from planner.errors import UserError

__all__ = ["ModelError"]


class ModelError(UserError):
    """The model spec, its sizes, a user's factory or ``torch.export`` of the model failed; the
    message names the cause (the user's ``file:line`` where there is one) and what to change."""
