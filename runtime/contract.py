"""What plans, the command line and the runtime agree on, importable without torch.

``planner plan`` validates a plan's dtype and its inputs' roles against the runtime's own names;
it does so through this module so that planning (from the layer-table cache) never imports torch,
whose import alone is most of a re-plan's time. ``runtime.dtypes`` adds the torch dtypes to the
names here, ``runtime.data`` feeds the roles, and both re-export what they take from here.
"""

from __future__ import annotations

__all__ = ["DTYPES", "ALIASES", "ITEMSIZE", "canonical", "INPUT_ROLES", "LEGACY_INPUTS", "DataError"]

DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32")
"""The names a plan's ``dtype`` may take, in the order the CLI lists them."""

ALIASES: dict[str, str] = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
"""torch's names for the same dtypes."""

ITEMSIZE: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes per element of each compute dtype."""


def canonical(name: str) -> str:
    """``'bfloat16'`` / ``'BF16'`` / ``'bf16'`` / ``'torch.bfloat16'`` -> ``'bf16'``; a
    ``ValueError`` naming the choices for anything else."""
    key = str(name).lower().removeprefix("torch.")
    key = ALIASES.get(key, key)
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use {', '.join(DTYPES)}")
    return key


INPUT_ROLES = ("tokens", "labels", "targets", "ones", "zeros", "positions")
"""What an input can be fed: the token ids; the same ids as ``labels`` (the model shifts them);
the next tokens as ``targets``; a constant ``ones``/``zeros`` of the input's shape (a mask); the
``positions`` ``0..S-1`` of each row. ``passes.inputs`` assigns them from the graph."""

LEGACY_INPUTS = [
    {"name": "input_ids", "role": "tokens", "dtype": "int64", "shape": ["b", "s"]},
    {"name": "labels", "role": "targets", "dtype": "int64", "shape": ["b", "s"]},
]
"""The inputs of a plan written before ``model.inputs`` existed: ``(tokens, targets)``."""


class DataError(ValueError):
    """The data source cannot be used (the message names the file and the problem)."""
