"""HF architectures whose export is not a plain stack of identical ATen blocks compile and run
like the HF model: PhiMoE (a router that computes under ``torch.no_grad()``, which export keeps as
a nested graph, and a custom ``autograd.Function`` whose backward export drops) and Jamba
(a ``ModuleList`` mixing Mamba and attention layers, dense and MoE feed-forwards).

Each model is a directory holding only a tiny ``config.json`` (``hf:PATH``) built from its
transformers config class; its plan (two pipeline stages, recompute in one) is compiled and the
stages are chained by hand in this process (``tests.helpers.run_stages_in_process``): the loss and
every gradient equal the HF model's on the same batch and random stream.
"""

from __future__ import annotations

import pytest
import torch

from planner.commands.compile import compile_plan
from planner.commands.train import original_state
from planner.frontend.model_analysis import build_layer_table
from planner.frontend.zoo import ModelSizes, build_model
from runtime.stages.compiled_stages import read_manifest
from tests.helpers import make_plan, run_stages_in_process

tf = pytest.importorskip("transformers")

SEQ, VOCAB = 16, 64
COMMON = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=64,
)
CONFIGS = {
    "phimoe": lambda: tf.PhimoeConfig(num_local_experts=4, num_experts_per_tok=2, **COMMON),
    "jamba": lambda: tf.JambaConfig(
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=8,
        mamba_dt_rank=8,
        use_mamba_kernels=False,
        **COMMON,
    ),
    "mixtral": lambda: tf.MixtralConfig(
        num_local_experts=4, num_experts_per_tok=2, **{**COMMON, "num_hidden_layers": 4}
    ),
    # Mamba, Mamba, attention, all dense: the shallow trace's first two blocks are alike
    "jamba3": lambda: tf.JambaConfig(
        attn_layer_period=3,
        attn_layer_offset=2,
        num_experts=1,
        mamba_d_state=8,
        mamba_dt_rank=8,
        use_mamba_kernels=False,
        **{**COMMON, "num_hidden_layers": 3},
    ),
}


def model_dir(root, arch: str) -> str:
    """``hf:PATH`` of a directory holding only the tiny ``config.json`` of ``arch``."""
    path = root / arch
    if not path.exists():
        CONFIGS[arch]().save_pretrained(str(path))
    return f"hf:{path}"


@pytest.mark.parametrize("arch", ["phimoe", "jamba"])
def test_compiled_stages_match_the_hf_model(tmp_path, arch):
    spec, sizes = model_dir(tmp_path, arch), {"layers": 2, "seq_len": SEQ}
    plan = make_plan(spec, sizes, pp=2, checkpoint=(1,))
    compile_plan(plan, str(tmp_path / "c"))
    man = read_manifest(str(tmp_path / "c"))
    names = [name for stage in man["stages"] for name in stage["layer_names"]]
    assert names[1:3] == ["inner.model.layers.0", "inner.model.layers.1"]  # no block merged into the head
    assert "layers" not in names[-1]
    model = build_model(spec, ModelSizes(**sizes), seed=0).model
    ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    x, y = ids[:, :-1], ids[:, 1:]
    torch.manual_seed(7)  # PhiMoE samples its experts while training: one random stream for both
    ref = model(x, y)
    ref.backward()
    state = original_state(spec, sizes, SEQ, 0)
    torch.manual_seed(7)
    loss, mods = run_stages_in_process(str(tmp_path / "c"), man, state, {"input_ids": x, "labels": y})
    torch.testing.assert_close(loss, ref)
    grads = dict(model.named_parameters(remove_duplicate=False))
    for module, stage in zip(mods, man["stages"]):
        for attr, param in module.named_parameters():
            fqn = stage["params"][attr]["fqn"]
            torch.testing.assert_close(param.grad, grads[fqn].grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{fqn}: {m}")


def test_a_hybrid_whose_first_blocks_match_is_traced_in_full(tmp_path):
    """The planner traces a 2-block copy of a deep model and repeats its block; a hybrid whose
    first two blocks happen to match (Jamba: Mamba, Mamba, then attention) must not have its
    attention block priced as a third Mamba block."""
    table = build_layer_table(model_dir(tmp_path, "jamba3"), batch=1, seq_len=SEQ, dtype="fp32")
    rows = table.layers[1:-1]
    assert len(rows) == 3
    assert rows[0].signature == rows[1].signature != rows[2].signature


def test_blocks_that_share_size_arithmetic_are_alike(tmp_path):
    """Export computes a size expression once, in the first block that needs it, and later blocks
    read it there (Mixtral's expert dispatch: ``b * s`` and the like). Blocks are compared without
    that arithmetic: Mixtral's four blocks are one block (the block-count ILP applies), and the
    shallow trace stands (every block was traced again, 19 s of export for Mixtral 8x7B)."""
    table = build_layer_table(model_dir(tmp_path, "mixtral"), batch=1, seq_len=SEQ, dtype="fp32")
    rows = table.layers[1:-1]
    assert len(rows) == 4 and len({row.signature for row in rows}) == 1
