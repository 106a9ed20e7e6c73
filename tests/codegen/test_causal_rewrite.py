"""An explicit causal mask lowered to SDPA's ``is_causal`` (``passes.causal_rewrite``): which masks
are rewritten (exactly the causal ones built from fixed data), that the rewritten graph computes
the same, and that a compiled HF Llama runs without its mask and matches the model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from passes.causal_rewrite import causal_at_length, explicit_causal_mask, rewrite_causal
from planner.commands.compile import compile_plan
from runtime.stages.compiled_stages import read_manifest
from tests.helpers import make_plan, run_stages_in_process

S = 12


class _Masked(torch.nn.Module):
    """SDPA with a mask built in the graph: ``kind`` picks how."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, q, k, v, tokens):
        s, t = q.shape[-2], k.shape[-2]
        i = torch.arange(s, device=q.device)[:, None]
        j = torch.arange(t, device=q.device)[None, :]
        if self.kind == "causal":
            mask = j <= i
        elif self.kind == "window_covers":  # a band wider than the sequence: the triangle itself
            mask = (j <= i) & (i - j < s + 3)
        elif self.kind == "sliding":
            mask = (j <= i) & (i - j < 4)
        elif self.kind == "padding":  # reads the token values: not fixed data
            mask = (j <= i) & (tokens[:, None, None, :] != 0)
        elif self.kind == "full":
            mask = torch.ones(s, t, dtype=torch.bool, device=q.device)
        else:  # "cross": a query shorter than the keys (is_causal would align the triangle differently)
            mask = j <= i + (t - s)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize(
    "kind, kv_len, rewritten",
    [
        ("causal", S, True),
        ("window_covers", S, True),
        ("sliding", S, False),
        ("padding", S, False),
        ("full", S, False),
        ("cross", S + 4, False),
    ],
)
def test_only_an_exact_causal_mask_from_fixed_data_is_rewritten(kind, kv_len, rewritten):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, S, 8, generator=g)
    k, v = torch.randn(2, 3, kv_len, 8, generator=g), torch.randn(2, 3, kv_len, 8, generator=g)
    tokens = torch.randint(0, 3, (2, kv_len), generator=g)
    model = _Masked(kind)
    gm = torch.export.export(model, (q, k, v, tokens), strict=False).module()
    before = len(gm.graph.nodes)
    cores = rewrite_causal(gm, {}, causal_at_length)
    assert len(cores) == int(rewritten)
    if rewritten:
        (core,) = cores
        assert core.kwargs.get("is_causal") is True and len(core.args) == 3
        assert "attn_mask" not in core.kwargs
        # every op that built the mask is gone: only the inputs, the core and the output remain
        calls = [n for n in gm.graph.nodes if n.op == "call_function" and "assert" not in str(n.target)]
        assert calls == [core] and len(gm.graph.nodes) < before
        assert "is_causal = True" in gm.code
    else:
        assert len(gm.graph.nodes) == before
    torch.testing.assert_close(gm(q, k, v, tokens), model(q, k, v, tokens), rtol=1e-6, atol=1e-6)


def test_the_probe_refuses_a_mask_longer_than_its_limit(monkeypatch):
    """A static export longer than ``PROBE_LIMIT`` elements keeps its explicit mask (it is not
    built on the CPU to be read)."""
    import passes.causal_rewrite as rewrite

    q = torch.randn(1, 2, S, 8)
    gm = torch.export.export(_Masked("causal"), (q, q, q, torch.zeros(1, S, dtype=torch.long)), strict=False).module()
    monkeypatch.setattr(rewrite, "PROBE_LIMIT", S * S - 1)
    assert rewrite_causal(gm, {}, causal_at_length) == []
    core = next(n for n in gm.graph.nodes if "scaled_dot" in str(n.target))
    assert explicit_causal_mask(core, {}) is not None  # eligible: only the probe's size stopped it


LLAMA = {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 64, "vocab": 64, "seq_len": 16}


def test_compiled_llama_runs_is_causal_without_its_mask_and_matches_the_model(tmp_path):
    """HF Llama compiled into two stages: the stage files call SDPA with ``is_causal=True``, build
    no mask, send none across the boundary, and give the model's loss and gradients."""
    from planner.commands.train import original_state
    from planner.frontend.zoo import ModelSizes, build_model

    compile_plan(make_plan("hf:llama", LLAMA, pp=2), str(tmp_path))
    man = read_manifest(str(tmp_path))
    sources = [(tmp_path / stage["file"]).read_text() for stage in man["stages"]]
    calls = [
        line for src in sources for line in src.splitlines() if "= torch.ops.aten.scaled_dot_product_attention" in line
    ]
    assert len(calls) == 2 and all("is_causal = True" in line for line in calls)
    for src in sources:
        for built in ("attn_mask", "aten.cumsum", "aten.diff", "aten.le.", "new_ones", "torch.bool"):
            assert built not in src, built
    crossing = man["stages"][0]["send"]
    assert all(c["dtype"] != "bool" and len(c["shape"]) != 4 for c in crossing), crossing

    model = build_model("hf:llama", ModelSizes(**LLAMA), seed=0).model
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(5))
    x, y = ids[:, :-1], ids[:, 1:]
    ref = model(x, y)
    ref.backward()
    state = original_state("hf:llama", LLAMA, 16, 0)
    loss, mods = run_stages_in_process(str(tmp_path), man, state, {"input_ids": x, "labels": y})
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    grads = dict(model.named_parameters(remove_duplicate=False))
    checked = 0
    for m, stage in zip(mods, man["stages"]):
        for attr, p in m.named_parameters():
            torch.testing.assert_close(p.grad, grads[stage["params"][attr]["fqn"]].grad, rtol=1e-5, atol=1e-6)
            checked += 1
    assert checked == len(grads)


def test_bert_padding_mask_stays_bidirectional(tmp_path):
    """BERT's all-ones padding mask is full, not causal: nothing is rewritten to is_causal."""
    sizes = {"layers": 1, "hidden": 32, "heads": 4, "ffn": 64, "vocab": 64, "seq_len": 16}
    compile_plan(make_plan("hf:bert", sizes), str(tmp_path))
    src = "".join((tmp_path / stage["file"]).read_text() for stage in read_manifest(str(tmp_path))["stages"])
    assert "scaled_dot_product_attention" in src and "is_causal = True" not in src


def test_a_window_wider_than_the_plan_sequence_stays_explicit_as_planned(tmp_path):
    """Mistral with window 100 planned at 16 tokens: the band equals the triangle at 16, but the
    planner probes past the window, names it sliding and prices it full, so compile keeps the
    explicit mask too (the stage files hold what the table priced)."""
    import transformers as tf

    from passes.causal_rewrite import REWRITTEN
    from planner.frontend.model_analysis import build_layer_table

    cfg = tf.MistralConfig(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=64
    )
    cfg.num_hidden_layers, cfg.sliding_window, cfg.max_position_embeddings = 1, 100, 256
    cfg.save_pretrained(tmp_path / "mistral")
    spec = f"hf:{tmp_path / 'mistral'}"
    att = build_layer_table(spec, seq_len=16).model["attention"]
    assert (att["mask"], att["window"], att["skips"]) == ("sliding", 100, False) and att["reason"] != REWRITTEN
    sizes = {"layers": 1, "seq_len": 16}
    compile_plan(make_plan(spec, sizes), str(tmp_path / "out"))
    src = "".join((tmp_path / "out" / s["file"]).read_text() for s in read_manifest(str(tmp_path / "out"))["stages"])
    assert "scaled_dot_product_attention" in src and "is_causal = True" not in src
