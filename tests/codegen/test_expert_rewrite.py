"""Routed experts in compiled stages (``codegen.expert_rewrite``): dispatch before the first expert
product, combine after the last, the manifest's expert entries; refusals that say what to change.

Compiled stages run here in one process (no process group: ``runtime.moe.dispatch`` exchanges
nothing), which checks the rewrite's wiring exactly: same loss and gradients as the stage compiled
without it. The exchange itself is ``tests/runtime/test_moe_dispatch.py``'s; whole runs over ranks
are ``tests/e2e/test_moe.py``'s.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch

from codegen.codegen_errors import CodegenError
from planner.commands.compile import compile_plan
from planner.frontend.zoo import ModelSizes, build_model
from runtime.moe import LOAD
from tests.helpers import make_plan, run_stages_in_process

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
EXPERTS, TOP_K, MBS, SEQ = 4, 2, 2, 16


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("mixtral")
    tf.MixtralConfig(num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, **SIZES).save_pretrained(path)
    return f"hf:{path}"


def _plan(spec: str, *, ep: int = 1, capacity: float | None = None, dp: int = 2, moe: bool = True, **pins):
    """A hand-pinned plan; ``moe``: with the ``model.moe`` facts the planner fills for an MoE model."""
    plan = make_plan(spec, {"layers": 2, "seq_len": SEQ}, mbs=MBS, m=pins.get("pp", 1), dp=dp, **pins)
    if moe:
        plan.model.moe = dict(layers=[1, 2], experts=EXPERTS, top_k=TOP_K, shared_experts=0, capacity_factor=capacity)
    return dataclasses.replace(plan, expert_parallel=ep)


@functools.lru_cache(maxsize=None)
def _weights_and_inputs(spec: str):
    bundle = build_model(spec, ModelSizes(layers=2), seed=3)
    torch.manual_seed(4)
    ids = torch.randint(0, 96, (MBS, SEQ))
    return bundle.model, {"input_ids": ids, "labels": ids.clone(), "tokens": ids, "targets": ids.clone()}


def _run(folder: str, manifest: dict, spec: str):
    """The compiled stages' loss in this process, on the model's weights."""
    model, inputs = _weights_and_inputs(spec)
    state = {k: v.detach().clone() for k, v in [*model.named_parameters(), *model.named_buffers()]}
    loss, _ = run_stages_in_process(folder, manifest, state, inputs)
    return loss.detach()


def test_ep2_stage_dispatches_and_combines_each_routed_layer(mixtral, tmp_path):
    """The generated layer reads like the math: dispatch the sorted rows with their counts, run
    the expert products on the local rows and offsets, combine. The stage allocates its rank's
    ``E / ep`` experts; the manifest marks the expert weights with their full ``[E, ...]`` shape
    (what checkpoints and the loader cut from) and records the degree. (The exchange runs over
    ranks: ``tests/e2e/test_moe.py``.)"""
    plain = compile_plan(_plan(mixtral, moe=False), str(tmp_path / "ep1"))
    cut = compile_plan(_plan(mixtral, ep=2), str(tmp_path / "ep2"))
    assert "expert_parallel" not in plain
    assert cut["expert_parallel"] == {"degree": 2, "experts": EXPERTS, "capacity_factor": None}
    params = cut["stages"][0]["params"]
    experts = {entry["fqn"]: entry["shape"] for entry in params.values() if entry.get("expert")}
    assert experts == {
        f"inner.model.layers.{i}.mlp.experts.{name}": shape
        for i in (0, 1)
        for name, shape in (("gate_up_proj", [EXPERTS, 2 * 64, 32]), ("down_proj", [EXPERTS, 32, 64]))
    }
    assert not any("expert" in entry for entry in plain["stages"][0]["params"].values())
    assert {k: e for k, e in params.items() if not e.get("expert")} == {
        k: e for k, e in plain["stages"][0]["params"].items() if "experts" not in e["fqn"]
    }
    source = (tmp_path / "ep2" / "stage_0.py").read_text()  # both blocks share the class Block
    dispatch = "dispatched = runtime_moe_exchange_dispatch(to_dtype_6, histc_default, 4, capacity_factor = None)"
    assert source.count(dispatch) == 1
    assert source.count("runtime_portable_grouped_mm(local_rows, ") == 1
    assert source.count(", local_offsets)") == 2
    assert source.count("combined = runtime_moe_exchange_combine(grouped_mm_fallback_default_1, routing)") == 1
    assert "from runtime.moe.exchange import dispatch as runtime_moe_exchange_dispatch" in source
    assert "self.mlp_experts_gate_up_proj = torch.nn.Parameter(torch.empty((2, 128, 32)" in source
    assert "self.mlp_experts_down_proj = torch.nn.Parameter(torch.empty((2, 32, 64)" in source
    plain_source = (tmp_path / "ep1" / "stage_0.py").read_text()
    assert "runtime.moe" not in plain_source and "torch.empty((4, 128, 32)" in plain_source


def _hand_count_dropped(spec: str, capacity: float) -> tuple[int, int]:
    """(rows dropped, rows routed) by ``capacity`` in each routed layer, from the HF model's own
    router logits: an expert keeps ``ceil(F * rows / E)`` of its rows."""
    model, inputs = _weights_and_inputs(spec)
    hf = model.inner
    with torch.no_grad():
        out = hf(input_ids=inputs["input_ids"], output_router_logits=True)
    dropped = routed = 0
    for logits in out.router_logits:
        ids = torch.topk(logits, TOP_K, dim=-1).indices.flatten()
        counts = torch.bincount(ids, minlength=EXPERTS).tolist()
        cap = math.ceil(capacity * len(ids) / EXPERTS)
        dropped += sum(max(0, c - cap) for c in counts)
        routed += len(ids)
    return dropped, routed


def test_capacity_drops_what_a_hand_count_drops(mixtral, tmp_path):
    """Capacity without expert parallelism still rewrites: each expert keeps ``ceil(F S / E)``
    rows, and the dispatch's count of dropped rows equals the count made from the router's
    logits. A factor no expert reaches drops nothing and keeps the loss."""
    dropped, routed = _hand_count_dropped(mixtral, 0.5)
    assert 0 < dropped < routed
    man = compile_plan(_plan(mixtral, capacity=0.5, dp=1), str(tmp_path / "cap"))
    assert man["expert_parallel"] == {"degree": 1, "experts": EXPERTS, "capacity_factor": 0.5}
    LOAD.reset()
    loss_cap = _run(str(tmp_path / "cap"), man, mixtral)
    assert LOAD.tokens_dropped == dropped and sum(sum(v) for v in LOAD.per_expert.values()) == routed
    roomy = compile_plan(_plan(mixtral, capacity=float(EXPERTS), dp=1), str(tmp_path / "roomy"))
    plain = compile_plan(_plan(mixtral, dp=1, moe=False), str(tmp_path / "plain"))
    LOAD.reset()
    loss_roomy = _run(str(tmp_path / "roomy"), roomy, mixtral)
    assert LOAD.tokens_dropped == 0
    loss_plain = _run(str(tmp_path / "plain"), plain, mixtral)
    torch.testing.assert_close(loss_roomy, loss_plain, rtol=1e-6, atol=0)
    assert not torch.allclose(loss_cap, loss_plain)
    LOAD.reset()


def test_replicated_experts_dispatch_in_place_to_count_the_load(mixtral, tmp_path):
    """An MoE plan at ep 1, dropless: the regions still call dispatch (which moves nothing) so the
    metrics see the tokens per expert; the loss is the traced graph's. A model without MoE facts in
    its plan compiles as traced."""
    counted = compile_plan(_plan(mixtral, dp=1), str(tmp_path / "counted"))
    assert counted["expert_parallel"] == {"degree": 1, "experts": EXPERTS, "capacity_factor": None}
    assert "torch.empty((4, 128, 32)" in (tmp_path / "counted" / "stage_0.py").read_text()
    plain = compile_plan(_plan(mixtral, dp=1, moe=False), str(tmp_path / "plain"))
    LOAD.reset()
    loss = _run(str(tmp_path / "counted"), counted, mixtral)
    _, routed = _hand_count_dropped(mixtral, 1.0)
    assert LOAD.calls == 2 and sum(LOAD.per_expert[EXPERTS]) == routed and LOAD.tokens_dropped == 0
    torch.testing.assert_close(loss, _run(str(tmp_path / "plain"), plain, mixtral), rtol=1e-6, atol=0)
    LOAD.reset()


def test_compiled_layers_run_the_dispatch_eagerly(mixtral, tmp_path):
    """``plan.compile`` (torch.compile of each layer class): the dispatch and combine are graph
    breaks (``runtime.stages.compile_layers``), so a capacity-limited stage compiled with
    ``aot_eager`` drops and counts what the eager stage does, with the same loss and gradients."""
    from runtime.stages.compile_layers import compile_counts, compile_stage
    from runtime.stages.compiled_stages import load_stage_module, load_weights

    plan = dataclasses.replace(_plan(mixtral, capacity=0.5, dp=1), compile=True)
    man = compile_plan(plan, str(tmp_path / "c"))
    model, inputs = _weights_and_inputs(mixtral)
    state = {k: v.detach().clone() for k, v in [*model.named_parameters(), *model.named_buffers()]}
    results = []
    for compiled in (False, True):
        module = load_stage_module(str(tmp_path / "c"), man["stages"][0])
        load_weights(module, man["stages"][0], state)
        if compiled:
            before = compile_counts()
            compile_stage(module, "aot_eager")
        LOAD.reset()
        loss = module(*[inputs[name] for name in man["stages"][0]["data_inputs"]])
        loss.backward()
        results.append((loss.detach(), LOAD.tokens_dropped, {n: p.grad for n, p in module.named_parameters()}))
    (eager, dropped, grads), (fast, fast_dropped, fast_grads) = results
    after = compile_counts()  # Pre, Block (around its two breaks: dispatch, combine) and Post compiled
    assert after["frames"] > before["frames"] and after["graph_breaks"] >= before["graph_breaks"] + 2
    assert dropped == fast_dropped == _hand_count_dropped(mixtral, 0.5)[0]
    torch.testing.assert_close(fast, eager, rtol=1e-5, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(fast_grads[name], grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    LOAD.reset()


def test_ep_with_tp_and_pp_compiles_the_rewrite_in_each_stage(mixtral, tmp_path):
    """Under tp2 the experts stay whole (attention splits) and the regions are rewritten after
    the tp analysis; under pp2 each stage rewrites its own routed layer."""
    tp = compile_plan(_plan(mixtral, ep=2, tp=2), str(tmp_path / "tp"))
    assert tp["expert_parallel"]["degree"] == 2
    assert all(entry["shard"] is None for entry in tp["stages"][0]["params"].values() if entry.get("expert"))
    assert (tmp_path / "tp" / "stage_0.py").read_text().count("runtime_moe_exchange_combine(") == 1
    pp = compile_plan(_plan(mixtral, ep=2, pp=2), str(tmp_path / "pp"))
    for k, stage in enumerate(pp["stages"]):
        assert sum(bool(e.get("expert")) for e in stage["params"].values()) == 2
        assert (tmp_path / "pp" / f"stage_{k}.py").read_text().count("runtime_moe_exchange_dispatch(") == 1


def test_gpt_oss_bias_is_gathered_by_each_rows_local_expert(tmp_path):
    """GPT-OSS adds ``bias[sorted expert ids]`` after its first expert product: the rewrite gathers
    this rank's rows of the bias by the local expert of each dispatched row, and cuts the bias
    with the experts. At ep 1 (nothing moves) the stage computes the traced graph's loss."""
    oss = tmp_path / "gpt_oss"
    tf.GptOssConfig(num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, head_dim=8, **SIZES).save_pretrained(oss)
    spec = f"hf:{oss}"
    cut = compile_plan(_plan(spec, ep=2), str(tmp_path / "ep2"))
    experts = {e["fqn"].rsplit(".", 1)[1]: e["shape"] for e in cut["stages"][0]["params"].values() if e.get("expert")}
    assert experts == {
        "gate_up_proj": [EXPERTS, 32, 128],
        "down_proj": [EXPERTS, 64, 32],
        "gate_up_proj_bias": [4, 128],
    }
    source = (tmp_path / "ep2" / "stage_0.py").read_text()
    assert source.count("local_expert_ids = runtime_moe_exchange_local_expert_ids(local_offsets)") == 1
    assert "self.mlp_experts_gate_up_proj_bias = torch.nn.Parameter(torch.empty((2, 128)" in source
    counted = compile_plan(_plan(spec, dp=1), str(tmp_path / "counted"))
    plain = compile_plan(_plan(spec, dp=1, moe=False), str(tmp_path / "plain"))
    LOAD.reset()
    loss = _run(str(tmp_path / "counted"), counted, spec)
    assert LOAD.calls == 2
    torch.testing.assert_close(loss, _run(str(tmp_path / "plain"), plain, spec), rtol=1e-6, atol=0)
    LOAD.reset()


def test_refusals_name_what_to_change(mixtral, tmp_path):
    """A plan the rewrite cannot honour fails at compile time with what to change: a model
    without routed experts."""
    llama = tmp_path / "llama"
    tf.LlamaConfig(**SIZES).save_pretrained(llama)
    with pytest.raises(CodegenError, match="has no routed-expert layer.*plan with --ep 1"):
        compile_plan(_plan(f"hf:{llama}", ep=2), str(tmp_path / "l"))
