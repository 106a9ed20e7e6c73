"""GEMM shapes in the layer table (``passes.autograd_costs`` records them, ``passes.tensor_parallel.tp_costs``
marks the dim tp divides, ``passes.layer_table`` merges them per layer): present for every block,
their FLOPs are the layer's FLOPs, the column/row-parallel products divide the right dim, fused
attention is its 2 + 4 batched products, and the shapes survive JSON, ``numeric`` and the cache.

Models: the built-in GPT (2 blocks of width 64, 4 heads, MLP 256, vocabulary 128), the tiny HF
LLaMA of ``tests/fixtures/hf_archs.py`` (width 32, 4 heads of 8, 2 key/value heads, MLP 64; its
factory's costs come out at the example's sizes, b = 2, s = 16, so its rows, b s = 32, equal
its width: every product of its square projections is 32 x 32 x 32) and ``hf:llama`` of the zoo
(width 64, 4 heads, 2 key/value heads, MLP 128, symbolic in b and s).
"""

from __future__ import annotations

import os

import pytest
import sympy

from passes.analyze import analyze
from passes.autograd_costs import GemmCall
from passes.common import B, S, to_expr
from passes.layer_table import GEMM_FIELDS, Gemm, LayerTable
from passes.op_class import op_name
from passes.tabulate import table_from_traced
from passes.tensor_parallel.tp_analysis import gemm_tp_dim, matmul_operands
from planner.frontend import cache
from planner.frontend.trace import trace_model
from tests.helpers import TESTS

LLAMA = os.path.join(TESTS, "fixtures", "hf_archs.py") + ":llama"
SPECS = {
    "gpt": dict(batch=2, seq_len=32, dtype="fp32", layers=2, hidden=64, heads=4, vocab=128),
    LLAMA: dict(),
    "hf:llama": dict(batch=2, seq_len=32, dtype="fp32", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=128),
}
IDS = ["gpt", "llama-factory", "hf-llama"]
_CACHE: dict = {}


def analyzed(spec: str):
    """(traced graph with every pass run, its layer table), cached per module."""
    if spec not in _CACHE:
        tr = trace_model(spec, **SPECS[spec])
        analyze(tr)
        _CACHE[spec] = (tr, table_from_traced(tr, analyzed=True))
    return _CACHE[spec]


def _total(gemms, tp_only=False) -> sympy.Expr:
    return sympy.expand(sum((g.flops for g in gemms if g.tp_dim or not tp_only), sympy.Integer(0)))


@pytest.mark.parametrize("spec", list(SPECS), ids=IDS)
def test_every_block_lists_its_products_and_their_flops_are_the_layers(spec):
    _, table = analyzed(spec)
    blocks = [lay for lay in table.layers if lay.kind == "block"]
    assert blocks
    for lay in table.layers:
        if lay.kind != "pre":  # the embedding is a lookup, every other row multiplies
            assert lay.fwd_gemms and lay.bwd_gemms, lay.name
        for f in GEMM_FIELDS:
            assert all(isinstance(g, Gemm) and g.count >= 1 for g in getattr(lay, f))
            assert len(set(g[:4] + (g.tp_dim,) for g in getattr(lay, f))) == len(getattr(lay, f))  # merged
        # the invariant: every matmul-class FLOP of these models is a listed product ...
        assert _total(lay.fwd_gemms) == sympy.expand(lay.fwd_flops), lay.name
        assert _total(lay.bwd_gemms) == sympy.expand(lay.bwd_flops), lay.name
        # ... and the products tp divides are the FLOPs it divides
        assert _total(lay.fwd_gemms, tp_only=True) == sympy.expand(lay.fwd_flops_tp), lay.name
        assert _total(lay.bwd_gemms, tp_only=True) == sympy.expand(lay.bwd_flops_tp), lay.name
    # a block: 4 weighted projections (GPT: q, k, v, out + 2 MLP; LLaMA: + gate) forward, each
    # with an input and a weight gradient in backward, and attention's 2 + 4
    blk = blocks[0]
    weighted = 6 if spec == "gpt" else 7
    assert sum(g.count for g in blk.fwd_gemms if g.batch == 1) == weighted
    assert sum(g.count for g in blk.bwd_gemms if g.batch == 1) == 2 * weighted


