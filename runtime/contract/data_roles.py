"""What training feeds each model input (``passes.inputs`` assigns the roles from the graph,
``runtime.training.data`` fills them)."""

from __future__ import annotations

__all__ = ["INPUT_ROLES", "LEGACY_INPUTS"]

INPUT_ROLES: tuple[str, ...] = ("tokens", "labels", "targets", "ones", "zeros", "positions")
"""What an input can be fed: the token ids; the same ids as ``labels`` (the model shifts them);
the next tokens as ``targets``; a constant ``ones``/``zeros`` of the input's shape (a mask); the
``positions`` ``0..S-1`` of each row."""

LEGACY_INPUTS = [
    {"name": "input_ids", "role": "tokens", "dtype": "int64", "shape": ["b", "s"]},
    {"name": "labels", "role": "targets", "dtype": "int64", "shape": ["b", "s"]},
]
"""The inputs of a plan written before ``model.inputs`` existed: ``(tokens, targets)``."""
