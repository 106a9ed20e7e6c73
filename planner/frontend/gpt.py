"""The built-in GPT: a pre-LayerNorm decoder with learned positions, and its size presets
(``GPTConfig`` and ``PRESETS`` live in the torch-free ``planner.frontend.spec``).

``forward(input_ids, labels)`` returns the scalar training loss, so a traced graph ends in a
scalar. ``planner.frontend.zoo.build_model`` builds it from a spec and size flags.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from planner.frontend.spec import PRESETS, GPTConfig

__all__ = ["GPTConfig", "GPT", "PRESETS"]


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
        batch, seq, _ = x.shape
        query = self.q(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        key = self.k(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        value = self.v(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        attended = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        attended = attended.transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim)
        return F.dropout(self.proj(attended), self.dropout, self.training)


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
        for name, param in self.named_parameters():
            if param.device.type == "meta":
                continue
            if param.dim() == 1:
                if name.endswith("weight"):
                    param.fill_(1.0)
                else:
                    param.zero_()
            elif name.endswith("proj.weight"):
                param.normal_(0.0, std / math.sqrt(2 * self.cfg.layers))
            else:
                param.normal_(0.0, std)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x, labels)
