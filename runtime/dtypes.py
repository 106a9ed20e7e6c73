"""The one dtype table: the compute dtypes a plan may name, their torch dtypes and sizes.

Plans, manifests and the CLI name dtypes ``fp32``, ``bf16`` and ``fp16``; torch's own names
(``float32``, ``bfloat16``, ``float16``) are accepted as aliases. The front end, the plan, the
search, codegen, the CLI and the runtime read their torch dtypes here; the names alone live in
``runtime.contract`` (importable without torch) and are re-exported. ``passes`` work
on torch dtypes, and ``cost_models`` (which never import the runtime) key their precision recipe
by these names; ``tests/cost_models`` checks that their tables agree with this one.
"""

from __future__ import annotations

import torch

from runtime.contract import ALIASES, DTYPES, ITEMSIZE, canonical

__all__ = ["DTYPES", "TORCH_DTYPES", "ALIASES", "to_torch", "name_of", "itemsize", "canonical"]

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
    for name, dt in TORCH_DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"{dtype} is not a compute dtype; use {', '.join(DTYPES)}")


def itemsize(name: str) -> int:
    """Bytes per element of a named dtype."""
    return ITEMSIZE[canonical(name)]
