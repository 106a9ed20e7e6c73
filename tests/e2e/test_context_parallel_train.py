"""Context parallelism end to end: plans with ``context_parallel`` compile (attention, positions and
the loss rewritten by ``codegen.context_rewrite``) and train on gloo ranks like one process.

The matrix: a tiny HF Llama (grouped-query attention, rotary positions) and a tiny Qwen2 whose first
layer has a sliding window of 48 over sequences of 256 (the window crosses the chunk edges), at cp 2
with each method, and at 1024 and 2048 positions; cp 2 with tp 2 (the built-in ``hf:llama``, its labels pre-shifted by the data and
its loss vocab-parallel), with pp 2 and with dp 2 under ZeRO-3; and the block-sparse example
(``tests/fixtures/block_sparse_lm.py``, its loss shifting the logits) at cp 2. Every case compiles in
the test process and trains in one spawn per world size (``tests.e2e.batched``); each compares its
per-step losses and final weights with one process (fp32, rtol 1e-5).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.cp_plans import cp_plan
from tests.e2e.batched import Run, options, run_result, train_together
from tests.e2e.test_train_matrix import EPS
from tests.helpers import TESTS, reference_run

pytest.importorskip("transformers")

CP_MODELS = os.path.join(TESTS, "fixtures", "cp_models.py")
BLOCK_SPARSE = os.path.join(TESTS, "fixtures", "block_sparse_lm.py") + ":factory"
SEQ, STEPS = 256, 2
METHODS = ("ring", "all-gather", "ulysses")
HF_SIZES = dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=256)
WEIGHT_ATOL = 5e-6
"""Context parallelism sums attention partials and each rank's share of the loss across ranks,
another fp32 summation order than one process; Adam turns a last-bit difference in a gradient
element near zero (|g| ~ eps) into an update difference of up to a few 1e-6 (seen: 1 element in
2048 at 1.2e-6, rtol 5e-4, where the weight itself is ~2e-3). Losses keep atol 1e-6."""

CASES = {
    **{f"llama-{m}": dict(spec=f"{CP_MODELS}:llama", method=m, global_batch=2) for m in METHODS},
    **{f"qwen2-sliding-{m}": dict(spec=f"{CP_MODELS}:qwen2_sliding", method=m, global_batch=2) for m in METHODS},
    # the built-in HF builder: labels fed pre-shifted by the data, the vocab-parallel loss under tp
    "hf-llama-ring-tp2": dict(spec="hf:llama", sizes=HF_SIZES, method="ring", global_batch=2, tp=2),
    "qwen2-sliding-all-gather-pp2": dict(spec=f"{CP_MODELS}:qwen2_sliding", method="all-gather", global_batch=4, pp=2),
    "llama-ulysses-dp2-zero3": dict(spec=f"{CP_MODELS}:llama", method="ulysses", global_batch=4, dp=2, zero_stage=3),
    "block-sparse-ring": dict(spec=BLOCK_SPARSE, method="ring", global_batch=2),
    # the lengths: chunks of 256 and 512 positions, the window well inside a chunk
    "llama-ring-seq1024": dict(spec=f"{CP_MODELS}:llama", method="ring", global_batch=1, seq=1024),
    "qwen2-sliding-ulysses-seq2048": dict(
        spec=f"{CP_MODELS}:qwen2_sliding", method="ulysses", global_batch=1, seq=2048
    ),
}


@pytest.fixture(scope="module")
def trained(request, tmp_path_factory) -> dict[str, Run]:
    """Plan and compile the selected cases, then train them: one spawn per world size."""
    root = tmp_path_factory.mktemp("cp_train")
    wanted = {item.callspec.params["case"] for item in request.session.items if item.module is request.module}
    runs = {}
    for name, settings in CASES.items():
        if name in wanted:
            folder = str(root / name)
            pins = {key: value for key, value in settings.items() if key != "seq"}
            plan = cp_plan(cp=2, seq_len=settings.get("seq", SEQ), **pins)
            runs[name] = Run(name, plan, folder, options(folder, STEPS, eps=EPS))
    train_together(list(runs.values()))
    return runs


@pytest.mark.parametrize("case", list(CASES))
def test_context_parallel_trains_like_one_process(trained, case):
    run = trained[case]
    assert run.plan.cp == 2 and run.plan.context_parallel["method"] == CASES[case]["method"]
    losses, params = run_result(run.folder)
    ref_losses, ref_params = reference_run(run.plan, STEPS, eps=EPS)
    assert len(losses) == STEPS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert set(params) <= set(ref_params) and params
    for name, p in params.items():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=WEIGHT_ATOL, msg=lambda m: f"{name}: {m}")
