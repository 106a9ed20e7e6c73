"""Tensor-parallel codegen: generated code, shard specs and clear errors for what cannot be split."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from codegen import tp_rewrite
from codegen.codegen_errors import TPRewriteError
from codegen.tp_rewrite import analyze_tp, reshape_shard
from passes.analyze import analyze
from passes.layers import assign_layers
from passes.tensor_parallel.tp_analysis import analyze_tensor_parallel
from planner.commands.compile import compile_plan, model_dims
from planner.frontend.trace import export_training_module, trace_model
from planner.plan import Plan
from tests.helpers import USER_MODELS, manual_plan

GPT = {"layers": 2, "hidden": 32, "heads": 4, "vocab": 51, "seq_len": 8}
LLAMA = {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 48, "vocab": 64, "seq_len": 8}
GPT2 = {"layers": 1, "hidden": 32, "heads": 4, "vocab": 50, "seq_len": 8}
BERT = {"layers": 1, "hidden": 32, "heads": 4, "ffn": 64, "vocab": 50, "seq_len": 8}
FACTORY = USER_MODELS + ":good"
MBS, SEED, WORLD = 2, 7, 4


def _plan(spec: str, sizes: dict, tp: int, pp: int = 1, m: int = 1) -> Plan:
    L = sizes["layers"]
    stages = [[0, L + 1]] if pp == 1 else [[0, L // 2], [L // 2 + 1, L + 1]]
    return manual_plan(spec, sizes, tp=tp, pp=pp, mbs=MBS, m=m, stages=stages)


def test_gpt2_fused_qkv_needs_runtime_support(tmp_path, monkeypatch):
    monkeypatch.setattr(tp_rewrite, "_fused_supported", lambda: False)
    with pytest.raises(TPRewriteError, match=r"'qkv' shards") as e:
        compile_plan(_plan("hf:gpt2", GPT2, tp=2), str(tmp_path))
    assert "inner.transformer.h.0.attn" in str(e.value)


def test_generated_code_and_shard_specs(tmp_path):
    man = compile_plan(_plan("hf:llama", LLAMA, tp=2), str(tmp_path))  # (equal to the runs' copy)
    params = {e["fqn"]: e for e in man["stages"][0]["params"].values()}
    layer = "inner.model.layers.0."
    assert params[layer + "self_attn.q_proj.weight"]["shard"] == {"dim": 0, "kind": "heads", "size": 32}
    assert params[layer + "self_attn.k_proj.weight"]["shape"] == [8, 32]  # 2 kv heads -> 1 per rank
    assert params[layer + "self_attn.o_proj.weight"]["shard"] == {"dim": 1, "kind": "row", "size": 32}
    assert params[layer + "mlp.down_proj.weight"]["shape"] == [32, 24]
    assert params[layer + "input_layernorm.weight"]["shard"] is None
    assert params["inner.lm_head.weight"]["shard"] == {"dim": 0, "kind": "vocab", "padded": 64, "size": 64}
    src = (tmp_path / "stage_0.py").read_text()
    for needle in (  # q, k and v share one input entering the region: one fused call, as gate and up
        "column_parallel_linears(mul_tensor_1, [self_attn_q_proj_weight, self_attn_k_proj_weight, "
        "self_attn_v_proj_weight], [None, None, None])",
        "column_parallel_linears(mul_tensor_7, [mlp_gate_proj_weight, mlp_up_proj_weight], [None, None])",
        "linear_default_1 = column_parallel_linears[1]",
        "row_parallel_linear",
        "vocab_parallel_embedding",
        "vocab_parallel_cross_entropy",
        "[2, 1, 2, 8, 8]",
    ):  # repeat_kv: 1 kv head, 2 reps
        assert needle in src, needle
    assert "cross_entropy_loss.default" not in src and "aten.linear" not in src and "copy_to_tp" not in src
    # Compiling again gives byte-identical files.
    before = {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)}
    compile_plan(_plan("hf:llama", LLAMA, tp=2), str(tmp_path))
    assert before == {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)}


def test_tp_not_dividing_heads_is_a_clear_error(tmp_path):
    with pytest.raises(TPRewriteError, match=r"tp=2 does not divide the model's 3 attention heads"):
        compile_plan(
            _plan("gpt", {"layers": 1, "hidden": 24, "heads": 3, "vocab": 32, "seq_len": 8}, tp=2), str(tmp_path)
        )
    with pytest.raises(TPRewriteError, match=r"neither divides the model's 3 key/value heads"):
        compile_plan(_plan("hf:llama", dict(LLAMA, hidden=48, heads=6, kv_heads=3), tp=2), str(tmp_path))


def test_tp_not_dividing_ffn_names_node_and_dims(tmp_path):
    sizes = {"layers": 1, "hidden": 32, "heads": 4, "ffn": 30, "vocab": 32, "seq_len": 8}
    with pytest.raises(TPRewriteError) as e:
        compile_plan(_plan("gpt", sizes, tp=4), str(tmp_path))
    msg = str(e.value)
    assert "'blocks.0.mlp.fc'" in msg and "30 output features" in msg and "tp=4" in msg, msg
    assert "'ffn': 30" in msg and "planner/frontend/gpt.py:" in msg, msg


class _Toy(nn.Module):
    """A projection closed by a LayerNorm (cannot be column parallel) and a Megatron MLP."""

    def __init__(self, heads=None):
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 16)
        self.out = nn.Linear(16, 8)
        self.heads = heads

    def forward(self, x):
        h = self.norm(self.pre(x))
        if self.heads:
            b, s, _ = h.shape
            return x + self.out(F.gelu(self.fc(h)).view(b, s, self.heads, -1).flatten(2))
        return x + self.out(F.gelu(self.fc(h)))


def _export(mod):
    return torch.export.export(mod, (torch.randn(2, 4, 8),), strict=False).module()


def test_unclosable_column_region_stays_replicated():
    gm = _export(_Toy())
    an = analyze_tp(gm, lambda n: 0, 2, fused_ok=False)
    assert set(an.shard_info) == {"fc.weight", "fc.bias", "out.weight"}
    assert len(an.replicated) == 1 and "normalization over the sharded dim" in next(iter(an.replicated.values()))


def test_indivisible_reshape_names_the_node():
    gm = _export(_Toy(heads=8))  # 16 features as 8 groups of 2: 3 ranks cannot split 16
    with pytest.raises(TPRewriteError, match=r"16 output features, which tp=3 does not divide"):
        analyze_tp(gm, lambda n: 0, 3, fused_ok=False)
    gm = _export(_Toy(heads=2))  # 2 groups of 8 over 4 ranks: the view is refused
    with pytest.raises(TPRewriteError, match=r"tp=4 does not divide 2 ") as e:
        analyze_tp(gm, lambda n: 0, 4, fused_ok=False)
    assert "test_tp_rewrite.py:" in str(e.value) and "'view'" in str(e.value)  # the user's source line


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.sampled_from([1, 2, 3, 4, 6]), min_size=1, max_size=4),
    st.integers(0, 3),
    st.sampled_from([2, 3]),
    st.randoms(use_true_random=False),
)
def test_reshape_shard_rule_matches_slicing(dims, d_pick, tp, rnd):
    """Reshaping each rank's shard equals sharding the reshaped tensor, whenever the rule allows."""
    src = list(dims)
    d = d_pick % len(src)
    src[d] *= tp
    # dst: merge a random run of adjacent dims or split one dim into factors
    dst = list(src)
    if len(dst) > 1 and rnd.random() < 0.5:
        i = rnd.randrange(len(dst) - 1)
        dst[i : i + 2] = [dst[i] * dst[i + 1]]
    else:
        i = rnd.randrange(len(dst))
        f = [k for k in range(1, dst[i] + 1) if dst[i] % k == 0]
        a = rnd.choice(f)
        dst[i : i + 1] = [a, dst[i] // a]
    full = torch.arange(torch.Size(src).numel()).view(src)
    try:
        m = reshape_shard(src, dst, d, tp)
    except ValueError:
        return
    if m is None:
        return
    d_out, local = m
    per = src[d] // tp
    for r in range(tp):
        shard = full.narrow(d, r * per, per)
        local_dst = list(dst)
        local_dst[d_out] = local
        assert torch.equal(shard.reshape(local_dst), full.reshape(dst).narrow(d_out, r * local, local))


class _DropoutMLP(nn.Module):
    """A Megatron MLP with ``aten.native_dropout`` (a two-output op) inside the sharded region."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.out = nn.Linear(16, 8)

    def forward(self, x):
        h, _mask = torch.ops.aten.native_dropout(F.gelu(self.fc(x)), 0.1, True)
        return x + self.out(h)


def test_native_dropout_passes_the_sharding_through():
    gm = _export(_DropoutMLP())
    an = analyze_tp(gm, lambda n: 0, 2, fused_ok=False)
    assert set(an.shard_info) == {"fc.weight", "fc.bias", "out.weight"} and not an.replicated
    assert an.shard_info["out.weight"] == {"dim": 1, "kind": "row", "size": 16}
    dec = an.decisions
    drop = next(n for n in gm.graph.nodes if "native_dropout" in str(n.target))
    assert [s.dim for s in dec.state[drop]] == [2, 2]  # the output and its mask, by features
    assert [dec.role[u] for u in drop.users] == ["sharded"] * len(drop.users)


def _cost_pass_weights(spec: str, sizes: dict) -> tuple[set, dict]:
    """FQNs the cost pass marks sharded, and the shared analysis' ``WeightShard`` of each, on the
    lifted graph the planner prices (symbolic b and s)."""
    sizes = {k: v for k, v in sizes.items() if k != "seq_len"}
    tr = trace_model(spec, batch=MBS, seq_len=8, dtype="fp32", **sizes)
    analyze(tr)
    sharded = {
        tr.fqns[n.name] for n in tr.gm.graph.nodes if tr.roles.get(n.name) == "param" and n.meta["tp"].role == "sharded"
    }
    weights = analyze_tensor_parallel(tr.gm, roles=tr.roles).weights
    return sharded, {tr.fqns[k]: w for k, w in weights.items()}


def _codegen_shards(spec: str, sizes: dict, tp: int) -> dict:
    """``shard_info`` codegen derives for ``tp`` on the trainable module (static shapes)."""
    gm, blocks, bundle = export_training_module(spec, sizes, dtype="fp32", batch=MBS, seq_len=8)
    assign_layers(gm, blocks, {n.name: "input" for n in gm.graph.nodes if n.op == "placeholder"})
    return analyze_tp(gm, lambda n: n.meta["layer"], tp, vocab=bundle.vocab, dims=model_dims(bundle, sizes)).shard_info


@pytest.mark.parametrize(
    "spec, sizes, kinds",
    [
        ("gpt", GPT, {"heads", "column", "row", "vocab"}),
        ("hf:llama", LLAMA, {"heads", "column", "row", "vocab"}),  # GQA: 4 heads, 2 kv heads
        ("hf:gpt2", GPT2, {"qkv", "column", "row", "vocab"}),  # fused c_attn, Conv1D (addmm)
        ("hf:bert", BERT, {"heads", "column", "row", "vocab"}),  # MLM transform stays replicated
        (FACTORY, {}, {"vocab"}),  # residual tanh(linear) cannot close a region; embedding + head
    ],
    ids=["gpt", "llama", "gpt2", "bert", "factory"],
)
def test_cost_pass_and_codegen_shard_the_same_weights(spec, sizes, kinds):
    sharded, weights = _cost_pass_weights(spec, sizes)
    shards = _codegen_shards(spec, sizes, tp=2)
    assert sharded == set(weights) == set(shards)
    assert {s["kind"] for s in shards.values()} == kinds
    for fqn, s in shards.items():
        w = weights[fqn]
        assert (w.kind, w.dim, w.size, list(w.parts or []) or None) == (
            s["kind"],
            s["dim"],
            s["size"],
            s.get("parts"),
        ), fqn
    if spec == "hf:bert":
        assert not any("predictions.transform" in f for f in shards)
