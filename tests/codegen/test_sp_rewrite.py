"""Sequence parallelism in the shared tp analysis and in codegen, without processes: what is
sequence-sharded and communicated (the decisions the cost pass prices), the generated code, the
stages' shapes, and the clear error for a model SP cannot split."""

from __future__ import annotations

import dataclasses

import pytest
import sympy

from codegen.codegen_errors import TPRewriteError
from passes.analyze import analyze
from passes.common import B, S
from passes.tensor_parallel.tp_analysis import analyze_tensor_parallel
from planner.commands.compile import compile_plan
from planner.frontend.trace import trace_model
from tests.helpers import manual_plan

GPT = {"layers": 2, "hidden": 32, "heads": 4, "vocab": 51, "seq_len": 8}
GPT2 = {"layers": 1, "hidden": 32, "heads": 4, "vocab": 50, "seq_len": 8}


def _sp_plan(spec: str, sizes: dict, tp: int = 2, pp: int = 1):
    L = sizes["layers"]
    stages = [[0, L + 1]] if pp == 1 else [[0, L // 2], [L // 2 + 1, L + 1]]
    plan = manual_plan(spec, sizes, tp=tp, pp=pp, mbs=2, m=pp, stages=stages)
    return dataclasses.replace(plan, sequence_parallel=True)


def test_gpt_decisions_for_the_cost_pass():
    """On the lifted graph the planner prices (symbolic b, s): one reduce-scatter per row-parallel
    matmul and for the embedding, one all-gather per column-parallel input (q, k, v share one; the
    LM head's too), the position embedding split, the norms' and row biases' gradients all-reduced."""
    sizes = {k: v for k, v in GPT.items() if k != "seq_len"}
    tr = trace_model("gpt", batch=2, seq_len=8, dtype="fp32", **sizes)
    analyze(tr)
    dec = analyze_tensor_parallel(tr.gm, roles=tr.roles)
    assert dec.sp_blocked is None and dec.sp_seq_len == 8 and not dec.sp_replicated
    by_kind: dict[str, list] = {}
    for c in dec.sp_comms:
        by_kind.setdefault(c.kind, []).append(c)
    L, h = GPT["layers"], GPT["hidden"]
    assert len(by_kind["reduce_scatter"]) == 2 * L + 1 and len(by_kind["all_gather"]) == 2 * L + 1
    for c in by_kind["reduce_scatter"] + by_kind["all_gather"]:
        assert c.dim == 1 and sympy.simplify(c.nbytes - 4 * h * B * S) == 0, c
    assert sorted(len(c.users) for c in by_kind["all_gather"]) == [1] * (L + 1) + [3] * L
    (pos,) = by_kind["split"]  # [s, h] added to the [b, s, h] token embeddings
    assert pos.dim == 0 and pos.grad and sympy.simplify(pos.nbytes - 4 * h * S) == 0
    reduced = {tr.fqns[c.value] for c in by_kind["grad_all_reduce"]}
    norms = {f"blocks.{i}.{m}.{p}" for i in range(L) for m in ("ln1", "ln2") for p in ("weight", "bias")}
    biases = {f"blocks.{i}.{m}.proj.bias" for i in range(L) for m in ("attn", "mlp")}
    assert reduced == norms | biases | {"head.ln_f.weight", "head.ln_f.bias"}
    sharded = {n.name: d for n in tr.gm.graph.nodes if (d := dec.sp_sharded.get(n.name)) is not None}
    assert all(d == 1 for d in sharded.values())
    assert {c.value for c in by_kind["all_gather"]} <= set(sharded)  # what is gathered was sharded


def test_sp_code_and_stage_shapes(tmp_path):
    man = compile_plan(_sp_plan("gpt", GPT, pp=2), str(tmp_path))
    first, last = man["stages"]
    assert [r["shape"] for r in last["recv"]] == [[2, 4, 32]]  # S/t = 8/2 positions
    assert [s["shape"] for s in first["send"]] == [[2, 4, 32]]
    src = (tmp_path / "stage_0.py").read_text()
    assert "sequence-parallel" in src.splitlines()[1]
    assert "vocab_parallel_embedding(input_ids, tok_weight, vocab_start, sequence_dim = 1)" in src
    assert "scatter_to_tp(embedding_default_1, 0)" in src  # this rank's positions of [s, h]
    # one block: q, k and v gather their shared input once, fused with them (as fc); each row-parallel
    # product is fused with its reduce-scatter; the bias added after it, through copy_to_tp
    assert src.count("column_parallel_linears(") == 2 and src.count("linear_reduce_scatter_seq(") == 2
    assert "[attn_q_bias, attn_k_bias, attn_v_bias], sequence_dim = 1)" in src
    assert "all_gather_seq" not in src and "aten.linear" not in src
    assert "row_parallel_linear" not in src
    assert "[2, 8, 2, 8]" in src  # views inside the tensor-parallel region see every position
    tail = (tmp_path / "stage_1.py").read_text()
    assert "column_parallel_linears(layer_norm_default, [lm_head_weight], [None], sequence_dim = 1)" in tail


def test_sp_off_writes_plain_tp(tmp_path):
    plan = manual_plan("gpt", GPT, tp=2, mbs=2)
    compile_plan(plan, str(tmp_path))
    src = (tmp_path / "stage_0.py").read_text()
    assert "_seq" not in src and "sequence" not in src and "row_parallel_linear" in src


def test_gpt2_cannot_be_sequence_parallel(tmp_path):
    """GPT-2's Conv1D flattens [b, s, h] into [b * s, h] before each matmul: the rows of a rank's
    block would be a batch slice, not its positions. A clear error, naming the node."""
    with pytest.raises(TPRewriteError, match=r"sequence parallelism \(tp=2\) cannot split") as e:
        compile_plan(_sp_plan("hf:gpt2", GPT2), str(tmp_path))
    msg = str(e.value)
    assert "flattens the tokens" in msg and "'view_1'" in msg and "h.0.attn.c_attn" in msg
    assert "sequence_parallel to false" in msg
