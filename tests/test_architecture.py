"""The code's shape, checked like the import rules: module names that say where a module lives,
imports readable from file headers, and functions, signatures and docstrings of a reviewable size
(ARCHITECTURE.md)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

from tests.helpers import ROOT

PACKAGES = ("planner", "passes", "codegen", "cost_models", "runtime")
MAX_FUNCTION_LINES = 80
MAX_PARAMETERS = 8
MAX_MODULE_DOCSTRING_LINES = 70  # "about 60": the model and its math, no measured figures


def _modules() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (Path(ROOT) / package).rglob("*.py"))


def _functions(tree: ast.AST):
    return [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


@pytest.fixture(scope="module")
def trees() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(), filename=str(path)) for path in _modules()}


def _where(path: Path, node: ast.AST | None = None) -> str:
    relative = path.relative_to(ROOT).as_posix()
    return f"{relative}:{node.lineno}" if node is not None else relative


def test_no_two_modules_share_a_base_name():
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in _modules():
        if path.name not in ("__init__.py", "__main__.py"):
            by_name[path.name].append(_where(path))
    assert {name: where for name, where in by_name.items() if len(where) > 1} == {}


def test_no_module_level_getattr(trees):
    lazy = [
        _where(path, node)
        for path, tree in trees.items()
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
    ]
    assert lazy == [], "import from the defining module instead of a lazy module __getattr__"


def test_functions_are_short(trees):
    long = [
        f"{_where(path, node)} {node.name}: {node.end_lineno - node.lineno + 1} lines"
        for path, tree in trees.items()
        for node in _functions(tree)
        if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long == []


def test_signatures_are_narrow(trees):
    def count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
        args = node.args
        return sum(arg.arg not in ("self", "cls") for arg in args.posonlyargs + args.args + args.kwonlyargs)

    wide = [
        f"{_where(path, node)} {node.name}: {count(node)} parameters"
        for path, tree in trees.items()
        for node in _functions(tree)
        if count(node) > MAX_PARAMETERS
    ]
    assert wide == [], "group related parameters in a typed config object"


def test_module_docstrings_keep_to_the_model(trees):
    long = []
    for path, tree in trees.items():
        doc = ast.get_docstring(tree, clean=False)
        if doc and doc.count("\n") + 1 > MAX_MODULE_DOCSTRING_LINES:
            long.append(f"{_where(path)}: {doc.count(chr(10)) + 1} lines")
    assert long == [], "measured figures belong in benchmarks/, known gaps in ARCHITECTURE.md"
