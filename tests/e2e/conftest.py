"""End-to-end tests: training runs on gloo processes (``torch.multiprocessing`` or the CLI's local
launch) compared against a single-process reference, and the launch's own checks (refusals
before any process starts, fault handling). All are marked ``dist``: ``pytest -m dist`` runs only
these, ``-m 'not dist'`` everything else."""

from __future__ import annotations

import os

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if str(item.path).startswith(_HERE + os.sep):
            item.add_marker(pytest.mark.dist)
