"""Any model, end to end: HF architectures handed over as a user would (``file.py:factory``, the
model computing its own loss) plan, compile and train under each strategy like one process.

Each architecture is traced once (its layer table); each case pins the strategy, plans it with
the real search and is compiled as ``planner train`` compiles it; the selected cases train on gloo
in one spawn per world size (``tests.e2e.batched``); each test compares its case's per-step
losses and final parameters with a single process running plain torch AdamW on the same global
batch, fed by the same roles (``runtime.training.data.model_inputs``).
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
from tests.e2e.batched import Run, options, run_result, train_together
from tests.e2e.test_train_matrix import EPS
from tests.helpers import TESTS, USER_MODELS, reference_run, two_rank_plan

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


BLOCK_SPARSE = os.path.join(TESTS, "fixtures", "block_sparse_lm.py") + ":factory"
BLOCK_SPARSE_SEQ = 256
"""Eight of the example's 32-position blocks: local, global and skipped blocks all occur."""


def _block_sparse_plan(**pins):
    """The block-sparse example (runtime.sparse_attention) on 2 ranks at 128 positions."""
    req = PlanRequest(
        spec=BLOCK_SPARSE,
        gpus=2,
        gpus_per_node=2,
        hardware="cpu",
        global_batch=BATCH,
        seq_len=BLOCK_SPARSE_SEQ,
        dtype="fp32",
        micro_batch=1,
        **{"dp": 1, "tp": 1, "pp": 1, **pins},
    )
    table = build_layer_table(BLOCK_SPARSE, batch=1, seq_len=BLOCK_SPARSE_SEQ, dtype="fp32")
    return solve(req, table, load_hardware("cpu", gpus_per_node=2)).plan


BLOCK_SPARSE_CASES = {"dp2-zero3": dict(dp=2, zero_stage=3), "tp2": dict(tp=2), "pp2": dict(pp=2)}


def _hf_plan(spec: str, **pins):
    """A tiny model directory's plan on 2 ranks (micro-batch 1)."""
    return two_rank_plan(spec, _table(spec), SEQ, BATCH, **pins)


def _bf16_plan():
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
    return solve(req, _table(f"{HF_ARCHS}:llama"), load_hardware("cpu", gpus_per_node=n)).plan


DIR_CASES = [
    ("mixtral", dict(pp=2)),
    ("mixtral", dict(tp=2)),
    ("gemma2", dict(pp=2)),
    ("bloom", dict(pp=2)),
    ("falcon", dict(pp=2)),
]


def _all_cases(hf_root) -> dict:
    """Every case of this file: name -> a function making its plan (planned only when selected)."""
    cases = {f"{arch}-{case}": functools.partial(_plan, arch, **CASES[case]) for arch in ARCHS for case in CASES}
    cases.update({f"{arch}-tp2xpp2": functools.partial(_plan, arch, tp=2, pp=2) for arch in TP_PP})
    cases["user-masked-dp2"] = functools.partial(_plan, "", spec=f"{USER_MODELS}:masked", dp=2)
    cases["llama-bf16-pp2"] = _bf16_plan
    for case, pins in BLOCK_SPARSE_CASES.items():
        cases[f"block-sparse-{case}"] = functools.partial(_block_sparse_plan, **pins)
    for index, (arch, pins) in enumerate(DIR_CASES):
        cases[f"dir-{arch}-{index}"] = lambda arch=arch, pins=pins: _hf_plan(_hf_dir(hf_root, arch), **pins)
    return cases


def _case_of(item) -> str:
    """The case a collected test of this file checks."""
    params = item.callspec.params if hasattr(item, "callspec") else {}
    return {
        "test_hf_architecture_trains_like_one_process": lambda: f"{params.get('arch')}-{params.get('case')}",
        "test_hf_architecture_tp2_pp2": lambda: f"{params.get('arch')}-tp2xpp2",
        "test_user_model_fed_mask_positions_and_labels": lambda: "user-masked-dp2",
        "test_hf_architecture_trains_in_bf16": lambda: "llama-bf16-pp2",
        "test_block_sparse_model_trains_like_one_process": lambda: f"block-sparse-{params.get('case')}",
        "test_hf_directory_moe_and_eager_attention_train_like_one_process": lambda: (
            f"dir-{params.get('arch')}-{params.get('index')}"
        ),
    }[item.originalname]()


