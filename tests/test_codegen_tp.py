"""Tensor-parallel codegen: compiled tp stages reproduce the original model's loss and gradients.

Each plan is compiled in the test process; the gloo ranks load their stage, cut their shard of the
original weights with ``runtime.compiled.load_weights``, run forward and backward on a fixed
batch and save the loss and every parameter gradient. The test joins the tp shards (along the
manifest's shard dim, padding trimmed) and compares them with the single-process original model
in fp32. One 2-rank launch covers the built-in GPT (vocab 51: padded to 52 over 2 ranks),
hf:llama with GQA (4 heads, 2 kv heads) and hf:gpt2 (Conv1D, fused c_attn); one 4-rank launch
covers tp 2 x pp 2 with the 1F1B executor and tp 4. The rest are pure checks: shard specs and
shapes, divisibility errors, the reshape rule (hypothesis), the fallback that keeps an unclosable
column-parallel matmul replicated, and that the cost pass (on the lifted, symbolic graph) shards
the same weights the same way as codegen (on the trainable module): both read
``passes.tp_analysis``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from codegen import tp_rewrite
from codegen.errors import TPRewriteError
from codegen.tp_rewrite import analyze_tp, reshape_shard
from passes.analyze import analyze
from passes.layers import assign_layers
from passes.tp_analysis import analyze_tensor_parallel
from planner.commands.compile import compile_plan, model_dims
from planner.commands.train import original_state
from planner.frontend.trace import export_training_module, trace_model
from planner.frontend.zoo import build_model
from planner.plan import Plan
from runtime.compiled import load_stage_module, load_weights, read_manifest
from runtime.dist import launch_local
from runtime.mesh import setup_mesh
from runtime.pipeline import PipelineStage, TensorMeta
from runtime.schedule import one_f_one_b
from tests.helpers import manual_plan

GPT = {"layers": 2, "hidden": 32, "heads": 4, "vocab": 51, "seq_len": 8}
LLAMA = {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 48, "vocab": 64, "seq_len": 8}
GPT2 = {"layers": 1, "hidden": 32, "heads": 4, "vocab": 50, "seq_len": 8}
GPT_PP = {"layers": 2, "hidden": 32, "heads": 4, "vocab": 64, "seq_len": 8}
BERT = {"layers": 1, "hidden": 32, "heads": 4, "ffn": 64, "vocab": 50, "seq_len": 8}
FACTORY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "user_models.py") + ":good"
MBS, SEED, WORLD = 2, 7, 4


def _plan(spec: str, sizes: dict, tp: int, pp: int = 1, m: int = 1) -> Plan:
    L = sizes["layers"]
    stages = [[0, L + 1]] if pp == 1 else [[0, L // 2], [L // 2 + 1, L + 1]]
    return manual_plan(spec, sizes, tp=tp, pp=pp, mbs=MBS, m=m, stages=stages)


def _batch(vocab: int, rows: int, seq: int):
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    labels = torch.randint(0, vocab, (rows, seq), generator=g)
    labels[0, 0] = -100  # an ignored token exercises ignore_index
    return ids, labels


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


def _qkv_order(spec: dict, tp: int) -> torch.Tensor:
    """Index of the fused ``[q; k; v]`` rows in rank-major order ``[q_0; k_0; v_0; q_1; ...]``."""
    starts = [sum(spec["parts"][:i]) for i in range(len(spec["parts"]))]
    return torch.cat([torch.arange(s + r * (p // tp), s + (r + 1) * (p // tp))
                      for r in range(tp) for s, p in zip(starts, spec["parts"])])


def _worker(rank: int, world: int, jobs: list, out_dir: str) -> None:
    for name, cdir, spec, sizes, m in jobs:
        man = read_manifest(cdir)
        tp, pp = man["plan"]["tp"], man["plan"]["pp"]
        mesh = setup_mesh(pp, world // (pp * tp), tp)  # spare ranks: dp replicas of the same batch
        stage = man["stages"][mesh.pp_index]
        module = load_stage_module(cdir, stage)
        state = original_state(spec, sizes, sizes["seq_len"], SEED)
        load_weights(module, stage, state, mesh.tp_index, tp)
        ids, labels = _batch(sizes["vocab"], MBS * m, sizes["seq_len"])
        src = {"input_ids": ids, "labels": labels}
        if pp == 1:
            loss = module(*[src[n] for n in stage["data_inputs"]])
            loss.backward()
            loss = loss.item()
        else:
            recv = [TensorMeta(tuple(r["shape"]), getattr(torch, r["dtype"]), r["requires_grad"])
                    for r in stage["recv"]]
            ps = PipelineStage.from_mesh(module, recv_meta=recv, mesh=mesh)
            micro = [tuple(src[n][i * MBS:(i + 1) * MBS] for n in stage["data_inputs"]) for i in range(m)]
            loss = ps.run(one_f_one_b(pp, m)[mesh.pp_index], micro)
        grads = {k: p.grad.detach().clone() for k, p in module.named_parameters()}
        torch.save({"loss": loss, "grads": grads}, os.path.join(out_dir, f"{name}_{rank}.pt"))


# --------------------------------------------------------------------------------------------
# Test side
# --------------------------------------------------------------------------------------------


def _reference(spec: str, sizes: dict, m: int):
    """Mean of the micro-batch losses of the original model and its gradients."""
    model = build_model(spec, seed=SEED, **sizes).model
    ids, labels = _batch(sizes["vocab"], MBS * m, sizes["seq_len"])
    loss = sum(model(ids[i * MBS:(i + 1) * MBS], labels[i * MBS:(i + 1) * MBS]) for i in range(m)) / m
    loss.backward()
    named = dict(model.named_parameters(remove_duplicate=False))
    return loss.item(), {n: p.grad for n, p in named.items()}, {n: id(p) for n, p in named.items()}


def _join(pieces: list[torch.Tensor], spec: dict | None) -> torch.Tensor:
    """Re-assemble tp shards: cat along the shard dim, trim the vocabulary padding."""
    if not spec:
        return pieces[0]
    full = torch.cat(pieces, dim=spec["dim"])
    if spec["kind"] == "qkv":
        inv = torch.argsort(_qkv_order(spec, len(pieces)))
        return full.index_select(spec["dim"], inv)
    return full.narrow(spec["dim"], 0, spec["size"])


def _check(name: str, cdir: str, out_dir: str, spec: str, sizes: dict, m: int) -> None:
    with open(os.path.join(cdir, "manifest.json")) as f:
        man = json.load(f)
    tp, pp = man["plan"]["tp"], man["plan"]["pp"]
    dp = WORLD // (tp * pp)
    ref_loss, ref_grads, ref_ids = _reference(spec, sizes, m)
    res = {r: torch.load(os.path.join(out_dir, f"{name}_{r}.pt")) for r in range(WORLD)}
    checked = set()
    for r in range(WORLD):
        assert res[r]["loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-6), (name, r)
    for s, stage in enumerate(man["stages"]):
        ranks = [s * dp * tp + t for t in range(tp)]  # dp index 0 of pipeline stage s
        for attr, e in stage["params"].items():
            if not e["trainable"]:
                continue
            pieces = [res[r]["grads"][attr] for r in ranks]
            if e["shard"]:
                got = _join(pieces, e["shard"])
                assert list(pieces[0].shape) == e["shape"]
            else:  # replicated: every tp rank must hold the full, identical gradient
                for p in pieces[1:]:
                    assert_close(p, pieces[0], rtol=1e-5, atol=1e-6)
                got = pieces[0]
            assert_close(got, ref_grads[e["fqn"]], rtol=1e-4, atol=1e-6, msg=lambda s_: f"{name} {e['fqn']}: {s_}")
            checked.add(e["fqn"])
    covered = {ref_ids[n] for n in checked}  # a tied weight is checked once, under any name
    missing = [n for n, i in ref_ids.items() if i not in covered]
    assert not missing, f"{name}: parameters not covered: {missing}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Compile every case, then run them all in one 4-rank launch (spawning is the slow part)."""
    root = tmp_path_factory.mktemp("tp")
    cases = (("gpt", "gpt", GPT, 2, 1, 1), ("llama", "hf:llama", LLAMA, 2, 1, 1),
             ("gpt2", "hf:gpt2", GPT2, 2, 1, 1), ("pp", "gpt", GPT_PP, 2, 2, 2),
             ("tp4", "gpt", GPT, 4, 1, 1))
    jobs = {}
    for name, spec, sizes, tp, pp, m in cases:
        cdir = str(root / name)
        compile_plan(_plan(spec, sizes, tp=tp, pp=pp, m=m), cdir)
        jobs[name] = (name, cdir, spec, sizes, m)
    launch_local(_worker, WORLD, (list(jobs.values()), str(root)), timeout_s=150)
    return root, jobs


