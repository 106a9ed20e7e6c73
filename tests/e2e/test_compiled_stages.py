"""Compiled stages (plan.json ``compile: true``) train like the same plan uncompiled (fp32, gloo).

Each compiled run is compared with the plan's uncompiled training as one process
(``tests.helpers.reference_run``, which ``tests/e2e/test_train_matrix.py`` shows the uncompiled
multi-process runs of these plans match to the same tolerance), by losses and final parameters:

- inductor, ZeRO-3 with recompute over two data-parallel ranks. Inductor fuses and reorders
  float operations, so the results agree to ``RTOL`` (1e-5, the matrix's tolerance for a change
  of summation order, which is what a fused reduction is), not bit for bit;
- tensor x pipeline parallelism (tp2 x pp2, recompute) with the ``aot_eager`` backend
  (``PLANNER_COMPILE_BACKEND``): the same Dynamo capture, graph breaks at the tensor-parallel
  collectives and autograd split as inductor, without half a minute of C++ code generation for
  the tensor-parallel graphs; with memory tracking, so its first steps run eagerly under the
  tracker and the others compiled.

The runs share one inductor cache (``TORCHINDUCTOR_CACHE_DIR``, a temporary folder).
"""

import dataclasses

import pytest
import torch

from planner.cli import main
from runtime.checkpointing.checkpoint_io import list_checkpoints, load_model_tensors
from runtime.contract.environment import COMPILE_BACKEND
from tests.helpers import TINY_GPT, make_plan, read_metrics, reference_run, write_plan

STEPS = 4
EPS = 1e-6  # as tests/e2e/test_train_matrix.py: Adam's eps would amplify last-bit differences
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory):
    """One inductor cache for these runs (their processes inherit the environment)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
        yield


def _train(d, plan, track_memory=False):
    path = write_plan(d / "plan.json", plan)
    metrics, ck = d / "m.jsonl", d / "ck"
    rc = main(
        [
            "train",
            path,
            "--nproc",
            str(plan.dp * plan.tp * plan.pp),
            "--steps",
            str(STEPS),
            "--metrics",
            str(metrics),
            "--checkpoint-dir",
            str(ck),
            "--save-every",
            str(STEPS),
            "--compiled",
            str(d / "compiled"),
            "--timeout",
            "120",
            "--adam-eps",
            str(EPS),
        ]
        + ([] if track_memory else ["--no-memory-tracking"])
    )
    assert rc == 0
    ((_, last),) = list_checkpoints(str(ck))
    return [m["loss"] for m in read_metrics(metrics)], load_model_tensors(last)


def _assert_same(run, ref):
    (losses, params), (ref_losses, ref_params) = run, ref
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    assert set(params) == set(ref_params)
    for name, p in ref_params.items():
        torch.testing.assert_close(params[name], p, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.dist
def test_inductor_zero3_recompute_matches_uncompiled(tmp_path, inductor_cache, capfd):
    plan = make_plan("gpt", TINY_GPT, dp=2, zero=3, checkpoint=(1, 2))
    run = _train(tmp_path, dataclasses.replace(plan, compile=True))
    err = capfd.readouterr().err
    assert "compiled stage 0: 4 layers, 3 compiled classes (Pre, Block, Post; inductor)" in err
    assert "arning" not in err, err  # no stray warnings from the compiler
    _assert_same(run, reference_run(plan, STEPS, eps=EPS))


@pytest.mark.dist
def test_compiled_tp_pp_recompute_matches_uncompiled(tmp_path, inductor_cache, monkeypatch):
    monkeypatch.setenv(COMPILE_BACKEND.name, "aot_eager")
    plan = make_plan("gpt", TINY_GPT, tp=2, pp=2, checkpoint=(1, 2))
    # memory tracked in the first steps, which run eagerly; the rest compiled
    run = _train(tmp_path, dataclasses.replace(plan, compile=True), track_memory=True)
    _assert_same(run, reference_run(plan, STEPS, eps=EPS))
