"""Attention by its mask (``passes.mask_density``, ``passes.mask_kind``): densities against a brute
count, masks named from real graphs (the built-in GPT's ``is_causal``, HF Llama's materialized
causal mask lowered to ``is_causal``, an eager Mistral's window smaller than the sequence, Qwen2's mixed sliding/full blocks, a mask
read from a buffer), FLOPs priced at the density only where the kernel skips, and plan.json's
``model.attention``."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
import sympy
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from passes.causal_rewrite import REWRITTEN
from passes.common import B, S
from passes.mask_density import density, kept_pairs, summarize
from passes.mask_kind import classify

HYP = settings(max_examples=60, deadline=None)


def _brute(s: int, window: int | None) -> torch.Tensor:
    i = torch.arange(s)[:, None]
    j = torch.arange(s)[None, :]
    keep = j <= i
    return keep & (i - j < window) if window is not None else keep


@HYP
@given(s=st.integers(1, 160), w=st.integers(1, 200))
def test_sliding_and_causal_pairs_match_a_brute_count(s, w):
    assert kept_pairs("sliding", s, w) == int(_brute(s, w).sum())
    assert kept_pairs("causal", s) == int(_brute(s, None).sum())
    assert density("sliding", s, w) == pytest.approx(int(_brute(s, w).sum()) / s**2, rel=1e-12)
    # the symbolic form (the layer table's) agrees at this s
    assert float(density("sliding", S, w).subs(S, s)) == pytest.approx(density("sliding", s, w), rel=1e-12)
    assert density("causal", s) == pytest.approx((s + 1) / (2 * s), rel=1e-12)


@HYP
@given(s=st.integers(2, 96), w=st.integers(1, 120))
def test_classify_names_the_matrix(s, w):
    band = _brute(s, w)
    got = classify(band)
    if w >= s:
        assert (got.kind, got.window) == ("causal", None)
    else:
        assert (got.kind, got.window) == ("sliding", w)
    assert classify(torch.ones(s, s, dtype=torch.bool)).kind == "full"
    odd = _brute(s, None).clone()
    odd[-1, s // 2] = False  # a hole inside the band: no pattern explains it
    got = classify(odd)
    assert got.kind == "custom" and not got.skips and f"s={s}" in got.reason


def _table(spec: str, **kw):
    from planner.frontend.model_analysis import build_layer_table

    return build_layer_table(spec, seq_len=32, **kw)


def _hf_dir(tmp_path, name: str, cfg) -> str:
    path = os.path.join(tmp_path, name)
    cfg.save_pretrained(path)
    return "hf:" + path


def test_masks_read_from_real_graphs(tmp_path, monkeypatch):
    monkeypatch.setenv("PLANNER_CACHE", "off")
    import transformers as tf

    small = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    small["max_position_embeddings"] = 256

    # the built-in GPT: is_causal, priced at (s + 1) / 2s exactly: 4 b H D s (s + 1) / 2 forward
    gpt = _table("gpt", layers=2, hidden=64, heads=4, ffn=128, vocab=256)
    att = gpt.model["attention"]
    assert (att["mask"], att["window"], att["skips"]) == ("causal", None, True)
    core = gpt.layers[1].core_fwd_flops
    assert sympy.expand(core - 4 * B * 4 * 16 * S * (S + 1) / 2) == 0

    # HF Llama: a materialized causal mask, lowered to is_causal (passes.causal_rewrite): priced
    # at the density like the GPT, and the reason says why
    llama = _table("hf:llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256)
    att = llama.model["attention"]
    assert (att["mask"], att["skips"]) == ("causal", True) and att["reason"] == REWRITTEN
    assert sympy.expand(llama.layers[1].core_fwd_flops - 4 * B * 4 * 16 * S * (S + 1) / 2) == 0

    # Mistral with eager attention, window 8 < the probe: a band read from the graph (the additive
    # mask before the softmax); eager attention computes the whole square, so priced full
    src = tmp_path / "eager_mistral.py"
    src.write_text(EAGER_MISTRAL)
    mistral = _table(f"{src}:factory")
    att = mistral.model["attention"]
    assert (att["mask"], att["window"], att["skips"]) == ("sliding", 8, False) and "eager" in att["reason"]
    assert [row[:2] for row in att["layers"]] == [["sliding", 8], ["sliding", 8]]

    # Qwen2: the first 2 of 4 blocks full, the rest sliding with window 100 (> the 64 probe)
    qcfg = tf.Qwen2Config(
        num_hidden_layers=4, use_sliding_window=True, sliding_window=100, max_window_layers=2, **small
    )
    qwen = _table(_hf_dir(tmp_path, "qwen2", qcfg))
    att = qwen.model["attention"]
    assert [row[:2] for row in att["layers"]] == [
        ["causal", None],
        ["causal", None],
        ["sliding", 100],
        ["sliding", 100],
    ]
    summary = summarize(att, 400, 4, 8, 2)
    want = [(401 / 800)] * 2 + [kept_pairs("sliding", 400, 100) / 400**2] * 2
    assert [p["density"] for p in summary["per_layer"]] == pytest.approx(want)
    assert summary["density"] == pytest.approx(sum(want) / 4)
    assert summary["saved_flops"] == pytest.approx(12 * 4 * 8 * 400**2 * sum(1 - d for d in want) * 2)

    # a mask read from a buffer (GPT-2's old ``bias`` triangle): unread, priced full, with the reason
    src = tmp_path / "buffer_mask.py"
    src.write_text(BUFFER_MASK_MODEL)
    custom = _table(f"{src}:factory")
    att = custom.model["attention"]
    assert att["mask"] == "custom" and not att["skips"] and "buffer" in att["reason"]


def test_sink_attention_reads_its_masks(tmp_path, monkeypatch):
    """gpt-oss runs eager attention with a sink logit per head concatenated to the masked scores:
    it is found, with its layers' sliding and causal masks read through the concatenation
    (plan.json's ``model.attention`` was empty; Gemma 2's soft-capped scores, found by the same
    pass, are checked on a hand-written core in ``tests/passes/test_attention.py``)."""
    monkeypatch.setenv("PLANNER_CACHE", "off")
    import transformers as tf

    small = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=128)
    small.update(num_hidden_layers=2, max_position_embeddings=256, sliding_window=8)
    oss = tf.GptOssConfig(
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        architectures=["GptOssForCausalLM"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **small,
    )
    att = _table(_hf_dir(tmp_path, "gpt_oss", oss)).model["attention"]
    assert [row[:2] for row in att["layers"]] == [["sliding", 8], ["causal", None]]
    assert not att["skips"] and "eager" in att["reason"]


EAGER_MISTRAL = textwrap.dedent(
    """
    import torch
    import transformers as tf

    from planner.frontend.hf import HFLossModel


    def factory():
        cfg = tf.MistralConfig(
            num_hidden_layers=2, sliding_window=8, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
        )
        cfg._attn_implementation = "eager"
        tokens = torch.zeros(2, 32, dtype=torch.long)
        return HFLossModel(tf.MistralForCausalLM(cfg)), (tokens, tokens)
    """
)

BUFFER_MASK_MODEL = textwrap.dedent(
    """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(32, 96)
            self.register_buffer("bias", torch.ones(16, 16, dtype=torch.bool).tril())

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, 4, 8).permute(2, 0, 3, 1, 4)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias[:s, :s])
            return x + out.transpose(1, 2).reshape(b, s, 32)


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(64, 32)
            self.blocks = nn.ModuleList([Block(), Block()])
            self.head = nn.Linear(32, 64)

        def forward(self, tokens, targets):
            x = self.emb(tokens)
            for block in self.blocks:
                x = block(x)
            return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


    def factory():
        tokens = torch.zeros(2, 16, dtype=torch.long)
        return Model(), (tokens, tokens)
    """
)


def test_plan_json_attention_and_report_line(capsys, tmp_path):
    from planner.cli import main

    args = "plan --model gpt --layers 2 --hidden 64 --heads 4 --ffn 128 --vocab 256 --gpus 1 --gpus-per-node 1"
    code = main(
        (args + " --hardware cpu --global-batch 4 --seq-len 64 --json").split() + ["--out", str(tmp_path / "p.json")]
    )
    assert code in (0, None)
    plan = json.loads(capsys.readouterr().out)
    att = plan["model"]["attention"]
    assert {"mask", "window", "density"} <= set(att)
    assert (att["mask"], att["window"], att["priced"]) == ("causal", None, True)
    assert att["density"] == pytest.approx(65 / 128)
    # flops_per_step counts the attention at the priced density: 2 blocks x (fwd 4 + bwd 8) H D pairs
    assert att["saved_flops"] == pytest.approx(12 * 4 * 16 * 64 * 64 * (1 - 65 / 128) * 2 * 4)
    from planner.plan import Plan
    from planner.report.render import attention_line

    what, saves = attention_line(Plan.from_dict(plan))
    assert what == "causal, density 0.508" and saves.startswith("saves ") and saves.endswith(" vs full")
    # HF's explicit causal mask lowered to is_causal: priced, and the row says how
    plan["model"]["attention"] = summarize(
        {"mask": "causal", "window": None, "skips": True, "reason": REWRITTEN, "layers": [["causal", None]] * 2},
        64,
        4,
        16,
        4,
    )
    what, saves = attention_line(Plan.from_dict(plan))
    assert saves.startswith("saves ") and saves.endswith(f" per step vs full ({REWRITTEN})")
    # a sliding window the kernel does not skip: priced full, the row says why and what it would save
    plan["model"]["attention"] = summarize(
        {
            "mask": "sliding",
            "window": 16,
            "skips": False,
            "reason": "an explicit mask tensor",
            "layers": [["sliding", 16]] * 2,
        },
        64,
        4,
        16,
        4,
    )
    what, saves = attention_line(Plan.from_dict(plan))
    assert what == f"sliding window 16, density {kept_pairs('sliding', 64, 16) / 64**2:.3g}"
    assert saves.startswith("priced full (an explicit mask tensor); a kernel that skips would save ")


@HYP
@given(
    s=st.integers(1, 200),
    block=st.integers(1, 12),
    local=st.integers(1, 6),
    glob=st.integers(0, 4),
)
def test_block_sparse_pairs_match_a_brute_count(s, block, local, glob):
    """Closed form (a whole number of blocks, numeric and symbolic) and the query-by-query count
    (any length) against the layout's own mask, the one the runtime applies."""
    from runtime.sparse_attention import BlockSparseLayout

    positions = torch.arange(s)
    brute = int(BlockSparseLayout(block, local, glob).visible(positions, positions).sum())
    layout = (block, local, glob)
    assert kept_pairs("block-sparse", s, layout=layout) == brute
    if s % block == 0:
        assert int(kept_pairs("block-sparse", S, layout=layout).subs(S, s)) == brute
    assert density("block-sparse", s, layout=layout) == pytest.approx(brute / s**2, rel=1e-12)


