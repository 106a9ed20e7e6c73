"""The runtime's correctness matrix: every plan kind trains like one process (fp32).

Each case compiles a plan as `planner train` does and trains it on gloo (the matrix's cases in one
spawn per world size, ``tests.e2e.batched``), and compares the per-step losses (metrics JSONL) and
the final parameters (the consolidated checkpoint) with a single process running plain torch AdamW
on the same global batch. `planner train --nproc N` itself trains the mixed-precision cases.
"""

import pytest
import torch

from planner.cli import main
from tests.e2e.batched import Run, options, run_result, train_together
from tests.helpers import TINY_GPT, make_plan, read_metrics, reference_run, write_plan

STEPS = 10
# Adam divides by sqrt(v) + eps: with eps = 1e-8 an element whose gradient is ~1e-8 turns a
# last-bit difference in a reduction's summation order (tp, dp) into a 1e-6 weight difference.
# eps = 1e-6 keeps the comparison about the runtime, not about that amplification.
EPS = 1e-6
CASES = {
    "dp2-zero0": dict(dp=2, zero=0),
    "dp2-zero1": dict(dp=2, zero=1),
    "dp2-zero2": dict(dp=2, zero=2),
    "dp2-zero3": dict(dp=2, zero=3),
    "dp2-zero3-ckpt": dict(dp=2, zero=3, checkpoint=(1, 2)),
    "pp2": dict(pp=2),
    "pp2-ckpt": dict(pp=2, checkpoint=(1,)),
    "dp2xpp2-zero1": dict(dp=2, pp=2, zero=1),
    "tp2": dict(tp=2),
    "tp2-ckpt": dict(tp=2, checkpoint=(0, 1, 2, 3)),
    "tp2-selective": dict(tp=2, selective=(1, 2)),
    "tp2-sp-selective": dict(tp=2, sequence_parallel=True, selective=(1, 2)),
    "pp2-selective-ckpt": dict(pp=2, checkpoint=(1,), selective=(2,)),
    # a stage per node: activations and gradients cross as tp slices, gathered (runtime.pipeline.transport)
    "tp2xpp2": dict(tp=2, pp=2, gpus_per_node=2),
    "dp2xtp2-zero3": dict(dp=2, tp=2, zero=3),
}


@pytest.fixture(scope="module")
def trained(request, tmp_path_factory) -> dict[str, Run]:
    """Train the selected cases of the matrix: one spawn per world size (``tests.e2e.batched``)."""
    root = tmp_path_factory.mktemp("train_matrix")
    wanted = {
        item.callspec.params["case"]
        for item in request.session.items
        if item.originalname == "test_plan_trains_like_one_process"
    }
    runs = {}
    for name in CASES:
        if name in wanted:
            folder = str(root / name)
            runs[name] = Run(name, make_plan("gpt", TINY_GPT, **CASES[name]), folder, options(folder, STEPS, eps=EPS))
    train_together(list(runs.values()))
    return runs


@pytest.mark.dist
@pytest.mark.parametrize("case", list(CASES))
def test_plan_trains_like_one_process(trained, case):
    run = trained[case]
    losses, params = run_result(run.folder)
    ref_losses, ref_params = reference_run(run.plan, STEPS, eps=EPS)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert set(params) == set(ref_params)
    for name, p in ref_params.items():
        torch.testing.assert_close(params[name], p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.dist
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_precision_trains_close_to_fp32(tmp_path, dtype):
    plan = make_plan("gpt", TINY_GPT, dp=2, zero=1, dtype=dtype)
    path = write_plan(tmp_path / "plan.json", plan)
    metrics = tmp_path / "m.jsonl"
    assert (
        main(
            [
                "train",
                path,
                "--nproc",
                "2",
                "--steps",
                "4",
                "--metrics",
                str(metrics),
                "--compiled",
                str(tmp_path / "c"),
                "--no-memory-tracking",
                "--timeout",
                "60",
            ]
        )
        == 0
    )
    rows = read_metrics(metrics)
    ref, _ = reference_run(plan, 4)
    torch.testing.assert_close(torch.tensor([r["loss"] for r in rows]), torch.tensor(ref), rtol=1e-2, atol=0)
    assert all(("loss_scale" in r) == (dtype == "fp16") for r in rows)
    # time blocked in collectives (at least the gradient-norm all-reduce), part of the step
    assert all(0 < r["comm_wait_s"] < r["step_time_s"] for r in rows), rows
    if dtype == "fp16":
        assert rows[0]["loss_scale"] == 2.0**16
