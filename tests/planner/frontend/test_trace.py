"""planner.frontend.trace and passes.layer_table: export, repeated-block reuse, symbolic sizes, errors.

Tiny models only (2-4 blocks of width 64, vocabulary 128, sequence 32), all on the meta device.
"""

from __future__ import annotations

import dataclasses

import pytest
import sympy
import torch

from passes.common import B, S
from passes.layer_table import EXPR_FIELDS, INT_FIELDS, LayerTable
from passes.tabulate import table_from_traced
from planner.errors import UserError
from planner.frontend.model_analysis import build_layer_table
from planner.frontend.trace import _blocks_reading, _shared_across_blocks, find_block_container, trace_model
from tests.fixtures.user_models import SharedBlocks

TINY = dict(hidden=64, heads=4, vocab=128)
ARCHS = {
    "gpt": dict(layers=3, **TINY),  # 3 blocks: traced shallow (2) and expanded
    "hf:gpt2": dict(layers=2, ffn=128, **TINY),
    "hf:llama": dict(layers=2, ffn=128, kv_heads=2, **TINY),
    "hf:bert": dict(layers=2, ffn=128, **TINY),
}
NAMES = {
    "gpt": ["embed", "blocks.0", "blocks.1", "blocks.2", "head"],
    "hf:gpt2": [
        "inner.transformer.wpe+inner.transformer.wte",
        "inner.transformer.h.0",
        "inner.transformer.h.1",
        "inner.lm_head+inner.transformer.ln_f",
    ],
    "hf:llama": [
        "inner.model.embed_tokens",
        "inner.model.layers.0",
        "inner.model.layers.1",
        "inner.lm_head+inner.model.norm",
    ],
    "hf:bert": [
        "inner.bert.embeddings",
        "inner.bert.encoder.layer.0",
        "inner.bert.encoder.layer.1",
        "inner.cls.predictions",
    ],
}
_CACHE: dict[str, tuple] = {}


def traced_table(spec: str):
    """(Traced, LayerTable) of a tiny model at example size b=2, s=32; cached per module."""
    if spec not in _CACHE:
        tr = trace_model(spec, batch=2, seq_len=32, **ARCHS[spec])
        _CACHE[spec] = (tr, table_from_traced(tr))
    return _CACHE[spec]


def table(spec: str) -> LayerTable:
    return traced_table(spec)[1]


def assert_rows_equal(a, b):
    assert len(a.layers) == len(b.layers)
    for x, y in zip(a.layers, b.layers):
        assert (x.index, x.name, x.kind) == (y.index, y.name, y.kind)
        for f in EXPR_FIELDS:
            assert sympy.expand(getattr(x, f) - getattr(y, f)) == 0, (x.name, f)
        for f in INT_FIELDS:
            assert getattr(x, f) == getattr(y, f), (x.name, f)
        assert x.boundary == y.boundary, x.name


@pytest.mark.parametrize("spec", list(ARCHS))
def test_layer_count_and_names(spec):
    t = table(spec)
    L = ARCHS[spec]["layers"]
    assert len(t.layers) == L + 2
    assert [lay.name for lay in t.layers] == NAMES[spec]
    assert [lay.kind for lay in t.layers] == ["pre"] + ["block"] * L + ["post"]
    assert len({lay.signature for lay in t.layers[1:-1]}) == 1
    assert t.model["layers"] == L and t.model["hidden"] == 64 and t.model["vocab"] == 128
    assert t.fixed == {}
    # every cost is a polynomial in b and s only
    for lay in t.layers:
        for f in EXPR_FIELDS:
            assert getattr(lay, f).free_symbols <= {B, S}, (lay.name, f)


def test_block_container_is_found_generically():
    from planner.frontend.zoo import ModelSizes, build_model

    for spec, path in [("gpt", "blocks"), ("hf:llama", "inner.model.layers"), ("hf:bert", "inner.bert.encoder.layer")]:
        m = build_model(spec, ModelSizes(**ARCHS[spec]), device="meta").model
        container, blocks = find_block_container(m)
        assert container == path
        assert blocks == [f"{path}.{j}" for j in range(ARCHS[spec]["layers"])]


def test_a_mixed_module_list_is_one_block_sequence():
    """A ``ModuleList`` is what a model loops over: every child is a block whatever its type (a
    hybrid stack such as Jamba's Mamba and attention layers); a ``Sequential`` keeps only the
    children of its most common type (it may hold the embedding and the head too)."""
    import torch.nn as nn

    hybrid = nn.Module()
    hybrid.layers = nn.ModuleList([nn.Linear(4, 4), nn.Conv1d(4, 4, 1), nn.Linear(4, 4), nn.GRU(4, 4)])
    assert find_block_container(hybrid) == ("layers", ["layers.0", "layers.1", "layers.2", "layers.3"])
    seq = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.LayerNorm(4))
    assert find_block_container(seq) == ("", ["1", "2"])


