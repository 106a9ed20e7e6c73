"""Sequence parallelism trains like one process (fp32, gloo).

Each case compiles a plan with ``sequence_parallel: true``, trains it a few steps (the cases in
one spawn per world size, ``tests.e2e.batched``) and compares the per-step losses and the final parameters with one
process running plain torch AdamW on the same global batch (``tests.helpers.reference_run``): the
built-in GPT (learned position embeddings added to the sequence-sharded token embeddings, LayerNorm
weights and biases, row-parallel biases), an HF llama (GQA, rotary, RMSNorm, no biases), GPT at
tp 2 x pp 2 (the stages send ``S/t`` positions) and llama at tp 4, where SP covers only part of
the model; and GPT at tp 2 with ``--overlap off`` (the collectives waited in line, not beside the
matmuls: the same numbers).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.e2e.batched import Run, options, run_result, train_together
from tests.e2e.test_train_matrix import EPS
from tests.helpers import TINY_GPT, TINY_LLAMA, make_plan, reference_run

STEPS = 3
CASES = {
    "gpt-tp2": ("gpt", TINY_GPT, dict(tp=2)),
    "llama-tp2": ("hf:llama", TINY_LLAMA, dict(tp=2)),
    "gpt-tp2xpp2": ("gpt", TINY_GPT, dict(tp=2, pp=2)),
    # 2 key/value heads over 4 ranks: their projections stay replicated, and attention cannot read
    # sequence shards, so the first layers keep their all-reduces (TPDecisions.sp_replicated) and
    # SP starts at the last attention's output projection: a replicated residual meets sequence
    # shards there and each rank keeps its positions of it
    "llama-tp4-partial": ("hf:llama", TINY_LLAMA, dict(tp=4)),
    "gpt-tp2-overlap-off": ("gpt", TINY_GPT, dict(tp=2)),
}


@pytest.fixture(scope="module")
def trained(request, tmp_path_factory) -> dict[str, Run]:
    """Train the selected cases: one spawn per world size (``tests.e2e.batched``)."""
    root = tmp_path_factory.mktemp("sequence_parallel")
    wanted = {item.callspec.params["case"] for item in request.session.items if item.module is request.module}
    runs = {}
    for name, (spec, sizes, degrees) in CASES.items():
        if name in wanted:
            plan = dataclasses.replace(make_plan(spec, sizes, **degrees), sequence_parallel=True)
            folder = str(root / name)
            overlap = "off" if name.endswith("overlap-off") else "on"
            runs[name] = Run(name, plan, folder, options(folder, STEPS, eps=EPS, overlap=overlap))
    train_together(list(runs.values()))
    return runs


@pytest.mark.dist
@pytest.mark.parametrize("case", list(CASES))
def test_sequence_parallel_trains_like_one_process(trained, case):
    run = trained[case]
    losses, params = run_result(run.folder)
    code = (Path(run.compiled) / "stage_0.py").read_text()
    assert "sequence_dim = 1" in code and "reduce_scatter_seq(" in code  # SP is really on
    ref_losses, ref_params = reference_run(run.plan, STEPS, eps=EPS)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert set(params) == set(ref_params)
    for name, p in ref_params.items():
        torch.testing.assert_close(params[name], p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
