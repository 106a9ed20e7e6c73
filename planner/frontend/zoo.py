"""The model zoo: build any spec (built-in GPT presets, HF config classes, user factories).

Every builder returns a ``ModelBundle``: a module whose ``forward(input_ids, labels)`` returns the
scalar training loss (so a traced graph ends in a scalar), plus the facts the planner needs
(sizes, vocabulary, sequence length). Nothing downloads weights: HF models are built from their
config classes or a local directory's config.json with fresh initialization (``planner train``
then loads a directory's safetensors weights, ``planner.frontend.checkpoint``).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from planner.frontend.bundle import ModelBundle, parse_spec
from planner.frontend.factory import load_factory
from planner.frontend.frontend_errors import ModelError
from planner.frontend.gpt import GPT, PRESETS
from planner.frontend.hf import build_hf, build_hf_dir, hf_directory

__all__ = ["build_model"]


def build_model(
    spec: str,
    *,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    ffn: int | None = None,
    vocab: int | None = None,
    seq_len: int | None = None,
    batch: int = 1,
    dropout: float = 0.0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int | None = None,
) -> ModelBundle:
    """Build the model named by ``spec`` on ``device`` (``"meta"`` allocates nothing)."""
    kind, name = parse_spec(spec)
    sizes = {
        k: v
        for k, v in dict(
            layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab, seq_len=seq_len
        ).items()
        if v is not None
    }
    if seed is not None:
        torch.manual_seed(seed)
    if kind == "gpt":
        if "kv_heads" in sizes and sizes["kv_heads"] != sizes.get("heads", PRESETS[name].heads):
            raise ModelError("The built-in GPT has no grouped-query attention; drop --kv-heads or use hf:llama.")
        cfg = replace(PRESETS[name], dropout=dropout, **{k: v for k, v in sizes.items() if k != "kv_heads"})
        with torch.device(device):
            model = GPT(cfg)
        model = model.to(dtype)
        b = ModelBundle(
            spec, model, (), cfg.vocab, cfg.seq_len, cfg.hidden, cfg.heads, cfg.heads, cfg.layers, "gpt", sizes
        )
    elif kind == "hf":
        directory = hf_directory(name)
        if directory is None:
            b = build_hf(name, sizes, device=device, dtype=dtype, dropout=dropout)
        else:  # a local model directory: its config (the runtime loads its weights)
            b = build_hf_dir(directory, sizes, device=device, dtype=dtype, dropout=dropout)
        b.spec = spec
    else:
        b = load_factory(spec, device=device)
    if kind != "file":
        s = b.seq_len if seq_len is None else seq_len
        b.example_inputs = b.make_inputs(batch, s, device=device)
    return b