def test_shallow_trace_expands_to_the_full_trace():
    tr, shallow = traced_table("gpt")
    assert tr.shallow and tr.layers == 3 and tr.block_paths == ["blocks.0", "blocks.1"]
    assert sum(1 for n in tr.gm.graph.nodes if "scaled_dot_product" in str(n.target)) == 2
    full = build_layer_table("gpt", batch=2, seq_len=32, shallow=False, **ARCHS["gpt"])
    assert_rows_equal(shallow, full)
    assert shallow.model["params"] == full.model["params"]


def test_a_hybrid_is_traced_as_its_first_blocks_of_each_kind(tmp_path):
    """DeepSeek-V3 (dense blocks, then experts) and Llama-4 (dense and expert blocks in turn) are
    traced as their first blocks holding each kind, the last of the model's last kind (Llama-4's
    rotary and plain expert blocks differ: 8 of 12): their tables equal the trace of every block,
    row by row (a 61-block DeepSeek-V3 traces 5). Two differences, by design: the last block
    keeps its own sequence-parallel collectives (it hands the head its rows, as a shallow trace's
    last block does), where the trace of every block gives it the costs of the first block alike;
    a block hands on what its twin among the first blocks does, which may include the rotary
    tables no later block of the model reads (Llama-4's last blocks have none): bytes per
    position, never per sequence."""
    transformers = pytest.importorskip("transformers")
    from tests.moe_configs import moe_configs

    sizes = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    sizes.update(vocab_size=96, max_position_embeddings=64)
    deepseek = moe_configs(transformers, {**sizes, "num_hidden_layers": 6})["deepseek_v3"]()
    llama4 = transformers.Llama4TextConfig(
        num_hidden_layers=12, num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2, head_dim=8,
        intermediate_size_mlp=64, **sizes,
    )  # fmt: skip
    for name, config, traced_blocks in (("deepseek", deepseek, 3), ("llama4", llama4, 8)):
        config.save_pretrained(tmp_path / name)
        spec = f"hf:{tmp_path / name}"
        prefix = build_layer_table(spec, batch=2, seq_len=16, dtype="fp32")
        assert f"traced its first {traced_blocks}" in " ".join(prefix.notes)
        every = build_layer_table(spec, batch=2, seq_len=16, dtype="fp32", shallow=False)
        last = len(every.layers) - 2
        for mine, theirs in zip(prefix.layers[1:last], every.layers[1:last]):
            extra = sympy.expand(mine.boundary_bytes - theirs.boundary_bytes)
            assert extra.coeff(B) == 0 and extra.subs(S, 1) >= 0, (mine.name, extra)
            mine.boundary_bytes, mine.boundary = theirs.boundary_bytes, theirs.boundary
        for table in (prefix, every):
            table.layers[last] = dataclasses.replace(
                table.layers[last], **{f: 0 for f in (*EXPR_FIELDS, *INT_FIELDS) if "sp_" in f or f.endswith("_sp")}
            )
        assert_rows_equal(prefix, every)
        assert prefix.model["params"] == every.model["params"] and prefix.model.get("moe") == every.model.get("moe")


@pytest.mark.parametrize("spec", ["gpt", "hf:llama"])
def test_symbolic_costs_equal_a_fresh_static_trace(spec):
    symbolic = table(spec)
    b, s = 3, 20
    static = build_layer_table(spec, batch=b, seq_len=s, dynamic=False, **ARCHS[spec])
    for lay in static.layers:  # traced at fixed sizes: plain numbers
        for f in EXPR_FIELDS:
            assert getattr(lay, f).free_symbols == set()
    got, want = symbolic.numeric(b, s), static.numeric(b, s)
    # Operator counts may differ by the shape code a dynamic trace keeps (llama: 2 per layer),
    # and its backward bytes by that code's backward (llama: a slice of the rotary table whose
    # static twin is a no-op, so its slice_backward copies a few % more: 6% on the small post layer).
    for g, w in zip(got, want):
        g_ops, w_ops = g.pop("num_ops"), w.pop("num_ops")
        assert abs(g_ops - w_ops) <= 2 and w_ops > 0
        for f in ("bwd_bytes", "bwd_bytes_tp", "bwd_bytes_sp"):
            gb, wb = g.pop(f), w.pop(f)
            assert wb <= gb <= 1.1 * wb, (f, gb, wb)
    assert got == want
    assert [lay.boundary for lay in static.layers] == [
        [(tuple(sympy.sympify(e).subs({B: b, S: s}) for e in shape), dt) for shape, dt in lay.boundary]
        for lay in symbolic.layers
    ]


