"""The compute dtypes a plan may name, torch's names for them, and their sizes (torch-free;
``runtime.dtypes`` adds the torch dtypes)."""

from __future__ import annotations

__all__ = ["DTYPES", "ALIASES", "ITEMSIZE", "canonical"]

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
