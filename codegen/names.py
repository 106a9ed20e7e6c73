"""Identifiers that end up in generated source.

Everything from the outside world (module paths and parameter names of a user's model, names in
plan.json) passes through ``safe_ident`` before it is written into a ``.py`` file, so a crafted
model or plan cannot inject code: the result always matches ``[A-Za-z_][A-Za-z0-9_]*``, is not a
keyword and is not a dunder name. String literals go through ``repr`` of a ``str`` only.
"""

from __future__ import annotations

import keyword
import re

from codegen.codegen_errors import UnsafeNameError

__all__ = ["safe_ident", "check_ident"]

_BAD = re.compile(r"[^A-Za-z0-9_]")


def safe_ident(name: str, prefix: str = "p_") -> str:
    """Map any string to a plain, non-keyword, non-dunder Python identifier."""
    ident = _BAD.sub("_", str(name)).strip("_") or "x"
    if ident[0].isdigit() or keyword.iskeyword(ident) or ident in ("self", "torch", "runtime"):
        ident = prefix + ident
    ident = re.sub(r"_{2,}", "_", ident)
    check_ident(ident)
    return ident


def check_ident(name: str) -> str:
    """Raise ``UnsafeNameError`` unless ``s`` is a plain identifier safe to emit."""
    if not (
        isinstance(name, str)
        and name.isidentifier()
        and name.isascii()
        and not keyword.iskeyword(name)
        and not name.startswith("__")
        and _BAD.search(name) is None
    ):
        raise UnsafeNameError(f"{name!r} is not a safe identifier for generated code")
    return name
