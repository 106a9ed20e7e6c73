"""Attention structure read from the graph (``passes.attention``) and the tensor-parallel analysis
of the HF layouts it must handle: grouped-query attention, Gemma's head size, fused qkv (NeoX,
Falcon's ``x @ W.T``), one key/value head at tp 2 and eager matmul-softmax-matmul attention."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from passes.attention import AttentionInfo, annotate_attention, attention_core, attention_facts
from passes.op_class import op_name
from passes.tensor_parallel.tp_analysis import analyze_tensor_parallel
from tests.helpers import TESTS


def _load(fname: str):
    spec = importlib.util.spec_from_file_location(fname[:-3] + "_t", os.path.join(TESTS, "fixtures", fname))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


HF = _load("hf_archs.py")
TPM = _load("tp_models.py")
_CACHE: dict = {}


def _graph(name: str) -> torch.fx.GraphModule:
    """``ep.module()`` of a fixture factory (get_attr parameters, static sizes), cached."""
    if name not in _CACHE:
        mod = TPM if hasattr(TPM, name) else HF
        model, inputs = getattr(mod, name)()
        _CACHE[name] = torch.export.export(model, inputs).module()
    return _CACHE[name]


def _facts(name):
    f = attention_facts(_graph(name))
    return f["heads"], f["kv_heads"], f["head_dim"]


@pytest.mark.parametrize(
    "arch,want",
    [
        ("llama", (4, 2, 8)),  # GQA: k repeated by repeat_kv's expand before SDPA
        ("mistral", (4, 2, 8)),
        ("qwen2", (4, 2, 8)),
        ("gemma", (4, 1, 16)),  # head size 16, not hidden / heads = 8; one kv head
        ("gpt_neox", (4, 4, 8)),  # fused qkv, head-major
        ("falcon", (4, 4, 8)),  # fused qkv through x @ W.T
        ("opt", (4, 4, 8)),
        ("bert", (4, 4, 8)),
    ],
)
def test_heads_from_sdpa(arch, want):
    assert _facts(arch) == want


@pytest.mark.parametrize("name,want", [("llama_eager", (4, 2, 8)), ("gemma_eager", (4, 1, 16))])
def test_heads_from_eager_matmul_softmax_matmul(name, want):
    assert _facts(name) == want
    infos = [n.meta["attention"] for n in _graph(name).graph.nodes if "attention" in n.meta]
    assert len(infos) == 2 and all(i.pattern == "eager" for i in infos)


class _HandAttention(nn.Module):
    """3 heads of 4 with a hand-written softmax(q k^T / 2) v: a 3-d bmm would hide the heads."""

    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(12, 36), nn.Linear(12, 12)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 3, 4).permute(2, 0, 3, 1, 4)
        p = F.softmax(q @ k.transpose(-1, -2) / 2, dim=-1)
        return self.o((p @ v).transpose(1, 2).reshape(b, s, 12)).sum()


def test_hand_written_attention_and_no_attention():
    gm = torch.export.export(_HandAttention(), (torch.randn(2, 5, 12),)).module()
    annotate_attention(gm)
    assert [n.meta["attention"] for n in gm.graph.nodes if "attention" in n.meta] == [AttentionInfo(3, 3, 4, "eager")]
    mlp = torch.export.export(nn.Sequential(nn.Linear(4, 8), nn.Softmax(-1)), (torch.randn(2, 4),)).module()
    assert attention_facts(mlp) == {}


class _CappedAttention(nn.Module):
    """Gemma 2's eager attention: logits soft-capped by ``cap * tanh(scores / cap)`` (2 heads of 4)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4)
        scores = torch.tanh(q @ k.transpose(-1, -2) / 2 / 50.0) * 50.0
        return self.o((F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, s, 8)).sum()