def _run_check(runs, name):
    root, jobs = runs
    n, cdir, spec, sizes, m = jobs[name]
    _check(n, cdir, str(root), spec, sizes, m)


@pytest.mark.dist
def test_gpt_tp2_matches_original(runs):
    _run_check(runs, "gpt")  # vocab 51 over 2 ranks: 26 rows each, one padding row


@pytest.mark.dist
def test_llama_gqa_tp2_matches_original(runs):
    _run_check(runs, "llama")  # 4 query heads, 2 kv heads: 2 and 1 per rank


@pytest.mark.dist
def test_gpt2_fused_qkv_conv1d_tp2_matches_original(runs):
    _run_check(runs, "gpt2")  # Conv1D (addmm), fused c_attn split, tied embedding / LM head


@pytest.mark.dist
def test_gpt_tp2_pp2_pipeline_matches_original(runs):
    _run_check(runs, "pp")  # 1F1B over 2 stages, 2 micro-batches


@pytest.mark.dist
def test_gpt_tp4_padded_vocab_matches_original(runs):
    _run_check(runs, "tp4")  # vocab 51 over 4 ranks: 13 rows each, one padding row


def test_gpt2_fused_qkv_needs_runtime_support(tmp_path, monkeypatch):
    monkeypatch.setattr(tp_rewrite, "_fused_supported", lambda: False)
    with pytest.raises(TPRewriteError, match=r"'qkv' shards") as e:
        compile_plan(_plan("hf:gpt2", GPT2, tp=2), str(tmp_path))
    assert "inner.transformer.h.0.attn" in str(e.value)


