"""Careless HF configurations at the CLI: exit 2 with one message that names the real mistake
(transformers' own validation, whatever exception type it raises) and how to fix it, no traceback."""

from __future__ import annotations

import json
import os

import pytest

from planner.cli import main

transformers = pytest.importorskip("transformers")


def _plan(spec: str, capsys, *extra: str) -> tuple[int, str]:
    rc = main(
        ["plan", "--model", spec, "--gpus", "1", "--hardware", "cpu", "--global-batch", "2", "--seq-len", "8"]
        + ["--dtype", "fp32", "--out", os.devnull, "--json", *extra]
    )
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


def test_builtin_sizes_transformers_refuses_exit_2(capsys):
    """``hf:llama`` with a hidden size its heads do not divide: transformers' strict-dataclass
    validation (huggingface_hub's own error type wrapping a ValueError) is reported as its cause."""
    rc, err = _plan("hf:llama", capsys, "--layers", "2", "--hidden", "65", "--heads", "4", "--vocab", "256")
    assert rc == 2
    assert "hidden size (65) is not a multiple of the number of attention heads (4)" in err
    assert "StrictDataclass" not in err and "--hidden 65" in err
    assert len(err.strip().splitlines()) == 1


def test_a_known_model_type_with_a_bad_value_names_the_value(tmp_path, capsys):
    """gemma3n_text is known to transformers: its config's real error is reported, not an unknown
    model_type and an upgrade."""
    cfg = transformers.Gemma3nTextConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=64
    )
    cfg.save_pretrained(str(tmp_path))
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    # two layers, but activation_sparsity_pattern keeps one value per default layer (35)
    data.update(num_hidden_layers=2, intermediate_size=64, layer_types=data["layer_types"][:2])
    path.write_text(json.dumps(data))
    rc, err = _plan(f"hf:{tmp_path}", capsys)
    assert rc == 2
    assert "activation_sparsity_pattern" in err and "gemma3n_text" in err
    assert "unknown" not in err and "upgrade" not in err


@pytest.mark.parametrize(
    "make, example",
    [
        (
            lambda: transformers.DistilBertConfig(
                dim=32, hidden_dim=64, n_layers=2, n_heads=4, vocab_size=64, max_position_embeddings=64
            ),
            "DistilBertForMaskedLM",
        ),
        (
            lambda: transformers.ModernBertConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                vocab_size=64,
                max_position_embeddings=64,
            ),
            "ModernBertForMaskedLM",
        ),
    ],
)
def test_an_encoder_without_architectures_is_told_its_masked_lm_class(tmp_path, capsys, make, example):
    make().save_pretrained(str(tmp_path))
    assert not json.loads((tmp_path / "config.json").read_text()).get("architectures")
    rc, err = _plan(f"hf:{tmp_path}", capsys)
    assert rc == 2 and f'"architectures": ["{example}"]' in err and "LlamaForCausalLM" not in err
    data = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**data, "architectures": [example]}))
    assert _plan(f"hf:{tmp_path}", capsys)[0] == 0  # the advice works


#: The sizes of the tiny mixtures below (one block).
TINY_MOE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
)


def test_a_mixture_routing_to_more_experts_than_it_has_is_named(tmp_path, capsys):
    """An edited MoE config whose top-k exceeds its experts: the config's two fields, not a
    failure deep in the router's ``topk`` while tracing."""
    transformers.MixtralConfig(**TINY_MOE, num_local_experts=4, num_experts_per_tok=6).save_pretrained(str(tmp_path))
    rc, err = _plan(f"hf:{tmp_path}", capsys)
    assert rc == 2
    assert "num_experts_per_tok = 6 experts, more than the 4 a layer has (num_local_experts)" in err
    # one expert is no mixture (Jamba builds a plain MLP): nothing to refuse
    one = tmp_path / "jamba"
    transformers.JambaConfig(
        **TINY_MOE, num_experts=1, num_experts_per_tok=2, attn_layer_period=1, attn_layer_offset=0
    ).save_pretrained(str(one))
    assert _plan(f"hf:{one}", capsys)[0] == 0


BAD_MODEL = """
import torch
from torch import nn


class TopTooMany(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 8)

    def forward(self, ids):
        return torch.topk(self.embed(ids), 9, dim=-1).values.sum()  # 9 of 8 features


def factory():
    return TopTooMany(), (torch.zeros(2, 8, dtype=torch.long),)
"""


def test_a_trace_that_fails_in_a_kernel_prints_the_reason_not_torchs_log(tmp_path, capfd):
    """torch logs a meta kernel's failure whole (a traceback per line) before raising it: the
    CLI prints its one explained error only, whatever stream the log handler holds."""
    model = tmp_path / "bad_model.py"
    model.write_text(BAD_MODEL)
    rc = main(
        ["plan", "--model", f"{model}:factory", "--gpus", "1", "--hardware", "cpu", "--global-batch", "2"]
        + ["--seq-len", "8", "--dtype", "fp32", "--out", os.devnull, "--json"]
    )
    err = capfd.readouterr().err
    assert rc == 2 and "Cannot trace" in err and "k not in range" in err
    assert "Traceback" not in err and "fake_tensor" not in err, err[:2000]


def test_a_config_whose_own_forward_fails_is_not_blamed_on_the_trace(tmp_path, capsys):
    """DeepSeek-V3 with ``head_dim`` set apart from its rotary width (16 against 8): transformers
    builds it, and its forward fails at the rotary product whether traced or not. The message
    says so and points at the config's sizes, not at making forward() traceable."""
    transformers.DeepseekV3Config(
        num_hidden_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=64,
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        head_dim=16,
        vocab_size=64,
        n_group=1,
        topk_group=1,
    ).save_pretrained(str(tmp_path))
    rc, err = _plan(f"hf:{tmp_path}", capsys)
    assert rc == 2
    assert "forward() fails on the example input even when run without tracing" in err
    assert "sizes agree" in err and "modeling_deepseek_v3.py" in err
    assert "Make forward() traceable" not in err


def test_a_rotary_embedding_wider_than_a_head_names_the_flag(tmp_path, capsys):
    """GPT-J rotates ``rotary_dim`` features of each head: ``--heads`` that narrow a head below it
    are named, with the sizes, before any trace; the config's own heads plan."""
    transformers.GPTJConfig(
        n_embd=64, n_head=2, rotary_dim=16, n_layer=1, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0
    ).save_pretrained(str(tmp_path))
    rc, err = _plan(f"hf:{tmp_path}", capsys, "--heads", "8")
    assert rc == 2
    assert "rotary_dim 16 is wider than a head (64 / 8 heads = 8 features) under --heads 8" in err
    assert _plan(f"hf:{tmp_path}", capsys)[0] == 0
