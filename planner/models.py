"""The model zoo: the built-in GPT, its presets, HF config-class models and ``file.py:factory``.

Every builder returns a ``ModelBundle``: a module whose ``forward(input_ids, labels)`` returns the
scalar training loss (so a traced graph ends in a scalar), plus the facts the planner needs
(sizes, vocabulary, sequence length). Nothing downloads weights: HF models are built from their
config classes with fresh initialization.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from planner.errors import UserError

__all__ = ["GPTConfig", "GPT", "ModelBundle", "PRESETS", "build_model", "parse_spec", "SPEC_HELP"]


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
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise UserError(f"GPT size {name}={v!r} must be a positive integer.")
        if self.hidden % self.heads:
            raise UserError(
                f"GPT hidden size {self.hidden} is not divisible by heads={self.heads}; "
                f"pick --heads that divides --hidden."
            )
        if self.ffn < 0:
            raise UserError(f"GPT ffn={self.ffn} must be positive (0 means 4 x hidden).")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"dropout={self.dropout} must be in [0, 1).")

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.head_dim = cfg.hidden // cfg.heads
        self.q = nn.Linear(cfg.hidden, cfg.hidden)
        self.k = nn.Linear(cfg.hidden, cfg.hidden)
        self.v = nn.Linear(cfg.hidden, cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        return F.dropout(self.proj(y), self.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, cfg.ffn_size)
        self.proj = nn.Linear(cfg.ffn_size, cfg.hidden)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.proj(F.gelu(self.fc(x))), self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embed(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.tok(input_ids) + self.pos(positions)


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


class GPT(nn.Module):
    """Pre-LN decoder: ``embed`` (layer 0), ``blocks.0 .. blocks.{L-1}``, ``head`` (layer L+1).

    The LM head is untied from the token embedding so that pipeline stages own disjoint weights.
    ``forward(input_ids, labels)`` returns the mean next-token cross-entropy; labels are the
    targets already aligned with ``input_ids`` (the data loader shifts them).
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embed(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.head = Head(cfg)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 initialization: N(0, 0.02), residual projections scaled by 1/sqrt(2L)."""
        std = 0.02
        for name, p in self.named_parameters():
            if p.device.type == "meta":
                continue
            if p.dim() == 1:
                if name.endswith("weight"):
                    p.fill_(1.0)
                else:
                    p.zero_()
            elif name.endswith("proj.weight"):
                p.normal_(0.0, std / math.sqrt(2 * self.cfg.layers))
            else:
                p.normal_(0.0, std)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x, labels)


PRESETS: dict[str, GPTConfig] = {
    "gpt": GPTConfig(vocab=8192, seq_len=128, layers=4, hidden=256, heads=4),
    "gpt2": GPTConfig(vocab=50257, seq_len=1024, layers=12, hidden=768, heads=12),
    "gpt2-xl": GPTConfig(vocab=50257, seq_len=1024, layers=48, hidden=1600, heads=25),
    "gpt3-175b": GPTConfig(vocab=51200, seq_len=2048, layers=96, hidden=12288, heads=96),
}

SPEC_HELP = (
    "Model specs: 'gpt' (built-in GPT; sizes from --layers/--hidden/--heads/--ffn/--vocab), "
    "presets 'gpt2', 'gpt2-xl', 'gpt3-175b'; 'hf:gpt2', 'hf:llama', 'hf:bert' (needs the 'hf' "
    "extra: pip install 'planner[hf]'); or 'path/to/file.py:factory' where factory() returns "
    "(model, example_inputs)."
)


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
        """Random token inputs ``(input_ids, labels)`` of shape (batch, seq_len)."""
        if self.kind == "file":
            return self.example_inputs
        ids = torch.randint(0, self.vocab, (batch, seq_len + 1), generator=generator)
        return ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)


def parse_spec(spec: str) -> tuple[str, str]:
    """Split a spec into (kind, name): ('gpt', preset) | ('hf', arch) | ('file', 'path:fn')."""
    if not isinstance(spec, str) or not spec.strip():
        raise UserError("The model spec is empty. " + SPEC_HELP)
    spec = spec.strip()
    if spec in PRESETS:
        return "gpt", spec
    if spec.startswith("hf:"):
        return "hf", spec[3:]
    if ".py:" in spec:
        return "file", spec
    raise UserError(f"Unknown model spec {spec!r}. " + SPEC_HELP)


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
    sizes = {k: v for k, v in dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                                    ffn=ffn, vocab=vocab, seq_len=seq_len).items() if v is not None}
    if seed is not None:
        torch.manual_seed(seed)
    if kind == "gpt":
        if "kv_heads" in sizes and sizes["kv_heads"] != sizes.get("heads", PRESETS[name].heads):
            raise UserError("The built-in GPT has no grouped-query attention; drop --kv-heads "
                            "or use hf:llama.")
        cfg = replace(PRESETS[name], dropout=dropout,
                      **{k: v for k, v in sizes.items() if k != "kv_heads"})
        with torch.device(device):
            model = GPT(cfg)
        model = model.to(dtype)
        b = ModelBundle(spec, model, (), cfg.vocab, cfg.seq_len, cfg.hidden, cfg.heads, cfg.heads,
                        cfg.layers, "gpt", sizes)
    elif kind == "hf":
        from planner.hf import build_hf

        b = build_hf(name, sizes, device=device, dtype=dtype, dropout=dropout)
        b.spec = spec
    else:
        b = load_factory(spec, device=device)
    if kind != "file":
        s = b.seq_len if seq_len is None else seq_len
        b.example_inputs = b.make_inputs(batch, s, device=device)
    return b


_NAME_PART = __import__("re").compile(r"^[A-Za-z0-9_]+$")


def check_module_names(model: nn.Module, where: str) -> None:
    """Refuse module, parameter and buffer names that are not plain ``[A-Za-z0-9_]`` words.

    Names end up in code that torch.export and our compiler generate; a name with quotes,
    newlines or other punctuation could change that code, so it is an error, not rewritten.
    """
    names = [n for n, _ in model.named_modules() if n]
    names += [n for n, _ in model.named_parameters(remove_duplicate=False)]
    names += [n for n, _ in model.named_buffers(remove_duplicate=False)]
    for full in names:
        for part in full.split("."):
            if not _NAME_PART.match(part) or __import__("keyword").iskeyword(part):
                raise UserError(
                    f"{where}: the model has a submodule or parameter named {part!r} (in {full!r}); "
                    "names may contain only letters, digits and '_' and may not be Python keywords, so "
                    "that they are safe in generated code. Rename it (e.g. the key of an nn.ModuleDict).")


def load_factory(spec: str, device="cpu") -> ModelBundle:
    """Load ``path/to/file.py:factory``; the factory returns ``(model, example_inputs)``."""
    path, _, fn_name = spec.rpartition(":")
    if not os.path.isfile(path):
        raise UserError(f"Model file {path!r} does not exist (from spec {spec!r}).")
    if not fn_name.isidentifier():
        raise UserError(f"{fn_name!r} in spec {spec!r} is not a Python function name.")
    mod_name = "planner_user_model_" + str(abs(hash(os.path.abspath(path))))
    try:
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's file failed to import: report their error, not ours
        raise UserError(f"Importing {path} failed: {type(e).__name__}: {e}") from e
    factory: Callable | None = getattr(module, fn_name, None)
    if not callable(factory):
        raise UserError(f"{path} defines no function {fn_name!r}.")
    try:
        out = factory()
    except Exception as e:
        raise UserError(f"{path}:{fn_name}() raised {type(e).__name__}: {e}") from e
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], nn.Module)):
        raise UserError(f"{path}:{fn_name}() must return (model, example_inputs); got "
                        f"{type(out).__name__}.")
    model, inputs = out
    check_module_names(model, f"{path}:{fn_name}()")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise UserError(f"{path}:{fn_name}(): example_inputs must be a tensor or a tuple of tensors.")
    inputs = tuple(inputs)
    seq = inputs[0].shape[1] if inputs[0].dim() >= 2 else 1
    return ModelBundle(spec, model, inputs, vocab=0, seq_len=seq, kind="file")
