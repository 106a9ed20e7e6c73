"""Tensor parallelism the model's structure allows: heads read from the graph, key/value heads
replicated at a tp that is a multiple of them, and a model nothing of which splits planned without
tp (an explicit ``--tp`` pin is refused naming the node)."""

from __future__ import annotations

import json
import os
import re
from types import SimpleNamespace

import pytest

from planner.cli import main
from planner.search.candidates import tp_structure
from tests.helpers import TESTS

TP_MODELS = os.path.join(TESTS, "fixtures", "tp_models.py")
HF_ARCHS = os.path.join(TESTS, "fixtures", "hf_archs.py")


def _nt(**model):
    return SimpleNamespace(model=model)


@pytest.mark.parametrize(
    "model,tp,why",
    [
        ({"heads": 4, "kv_heads": 2}, 2, None),
        ({"heads": 4, "kv_heads": 2}, 4, None),  # each kv head on 2 ranks
        ({"heads": 4, "kv_heads": 1}, 2, None),  # Gemma's one kv head, replicated
        ({"heads": 6, "kv_heads": 4}, 3, "neither divides the model's 4 key/value heads"),
        ({"heads": 3}, 2, "does not divide the model's 3 attention heads"),
        ({}, 2, None),  # no attention: the matmul analysis decides
        (
            {"heads": 4, "tp_divides": {"64": "node 'linear_3'", "30": "node 'linear_7' (aten.linear.default)"}},
            4,
            "does not divide the 30 output features of node 'linear_7'",
        ),
        ({"heads": 4, "tp_blocked": "no matmul can be split: x at node 'ln'"}, 2, "cannot split this model: no matmul"),
        ({"heads": 4, "tp_blocked": "anything"}, 1, None),
    ],
)
def test_tp_structure(model, tp, why):
    got = tp_structure(tp, _nt(**model))
    assert got is None if why is None else why in got


def _plan(tmp_path, spec, *extra):
    out = tmp_path / "p.json"
    rc = main(
        [
            "plan",
            "--model",
            spec,
            "--seq-len",
            "16",
            "--gpus",
            "2",
            "--global-batch",
            "4",
            "--hardware",
            "cpu",
            "--dtype",
            "fp32",
            "--out",
            str(out),
            *extra,
        ]
    )
    return rc, (json.loads(out.read_text()) if rc == 0 else None)


def test_unsplittable_model_is_planned_without_tp_and_a_pin_names_the_node(tmp_path, capsys):
    rc, plan = _plan(tmp_path, f"{TP_MODELS}:unsplittable", "--pp", "1")
    assert rc == 0 and plan["tp"] == 1 and plan["dp"] == 2
    rc, _ = _plan(tmp_path, f"{TP_MODELS}:unsplittable", "--tp", "2")
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "cannot split this model" in err and "'layer_norm'" in err and "tp_models.py:" in err


def test_file_model_heads_come_from_the_graph(tmp_path):
    rc, plan = _plan(tmp_path, f"{HF_ARCHS}:gemma", "--tp", "2")  # 4 heads of 16, one kv head
    assert rc == 0 and plan["tp"] == 2


def test_a_plan_under_tp_names_what_tp_keeps_whole(tmp_path, capsys):
    """Bloom merges its heads with the batch before its batched matmuls, which tensor parallelism
    cannot cut by heads: its attention stays whole on every rank while the MLP splits, and a plan
    under ``--tp`` says so, naming the modules as the model does and the source line."""
    import transformers

    config = transformers.BloomConfig(vocab_size=96, hidden_size=32, n_layer=2, n_head=4)
    config.architectures = ["BloomForCausalLM"]
    config.save_pretrained(tmp_path / "bloom")
    rc, plan = _plan(tmp_path, f"hf:{tmp_path / 'bloom'}", "--tp", "2")
    out = capsys.readouterr().out
    assert rc == 0 and plan["tp"] == 2
    note = " ".join(out[out.index("tensor parallelism keeps") :].split())
    share = re.match(r"tensor parallelism keeps (\d+)% of a block's weights whole on every rank, ", note)
    assert share and 33 <= int(share[1]) <= 36  # attention's 4 h^2 of 12 h^2, with its biases and the norms
    assert "transformer.h.*.self_attention.query_key_value" in note
    assert "interleaves the sharded dim" in note and "modeling_bloom.py:" in note and "inner." not in note
    rc, plan = _plan(tmp_path, f"{HF_ARCHS}:llama", "--tp", "2")  # split whole: nothing to say
    assert rc == 0 and "tensor parallelism keeps" not in capsys.readouterr().out


def test_the_whole_share_leaves_routed_experts_to_expert_parallelism(tmp_path, capsys):
    """DeepSeek-V3's experts stay whole under tp (expert parallelism splits them) and its latent
    attention keeps two low-rank projections whole: the note's share counts those projections
    against the rest of the block, the experts aside, not the experts as weights tp left whole."""
    import transformers

    from tests.moe_configs import moe_configs

    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    sizes.update(num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)
    moe_configs(transformers, sizes)["deepseek_v3"]().save_pretrained(tmp_path / "deepseek")
    rc, plan = _plan(tmp_path, f"hf:{tmp_path / 'deepseek'}", "--tp", "2")
    out = capsys.readouterr().out
    assert rc == 0 and plan["tp"] == 2
    note = " ".join(out[out.index("tensor parallelism keeps") :].split())
    share = re.match(r"tensor parallelism keeps (\d+)% of a block's weights \(its routed experts aside", note)
    assert share and 5 <= int(share[1]) <= 50, note
    assert "self_attn.q_a_proj" in note and "kv_a_proj_with_mqa" in note and ".experts." not in note
