"""What every model builder returns (``ModelBundle``) and how a model spec is read.

A spec names a built-in GPT preset, an HF architecture (``hf:llama``) or model directory
(``hf:PATH``), or a user's ``path/to/file.py:factory``; ``planner.frontend.spec.parse_spec`` splits
it (re-exported here),
``planner.frontend.zoo`` builds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from planner.frontend.spec import SPEC_HELP, parse_spec

__all__ = ["ModelBundle", "parse_spec", "SPEC_HELP"]


@dataclass
class ModelBundle:
    """A model ready to trace or train, and what the planner needs to know about it."""

    spec: str
    """The spec string the user gave (recorded in plan.json)."""
    model: nn.Module
    """``forward(*example_inputs)`` returns the scalar loss."""
    example_inputs: tuple
    """Example inputs for one micro-batch of ``batch`` sequences."""
    vocab: int
    seq_len: int
    hidden: int = 0
    heads: int = 0
    kv_heads: int = 0
    layers: int = 0
    kind: str = "gpt"
    """``gpt``, ``hf`` or ``file``."""
    sizes: dict[str, Any] = field(default_factory=dict)
    """The size overrides used to build it (re-building a plan's model uses these)."""

    def make_inputs(self, batch: int, seq_len: int, device="cpu", generator=None) -> tuple:
        """Random token inputs ``(input_ids, labels)`` of shape (batch, seq_len); for a user's
        model, inputs like its examples (same number, dtypes and trailing sizes) with ``batch``
        rows and, where an example's second size is the examples' sequence length, ``seq_len``
        of them (zeros: this is for tracing), on the device of the examples (the factory chose it)."""
        if self.kind == "file":
            return tuple(
                torch.zeros(self._resized(example, batch, seq_len), dtype=example.dtype, device=example.device)
                for example in self.example_inputs
            )
        ids = torch.randint(0, self.vocab, (batch, seq_len + 1), generator=generator)
        return ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)

    def _resized(self, example: torch.Tensor, batch: int, seq_len: int) -> list[int]:
        dims = list(example.shape)
        if dims:
            dims[0] = batch
        if len(dims) >= 2 and dims[1] == self.seq_len:
            dims[1] = seq_len
        return dims
