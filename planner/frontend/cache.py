"""The layer-table cache: a model traced and analyzed once is planned again in import time.

Tracing (``torch.export`` on meta) and the passes take seconds, the search a fraction of one,
and a user re-plans the same model many times (other cluster sizes, batches, pins). So
``build_layer_table`` stores the analyzed ``LayerTable`` of every model spec it traced and reads
it back the next time the same table is asked for.

The key is everything the table is a function of; change any part and the entry is not used:

- the spec as given and every argument of ``build_layer_table`` (the size overrides, the traced
  batch, sequence length, dtype, position table, ``shallow``, ``dynamic``);
- the planner's own code that computes the table: a digest of the source of ``passes/``,
  ``planner/frontend/``, ``runtime/dtypes.py`` and ``runtime/contract/``, so an upgrade (or a local edit) never serves
  a table an older version computed;
- the versions of torch, sympy, Python and, but for the built-in GPT, transformers;
- the model's files: a ``file.py:factory``'s content (only that file: a factory that imports
  other local modules is re-traced when its own file changes, not theirs); for ``hf:PATH``, the
  content of ``config.json`` and the name, size and modification time of its weight files (the
  trace also checks the weights against the config, and that check is skipped on a hit).

A ``ModelBundle`` (a live module, not a spec) is never cached. The key and the lookup import
neither torch nor transformers (versions come from the installed packages' metadata), so a hit
costs no more than reading the file.

Where: ``$PLANNER_CACHE_DIR``, else ``$XDG_CACHE_HOME/planner``, else ``~/.cache/planner``; one
file per table under ``layer-tables/``, named by the key's SHA-256. Deleting the folder clears
the cache; ``PLANNER_CACHE=off`` (or ``0``, ``false``, ``no``) turns it off.

Safety. A cache must never make planning fail or lie:

- an entry is written to a temporary file in the same folder and renamed over the old one
  (``os.replace``), so a reader sees a whole entry or none, even with concurrent plans;
- reading is all-or-nothing: truncated bytes, garbage, an entry of another format version, a
  key that does not match (a hash collision) or an object of the wrong shape are all treated
  as a miss, and the fresh table overwrites the entry;
- an unwritable or missing cache folder only costs the speed-up (nothing is raised or printed);
- entries are pickles, and unpickling runs code named in the file, so only files owned by the
  current user are read and the folder is created private (mode 0700), like ``~/.cache`` itself.

An entry holds two forms of the table. The *compiled* one (``passes.compiled_table``: the
source of the one function of ``(b, s)`` that ``LayerTable.numeric`` compiles, and each row's
name, kind and integers) is plain data: a hit builds a ``CompiledTable`` from it, and a re-plan
prices from it without importing sympy (a third of a second, a sixth of a re-plan). The
*symbolic* one is pickled apart, as bytes inside the entry, and unpickled only when a caller reads
an expression (``CompiledTable.full``); should that part be unusable then, the table is traced
again and the entry overwritten. A table whose compiled function needs more than ``math`` has no
compiled form and is served symbolic.

Pickle was chosen over the table's JSON form (``LayerTable.to_json``) because reading JSON back
re-parses every sympy expression, which costs more than the plan it would save. Even sympy's own
pickling rebuilds each expression through its constructor, which re-canonicalizes it (and on the
first ``Add`` imports half of sympy). ``_table_pickler`` stores each expression as its class and
arguments instead and ``_rebuild`` reassembles it unevaluated (the arguments are canonical
already, so the result is the same expression). Rows that share an expression (identical
blocks) share it in the file too.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import io
import json
import logging
import os
import pickle
import platform
import tempfile
from collections import Counter
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from passes.compiled_table import CompiledTable
from passes.table_fields import EXPR_FIELDS, GEMM_FIELDS, GEMM_TP_DIMS, INT_FIELDS, Gemm
from planner.frontend.frontend_errors import ModelError
from planner.frontend.spec import hf_directory, parse_spec
from runtime.contract import environment
from runtime.contract.dtype_table import DTYPES, canonical

if TYPE_CHECKING:
    import sympy

    from passes.layer_table import LayerTable

__all__ = ["FORMAT", "cache_enabled", "cache_dir", "table_key", "load_table", "store_table", "write_entry", "stats"]

FORMAT = 4
"""Version of the entry layout; raise it when the pickled payload changes shape (2: the rows'
GEMM shapes, ``fwd_gemms`` / ``bwd_gemms``; 4: the compiled numeric form beside the symbolic
table, which is pickled apart and read only when asked for)."""

_SUBDIR = "layer-tables"
_log = logging.getLogger(__name__)

stats: Counter = Counter()
"""What the cache did in this process: ``hit``, ``miss``, ``stored``, ``rejected`` (an entry
that could not be used), ``unwritable`` (an entry that could not be stored), ``uncacheable``
(a request without a key). Tests and benchmarks read it."""


def cache_enabled() -> bool:
    """False when ``PLANNER_CACHE`` is ``off`` (or ``0``, ``false``, ``no``)."""
    return not environment.is_off(environment.CACHE)


def cache_dir() -> Path:
    """The cache folder: ``$PLANNER_CACHE_DIR``, else ``$XDG_CACHE_HOME/planner``, else
    ``~/.cache/planner``."""
    explicit = environment.read(environment.CACHE_DIR)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "planner"


# --------------------------------------------------------------------------------------------
# The key


_SOURCES = ("passes", "planner/frontend", "runtime/contract")
"""Folders (relative to the repository root) whose ``*.py`` files, sub-packages included, compute the table."""
_SOURCE_FILES = ("runtime/dtypes.py",)
_code_digest: str | None = None


def _root() -> Path:
    """The folder holding the ``passes`` and ``planner`` packages (the checkout, or site-packages)."""
    return Path(__file__).resolve().parents[2]


def source_paths() -> list[Path]:
    """The files whose code computes a layer table: the key's code part."""
    root = _root()
    return sorted(path for folder in _SOURCES for path in (root / folder).rglob("*.py")) + [
        root / f for f in _SOURCE_FILES
    ]