# --------------------------------------------------------------------------------------------
# Pure checks (no processes)
# --------------------------------------------------------------------------------------------


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
    for needle in ("copy_to_tp", "row_parallel_linear", "vocab_parallel_embedding",
                   "vocab_parallel_cross_entropy", "[2, 1, 2, 8, 8]"):  # repeat_kv: 1 kv head, 2 reps
        assert needle in src, needle
    assert "cross_entropy_loss.default" not in src
    # Compiling again gives byte-identical files.
    before = {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)}
    compile_plan(_plan("hf:llama", LLAMA, tp=2), str(tmp_path))
    assert before == {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)}


def test_tp_not_dividing_heads_is_a_clear_error(tmp_path):
    with pytest.raises(TPRewriteError, match=r"tp=2 does not divide the model's 3 attention heads"):
        compile_plan(_plan("gpt", {"layers": 1, "hidden": 24, "heads": 3, "vocab": 32, "seq_len": 8}, tp=2),
                     str(tmp_path))
    with pytest.raises(TPRewriteError, match=r"1 key/value heads"):
        compile_plan(_plan("hf:llama", dict(LLAMA, kv_heads=1), tp=2), str(tmp_path))


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
    assert "test_codegen_tp.py:" in str(e.value) and "'view'" in str(e.value)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from([1, 2, 3, 4, 6]), min_size=1, max_size=4), st.integers(0, 3),
       st.sampled_from([2, 3]), st.randoms(use_true_random=False))
def test_reshape_shard_rule_matches_slicing(dims, d_pick, tp, rnd):
    """Reshaping each rank's shard equals sharding the reshaped tensor, whenever the rule allows."""
    src = list(dims)
    d = d_pick % len(src)
    src[d] *= tp
    # dst: merge a random run of adjacent dims or split one dim into factors
    dst = list(src)
    if len(dst) > 1 and rnd.random() < 0.5:
        i = rnd.randrange(len(dst) - 1)
        dst[i:i + 2] = [dst[i] * dst[i + 1]]
    else:
        i = rnd.randrange(len(dst))
        f = [k for k in range(1, dst[i] + 1) if dst[i] % k == 0]
        a = rnd.choice(f)
        dst[i:i + 1] = [a, dst[i] // a]
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
    sharded = {tr.fqns[n.name] for n in tr.gm.graph.nodes
               if tr.roles.get(n.name) == "param" and n.meta["tp"].role == "sharded"}
    weights = analyze_tensor_parallel(tr.gm, roles=tr.roles).weights
    return sharded, {tr.fqns[k]: w for k, w in weights.items()}


def _codegen_shards(spec: str, sizes: dict, tp: int) -> dict:
    """``shard_info`` codegen derives for ``tp`` on the trainable module (static shapes)."""
    gm, blocks, bundle = export_training_module(spec, sizes, dtype="fp32", batch=MBS, seq_len=8)
    assign_layers(gm, blocks, {n.name: "input" for n in gm.graph.nodes if n.op == "placeholder"})
    return analyze_tp(gm, lambda n: n.meta["layer"], tp, vocab=bundle.vocab,
                      dims=model_dims(bundle, sizes)).shard_info


@pytest.mark.parametrize("spec, sizes, kinds", [
    ("gpt", GPT, {"heads", "column", "row", "vocab"}),
    ("hf:llama", LLAMA, {"heads", "column", "row", "vocab"}),  # GQA: 4 heads, 2 kv heads
    ("hf:gpt2", GPT2, {"qkv", "column", "row", "vocab"}),  # fused c_attn, Conv1D (addmm)
    ("hf:bert", BERT, {"heads", "column", "row", "vocab"}),  # MLM transform stays replicated
    (FACTORY, {}, {"vocab"}),  # residual tanh(linear) cannot close a region; embedding + head
], ids=["gpt", "llama", "gpt2", "bert", "factory"])
def test_cost_pass_and_codegen_shard_the_same_weights(spec, sizes, kinds):
    sharded, weights = _cost_pass_weights(spec, sizes)
    shards = _codegen_shards(spec, sizes, tp=2)
    assert sharded == set(weights) == set(shards)
    assert {s["kind"] for s in shards.values()} == kinds
    for fqn, s in shards.items():
        w = weights[fqn]
        assert (w.kind, w.dim, w.size, list(w.parts or []) or None) == \
            (s["kind"], s["dim"], s["size"], s.get("parts")), fqn
    if spec == "hf:bert":
        assert not any("predictions.transform" in f for f in shards)
