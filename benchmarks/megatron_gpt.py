"""GPT as Megatron-LM ran it in 2021-2022: the built-in GPT with its attention core materialized.

The published runs ``bench_published.py`` compares against predate FlashAttention in Megatron-LM:
each block computes the ``b a s s`` scores with a batched product, then a fused
scale-mask-softmax kernel, dropout on the probabilities, and a second batched product (Narayanan
et al. 2021, Sec. 4.2; Korthikanti et al. 2022, Sec. 4 count these ``5 a s^2 b`` bytes of the
attention core). The built-in GPT calls ``scaled_dot_product_attention``, which the cost replay
prices as a flash kernel (no score tensor in memory). Pricing the published layouts with flash
attention would price a faster model than the one that ran, so this module rebuilds the block's
attention the way it ran; everything else is the built-in GPT (learned positions, GELU MLP of
``4 h``, LayerNorm, dropout 0.1 as in Megatron's defaults; its LM head is not tied to the embedding,
as Megatron's is, which adds ``V h`` parameters but no FLOPs).

The model is built on the meta device (no memory), as a ``ModelBundle`` of kind ``file`` that
``planner.frontend.model_analysis.build_layer_table`` traces with symbolic batch and sequence.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from planner.frontend.bundle import ModelBundle
from planner.frontend.gpt import GPT, Attention
from planner.frontend.spec import GPTConfig

__all__ = ["MaterializedAttention", "megatron_bundle"]


class MaterializedAttention(Attention):
    """The built-in attention with the core written out: scores, causal mask + softmax, dropout."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        query = self.q(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        key = self.k(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        value = self.v(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        scores = torch.matmul(query, key.transpose(-1, -2)) * (1.0 / math.sqrt(self.head_dim))
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
        probs = F.dropout(probs, self.dropout, self.training)
        attended = torch.matmul(probs, value).transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim)
        return F.dropout(self.proj(attended), self.dropout, self.training)


def megatron_bundle(layers: int, hidden: int, heads: int, vocab: int, seq_len: int) -> ModelBundle:
    """The Megatron-style GPT of these sizes on the meta device, ready for ``build_layer_table``."""
    cfg = GPTConfig(layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq_len=seq_len, dropout=0.1)
    with torch.device("meta"):
        model = GPT(cfg)
        for block in model.blocks:
            attention = MaterializedAttention(cfg)
            block.attn = attention
        ids = torch.zeros(2, seq_len, dtype=torch.long)
    spec = f"megatron-gpt-{layers}x{hidden}"
    return ModelBundle(
        spec,
        model,
        (ids, ids.clone()),
        vocab,
        seq_len,
        hidden=hidden,
        heads=heads,
        kv_heads=heads,
        layers=layers,
        kind="file",
    )
