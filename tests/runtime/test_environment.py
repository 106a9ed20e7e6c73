"""Every ``PLANNER_*`` variable is declared once (``runtime.contract.environment``), read through it,
and listed in the README."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from runtime.contract import environment
from tests.helpers import ROOT

PACKAGES = ("planner", "passes", "codegen", "cost_models", "runtime")


def test_the_readme_lists_every_variable_with_its_default():
    readme = (Path(ROOT) / "README.md").read_text()
    for var in environment.VARIABLES:
        default = f"`{var.default}`" if var.default else "unset"
        assert f"| `{var.name}` | {default} |" in readme, var.name


def test_no_module_reads_a_variable_by_its_literal_name():
    declared = {var.name for var in environment.VARIABLES}
    home = Path(ROOT) / "runtime" / "contract" / "environment.py"
    for package in PACKAGES:
        for path in (Path(ROOT) / package).rglob("*.py"):
            if path == home:
                continue
            code = path.read_text()
            assert not re.search(r"environ(?:\.get)?[\[(]\s*[\"']PLANNER_", code), f"{path} reads os.environ directly"
            for name in re.findall(r"PLANNER_[A-Z_]+", code):
                assert name in declared, f"{path} names {name}, which runtime.contract.environment does not declare"


@pytest.mark.parametrize(("value", "expected"), [("", "cbc"), ("  ", "cbc"), (" highs ", "highs")])
def test_read_strips_and_falls_back_on_the_default(monkeypatch, value, expected):
    monkeypatch.setenv(environment.SOLVER.name, value)
    assert environment.read(environment.SOLVER) == expected


@pytest.mark.parametrize("value", ["off", "OFF", "0", "false", "no", "disabled"])
def test_is_off(monkeypatch, value):
    monkeypatch.setenv(environment.CACHE.name, value)
    assert environment.is_off(environment.CACHE)
    monkeypatch.setenv(environment.CACHE.name, "on")
    assert not environment.is_off(environment.CACHE)
