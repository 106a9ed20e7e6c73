"""Errors of the user's input that the runtime raises and ``planner`` reports as bad input (exit
status 2, no traceback)."""

from __future__ import annotations

__all__ = ["ConfigError", "DataError"]


class ConfigError(ValueError):
    """A training setting is out of range; the message names the setting, its flag and the value."""


class DataError(ValueError):
    """The data source cannot be used (the message names the file and the problem)."""
