"""End-to-end tests: each one spawns gloo processes (``torch.multiprocessing`` or the CLI's local
launch) and compares them against a single-process reference. All are marked ``dist``:
``pytest -m dist`` runs only these, ``-m 'not dist'`` everything else."""

from __future__ import annotations

import os

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if str(item.path).startswith(_HERE + os.sep):
            item.add_marker(pytest.mark.dist)
