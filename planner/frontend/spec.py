"""Model specs and the built-in sizes, without torch: what a re-plan needs before any model exists.

A spec names a built-in GPT preset (``gpt``, ``gpt2``, ``gpt2-xl``, ``gpt3-175b``), an HF
architecture (``hf:llama``) or a local model directory (``hf:PATH``), or a user's
``path/to/file.py:factory``. ``parse_spec`` splits it; ``PRESETS`` give the built-in GPT's sizes;
``hf_directory`` tells an architecture name from a directory. The layer-table cache keys a request
with these alone, so that planning a model traced before imports neither torch nor transformers
(``planner.frontend.zoo`` builds the model when it must be traced).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from planner.frontend.frontend_errors import ModelError

__all__ = [
    "GPTConfig",
    "ModelSizes",
    "PRESETS",
    "HF_ARCHS",
    "SPEC_HELP",
    "HF_WRAPPER_PREFIX",
    "parse_spec",
    "hf_directory",
    "model_layer_names",
]

HF_ARCHS = ("gpt2", "llama", "bert")
"""The HF architectures built from their config classes (``hf:NAME``)."""
HF_WRAPPER_PREFIX = "inner."
"""What the traced module paths of an ``hf:`` model start with: the loss wrapper
(``planner.frontend.hf.HFLossModel``) holds the transformers model as ``inner``."""

SPEC_HELP = (
    "Model specs: 'gpt' (built-in GPT; sizes from --layers/--hidden/--heads/--ffn/--vocab), "
    "presets 'gpt2', 'gpt2-xl', 'gpt3-175b'; 'hf:gpt2', 'hf:llama', 'hf:bert' (needs the 'hf' "
    "extra: pip install 'planner[hf]'); 'hf:PATH', a local HF model directory (config.json, and "
    "*.safetensors weights to start from; nothing is downloaded); or 'path/to/file.py:factory' "
    "where factory() returns (model, example_inputs)."
)


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the built-in GPT (a pre-LayerNorm decoder with learned positions)."""

    vocab: int = 50257
    """Vocabulary size (rows of the embedding and of the untied LM head)."""
    seq_len: int = 1024
    """Maximum sequence length (rows of the position embedding)."""
    layers: int = 12
    """Number of transformer blocks."""
    hidden: int = 768
    """Model width."""
    heads: int = 12
    """Attention heads; must divide ``hidden``."""
    ffn: int = 0
    """MLP inner width; 0 means 4 x hidden."""
    dropout: float = 0.0
    """Dropout probability on attention output and MLP output."""

    def __post_init__(self):
        for name in ("vocab", "seq_len", "layers", "hidden", "heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ModelError(f"GPT size {name}={value!r} must be a positive integer.")
        if self.hidden % self.heads:
            raise ModelError(
                f"GPT hidden size {self.hidden} is not divisible by heads={self.heads}; "
                f"pick --heads that divides --hidden."
            )
        if self.ffn < 0:
            raise ModelError(f"GPT ffn={self.ffn} must be positive (0 means 4 x hidden).")
        if not 0.0 <= self.dropout < 1.0:
            raise ModelError(f"dropout={self.dropout} must be in [0, 1).")

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden


@dataclass(frozen=True)
class ModelSizes:
    """The size flags of a model spec (``--layers``, ``--hidden`` ...): each overrides the spec's
    own size when given, ``None`` keeps it. The builders check that a size fits their model (a
    positive integer, heads dividing hidden ...); this checks only that each is an integer."""

    layers: int | None = None
    """Transformer blocks."""
    hidden: int | None = None
    """Model width."""
    heads: int | None = None
    """Attention heads."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention; HF models that have it)."""
    ffn: int | None = None
    """MLP inner width."""
    vocab: int | None = None
    """Vocabulary size."""
    seq_len: int | None = None
    """Maximum sequence length (the model's position table)."""

    def __post_init__(self) -> None:
        for size in fields(self):
            value = getattr(self, size.name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ModelError(f"model size {size.name}={value!r} must be an integer.")

    def given(self) -> dict[str, Any]:
        """The sizes that were given, by name (what ``ModelBundle.sizes`` and plan.json record)."""
        return {size.name: getattr(self, size.name) for size in fields(self) if getattr(self, size.name) is not None}


PRESETS: dict[str, GPTConfig] = {
    "gpt": GPTConfig(vocab=8192, seq_len=128, layers=4, hidden=256, heads=4),
    "gpt2": GPTConfig(vocab=50257, seq_len=1024, layers=12, hidden=768, heads=12),
    "gpt2-xl": GPTConfig(vocab=50257, seq_len=1024, layers=48, hidden=1600, heads=25),
    "gpt3-175b": GPTConfig(vocab=51200, seq_len=2048, layers=96, hidden=12288, heads=96),
}


def parse_spec(spec: str) -> tuple[str, str]:
    """Split a spec into (kind, name): ('gpt', preset) | ('hf', arch or directory) | ('file', 'path:fn')."""
    if not isinstance(spec, str) or not spec.strip():
        raise ModelError("The model spec is empty. " + SPEC_HELP)
    spec = spec.strip()
    if spec in PRESETS:
        return "gpt", spec
    if spec.startswith("hf:"):
        if not spec[3:].strip():
            raise ModelError(
                "'hf:' needs an architecture (hf:gpt2, hf:llama, hf:bert) or the path of "
                "a local model directory (hf:PATH)."
            )
        return "hf", spec[3:]
    if ".py:" in spec:
        return "file", spec
    raise ModelError(f"Unknown model spec {spec!r}. " + SPEC_HELP)


def model_layer_names(spec: str, names: list[str]) -> list[str]:
    """The layer table's row names as the model names its modules: an ``hf:`` model's without the
    loss wrapper's ``inner.`` (``model.layers.0``, ``lm_head+model.norm``, as in the model's
    checkpoint); every other front end traces the user's own module, whose paths are its names."""
    if not (isinstance(spec, str) and spec.strip().startswith("hf:")):
        return list(names)
    return ["+".join(part.removeprefix(HF_WRAPPER_PREFIX) for part in name.split("+")) for name in names]


def hf_directory(name: str) -> str | None:
    """The directory of ``hf:NAME`` when NAME is a path, ``None`` for a built-in architecture.

    A built-in name (``gpt2``, ``llama``, ``bert``) wins; write ``./llama`` for a folder of that name.
    """
    if name in HF_ARCHS:
        return None
    if not os.path.isdir(name):
        raise ModelError(
            f"'hf:{name}' is neither a built-in HF architecture ("
            + ", ".join("hf:" + arch for arch in HF_ARCHS)
            + ") nor a directory. Give the path "
            "of a local model directory holding config.json (and optionally *.safetensors "
            "weights, e.g. written by save_pretrained); nothing is downloaded."
        )
    return name
