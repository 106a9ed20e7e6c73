"""Selective recompute in generated code (``codegen.selective``): a layer's attention core becomes a
checkpointed submodule. The compiled stage computes the original loss and gradients, and it keeps
the activations the layer table says the cores alone hold fewer (within the estimate's known
error: a mask the blocks share is charged to each)."""

from __future__ import annotations

import gc
import importlib.util
import inspect
import os

import pytest
import torch
from torch.testing import assert_close

from codegen.codegen_errors import LoweringError
from planner.commands.compile import compile_plan
from planner.frontend.model_analysis import build_layer_table
from runtime.stages.compiled_stages import load_stage_module, load_weights, read_manifest
from runtime.training.memtrack import StorageCounter
from tests.helpers import TESTS, manual_plan

EAGER = os.path.join(TESTS, "fixtures", "tp_models.py")
SPEC = f"{EAGER}:llama_eager"
MBS, SEQ = 2, 16


def _original():
    spec = importlib.util.spec_from_file_location("sel_models", EAGER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.llama_eager()


def _stage(tmp_path, name, **decisions):
    cdir = str(tmp_path / name)
    compile_plan(manual_plan(SPEC, {"layers": 2}, mbs=MBS, seq_len=SEQ, **decisions), cdir)
    stage = read_manifest(cdir)["stages"][0]
    module = load_stage_module(cdir, stage)
    model, inputs = _original()
    state = {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}
    state.update(dict(model.named_buffers(remove_duplicate=False)))
    load_weights(module, stage, state, 0, 1)
    named = dict(zip(inspect.signature(model.forward).parameters, inputs))
    return cdir, stage, module, [named[n] for n in stage["data_inputs"]]


def _kept_after_forward(module, args) -> tuple[torch.Tensor, int]:
    """The loss and the bytes of the storages the forward created that are still alive (the
    activations autograd keeps, and the loss)."""
    gc.collect()
    with StorageCounter(track_inputs=False) as c:
        loss = module(*args)
        gc.collect()  # temporaries caught in reference cycles are not activations
        kept = c.current
    return loss, kept


def test_selective_stage_matches_original_and_frees_the_core(tmp_path):
    cdir, stage, module, args = _stage(tmp_path, "selective", selective=(1, 2))
    src = open(os.path.join(cdir, stage["file"])).read()
    core_src = src[src.index("class AttentionCore") : src.index("class SelectiveBlock")]
    assert "softmax" in core_src and ("matmul" in core_src or "bmm" in core_src)
    assert src.count("runtime_checkpoint(attention_core_0") == 1  # one class for both blocks

    model, inputs = _original()
    ref = model(*inputs)
    ref.backward()
    loss, kept = _kept_after_forward(module, args)
    loss.backward()
    assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    for attr, e in stage["params"].items():
        if e["trainable"]:
            got = dict(module.named_parameters())[attr].grad
            assert_close(got, dict(model.named_parameters())[e["fqn"]].grad, rtol=1e-5, atol=1e-6)

    _, _, plain, args = _stage(tmp_path, "plain")
    _, kept_plain = _kept_after_forward(plain, args)
    table = build_layer_table(SPEC, seq_len=SEQ)
    rows = table.numeric(MBS, SEQ)
    freed = sum(rows[i]["core_saved_bytes"] for i in (1, 2))
    measured = kept_plain - kept
    # each block frees its softmax probabilities (8 KiB here) and keeps the attention mask the
    # checkpoint holds (2 KiB), which the blocks share: the table charges the mask to each block
    # (2 KiB less freed than measured) or, in some test orders, to none (2 KiB more: an open
    # question); either way within 20%
    assert 0.8 * measured <= freed <= 1.2 * measured, (freed, measured)


def test_selective_layer_without_attention_is_a_clear_error(tmp_path):
    with pytest.raises(LoweringError, match="has no attention core"):
        compile_plan(manual_plan(SPEC, {"layers": 2}, mbs=MBS, seq_len=SEQ, selective=(0,)), str(tmp_path / "c"))