def code_digest() -> str:
    """SHA-256 of the source files that compute a layer table (computed once per process)."""
    global _code_digest
    if _code_digest is None:
        root = _root()
        paths = source_paths()
        digest = hashlib.sha256()
        for path in paths:
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
        _code_digest = digest.hexdigest()
    return _code_digest


def _file_digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


_WEIGHT_SUFFIXES = (".safetensors", ".json", ".bin")


def _directory_parts(path: str) -> dict[str, Any]:
    """What an ``hf:PATH`` table depends on: the config's content, and the weight files' names,
    sizes and times (their headers are checked against the config while tracing)."""
    files = {}
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if entry.is_file() and entry.name != "config.json" and entry.name.endswith(_WEIGHT_SUFFIXES):
            stat = entry.stat()
            files[entry.name] = [stat.st_size, stat.st_mtime_ns]
    return {"path": os.path.abspath(path), "config": _file_digest(os.path.join(path, "config.json")), "files": files}


def _dtype_key(dtype: Any) -> str:
    """The canonical name of a dtype argument (``'bf16'``, or a torch dtype), without torch."""
    if dtype is None:
        return "fp32"
    try:
        return canonical(str(dtype))
    except ValueError:
        raise ModelError(f"Unknown dtype {dtype!r}; use {', '.join(DTYPES)}.") from None


def table_key(spec: str, args: dict[str, Any]) -> str | None:
    """The canonical key text of ``build_layer_table(spec, **args)``, or ``None`` when the request
    cannot be keyed (a bad spec, a missing file: tracing then reports the error)."""
    try:
        kind, name = parse_spec(spec)
        args = dict(args)
        sizes = args.pop("sizes", {})
        dtype = args.pop("dtype", None)
        parts: dict[str, Any] = {
            "format": FORMAT,
            "spec": spec,
            "kind": kind,
            "args": {k: args[k] for k in sorted(args)},
            "sizes": {k: sizes[k] for k in sorted(sizes) if sizes[k] is not None},
            "dtype": _dtype_key(dtype),
            "code": code_digest(),
            "versions": {"python": platform.python_version(), "torch": _version("torch"), "sympy": _version("sympy")},
        }
        if kind != "gpt":  # hf: models are transformers' code; a factory may wrap one too
            parts["versions"]["transformers"] = _version("transformers")
        if kind == "hf":
            directory = hf_directory(name)
            if directory is not None:
                parts["directory"] = _directory_parts(directory)
        elif kind == "file":
            path = spec.rpartition(":")[0]
            parts["file"] = {"path": os.path.abspath(path), "sha256": _file_digest(path)}
        return json.dumps(parts, sort_keys=True, default=repr)
    except Exception as e:  # noqa: BLE001 - no key means no caching; the trace reports real errors
        _log.debug("layer-table cache: no key for %r (%s)", spec, e)
        stats["uncacheable"] += 1
        return None


