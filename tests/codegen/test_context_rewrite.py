"""codegen.context_rewrite: a context-parallel plan compiles into stages that call
runtime.context_parallel for every attention core, the sequence positions and the loss; a mask
that is no function of positions is refused, naming the node and what to do; and the compiled
stages, imported without a mesh, are the plain one-process computation at the local length."""

from __future__ import annotations

import os

import pytest
import torch

from codegen.codegen_errors import CodegenError
from planner.commands.compile import compile_plan
from planner.commands.train import original_state
from planner.frontend.spec import ModelSizes
from planner.frontend.zoo import build_model
from planner.plan import Plan
from runtime.data_parallel.engine_config import CompressionConfig
from runtime.data_parallel.offload_engine import OffloadConfig
from runtime.stages.compiled_stages import CompiledError
from runtime.training.trainer import context_degree
from tests.cp_plans import cp_plan
from tests.helpers import TESTS, run_stages_in_process

pytest.importorskip("transformers")

CP_MODELS = os.path.join(TESTS, "fixtures", "cp_models.py")
SEQ = 128


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    plan = cp_plan(f"{CP_MODELS}:qwen2_sliding", cp=2, method="ulysses", seq_len=SEQ, global_batch=2)
    out = str(tmp_path_factory.mktemp("cp_compile"))
    return plan, out, compile_plan(plan, out)


def test_stages_call_the_context_parallel_runtime(compiled):
    plan, out, manifest = compiled
    source = open(os.path.join(out, manifest["stages"][0]["file"])).read()
    assert "from runtime.context_parallel.entry import attention" in source
    assert "scaled_dot_product_attention" not in source  # every core goes through the runtime
    # the sliding layer keeps the config's window, the other layer is causal
    assert "causal = True, window = 48" in source and "causal = True, window = None" in source
    assert "positions(64" in source and "targets(input_ids, shift = True" in source
    assert manifest["context_parallel"] == {
        "degree": 2,
        "method": "ulysses",
        "seq_len": SEQ,
        "local_seq_len": SEQ // 2,
        "attention_cores": 2,
        "positions": 1,
        "loss": {"input": "input_ids", "shift": True, "ignore_index": -100, "dropped_last_logit": False},
    }
    assert manifest["plan"]["context_parallel"] == {"degree": 2, "method": "ulysses"}


def test_compiled_stage_without_a_mesh_is_the_model_at_the_local_length(compiled):
    """Without context parallelism the entry points are the traced computation: the stage run in
    this process on 64 positions gives the HF model's own loss and gradients at 64 positions."""
    plan, out, manifest = compiled
    model = build_model(plan.model.spec, ModelSizes(**plan.model.sizes), seed=0).model
    ids = torch.randint(0, 96, (1, SEQ // 2), generator=torch.Generator().manual_seed(3))
    state = original_state(plan.model.spec, dict(plan.model.sizes), plan.seq_len, 0)
    loss, _ = run_stages_in_process(out, manifest, state, {"input_ids": ids})
    expected = model(ids)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_a_document_mask_is_refused_naming_the_node(tmp_path):
    plan = cp_plan(f"{CP_MODELS}:document_mask", cp=2, method="ring", seq_len=SEQ, global_batch=2)
    with pytest.raises(CodegenError, match=r"cannot split the attention of node '.*scaled_dot_product.*'.*custom mask"):
        compile_plan(plan, str(tmp_path))


def test_eager_attention_is_refused_saying_what_to_export(tmp_path):
    plan = cp_plan(f"{CP_MODELS}:eager_attention", cp=2, method="all-gather", seq_len=SEQ, global_batch=2)
    with pytest.raises(CodegenError, match=r"eager \(matmul-softmax\) attention of node .*attn_implementation='sdpa'"):
        compile_plan(plan, str(tmp_path))


def test_compile_refuses_offload_with_context_parallelism(compiled, tmp_path):
    plan, _, _ = compiled
    offloaded = Plan.from_dict({**plan.to_dict(), "zero_stage": 3, "offload": {"optimizer": "cpu", "params": "none"}})
    with pytest.raises(
        CodegenError, match=r"context parallelism \(cp=2, ulysses\) with offload .*plan without offload"
    ):
        compile_plan(offloaded, str(tmp_path))


def test_the_trainer_refuses_what_context_parallelism_does_not_combine_with(compiled):
    _, _, manifest = compiled
    none = CompressionConfig()
    assert context_degree(manifest, OffloadConfig(), none) == 2
    with pytest.raises(CompiledError, match="offload is not supported; plan without offload"):
        context_degree(manifest, OffloadConfig(optimizer="cpu"), none)
    with pytest.raises(CompiledError, match="onebit-adam compression is not supported"):
        context_degree(manifest, OffloadConfig(), CompressionConfig(method="onebit-adam", warmup_steps=1))
    stale = {**manifest, "context_parallel": {}}
    with pytest.raises(CompiledError, match="recompile the plan"):
        context_degree(stale, OffloadConfig(), none)
