"""Key/value heads at a tp that does not divide them: replicated when tp is a multiple of them
(each rank keeps its query heads' share), a clear error otherwise; heads of a file model read
from its graph."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from codegen.codegen_errors import TPRewriteError
from planner.commands.compile import compile_plan, model_dims
from planner.frontend.bundle import ModelBundle
from tests.helpers import manual_plan

LLAMA = {"layers": 1, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 48, "vocab": 64, "seq_len": 8}


def _compile(spec, sizes, tp, tmp_path):
    return compile_plan(manual_plan(spec, sizes, tp=tp, mbs=2), str(tmp_path))


def test_kv_heads_tp_neither_divides_nor_multiplies_is_a_clear_error(tmp_path):
    with pytest.raises(TPRewriteError, match=r"tp=2 neither divides the model's 3 key/value heads"):
        _compile("hf:llama", dict(LLAMA, hidden=48, heads=6, kv_heads=3), 2, tmp_path)


def test_one_kv_head_at_tp2_keeps_k_v_replicated(tmp_path):
    man = _compile("hf:llama", dict(LLAMA, kv_heads=1), 2, tmp_path)
    shards = {
        e["fqn"].rsplit(".", 2)[-2]: e["shard"]
        for e in man["stages"][0]["params"].values()
        if ".layers.0.self_attn." in e["fqn"]
    }
    assert shards["k_proj"] is None and shards["v_proj"] is None
    assert shards["q_proj"]["kind"] == "heads" and shards["o_proj"]["kind"] == "row"
    src = open(os.path.join(tmp_path, "stage_0.py")).read()
    assert src.count("scatter_to_tp(") == 2  # k and v: each rank keeps its query heads' share


class _Sdpa(torch.nn.Module):
    """3 query heads of 4 sharing one key/value head (SDPA with ``enable_gqa``)."""

    def __init__(self):
        super().__init__()
        self.q, self.kv = torch.nn.Linear(12, 12), torch.nn.Linear(12, 8)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 3, 4).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, 1, 4).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True).sum()


def test_model_dims_fill_heads_from_the_graph():
    gm = torch.export.export(_Sdpa(), (torch.randn(2, 5, 12),)).module()
    bundle = ModelBundle(spec="x.py:f", model=_Sdpa(), example_inputs=(), vocab=0, seq_len=5, kind="file")
    assert model_dims(bundle, {}, gm) == {"heads": 3, "kv_heads": 1, "head_dim": 4}
    stated = ModelBundle(
        spec="x.py:f", model=_Sdpa(), example_inputs=(), vocab=0, seq_len=5, heads=3, kv_heads=1, hidden=12
    )
    assert model_dims(stated, {"ffn": 0}, gm) == {"hidden": 12, "heads": 3, "kv_heads": 1, "head_dim": 4}