def _entry_path(key: str) -> Path:
    return cache_dir() / _SUBDIR / (hashlib.sha256(key.encode()).hexdigest() + ".pkl")


# --------------------------------------------------------------------------------------------
# Reading and writing


def _rebuild(cls: type, args: tuple) -> "sympy.Basic":
    """An expression from its class and canonical arguments, without evaluating it again."""
    try:
        return cls(*args, evaluate=False)
    except TypeError:  # a class without the keyword: evaluate (same result, just slower)
        return cls(*args)


def _table_pickler(buffer: io.BytesIO) -> pickle.Pickler:
    """A pickler that stores compound sympy expressions as ``_rebuild(class, args)`` (see the
    module doc)."""
    import sympy

    class _TablePickler(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, sympy.Basic) and not obj.is_Atom and obj.args:
                return _rebuild, (type(obj), obj.args)
            return NotImplemented

    return _TablePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)


def _valid_table(obj: Any) -> bool:
    """Is ``obj`` the field dict of a ``LayerTable`` (right types all the way down)?"""
    import sympy

    from passes.layer_table import LayerCosts, LayerTable

    if not isinstance(obj, dict) or set(obj) != {f.name for f in fields(LayerTable)}:
        return False
    rows = obj["layers"]
    if not isinstance(rows, list) or not rows or not all(type(row) is LayerCosts for row in rows):
        return False
    for row in rows:
        if not all(isinstance(getattr(row, f), sympy.Basic) for f in EXPR_FIELDS):
            return False
        if not all(type(getattr(row, f)) is int for f in INT_FIELDS):
            return False
        if not all(_valid_gemms(getattr(row, f, None), sympy.Basic) for f in GEMM_FIELDS):
            return False
    return _valid_header(obj)


def _valid_header(obj: dict) -> bool:
    return (
        isinstance(obj["dtype"], str)
        and isinstance(obj["model"], dict)
        and isinstance(obj["fixed"], dict)
        and isinstance(obj["notes"], list)
        and isinstance(obj["tied"], list)
    )


def _valid_gemms(gemms: Any, size_type: type) -> bool:
    """Is ``gemms`` a row's list of ``Gemm`` (sizes of ``size_type``, an int count, a known tp dim)?"""
    return isinstance(gemms, list) and all(
        type(gemm) is Gemm
        and all(isinstance(x, size_type) for x in gemm[:4])
        and type(gemm.count) is int
        and gemm.tp_dim in GEMM_TP_DIMS
        for gemm in gemms
    )


def _valid_record(record: Any) -> bool:
    """Is ``record`` a ``CompiledTable.record`` (plain data of the right shapes)?"""
    keys = {"dtype", "model", "fixed", "notes", "tied", "nonzero", "source", "index", "rows"}
    if not isinstance(record, dict) or set(record) != keys or not _valid_header(record):
        return False
    rows, index = record["rows"], record["index"]
    return (
        isinstance(record["source"], str)
        and isinstance(record["nonzero"], list)
        and isinstance(rows, list)
        and isinstance(index, list)
        and len(rows) == len(index) > 0
        and all(
            isinstance(row, dict)
            and isinstance(row.get("name"), str)
            and isinstance(row.get("kind"), str)
            and type(row.get("index")) is int
            and isinstance(row.get("ints"), dict)
            and all(type(row["ints"].get(f)) is int for f in INT_FIELDS)
            for row in rows
        )
        and all(_valid_slots(slots) for slots in index)
    )


def _valid_slots(slots: Any) -> bool:
    """One row's ``Index`` entry: a result slot per ``EXPR_FIELDS`` entry, and per GEMM field its
    products as ``(four size slots, count, tp_dim)``."""
    if not (isinstance(slots, tuple) and len(slots) == 2 and isinstance(slots[1], dict)):
        return False
    row, gemms = slots
    return (
        isinstance(row, list)
        and len(row) == len(EXPR_FIELDS)
        and all(type(slot) is int and slot >= 0 for slot in row)
        and set(gemms) <= set(GEMM_FIELDS)
        and all(
            isinstance(entries, list) and all(_valid_product(entry) for entry in entries) for entries in gemms.values()
        )
    )


def _valid_product(entry: Any) -> bool:
    return (
        isinstance(entry, tuple)
        and len(entry) == 3
        and isinstance(entry[0], tuple)
        and len(entry[0]) == 4
        and all(type(slot) is int and slot >= 0 for slot in entry[0])
        and type(entry[1]) is int
        and entry[2] in GEMM_TP_DIMS
    )


