"""Event lines of the metrics JSONL: what happened to a run between steps (it resumed, it was
re-planned), written by rank 0 beside the per-step lines.

An event line is a JSON object with an ``"event"`` key (its kind) and a ``"message"`` a person
reads ("resumed at step 1200 from checkpoint step-001200"); the step lines have no ``"event"``.
Readers of the metrics take the step lines with ``step_lines`` and the events with
``event_lines``; a metrics file written before events existed reads the same.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

__all__ = ["EVENT_KEY", "write_event", "is_event", "step_lines", "event_lines", "read_lines"]

EVENT_KEY = "event"
"""The key that marks an event line; its value is the event's kind (``resume``, ``replan``...)."""


def write_event(path: str | None, kind: str, message: str, /, **fields: Any) -> dict:
    """Append one event line to the metrics file ``path`` (nothing when None); the line's object.
    The first three are positional-only, so a field may be called ``path`` too."""
    line = {EVENT_KEY: kind, "message": message, **fields}
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")
    return line


def is_event(line: dict) -> bool:
    return EVENT_KEY in line


def step_lines(lines: Iterable[dict]) -> list[dict]:
    """The per-step lines, in order."""
    return [line for line in lines if not is_event(line)]


def event_lines(lines: Iterable[dict]) -> list[dict]:
    """The event lines, in order."""
    return [line for line in lines if is_event(line)]


def read_lines(path: str) -> list[dict]:
    """Every line of a metrics JSONL file (steps and events)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
