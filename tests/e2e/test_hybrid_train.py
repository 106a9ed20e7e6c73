"""Hybrid and sampled-routing HF architectures plan with the real search and train on 2 gloo ranks.

Jamba (Mamba and attention layers, a dense and an MoE feed-forward: blocks that are not all
alike) is planned with every block in its layer table and trains under data parallelism, a
2-stage pipeline and 2-way tensor parallelism like one process (per-step losses and final
parameters, ``tests.helpers.reference_run``). PhiMoE (a ``no_grad`` router that samples its
experts while training) trains under data parallelism and a pipeline; its sampled routing draws
other random numbers under each layout, so its losses are only close to one process's.

The models are directories holding only a tiny ``config.json`` (``tests.codegen.test_hybrid_archs``).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from planner.frontend.model_analysis import build_layer_table
from tests.codegen.test_hybrid_archs import model_dir
from tests.e2e.batched import Run, options, run_result, train_together
from tests.e2e.test_train_matrix import EPS
from tests.helpers import reference_run, two_rank_plan

pytest.importorskip("transformers")

SEQ, BATCH, STEPS = 16, 4, 2
CASES = {
    "jamba-dp2": ("jamba", dict(dp=2)),
    "jamba-pp2": ("jamba", dict(pp=2)),
    "jamba-tp2": ("jamba", dict(tp=2)),
    "phimoe-dp2": ("phimoe", dict(dp=2)),
    "phimoe-pp2": ("phimoe", dict(pp=2)),
}


@functools.lru_cache(maxsize=None)
def _table(spec: str):
    return build_layer_table(spec, batch=1, seq_len=SEQ, dtype="fp32")


def _plan(spec: str, **pins):
    return two_rank_plan(spec, _table(spec), SEQ, BATCH, **pins)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("hybrid")
    runs = {}
    for name, (arch, pins) in CASES.items():
        plan = _plan(model_dir(root, arch), **pins)
        folder = str(root / name)
        runs[name] = Run(name, plan, folder, options(folder, STEPS, eps=EPS))
    train_together(list(runs.values()))
    return runs


def test_jamba_plans_every_block(trained):
    plan = trained["jamba-dp2"].plan
    assert plan.model.layers == 2
    assert plan.model.layer_names[1:3] == ["model.layers.0", "model.layers.1"]
    assert "layers" not in plan.model.layer_names[-1]  # no block merged into the head row


@pytest.mark.parametrize("case", ["jamba-dp2", "jamba-pp2", "jamba-tp2"])
def test_jamba_trains_like_one_process(trained, case):
    run = trained[case]
    losses, params = run_result(run.folder)
    ref_losses, ref_params = reference_run(run.plan, STEPS, eps=EPS)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert params and set(params) <= set(ref_params)
    for name, p in params.items():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("case", ["phimoe-dp2", "phimoe-pp2"])
def test_phimoe_trains(trained, case):
    run = trained[case]
    losses, params = run_result(run.folder)
    ref_losses, _ = reference_run(run.plan, STEPS, eps=EPS)
    assert len(losses) == STEPS and params
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-2, atol=0)
    assert os.path.exists(os.path.join(run.compiled, "manifest.json"))
