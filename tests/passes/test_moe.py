"""Mixture-of-experts costs: the experts' grouped products are matmul work (``passes.autograd_costs``)."""

from __future__ import annotations

import pytest

from passes.core import B, S
from planner.frontend.frontend_errors import ModelError
from planner.frontend.model_analysis import build_layer_table

tf = pytest.importorskip("transformers")

SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=128,
)


def test_expert_products_count_top_k_mlps_and_the_router(tmp_path):
    """A Mixtral block (4 experts, top 2) does the work of a Mistral block of the same sizes plus
    one more MLP (gate, up and down: 3 products of h x ffn per token) and the router (h x E):
    exactly, forward and backward (twice the forward)."""
    tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **SIZES).save_pretrained(tmp_path / "moe")
    # no window on either (Mistral's default is 4096, Mixtral's none): the same causal attention,
    # both lowered to is_causal and priced at its density
    tf.MistralConfig(**{"sliding_window": None, **SIZES}).save_pretrained(tmp_path / "dense")
    moe, dense = (
        build_layer_table(f"hf:{tmp_path / d}", batch=1, seq_len=32, dtype="fp32").layers[1] for d in ("moe", "dense")
    )
    at = {B: 2, S: 32}
    tokens = 2 * 32
    assert int((moe.fwd_flops - dense.fwd_flops).subs(at)) == tokens * (2 * 3 * 64 * 128 + 2 * 64 * 4)
    assert int((moe.bwd_flops - dense.bwd_flops).subs(at)) == 2 * int((moe.fwd_flops - dense.fwd_flops).subs(at))


def test_encoder_decoder_is_refused_clearly(tmp_path):
    tf.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, vocab_size=64).save_pretrained(tmp_path / "t5")
    with pytest.raises(ModelError, match="encoder-decoder model"):
        build_layer_table(f"hf:{tmp_path / 't5'}", batch=1, seq_len=8, dtype="fp32")
