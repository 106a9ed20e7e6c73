"""The tiny mixture-of-experts configurations the MoE tests share, one builder per architecture.

Each test file picks its sizes (``sizes``: hidden, layers, heads, vocab ...) and gets every
architecture at them, so the five files that read, rewrite, plan and train MoE models test the
same routing shapes: Mixtral (4 experts, top 2), Qwen2-MoE (4, top 2, one shared expert),
Qwen3-MoE (8, top 3, q/k norms), DeepSeek-V3 (4, top 2, grouped routing, multi-head latent
attention, one dense block first) and GPT-OSS (4, top 2: its expert bias is gathered by expert
id, cut with the experts).
"""

from __future__ import annotations

from typing import Any, Callable


def moe_configs(tf: Any, sizes: dict, *, deepseek_shared: int = 1) -> dict[str, Callable[[], Any]]:
    """Architecture name -> a function building its config at ``sizes`` (``tf`` is transformers,
    imported by the caller with ``pytest.importorskip``). ``sizes`` must name ``num_key_value_heads``
    (DeepSeek-V3 overrides it: transformers' latent attention repeats no key/value heads)."""
    return {
        "mixtral": lambda: tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **sizes),
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64, **sizes
        ),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(
            num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, head_dim=8, **sizes
        ),
        "deepseek_v3": lambda: tf.DeepseekV3Config(
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=deepseek_shared,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            **{**sizes, "num_key_value_heads": sizes["num_attention_heads"]},
        ),
        "gpt_oss": lambda: tf.GptOssConfig(num_local_experts=4, num_experts_per_tok=2, head_dim=8, **sizes),
    }
