"""Fixtures of the search tests."""

from __future__ import annotations

import pytest

from planner.search import program_cache


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh schedule cache folder (``planner.search.program_cache``) with its counters at zero."""
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PLANNER_CACHE", raising=False)
    monkeypatch.setattr(program_cache, "stats", program_cache.stats.__class__())
    return tmp_path / "schedule-programs"
