"""Any model, end to end: HF architectures handed over as a user would (``file.py:factory``, the
model computing its own loss) plan, compile and train under each strategy like one process.

Each architecture is traced once (its layer table); each case pins the strategy, plans it with
the real search, trains it with ``planner train --nproc N`` on gloo and compares the per-step
losses and the final parameters with a single process running plain torch AdamW on the same
global batch, fed by the same roles (``runtime.training.data.model_inputs``).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from cost_models.hardware import load_hardware
from planner.frontend.model_analysis import build_layer_table
from planner.search.request import PlanRequest
from planner.search.solve import solve
from tests.e2e.test_train_matrix import EPS, run_case
from tests.helpers import TESTS, USER_MODELS, reference_run

pytest.importorskip("transformers")

HF_ARCHS = os.path.join(TESTS, "fixtures", "hf_archs.py")
SEQ, BATCH, STEPS = 8, 4, 3
ARCHS = ["llama", "qwen2", "gemma", "gpt_neox", "opt", "bert"]
"""GQA, qkv bias + tied embeddings, a head size that is not hidden/heads, fused qkv with a
parallel residual, learned positions, a masked LM with its own labels input."""
CASES = {"dp2-zero3": dict(dp=2, zero_stage=3), "tp2": dict(tp=2), "pp2": dict(pp=2)}
TP_PP = ["llama", "gpt_neox"]


@functools.lru_cache(maxsize=None)
def _table(spec: str):
    return build_layer_table(spec, batch=1, seq_len=SEQ, dtype="fp32")


def _plan(arch: str, spec: str | None = None, **pins):
    n = pins.get("dp", 1) * pins.get("tp", 1) * pins.get("pp", 1)
    spec = spec or f"{HF_ARCHS}:{arch}"
    req = PlanRequest(
        spec=spec,
        gpus=n,
        gpus_per_node=n,
        hardware="cpu",
        global_batch=BATCH,
        seq_len=SEQ,
        dtype="fp32",
        micro_batch=1 if pins.get("pp", 1) > 1 else None,
        **{"dp": 1, "tp": 1, "pp": 1, **pins},
    )
    return solve(req, _table(spec), load_hardware("cpu", gpus_per_node=n)).plan


def _check(tmp_path, plan):
    losses, params = run_case(tmp_path, plan, steps=STEPS)
    ref_losses, ref_params = reference_run(plan, STEPS, eps=EPS)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert set(params) <= set(ref_params)
    for name, p in params.items():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("arch", ARCHS)
def test_hf_architecture_trains_like_one_process(tmp_path, arch, case):
    _check(tmp_path, _plan(arch, **CASES[case]))


@pytest.mark.parametrize("arch", TP_PP)
def test_hf_architecture_tp2_pp2(tmp_path, arch):
    _check(tmp_path, _plan(arch, tp=2, pp=2))


def test_user_model_fed_mask_positions_and_labels(tmp_path):
    """Four inputs: token ids, an all-ones mask, positions and labels the model shifts itself."""
    plan = _plan("", spec=f"{USER_MODELS}:masked", dp=2)
    assert [x["role"] for x in plan.model.inputs] == ["tokens", "ones", "positions", "labels"]
    _check(tmp_path, plan)


def test_hf_architecture_trains_in_bf16(tmp_path):
    """The default dtype: a factory builds its model in fp32, the plan compiles and trains it in bf16
    (the compiled stages, the data and the weights all follow the plan's dtype)."""
    n = 2
    req = PlanRequest(
        spec=f"{HF_ARCHS}:llama",
        gpus=n,
        gpus_per_node=n,
        hardware="cpu",
        global_batch=BATCH,
        seq_len=SEQ,
        dtype="bf16",
        dp=1,
        tp=1,
        pp=2,
        micro_batch=1,
    )
    plan = solve(req, _table(f"{HF_ARCHS}:llama"), load_hardware("cpu", gpus_per_node=n)).plan
    losses, _ = run_case(tmp_path, plan, steps=STEPS)
    ref, _ = reference_run(plan, STEPS, eps=EPS)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=2e-2, atol=0)


def _hf_dir(tmp_path, arch: str) -> str:
    """A model directory (``hf:PATH``) holding only a tiny ``config.json`` of ``arch``."""
    import transformers as tf

    common = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=64,
    )
    cfg = {
        "mixtral": lambda: tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common),
        "gemma2": lambda: tf.Gemma2Config(head_dim=8, **common),
        "bloom": lambda: tf.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=96),
        "falcon": lambda: tf.FalconConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_kv_heads=2,
            new_decoder_architecture=True,
            vocab_size=96,
        ),
    }[arch]()
    path = tmp_path / arch
    cfg.save_pretrained(path)
    return f"hf:{path}"


@pytest.mark.parametrize(
    "arch, pins",
    [
        ("mixtral", dict(pp=2)),
        ("mixtral", dict(tp=2)),
        ("gemma2", dict(pp=2)),
        ("bloom", dict(pp=2)),
        ("falcon", dict(pp=2)),
    ],
)
def test_hf_directory_moe_and_eager_attention_train_like_one_process(tmp_path, arch, pins):
    """A mixture of experts traced on meta (transformers' integer ``histc`` and its own grouped
    product, which compiled code runs as ``runtime.portable``) and architectures without SDPA
    (Gemma2: soft-capped scores; Bloom: ALiBi, whose ``baddbmm`` the cost replay decomposes), built
    with eager attention, and Falcon (its attention indexes with a list, ``qkv[..., [-2]]``, whose
    index tensor the trace keeps on the CPU so that compiled code can rebuild it), train under a
    2-stage pipeline like one process with the HF model; the experts under tp2 too (they stay
    replicated, the attention splits)."""
    spec = _hf_dir(tmp_path, arch)
    req = PlanRequest(
        spec=spec,
        gpus=2,
        gpus_per_node=2,
        hardware="cpu",
        global_batch=BATCH,
        seq_len=SEQ,
        dtype="fp32",
        micro_batch=1,
        **{"dp": 1, "tp": 1, "pp": 1, **pins},
    )
    plan = solve(
        req, build_layer_table(spec, batch=1, seq_len=SEQ, dtype="fp32"), load_hardware("cpu", gpus_per_node=2)
    ).plan
    _check(tmp_path, plan)