def test_table_json_round_trip_and_numeric():
    t = table("gpt")
    back = LayerTable.from_json(t.to_json())
    assert_rows_equal(t, back)
    assert back.model == t.model and back.dtype == "float32"
    for b, s in [(1, 1), (4, 17), (8, 2048)]:
        assert back.numeric(b, s) == t.numeric(b, s)
        rows = t.numeric(b, s)
        for lay, row in zip(t.layers, rows):
            assert row["fwd_flops"] == float(lay.fwd_flops.subs({B: b, S: s}))
    assert t.total("param_count", 1, 1) == t.model["params"]
    with pytest.raises(KeyError):
        t.total("no_such_field", 1, 1)


def test_hf_gpt2_tied_embedding_counted_once():
    from planner.frontend.zoo import ModelSizes, build_model

    t = table("hf:gpt2")
    m = build_model("hf:gpt2", ModelSizes(**ARCHS["hf:gpt2"]), device="meta").model
    unique = {id(p): p for p in m.parameters()}
    assert t.model["params"] == sum(p.numel() for p in unique.values())
    # the shared wte/lm_head weight lives with its first user, the embedding (row 0)
    assert t.layers[0].param_count == (128 + 1024) * 64
    assert t.layers[-1].param_count == 2 * 64  # ln_f only


FACTORY_OK = """
import torch, torch.nn as nn, torch.nn.functional as F

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))

class Net(nn.Module):
    def __init__(self, vocab=50, d=16, n=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(n))
        self.out = nn.Linear(d, vocab)

    def forward(self, ids, labels):
        x = self.emb(ids)
        for blk in self.layers:
            x = blk(x)
        return F.cross_entropy(self.out(x).flatten(0, 1), labels.flatten())

def make():
    ids = torch.randint(0, 50, (1, 12))
    return Net(), (ids, ids.clone())
"""
FACTORY_BAD = """
import torch, torch.nn as nn

class Bad(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:
            y = y * 2
        return y.mean()

def make():
    return Bad(), (torch.randn(4, 6, 8),)
"""


def test_file_factory_traced_in_full_with_identical_blocks(tmp_path):
    from torch.utils.flop_counter import FlopCounterMode

    path = tmp_path / "net.py"
    path.write_text(FACTORY_OK)
    t = build_layer_table(f"{path}:make")
    assert [lay.name for lay in t.layers] == ["emb", "layers.0", "layers.1", "layers.2", "out"]
    blocks = t.layers[1:-1]
    assert len({lay.signature for lay in blocks}) == 1
    assert all(lay.fwd_flops == blocks[0].fwd_flops for lay in blocks)
    # traced at batch 1 -> re-traced at 2 so that b stays symbolic; s is the example's 12
    assert t.fixed == {}
    fwd = t.total("fwd_flops", 1, 12)
    import importlib.util

    spec = importlib.util.spec_from_file_location("net_mod", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model, (ids, labels) = mod.make()
    with FlopCounterMode(display=False) as fc:
        model(ids, labels).backward()
    total = t.total("fwd_flops", 1, 12) + t.total("bwd_flops", 1, 12)
    assert total == fc.get_total_flops()
    assert fwd == 2 * 12 * (3 * (16 * 32 * 2) + 16 * 50)
    assert t.model["params"] == sum(p.numel() for p in model.parameters())


def test_unexportable_model_names_the_source_line(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text(FACTORY_BAD)
    with pytest.raises(UserError) as err:
        trace_model(f"{path}:make")
    msg = str(err.value)
    assert f"{path}:11" in msg and "if y.sum() > 0:" in msg
    assert "torch.where" in msg and "torch.cond" in msg
    assert "def forward(self" not in msg and len(msg.splitlines()) <= 6


def test_a_loop_over_shared_blocks_is_refused_at_plan_time(tmp_path):
    """A forward that runs its blocks twice (weight-shared recurrence, as HRM and Dory do) cannot
    be split into stages of blocks that each run once: the plan says so instead of planning a
    model that compile then refuses. The same model looping once traces."""
    path = tmp_path / "looped.py"
    path.write_text(FACTORY_OK.replace("        for blk in self.layers:", "        for blk in [*self.layers] * 2:"))
    with pytest.raises(UserError) as err:
        trace_model(f"{path}:make")
    msg = str(err.value)
    assert "runs layers.0 2 times (3 of its 3 blocks run more than once)" in msg
    assert "a loop over shared blocks" in msg
    path.write_text(FACTORY_OK)
    assert trace_model(f"{path}:make").block_paths == ["layers.0", "layers.1", "layers.2"]


def test_blocks_holding_one_shared_weight_count_it_once():
    """Every block holds the same linear (as Zamba's hybrid layers hold its attention block): the
    table owns it in its first reader's row and ties it to the others, so the plan's parameter
    count is the model's (the rows of alike blocks once all took the first's count, which owns
    the shared weight: a plan that compile then refused for its parameter count)."""
    table = table_from_traced(trace_model("tests/fixtures/user_models.py:shared_blocks"))
    model = SharedBlocks()
    assert table.model["params"] == sum(p.numel() for p in model.parameters())
    assert [row.param_count for row in table.layers[1:-1]] == [16 * 16 * 2 + 32] + [16 * 16 + 16] * 3
    shared = [t for t in table.tied if t["weight"].endswith("shared.weight")]
    assert shared and shared[0]["layers"] == [1, 4]
    # a zoo model of such blocks is traced whole: a shallow copy's blocks would each own it
    assert _shared_across_blocks(model) == "blocks.0.shared.weight"
    assert _blocks_reading(model, "blocks.0.shared.weight") == [f"blocks.{i}" for i in range(4)]
    assert _shared_across_blocks(nn_blocks()) is None


def nn_blocks() -> torch.nn.Module:
    """Four blocks with weights of their own."""
    return torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])