def _nodes(spec, role):
    tr, _ = analyzed(spec)
    return [n for n in tr.gm.graph.nodes if n.op == "call_function" and n.meta["tp"].role == role]


def _size(g: GemmCall, dim: str):
    return getattr(g, dim)


@pytest.mark.parametrize("spec", list(SPECS), ids=IDS)
def test_column_and_row_parallel_products_divide_the_sharded_features(spec):
    tr, _ = analyzed(spec)
    col, row = _nodes(spec, "col"), _nodes(spec, "row")
    assert col and row
    for n in col + row:
        info = n.meta["tp"]
        w = matmul_operands(n)[1]
        wshape = [int(d) for d in w.meta["val"].shape] if "val" in w.meta else None
        if op_name(n) == "linear" and wshape:  # [out, in]
            out_f, in_f = wshape
        else:
            out_f, in_f = int(n.meta["val"].shape[-1]), int(matmul_operands(n)[0].meta["val"].shape[-1])
        sharded = out_f if info.role == "col" else in_f
        x_shape = [to_expr(d, tr.symbols) for d in matmul_operands(n)[0].meta["val"].shape]
        rows = sympy.expand(sympy.Mul(*x_shape[:-1]))
        [fwd] = n.meta["fwd_gemms"]
        assert info.fwd_gemm_dims == ["n" if info.role == "col" else "k"]
        assert fwd.operands == ("x", "w") and _size(fwd, info.fwd_gemm_dims[0]) == sharded
        assert len(n.meta["bwd_gemms"]) == len(info.bwd_gemm_dims) == 2
        for g, dim in zip(n.meta["bwd_gemms"], info.bwd_gemm_dims):
            assert _size(g, dim) == sharded, (n.name, g, dim)
            if "w" in g.operands:  # input gradient: contracts the out features
                assert (dim == "k") == (info.role == "col")
            else:  # weight gradient: contracts the rows (b s; LLaMA's fixture: 2 x 16 = its width)
                assert g.k == rows and dim in ("m", "n")


def test_the_rule_for_each_product_by_hand():
    # column parallel: y = x w -> n; g wᵀ -> k; xᵀ g or gᵀ x -> the out features
    assert [gemm_tp_dim("col", True, ops) for ops in [("x", "w"), ("g", "w"), ("w", "g"), ("x", "g"), ("g", "x")]] == [
        "n",
        "k",
        "k",
        "n",
        "m",
    ]
    assert [gemm_tp_dim("row", True, ops) for ops in [("x", "w"), ("g", "w"), ("w", "g"), ("x", "g"), ("g", "x")]] == [
        "k",
        "n",
        "m",
        "m",
        "n",
    ]
    assert gemm_tp_dim("sharded", True, ("x", "x")) == "batch"
    assert gemm_tp_dim("col", False, ("x", "w")) is None
    assert gemm_tp_dim("col", True, ("x", "x")) == "n"  # factors not told apart: the forward's dim


def test_gpt_block_by_hand():
    _, table = analyzed("gpt")
    blk = table.layers[1]
    bs = B * S
    assert blk.fwd_gemms == [
        Gemm(bs, 64, 64, 1, 3, "n"),  # q, k, v: column parallel
        Gemm(S, S, 16, 4 * B * (S + 1) / (2 * S), 1, "batch"),  # Q Kᵀ, per head, causal: (s + 1) / 2s kept
        Gemm(S, 16, S, 4 * B * (S + 1) / (2 * S), 1, "batch"),  # P V
        Gemm(bs, 64, 64, 1, 1, "k"),  # out projection: row parallel
        Gemm(bs, 256, 64, 1, 1, "n"),  # fc1
        Gemm(bs, 64, 256, 1, 1, "k"),  # fc2
    ]
    assert Gemm(256, 64, bs, 1, 1, "m") in blk.bwd_gemms  # fc1's weight gradient gᵀ x: out x in
    assert Gemm(64, 256, bs, 1, 1, "n") in blk.bwd_gemms  # fc2's: in (256) is n
    head = table.layers[-1]
    assert head.fwd_gemms == [Gemm(bs, 128, 64, 1, 1, "n")]  # vocab parallel


