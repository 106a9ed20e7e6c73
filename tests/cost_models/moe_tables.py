"""Closed-form mixture-of-experts layer tables for the pricing and search tests.

``moe_table`` is ``tests.helpers.gpt_table`` with a Mixtral-style routed MLP added to every block,
written the way ``passes.moe`` and ``passes.autograd_costs`` fill a traced table: ``E`` experts of
gate + up (``h x 2f``) and down (``f x h``) as ``[E, ...]`` weights, each token routed to ``top_k``
of them, the products listed at the even share (``b s top_k / E`` rows per expert), their forward
FLOPs ``2 b s top_k 3 h f``, backward twice that (input and weight gradients).
"""

from __future__ import annotations

from passes.core import B, S
from passes.layer_table import Gemm, LayerTable
from tests.helpers import gpt_table

__all__ = ["moe_table", "expert_forward_flops"]


def expert_forward_flops(b: int, s: int, hidden: int, ffn: int, top_k: int) -> int:
    """Forward FLOPs of one MoE layer's routed products at the even share."""
    return 2 * b * s * top_k * 3 * hidden * ffn


def moe_table(
    layers: int = 4,
    hidden: int = 256,
    ffn: int = 512,
    experts: int = 8,
    top_k: int = 2,
    heads: int = 4,
    vocab: int = 8192,
    dtype_bytes: int = 2,
    shared_experts: int = 0,
) -> LayerTable:
    """A GPT table whose blocks also hold a routed MoE MLP (module docstring)."""
    table = gpt_table(layers=layers, hidden=hidden, heads=heads, vocab=vocab, dtype_bytes=dtype_bytes)
    h, f, e = hidden, ffn, experts
    rows = B * S * top_k / e  # token rows per expert at the even share
    fwd = [Gemm(rows, 2 * f, h, e, 1, None), Gemm(rows, h, f, e, 1, None)]
    bwd = [
        Gemm(rows, h, 2 * f, e, 1, None),  # input gradients
        Gemm(rows, f, h, e, 1, None),
        Gemm(h, 2 * f, rows, e, 1, None),  # weight gradients: contraction over the rows
        Gemm(f, h, rows, e, 1, None),
    ]
    flops = 2 * B * S * top_k * 3 * h * f
    params = e * 3 * h * f
    for row in table.layers[1:-1]:
        row.param_count += params
        row.param_bytes += params * dtype_bytes
        row.fwd_flops = row.fwd_flops + flops
        row.bwd_flops = row.bwd_flops + 2 * flops
        row.fwd_gemms = list(row.fwd_gemms) + fwd
        row.bwd_gemms = list(row.bwd_gemms) + bwd
        row.expert_fwd_gemms = list(fwd)
        row.expert_bwd_gemms = list(bwd)
        row.expert_param_count = params
        row.expert_dispatch_bytes = dtype_bytes * B * S * top_k * h
        row.expert_tokens = rows
        row.experts, row.top_k, row.moe_layers, row.shared_experts = e, top_k, 1, shared_experts
        row.largest_param = max(row.largest_param, e * 2 * h * f)
    table.model["moe"] = {
        "layers": list(range(1, layers + 1)),
        "experts": e,
        "top_k": top_k,
        "shared_experts": shared_experts,
    }
    table.model["params"] = sum(row.param_count for row in table.layers)
    return table
