"""A layer table's numbers without sympy: what a re-plan reads from the layer-table cache.

``LayerTable.numeric`` compiles the table's distinct expressions into one Python function of
``(b, s)`` (sympy's ``lambdify`` with the ``math`` module); its source is plain Python that
needs only ``math`` and the builtins. ``CompiledTable`` keeps that source, where each field reads
the function's results, and each row's name, kind and integer fields: everything the search's
``cost_models.layer_row.NumericTable`` reads, with the same numbers (``evaluate_rows`` is the one
evaluation both use). Anything else (an expression, ``to_json``, a pass's symbol) loads the
symbolic ``LayerTable`` once, on first use (``full``): a reader that needs it gets it, only
slower. The layer-table cache stores both forms (``planner.frontend.cache``), so a re-plan
imports neither torch nor sympy, which alone is a third of a second.
"""

from __future__ import annotations

import builtins
import copy
import math
from typing import Any, Callable

from passes.pass_error import PassError
from passes.table_fields import EXPR_FIELDS, INT_FIELDS, Gemm

__all__ = ["CompiledRow", "CompiledTable", "check_fixed", "evaluate_rows", "function_source", "row_shapes"]

#: Where each row reads the compiled function's results: per row, the result index of each
#: ``EXPR_FIELDS`` entry, and per ``GEMM_FIELDS`` entry its products as ``(size indices, count, tp_dim)``.
Index = list[tuple[list[int], dict[str, list]]]

_NAMESPACE = {"math": math} | {name: getattr(math, name) for name in dir(math) if not name.startswith("_")}
"""What ``lambdify(..., modules="math")`` gives the generated function besides the builtins."""


def check_fixed(fixed: dict[str, int], b: int, s: int) -> None:
    """``PassError`` when ``b`` or ``s`` differs from a size the trace fixed (``LayerTable.fixed``)."""
    for name, value in (("s", s), ("b", b)):
        if name in fixed and int(value) != fixed[name]:
            what = "sequence length" if name == "s" else "micro-batch size"
            raise PassError(
                "",
                None,
                f"This model's costs were traced at a fixed {what} "
                f"{fixed[name]}; re-trace at {value} (the model or the trace "
                f"pinned it), or make the model shape-generic.",
            )


def evaluate_rows(
    fn: Callable, index: Index, integers: list[dict[str, int]], b: int, s: int, positions: list[int] | None = None
) -> list[dict]:
    """Every field of every row (or of the rows at ``positions``) as numbers at ``(b, s)``: the
    compiled function's results by ``index``, each row's ``integers`` as floats, its products as
    tuples of ``Gemm``."""
    values = [float(value) for value in fn(b, s)]
    out = []
    for position in range(len(index)) if positions is None else positions:
        (row, gemms), ints = index[position], integers[position]
        numbers: dict[str, Any] = {name: values[i] for name, i in zip(EXPR_FIELDS, row)}
        numbers.update({name: float(ints[name]) for name in INT_FIELDS})
        for name, entries in gemms.items():
            numbers[name] = tuple(
                Gemm._make([*(values[i] for i in dims), count, tp_dim]) for dims, count, tp_dim in entries
            )
        out.append(numbers)
    return out


def row_shapes(index: Index, integers: list[dict[str, int]]) -> list[int]:
    """Per row, the number of its shape (numbered in order of first appearance): rows of one shape read the same results of the compiled
    function (its expressions are deduplicated) and have the same integers, so their numbers are
    equal at every ``(b, s)``: a 96-block table has a handful of shapes."""
    shapes: dict[tuple, int] = {}
    out = []
    for (row, gemms), ints in zip(index, integers):
        key = (
            tuple(row),
            tuple(
                (name, tuple((tuple(dims), count, tp_dim) for dims, count, tp_dim in entries))
                for name, entries in sorted(gemms.items())
            ),
            tuple(sorted(ints.items())),
        )
        out.append(shapes.setdefault(key, len(shapes)))
    return out


def function_source(fn: Callable) -> str | None:
    """The source of a ``lambdify``'d function when it runs from its text alone (every global it
    reads is a ``math`` name or a builtin), else None."""
    import inspect  # only when storing a table

    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return None
    if fn.__closure__ or fn.__defaults__ or fn.__kwdefaults__ or fn.__code__.co_freevars:
        return None  # state beside the text (lambdify makes none)
    if fn.__builtins__ is not builtins.__dict__ and fn.__builtins__ is not builtins:
        return None
    missing = object()
    for name in _globals_read(fn.__code__):  # each must mean, rebuilt from the text, what it means now
        bound = fn.__globals__[name] if name in fn.__globals__ else getattr(builtins, name, missing)
        if bound is missing or bound is not _NAMESPACE.get(name, getattr(builtins, name, missing)):
            return None  # e.g. an implemented function lambdify put in the namespace
    return source


def _globals_read(code: Any) -> set[str]:
    """The global names ``code`` (and the code nested in it) loads: not its attribute names."""
    import dis

    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            names |= _globals_read(const)
    return names


def _function(source: str) -> Callable:
    namespace: dict[str, Any] = dict(_NAMESPACE)
    exec(compile(source, "<planner compiled layer table>", "exec"), namespace)  # noqa: S102 - our own cache entry
    return namespace["_lambdifygenerated"]


def _same(table: Any) -> Any:
    return table