def test_bad_sizes_are_user_errors():
    with pytest.raises(UserError, match="exceeds"):
        trace_model("gpt", seq_len=4096, layers=1, **TINY)
    with pytest.raises(UserError, match="dtype"):
        trace_model("gpt", dtype="int3", layers=1, **TINY)


def test_gpt_trace_is_on_meta_and_lifts_parameters():
    tr, _table = traced_table("gpt")
    ph = [n for n in tr.gm.graph.nodes if n.op == "placeholder"]
    roles = [tr.roles[n.name] for n in ph]
    assert roles.count("input") == 2 and roles.count("param") == len(ph) - 2
    assert tr.fqns["p_blocks_0_attn_q_weight"] == "blocks.0.attn.q.weight"
    assert all(n.meta["val"].device.type == "meta" for n in ph)
    assert set(tr.symbols.values()) == {B, S}
    ids = next(n for n in ph if n.name == "input_ids").meta["val"]
    assert [tr.symbols[d.node.expr] for d in ids.shape] == [B, S]
    assert isinstance(tr.exported.module(), torch.nn.Module)


class _Scan(torch.nn.Module):
    """A recurrence stepped position by position in Python (a Mamba layer's reference scan)."""

    def __init__(self):
        super().__init__()
        self.decay = torch.nn.Parameter(torch.full((8,), 0.5))

    def forward(self, x):
        state, outputs = torch.zeros_like(x[:, 0]), []
        for position in range(x.shape[1]):
            state = state * self.decay + x[:, position]
            outputs.append(state)
        return torch.stack(outputs, 1).sum()


def test_a_graph_that_grows_with_the_sequence_is_refused_before_it_unrolls(monkeypatch):
    """A model that loops over the positions in Python would unroll its loop once per position
    (hours at 4,096): the export stops at its node budget and says why, while the same model at
    a handful of positions, and a model without the loop at any length, export."""
    from planner.errors import UserError as Refused
    from planner.frontend.trace import _export, _NodeBudget

    monkeypatch.setattr(_NodeBudget, "PER_BLOCK", 300)  # a tenth of a real block's: spent sooner
    scan = _Scan().to("meta")
    with pytest.raises(
        Refused, match=r"within 600 graph nodes for 1 blocks at 4096 positions.*grows with the sequence"
    ):
        _export(scan, (torch.ones(2, 4096, 8, device="meta"),), None, "model 'scan'", _NodeBudget(1, 4096))
    _export(scan, (torch.ones(2, 16, 8, device="meta"),), None, "model 'scan'", _NodeBudget(1, 16))
    dense = torch.nn.Linear(8, 8, device="meta")
    _export(dense, (torch.ones(2, 4096, 8, device="meta"),), None, "model 'dense'", _NodeBudget(1, 4096))
    assert torch.fx.Graph.create_node is _NodeBudget(1, 1)._create  # restored after each export