def _read_payload(key: str) -> dict | None:
    """The entry of ``key`` as written by :func:`store_table` (its outer pickle: plain data and
    the symbolic table's bytes), or None (a miss, or an entry that cannot be used)."""
    path = _entry_path(key)
    try:
        with open(path, "rb") as f:
            if hasattr(os, "getuid") and os.fstat(f.fileno()).st_uid != os.getuid():
                raise ValueError("the entry belongs to another user")
            payload = pickle.load(f)
        if not (
            isinstance(payload, dict)
            and payload.get("format") == FORMAT
            and payload.get("key") == key
            and isinstance(payload.get("table"), bytes)
            and (payload.get("compiled") is None or _valid_record(payload["compiled"]))
        ):
            raise ValueError("not an entry of this key and format")
    except FileNotFoundError:
        stats["miss"] += 1
        return None
    except Exception as e:  # noqa: BLE001 - any unreadable entry is a miss, rebuilt and overwritten
        _log.debug("layer-table cache: ignoring %s (%s: %s)", path, type(e).__name__, e)
        stats["rejected"] += 1
        return None
    return payload


def _symbolic(key: str, data: bytes) -> "LayerTable | None":
    """The symbolic table pickled in ``data`` (imports sympy), or None when it cannot be used."""
    from passes.layer_table import LayerTable

    try:
        fields_of = pickle.loads(data)
        if not _valid_table(fields_of):
            raise ValueError("not a layer table")
        return LayerTable(**fields_of)
    except Exception as e:  # noqa: BLE001 - the caller rebuilds the table
        _log.debug("layer-table cache: ignoring the symbolic table of %s (%s: %s)", key[:60], type(e).__name__, e)
        stats["rejected"] += 1
        return None


def load_table(key: str, rebuild: "Callable[[], LayerTable] | None" = None) -> "LayerTable | CompiledTable | None":
    """The cached table of ``key``, or ``None`` (a miss, or an entry that cannot be used).

    With ``rebuild`` (what computes the table on a miss), a hit gives the entry's compiled form
    (``passes.compiled_table.CompiledTable``: numbers without sympy), which reads its symbolic
    table from the entry only when a caller asks for it, and calls ``rebuild`` should that part
    be unusable. Without it, or for an entry without a compiled form, the symbolic table."""
    payload = _read_payload(key)
    if payload is None:
        return None
    data, record = payload["table"], payload["compiled"]
    if record is not None and rebuild is not None:
        try:
            compiled = CompiledTable(record, lambda: _symbolic(key, data) or rebuild())
        except Exception as e:  # noqa: BLE001 - a source that does not compile: use the symbolic table
            _log.debug("layer-table cache: no compiled form for %s (%s: %s)", key[:60], type(e).__name__, e)
        else:
            stats["hit"] += 1
            return compiled
    table = _symbolic(key, data)
    if table is not None:
        stats["hit"] += 1
    return table


def store_table(key: str, table: "LayerTable") -> None:
    """Write ``table`` under ``key`` atomically, with its compiled form where it has one
    (``CompiledTable.record``); a failure only loses the speed-up."""
    path = _entry_path(key)
    try:
        symbolic = io.BytesIO()
        _table_pickler(symbolic).dump({f.name: getattr(table, f.name) for f in fields(table)})
        payload = {
            "format": FORMAT,
            "key": key,
            "compiled": CompiledTable.record(table),
            "table": symbolic.getvalue(),
        }
        data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - an unpicklable note...
        _log.debug("layer-table cache: cannot store %s (%s: %s)", path, type(e).__name__, e)
        stats["unwritable"] += 1
        return
    if write_entry(path, data):
        stats["stored"] += 1
    else:
        stats["unwritable"] += 1


def write_entry(path: Path, data: bytes) -> bool:
    """Write ``data`` to the cache entry ``path`` atomically (a temporary file in the same folder,
    renamed over the old entry, so a reader sees a whole entry or none), creating the folders
    private (mode 0700); whether it was written (a read-only home or a full disk only lose the
    speed-up)."""
    tmp = None
    try:
        path.parent.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        descriptor, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem[:16] + ".", suffix=".tmp")
        with os.fdopen(descriptor, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        tmp = None
        return True
    except OSError as e:
        _log.debug("cache: cannot write %s (%s: %s)", path, type(e).__name__, e)
        return False
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
