"""Mixture-of-experts costs: the experts' grouped products are matmul work (``passes.autograd_costs``)."""

from __future__ import annotations

import pytest

from passes.core import B, S
from planner.frontend.frontend_errors import ModelError
from planner.frontend.model_analysis import build_layer_table
from tests.moe_configs import moe_configs

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


def test_models_without_token_ids_are_refused_clearly(tmp_path):
    """A vision model (no vocabulary at all) and a multimodal wrapper (its vocabulary in
    text_config) are refused before anything is built, the latter naming its language model."""
    tf.ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2).save_pretrained(
        tmp_path / "vit"
    )
    tf.Gemma3Config().save_pretrained(tmp_path / "gemma3")
    with pytest.raises(ModelError, match="'vit' reads no token ids"):
        build_layer_table(f"hf:{tmp_path / 'vit'}", batch=1, seq_len=8, dtype="fp32")
    with pytest.raises(ModelError, match="multimodal model .* model_type 'gemma3_text'") as refused:
        build_layer_table(f"hf:{tmp_path / 'gemma3'}", batch=1, seq_len=8, dtype="fp32")
    # the message's command writes the language model's config, which plans as a causal LM
    assert f".text_config.save_pretrained('{tmp_path / 'gemma3'}-text')" in str(refused.value)
    text = tf.AutoConfig.from_pretrained(tmp_path / "gemma3").text_config
    assert text.model_type == "gemma3_text" and text.vocab_size > 0


# ---------------------------------------------------------------------------------------------
# passes.moe: the facts pricing reads, per layer-table row
# ---------------------------------------------------------------------------------------------
TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=96,
    max_position_embeddings=64,
)
MOE_CONFIGS = {arch: build for arch, build in moe_configs(tf, TINY, deepseek_shared=2).items() if arch != "gpt_oss"}
#: experts, top_k, MoE rows, shared experts, routed expert's (gate + up + down) width
MOE_EXPECT = {
    "mixtral": (4, 2, [1, 2], 0, 64),
    "qwen2_moe": (4, 2, [1, 2], 1, 32),
    "qwen3_moe": (8, 3, [1, 2], 0, 32),
    "deepseek_v3": (4, 2, [2], 2, 32),  # one dense block first; two shared experts' worth of width
}


@pytest.mark.parametrize("arch", list(MOE_CONFIGS))
def test_moe_facts_per_row(arch, tmp_path):
    """Routed expert parameters (exactly E x 3 h f), experts, top_k, shared experts, the dispatch
    bytes (tokens x top_k x h x 4 bytes in fp32), rows per expert, and the expert products listed
    apart with the FLOPs of the routed MLPs at the even share (forward 2 x tokens x top_k x 3 h f,
    backward twice that): all of them still inside the row's FLOPs."""
    MOE_CONFIGS[arch]().save_pretrained(tmp_path / arch)
    table = build_layer_table(f"hf:{tmp_path / arch}", batch=1, seq_len=16, dtype="fp32")
    experts, top_k, rows, shared, ffn = MOE_EXPECT[arch]
    h, at = 32, {B: 2, S: 16}
    tokens = 2 * 16
    assert table.model["moe"] == {"layers": rows, "experts": experts, "top_k": top_k, "shared_experts": shared}
    for row in table.layers:
        if row.index not in rows:
            assert (row.experts, row.expert_param_count, row.expert_fwd_gemms) == (0, 0, [])
            continue
        assert (row.experts, row.top_k, row.moe_layers, row.shared_experts) == (experts, top_k, 1, shared)
        assert row.expert_param_count == experts * 3 * h * ffn
        assert int(row.expert_dispatch_bytes.subs(at)) == tokens * top_k * h * 4
        assert int(row.expert_tokens.subs(at)) == tokens * top_k // experts
        fwd = sum(int(g.flops.subs(at)) for g in row.expert_fwd_gemms)
        bwd = sum(int(g.flops.subs(at)) for g in row.expert_bwd_gemms)
        assert fwd == 2 * tokens * top_k * 3 * h * ffn and bwd == 2 * fwd
        assert int(row.fwd_flops.subs(at)) > fwd
    # and it plans: experts sharded over 2 of the 4 data-parallel ranks when pinned
    from cost_models.hardware import load_hardware
    from planner.search.request import PlanRequest
    from planner.search.solve import solve

    request = PlanRequest(
        spec=f"hf:{tmp_path / arch}", gpus=4, gpus_per_node=4, hardware="h100-sxm", global_batch=8, seq_len=16, ep=2
    )
    plan = solve(request, table, load_hardware("h100-sxm", 4)).plan
    assert plan.expert_parallel == 2 and plan.dp % 2 == 0 and plan.predicted.time["ep_comm"] > 0
    assert plan.model.moe == {**table.model["moe"], "capacity_factor": None}