class CompiledRow:
    """One row's name, kind and integer fields; any other field is the symbolic row's (the table
    loads it)."""

    def __init__(self, table: "CompiledTable", position: int, index: int, name: str, kind: str, ints: dict[str, int]):
        self._table, self._position = table, position
        self.index, self.name, self.kind = index, name, kind
        for field_name in INT_FIELDS:
            setattr(self, field_name, ints[field_name])

    def __getattr__(self, name: str) -> Any:  # only for what __init__ did not set
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._symbolic(), name)

    def _symbolic(self) -> Any:
        return self._table.full().layers[self._position]

    def __reduce__(self) -> tuple:
        return (_same, (self._symbolic(),))  # pickles (and copies) as the symbolic row


class CompiledTable:
    """A ``LayerTable``'s numeric form (module docstring): ``numeric``, ``total``, the rows'
    names, kinds and integers, ``model``, ``fixed``, ``notes``, ``tied``, ``dtype`` and
    ``nonzero_fields`` without sympy; anything else from ``full()``. Pickled or copied, it is the
    symbolic table (``dataclasses.replace`` wants ``full()``)."""

    def __init__(self, record: dict[str, Any], load_full: Callable[[], Any]):
        self.dtype: str = record["dtype"]
        self.model: dict[str, Any] = record["model"]
        self.fixed: dict[str, int] = record["fixed"]
        self.notes: list[str] = record["notes"]
        self.tied: list[dict[str, Any]] = record["tied"]
        self._nonzero: frozenset[str] = frozenset(record["nonzero"])
        self._index: Index = record["index"]
        self._integers: list[dict[str, int]] = [row["ints"] for row in record["rows"]]
        self.layers = [
            CompiledRow(self, position, row["index"], row["name"], row["kind"], row["ints"])
            for position, row in enumerate(record["rows"])
        ]
        self._fn = _function(record["source"])
        self._load_full = load_full
        self._full: Any = None
        self._cache: dict[tuple[int, int], list[dict]] = {}
        self._shapes: list[int] | None = None

    @staticmethod
    def record(table: Any) -> dict[str, Any] | None:
        """What ``CompiledTable`` is built from, for a symbolic ``table`` (plain data: the cache
        pickles it without sympy); None when its compiled function needs more than ``math``."""
        fn, index = table._compile()
        source = function_source(fn)
        if source is None:
            return None
        return {
            "dtype": table.dtype,
            "model": table.model,
            "fixed": table.fixed,
            "notes": table.notes,
            "tied": table.tied,
            "nonzero": sorted(table.nonzero_fields()),
            "source": source,
            "index": copy.deepcopy(index),  # not the table's own (a reader may not change it)
            "rows": [
                {
                    "index": lay.index,
                    "name": lay.name,
                    "kind": lay.kind,
                    "ints": {name: int(getattr(lay, name)) for name in INT_FIELDS},
                }
                for lay in table.layers
            ],
        }

    def full(self) -> Any:
        """The symbolic ``LayerTable`` (loaded once)."""
        if self._full is None:
            self._full = self._load_full()
        return self._full

    def nonzero_fields(self) -> frozenset[str]:
        """The ``EXPR_FIELDS`` that are not zero in some row (as ``LayerTable.nonzero_fields``)."""
        return self._nonzero

    def numeric(self, b: int, s: int) -> list[dict[str, Any]]:
        """``LayerTable.numeric``: every field of every row as numbers at ``(b, s)``."""
        check_fixed(self.fixed, b, s)
        key = (int(b), int(s))
        if key not in self._cache:
            try:
                self._cache[key] = evaluate_rows(self._fn, self._index, self._integers, *key)
            except (ArithmeticError, AttributeError, IndexError, TypeError, ValueError):
                # a damaged entry the checks let through: the symbolic table answers (or raises)
                return self.full().numeric(b, s)
        return [dict(row) for row in self._cache[key]]

    def shapes(self) -> list[int]:
        """``row_shapes`` of the rows (computed once)."""
        if self._shapes is None:
            self._shapes = row_shapes(self._index, self._integers)
        return self._shapes

    def numeric_at(self, b: int, s: int, positions: list[int]) -> list[dict[str, Any]]:
        """``numeric(b, s)`` of the rows at ``positions`` only (what a search reads of one row per
        shape); the same numbers, without building every row's."""
        check_fixed(self.fixed, b, s)
        try:
            return evaluate_rows(self._fn, self._index, self._integers, int(b), int(s), positions)
        except (ArithmeticError, AttributeError, IndexError, TypeError, ValueError):
            return self.full().numeric_at(b, s, positions)  # as ``numeric``: a damaged entry

    def total(self, field_name: str, b: int, s: int) -> float:
        """Sum of one field over all rows at ``(b, s)``."""
        if field_name not in EXPR_FIELDS + INT_FIELDS:
            raise KeyError(f"unknown layer-table field {field_name!r}")
        return sum(row[field_name] for row in self.numeric(b, s))

    def __eq__(self, other: object) -> bool:
        """Equal to the symbolic table it stands for (loads it)."""
        if isinstance(other, CompiledTable):
            other = other.full()
        return self.full() == other

    __hash__ = None  # type: ignore[assignment]  # mutable, as LayerTable

    def __reduce__(self) -> tuple:
        # its function is generated code and its loader a closure: it pickles as the table it stands for
        return (_same, (self.full(),))

    def __copy__(self) -> Any:
        return copy.copy(self.full())

    def __deepcopy__(self, memo: dict) -> Any:
        return copy.deepcopy(self.full(), memo)

    def __getattr__(self, name: str) -> Any:  # only for what __init__ did not set
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.full(), name)
