"""Routed-expert regions read from exported graphs (``passes.expert_regions``).

Tiny transformers MoE models built from their config classes, traced as the front end traces them
(the analysis graph: parameters are placeholders) and exported as code generation exports them
(``ep.module()``: parameters are ``get_attr`` nodes); plus hand-written routed experts on
``aten._grouped_mm`` for what the zoo does not show.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from passes.expert_regions import find_expert_regions
from passes.op_class import op_name
from tests.moe_configs import moe_configs

tf = pytest.importorskip("transformers")

SIZES = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=96,
    max_position_embeddings=64,
)
CONFIGS = moe_configs(tf, SIZES)
"""The architectures read: DeepSeek-V3 with multi-head latent attention, one dense layer then one MoE
layer with a shared expert and grouped routing; GPT-OSS, whose expert bias ep cannot cut."""
EXPECT = {
    "mixtral": (4, 2, [0, 1]),
    "qwen2_moe": (4, 2, [0, 1]),
    "qwen3_moe": (8, 3, [0, 1]),
    "deepseek_v3": (4, 2, [1]),
}
"""Experts, top k and the MoE layers (block indices) of each routed-expert config above."""


@functools.lru_cache(maxsize=None)
def _model_dir(arch: str, root: str) -> str:
    path = f"{root}/{arch}"
    CONFIGS[arch]().save_pretrained(path)
    return f"hf:{path}"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("moe_configs"))


def _traced(arch: str, root: str):
    from planner.frontend.trace import trace_model

    return trace_model(_model_dir(arch, root), batch=1, seq_len=8, dtype="fp32")


def _exported(arch: str, root: str) -> torch.fx.GraphModule:
    from planner.frontend.trace import export_training_module

    return export_training_module(_model_dir(arch, root), {}, dtype="fp32", batch=2, seq_len=8)[0]


@pytest.mark.parametrize("arch", list(EXPECT))
def test_transformers_moe_layers_are_read_from_the_analysis_graph(arch, root):
    """One region per MoE layer, its routing nodes and the expert weights by FQN; shared experts
    (Qwen2-MoE's ``shared_expert``, DeepSeek's ``shared_experts``) are not routed experts."""
    traced = _traced(arch, root)
    regions = find_expert_regions(traced.gm, roles=traced.roles, fqns=traced.fqns)
    experts, top_k, layers = EXPECT[arch]
    assert [r.reason for r in regions] == [None] * len(layers)
    assert [r.module for r in regions] == [f"inner.model.layers.{i}.mlp.experts" for i in layers]
    for region, layer in zip(regions, layers):
        prefix = f"inner.model.layers.{layer}.mlp.experts"
        assert region.params == [f"{prefix}.gate_up_proj", f"{prefix}.down_proj"]
        assert (region.experts, region.top_k) == (experts, top_k)
        assert [op_name(p) for p in region.products] == ["grouped_mm_fallback"] * 2
        assert op_name(region.counts) == "histc" and op_name(region.offsets) == "cumsum"
        assert region.counts.args[1] == experts
        assert region.products[0].args[0] is region.rows
        assert all(p.args[2] is region.offsets for p in region.products)
        # rows: the hidden states gathered once per (token, chosen expert), [T * k, h]
        assert region.rows.meta["val"].shape[-1] == 32
        assert [n.meta["val"].shape[0] for n in region.param_nodes] == [experts, experts]
        assert not any("shared" in fqn for fqn in region.params)


def test_the_trainable_export_reads_the_same_regions(root):
    """Code generation's graph (``get_attr`` parameters, static sizes): the same regions, FQNs
    from the attribute targets with no ``roles`` / ``fqns`` given."""
    gm = _exported("mixtral", root)
    regions = find_expert_regions(gm)
    assert [r.params for r in regions] == [
        [f"inner.model.layers.{i}.mlp.experts.gate_up_proj", f"inner.model.layers.{i}.mlp.experts.down_proj"]
        for i in (0, 1)
    ]
    assert all(r.parallel and r.top_k == 2 and r.experts == 4 for r in regions)
    assert [tuple(r.rows.meta["val"].shape) for r in regions] == [(2 * 8 * 2, 32)] * 2
    assert all(n.op == "get_attr" for r in regions for n in r.param_nodes)


def test_a_bias_gathered_by_expert_id_is_cut_with_its_experts(root):
    """GPT-OSS adds ``bias[sorted expert ids]`` to each product's output: a per-row tensor laid
    out before the dispatch, but rebuilt after it from the bias's rows and each row's expert.
    The region lists the gather between its products and cuts the bias with the experts; the
    bias added after the last product runs on the combined rows, in the original order."""
    traced = _traced("gpt_oss", root)
    regions = find_expert_regions(traced.gm, roles=traced.roles, fqns=traced.fqns)
    assert len(regions) == 2 and all(r.parallel and r.experts == 4 and r.top_k == 2 for r in regions)
    for region in regions:
        (gather,) = region.gathers
        assert op_name(gather) == "index" and traced.fqns[gather.args[0].name].endswith("gate_up_proj_bias")
        assert [name.rsplit(".", 1)[1] for name in region.params] == ["gate_up_proj", "down_proj", "gate_up_proj_bias"]


class _Experts(nn.Module):
    """Routed experts written with ``aten._grouped_mm`` (torch's own grouped product)."""

    def __init__(self, between, experts=4, hidden=8, ffn=16, top_k=2):
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, hidden, ffn))
        self.w2 = nn.Parameter(torch.randn(experts, ffn, hidden))
        self.between, self.experts, self.top_k = between, experts, top_k

    def forward(self, x):
        ids = torch.topk(self.router(x), self.top_k).indices
        sorted_ids, perm = torch.sort(ids.flatten())
        rows = x[perm // self.top_k]
        counts = torch.histc(sorted_ids.float(), self.experts, 0, self.experts - 1)
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        h = torch._grouped_mm(rows, self.w1, offsets)
        h = self.between(h, sorted_ids)
        return torch._grouped_mm(h, self.w2, offsets).sum()


def _regions(between):
    model = _Experts(between).to(device="meta", dtype=torch.bfloat16)
    x = torch.empty(6, 8, device="meta", dtype=torch.bfloat16)
    ep = torch.export.export(model, (x,), strict=False)
    return find_expert_regions(ep.module())


def test_aten_grouped_mm_regions_and_what_is_row_wise():
    """``aten._grouped_mm`` is a grouped product; an activation between the products is row-wise,
    a mean over the rows (each row then depends on every other) is not."""
    (ok,) = _regions(lambda h, ids: torch.nn.functional.silu(h) * 2.0)
    assert ok.parallel and ok.params == ["w1", "w2"] and (ok.experts, ok.top_k) == (4, 2)
    assert op_name(ok.offsets) == "to" and op_name(ok.offsets.args[0]) == "cumsum"
    (mixed,) = _regions(lambda h, ids: h - h.mean(0))
    assert not mixed.parallel and "between the expert products" in mixed.reason
    (by_id,) = _regions(lambda h, ids: h * ids.unsqueeze(-1).to(h.dtype))
    assert not by_id.parallel and "neither computed from them nor a parameter" in by_id.reason


def test_offsets_not_counted_from_expert_ids_are_refused():
    """A grouped product whose offsets are not ``cumsum(histc(ids))`` (fixed groups, say) is not
    a routed-expert layer the runtime can dispatch: refused with the reason."""

    class Fixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 8, 8))

        def forward(self, x):
            offs = torch.arange(1, 4, device=x.device, dtype=torch.int32) * 2
            return torch._grouped_mm(x, self.w, offs).sum()

    model = Fixed().to(device="meta", dtype=torch.bfloat16)
    ep = torch.export.export(model, (torch.empty(6, 8, device="meta", dtype=torch.bfloat16),), strict=False)
    (region,) = find_expert_regions(ep.module())
    assert not region.parallel and "not cumsum(histc(expert ids))" in region.reason