def test_gpt_oss_experts_and_their_bias_are_routed(tmp_path):
    """GPT-OSS gathers a per-expert bias by expert id between its products: the bias is cut with
    the experts, so its parameters count among the row's routed ones."""
    tf.GptOssConfig(num_local_experts=4, num_experts_per_tok=2, head_dim=8, **TINY).save_pretrained(tmp_path / "oss")
    table = build_layer_table(f"hf:{tmp_path / 'oss'}", batch=1, seq_len=16, dtype="fp32")
    routed = [row for row in table.layers if row.experts]
    assert len(routed) == TINY["num_hidden_layers"] and all((row.experts, row.top_k) == (4, 2) for row in routed)
    hidden, ffn = TINY["hidden_size"], TINY["intermediate_size"]
    # gate_up [E, h, 2f] + its bias [E, 2f] + down [E, f, h]; down's bias (added after the combine) stays dense
    assert all(row.expert_param_count == 4 * (hidden * 2 * ffn + 2 * ffn + ffn * hidden) for row in routed)
    assert "reason" not in table.model["moe"]


def test_experts_computing_every_token_stay_replicated_and_say_why(tmp_path):
    """transformers' Llama-4 layer repeats the tokens once per expert and runs one batched product
    over all of them (the router's scores zero the unchosen): nothing to route, and the table says
    that every token goes through every expert."""
    tf.Llama4TextConfig(
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        intermediate_size_mlp=64,
        head_dim=8,
        **TINY,
    ).save_pretrained(tmp_path / "llama4")
    table = build_layer_table(f"hf:{tmp_path / 'llama4'}", batch=1, seq_len=16, dtype="fp32")
    assert all(row.experts == 0 for row in table.layers)
    assert set(table.model["moe"]) == {"reason"}
    assert "layers.1.feed_forward.experts) run every token through all 4 of them" in table.model["moe"]["reason"]
    # a request that does not fit says so beside the memory it needs: those experts are why
    import dataclasses

    from cost_models.hardware import load_hardware
    from planner.search.request import PlanRequest
    from planner.search.search_errors import NoFeasiblePlan
    from planner.search.solve import solve

    spec = f"hf:{tmp_path / 'llama4'}"
    request = PlanRequest(spec=spec, gpus=2, gpus_per_node=2, hardware="cpu", global_batch=4, seq_len=16, dtype="fp32")
    tiny = dataclasses.replace(load_hardware("cpu", 2), memory_bytes=2**14, host_memory_bytes=2**14)
    with pytest.raises(
        NoFeasiblePlan, match=r"No expert parallelism: the experts \(.*\) run every token through all 4"
    ):
        solve(request, table, tiny).plan


def test_experts_in_a_python_loop_stay_replicated_and_say_why():
    """Experts as a ModuleList run one by one have no grouped product to cut: every rank keeps
    them, the table says why, and ``--ep`` is refused naming it."""
    from pathlib import Path

    from cost_models.hardware import load_hardware
    from planner.search.request import PlanRequest
    from planner.search.search_errors import SearchError
    from planner.search.solve import solve

    spec = f"{Path(__file__).parents[1] / 'fixtures' / 'moe_models.py'}:looped_experts"
    table = build_layer_table(spec, batch=2, seq_len=8, dtype="fp32")
    assert all(row.experts == 0 for row in table.layers)
    assert "ModuleList of MLPs the graph runs one by one" in table.model["moe"]["reason"]
    request = dict(spec=spec, gpus=2, gpus_per_node=2, hardware="cpu", global_batch=4, seq_len=8, dtype="fp32")
    with pytest.raises(SearchError, match="no routed experts the planner can shard .*ModuleList"):
        solve(PlanRequest(**request, ep=2), table, load_hardware("cpu", 2))
    solution = solve(PlanRequest(**request), table, load_hardware("cpu", 2))
    assert solution.plan.model.moe == {} and solution.plan.expert_parallel == 1
    assert any("experts replicated" in note for note in solution.search.notes)
