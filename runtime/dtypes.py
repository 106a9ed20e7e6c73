"""The torch side of the dtype table: each compute dtype's torch dtype (the names and sizes live in
``runtime.contract.dtype_table``, importable without torch)."""

from __future__ import annotations

import torch

from runtime.contract.dtype_table import DTYPES, ITEMSIZE, canonical

__all__ = ["TORCH_DTYPES", "to_torch", "name_of", "itemsize"]

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}
"""Compute dtype name -> torch dtype, in the order the CLI lists them (``DTYPES``)."""


def to_torch(name: str | torch.dtype) -> torch.dtype:
    """A dtype name (or a torch dtype, returned as is) -> the torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    return TORCH_DTYPES[canonical(name)]


def name_of(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``'bf16'``; a ``ValueError`` for a dtype no plan can name."""
    for name, candidate in TORCH_DTYPES.items():
        if candidate == dtype:
            return name
    raise ValueError(f"{dtype} is not a compute dtype; use {', '.join(DTYPES)}")


def itemsize(name: str) -> int:
    """Bytes per element of a named dtype."""
    return ITEMSIZE[canonical(name)]
