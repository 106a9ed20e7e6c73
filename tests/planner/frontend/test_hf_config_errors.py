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