class _SinkAttention(nn.Module):
    """gpt-oss's eager attention: a learned sink logit per head joins the scores, the softmax
    runs over both and the sink's probability is sliced off before ``@ v`` (2 heads of 4)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.o = nn.Linear(8, 24), nn.Linear(8, 8)
        self.sinks = nn.Parameter(torch.zeros(2))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / 2
        sinks = self.sinks.reshape(1, 2, 1, 1).expand(b, 2, s, 1)
        logits = torch.cat([scores, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1)[..., :-1]
        return self.o((probs @ v).transpose(1, 2).reshape(b, s, 8)).sum()


@pytest.mark.parametrize("model,kept", [(_CappedAttention, "tanh"), (_SinkAttention, "cat")])
def test_soft_capped_and_sink_attention_are_found_with_their_cores(model, kept):
    """Gemma 2 and gpt-oss run eager attention with an op between the scores and the softmax;
    both are attention (heads read, plan.json's ``model.attention`` filled) and the core that
    selective recompute frees runs from ``q @ k^T`` through that op to ``@ v``."""
    gm = torch.export.export(model(), (torch.randn(2, 5, 8),)).module()
    annotate_attention(gm)
    cores = [n for n in gm.graph.nodes if "attention" in n.meta]
    assert [n.meta["attention"] for n in cores] == [AttentionInfo(2, 2, 4, "eager")]
    names = [op_name(n) for n in attention_core(cores[0])]
    assert names[0] == "matmul" and names[-1] == "matmul" and kept in names and "softmax" in names


def _analysis(name: str, tp=None):
    return analyze_tensor_parallel(_graph(name), layer_of=lambda n: 0, tp=tp)


def test_falcon_transposed_weight_is_column_and_row_parallel():
    dec = _analysis("falcon")
    kinds = {k.split(".h.0.")[-1]: w.kind for k, w in dec.weights.items() if ".h.0." in k}
    assert kinds == {
        "self_attention.query_key_value.weight": "heads",
        "self_attention.dense.weight": "row",
        "mlp.dense_h_to_4h.weight": "column",
        "mlp.dense_4h_to_h.weight": "row",
    }
    assert dec.weights["inner.transformer.h.0.self_attention.query_key_value.weight"].dim == 0


def test_one_kv_head_is_replicated_and_scattered_by_query_heads():
    dec = _analysis("gemma")
    sharded = {k.split(".", 4)[-1] for k in dec.weights if ".layers.0." in k}
    assert sharded == {
        "self_attn.q_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    }
    (sdpa, paths), *_ = dec.scatter.items()
    assert "attention" in op_name(sdpa) and paths == [((1, None), 1), ((2, None), 1)]


def test_kv_heads_tp_does_not_divide_stay_replicated_at_that_tp():
    assert not _analysis("llama", tp=2).scatter  # 2 kv heads over 2 ranks: sharded
    dec = _analysis("llama", tp=4)  # 2 kv heads over 4 ranks: k/v projections replicated
    assert len(dec.scatter) == 2
    assert not any("k_proj" in k or "v_proj" in k for k in dec.weights)
    assert dec.weights["inner.model.layers.0.self_attn.q_proj.weight"].kind == "heads"


class _SlicedQKV(nn.Module):
    """Phi-3's attention: q, k and v cut from one fused projection by slices (2 kv heads of 4)."""

    def __init__(self, k_start: int = 16):
        super().__init__()
        self.qkv, self.o, self.k_start = nn.Linear(16, 32, bias=False), nn.Linear(16, 16, bias=False), k_start

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(x)
        q, k, v = qkv[..., :16], qkv[..., self.k_start : self.k_start + 8], qkv[..., 24:]
        q, k, v = (t.view(b, s, -1, 4).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(out.transpose(1, 2).reshape(b, s, 16)).sum()


@pytest.mark.parametrize("k_start,parts", [(16, (16, 8, 8)), (12, None)])
def test_slices_that_cut_a_projection_into_parts_split_it_as_fused(k_start, parts):
    """Slices that partition a column-parallel projection's features are its fused parts (each
    rank ``[q_r; k_r; v_r]``); slices that overlap (or leave a gap) keep it replicated."""
    gm = torch.export.export(_SlicedQKV(k_start), (torch.randn(2, 5, 16),)).module()
    weights = analyze_tensor_parallel(gm, layer_of=lambda n: 0).weights
    if parts is None:
        assert "qkv.weight" not in weights and "o.weight" not in weights
    else:
        assert weights["qkv.weight"].kind == "qkv" and weights["qkv.weight"].parts == parts
        assert weights["o.weight"].kind == "row"