@pytest.fixture(scope="module")
def trained(request, tmp_path_factory) -> dict[str, Run]:
    """Plan the selected cases, then train them all: one spawn per world size."""
    root = tmp_path_factory.mktemp("any_model")
    wanted = {_case_of(item) for item in request.session.items if item.module is request.module}
    runs = {}
    for name, make_plan in _all_cases(root / "hf").items():
        if name in wanted:
            folder = str(root / name)
            runs[name] = Run(name, make_plan(), folder, options(folder, STEPS, eps=EPS))
    train_together(list(runs.values()))
    return runs


def _check(run: Run):
    losses, params = run_result(run.folder)
    ref_losses, ref_params = reference_run(run.plan, STEPS, eps=EPS)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert set(params) <= set(ref_params)
    for name, p in params.items():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("arch", ARCHS)
def test_hf_architecture_trains_like_one_process(trained, arch, case):
    _check(trained[f"{arch}-{case}"])


@pytest.mark.parametrize("arch", TP_PP)
def test_hf_architecture_tp2_pp2(trained, arch):
    _check(trained[f"{arch}-tp2xpp2"])


def test_user_model_fed_mask_positions_and_labels(trained):
    """Four inputs: token ids, an all-ones mask, positions and labels the model shifts itself."""
    run = trained["user-masked-dp2"]
    assert [x["role"] for x in run.plan.model.inputs] == ["tokens", "ones", "positions", "labels"]
    _check(run)


def test_hf_architecture_trains_in_bf16(trained):
    """The default dtype: a factory builds its model in fp32, the plan compiles and trains it in bf16
    (the compiled stages, the data and the weights all follow the plan's dtype)."""
    run = trained["llama-bf16-pp2"]
    losses, _ = run_result(run.folder)
    ref, _ = reference_run(run.plan, STEPS, eps=EPS)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=2e-2, atol=0)


@pytest.mark.parametrize("case", list(BLOCK_SPARSE_CASES))
def test_block_sparse_model_trains_like_one_process(trained, case):
    """A fixed block-sparse layout (runtime.sparse_attention's operator in the compiled stages)
    under ZeRO-3, tensor parallelism (its heads split) and a pipeline, priced at its density."""
    run = trained[f"block-sparse-{case}"]
    attention = run.plan.model.attention
    assert attention["mask"] == "block-sparse" and attention["priced"]
    assert attention["layout"] == {"block": 32, "local_blocks": 4, "global_blocks": 1}
    # 8 blocks of 32: the diagonal blocks (8 x 528 pairs), the local blocks below them (block rows
    # 0..7 see 0, 1, 2, 3, 3, 3, 3, 3) and the global block 0 for rows 4..7 (4 more)
    assert attention["density"] == pytest.approx((8 * 528 + 22 * 32 * 32) / 256**2)
    _check(run)


def _hf_dir(root, arch: str) -> str:
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
    path = root / arch
    cfg.save_pretrained(path)
    return f"hf:{path}"


@pytest.mark.parametrize("index, arch", [(index, arch) for index, (arch, _) in enumerate(DIR_CASES)])
def test_hf_directory_moe_and_eager_attention_train_like_one_process(trained, index, arch):
    """A mixture of experts traced on meta (transformers' integer ``histc`` and its own grouped
    product, which compiled code runs as ``runtime.portable``) and architectures without SDPA
    (Gemma2: soft-capped scores; Bloom: ALiBi, whose ``baddbmm`` the cost replay decomposes), built
    with eager attention, and Falcon (its attention indexes with a list, ``qkv[..., [-2]]``, whose
    index tensor the trace keeps on the CPU so that compiled code can rebuild it), train under a
    2-stage pipeline like one process with the HF model; the experts under tp2 too (they stay
    replicated, the attention splits)."""
    _check(trained[f"dir-{arch}-{index}"])