@pytest.mark.parametrize("spec", list(SPECS), ids=IDS)
def test_fused_attention_is_its_batched_products(spec):
    tr, _ = analyzed(spec)
    [sdpa, *_] = [n for n in tr.gm.graph.nodes if n.op == "call_function" and "scaled_dot_product" in str(n.target)]
    q, k, v = ([to_expr(x, tr.symbols) for x in a.meta["val"].shape] for a in sdpa.args[:3])
    b, heads, s_q, d = q
    s_k, d_v = k[-2], v[-1]
    batch = sympy.expand(b * heads) * sdpa.meta["mask"].priced_density(s_q)  # b x query heads (x causal density)
    shape = lambda g: (g.m, g.n, g.k, g.batch)  # noqa: E731
    fwd, bwd = sdpa.meta["fwd_gemms"], sdpa.meta["bwd_gemms"]
    # S = Q Kᵀ, O = P V; backward dV = Pᵀ dO, dP = dO Vᵀ, dQ = dS K, dK = dSᵀ Q (no Q Kᵀ recompute)
    assert [shape(g) for g in fwd] == [(s_q, s_k, d, batch), (s_q, d_v, s_k, batch)]
    assert [shape(g) for g in bwd] == [
        (s_k, d_v, s_q, batch),
        (s_q, s_k, d_v, batch),
        (s_q, d, s_k, batch),
        (s_k, d, s_q, batch),
    ]
    assert all(g.operands == ("x", "x") for g in fwd + bwd)
    assert _total_calls(fwd) == sympy.expand(sdpa.meta["fwd_flops"])
    assert _total_calls(bwd) == sympy.expand(sdpa.meta["bwd_flops"]) == sympy.expand(2 * sdpa.meta["fwd_flops"])
    assert sdpa.meta["tp"].fwd_gemm_dims == ["batch"] * 2 and sdpa.meta["tp"].bwd_gemm_dims == ["batch"] * 4


def _total_calls(calls) -> sympy.Expr:
    return sympy.expand(sum((c.flops for c in calls), sympy.Integer(0)))


def test_llama_attention_batch_counts_the_query_heads():
    # both symbolic in b and s: the factory's example (2 x 16) must not pin them (F.pad in its loss)
    # both build an explicit causal mask, lowered to is_causal (passes.causal_rewrite), so their
    # products are priced at the causal density (s + 1) / 2s, as the GPT's
    causal = 4 * B * (S + 1) / (2 * S)
    for spec, batch, s, d in ((LLAMA, causal, S, 8), ("hf:llama", causal, S, 16)):
        blk = analyzed(spec)[1].layers[1]
        att = [g for g in blk.fwd_gemms if g.tp_dim == "batch"]
        assert {sympy.simplify(g.batch - batch) for g in att} == {0}  # b x 4 query heads (2 kv heads broadcast)
        assert {(g.m, g.n, g.k) for g in att} == {(s, s, d), (s, d, s)}


def test_shapes_survive_json_numeric_and_the_cache(tmp_path, monkeypatch):
    _, table = analyzed("gpt")
    back = LayerTable.from_json(table.to_json())
    assert [lay.fwd_gemms for lay in back.layers] == [lay.fwd_gemms for lay in table.layers]
    assert [lay.bwd_gemms for lay in back.layers] == [lay.bwd_gemms for lay in table.layers]
    assert back.numeric(3, 20) == table.numeric(3, 20)
    row = table.numeric(3, 20)[1]
    assert row["fwd_gemms"][0] == Gemm(60.0, 64.0, 64.0, 1.0, 3, "n")
    assert sum(g.flops for g in row["fwd_gemms"]) == pytest.approx(row["fwd_flops"], rel=1e-12)
    # a table written before the shapes existed reads back without them
    old = table.to_json().replace('"fwd_gemms"', '"x_fwd_gemms"').replace('"bwd_gemms"', '"x_bwd_gemms"')
    assert all(lay.fwd_gemms == [] for lay in LayerTable.from_json(old).layers)
    # the pickled cache entry keeps them, and rejects a malformed one
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path))
    cache.store_table("k", table)
    got = cache.load_table("k")
    assert got is not None and got.layers == table.layers and got.numeric(3, 20) == table.numeric(3, 20)
    bad = LayerTable(layers=[lay for lay in table.layers], dtype=table.dtype, model=table.model)
    bad.layers[1] = type(bad.layers[1])(**{**bad.layers[1].__dict__, "fwd_gemms": [(1, 2, 3, 4, 1, None)]})
    cache.store_table("bad", bad)
    assert cache.load_table("bad") is None