def test_block_sparse_needs_a_layout():
    with pytest.raises(ValueError, match="needs a layout"):
        kept_pairs("block-sparse", 64)


def test_block_sparse_core_is_named_and_priced_by_its_layout():
    """The example model's cores are the runtime's operator: named block-sparse with their layout,
    priced at the layout's density (forward 4 and backward 8 H D pairs per kept pair and layer)."""
    from tests.helpers import TESTS

    spec = os.path.join(TESTS, "fixtures", "block_sparse_lm.py") + ":factory"
    table = _table(spec, dtype="fp32")
    facts = table.model["attention"]
    assert facts["mask"] == "block-sparse" and facts["skips"] and facts["layout"] == [32, 4, 1]
    s = 4096
    pairs = kept_pairs("block-sparse", s, layout=(32, 4, 1))
    assert pairs / (s * (s + 1) / 2) < 0.08  # about 7% of the causal triangle at 4096
    summary = summarize(facts, s, heads=4, head_dim=16, sequences=1)
    assert summary["layout"] == {"block": 32, "local_blocks": 4, "global_blocks": 1}
    assert summary["density"] == pytest.approx(pairs / s**2)
    # a block's FLOPs: its projections and MLP per token, plus the core over the kept pairs only
    row = table.layers[1]
    per_token = 2 * (64 * 64 + 64 * 64 + 64 * 64 + 64 * 256 + 256 * 64)  # q, kv, o, up, down
    core = 2 * 2 * 4 * 16 * pairs  # q k^T and p v: 2 FLOPs per multiply-add, 4 heads of 16
    assert float(row.fwd_flops.subs({B: 1, S: s})) == pytest.approx(per_token * s + core, rel=1e-9)
    assert float(row.bwd_flops.subs({B: 1, S: s})) == pytest.approx(2 * per_token * s + 2 * core, rel=1e-9)
