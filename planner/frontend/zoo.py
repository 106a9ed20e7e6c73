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
from planner.frontend.spec import ModelSizes

__all__ = ["build_model", "ModelSizes"]


def build_model(
    spec: str,
    sizes: ModelSizes | None = None,
    *,
    batch: int = 1,
    dropout: float = 0.0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int | None = None,
) -> ModelBundle:
    """Build the model named by ``spec`` with the ``sizes`` flags on ``device`` (``"meta"``
    allocates nothing); ``batch`` rows of example inputs."""
    kind, name = parse_spec(spec)
    given = (sizes or ModelSizes()).given()
    if seed is not None:
        torch.manual_seed(seed)
    if kind == "gpt":
        if "kv_heads" in given and given["kv_heads"] != given.get("heads", PRESETS[name].heads):
            raise ModelError("The built-in GPT has no grouped-query attention; drop --kv-heads or use hf:llama.")
        cfg = replace(PRESETS[name], dropout=dropout, **{k: size for k, size in given.items() if k != "kv_heads"})
        with torch.device(device):
            model = GPT(cfg)
        model = model.to(dtype)
        bundle = ModelBundle(
            spec, model, (), cfg.vocab, cfg.seq_len, cfg.hidden, cfg.heads, cfg.heads, cfg.layers, "gpt", given
        )
    elif kind == "hf":
        directory = hf_directory(name)
        if directory is None:
            bundle = build_hf(name, given, device=device, dtype=dtype, dropout=dropout)
        else:  # a local model directory: its config (the runtime loads its weights)
            bundle = build_hf_dir(directory, given, device=device, dtype=dtype, dropout=dropout)
        bundle.spec = spec
    else:
        bundle = load_factory(spec, device=device)
    if kind != "file":
        seq_len = bundle.seq_len if given.get("seq_len") is None else given["seq_len"]
        bundle.example_inputs = bundle.make_inputs(batch, seq_len, device=device)
    return bundle
